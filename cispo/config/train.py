"""The run's configuration: one dataclass per concern, a docstring per field.

``cispo train --help`` lists these fields with their docstrings; `cispo.config.engine` reads
YAML files and ``key=value`` overrides into them (checked by pydantic: types, ``Literal``
choices, unknown keys, and each class's ``__post_init__``) and names the key in every error.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Iterable, Literal

from cispo.config.engine import (ConfigError, apply_overrides, field_docs, format_help, from_dict, load_yaml,
                                 rename_key, save_yaml, to_dict)
from cispo.foundations.suggest import did_you_mean

__all__ = [
    "AlgoConfig", "DataConfig", "EvalConfig", "EvalSetConfig", "ModelConfig", "OptimConfig", "RolloutConfig",
    "TrainConfig", "ConfigError", "apply_overrides", "field_docs", "format_help", "from_dict", "load_yaml",
    "save_yaml", "to_dict",
]


# ---------------------------------------------------------------------------------------
# vLLM engine arguments that cispo sets itself (cispo.rollout.vllm_engine builds them)
# ---------------------------------------------------------------------------------------

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


# =======================================================================================
# The run's configuration: one dataclass per concern, a docstring per field.
# =======================================================================================


@dataclass
class ModelConfig:
    """The policy."""

    path: str | None = None
    """Local Hugging Face causal-LM folder, ``builtin:<name>`` (a real model shipped in a pip
    package, `cispo.models.packaged`) or a hub id ``org/name``. None: the built-in base model of the task
    (shipped with the package; `cispo.models.builtin`)."""
    fp32_lm_head: bool = True
    """Compute the LM head (logits, log-probs) in FP32: MiniMax-M1's fix for the train /
    rollout probability mismatch."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:1``, … or ``auto`` (CUDA when available)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Parameter dtype: ``float32``, ``bfloat16``, ``float16``. None: as saved."""
    chat_template: bool = False
    """Wrap each prompt (or its ``messages``) in the tokenizer's chat template."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    lora_rank: int = 0
    """LoRA rank (``pip install "cispo[lora]"``): train rank-r adapters on every linear layer
    but lm_head. 0: full fine-tuning."""
    lora_alpha: float = 16.0
    """LoRA scale: the adapters' output is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_target_modules: list[str] | None = None
    """Module names to adapt. None: all linear layers but lm_head."""
    fsdp: bool = False
    """Under ``torchrun`` with several processes: shard the parameters, gradients and
    optimizer state across them with FSDP2 (one unit per decoder layer, plus the rest), for
    a model that does not fit one device with its gradients and Adam state. Off: every
    process holds the whole model. With a low-precision model.dtype (and master weights) the
    decoder layers gather their weights in that dtype and reduce gradients in FP32 (FSDP2's
    ``MixedPrecisionPolicy``, as verl does) over FP32 shards; the root unit (embeddings, final
    norm, LM head) stays FP32, so the FP32 head uses the FP32 weight. With rollout.engine=vllm
    each rank's engine takes the full weights, gathered one tensor at a time. Ignored in a single
    process."""
    fsdp_offload: bool = False
    """With model.fsdp: keep the sharded parameters, gradients and optimizer state in CPU memory
    (FSDP2's ``CPUOffloadPolicy``; each unit is copied to the GPU to run), for a model whose shards
    do not fit the GPUs; the optimizer step then runs on the CPU (much slower)."""
    dropout: bool = False
    """Keep the model's dropout in the RL passes (logp_old and the updates). Off (default, as
    TRL and verl do): every dropout probability is set to 0 at load, so pi_old and the updated
    policy are the deterministic distribution the sampler draws from."""
    master_weights: bool = True
    """With a low-precision ``dtype`` (bfloat16, float16; or one saved in the checkpoint):
    keep FP32 parameters, gradients and AdamW state and compute under torch.autocast in that
    dtype (mixed precision; float16 adds dynamic loss scaling, ``cispo.models.policy.loss_scaler``).
    False: the parameters themselves are low precision (less memory; small updates are rounded
    away — a warning says so; float16 then has no loss scaling)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Run the decoder of the trainer's passes (logp_old and the updates' forward + backward)
    and the sampler's static-cache decode step under ``torch.compile`` with dynamic shapes, the
    compiled graphs cached on disk under the cispo cache folder (``cispo.models.compile``). ``on``;
    ``off`` (eager); ``auto``: where it was
    measured to pay off: on a CPU with a C++ compiler for runs of at least
    ``cispo.models.compile.AUTO_MIN_STEPS`` (1000) steps (on the built-in models it saves a little per
    step and costs 10-100 s to compile; docs/performance.md), eager otherwise (no GPU measured).
    A compile that fails falls back to eager with a warning. Not with ``model.fsdp``."""
    ref_path: str | None = None
    """With ``algo.objective_overrides.kl_coef > 0``: local Hugging Face causal-LM folder of the
    frozen reference policy pi_ref (same tokenizer as the policy). None: a frozen copy of the
    initial policy (``model.path`` or the built-in model)."""


