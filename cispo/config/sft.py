"""The configuration of ``cispo sft``, supervised fine-tuning on chat data before RL (a warm start): one
dataclass per concern, a docstring per field, read by the same engine as ``cispo train``'s
(`cispo.config.engine`: YAML files, ``key=value`` overrides, errors that name the key).

The optimizer section is ``cispo train``'s (`cispo.config.algo.OptimConfig`) with a plain fine-tune's defaults
(`SFTOptimConfig`: AdamW's usual betas and eps, no clipping, no warm-up): those of the calculator warm start
(``studies/results/agents/warm_start.py``), which ``examples/calculator_sft.yaml`` reproduces."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from cispo.config.algo import OptimConfig, schedule_checks
from cispo.config.train import MAX_SEED, check_finite, check_sink_kinds

__all__ = ["SFTConfig", "SFTDataConfig", "SFTModelConfig", "SFTOptimConfig"]


@dataclass
class SFTModelConfig:
    """The model fine-tuned."""

    path: str | None = None
    """Local Hugging Face causal-LM folder, ``builtin:<name>`` (a real model shipped in a pip package:
    ``builtin:smollm2-135m``) or a hub id ``org/name``. None: the model of ``data.task`` (``builtin:smollm2-135m``
    for ``wordmath_calc``); required with ``data.path``."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:1``, … or ``auto`` (CUDA when available)."""
    dtype: Literal["float32", "bfloat16"] | None = None
    """Compute dtype. ``bfloat16``: FP32 parameters, gradients and AdamW state, the passes under ``torch.autocast``
    in bfloat16. None: as saved (the converted ``builtin:`` models: float32)."""
    dropout: bool = False
    """Keep the model's dropout. Off (default, as ``cispo train``): every dropout probability set to 0 at load."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    lora_rank: int = 0
    """LoRA rank (``pip install "cispo[lora]"``): train rank-r adapters on every linear layer but lm_head; the
    model written holds the merged weights. 0: full fine-tuning."""
    lora_alpha: float = 16.0
    """LoRA scale: the adapters' output is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_target_modules: list[str] | None = None
    """Module names to adapt. None: all linear layers but lm_head."""


@dataclass
class SFTDataConfig:
    """The conversations trained on: a chat file, or a built-in task's worked answers."""

    path: str | None = None
    """A JSONL / Parquet file (or a ``datasets`` folder, a folder of shards) whose rows hold ``messages``, a chat
    in TRL's conversational format (``system`` / ``user`` / ``assistant`` / ``tool`` turns; an assistant turn may
    carry OpenAI-style ``tool_calls``), and optionally ``tools`` (the JSON schemas the chat template shows).
    The loss covers the assistant turns' tokens only (``cispo.training.sft_data``). None: ``task``'s
    demonstrations."""
    split: str | None = None
    """The split of a ``datasets`` folder or a folder of shards (as ``cispo train``'s ``data.split``)."""
    task: Literal["wordmath_calc", "guess_number"] = "wordmath_calc"
    """With ``path`` unset: the built-in task whose worked answers are trained on (``wordmath_calc``: a word
    problem answered in one line of working that calls the calculator, ``539 / 11 =
    <calc>539/11</calc><result>49</result>`` then ``#### 49``; the environment's ``<result>`` is context;
    ``guess_number``: a game of guesses, each drawn from the interval the environment's answers leave, the
    answers ``higher`` / ``lower`` context; ``numbers``, ``calculator`` and ``call_share`` are wordmath_calc's)."""
    num_demonstrations: int = 256
    """Worked answers (distinct train problems) of ``task``."""
    seed: int = 1
    """The problems' stream of ``task`` (train split; the RL run's held-out problems are never among them). 1:
    other train problems than an RL run's ``data.seed=0`` starts with."""
    numbers: Literal["small", "large"] = "small"
    """``task``'s operands: ``small`` (1-2 digits, ``wordmath_calc``) or ``large`` (2-3 digits,
    ``wordmath_calc_large``)."""
    calculator: bool = True
    """Answers that call the calculator under its prompt. false: the value written by hand under wordmath's
    prompt (the control without the tool)."""
    call_share: float | None = None
    """With ``calculator``: the share of answers that call it, a seeded draw per problem (the others written by
    hand under the calculator's prompt: a rare call), in [0, 1]. None: every answer calls."""


@dataclass
class SFTOptimConfig(OptimConfig):
    """AdamW as a plain fine-tune runs it (and the calculator warm start did): ``cispo train``'s section with other
    defaults, so that a file giving only ``optim.lr`` keeps them."""

    lr: float = 5e-5
    """Learning rate (constant after the warm-up)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2): torch's defaults."""
    eps: float = 1e-8
    """AdamW epsilon: torch's default."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this value (0 = off)."""
    warmup_updates: int = 0
    """Linear learning-rate warm-up over this many optimizer steps."""


