"""A :class:`~cispo.rollout.base.Sampler` backed by vLLM's offline engine (``vllm.LLM``), colocated with the
trainer on the same GPU. Needs ``pip install "cispo[vllm]"`` and a CUDA GPU; vLLM is imported only when a
:class:`VLLMSampler` is constructed.

Written against the source of vLLM 0.33.0 (``cispo.foundations.versions.TESTED_VERSIONS``; another version warns once),
with fallbacks for older ones stated below. The engine's arguments are built by
:func:`cispo.rollout.vllm_engine.engine_kwargs` (torchrun placement, FP32 head, TRL-like defaults: see there).
**Not yet run on a GPU**: tested against a stand-in engine that checks the arguments it is given. What each
piece relies on:

* **Sampling.** ``LLM.generate([TokensPrompt(prompt_token_ids=...)], [SamplingParams(...)], use_tqdm=False)``
  with ``SamplingParams(temperature, top_p, top_k, min_p, repetition_penalty, max_tokens=max_new_tokens, logprobs=0,
  seed, stop_token_ids=[stop ids], ignore_eos=True, detokenize=False)``. ``logprobs=0`` returns the log-prob of
  the sampled token only (vLLM always adds the sampled token to the top-k it returns); ``ignore_eos=True``
  plus ``stop_token_ids`` makes *our* stop ids the only stop tokens, as in ``TorchSampler`` (the run
  passes the tokenizer's EOS, the ``eos_token_id`` list of the model's generation config and the chat
  template's end of turn: ``cispo.models.loading.stop_token_ids``); the stop token is kept in
  ``CompletionOutput.token_ids``. vLLM's ``finish_reason`` "stop" maps to "eos",
  "length" to "length". The engine is built with ``generation_config="vllm"`` so the checkpoint's
  generation config does not change the sampling defaults.

* **Log-probs** (``logp_rollout``). The engine is built with ``logprobs_mode="processed_logprobs"``
  (an ``LLM``/engine argument, not a per-request one; vLLM PR #21398 added the option in 0.10.0 and PR
  #22387 made "processed" mean the final sampling distribution). vLLM's V1 sampler then returns
  ``log_softmax`` of the logits *after* penalties, temperature, min_p and top-k/top-p, i.e. of the
  distribution it actually sampled from (``vllm/v1/sample/sampler.py`` and
  ``vllm/v1/sample/ops/topk_topp_sampler.py``; the model runner V2 sampler in
  ``vllm/v1/worker/gpu/sample/sampler.py`` does the same). That is the
  :class:`~cispo.rollout.base.RolloutBatch` contract (`cispo.rollout.processing`, which the torch sampler
  applies in vLLM's order), up to the engine's numerics (bf16 weights, its own kernels; see
  :func:`~cispo.rollout.correction.truncated_is_weights`). With ``fp32_head=True`` the logits are float32
  (``hf_overrides={"head_dtype": "float32"}``).

  - ``top_p`` / ``top_k`` / ``min_p``: vLLM renormalises over the tokens kept, so it reports
    ``log p_T(tok) - log S`` where S is the tempered probability mass kept at that step: the exact log-prob of
    the behaviour policy (vLLM issue #42259), the right one for an importance weight against the trainer's
    full-vocabulary log pi_old (TRL 1.17 uses it so).
  - ``repetition_penalty``: over the prompt's and the response's tokens (vLLM's prompt and output masks; in a
    multi-turn episode the context re-sent as the prompt holds both).
  - ``temperature == 0`` (greedy, vLLM uses argmax for T < 1e-5): the untempered ``log_softmax`` of the
    penalised logits, as in the contract. vLLM raises temperatures in (0, 0.01) to 0.01 (with a warning).
  - vLLM < 0.10 (no ``logprobs_mode``): V1 returns *raw* log-probs, ``log_softmax(logits)`` before
    penalties, temperature and truncation, so ``logp_rollout`` is only right at temperature 1 (or 0) without
    them; a warning says so at each such call.

* **Repetition early stop.** vLLM has no probability-based stop (recent versions have an n-gram
  ``RepetitionDetectionParams``, a different criterion). :func:`finalize_response` applies it after
  the fact on the returned per-token probabilities (the same distribution as ``logp_rollout``): the
  response is cut at the token where the N-th consecutive token with p > threshold occurs and marked
  "repetition". vLLM kept generating that row until EOS or ``max_tokens``: those tokens were computed and
  thrown away, so the stop saves no rollout compute here (it still shapes the training data exactly as
  ``TorchSampler``'s stop does).

* **Multi-turn episodes** (``generate(..., episodes=...)``, tool use): one ``LLM.generate`` per turn for
  the rows still running, each request the row's prompt + response ids so far (re-prefilled from vLLM's
  prefix cache) with ``max_tokens`` its remaining budget and the environment's stop strings; the segment's
  end is read from the returned token ids, never from vLLM's text. See :mod:`cispo.rollout.vllm_episodes`.

* **Weight push** (:meth:`VLLMSampler.update_weights`, after every optimizer step). The public path of
  vLLM 0.33: ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``, which runs the
  worker's ``reload_weights`` (``vllm/v1/worker/gpu_worker.py`` -> the model runner ->
  ``vllm/model_executor/model_loader/reload/inplace.py``): the model's own ``load_weights`` on Hugging Face
  names (it fuses q/k/v and gate/up, casts to the engine's dtype) inside vLLM's layerwise reload, which
  copies the results back into the original storage (CUDA graphs stay valid) and re-runs any
  post-load processing. In process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set unless the caller set it)
  ``collective_rpc`` calls the worker directly, so the trainer's tensors go in without a copy through
  the host. A vLLM whose ``reload_weights`` takes no ``weights_iterator`` (older versions) gets the
  private path TRL's colocate mode uses, ``llm.llm_engine.model_executor.driver_worker.model_runner``'s
  model ``load_weights`` (kept "for v0 compatibility" in ``vllm/v1/engine/llm_engine.py``); out of process,
  chunks through ``collective_rpc`` with a function (needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
  :meth:`VLLMSampler.info` says which path ran. LoRA adapters (``cispo.models.lora``) are merged on the fly; the
  prefix cache is reset afterwards (its KV blocks came from the old weights). Tensor parallelism > 1 and
  quantised engines are not supported.

* **Colocation and sleep.** ``gpu_memory_utilization`` (0.3 by default) is the share of the GPU vLLM takes
  for its weights and KV cache; the trainer gets the rest. With ``enable_sleep_mode=True``, :meth:`sleep`
  (``LLM.sleep(level)``) frees that memory during the update, at ``sleep_level`` 2 by default as TRL and
  verl do: the weights and the KV cache are discarded (level 1 would copy the soon stale weights to CPU
  memory and back every step); the buffers that are not weights (rotary caches) are saved and restored by
  vLLM itself (``Worker.sleep`` / ``wake_up``). :meth:`update_weights` then wakes the weights and pushes
  the new ones (nothing is read from disk), and the next :meth:`generate` wakes the KV cache. Before
  each ``wake_up`` the trainer's cached CUDA blocks are released (``torch.cuda.empty_cache()``, as TRL and
  verl do), else the update's cache can leave too little room for the engine.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Sequence

import torch

from cispo.rollout.base import Episodes, RolloutBatch, Sampler, SamplingConfig, stop_ids
from cispo.rollout.processing import processes
from cispo.rollout.vllm_engine import (
    RankPlacement,
    engine_accepts,
    engine_kwargs,
    set_rank_environment,
    supports_head_dtype,
    tokenizer_source,
)
from cispo.rollout.vllm_episodes import draw_seeds, pad_rollout, sample_episodes

INSTALL_HINT = 'VLLMSampler needs vLLM: pip install "cispo[vllm]" (needs a CUDA GPU; see docs/install.md)'

_FINISH = {"stop": "eos", "length": "length"}  # vLLM's finish_reason -> ours
_WARNED: set[str] = set()  # warnings given once per process


# --------------------------------------------------------------------------- pure helpers (no vLLM)


def repetition_stop_length(token_probs: Sequence[float], n: int, threshold: float) -> int | None:
    """Length of a response cut by the repetition early stop: index + 1 of the first token at which the run
    of consecutive tokens with probability > ``threshold`` reaches ``n``; None when it never does."""
    run = 0
    for i, p in enumerate(token_probs):
        run = run + 1 if p > threshold else 0
        if run >= n:
            return i + 1
    return None


def finalize_response(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    engine_reason: str | None,
    eos_token_id: int | Sequence[int],
    cfg: SamplingConfig,
) -> tuple[list[int], list[float], str]:
    """One engine response -> (token ids, their log-probs, finish reason) under the ``RolloutBatch`` contract.

    Maps vLLM's finish reason ("stop" -> "eos", "length" -> "length"), checks it against the tokens, then
    applies the repetition early stop post hoc (see the module docstring): the response is cut where the
    run of confident tokens reaches ``cfg.repetition_stop_tokens``; the cut row is "repetition", unless the
    token that reaches N is a stop token ("eos", as in ``TorchSampler``). A "length" row whose last token
    reaches N becomes "repetition", as in ``TorchSampler``. ``eos_token_id``: the stop id or ids
    (``cispo.rollout.base.stop_ids``).
    """
    stops = set(stop_ids(eos_token_id))
    ids, lps = [int(t) for t in token_ids], [math.nan if x is None else float(x) for x in logprobs]  # None: unscored
    if len(ids) != len(lps):
        raise RuntimeError(f"engine returned {len(ids)} tokens but {len(lps)} log-probs")
    if not ids:
        raise RuntimeError(f"engine returned an empty response (finish_reason={engine_reason!r})")
    first = next((i for i, t in enumerate(ids[:-1]) if t in stops), None)
    if first is not None:  # never expected (the engine stops there), but keep the contract
        ids, lps, reason = ids[: first + 1], lps[: first + 1], "eos"
    elif engine_reason == "stop":
        if ids[-1] not in stops:
            raise RuntimeError(f"engine stopped on token {ids[-1]}, not on EOS or another stop id {sorted(stops)}")
        reason = "eos"
    elif engine_reason == "length":
        if ids[-1] in stops:  # a stop token sampled as the last allowed token
            reason = "eos"
        elif len(ids) != cfg.max_new_tokens:
            raise RuntimeError(
                f"engine stopped after {len(ids)} < max_new_tokens={cfg.max_new_tokens} tokens for length "
                "(prompt + max_new_tokens exceeds the engine's max_model_len?)"
            )
        else:
            reason = "length"
    else:
        raise RuntimeError(f"unexpected finish_reason {engine_reason!r} from the engine")
    if cfg.repetition_stop_tokens is not None:
        cut = repetition_stop_length([math.exp(x) for x in lps], cfg.repetition_stop_tokens,
                                     cfg.repetition_stop_prob)
        if cut is not None:
            ids, lps = ids[:cut], lps[:cut]
            reason = "eos" if ids[-1] in stops else "repetition"
    return ids, lps, reason


def named_weights(model_or_weights) -> Iterable[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) pairs to push to the engine.

    A module: its ``state_dict`` (LoRA adapters injected by ``cispo.models.lora`` or a ``PeftModel`` are merged into
    the base weights, under the base names; an FSDP2-sharded module's shards are all-gathered one tensor at a
    time as the engine takes them, as TRL's ``_sync_fsdp2_params_to_vllm`` does, so every rank must push);
    a dict: its items; anything else: used as given.
    """
    if isinstance(model_or_weights, torch.nn.Module):
        from cispo.foundations.distributed import full_tensor
        from cispo.models.lora import has_lora, merged_named_weights

        if has_lora(model_or_weights):
            return merged_named_weights(model_or_weights)
        return ((k, full_tensor(v.detach())) for k, v in model_or_weights.state_dict().items())
    if isinstance(model_or_weights, dict):
        return iter(model_or_weights.items())
    return model_or_weights