@dataclass
class EvalSetConfig:
    """One named evaluation set (``data.eval_sets``), with its own fields; scored by
    ``data.reward`` and reported as ``eval/<name>/...``."""

    path: str
    """JSONL / Parquet file, folder of shards, ``datasets`` folder or hub id (as ``data.path``)."""
    prompt_field: str = "prompt"
    """Field holding the prompt (text or chat messages); dotted paths allowed."""
    answer_field: str | None = "answer"
    """Field holding the reference answer, passed to the reward as ``answer`` (as ``data.answer_field``)."""
    extra_fields: list[str] | Literal["all"] | None = "all"
    """Columns passed to the reward as keyword arguments (as ``data.extra_fields``)."""
    split: str | None = None
    """Split of a folder or hub data set (required for a hub id)."""
    name: str | None = None
    """Subset of a hub data set."""
    num_prompts: int | None = None
    """Evaluate the first this many prompts; None: all of them."""


@dataclass
class DataConfig:
    """The prompts and their reward."""

    task: str = "addition"
    """Built-in task name (see ``cispo.data.tasks.list_tasks()``)."""
    seed: int = 0
    """Seed of the train / held-out prompt sets: fixed, so runs of any seed share prompts."""
    num_train_prompts: int = 20000
    """Size of the training prompt set drawn from the task's train split."""
    num_eval_prompts: int = 200
    """Held-out prompts used by the periodic evaluation."""
    path: str | None = None
    """Prompt file instead of the built-in task: JSONL, Parquet or a ``datasets`` folder."""
    eval_path: str | None = None
    """Held-out prompt file. None: a seeded slice of ``path`` (at most 1/5 of it)."""
    eval_sets: dict[str, EvalSetConfig] = field(default_factory=dict)
    """Named evaluation sets, each with its own path and fields, reported as ``eval/<name>/...``
    next to the held-out set's ``eval/...`` (``num_eval_prompts=0`` leaves only these)."""
    prompt_field: str = "prompt"
    """Field holding the prompt (text or chat messages); dotted paths allowed."""
    answer_field: str | None = "answer"
    """Field holding the reference answer, passed to the reward as ``answer`` (and under its own
    name). The default, ``answer``, may be missing from the whole file (then a reward that needs
    ``answer`` is refused before training); any other field must be in every row. None: no answer."""
    extra_fields: list[str] | Literal["all"] | None = "all"
    """Columns passed to the reward as keyword arguments: ``all`` (every column but the prompt's,
    under its own name, as TRL passes them), a list of fields (dotted paths allowed, each passed
    under its last component), or None (only ``answer`` and a chat prompt's ``messages``)."""
    split: str | None = None
    """Split of a ``datasets`` DatasetDict folder, of a folder of shards, or of a hub data set
    (required for a hub id)."""
    name: str | None = None
    """Subset (configuration) of a hub data set, ``datasets.load_dataset(path, name=...)``."""
    system_prompt: str | None = None
    """System message put before each prompt's chat messages (needs ``model.chat_template=true``;
    a row whose messages already start with a system message keeps its own)."""
    on_error: Literal["raise", "skip"] = "raise"
    """Malformed rows: ``raise`` (the first one, naming file, line and field) or ``skip``."""
    reward: str | None = None
    """Reward for ``path`` data: ``math``, ``exact_match``, ``code`` or ``module:function``."""
    fork_tokens: list[str] | None = None
    """Reflective (fork) strings whose use, probability and clipping are tracked per string
    (``fork/<string>/...`` metrics, ``rollout/fork_rate``), e.g. ``[Wait, However, "Let me check"]``:
    each in either case of its first letter, with or without a leading space, as a whole word — every
    token and token sequence of the vocabulary that spells it (docs/metrics.md). None: the task's own
    (``wordmath``: an English list; ``addition``, ``chain``: ``[W]``; prompt files: none); ``[]``: none.
    ``data.fork_token=Wait``, its old name (one string), still reads as ``[Wait]``."""
    reward_timeout_s: float | None = 60.0
    """Per-call reward timeout; a reward that hangs, raises or returns a non-number scores 0
    and is counted in ``rollout/reward_errors``. Applies to rewards in worker processes
    (``reward_isolation``); None: no timeout."""
    reward_isolation: Literal["auto", "process", "main"] = "auto"
    """Where ``reward`` runs: ``process`` (worker processes that a hang, exit or crash cannot
    take down; ``reward_timeout_s`` kills a call), ``main`` (the trainer's main thread; trusted,
    no timeout), ``auto``: ``main`` for the built-in names, ``process`` for ``module:function``
    and ``file.py:function``."""
    reward_workers: int | None = None
    """Worker processes of a ``process`` reward (>= 1). None: min(8, CPU count)."""


