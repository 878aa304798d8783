"""What a step measures beside the objective: probes the runner registers on the trainer
(`cispo.training.trainer.Trainer.add_probe`). The gradient loop calls their hooks and knows nothing of
what they count, so a new diagnostic never touches the update.

* `TokenCounts`: each row's capped and PPO-dropped tokens, for ``samples.jsonl``
  (`cispo.records.samples`);
* `ForkDiagnostics`: the tracked fork strings' tokens (`cispo.foundations.forks`): where each match starts,
  and per optimizer step the counts of `cispo.training.metrics.fork_sums` — does PPO's upper mask act on
  rare, positive fork tokens? — turned into the step's ``fork/...`` and ``objective/fork_...`` metrics.
"""

from __future__ import annotations

import torch

from cispo.foundations.experience import Experience
from cispo.foundations.forks import ForkTokens
from cispo.foundations.nan import nan_mean
from cispo.objective.loss import ObjectiveConfig, ObjectiveStats
from cispo.records.samples import add_token_counts, start_token_counts
from cispo.training.metrics import fork_metrics, fork_rollout_metrics, fork_sums, frac_ppo_dropped_fork


class Probe:
    """A step's measurement. Every hook has a no-op default; a probe overrides what it needs."""

    def on_batch(self, exp: Experience) -> None:
        """The batch is built (advantages set), before log pi_old and the updates."""

    def on_micro_batch(self, exp: Experience, rows: torch.Tensor, sub: Experience, stats: ObjectiveStats) -> None:
        """Micro-batch ``sub`` = ``exp.select(rows)`` had its loss formed (``stats``: the objective's, with its
        per-token flags) and its backward run."""

    def on_update(self) -> None:
        """An optimizer step ended (its micro-batches done; also a skipped one)."""

    def on_step(self, exp: Experience) -> dict:
        """The step's updates are done: metrics to log (default: none)."""
        return {}


class TokenCounts(Probe):
    """Counts each row's capped (w != r, eq. 5) and PPO-dropped (M = 0, eq. 7) tokens over every update into
    ``exp.extras`` (`cispo.records.samples.COUNT_KEYS`), for ``samples.jsonl``."""

    def on_batch(self, exp) -> None:
        start_token_counts(exp)

    def on_micro_batch(self, exp, rows, sub, stats) -> None:
        add_token_counts(exp, rows, stats)


class ForkDiagnostics(Probe):
    """The tracked fork strings (``forks``): each token's string (``exp.extras["fork_index"]``), the counts
    of `fork_sums` per optimizer step under ``objective``'s eps_high / eps_low, and the step's fork metrics."""

    def __init__(self, forks: ForkTokens, objective: ObjectiveConfig) -> None:
        self.forks, self.objective = forks, objective
        self.per_update: list[torch.Tensor] = []  # one [S + 1, F] sum per optimizer step of this step
        self._current: torch.Tensor | None = None

    def on_batch(self, exp) -> None:
        exp.extras["fork_index"] = self.forks.index(exp.response_ids, exp.response_mask)  # [B, T]
        self.per_update, self._current = [], None

    def on_micro_batch(self, exp, rows, sub, stats) -> None:
        sums = fork_sums(sub, stats, len(self.forks.names), self.objective.eps_high, self.objective.eps_low)
        self._current = sums if self._current is None else self._current + sums

    def on_update(self) -> None:
        if self._current is not None:
            self.per_update.append(self._current)
        self._current = None

    def on_step(self, exp) -> dict:
        """``objective/frac_ppo_dropped_fork`` (the mean over updates of the PPO-dropped share of fork tokens),
        the tokens per response, `fork_rollout_metrics` and `fork_metrics`."""
        out = {"objective/frac_ppo_dropped_fork": nan_mean([frac_ppo_dropped_fork(s) for s in self.per_update])}
        if len(exp):
            is_fork = (exp.extras["fork_index"] >= 0) & exp.response_mask.bool()  # [B, T]
            out["rollout/fork_tokens_per_response"] = float(is_fork.sum()) / len(exp)
            out.update(fork_rollout_metrics(exp, self.forks.slugs))
        if self.per_update:
            out.update(fork_metrics(self.per_update, self.forks.slugs))
        return out
