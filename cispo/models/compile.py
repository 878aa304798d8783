"""A compiled decoder for the trainer's passes (``model.compile``).

The trainer runs two kinds of pass over a batch: the no-grad ``logp_old`` pass and the K
update passes (forward + backward). Both go through the decoder body of the Hugging Face
model (``cispo.models.policy.decoder``) and then the chunked LM head (``cispo.objective.logprobs``). This module
wraps that body in ``torch.compile`` (inductor) with dynamic shapes, so the varying rows and
lengths of length-sorted micro-batches reuse one graph per grad mode instead of recompiling,
and points inductor's on-disk caches at the project's cache folder, so a later run with the
same model shape reads the compiled kernels instead of building them again (it still traces
the model: a few seconds instead of tens).

What is compiled, and what is not:

* the decoder only; the LM head and the objective stay eager (the head is a custom autograd
  function that walks over token chunks; on the built-in models' 17-token vocabulary it is a
  negligible share of the time);
* the trainer's passes and, separately, the sampler's decode step: the layer stack of
  ``cispo.rollout.static_cache`` (one new token per row through every layer against the static
  KV cache; :class:`CompiledLayerStack`), with attention in plain matmuls that inductor fuses
  (SDPA's CPU kernel is an opaque call). The prefill, the head and the sampling itself stay
  eager, and so do the reference model and models the static loop does not support.

The compiled body computes the same function as the eager one; inductor may fuse and reorder
floating-point operations, so in float32 the log-probs differ by rounding (tests/test_compile.py
bounds it) and in float64 by ~1e-16; a sampled token can then differ where two tokens' draws
tie within rounding. Dropout (``model.dropout=true``) draws different random numbers when
compiled.

Whether to compile (``model.compile``): ``on``, ``off``, or ``auto`` = the rule of
:func:`compile_wanted`. A compile that fails (no C++ compiler, an operation inductor cannot
handle) falls back to the eager decoder with one warning: :func:`compiled_decoder` compiles at
set-up, on a two-row probe batch (forward and backward, with and without gradients), so the
failure shows there, and a later failure (a new shape) also turns the wrapper eager for good.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from cispo.config.train import ModelConfig

CompileMode = Literal["auto", "on", "off"]

# ``auto``: compile only where it was measured to pay off. Measured on the 2-core CPU this was
# written on, under load (docs/performance.md, "Compiled model step"), built-in default-size
# model: the compiled decoder saves ~0.1-0.15 s per RL step (update passes ~0.85x, logp_old
# ~0.85x the eager time) and costs ~10-15 s to compile with a warm cache, 75-100 s cold (the
# first run on a machine); so it is repaid after ~100 steps warm, ~700 cold, never in the
# default 60-step run. The compiled decode step (CompiledLayerStack, measured later) saves
# another ~0.2-0.4 s per default step for ~7-14 s more compile; the rule was not re-derived.
# No GPU was measured: auto stays eager there.
AUTO_MIN_STEPS = 1000
"""``model.compile=auto`` compiles on a CPU (with a C++ compiler) for runs of at least this many steps."""


def compile_wanted(mode: CompileMode, device: torch.device, steps: int = 0, sharded: bool = False) -> bool:
    """Whether to compile the trainer's decoder:

        on    -> True (unless ``sharded``: FSDP units are not compiled here; a config error
                 refuses ``model.compile=on`` with ``model.fsdp``)
        off   -> False
        auto  -> device is a CPU with a C++ compiler and steps >= AUTO_MIN_STEPS, not sharded
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"model.compile must be auto, on or off, got {mode!r}")
    if mode == "off" or sharded:
        return False
    if mode == "on":
        return True
    return device.type == "cpu" and steps >= AUTO_MIN_STEPS and has_cxx_compiler()


def train_body(model_cfg: ModelConfig, model: torch.nn.Module, device: torch.device, pad_id: int, steps: int = 0
               ) -> CompiledDecoder | None:
    """``Policy.train_body``: the compiled decoder where ``model_cfg.compile`` asks for one for a
    run of ``steps`` RL steps (:func:`compile_wanted`) and compiling works here, else None (the
    eager decoder)."""
    if not compile_wanted(model_cfg.compile, device, steps, sharded=model_cfg.fsdp):
        return None
    return compiled_decoder(model, pad_id)


def compile_cache_dir() -> str:
    """Where inductor keeps its compiled graphs (its FX-graph and AOT-autograd caches, on by
    default in torch >= 2.6): ``$TORCHINDUCTOR_CACHE_DIR`` when the user set it, else
    ``<cispo cache>/torch-compile`` (``cispo.models.builtin.cache_root``: ``$CISPO_CACHE``, else
    ``$XDG_CACHE_HOME/cispo``, else ``~/.cache/cispo``), which this sets in the environment.
    (torch writes its own default, a folder in /tmp, into the variable the first time it asks,
    e.g. while a model is built; that value counts as unset.)"""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current and current != _torch_default_cache_dir():
        return current
    from cispo.models.cache import cache_root

    path = str((cache_root() / "torch-compile").absolute())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def _torch_default_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch layout: take the variable as the user's
        return None
    return os.path.abspath(default_cache_dir())