@dataclass
class RolloutConfig:
    """Sampling the generation batch."""

    prompts_per_step: int = 32
    """P: prompts (groups) per generation batch."""
    group_size: int = 8
    """G: responses sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same one)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    max_new_tokens: int | None = None
    """Longest response, in tokens. None: the task's longest well-formed answer + 25%."""
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
    high (e.g. 20) with ``algo.minibatch_policy=fixed_size``."""
    overlong_buffer: int | None = None
    """DAPO's soft overlong penalty: the last ``overlong_buffer`` tokens before
    max_new_tokens are penalised linearly down to -1. None: off."""
    overlong_scope: Literal["all", "paid"] = "all"
    """Which responses the overlong penalty reaches: ``all`` (DAPO) or ``paid``, only those the
    verifier pays (task reward > 0), so a group of unpaid answers stays uninformative
    (`cispo.data.rewards.shaped_reward`)."""
    engine: Literal["torch", "vllm"] = "torch"
    """Sampler: ``torch`` (the built-in KV-cache sampler) or ``vllm`` (needs a CUDA GPU and
    ``pip install "cispo[vllm]"``; weights are pushed to it after every step)."""
    decode: Literal["auto", "static", "hf"] = "auto"
    """How the torch sampler decodes: ``static`` (a preallocated KV cache written in place,
    rotary table and mask once per batch, stopped rows dropped; Llama / Qwen2 / Mistral),
    ``hf`` (the model's forward with its dynamic cache), ``auto`` (static where supported).
    Same tokens and log-probs either way; static is faster (docs/performance.md)."""
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
    set it to the longest prompt + max_new_tokens to leave more memory for the KV cache."""
    vllm_max_num_seqs: int | None = None
    """Most sequences the engine decodes at once. None: vLLM's default."""
    vllm_max_num_batched_tokens: int | None = 4096
    """Most tokens in one engine step (prefill chunks). 4096, as TRL's colocate mode sets it
    (vLLM's memory profiler is misled by its larger default). None: vLLM's default."""
    vllm_enforce_eager: bool = False
    """Run the engine without CUDA graphs (less memory and start-up time, slower decoding)."""
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    """More ``vllm.LLM`` arguments, e.g. ``vllm_kwargs.kv_cache_dtype=fp8``. Not those cispo sets
    (the fields above, model, seed, logprobs_mode, ...: an error names the setting to use);
    ``hf_overrides`` is merged with the FP32 head's."""


@dataclass
class AlgoConfig:
    """The objective and the schedule of off-policy updates."""

    objective: Literal["cispo", "ppo", "grpo", "dapo", "gspo", "reinforce", "cispo_lowmask", "cispo_highmask"] = "cispo"
    """Objective preset: cispo, ppo, grpo, dapo, gspo, reinforce; cispo_lowmask / cispo_highmask (CISPO with
    the lower / upper half of DAPO's trust region)."""
    objective_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of ``ObjectiveConfig`` to override, e.g. ``objective_overrides.eps_high_is=2.0``."""
    advantage_estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """Group-relative advantages: grpo, drgrpo, rloo."""
    updates_per_batch: int = 16
    """K: the generation batch is split into K mini-batches, one optimizer step each
    (MiniMax-M1: 16). With K = 1 every objective is identical (r = 1)."""
    minibatch_policy: Literal["fixed_updates", "fixed_size"] = "fixed_updates"
    """When dynamic sampling leaves the batch short of prompts_per_step groups: ``fixed_updates``
    keeps K updates on smaller mini-batches; ``fixed_size`` keeps the mini-batch at
    prompts_per_step * group_size / K rows and runs fewer updates (K_eff = kept rows // that,
    logged as ``optim/step_updates``), as DAPO's recipe keeps its mini-batch size."""
    epochs: int = 1
    """Passes over the generation batch (K optimizer steps each)."""
    micro_batch_size: int | None = None
    """Rows per forward/backward (gradient accumulation within a mini-batch). None: whole."""
    micro_batch_split_cost: float | None = 128.0
    """Length-sorted micro-batches: the rows of each mini-batch (and of the logp_old pass) are
    sorted by length and cut into micro-batches wherever a cut saves more padded decoder
    positions than this (the fixed cost of one more forward/backward, in positions), each of at
    most ``micro_batch_size`` rows and trimmed to its longest row. The mini-batches and the
    gradient are unchanged (up to float summation order). None: rows in random order, cut only
    by ``micro_batch_size``."""
    logp_old_from_update: bool = True
    """Take logp_old of the first update's rows (the first of the K mini-batches; with K = 1 the
    whole first epoch) from that update's own forward, detached, instead of a separate no-grad
    pass: it runs on the same weights over the same micro-batches, so the numbers are bitwise
    those of the separate pass, one forward fewer over 1/K of the batch. Applies only where
    exact: not with dropout (``model.dropout``, ``model.lora_dropout``), ``fused_head``,
    ``tis_cap`` or FSDP (``cispo.training.trainer.logp_old_from_update``). False: a separate pass over
    every row."""
    tis_cap: float | None = None
    """Truncated importance sampling for the rollout/trainer mismatch: each token's advantage
    is multiplied by min(pi_old / pi_rollout, tis_cap) (Yao et al. 2025 use 2). None: off."""
    fused_head: bool = False
    """Compute the LM head and the objective in one chunked pass in the updates
    (``cispo.objective.fused_head``): each chunk's gradient is formed in the forward while its logits
    exist, so the backward recomputes no logits (one large matmul fewer; docs/performance.md).
    The same gradient up to float rounding; the statistics come from the detached log-probs.
    Only for objectives whose per-token weight is known token by token: refused at config time
    for a sequence-level ratio (GSPO: a token's weight depends on its whole sequence) and with
    ``model.fsdp`` (not tested under sharding)."""


@dataclass
class OptimConfig:
    """AdamW, with MiniMax-M1's settings by default."""

    lr: float = 1e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2). MiniMax-M1: (0.9, 0.95); (0.9, 0.999) did not converge for them."""
    eps: float = 1e-15
    """AdamW epsilon. MiniMax-M1: 1e-15 (their gradients span 1e-18 .. 1e-5)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    warmup_updates: int = 16
    """Linear learning-rate warm-up over this many optimizer steps."""