@dataclass
class SFTConfig:
    """Supervised fine-tuning on chat data (the loss on the assistant's tokens only): a warm start for RL."""

    epochs: int = 1
    """Passes over the conversations, each in a seeded order."""
    batch_size: int = 8
    """Conversations per optimizer step (the last step of an epoch may hold fewer)."""
    micro_batch_size: int | None = None
    """Conversations per forward/backward (gradient accumulation within a step: each micro-batch's loss is
    normalised by the whole step's trained tokens, so the step's gradient is unchanged). None: the whole step."""
    max_length: int | None = None
    """Longest conversation in tokens: a longer one is refused, naming its row. None: no limit but the model's."""
    seed: int = 0
    """Seeds the order of the conversations (each epoch's) and torch (LoRA's initial adapters, dropout)."""
    out_dir: str = "runs"
    """Folder that holds the run folders."""
    run_name: str | None = None
    """Run folder name. None: ``sft__{task or data file}__seed{seed}``."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many optimizer steps (and at the end, and on a stop signal). 0: only then."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep. 0: all. Each holds what ``--resume`` needs: the weights and AdamW's
    two moments, about 3x the float32 weights (1.6 GB for SmolLM2-135M); its ``model/`` alone is the model."""
    threads: int | None = None
    """torch CPU threads. None: picked by load (as ``cispo train``)."""
    progress: bool = True
    """A line per optimizer step on stderr (epoch, step, loss, seconds). false: the start and the end only."""
    trackers: list[str] | str = field(default_factory=list)
    """Metric sinks besides metrics.jsonl: ``tensorboard``, ``wandb``, ``mlflow`` (as ``cispo train``'s)."""
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)

    def __post_init__(self) -> None:
        """Every setting checked before any work: ``ValueError`` naming the key."""
        if isinstance(self.trackers, str):
            self.trackers = [self.trackers]
        check_finite(self)
        problems = [f"{key} {why}" for key, ok, why in _checks(self) if not ok]
        if problems:
            raise ValueError(problems[0] if len(problems) == 1 else
                             f"{len(problems)} settings to fix: " + "; ".join(problems))
        check_sink_kinds(self.trackers)


def _checks(cfg: SFTConfig) -> list[tuple[str, object, str]]:
    """(dotted key, acceptable, why not) of each setting `SFTConfig` refuses."""
    d, o, m = cfg.data, cfg.optim, cfg.model
    return [
        ("epochs", 1 <= cfg.epochs <= 10**6, "must be in [1, 10^6]"),
        ("batch_size", 1 <= cfg.batch_size <= 10**6, "must be in [1, 10^6]"),
        ("micro_batch_size", cfg.micro_batch_size is None or cfg.micro_batch_size >= 1, "must be >= 1 or None"),
        ("max_length", cfg.max_length is None or cfg.max_length >= 2, "must be >= 2 or None"),
        ("seed", 0 <= cfg.seed <= MAX_SEED, f"must be in [0, {MAX_SEED}]"),
        ("checkpoint_every", cfg.checkpoint_every >= 0, "must be >= 0 (0: only at the end)"),
        ("keep_checkpoints", cfg.keep_checkpoints >= 0, "must be >= 0 (0: all)"),
        ("threads", cfg.threads is None or 1 <= cfg.threads <= 1024, "must be in [1, 1024] or None"),
        ("model.lora_rank", 0 <= m.lora_rank <= 65536, "must be in [0, 65536]"),
        ("data.num_demonstrations", 1 <= d.num_demonstrations <= 10**7, "must be in [1, 10^7]"),
        ("data.seed", 0 <= d.seed <= MAX_SEED, f"must be in [0, {MAX_SEED}]"),
        ("data.call_share", d.call_share is None or 0 <= d.call_share <= 1, "must be in [0, 1] or None"),
        ("data.call_share", d.call_share is None or d.calculator,
         "is set with data.calculator=false: a share of calls needs the calculator's prompt"),
        ("data.task", d.path is None or _task_defaults(d),
         "settings (num_demonstrations, numbers, calculator, call_share) are set beside data.path, which "
         "replaces the task's demonstrations: leave them out"),
        ("model.path", d.path is None or m.path is not None, "must be set with data.path (the task's model is "
         "only the default for its own demonstrations)"),
        ("optim.lr", 0 < o.lr <= 1.0, "must be in (0, 1]"),
        ("optim.eps", o.eps > 0, "must be > 0"),
        ("optim.betas", all(0 <= b < 1 for b in o.betas), "must both be in [0, 1)"),
        ("optim.weight_decay", 0 <= o.weight_decay * o.lr < 1, "must be >= 0 with weight_decay * lr < 1"),
        ("optim.grad_clip", o.grad_clip >= 0 and math.isfinite(o.grad_clip), "must be >= 0 (0: off)"),
        *schedule_checks(o),
    ]


def _task_defaults(d: SFTDataConfig) -> bool:
    """Whether the task's own settings of ``d`` are at their defaults (unused beside ``data.path``)."""
    default = SFTDataConfig()
    return all(getattr(d, k) == getattr(default, k) for k in ("num_demonstrations", "seed", "numbers", "calculator",
                                                              "call_share"))
