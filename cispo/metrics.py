"""The metrics of one RL step, and the NaN-skipping mean every average over metrics uses.

A metric that is not defined for a step (a fork rate on a task without a fork word, a
fraction over zero tokens) is NaN; averages over optimizer steps and over ranks skip it.
"""

from __future__ import annotations

import torch

from cispo.data import FillReport
from cispo.experience import Experience


def is_nan(x) -> bool:
    """A float NaN (a metric that is not defined)."""
    return isinstance(x, float) and x != x


def nan_mean(values) -> float:
    """The mean of ``values`` that are neither None nor NaN; NaN when none is left."""
    kept = [v for v in values if v is not None and not is_nan(v)]
    return sum(kept) / len(kept) if kept else float("nan")


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-D tensors (nan when either is constant)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = (x.square().sum() * y.square().sum()).sqrt()
    return float((x * y).sum() / denom) if denom > 0 else float("nan")


def rollout_metrics(groups, exp: Experience, report: FillReport, used_fork) -> dict:
    flat = [c for group in groups for c in group]
    mask = exp.response_mask.bool()
    lengths = torch.tensor([c.length for c in flat], dtype=torch.float)
    forked = [used_fork(c.text) for c in flat] if used_fork else []
    return {
        "rollout/reward_mean": sum(c.reward for c in flat) / len(flat),
        "rollout/accuracy": sum(c.task_reward for c in flat) / len(flat),
        "rollout/response_length": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/fork_rate": sum(forked) / len(flat) if forked else float("nan"),
        "rollout/truncated": sum(c.finish_reason == "length" for c in flat) / len(flat),
        "rollout/repetition_stops": float(sum(c.finish_reason == "repetition" for c in flat)),
        "rollout/logp_corr": pearson(exp.logp_rollout[mask], exp.logp_old[mask]),
        "rollout/logp_abs_diff": float((exp.logp_rollout - exp.logp_old)[mask].abs().mean()),
        "rollout/rounds": float(report.rounds),
        "rollout/groups_sampled": float(report.groups_sampled),
        "rollout/groups_kept": float(report.groups_kept),
        "objective/entropy": float(exp.extras["entropy"][mask].mean()),
    }


def update_metrics(stats: list[dict]) -> dict:
    """Means over the step's optimizer steps (min / max for the ratio extremes)."""
    out = {}
    for key in stats[0]:
        values = [s[key] for s in stats if not is_nan(s[key])]
        if key == "ratio_min":
            agg = min(values)
        elif key == "ratio_max":
            agg = max(values)
        elif key == "skipped":
            agg = sum(values)
        else:
            agg = nan_mean(values)
        out[f"objective/{key}" if key not in ("grad_norm", "skipped") else f"optim/{key}"] = agg
    return out