@dataclass
class EvalConfig:
    """Periodic held-out evaluation."""

    every: int = 10
    """Evaluate every this many steps (and before the first and after the last). 0: only then."""
    num_samples: int = 4
    """k: samples per prompt for the mean accuracy (the analogue of avg@k). 0: greedy only (half
    the time or less; ``eval/accuracy`` is then the greedy accuracy)."""
    temperature: float = 1.0
    """Temperature of the k samples (greedy accuracy is also reported)."""


SINK_KINDS = ("jsonl", "tensorboard", "wandb", "mlflow")
"""The metric sinks ``trackers`` may name (`cispo.records.tracking` writes them)."""


def check_sink_kinds(kinds: Iterable[str]) -> list[str]:
    """``kinds`` validated, ``"jsonl"`` first, duplicates dropped. Unknown → ValueError
    with the closest known kind."""
    out = ["jsonl"]
    for kind in kinds:
        if kind not in SINK_KINDS:
            raise ValueError(f"unknown tracking sink {kind!r}{did_you_mean(kind, SINK_KINDS)}; "
                             f"known: {', '.join(SINK_KINDS)}")
        if kind not in out:
            out.append(kind)
    return out


MAX_LR = 1.0
"""The largest ``optim.lr`` accepted: AdamW moves each weight by about ``lr`` per update."""