def _chunks(weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int):
    """CPU copies of the weights, in lists of at most ``max_bytes`` (one tensor may exceed it alone)."""
    chunk, size = [], 0
    for name, t in weights:
        t = t.detach().to("cpu")
        if chunk and size + t.numel() * t.element_size() > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += t.numel() * t.element_size()
    if chunk:
        yield chunk


def _worker_model(worker):
    """The vLLM ``nn.Module`` (with ``load_weights``) of a worker or worker wrapper (the private path)."""
    worker = getattr(worker, "worker", None) or worker  # WorkerWrapperBase -> Worker
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def _load_weights_on_worker(worker, weights) -> int:
    """Run by ``LLM.collective_rpc`` inside a vLLM worker (the private out-of-process path)."""
    with torch.no_grad():
        _worker_model(worker).load_weights(weights)
    return len(weights)


def _no_weights_iterator(error: Exception) -> bool:
    """Whether ``error`` says the worker has no ``reload_weights(weights_iterator=...)``: a vLLM without the
    method (``run_method``'s NotImplementedError, or AttributeError) or with the no-argument one (TypeError)."""
    if isinstance(error, TypeError):
        return "weights_iterator" in str(error)
    return isinstance(error, (NotImplementedError, AttributeError)) and "reload_weights" in str(error)


