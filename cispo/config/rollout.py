"""The ``rollout:`` section of the run's configuration: how the generation batch is sampled (the torch
or the vLLM engine), and the vLLM arguments that cispo sets itself, which ``rollout.vllm_kwargs`` may
not name (`cispo.config.train` gathers the sections)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["OWNED_ARGUMENTS", "RolloutConfig", "check_vllm_kwargs", "processes"]


OWNED_ARGUMENTS: dict[str, str] = {
    "model": "set it with model.path",
    "tokenizer": "the policy's own, from model.path",
    "seed": "set it with seed; each torchrun rank adds its own offset",
    "dtype": "set it with rollout.vllm_dtype",
    "gpu_memory_utilization": "set it with rollout.vllm_gpu_memory_utilization",
    "enable_sleep_mode": "set it with rollout.vllm_sleep",
    "max_model_len": "set it with rollout.vllm_max_model_len",
    "max_num_seqs": "set it with rollout.vllm_max_num_seqs",
    "max_num_batched_tokens": "set it with rollout.vllm_max_num_batched_tokens",
    "enforce_eager": "set it with rollout.vllm_enforce_eager",
    "logprobs_mode": "always processed_logprobs: logp_rollout must be the log-probs of the sampled distribution",
    "generation_config": "always 'vllm': the checkpoint's generation config must not change the sampling",
    "distributed_executor_backend": "external_launcher under torchrun, vLLM's default in a single process",
    "tensor_parallel_size": "always 1: the weight push needs the whole model in each engine",
}
"""``LLM`` arguments that cispo sets itself -> how. ``rollout.vllm_kwargs`` may not name them
(``check_vllm_kwargs``); ``cispo.rollout.vllm_engine.engine_kwargs`` builds them."""


def check_vllm_kwargs(extra: dict[str, Any], key: str = "rollout.vllm_kwargs") -> None:
    """ValueError naming ``key`` when ``extra`` sets an argument cispo sets itself, or the head
    dtype (``model.fp32_lm_head`` sets it)."""
    for name in extra:
        if name in OWNED_ARGUMENTS:
            raise ValueError(f"{key}.{name}: cispo sets this vLLM argument itself ({OWNED_ARGUMENTS[name]})")
    overrides = extra.get("hf_overrides")
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"{key}.hf_overrides must be a mapping of config fields, got {type(overrides).__name__}")
    if overrides and "head_dtype" in overrides:
        raise ValueError(f"{key}.hf_overrides.head_dtype: cispo sets it from model.fp32_lm_head (true: float32)")


def processes(sampling) -> bool:
    """Whether ``sampling`` (a `RolloutConfig` or a `cispo.rollout.base.SamplingConfig`) samples from anything but
    softmax(logits / T): a repetition penalty, min_p, top_k or top_p (`cispo.rollout.processing`)."""
    return sampling.repetition_penalty != 1.0 or sampling.min_p > 0 or sampling.top_k > 0 or sampling.top_p < 1.0


MAX_TURNS = 1000
"""The largest ``rollout.max_turns``: each turn is at least a call and an observation of the same response."""


@dataclass
class RolloutConfig:
    """Sampling the generation batch."""

    prompts_per_step: int = 32
    """P: prompts (groups) per generation batch; at most 10^6."""
    group_size: int = 8
    """G: responses sampled per prompt; at most 10^6."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same one)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    top_k: int = 0
    """Sample from the k most likely tokens only (0 = off)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one, in [0, 1) (0 = off)."""
    repetition_penalty: float = 1.0
    """HF's / vLLM's repetition penalty, > 0: the logits of the tokens already in the prompt or the response are
    divided by it where positive, multiplied where negative (1 = off). The penalty, temperature, min_p, top_k and
    top_p make the distribution sampled (in vLLM's order, both engines); the sampler's log-probs
    (``logp_rollout``) are of it, the trainer's of the model's own softmax(logits / temperature): set a rollout
    correction (``algo.rollout_is`` / ``algo.tis_cap``) to weight the difference (docs/api.md). Evaluation
    samples without them."""
    max_new_tokens: int | None = None
    """Longest response, in tokens; at most 10^8 (10 times the longest context of any model). None:
    the task's longest well-formed answer + 25%."""
    repetition_stop_tokens: int | None = None
    """Stop a response once this many consecutive tokens each had probability above
    ``repetition_stop_prob`` (MiniMax-M1: 3000 of 40k-80k). None: 3/4 of max_new_tokens.
    0: off."""
    repetition_stop_prob: float = 0.99
    """Probability threshold of the repetition early stop."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and sample more prompts (DAPO)."""
    max_sampling_rounds: int = 3
    """Cap on generation rounds per step with dynamic sampling (each round samples the groups still
    missing); then train on what was kept. DAPO's recipe samples until the batch is full: set it
    high (e.g. 20) with ``algo.minibatch_policy=fixed_size``. At most 10^4 (on a task whose groups all
    tie, a higher cap would not end)."""
    max_turns: int = 4
    """Tool turns per response in a multi-turn rollout (``data.tools``; 1 to 1000): after this many
    observations the next tool call ends the episode (TRL's ``max_tool_calling_iterations``; a chat turn
    may carry several calls)."""
    overlong_buffer: int | None = None
    """DAPO's soft overlong penalty: the last ``overlong_buffer`` tokens before
    max_new_tokens are penalised linearly down to -1. None: off."""
    overlong_scope: Literal["all", "paid"] = "all"
    """Which responses the overlong penalty reaches: ``all`` (DAPO) or ``paid``, only those the
    verifier pays (task reward > 0), so a group of unpaid answers stays uninformative
    (`cispo.data.rewards.shaped_reward`)."""
    async_steps: Literal[0, 1] = 0
    """Sampling beside training (docs/async.md): 0, sample a batch and then train on it; 1, one step off
    policy — while the trainer updates on batch n, a second thread samples batch n+1 with the weights before
    that update (the torch sampler: its own copy, loaded at the step's start; vLLM: the engine's, pushed at
    the end of the step before), so each batch is one update older
    than the weights that train on it (``rollout/staleness``). The importance weight's anchor is
    ``algo.logp_old``: ``rollout``, the behaviour policy's own log-probs (the staleness inside ``r``, where
    CISPO's cap bounds it), or ``recompute`` with a rollout correction (``algo.rollout_is`` / ``tis_cap``:
    AReaL's decoupled weight pi_proximal / pi_behaviour); ``recompute`` alone is refused (the staleness
    would reach neither). One process (no torchrun yet); with vLLM the engine stays awake (no
    ``vllm_sleep``); on a CPU the torch threads are split between the two sides."""
    engine: Literal["torch", "vllm"] = "torch"
    """Sampler: ``torch`` (the built-in KV-cache sampler) or ``vllm`` (needs a CUDA GPU and
    ``pip install "cispo[vllm]"``; weights are pushed to it after every step)."""
    decode: Literal["auto", "static", "hf"] = "auto"
    """How the torch sampler decodes: ``static`` (a preallocated KV cache written in place,
    rotary table and mask once per batch, stopped rows dropped; Llama / Qwen2 / Mistral),
    ``hf`` (the model's forward with its dynamic cache), ``auto`` (static where supported).
    Same tokens and log-probs either way; static is faster (docs/performance.md)."""
    prefill_observations: bool = True
    """Multi-turn rollouts (an environment): the torch sampler runs a row's whole observation through
    its KV cache in one forward, so the batch takes one step per turn instead of one per observation
    token (static decode and ``use_cache=false``; ``hf`` feeds token by token). Same response layout,
    log-probs equal to a full recompute; the random draws fall on other steps, so sampled tokens
    differ from ``false`` (token by token) at the same seed, equal when greedy (docs/performance.md)."""
    vllm_gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory vLLM may take for its weights and KV cache (the trainer shares the
    GPU; TRL's colocate default)."""
    vllm_sleep: bool = False
    """Put the vLLM engine to sleep during the updates (frees its memory; slower)."""
    vllm_sleep_level: Literal[1, 2] = 2
    """With vllm_sleep: 2 (TRL and verl) discards the engine's weights and KV cache during the
    updates, and the new weights are pushed after them; 1 copies the weights to CPU memory and
    back (stale weights, moved twice per step)."""
    vllm_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """The engine's dtype. auto: model.dtype when set, else vLLM's own choice (the checkpoint's
    dtype; float32 checkpoints run in bfloat16)."""
    vllm_max_model_len: int | None = None
    """Longest prompt + response the engine serves. None: the model's context (vLLM's default);
    set it to the longest prompt + max_new_tokens to leave more memory for the KV cache. At most 10^8."""
    vllm_max_num_seqs: int | None = None
    """Most sequences the engine decodes at once (at most 10^6). None: vLLM's default."""
    vllm_max_num_batched_tokens: int | None = 4096
    """Most tokens in one engine step (prefill chunks). 4096, as TRL's colocate mode sets it
    (vLLM's memory profiler is misled by its larger default). At most 10^8. None: vLLM's default."""
    vllm_enforce_eager: bool = False
    """Run the engine without CUDA graphs (less memory and start-up time, slower decoding)."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    """More ``vllm.LLM`` arguments, e.g. ``vllm_kwargs.kv_cache_dtype=fp8``. Not those cispo sets
    (the fields above, model, seed, logprobs_mode, ...: an error names the setting to use);
    ``hf_overrides`` is merged with the FP32 head's."""

    def __post_init__(self) -> None:
        """``rollout.max_turns`` refused outside 1 to 1000 (`MAX_TURNS`), naming the field."""
        turns = self.max_turns
        if isinstance(turns, bool) or not isinstance(turns, int) or not 1 <= turns <= MAX_TURNS:
            raise ValueError(f"rollout.max_turns must be an int from 1 to {MAX_TURNS} (tool turns per response), "
                             f"got {self.max_turns!r}")