def check_finite(cfg, prefix: str = "") -> None:
    """``ValueError`` naming the first float setting of the dataclass ``cfg`` (its sections and
    tuples included) that is NaN or infinite: no setting of a run means anything at either."""
    for f in fields(cfg):
        value, name = getattr(cfg, f.name), prefix + f.name
        if is_dataclass(value):
            check_finite(value, name + ".")
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{name} is {v}: must be a finite number")


@dataclass
class TrainConfig:
    """A CISPO (or PPO / GRPO / DAPO / GSPO / REINFORCE) training run."""

    steps: int = 60
    """Generation batches (RL steps)."""
    seed: int = 0
    """Seeds sampling, shuffling and the prompt order."""
    out_dir: str = "runs"
    """Folder that holds the run folders."""
    run_name: str | None = None
    """Run folder name. None: ``{objective}__{task}__seed{seed}``."""
    checkpoint_every: int = 20
    """Save a checkpoint every this many steps (and at the end). 0: only at the end."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep. 0: all."""
    threads: int | None = None
    """torch CPU threads. None: picked by load (``cispo.foundations.threads.pick_threads``: 2 when another
    core is idle, else 1; docs/performance.md)."""
    progress: bool = True
    """Show a progress bar."""
    max_bad_steps: int = 3
    """Stop (with a checkpoint of the last good weights) after this many consecutive steps
    whose every update had a non-finite gradient (under float16 loss scaling: once the loss
    scale has backed off below 1, so the scaler's own overflow probing does not count)."""
    trackers: list[str] = field(default_factory=list)
    """Metric sinks besides metrics.jsonl: ``tensorboard``, ``wandb``, ``mlflow``
    (``pip install 'cispo[wandb]'`` etc.). W&B and MLflow read their usual environment
    variables (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, ...); see docs/api.md."""
    log_samples_every: int = 1
    """Append some of the step's responses (prompt, completion, reward, advantage, fork /
    capped / PPO-dropped token counts) to ``<run>/samples.jsonl`` and the trackers every this
    many steps (docs/metrics.md). 0: never."""
    max_samples_per_step: int = 8
    """Responses saved per such step: the first ones of the batch, whole groups first."""
    samples_max_chars: int = 2000
    """Prompts and completions longer than this are cut (marked with ``…``) in the samples."""
    samples_max_mb: float = 50.0
    """``samples.jsonl`` stops growing (with a note) before it passes this size."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        """Every setting checked before any work: ``ValueError`` naming the key. None means the
        default; 0 or a negative number is an error where it has no meaning."""
        check_finite(self)
        r, a, d = self.rollout, self.algo, self.data
        rows = r.prompts_per_step * r.group_size
        checks = [
            ("steps", self.steps >= 1, "must be >= 1"),
            ("checkpoint_every", self.checkpoint_every >= 0, "must be >= 0 (0: only at the end)"),
            ("keep_checkpoints", self.keep_checkpoints >= 0, "must be >= 0 (0: all)"),
            ("threads", self.threads is None or self.threads >= 1, "must be >= 1 or None (by load)"),
            ("max_bad_steps", self.max_bad_steps >= 1, "must be >= 1"),
            ("model.lora_rank", self.model.lora_rank >= 0, "must be >= 0"),
            ("model.compile", not (self.model.compile == "on" and self.model.fsdp),
             "=on cannot be combined with model.fsdp (sharded units are not compiled): use auto or off"),
            ("model.device", not (r.engine == "vllm" and re.fullmatch(r"cuda:[1-9]\d*", self.model.device)),
             f"is {self.model.device}, which rollout.engine=vllm cannot use: vLLM's engine takes the GPU of the "
             "process's LOCAL_RANK (0 without torchrun): use model.device=cuda and pick the GPU with "
             "CUDA_VISIBLE_DEVICES"),
            ("rollout.vllm_gpu_memory_utilization", 0 < r.vllm_gpu_memory_utilization <= 1, "must be in (0, 1]"),
            *((f"rollout.{k}", getattr(r, k) is None or getattr(r, k) >= 1, "must be >= 1 or None (vLLM's default)")
              for k in ("vllm_max_model_len", "vllm_max_num_seqs", "vllm_max_num_batched_tokens")),
            ("model.fsdp_offload", not self.model.fsdp_offload or self.model.fsdp,
             "needs model.fsdp=true (it offloads the FSDP shards)"),
            ("model.fsdp", not (self.model.fsdp and r.engine == "vllm" and self.model.lora_rank),
             "with rollout.engine=vllm cannot be combined with model.lora_rank > 0 yet (the adapters are not "
             "merged across shards for the engine)"),
            ("model.dtype", not (self.model.fsdp and self.model.dtype == "float16" and self.model.master_weights),
             "float16 cannot be combined with model.fsdp (its loss scaler checks each shard's gradients for "
             "overflow on its own, so ranks could disagree on the scale): use bfloat16"),
            ("data.num_train_prompts", d.num_train_prompts >= 1, "must be >= 1"),
            ("data.num_eval_prompts", d.num_eval_prompts >= 0, "must be >= 0"),
            ("data.reward_timeout_s", d.reward_timeout_s is None or d.reward_timeout_s > 0, "must be > 0 or None (off)"),
            ("data.reward_workers", d.reward_workers is None or d.reward_workers >= 1, "must be >= 1 or None (auto)"),
            ("model.path", d.path is None or self.model.path is not None,
             "is required with data.path (the tiny built-in base model knows only the built-in tasks' "
             "characters): a local Hugging Face model folder, builtin:smollm2-135m (SmolLM2-135M-Instruct "
             "shipped in a pip package, any text; docs/real-models.md) or a hub id org/name"),
            ("data.eval_sets", not d.eval_sets or d.path is not None,
             "needs data.path (the sets are scored by data.reward)"),
            *((f"data.eval_sets.{n}", re.fullmatch(r"[A-Za-z0-9_.-]+", n) is not None,
               "is not a usable set name (part of metric names: letters, digits, _ . - only)") for n in d.eval_sets),
            *((f"data.eval_sets.{n}.num_prompts", e.num_prompts is None or e.num_prompts >= 1, "must be >= 1 or None (all)")
              for n, e in d.eval_sets.items()),
            ("data.system_prompt", d.system_prompt is None or self.model.chat_template,
             "needs model.chat_template=true (a system message exists only in a chat template)"),
            ("data.reward", d.path is None or d.reward is not None,
             "is required with data.path (math, exact_match, code or module:function)"),
            ("rollout.max_new_tokens", d.path is None or r.max_new_tokens is not None, "is required with data.path"),
            ("rollout.prompts_per_step", r.prompts_per_step >= 1, "must be >= 1"),
            ("rollout.group_size", r.group_size >= 2, "must be >= 2 (group-relative advantages)"),
            ("rollout.temperature", r.temperature > 0, "must be > 0 (the trainer's log-probs divide by it)"),
            ("rollout.top_p", 0 < r.top_p <= 1, "must be in (0, 1]"),
            ("rollout.max_new_tokens", r.max_new_tokens is None or r.max_new_tokens >= 1, "must be >= 1 or None"),
            ("rollout.repetition_stop_tokens", r.repetition_stop_tokens is None or r.repetition_stop_tokens >= 0,
             "must be >= 0 (0: off) or None"),
            ("rollout.overlong_buffer", r.overlong_buffer is None or r.overlong_buffer >= 1, "must be >= 1 or None (off)"),
            ("rollout.max_sampling_rounds", r.max_sampling_rounds >= 1, "must be >= 1"),
            ("algo.updates_per_batch", a.updates_per_batch >= 1, "must be >= 1"),
            ("algo.updates_per_batch", a.updates_per_batch <= rows,
             f"must be <= the rows of a batch, prompts_per_step * group_size = {rows}"),
            ("algo.epochs", a.epochs >= 1, "must be >= 1"),
            ("algo.micro_batch_size", a.micro_batch_size is None or a.micro_batch_size >= 1, "must be >= 1 or None"),
            ("algo.tis_cap", a.tis_cap is None or a.tis_cap > 0, "must be > 0 or None"),
            ("optim.lr", 0 < self.optim.lr <= MAX_LR, f"must be in (0, {MAX_LR:g}] (a larger AdamW step moves every "
             "weight by about lr per update: the weights turn non-finite)"),
            ("optim.eps", self.optim.eps > 0, "must be > 0 (AdamW divides by sqrt(v) + eps; v is 0 for a weight "
             "whose gradient has been 0, so eps = 0 makes it NaN)"),
            ("optim.betas", all(0 <= b < 1 for b in self.optim.betas), "must both be in [0, 1)"),
            ("optim.weight_decay", 0 <= self.optim.weight_decay * self.optim.lr < 1,
             "must be >= 0 with weight_decay * lr < 1 (AdamW multiplies each weight by 1 - lr * weight_decay)"),
            ("optim.grad_clip", self.optim.grad_clip >= 0, "must be >= 0"),
            ("optim.warmup_updates", self.optim.warmup_updates >= 0, "must be >= 0"),
            ("eval.every", self.eval.every >= 0, "must be >= 0 (0: only before the first and after the last step)"),
            ("eval.num_samples", self.eval.num_samples >= 0, "must be >= 0 (0: greedy only)"),
            ("eval.temperature", self.eval.temperature >= 0, "must be >= 0"),
            ("log_samples_every", self.log_samples_every >= 0, "must be >= 0 (0: never)"),
            ("max_samples_per_step", self.max_samples_per_step >= 1, "must be >= 1"),
            ("samples_max_chars", self.samples_max_chars >= 1, "must be >= 1"),
            ("samples_max_mb", self.samples_max_mb > 0, "must be > 0"),
        ]
        problems = [f"{name} {why}" for name, ok, why in checks if not ok]
        if d.fork_tokens is not None:
            from cispo.foundations.forks import normalise

            try:
                normalise(d.fork_tokens)
            except ValueError as e:
                problems.append(f"data.fork_tokens is not usable: {e}")
        if problems:  # all of them at once: a user fixes them in one go, not one error per run
            raise ValueError(problems[0] if len(problems) == 1 else
                             f"{len(problems)} settings to fix: " + "; ".join(problems))
        check_vllm_kwargs(r.vllm_kwargs)  # an argument cispo sets itself -> ValueError naming how
        from cispo.objective.presets import preset

        check_sink_kinds(self.trackers)  # unknown name -> ValueError with a suggestion
        obj = preset(a.objective, **a.objective_overrides)  # unknown name / field / bad value
        kl_coef = obj.kl_coef
        ref_checks = [
            ("model.ref_path", self.model.ref_path is None or kl_coef > 0,
             "is set but algo.objective_overrides.kl_coef is 0: the reference model would be unused"),
            ("algo.objective_overrides.kl_coef", kl_coef == 0 or self.model.lora_rank == 0,
             "> 0 cannot be combined with model.lora_rank > 0 (a reference model next to LoRA adapters "
             "is not supported yet)"),
            ("algo.objective_overrides.kl_coef", kl_coef == 0 or not self.model.fsdp,
             "> 0 cannot be combined with model.fsdp (the reference model is not sharded)"),
            ("algo.fused_head", not a.fused_head or obj.ratio_level == "token",
             f"needs a token-level ratio; algo.objective={a.objective} has ratio_level={obj.ratio_level!r} "
             "(a token's weight depends on its whole sequence, unknown chunk by chunk): set algo.fused_head=false"),
            ("algo.fused_head", not (a.fused_head and self.model.fsdp),
             "cannot be combined with model.fsdp yet (the fused head is not tested under sharding)"),
        ]
        for name, ok, why in ref_checks:
            if not ok:
                raise ValueError(f"{name} {why}")


# run folders written before a key was renamed still load (their config.yaml, ``--resume``)
rename_key(TrainConfig, "data.fork_token", "data.fork_tokens", lambda word: [word])  # one string, then a list