def _warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """Warn ``message`` the first time this process meets ``key``, then never again (``stacklevel`` as
    ``warnings.warn``'s, counted from this function)."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=stacklevel)


# --------------------------------------------------------------------------- the sampler's construction steps


def _import_vllm():
    """(``vllm``, ``vllm.SamplingParams``, ``vllm.inputs.TokensPrompt``); ImportError with the install hint
    where vLLM is missing (imported here, not at module level: importing cispo.rollout needs no vLLM)."""
    try:
        import vllm
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return vllm, SamplingParams, TokensPrompt


def resolve_token_ids(tokenizer, eos_token_id: int | Sequence[int] | None, pad_token_id: int | None) -> tuple:
    """(stop ids, pad id): the ones given (``eos_token_id``: one id or a list), else the tokenizer's EOS
    and pad; the pad id falls back to the first stop id. ValueError without a stop id: a response
    could never end."""
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
    if eos_token_id is None:
        raise ValueError("VLLMSampler needs eos_token_id (or a tokenizer that has one)")
    stops = stop_ids(eos_token_id)
    return stops, stops[0] if pad_token_id is None else pad_token_id


def _engine_features(vllm_version: str, fp32_head: bool) -> tuple[str | None, bool]:
    """(``logprobs_mode`` for the engine or None, whether the engine computes its logits in FP32), as far
    as the installed vLLM allows. Warns where it falls short: without ``logprobs_mode`` logp_rollout is
    raw (right only at temperature 1 with top_p=1); without a head_dtype override the FP32 head covers the
    trainer only. Called from ``VLLMSampler.__init__``: the warnings name its caller's line."""
    logprobs_mode = "processed_logprobs" if engine_accepts("logprobs_mode") else None
    if logprobs_mode is None:
        warnings.warn(
            f"vLLM {vllm_version} has no logprobs_mode: its V1 engine returns raw log-probs "
            "(before temperature and top-p), so logp_rollout is only right at temperature 1 with top_p=1. "
            "Use vLLM >= 0.10.2.",
            stacklevel=3,
        )
    in_engine = bool(fp32_head) and supports_head_dtype()
    if fp32_head and not in_engine:
        _warn_once("fp32_head", f"vLLM {vllm_version} has no head_dtype override: the engine computes its "
                   "logits in its own dtype, so the FP32 LM head (model.fp32_lm_head) covers the trainer only; "
                   "logp_rollout comes from the engine's low-precision head (recorded in meta.json)", stacklevel=4)
    return logprobs_mode, in_engine


