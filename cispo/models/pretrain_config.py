"""`PretrainConfig`: the settings of pretraining a built-in base model (`cispo.models.pretrain`). Plain data
with no torch, so that ``cispo pretrain --help`` and the model cache's key need not load it."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class PretrainConfig:
    """Pretraining of the built-in base model. Its hash keys the model cache."""

    task: str = "addition"
    """Built-in task name (`cispo.data.tasks.get_task`)."""
    seed: int = 0
    """Seeds the corpus, the initial weights and the batch order."""
    model_size: str = "default"
    """Key of `cispo.models.loading.MODEL_SIZES` (``default``: hidden 96, 3 layers, 0.34M params)."""
    steps: int | None = None
    """Optimizer steps. None: the task's default (`Task.pretrain_defaults`: addition 1000, chain 1000)."""
    batch_size: int | None = None
    """Examples per step (direct and forked together). None: the task's default (addition 96, chain 48)."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 50
    """Linear warm-up steps, then cosine decay to `min_lr_ratio * lr`."""
    min_lr_ratio: float = 0.05
    """Final learning rate as a fraction of `lr`."""
    weight_decay: float = 0.01
    """AdamW weight decay (on matrices only)."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    corpus_size: int = 200_000
    """Examples generated once; batches are drawn from them with replacement."""
    fork_fraction: float | None = None
    """Trained frequency of the fork token at each decision "fork or go on" (addition: after
    the guess; chain: after each step). None: the task's default (addition 0.03, chain 0.04)."""
    derivation_fraction: float | None = None
    """addition: fraction of examples that contain a derivation, the rest are direct answers
    (high, so the model learns the derivation well but the direct answer hardly at all, see
    docs/builtin-task.md); chain: probability of a recheck after each step. It does not change
    how often the fork is chosen. None: the task's default (addition 0.8, chain 0.5)."""
    wrong_guess_fraction: float | None = None
    """addition: fraction of forked examples whose pre-fork guess has a corrupted digit;
    chain: fraction of steps with a carry written with the carry dropped. None: the task's
    default (addition 0.5, chain 1.0)."""

    def resolved(self) -> PretrainConfig:
        """This config with every None replaced by the task's default (what `pretrain` runs)."""
        from cispo.data.tasks import get_task

        defaults = get_task(self.task).pretrain_defaults
        missing = [f.name for f in fields(self) if getattr(self, f.name) is None and f.name not in defaults]
        if missing:
            raise ValueError(f"PretrainConfig: {missing} unset and task {self.task!r} has no default for them")
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})
