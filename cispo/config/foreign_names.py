"""TRL's and verl's names of cispo's settings (`OTHER_NAMES`): read as cispo's keys where they mean the
same, answered with cispo's key and the difference where they do not. `cispo.config.engine` reads an
unknown key through them (`lookup`, `describe`, `read_line`); docs/integrations.md shows the table
(tests/test_config.py checks that the two agree). Plain data, no cispo import."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["OTHER_NAMES", "OTHER_SECTIONS", "OtherName", "describe", "lookup", "other_name_hint", "read_line"]

@dataclass(frozen=True)
class OtherName:
    """TRL's or verl's name of a setting (a row of `OTHER_NAMES`): read as cispo's key where it means
    the same (``read``), else refused with cispo's key and how the two differ (``what``)."""

    source: str
    """``TRL`` (a field of trl 1.16's ``GRPOConfig``) or ``verl`` (a key of verl 0.9.1's ``ppo_trainer.yaml``)."""
    keys: tuple[str, ...]
    """cispo's key(s) of the setting; () where cispo has none."""
    what: str
    """Read: how the values map where they are not simply the same ("" where they are). Refused: how
    cispo's setting differs (the error says it)."""
    read: Callable[[Any], Any] | None = None
    """The value as cispo's (``keys[0]``), or ``ValueError`` saying why a value has no exact cispo
    equivalent. None: the name is refused whatever its value."""
    example: tuple[Any, Any] = ()
    """Read: a value as written for TRL or verl, and the value cispo's key then has."""

    @property
    def as_is(self) -> bool:
        """Read with its value unchanged (the same setting, the same values)."""
        return self.read is _same


def _same(value: Any) -> Any:
    """The value unchanged: the name means exactly cispo's key."""
    return value


def _is(a: Any, b: Any) -> bool:
    """``a == b`` of the same type (YAML's ``true`` is not ``1``)."""
    return type(a) is type(b) and a == b


def _values(table: dict, refused: dict | None = None) -> Callable[[Any], Any]:
    """A ``read``: each value of ``table`` to cispo's; any other refused (``refused[value]``: why)."""
    def read(value: Any) -> Any:
        for theirs, ours in table.items():
            if _is(value, theirs):
                return ours
        why = next((w for v, w in (refused or {}).items() if _is(value, v)), None)
        raise ValueError(why or "no cispo value equals it")
    return read