def _start_engine(vllm, kwargs: dict, placement: RankPlacement | None, device: torch.device | str | None):
    """(``vllm.LLM(**kwargs)`` built on this rank's GPU (`set_rank_environment`), the trainer's ``device`` as
    a ``torch.device`` or None); a CUDA ``device`` is made the current device again once the engine is built."""
    set_rank_environment(placement)
    llm = vllm.LLM(**kwargs)
    device = None if device is None else torch.device(device)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # the engine's worker set its own; the trainer keeps its rank's
    return llm, device


# --------------------------------------------------------------------------- the sampler


class VLLMSampler(Sampler):
    """Samples with a colocated ``vllm.LLM``; a :class:`~cispo.rollout.base.Sampler` with weight sync and
    sleep / wake (no lock-step: its forward passes need no other rank).

    See the module docstring for the exact semantics of ``logp_rollout``, of the repetition stop, of the
    weight push and of sleep mode. Call :meth:`update_weights` with the policy after every optimizer step
    (the engine otherwise keeps sampling from the weights it loaded from ``model_path``).

    Args:
        model_path: the Hugging Face folder of the policy (what ``cispo.models.loading.load_policy`` loads).
        tokenizer: its tokenizer (an object with ``name_or_path``, or a path); None: ``model_path``.
        eos_token_id: the token that ends a response, or a list of them (``cispo.rollout.base.stop_ids``);
            kept in the response, mask 1. None: the tokenizer's EOS.
        pad_token_id: fills the left of short prompts and the right of short responses.
        gpu_memory_utilization: share of the GPU memory vLLM may take (weights + KV cache).
        dtype: the engine's parameter dtype ("auto": the checkpoint's, float32 ones run in bf16).
        enable_sleep_mode: allow :meth:`sleep` / :meth:`wake_up` (vLLM's ``enable_sleep_mode``).
        seed: the engine's global seed (used for requests without their own seed); give each torchrun rank
            its own.
        sleep_level: what :meth:`sleep` frees by default: 2 (weights and KV cache discarded, the weights
            pushed back by :meth:`update_weights`) or 1 (weights copied to CPU memory).
        fp32_head: compute the engine's logits in float32 (``hf_overrides={"head_dtype": "float32"}``); a
            vLLM that cannot warns once and :meth:`info` records it.
        placement: this process's torchrun rank (None: a single process): builds the engine with
            ``distributed_executor_backend="external_launcher"`` on ``cuda:local_rank``.
        device: the trainer's device; made the current CUDA device again once the engine is built.
        max_model_len, max_num_seqs, max_num_batched_tokens, enforce_eager: vLLM's engine settings (None:
            vLLM's default); see :func:`cispo.rollout.vllm_engine.engine_kwargs`.
        in_process: run vLLM's engine core in this process (sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
            unless already set), needed for the zero-copy weight push.
        output_device: where the ``RolloutBatch`` tensors go (the trainer moves them to the CPU anyway).
        **llm_kwargs: more ``vllm.LLM`` arguments (free-form; ``hf_overrides`` is merged with the head's).
    """

    own_weights = True  # the engine's copy, changed only by update_weights

    def __init__(
        self,
        model_path,
        tokenizer=None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        gpu_memory_utilization: float = 0.3,
        dtype: str = "auto",
        enable_sleep_mode: bool = False,
        seed: int = 0,
        *,
        sleep_level: int = 2,
        fp32_head: bool = False,
        placement: RankPlacement | None = None,
        device: torch.device | str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = 4096,
        enforce_eager: bool = False,
        in_process: bool = True,
        output_device: torch.device | str = "cpu",
        **llm_kwargs,
    ) -> None:
        """Checks the arguments, asks the installed vLLM what it supports, builds the engine (the class
        docstring describes each argument)."""
        vllm, self._SamplingParams, self._TokensPrompt = _import_vllm()
        from cispo.foundations.versions import warn_if_untested

        self.stop_token_ids, pad_token_id = resolve_token_ids(tokenizer, eos_token_id, pad_token_id)
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        self.eos_token_id, self.pad_token_id = self.stop_token_ids[0], int(pad_token_id)
        self.output_device = torch.device(output_device)
        self.enable_sleep_mode, self.sleep_level = bool(enable_sleep_mode), int(sleep_level)
        self.vllm_version = getattr(vllm, "__version__", "unknown")
        warn_if_untested("vllm", INSTALL_HINT, version=self.vllm_version)
        if in_process:  # the zero-copy weight push needs the engine core in this process
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.logprobs_mode, self.fp32_head = _engine_features(self.vllm_version, fp32_head)
        self._fp32_head_requested = bool(fp32_head)
        self.engine_kwargs = engine_kwargs(
            str(model_path), tokenizer_source(tokenizer, model_path), dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.enable_sleep_mode, seed=seed,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enforce_eager=enforce_eager, placement=placement, logprobs_mode=self.logprobs_mode,
            head_dtype="float32" if self.fp32_head else None, extra=llm_kwargs)
        self.llm, self.device = _start_engine(vllm, self.engine_kwargs, placement, device)
        self._asleep: set[str] = set()  # parts put to sleep: "weights", "kv_cache"
        self._sleep_level = 0
        self._needs_weights = False  # after waking from level 2: the weights must be pushed again
        self.weight_push: str | None = None  # which path pushed the weights (info())

    def info(self) -> dict:
        """What the engine does, for the run's ``meta.json``."""
        recorded = {k: v for k, v in self.engine_kwargs.items() if isinstance(v, (str, int, float, bool, dict))}
        return {"engine": "vllm", "vllm_version": self.vllm_version, "logprobs_mode": self.logprobs_mode,
                "fp32_head_requested": self._fp32_head_requested, "fp32_head_in_engine": self.fp32_head,
                "sleep_level": self.sleep_level if self.enable_sleep_mode else None,
                "weight_push": self.weight_push, "llm_kwargs": recorded}


    # ------------------------------------------------------------------ sampling

    @property
    def logprob_semantics(self) -> str:
        """What ``logp_rollout`` is, for this engine (see the module docstring)."""
        if self.logprobs_mode == "processed_logprobs":
            return ("processed: log_softmax of the distribution sampled from (after the repetition penalty, "
                    "temperature, min_p, top-k and top-p)")
        return "raw: log_softmax(logits), before penalties, temperature and truncation (vLLM < 0.10, V1 engine)"

    def sampling_params(self, cfg: SamplingConfig, seed: int | None = None, **overrides):
        """The ``vllm.SamplingParams`` for ``cfg``; ``overrides``: other values of its fields (an episode's turn:
        ``max_tokens``, the stop strings; ``cispo.rollout.vllm_episodes.engine_turn``)."""
        return self._SamplingParams(**dict(
            n=1,
            temperature=float(cfg.temperature),
            top_p=float(cfg.top_p),
            top_k=int(cfg.top_k),  # 0: off in vLLM too
            min_p=float(cfg.min_p),
            repetition_penalty=float(cfg.repetition_penalty),
            max_tokens=cfg.max_new_tokens,
            logprobs=0,
            seed=seed,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=True,
            detokenize=False,
        ) | overrides)

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        cfg: SamplingConfig,
        generator: torch.Generator | None = None,
        episodes: Episodes | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt; see :class:`~cispo.rollout.base.RolloutBatch` for the layout.

        With a ``generator``, each request gets a seed drawn from it (reproducible for the same batch; vLLM's
        numerics are not batch-invariant, so the same prompt in another batch may still differ). Without,
        the engine's own seeded stream is used. ``episodes``: a multi-turn response per prompt, one engine
        call per turn (:mod:`cispo.rollout.vllm_episodes`).
        """
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty: need at least one prompt")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if self._asleep:
            self.wake_up()
        if self._needs_weights:
            raise RuntimeError("the engine woke from sleep level 2 without weights: call update_weights(model) first")
        self._check_lengths(prompt_ids, cfg)
        if self.logprobs_mode is None and (cfg.temperature not in (0.0, 1.0) or processes(cfg)):
            warnings.warn(f"vLLM {self.vllm_version} returns raw log-probs: logp_rollout ignores "
                          f"temperature={cfg.temperature}, top_p={cfg.top_p}, top_k={cfg.top_k}, min_p={cfg.min_p} "
                          f"and repetition_penalty={cfg.repetition_penalty}", stacklevel=2)
        if 0 < cfg.temperature < 0.01:
            warnings.warn(f"vLLM raises temperature {cfg.temperature} to 0.01", stacklevel=2)
        if episodes is not None:  # multi-turn: one engine call per turn, the context re-sent as ids
            return sample_episodes(self, prompt_ids, cfg, generator, episodes)

        B = len(prompt_ids)
        params = [self.sampling_params(cfg, s) for s in draw_seeds(generator, B)]
        prompts = [self._TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        if len(outputs) != B:
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {B} prompts")
        responses = []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            if completion.logprobs is None:
                raise RuntimeError("vLLM returned no logprobs (SamplingParams.logprobs was 0)")
            lps = [completion.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
            responses.append(finalize_response(ids, lps, completion.finish_reason, self.stop_token_ids, cfg))
        return pad_rollout(prompt_ids, responses, self.pad_token_id, self.output_device)

    def _check_lengths(self, prompt_ids, cfg: SamplingConfig) -> None:
        max_len = getattr(getattr(self.llm.llm_engine, "model_config", None), "max_model_len", None)
        if max_len is None:
            return
        longest = max(len(p) for p in prompt_ids)
        if longest + cfg.max_new_tokens > max_len:
            raise ValueError(f"longest prompt ({longest}) + max_new_tokens ({cfg.max_new_tokens}) exceeds the "
                             f"engine's max_model_len={max_len}")

    # ------------------------------------------------------------------ weights

    def _engine_model(self):
        """The vLLM model object when the engine runs in this process, else None (the private path)."""
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        worker = getattr(executor, "driver_worker", None)
        if worker is None:
            return None
        try:
            return _worker_model(worker)
        except AttributeError:
            return None

    def update_weights(self, model, chunk_bytes: int = 1 << 28) -> int:
        """Push the trainer's current weights to the engine; returns the number of tensors pushed.

        ``model``: the policy module (its ``state_dict``, with LoRA adapters merged), a ``{name: tensor}``
        dict or an iterable of (name, tensor), with Hugging Face names. ``chunk_bytes`` sizes the CPU
        chunks of the private out-of-process path only. Weights asleep (level 2: discarded) are woken first.
        """
        if "weights" in self._asleep:
            self.wake_up(tags=["weights"])
        n = 0

        def counted(ws):
            nonlocal n
            for item in ws:
                n += 1
                yield item

        in_process = self._engine_model() is not None
        weights = counted(named_weights(model))
        if self.weight_push in (None, "reload_weights"):
            try:
                with torch.no_grad():  # in process: the tensors themselves; else CPU copies in one message
                    payload = weights if in_process else [(k, v.detach().cpu()) for k, v in weights]
                    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": payload})
                self.weight_push = "reload_weights"
            except (TypeError, NotImplementedError, AttributeError) as e:
                if not _no_weights_iterator(e) or (in_process and n):
                    raise
                self.weight_push, n = "load_weights (private)", 0
                weights = counted(named_weights(model))
        if self.weight_push == "load_weights (private)":
            self._push_private(weights, chunk_bytes)
        self.llm.reset_prefix_cache()
        self._needs_weights = False
        return n

    def _push_private(self, weights, chunk_bytes: int) -> None:
        """The fallback for a vLLM without ``reload_weights(weights_iterator=...)``: the model's own
        ``load_weights`` through the V1 engine's ``model_executor`` (in process), else CPU chunks through
        ``collective_rpc`` with a function."""
        target = self._engine_model()
        if target is not None:
            with torch.no_grad():
                target.load_weights(weights)
            return
        for chunk in _chunks(weights, chunk_bytes):
            self.llm.collective_rpc(_load_weights_on_worker, args=(chunk,))

    # ------------------------------------------------------------------ colocation

    def sleep(self, level: int | None = None) -> None:
        """Free the engine's GPU memory (``LLM.sleep``): level 2 (default: ``sleep_level``) discards the
        weights and the KV cache (then :meth:`update_weights` must run before the next :meth:`generate`);
        level 1 moves the weights to CPU memory and discards the KV cache. Needs ``enable_sleep_mode=True``."""
        if not self.enable_sleep_mode:
            raise RuntimeError("VLLMSampler.sleep needs enable_sleep_mode=True at construction")
        level = self.sleep_level if level is None else level
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._asleep:
            return
        self.llm.sleep(level=level)
        self._asleep, self._sleep_level = {"weights", "kv_cache"}, level

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Reallocate what :meth:`sleep` freed (``LLM.wake_up``), after releasing the trainer's cached CUDA
        blocks (``torch.cuda.empty_cache()``); ``tags`` ("weights", "kv_cache") wakes only those parts
        (where vLLM's ``wake_up`` takes tags; else all wake), e.g. the weights before :meth:`update_weights`."""
        parts = set(self._asleep) if tags is None else set(tags) & self._asleep
        if not parts:
            return
        torch.cuda.empty_cache()  # a no-op without CUDA
        if parts == {"weights", "kv_cache"}:
            self.llm.wake_up()
        else:
            try:
                self.llm.wake_up(tags=sorted(parts))
            except TypeError:  # an older vLLM without tags: everything wakes
                self.llm.wake_up()
                parts = set(self._asleep)
        if "weights" in parts and self._sleep_level == 2:
            self._needs_weights = True  # discarded: update_weights pushes them (nothing is read from disk)
        self._asleep -= parts