def has_cxx_compiler() -> bool:
    """A C++ compiler inductor can call on a CPU (``$CXX`` or ``g++`` / ``c++`` / ``clang++``)."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c)


class CompiledDecoder:
    """The decoder under ``torch.compile(dynamic=True)``, falling back to ``eager`` (the same
    module, uncompiled) for good after the first compile error, with one warning.

    A micro-batch of one row runs eager: dynamic shapes still specialise a size of 1 (and a
    one-row view counts as contiguous whatever its row stride), so it would compile a graph
    of its own (~10-20 s on a CPU) for a call that costs milliseconds."""

    def __init__(self, eager: torch.nn.Module):
        self.eager = eager
        self.compiled = torch.compile(eager, dynamic=True)
        self.failed: str | None = None  # why it fell back to eager

    def __call__(self, **kwargs):
        if self.failed is None and kwargs["input_ids"].shape[0] >= 2:  # one row: eager (see below)
            # contiguous inputs: a view's row stride would be guarded (trimmed micro-batches and
            # the [:, :-1] slice give other strides at the same sizes, i.e. recompiles)
            inputs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            try:
                return self.compiled(**inputs)
            except Exception as e:  # noqa: BLE001 - any compile error: eager is always correct
                if not _is_compile_error(e):
                    raise
                self.fall_back(e)
        return self.eager(**kwargs)

    def fall_back(self, error: BaseException) -> None:
        self.failed = _warn_fallback(error, "torch.compile failed", "running the trainer's passes eager")


class CompiledLayerStack:
    """The sampler's decode step compiled: ``layer_stack`` (``cispo.rollout.static_cache.layer_stack``)
    under ``torch.compile(dynamic=True)``, called with ``attention`` (there: ``matmul_attention``,
    which inductor can fuse) and the padding mask always passed (one graph for every batch size,
    response column and padding; found: 1 graph per run). Called like ``layer_stack``; runs it
    eager, with the caller's attention function, for a batch of one row (a size of 1 is
    specialised: a graph of its own) and for good after the first compile error, with one
    warning. Compiled in the first decode step (~10-25 s on a CPU, less with inductor's cache
    warm)."""

    def __init__(self, layer_stack: Callable, attention: Callable) -> None:
        compile_cache_dir()
        self.eager, self.attention = layer_stack, attention
        self.compiled = torch.compile(layer_stack, dynamic=True)
        self.failed: str | None = None  # why it fell back to eager
        if not has_cxx_compiler():
            self.fall_back(RuntimeError("no C++ compiler (g++ / clang++) for inductor on the CPU"))

    def __call__(self, *args, attention: Callable, padded: bool = True) -> torch.Tensor:
        x = args[3]  # [b, 1, H]
        if self.failed is None and x.shape[0] >= 2:
            try:
                return self.compiled(*args, attention=self.attention, padded=True)
            except Exception as e:  # noqa: BLE001 - any compile error: eager is always correct
                if not _is_compile_error(e):
                    raise
                self.fall_back(e)
        return self.eager(*args, attention=attention, padded=padded)

    def fall_back(self, error: BaseException) -> None:
        self.failed = _warn_fallback(error, "compiling the decode step failed", "sampling eager")


def _warn_fallback(error: BaseException, what: str, instead: str) -> str:
    """Print the one warning of a compile that fell back to eager; returns the error on one line."""
    why = f"{type(error).__name__}: {' '.join(str(error).split())}"
    print(f"cispo: warning: model.compile: {what} ({why[:300]}); {instead}", file=sys.stderr)
    return why


def _is_compile_error(e: BaseException) -> bool:
    """An error raised by torch.compile's machinery (dynamo, AOT autograd, inductor, the C++
    compiler), as opposed to one the model would raise eager too."""
    from torch._dynamo.exc import TorchDynamoException

    if isinstance(e, TorchDynamoException):
        return True
    mod = type(e).__module__ or ""
    return mod.startswith(("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx"))


def compiled_decoder(model: torch.nn.Module, pad_id: int = 0) -> CompiledDecoder | None:
    """The decoder of ``model`` compiled for the trainer's passes, or None (with one warning)
    when compiling fails here. Compiles now, on a probe batch of 2 rows x 5 tokens (one
    left-padded) in train mode, forward + backward and a no-grad forward, so the two graphs the
    trainer uses exist and any failure shows at set-up; the probe leaves the weights, their
    gradients (None again) and the modules' train/eval flags as they were. Sets inductor's
    cache folder first (:func:`compile_cache_dir`)."""
    from cispo.models.policy import decoder

    compile_cache_dir()
    body = decoder(model)
    if not hasattr(torch, "compile"):
        print("cispo: warning: model.compile: this torch has no torch.compile; running eager", file=sys.stderr)
        return None
    if next(body.parameters()).device.type == "cpu" and not has_cxx_compiler():
        print("cispo: warning: model.compile: no C++ compiler (g++ / clang++) for inductor on the CPU; "
              "running the trainer's passes eager", file=sys.stderr)
        return None
    wrapped = CompiledDecoder(body)
    try:
        _probe(model, wrapped, pad_id)
    except Exception as e:  # noqa: BLE001 - whatever fails here, eager still works
        wrapped.fall_back(e)
    return None if wrapped.failed else wrapped


def _probe(model: torch.nn.Module, body: Callable, pad_id: int) -> None:
    """Forward + backward and a no-grad forward of ``body`` on 2 rows x 5 tokens (row 0 with
    one left pad), in train mode; everything it touches is restored. Two rows and five tokens
    differ (dynamic shapes assign equal sizes one symbol) and neither is 0 or 1 (specialised)."""
    param = next(model.parameters())
    ids = torch.tensor([[pad_id, 3, 4, 5, 6], [3, 4, 5, 6, 7]], device=param.device)  # [2, 5]
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 0] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [2, 5]
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    rng = torch.random.get_rng_state()
    model.train()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kw = dict(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
            hidden = body(**kw).last_hidden_state  # [2, 5, H]
            if hidden.requires_grad:
                (hidden.float() * 0).sum().backward()
            with torch.no_grad():
                body(**kw)
    finally:
        for m, training in modes:
            m.training = training
        for p, g in grads:
            p.grad = g
        torch.random.set_rng_state(rng)