def _at_least(least: int, why: str) -> Callable[[Any], Any]:
    """A ``read`` of a count >= ``least`` (the same in both); anything else refused with ``why``."""
    def read(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value >= least:
            return value
        raise ValueError(why)
    return read


def _positive(why: str) -> Callable[[Any], Any]:
    """A ``read`` of a number > 0 (the same in both); anything else refused with ``why``."""
    def read(value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return value
        raise ValueError(why)
    return read


def _none_as(off: Any) -> Callable[[Any], Any]:
    """A ``read`` of a setting whose null means off: null as cispo's ``off``, any other value as it is."""
    return lambda value: off if value is None else value


def _top_k(value: Any) -> Any:
    """verl's ``top_k`` as cispo's: -1 (verl's off) is 0 (cispo's off), a k >= 0 the same."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= -1:
        return max(value, 0)
    raise ValueError("expected -1 (off) or a count of tokens >= 0")


def _one_file(value: Any) -> Any:
    """verl's data files (a path or a list of paths) as cispo's one path."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str):
        return value
    raise ValueError("cispo reads one path: put several files in a folder and give the folder")


def _report_to(value: Any) -> Any:
    """TRL's ``report_to`` as cispo's ``trackers`` (which checks the sink names itself)."""
    if _is(value, "all"):
        raise ValueError("TRL's all (every installed integration) is not read: name the sinks")
    return [] if value is None or _is(value, "none") else value  # none: read as null on the command line


def verl_k1_bounds(spec: Any) -> tuple[float, float]:
    """verl's ``rollout_rs_threshold`` of a k1 rejection (``"L_U"``, or one number U meaning ``"1/U_U"``) as
    cispo's bounds ``(rollout_is_lower, rollout_is_upper)`` of rho = pi_old / pi_rollout: verl keeps a token
    where log L <= k1 <= log U with k1 = -log rho, i.e. 1/U <= rho <= 1/L (its bounds are on pi_rollout / pi_old,
    cispo's on pi_old / pi_rollout: reciprocals)."""
    text = str(spec)
    lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (1.0 / float(text), float(text))
    if not 0 < lower <= upper:
        raise ValueError(f"verl's k1 threshold must be 0 < L <= U, got {spec!r}")
    return 1.0 / upper, 1.0 / lower


def _rollout_is_threshold(value: Any) -> Any:
    """verl's ``rollout_is_threshold`` as cispo's ``rollout_is_upper``: a number C (or its text) is TIS's
    upper bound; ``"L_U"`` (IcePop, the weight zeroed outside [L, U]) needs three keys: refused, translated."""
    if isinstance(value, str) and "_" in value:
        lower, upper = value.split("_", 1)
        raise ValueError(f"verl's \"L_U\" (IcePop: the weight rho inside [L, U], 0 outside) is "
                         f"algo.rollout_is_mode=mask algo.rollout_is_lower={lower} algo.rollout_is_upper={upper}")
    try:
        upper = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else math.nan
    except ValueError:
        upper = math.nan
    if not 0 < upper < math.inf:
        raise ValueError("expected a number > 0 or \"L_U\"")
    return upper


def _logger(value: Any) -> Any:
    """verl's ``trainer.logger`` as cispo's ``trackers``: ``console`` dropped, ``file`` is ``jsonl``."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list):
        raise ValueError("expected a logger name or a list of them")
    return [{"file": "jsonl"}.get(n, n) for n in names if n != "console"]


def _lora_targets(value: Any) -> Any:
    """verl's ``target_modules`` as cispo's ``lora_target_modules``: ``all-linear`` is None (every
    linear layer but lm_head, as PEFT's all-linear)."""
    return None if _is(value, "all-linear") else [value] if isinstance(value, str) else value


_PROMPTS_NOT_CUT = ("cispo never cuts a prompt: one whose tokens and rollout.max_new_tokens do not fit the model's "
                    "context is left out")
_SCHEDULES = ("the HF Trainer's linear, cosine, constant and constant_with_warmup, per optimizer update (cispo's "
              "warm-up starts at lr / W, HF's at 0); TRL's default is linear, cispo's constant_with_warmup")
_VERL_SCHEDULES = ("constant -> constant_with_warmup (verl's constant warms up), cosine -> cosine (at verl's default "
                   "min_lr_ratio 0 and num_cycles 0.5); verl's scheduler steps once per RL step, cispo's per "
                   "optimizer update")
_TRL_IS = ("TRL's default, true with sequence_mask and clip_max 3.0, is algo.rollout_is=seq-sum "
           "algo.rollout_is_mode=mask algo.rollout_is_upper=3")
_TRL_IS_MODES = ("token_truncate -> rollout_is=token rollout_is_mode=truncate, token_mask -> token and mask, "
                 "sequence_truncate -> seq-sum and truncate, sequence_mask (TRL's default) -> seq-sum and mask "
                 "(TRL's sequence ratio is the product over the response: cispo's seq-sum)")
_VERL_RS = ("verl's rollout_rs rejects on k1 = -log rho against [log L, log U] of rollout_rs_threshold \"L_U\", so "
            "it keeps L <= pi_rollout / pi_old <= U: algo.rollout_is_mode=reject with the reciprocal bounds "
            "algo.rollout_is_lower=1/U algo.rollout_is_upper=1/L (\"0.5_5.0\" -> 0.2 and 2; one number U -> 1/U "
            "and U), at the level token_k1 -> token, seq_sum_k1 -> seq-sum, seq_mean_k1 -> seq-mean; its k2 / k3 "
            "options are algo.rollout_is_mode=reject-k2 / reject-k3 at the same levels, with "
            "algo.rollout_is_max_divergence = the threshold; seq_max and chained criteria have no equivalent")

_A, _R, _M = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model."
_RC = "algorithm.rollout_correction."
_OBJ = "algo.objective."

OTHER_NAMES: dict[str, OtherName] = {
    # ------------------------------------------------------------------ TRL: GRPOConfig's fields
    "learning_rate": OtherName("TRL", ("optim.lr",), "", _same, (1e-6, 1e-6)),
    "num_generations": OtherName("TRL", ("rollout.group_size",), "", _same, (16, 16)),
    "per_device_train_batch_size": OtherName(
        "TRL", ("algo.micro_batch_size", "rollout.prompts_per_step"),
        "cispo's micro-batch is the rows of one forward/backward and its generation batch rollout.prompts_per_step "
        "prompts x rollout.group_size; TRL's per_device_train_batch_size sets both, with gradient_accumulation_steps "
        "and steps_per_generation"),
    "gradient_accumulation_steps": OtherName(
        "TRL", ("algo.micro_batch_size",),
        "cispo accumulates over the micro-batches of each of its algo.updates_per_batch mini-batches: give the rows of "
        "a micro-batch, not their count"),
    "max_completion_length": OtherName("TRL", ("rollout.max_new_tokens",), "", _same, (512, 512)),
    "max_prompt_length": OtherName("TRL", (), f"{_PROMPTS_NOT_CUT} (trl 1.16 has no such field either)"),
    "temperature": OtherName("TRL", ("rollout.temperature",), "", _same, (0.7, 0.7)),
    "top_p": OtherName("TRL", ("rollout.top_p",), "", _same, (0.95, 0.95)),
    "top_k": OtherName("TRL", ("rollout.top_k",), "0 turns it off in both", _same, (50, 50)),
    "beta": OtherName(
        "TRL", (_OBJ + "kl_coef",),
        "cispo's KL term is k3 alone; TRL multiplies it by the IS ratio unless use_bias_correction_kl=false (default "
        "true), which changes its gradient even on-policy"),
    "epsilon": OtherName(
        "TRL", (_OBJ + "eps_low", _OBJ + "eps_high"),
        "TRL's epsilon is the clip's lower edge 1 - epsilon and, unless epsilon_high is set, its upper edge "
        "1 + epsilon"),
    "epsilon_high": OtherName(
        "TRL", (_OBJ + "eps_high", _OBJ + "eps_high_is"),
        "the clip's upper edge 1 + epsilon_high; with loss_type=cispo TRL caps the IS weight at epsilon_high itself: "
        "eps_high_is = epsilon_high - 1"),
    "delta": OtherName(
        "TRL", (),
        "TRL's delta clips the ratio of the clipped surrogate from above (two-sided GRPO); cispo's nearest, "
        "algo.objective.eps_high_is, caps a detached IS weight"),
    "loss_type": OtherName(
        "TRL", ("algo.objective.name",),
        "grpo -> grpo; dapo -> ppo (TRL's dapo clips at 1 -/+ epsilon, 0.2, unless epsilon_high is set; cispo's dapo "
        "at 0.2 and 0.28)",
        _values({"grpo": "grpo", "dapo": "ppo"}, {
            "cispo": "TRL's cispo caps the IS weight at epsilon_high itself (0.2 unless set); set "
                     "algo.objective=cispo, whose cap is 1 + eps_high_is = 5 (TRL's epsilon_high=5.0)",
            "dr_grpo": "TRL's dr_grpo divides by max_completion_length: set algo.objective=ppo with "
                       "algo.objective.aggregation=seq-mean-token-sum-norm and algo.objective.token_sum_norm=that "
                       "length",
            "bnpo": "TRL's bnpo divides by the tokens of the local micro-batch; cispo's token-mean (dapo -> ppo) by "
                    "those of the mini-batch"}),
        ("dapo", "ppo")),
    "scale_rewards": OtherName(
        "TRL", ("algo.advantage_estimator",),
        "group (true) -> grpo, batch -> batch-raw-std (the std of the raw rewards over the batch), none (false) -> "
        "drgrpo (TRL adds 1e-4 to the std, cispo 1e-6)",
        _values({"group": "grpo", True: "grpo", "batch": "batch-raw-std", "none": "drgrpo", False: "drgrpo"}),
        ("none", "drgrpo")),
    "num_iterations": OtherName("TRL", ("algo.epochs",), "", _same, (2, 2)),
    "steps_per_generation": OtherName(
        "TRL", ("algo.updates_per_batch",),
        "cispo counts optimizer steps per generation batch (K); TRL's steps_per_generation counts micro-steps: "
        "K = steps_per_generation / gradient_accumulation_steps"),
    "generation_batch_size": OtherName(
        "TRL", ("rollout.prompts_per_step", "rollout.group_size"),
        "cispo's generation batch is rollout.prompts_per_step prompts x rollout.group_size responses; TRL's "
        "generation_batch_size counts responses"),
    "importance_sampling_level": OtherName("TRL", (_OBJ + "ratio_level",), "", _same, ("sequence", "sequence")),
    "mask_truncated_completions": OtherName(
        "TRL", ("algo.mask_truncated_completions",),
        "out of the loss, still in the group's advantage statistics, in both", _same, (True, True)),
    "max_steps": OtherName(
        "TRL", ("steps",),
        "cispo counts RL steps (generation batches), each of algo.updates_per_batch x algo.epochs optimizer steps; "
        "TRL's max_steps counts optimizer steps"),
    "num_train_epochs": OtherName(
        "TRL", ("steps",),
        "cispo counts RL steps of rollout.prompts_per_step prompts each (reshuffled when they run out); TRL's "
        "num_train_epochs counts passes over the data set"),
    "save_steps": OtherName("TRL", ("checkpoint_every",),
                            "cispo counts RL steps; TRL's save_steps counts optimizer steps"),
    "logging_steps": OtherName("TRL", (), "cispo logs every RL step (metrics.jsonl and the trackers)"),
    "eval_steps": OtherName("TRL", ("eval.every",), "cispo counts RL steps; TRL's eval_steps counts optimizer steps"),
    "seed": OtherName("TRL", ("seed",), "", _same, (42, 42)),
    "bf16": OtherName(
        "TRL", ("model.dtype",),
        "true -> bfloat16 (with FP32 master weights under autocast, as TRL's mixed precision: model.master_weights), "
        "false -> float32",
        _values({True: "bfloat16", False: "float32"}), (True, "bfloat16")),
    "fp16": OtherName(
        "TRL", ("model.dtype",), "true -> float16 (FP32 master weights, autocast and loss scaling)",
        _values({True: "float16"}, {False: "false is TRL's default: leave it out"}), (True, "float16")),
    "use_cpu": OtherName("TRL", ("model.device",), "true -> cpu, false -> auto",
                         _values({True: "cpu", False: "auto"}), (True, "cpu")),
    "use_vllm": OtherName(
        "TRL", ("rollout.engine",), "true -> vllm (in the trainer's process: TRL's vllm_mode=colocate), false -> torch",
        _values({True: "vllm", False: "torch"}), (True, "vllm")),
    "vllm_mode": OtherName(
        "TRL", ("rollout.engine",),
        "rollout.engine=vllm runs vLLM inside each trainer process (TRL's colocate); there is no server mode"),
    "vllm_gpu_memory_utilization": OtherName("TRL", ("rollout.vllm_gpu_memory_utilization",), "", _same, (0.5, 0.5)),
    "vllm_enable_sleep_mode": OtherName("TRL", ("rollout.vllm_sleep",), "", _same, (True, True)),
    "vllm_max_model_length": OtherName("TRL", ("rollout.vllm_max_model_len",), "", _same, (4096, 4096)),
    "vllm_importance_sampling_correction": OtherName(
        "TRL", ("algo.rollout_is",), f"false -> null (no correction, cispo's default); {_TRL_IS}",
        _values({False: None}, {True: _TRL_IS}), (False, None)),
    "vllm_importance_sampling_mode": OtherName("TRL", ("algo.rollout_is", "algo.rollout_is_mode"), _TRL_IS_MODES),
    "vllm_importance_sampling_clip_max": OtherName(
        "TRL", ("algo.rollout_is_upper",), "the upper bound of rho in both (TRL's default 3.0, cispo's 2.0); null: "
        "none", _same, (3.0, 3.0)),
    "vllm_importance_sampling_cap": OtherName(
        "TRL", ("algo.rollout_is_upper",), "TRL's older name of vllm_importance_sampling_clip_max", _same, (3.0, 3.0)),
    "vllm_importance_sampling_clip_min": OtherName(
        "TRL", ("algo.rollout_is_lower",), "the lower bound of rho in both; null: none", _same, (0.5, 0.5)),
    "multi_objective_aggregation": OtherName(
        "TRL", ("algo.advantage_estimator",),
        "normalize_then_sum (GDPO: each reward normalised in its group, the weighted sum over the batch) -> gdpo; "
        "sum_then_normalize is TRL's default and cispo's way with every other estimator: leave it out",
        _values({"normalize_then_sum": "gdpo"}, {
            "sum_then_normalize": "TRL's default: cispo sums the rewards with data.reward_weights and normalises the "
                                  "sum by algo.advantage_estimator (scale_rewards' key): leave it out"}),
        ("normalize_then_sum", "gdpo")),
    "entropy_coef": OtherName(
        "TRL", (_OBJ + "entropy_coef",),
        "the entropy bonus; TRL's is the mean entropy of each micro-batch's tokens (divided by the accumulation "
        "steps), cispo's aggregates as the policy term over the mini-batch (token-mean, the default: the same where "
        "a mini-batch is one micro-batch)", _same, (0.01, 0.01)),
    "use_adaptive_entropy": OtherName(
        "TRL", (_OBJ + "entropy_coef",),
        "cispo's entropy coefficient is constant (false, TRL's default: leave it out); Skywork-OR1's adaptive one has "
        "no cispo equivalent"),
    "top_entropy_quantile": OtherName(
        "TRL", (), "cispo trains on every response token (TRL's default, 1.0: leave it out); keeping only the "
                   "highest-entropy tokens in the loss has no cispo equivalent"),
    "num_generations_eval": OtherName(
        "TRL", ("eval.num_samples",), "responses per evaluation prompt, in both",
        _at_least(1, "TRL's null samples num_generations; cispo's null takes the task's default: give a count"),
        (4, 4)),
    "repetition_penalty": OtherName("TRL", ("rollout.repetition_penalty",), "1 turns it off in both", _same,
                                    (1.1, 1.1)),
    "min_p": OtherName("TRL", ("rollout.min_p",), "TRL's null (off) is cispo's 0", _none_as(0.0), (0.05, 0.05)),
    "report_to": OtherName(
        "TRL", ("trackers",), "a sink or a list of them (tensorboard, wandb, mlflow); none -> []; all is refused",
        _report_to, ("tensorboard", ["tensorboard"])),
    "output_dir": OtherName("TRL", ("out_dir", "run_name"),
                            "cispo writes a run into out_dir/run_name; TRL's output_dir is that folder itself"),
    "reward_funcs": OtherName(
        "TRL", ("data.reward",),
        "TRL's are callables or reward-model ids; cispo's name module:function files (a list too, summed with "
        "data.reward_weights; a reward model is rm:FOLDER)"),
    "reward_weights": OtherName("TRL", ("data.reward_weights",), "", _same, ([1.0, 0.5], [1.0, 0.5])),
    "tools": OtherName(
        "TRL", ("data.tools",),
        "TRL's are the functions, passed to GRPOTrainer; cispo's name them: file.py:f,g or module:f (a list too; "
        "built-in calculator and python)", _same, (["my_tools.py:add"], ["my_tools.py:add"])),
    "max_tool_calling_iterations": OtherName(
        "TRL", ("rollout.max_turns",), "tool-calling turns per response in both",
        _at_least(1, "cispo's rollout.max_turns is a count >= 1 (TRL's None leaves the turns unbounded)"), (3, 3)),
    "warmup_steps": OtherName(
        "TRL", ("optim.warmup_updates",), "optimizer steps in both",
        _at_least(0, "TRL reads a warmup_steps below 1 as a share of the run's steps: give it as optim.warmup_ratio"),
        (10, 10)),
    "warmup_ratio": OtherName(
        "TRL", ("optim.warmup_ratio",),
        "a share of the run's optimizer updates, ceil(ratio x N), in both (transformers 5 reads it from a "
        "warmup_steps below 1)", _same, (0.1, 0.1)),
    "lr_scheduler_type": OtherName(
        "TRL", ("optim.lr_scheduler_type",), _SCHEDULES,
        _values({k: k for k in ("linear", "cosine", "constant", "constant_with_warmup")},
                dict.fromkeys(("cosine_with_restarts", "polynomial", "inverse_sqrt", "reduce_lr_on_plateau",
                               "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay", "greedy"),
                              "cispo's schedules are linear, cosine, constant and constant_with_warmup")),
        ("cosine", "cosine")),
    "max_grad_norm": OtherName("TRL", ("optim.grad_clip",), "0 turns clipping off in both", _same, (0.5, 0.5)),
    "weight_decay": OtherName(
        "TRL", ("optim.weight_decay",),
        "cispo decays every parameter; TRL's weight_decay leaves biases and LayerNorm weights out"),
    "adam_beta1": OtherName("TRL", ("optim.betas",), "cispo's optim.betas is the pair [adam_beta1, adam_beta2]"),
    "adam_beta2": OtherName("TRL", ("optim.betas",), "cispo's optim.betas is the pair [adam_beta1, adam_beta2]"),
    "adam_epsilon": OtherName("TRL", ("optim.eps",), "", _same, (1e-8, 1e-8)),
    "gradient_checkpointing": OtherName("TRL", ("model.gradient_checkpointing",), "", _same, (True, True)),
    "cast_lm_head_to_fp32": OtherName("TRL", ("model.fp32_lm_head",), "", _same, (True, True)),
    "log_completions": OtherName(
        "TRL", ("log_samples_every",),
        "cispo saves some responses of every log_samples_every-th RL step (samples.jsonl and the trackers); TRL's "
        "log_completions prints some every logging_steps"),
    # ------------------------------------------------------------------ verl: ppo_trainer.yaml's keys
    _A + "clip_ratio": OtherName(
        "verl", (_OBJ + "eps_low", _OBJ + "eps_high"),
        "both edges of verl's clip 1 -/+ clip_ratio where clip_ratio_low / clip_ratio_high are null (verl's defaults "
        "set them: 0.2)"),
    _A + "clip_ratio_low": OtherName(
        "verl", (_OBJ + "eps_low",),
        "the clip's lower edge; with loss_mode=cispo the IS weight's lower bound: eps_low_is; with loss_mode=dppo_tv "
        "/ dppo_kl DPPO's bound on a fall of the probability: delta_low"),
    _A + "clip_ratio_high": OtherName(
        "verl", (_OBJ + "eps_high",),
        "the clip's upper edge; with loss_mode=cispo the IS weight's cap: eps_high_is; with loss_mode=dppo_tv / "
        "dppo_kl DPPO's bound on a rise of the probability: delta_high"),
    _A + "clip_ratio_c": OtherName(
        "verl", (_OBJ + "eps_high_is",),
        "verl's dual-clip of A < 0 tokens, which the unified objective has not; with loss_mode=dppo_tv / dppo_kl the "
        "cap of the detached weight (verl's default 3): eps_high_is = clip_ratio_c - 1"),
    _A + "policy_loss.loss_mode": OtherName(
        "verl", ("algo.objective.name",),
        "verl's vanilla adds a dual-clip (clip_ratio_c) to ppo, its cispo bounds the IS weight to [0.8, 1.2] by "
        "default (cispo's: at most 5), its dppo_tv / dppo_kl (cispo's presets of those names) take their bounds from "
        "clip_ratio_low / high (0.2 by default; the presets': the DPPO recipe's 0.15 / 0.05) and cap the weight at "
        "clip_ratio_c (3 by default; the presets: no cap), and each takes verl's clip ratios and loss_agg_mode"),
    _A + "loss_agg_mode": OtherName(
        "verl", (_OBJ + "aggregation",),
        "token-mean, seq-mean-token-mean and seq-mean-token-sum-norm are the same (in both, it replaces the preset's)",
        _values({m: m for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")}, {
            "token-sum": "verl's token-sum is a sum, which no cispo aggregation is",
            "seq-mean-token-sum": "set aggregation=seq-mean-token-sum-norm with token_sum_norm=1"}),
        ("seq-mean-token-mean", "seq-mean-token-mean")),
    _A + "loss_scale_factor": OtherName(
        "verl", (_OBJ + "token_sum_norm",), "null: the padded response length, in both", _same, (512, 512)),
    _A + "entropy_coeff": OtherName(
        "verl", (_OBJ + "entropy_coef",),
        "the entropy bonus, in both aggregated as the policy term (loss_agg_mode; cispo's aggregation)", _same,
        (0.001, 0.001)),
    _A + "use_kl_loss": OtherName(
        "verl", (_OBJ + "kl_coef",), "no switch here: a coefficient > 0 turns the KL loss on"),
    _A + "kl_loss_coef": OtherName(
        "verl", (_OBJ + "kl_coef",),
        "verl applies it only with use_kl_loss=true; cispo's coefficient > 0 turns the KL loss on"),
    _A + "kl_loss_type": OtherName(
        "verl", (_OBJ + "kl_estimator",), "kl (k1) -> k1, low_var_kl (k3) -> k3 (verl also clamps k3 at 10)",
        _values({"kl": "k1", "k1": "k1", "low_var_kl": "k3", "k3": "k3"}), ("low_var_kl", "k3")),
    _A + "ppo_epochs": OtherName("verl", ("algo.epochs",), "", _same, (2, 2)),
    _A + "ppo_mini_batch_size": OtherName(
        "verl", ("algo.updates_per_batch",),
        "cispo counts mini-batches per generation batch (K); verl's ppo_mini_batch_size counts prompts per mini-batch: "
        "K = data.train_batch_size / ppo_mini_batch_size"),
    _A + "ppo_micro_batch_size_per_gpu": OtherName("verl", ("algo.micro_batch_size",), "responses per forward/backward "
                                                   "on each process, in both", _same, (4, 4)),
    _A + "optim.lr": OtherName("verl", ("optim.lr",), "", _same, (1e-6, 1e-6)),
    _A + "optim.weight_decay": OtherName("verl", ("optim.weight_decay",), "", _same, (0.01, 0.01)),
    _A + "optim.betas": OtherName("verl", ("optim.betas",), "", _same, ([0.9, 0.999], (0.9, 0.999))),
    _A + "optim.clip_grad": OtherName(
        "verl", ("optim.grad_clip",), "a norm > 0", _positive(
            "verl's 0 scales every gradient to 0; cispo's optim.grad_clip=0 turns clipping off"), (0.5, 0.5)),
    _A + "grad_clip": OtherName(
        "verl", ("optim.grad_clip",), "a norm > 0 (verl's older name of optim.clip_grad)", _positive(
            "verl's 0 scales every gradient to 0; cispo's optim.grad_clip=0 turns clipping off"), (0.5, 0.5)),
    _A + "optim.lr_warmup_steps": OtherName(
        "verl", ("optim.warmup_updates",),
        "cispo counts optimizer steps; verl's scheduler steps once per RL step: warmup_updates = lr_warmup_steps x "
        "algo.updates_per_batch x algo.epochs"),
    _A + "optim.lr_warmup_steps_ratio": OtherName(
        "verl", ("optim.warmup_ratio",),
        "a share of the run in both: verl's of its RL steps, int(ratio x steps), cispo's of its optimizer updates, "
        "ceil(ratio x N)", _same, (0.1, 0.1)),
    _A + "optim.lr_scheduler_type": OtherName(
        "verl", ("optim.lr_scheduler_type",), _VERL_SCHEDULES,
        _values({"constant": "constant_with_warmup", "cosine": "cosine"}), ("constant", "constant_with_warmup")),
    _A + "optim.warmup_style": OtherName(
        "verl", ("optim.lr_scheduler_type",), f"verl's older name of lr_scheduler_type: {_VERL_SCHEDULES}",
        _values({"constant": "constant_with_warmup", "cosine": "cosine"}), ("cosine", "cosine")),
    _R + "n": OtherName("verl", ("rollout.group_size",), "", _same, (8, 8)),
    _R + "temperature": OtherName("verl", ("rollout.temperature",), "", _same, (0.7, 0.7)),
    _R + "top_p": OtherName("verl", ("rollout.top_p",), "", _same, (0.9, 0.9)),
    _R + "top_k": OtherName("verl", ("rollout.top_k",), "verl's -1 (off) is cispo's 0", _top_k, (-1, 0)),
    _R + "response_length": OtherName("verl", ("rollout.max_new_tokens",), "", _same, (1024, 1024)),
    _R + "prompt_length": OtherName("verl", (), _PROMPTS_NOT_CUT),
    _R + "name": OtherName(
        "verl", ("rollout.engine",), "vllm -> vllm (in the trainer's process); sglang and trtllm have no equivalent",
        _values({"vllm": "vllm"}, {"sglang": "cispo samples with torch or vllm",
                                   "trtllm": "cispo samples with torch or vllm"}), ("vllm", "vllm")),
    _R + "gpu_memory_utilization": OtherName("verl", ("rollout.vllm_gpu_memory_utilization",), "", _same, (0.5, 0.5)),
    _R + "enforce_eager": OtherName("verl", ("rollout.vllm_enforce_eager",), "", _same, (True, True)),
    _R + "max_num_batched_tokens": OtherName("verl", ("rollout.vllm_max_num_batched_tokens",), "", _same,
                                             (8192, 8192)),
    _R + "max_num_seqs": OtherName("verl", ("rollout.vllm_max_num_seqs",), "", _same, (256, 256)),
    _R + "max_model_len": OtherName("verl", ("rollout.vllm_max_model_len",), "", _same, (4096, 4096)),
    _R + "tensor_model_parallel_size": OtherName(
        "verl", (), "cispo's vLLM engine always has tensor parallel size 1 (the weight push needs the whole model)"),
    _M + "path": OtherName("verl", ("model.path",), "", _same, ("Qwen/Qwen2.5-0.5B-Instruct",) * 2),
    _M + "enable_gradient_checkpointing": OtherName("verl", ("model.gradient_checkpointing",), "", _same,
                                                    (True, True)),
    _M + "lora_rank": OtherName("verl", ("model.lora_rank",), "", _same, (8, 8)),
    _M + "lora_alpha": OtherName("verl", ("model.lora_alpha",), "", _same, (32, 32.0)),
    _M + "target_modules": OtherName(
        "verl", ("model.lora_target_modules",), "all-linear -> null (every linear layer but lm_head, in both)",
        _lora_targets, ("all-linear", None)),
    "data.train_files": OtherName("verl", ("data.path",), "one path (a list of one)", _one_file,
                                  ("train.parquet", "train.parquet")),
    "data.val_files": OtherName("verl", ("data.eval_path",), "one path (a list of one)", _one_file,
                                ("test.parquet", "test.parquet")),
    "data.prompt_key": OtherName("verl", ("data.prompt_field",), "", _same, ("question", "question")),
    "data.max_prompt_length": OtherName("verl", (), _PROMPTS_NOT_CUT),
    "data.max_response_length": OtherName("verl", ("rollout.max_new_tokens",), "", _same, (1024, 1024)),
    "data.train_batch_size": OtherName("verl", ("rollout.prompts_per_step",), "prompts per RL step, in both", _same,
                                       (64, 64)),
    "trainer.total_epochs": OtherName(
        "verl", ("steps",),
        "cispo counts RL steps of rollout.prompts_per_step prompts each; verl's total_epochs counts passes over the "
        "data set: steps = total_epochs x prompts / data.train_batch_size"),
    "trainer.total_training_steps": OtherName(
        "verl", ("steps",), "RL steps, in both", _at_least(1, "verl's null counts total_epochs instead: give steps"),
        (200, 200)),
    "trainer.save_freq": OtherName(
        "verl", ("checkpoint_every",), "every N RL steps and at the end, in both",
        _at_least(1, "verl's -1 never saves; cispo always saves at the end (checkpoint_every=0: only then)"),
        (20, 20)),
    "trainer.test_freq": OtherName(
        "verl", ("eval.every",), "every N RL steps, before the first and after the last, in both",
        _at_least(1, "verl's -1 never evaluates during training; cispo always evaluates before the first step and "
                      "after the last (eval.every=0: only then)"), (10, 10)),
    "trainer.logger": OtherName(
        "verl", ("trackers",),
        "tensorboard, wandb, mlflow as they are; file -> jsonl (metrics.jsonl is always written); console is dropped "
        "(cispo's progress bar)", _logger, (["console", "wandb"], ["wandb"])),
    "trainer.experiment_name": OtherName(
        "verl", ("run_name",), "the run's name (cispo's run folder is out_dir/run_name)", _same, ("gsm8k", "gsm8k")),
    "trainer.project_name": OtherName(
        "verl", (), "cispo's runs have no project: W&B reads WANDB_PROJECT, MLflow MLFLOW_EXPERIMENT_NAME"),
    "trainer.default_local_dir": OtherName(
        "verl", ("out_dir", "run_name"),
        "cispo writes a run, checkpoints included, into out_dir/run_name; verl's default_local_dir is its checkpoint "
        "folder"),
    "trainer.n_gpus_per_node": OtherName("verl", (), "cispo runs on the processes torchrun starts (--nproc-per-node)"),
    "trainer.nnodes": OtherName("verl", (), "cispo runs on the processes torchrun starts (--nnodes)"),
    "trainer.val_before_train": OtherName(
        "verl", ("eval.every",), "cispo always evaluates before the first step and after the last"),
    "algorithm.adv_estimator": OtherName(
        "verl", ("algo.advantage_estimator",),
        "grpo -> grpo (with norm_adv_by_std_in_grpo=false: drgrpo), rloo -> rloo; gae and the others have no "
        "equivalent", _values({"grpo": "grpo", "rloo": "rloo"}), ("rloo", "rloo")),
    "algorithm.norm_adv_by_std_in_grpo": OtherName(
        "verl", ("algo.advantage_estimator",), "with adv_estimator=grpo, true is cispo's grpo and false its drgrpo"),
    "algorithm.use_kl_in_reward": OtherName(
        "verl", (_OBJ + "kl_coef",),
        "verl's puts a KL penalty in the reward; cispo's KL is a loss term (false, verl's default, is cispo's way: "
        "leave it out)"),
    "algorithm.kl_ctrl.kl_coef": OtherName(
        "verl", (_OBJ + "kl_coef",),
        "verl's is the coefficient of a KL penalty in the reward (use_kl_in_reward); cispo's is a loss term's"),
    "algorithm.filter_groups.enable": OtherName(
        "verl", ("rollout.dynamic_sampling",),
        "drop groups whose rewards are all equal and sample more (DAPO); on by default in cispo, off in verl", _same,
        (True, True)),
    "algorithm.filter_groups.max_num_gen_batches": OtherName(
        "verl", ("rollout.max_sampling_rounds",), "generation rounds per RL step, in both",
        _at_least(1, "verl's 0 samples until the batch is full; cispo's rounds are capped (at most 10^4)"), (10, 10)),
    "algorithm.rollout_correction.bypass_mode": OtherName(
        "verl", ("algo.logp_old",),
        "true -> rollout (pi_old is the sampler's log-probs, not recomputed), false -> recompute; cispo takes them "
        "only from its own torch sampler at float32, without dropout or a rollout correction beside it",
        _values({True: "rollout", False: "recompute"}), (True, "rollout")),
    _RC + "rollout_is": OtherName(
        "verl", ("algo.rollout_is",),
        "token -> token, sequence -> seq-sum (verl's sequence ratio is the product over the response), null -> null; "
        "the bounds are rollout_is_threshold's (verl's and cispo's default upper bound: 2.0)",
        _values({"token": "token", "sequence": "seq-sum", None: None}), ("sequence", "seq-sum")),
    _RC + "rollout_is_threshold": OtherName(
        "verl", ("algo.rollout_is_upper",),
        "a number C (TIS: the weight clipped at C, cispo's rollout_is_mode=truncate) -> rollout_is_upper=C; "
        "\"L_U\" (IcePop) is refused with its translation",
        _rollout_is_threshold, (3.0, 3.0)),
    _RC + "rollout_rs": OtherName(
        "verl", ("algo.rollout_is", "algo.rollout_is_mode", "algo.rollout_is_lower", "algo.rollout_is_upper"),
        _VERL_RS),
    _RC + "rollout_rs_threshold": OtherName(
        "verl", ("algo.rollout_is_lower", "algo.rollout_is_upper", "algo.rollout_is_max_divergence"), _VERL_RS),
    "custom_reward_function.path": OtherName(
        "verl", ("data.reward",), "cispo names the file and the function together: data.reward=PATH:NAME"),
    "custom_reward_function.name": OtherName(
        "verl", ("data.reward",), "cispo names the file and the function together: data.reward=PATH:NAME"),
}
"""TRL's and verl's names of cispo's settings (TRL: ``GRPOConfig``'s fields; verl: its dotted keys,
also found by their last parts, ``rollout.n`` or ``n``: `lookup`). `cispo train` reads an unknown key
that is one of them as cispo's key where ``read`` is set (a line on stderr says so), and refuses it
with cispo's key and the difference otherwise (`cispo.config.engine`); elsewhere an unknown name
gets the same words as its hint (`other_name_hint`). docs/integrations.md shows this table
(tests/test_config.py checks that the two agree)."""

_TOO_GENERIC = frozenset({"enable", "name", "path"})
"""Last parts of verl keys that say too little alone (``enable=true``): found only with their section."""

OTHER_SECTIONS = frozenset(name.split(".")[0] for name in OTHER_NAMES if "." in name)
"""The top-level sections of verl's names (``actor_rollout_ref``, ``trainer``, ...)."""


def _suffixes() -> dict[tuple[str, ...], list[str]]:
    """Every name of `OTHER_NAMES` by each of its trailing parts (``('rollout', 'n')``, ``('n',)``)."""
    out: dict[tuple[str, ...], list[str]] = {}
    for name in OTHER_NAMES:
        parts = tuple(name.split("."))
        for i in range(len(parts)):
            out.setdefault(parts[i:], []).append(name)
    return out


_BY_SUFFIX = _suffixes()


def lookup(path: Sequence[str], own: Collection[str] = ()) -> tuple[str, OtherName] | None:
    """The name of `OTHER_NAMES` that key ``path`` (its parts, as typed) is, with its row: the name
    itself; else the one name that ends with ``path`` (``rollout.n``), a single part only where it
    is none of ``own`` (the config's own field names: ``lr`` is cispo's) and says enough alone; None
    where none, or several, match."""
    path = tuple(map(str, path))
    name = ".".join(path)
    if name in OTHER_NAMES:
        return name, OTHER_NAMES[name]
    if len(path) == 1 and (path[0] in own or path[0] in _TOO_GENERIC):
        return None
    found = _BY_SUFFIX.get(path, [])
    return (found[0], OTHER_NAMES[found[0]]) if len(found) == 1 else None


def describe(name: str, other: OtherName, shown: Sequence[str] | None = None) -> str:
    """`` (did you mean 'k'? 'beta' in TRL: what)``: ``name`` as typed, its row ``other`` and cispo's
    key(s) as this config names them (``shown``; default ``other.keys``); where cispo has none,
    `` ('top_k' in TRL: no cispo setting; what)``."""
    shown = other.keys if shown is None else shown
    what = other.what or "the same setting"
    if not shown:
        return f" ({name!r} in {other.source}: no cispo setting; {what})"
    return f" (did you mean {' and '.join(map(repr, shown))}? {name!r} in {other.source}: {what})"


def other_name_hint(name: str, keys: Iterable[str]) -> str:
    """`describe` for ``name`` when it is one of `OTHER_NAMES` (`lookup`) and its cispo keys are
    among ``keys``: the key itself, a key below a dict field in ``keys`` (``rollout.vllm_kwargs``),
    or one given relative to its section (``kl_coef`` among ObjectiveConfig's fields); ``""`` otherwise."""
    match = lookup((name,))
    if match is None:
        return ""
    other = match[1]
    keys = set(map(str, keys))
    found = [next((k for k in sorted(keys, key=len, reverse=True)
                   if t == k or t.startswith(k + ".") or t.endswith("." + k)), None) for t in other.keys]
    if None in found:
        return ""
    return describe(name, other, [t if t.startswith(k + ".") else k for t, k in zip(other.keys, found)])


def read_line(typed: str, other: OtherName, before: Any, after: Any) -> str:
    """The line that says ``typed`` (a name of `OTHER_NAMES`, as given) is read as cispo's key:
    ``cispo: reading TRL's learning_rate as optim.lr``, with the values where they differ
    (``loss_type=dapo as algo.objective=ppo``)."""
    def shown(value: Any) -> str:
        if isinstance(value, bool) or value is None:
            return {True: "true", False: "false", None: "null"}[value]
        return value if isinstance(value, str) else reprlib.repr(value)

    if _is(before, after):
        return f"cispo: reading {other.source}'s {typed} as {other.keys[0]}"
    return f"cispo: reading {other.source}'s {typed}={shown(before)} as {other.keys[0]}={shown(after)}"
