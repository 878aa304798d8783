"""The arguments cispo gives vLLM's engine (``vllm.LLM``), and what the installed vLLM supports.

Pure functions of settings; vLLM is imported only inside the feature checks. Written against the
source of vLLM 0.33.0 (``cispo.foundations.versions.TESTED_VERSIONS``); every name below is an ``LLM`` /
``EngineArgs`` argument of that version (``vllm/entrypoints/llm.py``, ``vllm/engine/arg_utils.py``).
Not yet run on a GPU: the tests check the exact arguments against a stand-in engine.

1. **Under torchrun** (one engine per rank, tensor parallel size 1) the engine is built with
   ``distributed_executor_backend="external_launcher"`` and a per-rank ``seed``, as TRL's colocate
   mode does (``trl/generation/vllm_generation.py``). vLLM's executor for it
   (``ExecutorWithExternalLauncher`` in ``vllm/v1/executor/uniproc_executor.py``) reads ``RANK`` and
   ``LOCAL_RANK`` from the environment, puts its worker on ``cuda:LOCAL_RANK`` and joins the process
   group the trainer already initialised. Without it, the default single-process executor takes
   ``cuda:0`` on every rank (it reads the device index from ``device_config``, which has none), so N
   ranks each ask for ``gpu_memory_utilization`` of GPU 0 and every rank's current device becomes 0.
2. **The FP32 LM head**: ``hf_overrides={"head_dtype": "float32"}`` makes vLLM's ``LogitsProcessor``
   (``vllm/model_executor/layers/logits_processor.py``) compute the logits in float32 from the bf16
   hidden state and weight (``torch.mm(..., out_dtype=float32)`` on CUDA), MiniMax-M1's fix on the
   sampler side; ``ModelConfig.head_dtype`` (``vllm/config/model.py``) reads it. A vLLM without that
   property ignores the override: the sampler then warns once and records it (``VLLMSampler.info``).
3. **TRL-like defaults** for the rest: ``max_num_batched_tokens=4096`` (TRL: "the latest vLLM v1 memory
   profiler is misled by the high default"), ``max_model_len`` / ``max_num_seqs`` left to vLLM unless set,
   CUDA graphs on (``enforce_eager=False``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

EXTERNAL_LAUNCHER = "external_launcher"

@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """Where one torchrun process's engine runs: the values ``external_launcher`` reads."""

    rank: int
    local_rank: int
    world_size: int

    def environment(self) -> dict[str, str]:
        """``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``, as TRL sets them before building the engine."""
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size)}


def tokenizer_source(tokenizer, model_path) -> str:
    """The folder (or hub id) the engine loads its tokenizer from (``engine_kwargs``' ``tokenizer_path``):
    ``tokenizer`` itself when it is a path, else its ``name_or_path``, else ``model_path``."""
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        return str(tokenizer or model_path)
    return str(getattr(tokenizer, "name_or_path", "") or model_path)


def engine_kwargs(
    model_path: str,
    tokenizer_path: str,
    *,
    dtype: str,
    gpu_memory_utilization: float,
    enable_sleep_mode: bool,
    seed: int,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = 4096,
    enforce_eager: bool = False,
    placement: RankPlacement | None = None,
    logprobs_mode: str | None = "processed_logprobs",
    head_dtype: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM``. ``None`` settings are left out (vLLM's default);
    ``placement`` (a torchrun rank) adds the external launcher; ``head_dtype`` goes into
    ``hf_overrides`` (merged with ``extra``'s); ``extra`` (free-form) comes last."""
    kwargs: dict[str, Any] = dict(
        model=model_path,
        tokenizer=tokenizer_path,
        dtype=dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_sleep_mode=enable_sleep_mode,
        seed=seed,
        generation_config="vllm",  # the checkpoint's generation_config.json does not change sampling
        enforce_eager=enforce_eager,
    )
    optional = dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, logprobs_mode=logprobs_mode)
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if placement is not None and placement.world_size > 1:
        kwargs["distributed_executor_backend"] = EXTERNAL_LAUNCHER
    extra = dict(extra or {})
    overrides = dict(extra.pop("hf_overrides", None) or {})
    if head_dtype is not None:
        overrides["head_dtype"] = head_dtype
    if overrides:
        kwargs["hf_overrides"] = overrides
    kwargs.update(extra)
    return kwargs


def set_rank_environment(placement: RankPlacement | None) -> None:
    """Export ``placement``'s ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` (torchrun has set them already;
    this makes them agree with the process group cispo joined, as TRL does)."""
    if placement is not None and placement.world_size > 1:
        os.environ.update(placement.environment())


# --------------------------------------------------------------------------- what the installed vLLM has


def engine_accepts(name: str) -> bool:
    """Whether the installed vLLM's engine arguments (``EngineArgs``) have field ``name``."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return False
    try:
        return name in {f.name for f in dataclasses.fields(EngineArgs)}
    except TypeError:  # not a dataclass
        return name in getattr(EngineArgs, "__annotations__", {})


def supports_head_dtype() -> bool:
    """Whether the installed vLLM reads ``hf_overrides["head_dtype"]`` (``ModelConfig.head_dtype``,
    a property in ``vllm/config/model.py``); older versions silently ignore the key."""
    try:
        from vllm.config import ModelConfig
    except ImportError:
        return False
    import inspect

    return isinstance(inspect.getattr_static(ModelConfig, "head_dtype", None), property)
