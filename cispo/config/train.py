"""The run's configuration: one dataclass per concern, a docstring per field.

``cispo train --help`` lists these fields with their docstrings; `cispo.config.engine` reads
YAML files and ``key=value`` overrides into them (checked by pydantic: types, ``Literal``
choices, unknown keys, and each class's ``__post_init__``) and names the key in every error.

The sections have modules of their own (`cispo.config.model`, ``data``, ``rollout``, ``algo``
with ``optim``); this one holds the run as a whole, `TrainConfig` (its length, checkpoints,
evaluation and records), and the checks of `TrainConfig.__post_init__`, which read settings
across sections. It still has every name it had before the split, so ``from
cispo.config.train import ModelConfig, to_dict`` keeps working.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass

from cispo.config.algo import AlgoConfig, OptimConfig, schedule_checks
from cispo.config.data import DataConfig, EvalSetConfig
from cispo.config.describe import save_yaml
from cispo.config.engine import (
    ConfigError,
    apply_overrides,
    field_docs,
    from_dict,
    load_yaml,
    note_values,
    rename_key,
    section_shorthand,
    to_dict,
)
from cispo.config.model import ModelConfig
from cispo.config.rollout import OWNED_ARGUMENTS, RolloutConfig, check_vllm_kwargs, processes  # noqa: F401 - still a name here
from cispo.foundations.suggest import did_you_mean

__all__ = [
    "AlgoConfig", "DataConfig", "EvalConfig", "EvalSetConfig", "ModelConfig", "OptimConfig", "RolloutConfig",
    "TrainConfig", "ConfigError", "apply_overrides", "field_docs", "from_dict", "load_yaml",
    "save_yaml", "to_dict",
]


@dataclass
class EvalConfig:
    """Periodic held-out evaluation."""

    every: int = 10
    """Evaluate every this many steps (and before the first and after the last). 0: only then."""
    num_samples: int | None = None
    """k: samples per prompt for the mean accuracy (the analogue of avg@k), at most 10^6. 0: greedy only
    (half the time or less; ``eval/accuracy`` is then the greedy accuracy). None: the built-in task's own
    (``Task.eval_num_samples``: 4; ``wordmath`` and ``wordmath_working``: 0), 4 for a prompt file; at least
    the largest of ``pass_at_k``."""
    temperature: float = 1.0
    """Temperature of the k samples (greedy accuracy is also reported)."""
    pass_at_k: list[int] | None = None
    """pass@k and maj@k also at each of these k (``eval/accuracy_pass_at_<k>``, ...), from the ``num_samples``
    samples per prompt: pass@k by the unbiased estimator (Chen et al. 2021, the expected best of k drawn
    from them), maj@k over the first k. Each k in [1, num_samples]. None: at k = num_samples only."""


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
    """Generation batches (RL steps); at most 10^9 (more would never end)."""
    seed: int = 0
    """Seeds sampling, shuffling and the prompt order: 0 to 2^31 - 1 (each torchrun rank and step
    adds to it, and the sum must stay a seed numpy, and so vLLM, accepts: below 2^32)."""
    out_dir: str = "runs"
    """Folder that holds the run folders."""
    run_name: str | None = None
    """Run folder name. None: ``{objective}__{task}__seed{seed}``; with ``recipe=NAME`` on the command line
    ``{recipe}__{task}__seed{seed}`` (set here in the run's config.yaml)."""
    checkpoint_every: int = 20
    """Save a checkpoint every this many steps (and at the end). 0: only at the end."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep. 0: all. Each holds what ``--resume`` needs: the weights and AdamW's
    two moments, about 3x the float32 weights (1.6 GB for SmolLM2-135M); its ``model/`` alone is the model."""
    threads: int | None = None
    """torch CPU threads, at most 1024. None: picked by load (``cispo.foundations.threads.pick_threads``: 2 when another
    core is idle, else 1; docs/performance.md)."""
    progress: bool = True
    """Progress bars at a terminal: the steps', with the newest held-out accuracy, and each evaluation's own.
    false, or where stderr is no terminal (a log file, a pipe, a batch job) or one that reports 0 columns: one
    plain line per step (``cispo: step N: reward ..., eval_acc ...; 3.2 s (N/steps)``) and a line when step 0's
    evaluation starts and ends. The start-up phases (reward workers, the model) say a line each either way."""
    max_bad_steps: int = 3
    """Stop (with a checkpoint of the last good weights) after this many consecutive steps
    whose every update had a non-finite gradient (under float16 loss scaling: once the loss
    scale has backed off below 1, so the scaler's own overflow probing does not count). A step's own updates
    are counted, however many it makes; a step that makes none (every group dropped) leaves the count as it is."""
    trackers: list[str] | str = field(default_factory=list)
    """Metric sinks besides metrics.jsonl: ``tensorboard``, ``wandb``, ``mlflow``
    (``pip install 'cispo[wandb]'`` etc.); a list, or one name (read as a list of it). W&B and MLflow
    read their usual environment variables (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, ...); see docs/api.md."""
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
        if isinstance(self.trackers, str):  # one sink, as TRL's report_to takes it
            self.trackers = [self.trackers]
        check_finite(self)
        problems = setting_problems(self)
        if problems:  # all of them at once: a user fixes them in one go, not one error per run
            raise ValueError(problems[0] if len(problems) == 1 else
                             f"{len(problems)} settings to fix: " + "; ".join(problems))
        check_vllm_kwargs(self.rollout.vllm_kwargs)  # an argument cispo sets itself -> ValueError naming how
        check_sink_kinds(self.trackers)  # unknown name -> ValueError with a suggestion
        check_objective(self)  # an unknown preset, or one the other settings cannot serve


# ---------------------------------------------------------------------------------------
# TrainConfig's checks, one function per concern. Each returns (key, acceptable, why not)
# triples; `setting_problems` reports every failing one, in the order of `_SETTING_CHECKS`.
# ---------------------------------------------------------------------------------------

Check = tuple[str, object, str]
"""(dotted key, a truthy value when its setting is acceptable, why it is not): one check."""


def _schedule_checks(cfg: TrainConfig) -> list[Check]:
    """The run's length, checkpoints, threads and bad-step patience: refuses counts that count
    nothing (no steps, no threads, stopping before the first bad step) and negative intervals."""
    return [
        ("steps", cfg.steps >= 1, "must be >= 1"),
        ("checkpoint_every", cfg.checkpoint_every >= 0, "must be >= 0 (0: only at the end)"),
        ("keep_checkpoints", cfg.keep_checkpoints >= 0, "must be >= 0 (0: all)"),
        ("threads", cfg.threads is None or cfg.threads >= 1, "must be >= 1 or None (by load)"),
        ("max_bad_steps", cfg.max_bad_steps >= 1, "must be >= 1"),
    ]


def _model_checks(cfg: TrainConfig) -> list[Check]:
    """The policy's LoRA rank, compilation and device: refuses a negative rank, ``compile=on``
    with FSDP (sharded units are not compiled) and a ``cuda:N`` device under vLLM, whose engine
    takes the GPU of the process's LOCAL_RANK whatever the trainer's device."""
    model, engine = cfg.model, cfg.rollout.engine
    return [
        ("model.lora_rank", model.lora_rank >= 0, "must be >= 0"),
        ("model.compile", not (model.compile == "on" and model.fsdp),
         "=on cannot be combined with model.fsdp (sharded units are not compiled): use auto or off"),
        ("model.device", not (engine == "vllm" and re.fullmatch(r"cuda:[1-9]\d*", model.device)),
         f"is {model.device}, which rollout.engine=vllm cannot use: vLLM's engine takes the GPU of the "
         "process's LOCAL_RANK (0 without torchrun): use model.device=cuda and pick the GPU with "
         "CUDA_VISIBLE_DEVICES"),
    ]


def _vllm_engine_checks(cfg: TrainConfig) -> list[Check]:
    """The vLLM engine's sizes: refuses a GPU memory share outside (0, 1] and a model length,
    sequence count or batched-token count below 1 (None leaves vLLM's default)."""
    r = cfg.rollout
    return [
        ("rollout.vllm_gpu_memory_utilization", 0 < r.vllm_gpu_memory_utilization <= 1, "must be in (0, 1]"),
        *((f"rollout.{k}", getattr(r, k) is None or getattr(r, k) >= 1, "must be >= 1 or None (vLLM's default)")
          for k in ("vllm_max_model_len", "vllm_max_num_seqs", "vllm_max_num_batched_tokens")),
    ]


def _sharding_checks(cfg: TrainConfig) -> list[Check]:
    """FSDP's combinations: refuses offloading without FSDP (there are no shards to offload),
    FSDP with LoRA under vLLM (the adapters are not merged across shards for the engine) and
    FSDP with float16 master weights (each shard's loss scaler would judge overflow alone)."""
    model = cfg.model
    return [
        ("model.fsdp_offload", not model.fsdp_offload or model.fsdp,
         "needs model.fsdp=true (it offloads the FSDP shards)"),
        ("model.fsdp", not (model.fsdp and cfg.rollout.engine == "vllm" and model.lora_rank),
         "with rollout.engine=vllm cannot be combined with model.lora_rank > 0 yet (the adapters are not "
         "merged across shards for the engine)"),
        ("model.dtype", not (model.fsdp and model.dtype == "float16" and model.master_weights),
         "float16 cannot be combined with model.fsdp (its loss scaler checks each shard's gradients for "
         "overflow on its own, so ranks could disagree on the scale): use bfloat16"),
    ]


def _data_checks(cfg: TrainConfig) -> list[Check]:
    """The prompt sets' sizes and the reward workers: refuses an empty training set, a negative
    held-out set, a reward timeout that is not positive and fewer than one worker."""
    d = cfg.data
    return [
        ("data.num_train_prompts", d.num_train_prompts >= 1, "must be >= 1"),
        ("data.num_eval_prompts", d.num_eval_prompts is None or d.num_eval_prompts >= 0,
         "must be >= 0 or None (the task's own)"),
        ("data.reward_timeout_s", d.reward_timeout_s is None or d.reward_timeout_s > 0, "must be > 0 or None (off)"),
        ("data.retire_pass_rate", d.retire_pass_rate is None or 0 < d.retire_pass_rate <= 1,
         "must be in (0, 1] or None (off)"),
        ("data.reward_workers", d.reward_workers is None or d.reward_workers >= 1, "must be >= 1 or None (auto)"),
        *_reward_list_checks(d),
    ]


def _reward_list_checks(d) -> list[Check]:
    """Several rewards: refuses an empty ``data.reward`` list, and ``data.reward_weights`` without a
    ``data.reward``, of another length than it, or not finite."""
    n = len(d.reward) if isinstance(d.reward, list) else int(d.reward is not None)
    weights = d.reward_weights
    return [
        ("data.reward", d.reward != [], "is an empty list: name at least one reward"),
        ("data.reward_weights", weights is None or len(weights) == n,
         f"has {len(weights or [])} weight(s) for {n} reward(s) in data.reward: give one weight per reward"),
        ("data.reward_weights", weights is None or all(math.isfinite(w) for w in weights), "must be finite numbers"),
    ]


def _prompt_file_checks(cfg: TrainConfig) -> list[Check]:
    """What a prompt file (``data.path``) needs and what needs one: refuses a prompt file without
    a model, a reward or a response length (the built-in task supplies all three), evaluation
    sets without one or with names unfit for metric names, and a system prompt without a chat
    template (a system message exists only in one)."""
    d, model = cfg.data, cfg.model
    return [
        ("model.path", d.path is None or model.path is not None,
         "is required with data.path (the tiny built-in base model knows only the built-in tasks' "
         "characters): a local Hugging Face model folder, builtin:smollm2-135m (SmolLM2-135M-Instruct "
         "shipped in a pip package, any text; docs/real-models.md) or a hub id org/name"),
        ("data.eval_sets", not d.eval_sets or d.path is not None,
         "needs data.path (the sets are scored by data.reward)"),
        *((f"data.eval_sets.{n}", re.fullmatch(r"[A-Za-z0-9_.-]+", n) is not None,
           "is not a usable set name (part of metric names: letters, digits, _ . - only)") for n in d.eval_sets),
        *((f"data.eval_sets.{n}.num_prompts", e.num_prompts is None or e.num_prompts >= 1, "must be >= 1 or None (all)")
          for n, e in d.eval_sets.items()),
        ("data.system_prompt", d.system_prompt is None or model.chat_template is not False,
         "needs model.chat_template=auto or true, not false (a system message exists only in a chat template)"),
        ("data.reward", d.path is None or d.reward is not None,
         "is required with data.path (math, exact_match, code, env or module:function)"),
        ("rollout.max_new_tokens", d.path is None or cfg.rollout.max_new_tokens is not None,
         "is required with data.path"),
    ]


def _rollout_checks(cfg: TrainConfig) -> list[Check]:
    """Sampling: refuses an empty batch, groups of one (a group-relative advantage needs two), a
    temperature the trainer cannot divide by, a nucleus outside (0, 1] and lengths, stops and
    rounds below their meaningful range."""
    r = cfg.rollout
    return [
        ("rollout.prompts_per_step", r.prompts_per_step >= 1, "must be >= 1"),
        ("rollout.group_size", r.group_size >= 2, "must be >= 2 (group-relative advantages)"),
        ("rollout.temperature", r.temperature > 0, "must be > 0 (the trainer's log-probs divide by it)"),
        ("rollout.top_p", 0 < r.top_p <= 1, "must be in (0, 1]"),
        ("rollout.top_k", r.top_k >= 0, "must be >= 0 (0: off)"),
        ("rollout.min_p", 0 <= r.min_p < 1, "must be in [0, 1) (0: off)"),
        ("rollout.repetition_penalty", 0 < r.repetition_penalty < math.inf, "must be > 0 and finite (1: off)"),
        ("rollout.max_new_tokens", r.max_new_tokens is None or r.max_new_tokens >= 1, "must be >= 1 or None"),
        ("rollout.repetition_stop_tokens", r.repetition_stop_tokens is None or r.repetition_stop_tokens >= 0,
         "must be >= 0 (0: off) or None"),
        ("rollout.overlong_buffer", r.overlong_buffer is None or r.overlong_buffer >= 1, "must be >= 1 or None (off)"),
        ("rollout.max_sampling_rounds", r.max_sampling_rounds >= 1, "must be >= 1"),
    ]


def _algo_checks(cfg: TrainConfig) -> list[Check]:
    """The schedule of updates: refuses fewer than one update, epoch or micro-batch row, more
    updates than a batch has rows (a mini-batch would be empty); per-turn credit with an estimator other
    than its own leave-one-out one (``rloo``); and the rollout correction's: a TIS
    cap that is not positive, tis_cap next to rollout_is (one name for one correction), bounds that are
    negative, not finite, out of order, both None or a lower bound above 1 (an on-policy token's ratio), and
    bounds or a mode set with no correction to read them;
    the k2 / k3 rejection's threshold exactly where those modes read it."""
    a, r = cfg.algo, cfg.rollout
    rows = r.prompts_per_step * r.group_size
    lower, upper = a.rollout_is_lower, a.rollout_is_upper
    divergence = a.rollout_is_mode in ("reject-k2", "reject-k3")  # a threshold of its own, no bounds of rho
    return [
        ("algo.updates_per_batch", a.updates_per_batch >= 1, "must be >= 1"),
        ("algo.updates_per_batch", a.updates_per_batch <= rows,
         f"must be <= the rows of a batch, prompts_per_step * group_size = {rows}"),
        ("algo.epochs", a.epochs >= 1, "must be >= 1"),
        ("algo.turn_credit", a.turn_credit == "episode" or a.advantage_estimator == "rloo",
         f"=reward_to_go takes each turn's leave-one-out baseline with no std scaling, which is "
         f"algo.advantage_estimator=rloo, not {a.advantage_estimator} (grpo, batch-std and batch-raw-std divide by a "
         "standard deviation; drgrpo's mean holds the episode's own return): set algo.advantage_estimator=rloo"),
        ("algo.advantage_estimator", a.advantage_estimator != "gdpo" or cfg.rollout.overlong_buffer is None,
         "=gdpo normalises each data.reward's score on its own, and rollout.overlong_buffer's penalty is none of "
         "them: leave one of the two out"),
        ("algo.micro_batch_size", a.micro_batch_size is None or a.micro_batch_size >= 1, "must be >= 1 or None"),
        ("algo.tis_cap", a.tis_cap is None or 0 < a.tis_cap < math.inf, "must be > 0 and finite, or None"),
        ("algo.tis_cap", a.tis_cap is None or a.rollout_is is None,
         f"cannot be set with algo.rollout_is={a.rollout_is} (tis_cap is rollout_is=token, rollout_is_mode=truncate, "
         "rollout_is_upper=tis_cap): set one or the other"),
        ("algo.rollout_is_lower", lower is None or 0 <= lower < math.inf, "must be >= 0 and finite, or None"),
        ("algo.rollout_is_upper", upper is None or 0 < upper < math.inf, "must be > 0 and finite, or None"),
        ("algo.rollout_is_upper", lower is None or upper is None or lower < upper,
         f"must be > algo.rollout_is_lower = {lower}"),
        ("algo.rollout_is_lower", lower is None or lower <= 1,
         f"= {lower} must be <= 1: an on-policy token's ratio is 1, so a window above it would mask or reject "
         "every token of an on-policy batch (no update would learn)"),
        ("algo.rollout_is", a.rollout_is is None or lower is not None or upper is not None,
         "needs a bound: algo.rollout_is_lower, algo.rollout_is_upper or both"),
        ("algo.rollout_is_max_divergence",
         a.rollout_is is None or (a.rollout_is_max_divergence is not None) == divergence,
         f"is the threshold of rollout_is_mode=reject-k2 / reject-k3: {'set it' if divergence else 'leave it out'} "
         f"with rollout_is_mode={a.rollout_is_mode}"),
        ("algo.rollout_is_max_divergence", a.rollout_is_max_divergence is None or 0 < a.rollout_is_max_divergence
         < math.inf, "must be > 0 and finite, or None"),
        ("algo.rollout_is_lower", not divergence or lower is None,
         f"is not read by rollout_is_mode={a.rollout_is_mode} (it bounds a divergence estimate: "
         "algo.rollout_is_max_divergence): leave it out"),
        ("algo.rollout_is", a.rollout_is is not None or _is_default(a, IS_SETTINGS),
         f"is off, so {', '.join(f'algo.{k}' for k in IS_SETTINGS if not _is_default(a, (k,)))} would be ignored: "
         "set the correction's level (algo.rollout_is=token, seq-mean or seq-sum) or leave its settings out"),
    ]


IS_SETTINGS = ("rollout_is_mode", "rollout_is_lower", "rollout_is_upper", "rollout_is_max_divergence")
"""The rollout correction's settings, read only with ``algo.rollout_is``."""


def _is_default(section, names) -> bool:
    """Whether each field of ``names`` of config ``section`` has its default value."""
    defaults = {f.name: f.default for f in dataclasses.fields(section)}
    return all(getattr(section, n) == defaults[n] for n in names)


def _logp_old_checks(cfg: TrainConfig) -> list[Check]:
    """``algo.logp_old=rollout`` (pi_old := the sampler's log-probs) only where the sampler is the trainer's
    own policy at float32: refuses another engine (vLLM), dropout in the trainer's passes (the sampler
    runs without), a low-precision ``model.dtype``, a rollout correction (pi_old / pi_rollout = 1: every
    weight 1) and FSDP (not tested sharded). Greedy sampling is refused for every run (`_rollout_checks`);
    what the config cannot tell (a model saved in low precision) `cispo.training.logp_old` checks at the run."""
    a, m, engine = cfg.algo, cfg.model, cfg.rollout.engine
    if a.logp_old != "rollout":
        return []
    head = "=rollout (the sampler's log-probs as pi_old) cannot be combined with"
    fix = "use algo.logp_old=recompute"
    return [
        ("algo.logp_old", engine != "vllm", f"{head} rollout.engine={engine}: another engine's log-probs are not the "
         f"trainer's (its kernels and precision); {fix}, with algo.tis_cap or algo.rollout_is for the mismatch"),
        ("algo.logp_old", not m.dropout, f"{head} model.dropout=true: the trainer's passes drop units the sampler "
         f"keeps, so pi_old is not the distribution sampled from; {fix}"),
        ("algo.logp_old", not m.lora_dropout, f"{head} model.lora_dropout={m.lora_dropout}: the trainer's passes "
         f"drop adapter inputs the sampler keeps; {fix}"),
        ("algo.logp_old", m.dtype not in ("bfloat16", "float16"), f"{head} model.dtype={m.dtype}: the sampler's "
         f"decode and the trainer's forward differ by its rounding, which the recomputed pass sees; {fix} or "
         "model.dtype=float32"),
        ("algo.logp_old", a.tis_cap is None and a.rollout_is is None, f"{head} a rollout correction (algo.tis_cap="
         f"{a.tis_cap}, algo.rollout_is={a.rollout_is}): with pi_old = pi_rollout every correction weight "
         f"pi_old / pi_rollout is 1; drop the correction or {fix}"),
        ("algo.logp_old", not m.fsdp, f"{head} model.fsdp=true yet (not tested sharded); {fix}"),
        ("algo.logp_old", not processes(cfg.rollout), f"{head} rollout.top_p, top_k, min_p or repetition_penalty: the "
         "sampler's log-probs are then of the processed distribution it sampled, pi_old of the model's own; "
         f"{fix}, with algo.rollout_is (or algo.tis_cap) to weight the difference"),
    ]


def _async_checks(cfg: TrainConfig) -> list[Check]:
    """``rollout.async_steps=1`` (docs/async.md): a vLLM engine that stays awake (it samples while the trainer
    updates), and an anchor that sees the staleness — ``algo.logp_old=rollout`` (the behaviour policy's log-probs)
    or a rollout correction beside the recomputed pass (its weight is then pi_proximal / pi_behaviour, AReaL's
    decoupled objective)."""
    a, r = cfg.algo, cfg.rollout
    if r.async_steps == 0:
        return []
    corrected = a.tis_cap is not None or a.rollout_is is not None
    return [
        ("rollout.async_steps", not (r.engine == "vllm" and r.vllm_sleep), "=1 with rollout.vllm_sleep=true: the "
         "engine samples the next batch while the trainer updates, so it cannot sleep then; set "
         "rollout.vllm_sleep=false (and leave the trainer room beside rollout.vllm_gpu_memory_utilization)"),
        ("rollout.async_steps", a.logp_old == "rollout" or corrected, "=1 with algo.logp_old=recompute and no "
         "rollout correction: the sampler's staleness would enter neither the ratio (pi_old recomputed with the "
         "trainer's weights) nor a correction weight, which leaves CISPO's cap inert on it; set "
         "algo.logp_old=rollout (the behaviour policy's anchor, docs/async.md) or a correction "
         "(algo.rollout_is=token algo.rollout_is_upper=2, or algo.tis_cap=2)"),
    ]


MAX_LR = 1.0
"""The largest ``optim.lr`` accepted: AdamW moves each weight by about ``lr`` per update."""


def _optim_checks(cfg: TrainConfig) -> list[Check]:
    """AdamW's settings: refuses a learning rate outside (0, MAX_LR], eps = 0 (a weight whose
    gradient has been 0 would turn NaN), betas outside [0, 1), a decay that shrinks a weight
    by its whole value or more per step, and negative clipping or warm-up."""
    o = cfg.optim
    return [
        ("optim.lr", 0 < o.lr <= MAX_LR, f"must be in (0, {MAX_LR:g}] (a larger AdamW step moves every "
         "weight by about lr per update: the weights turn non-finite)"),
        ("optim.eps", o.eps > 0, "must be > 0 (AdamW divides by sqrt(v) + eps; v is 0 for a weight "
         "whose gradient has been 0, so eps = 0 makes it NaN)"),
        ("optim.betas", all(0 <= b < 1 for b in o.betas), "must both be in [0, 1)"),
        ("optim.weight_decay", 0 <= o.weight_decay * o.lr < 1,
         "must be >= 0 with weight_decay * lr < 1 (AdamW multiplies each weight by 1 - lr * weight_decay)"),
        ("optim.grad_clip", o.grad_clip >= 0, "must be >= 0"),
        *schedule_checks(o),
    ]


def _eval_checks(cfg: TrainConfig) -> list[Check]:
    """The periodic evaluation: refuses a negative interval, sample count or temperature, and a pass@k
    at a k below 1 or above the samples drawn per prompt."""
    e, ks = cfg.eval, cfg.eval.pass_at_k or []
    return [
        ("eval.every", e.every >= 0, "must be >= 0 (0: only before the first and after the last step)"),
        ("eval.num_samples", e.num_samples is None or e.num_samples >= 0,
         "must be >= 0 (0: greedy only) or None (the task's own)"),
        ("eval.temperature", e.temperature >= 0, "must be >= 0"),
        ("eval.pass_at_k", all(k >= 1 for k in ks), f"must hold numbers >= 1, got {ks}"),
        ("eval.pass_at_k", e.num_samples is None or all(k <= e.num_samples for k in ks),
         f"asks for k = {max(ks, default=0)}, more than the eval.num_samples={e.num_samples} samples drawn per "
         "prompt: raise eval.num_samples (or leave it unset: the largest k)"),
        ("eval.pass_at_k", all(k <= UPPER_BOUNDS["eval.num_samples"][0] for k in ks),
         f"must hold numbers <= {UPPER_BOUNDS['eval.num_samples'][0]:,} (the samples are held in memory)"),
    ]


def _samples_checks(cfg: TrainConfig) -> list[Check]:
    """What samples.jsonl keeps: refuses a negative interval and a size, count or length limit
    that would keep nothing."""
    return [
        ("log_samples_every", cfg.log_samples_every >= 0, "must be >= 0 (0: never)"),
        ("max_samples_per_step", cfg.max_samples_per_step >= 1, "must be >= 1"),
        ("samples_max_chars", cfg.samples_max_chars >= 1, "must be >= 1"),
        ("samples_max_mb", cfg.samples_max_mb > 0, "must be > 0"),
    ]


MAX_SEED = 2**31 - 1
"""The largest ``seed`` and ``data.seed``. Seeds reach torch (``manual_seed``: below 2^64), the prompt
order (``seed * 1_000_003 + epoch``, `cispo.data.prompts.PromptStream`: below 2^63 while seed < 2^43)
and, under vLLM, numpy (``np.random.seed``: 0 to 2^32 - 1), each rank with ``seed + 1000 * rank``
and the evaluation with ``seed + step``: below 2^31 every sum stays below 2^32 for any run. A seed
of 2^64 was a traceback from torch; a negative one fails in numpy."""

UPPER_BOUNDS: dict[str, tuple[int, str]] = {
    "steps": (10**9, "a run of more would never end"),
    "threads": (1024, "more CPU threads than the largest machines have"),
    "data.num_train_prompts": (10**8, "more prompts than any data set; the built-in tasks build them in memory"),
    "data.num_eval_prompts": (10**8, "more prompts than any data set; the built-in tasks build them in memory"),
    "data.reward_workers": (1024, "each is a process: more than the largest machines have cores"),
    "model.lora_rank": (65536, "wider than any layer it adapts"),
    "rollout.prompts_per_step": (10**6, "a generation batch is held in memory"),
    "rollout.group_size": (10**6, "a generation batch is held in memory"),
    "rollout.max_new_tokens": (10**8, "10 times the longest context of any model; the sampler allocates it"),
    "rollout.max_sampling_rounds": (10**4, "on a task whose groups all tie a higher cap would not end"),
    "rollout.vllm_max_model_len": (10**8, "10 times the longest context of any model"),
    "rollout.vllm_max_num_seqs": (10**6, "a generation batch is held in memory"),
    "rollout.vllm_max_num_batched_tokens": (10**8, "10 times the longest context of any model"),
    "algo.epochs": (10**6, "a run of more passes would never end"),
    "eval.num_samples": (10**6, "the samples are held in memory"),
}
"""Upper bounds of sizes and counts (each field's docstring says it): beyond them a value can only be a
mistake (``prompts_per_step=10**12``), and would end in an out-of-memory error, an overflow in torch,
numpy or vLLM (all take C integers), or a run that never ends, not in a message naming the key."""


def _bound_checks(cfg: TrainConfig) -> list[Check]:
    """Seeds outside [0, `MAX_SEED`] and sizes or counts above `UPPER_BOUNDS` (None: unset, passes)."""
    def value(key: str) -> object:
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        return node

    seeds = [(k, 0 <= value(k) <= MAX_SEED, f"must be in [0, {MAX_SEED}] (2^31 - 1: numpy and vLLM take seeds "
              "below 2^32, and each rank and step adds to it)") for k in ("seed", "data.seed")]
    return seeds + [(k, value(k) is None or value(k) <= bound, f"must be <= {bound:,} ({why})")
                    for k, (bound, why) in UPPER_BOUNDS.items()]


_SETTING_CHECKS = (_schedule_checks, _model_checks, _vllm_engine_checks, _sharding_checks, _data_checks,
                  _prompt_file_checks, _rollout_checks, _algo_checks, _logp_old_checks, _async_checks, _optim_checks,
                  _eval_checks, _samples_checks, _bound_checks)
"""`TrainConfig`'s checks of plain settings, in the order their problems are reported."""


def _fork_token_problems(cfg: TrainConfig) -> list[str]:
    """``data.fork_tokens`` that `cispo.foundations.forks.normalise` refuses (an empty or blank
    string, ...), as one problem naming why; [] when they are usable or None (the task's own)."""
    if cfg.data.fork_tokens is None:
        return []
    from cispo.foundations.forks import normalise

    try:
        normalise(cfg.data.fork_tokens)
    except ValueError as e:
        return [f"data.fork_tokens is not usable: {e}"]
    return []


def setting_problems(cfg: TrainConfig) -> list[str]:
    """Every refused plain setting of ``cfg`` as ``"<key> <why>"``: those of `_SETTING_CHECKS` in
    their order, then the fork strings'; [] when all are acceptable."""
    problems = [f"{name} {why}" for check in _SETTING_CHECKS for name, ok, why in check(cfg) if not ok]
    return problems + _fork_token_problems(cfg)


def check_objective(cfg: TrainConfig) -> None:
    """ValueError for the first setting the preset cannot serve: a reference model without a KL term (it
    would be unused); a KL term with LoRA or FSDP (the reference is neither adapted nor sharded);
    a fused head for a sequence-level ratio (a token's weight is unknown chunk by chunk) or under
    FSDP (not tested sharded)."""
    a, model = cfg.algo, cfg.model
    obj = a.objective.resolve()
    kl_coef = obj.kl_coef
    checks = [
        ("model.ref_path", model.ref_path is None or kl_coef > 0,
         "is set but algo.objective.kl_coef is 0: the reference model would be unused"),
        ("algo.objective.kl_coef", kl_coef == 0 or model.lora_rank == 0,
         "> 0 cannot be combined with model.lora_rank > 0 (a reference model next to LoRA adapters "
         "is not supported yet)"),
        ("algo.objective.kl_coef", kl_coef == 0 or not model.fsdp,
         "> 0 cannot be combined with model.fsdp (the reference model is not sharded)"),
        ("algo.fused_head", not a.fused_head or obj.ratio_level == "token",
         f"needs a token-level ratio; algo.objective.name={a.objective.name} has ratio_level={obj.ratio_level!r} "
         "(a token's weight depends on its whole sequence, unknown chunk by chunk): set algo.fused_head=false"),
        ("algo.fused_head", not (a.fused_head and model.fsdp),
         "cannot be combined with model.fsdp yet (the fused head is not tested under sharding)"),
    ]
    for name, ok, why in checks:
        if not ok:
            raise ValueError(f"{name} {why}")


def _recipe_names() -> dict[str, str]:
    """`cispo.objective.presets.RECIPE_NAMES`: a recipe's names, each with the answer that says to use the recipe."""
    from cispo.objective.presets import RECIPE_NAMES

    return RECIPE_NAMES


# run folders written before a key was renamed still load (their config.yaml, ``--resume``)
rename_key(TrainConfig, "data.fork_token", "data.fork_tokens", lambda word: [word])  # one string, then a list
# a paper's recipe typed as an objective (algo.objective=dr_grpo) is answered with the recipe, not the nearest preset
note_values(TrainConfig, "algo.objective.name", _recipe_names())
# algo.objective=ppo (and objective: ppo in a file, as every config.yaml before the section had it) names the preset
section_shorthand(TrainConfig, "algo.objective", "name")
# the objective's fields were an untyped mapping, algo.objective_overrides, in config.yaml files written before
rename_key(TrainConfig, "algo.objective_overrides", "algo.objective")
