"""The metrics of one RL step, and the NaN-skipping mean every average over metrics uses.

A metric that is not defined for a step (a fork rate on a task without a fork word, a
fraction over zero tokens) is NaN; averages over optimizer steps and over ranks skip it
(`reduce_over_ranks`: counts are summed over ranks, the rest averaged).
"""

from __future__ import annotations

import math

import torch

from cispo.data import FillReport
from cispo.experience import Experience
from cispo.objective import LOW_PROB, ObjectiveStats


def is_nan(x) -> bool:
    """A float NaN (a metric that is not defined)."""
    return isinstance(x, float) and x != x


def nan_mean(values) -> float:
    """The mean of ``values`` that are neither None nor NaN; NaN when none is left."""
    kept = [v for v in values if v is not None and not is_nan(v)]
    return sum(kept) / len(kept) if kept else float("nan")


# Per-rank counts and rates: the step's value is their sum over ranks (each rank samples its
# own groups); the largest length is the largest over ranks; every other metric is a mean.
SUMMED_OVER_RANKS = frozenset({"rollout/groups_sampled", "rollout/groups_kept", "rollout/reward_errors",
                               "rollout/repetition_stops", "perf/tokens_per_s"})
MAXED_OVER_RANKS = frozenset({"rollout/response_length_max"})


def reduce_over_ranks(per_rank: list[dict]) -> dict:
    """One step's metrics from every rank's: summed for `SUMMED_OVER_RANKS`, max for
    `MAXED_OVER_RANKS`, else `nan_mean` over the ranks that report the key."""
    out = {}
    for key in sorted({k for m in per_rank for k in m}):
        values = [v for m in per_rank if (v := m.get(key)) is not None and not is_nan(v)]
        if not values:
            out[key] = float("nan")
        elif key in SUMMED_OVER_RANKS or key.startswith(MECHANISM_COUNT):
            out[key] = float(sum(values))
        elif key in MAXED_OVER_RANKS:
            out[key] = float(max(values))
        else:
            out[key] = sum(values) / len(values)
    return out


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
            agg = min(values, default=math.nan)
        elif key == "ratio_max":
            agg = max(values, default=math.nan)
        elif key == "skipped":
            agg = sum(values)
        else:
            agg = nan_mean(values)
        out[f"objective/{key}" if key not in ("grad_norm", "skipped", "loss_scale") else f"optim/{key}"] = agg
    return out


# ---------------------------------------------------------------------------------------
# The mechanism check (issue 28): does PPO's upper mask act on rare positive fork tokens?
# ---------------------------------------------------------------------------------------

MECHANISM_COUNT = "objective/fork_pos_lowp_above"  # and its per-update "..._k{k}" keys: summed over ranks
MECHANISM_SUMS = ("fork_pos_lowp_above", "fork_mass", "fork_mass_above", "other_mass", "other_mass_above")


@torch.no_grad()
def mechanism_sums(exp: Experience, stats: ObjectiveStats, is_fork: torch.Tensor, eps_high: float) -> dict:
    """One micro-batch's share of the mechanism check, for positive-advantage tokens:

    * ``fork_pos_lowp_above``: fork tokens with A > 0, p_old < 0.1 and r > 1 + eps_high — the
      paper's case, whose gradient PPO's upper mask drops (CISPO keeps it, capped);
    * ``fork_mass`` / ``fork_mass_above``: the gradient-mass proxy (1 - p) |w A| summed over the
      positive fork tokens / over those of them with r > 1 + eps_high (|d log p / d logit| = 1 - p);
    * ``other_mass`` / ``other_mass_above``: the same over the other positive tokens (the contrast).

    ``is_fork``: [b, T] bool; ``stats`` must carry its per-token ``ratio`` and ``weight``."""
    mask = exp.response_mask.bool()  # [b, T]
    T = mask.shape[1]
    positive = (exp.advantages[:, None] > 0).expand_as(mask) & mask  # [b, T]
    ratio, weight = stats.ratio[:, :T], stats.weight[:, :T]  # [b, T]
    above = ratio > 1.0 + eps_high  # [b, T]
    p_new = torch.exp(exp.logp_old[:, :T]) * ratio  # pi_theta = r pi_old    [b, T]
    mass = (1.0 - p_new).clamp(min=0) * (weight * exp.advantages[:, None]).abs()  # [b, T]
    fork, other = positive & is_fork, positive & ~is_fork
    low_prob = exp.logp_old[:, :T] < torch.log(torch.tensor(LOW_PROB))
    return {"fork_pos_lowp_above": int((fork & low_prob & above).sum()),
            "fork_mass": float(mass[fork].sum()), "fork_mass_above": float(mass[fork & above].sum()),
            "other_mass": float(mass[other].sum()), "other_mass_above": float(mass[other & above].sum())}


def mechanism_metrics(per_update: list[dict]) -> dict:
    """The step's mechanism check from each optimizer step's summed ``mechanism_sums``: counts summed,
    mass shares pooled over the step (``objective/fork_pos_mass_above``: the share of the positive
    fork tokens' gradient mass that lies above 1 + eps_high), and per update index k = 1..K·epochs
    (``..._k{k}``)."""
    def share(rows, part, whole):
        total = sum(r[whole] for r in rows)
        return sum(r[part] for r in rows) / total if total > 0 else float("nan")

    out = {MECHANISM_COUNT: float(sum(r["fork_pos_lowp_above"] for r in per_update)),
           "objective/fork_pos_mass_above": share(per_update, "fork_mass_above", "fork_mass"),
           "objective/other_pos_mass_above": share(per_update, "other_mass_above", "other_mass")}
    for k, r in enumerate(per_update, start=1):
        out[f"{MECHANISM_COUNT}_k{k}"] = float(r["fork_pos_lowp_above"])
        out[f"objective/fork_pos_mass_above_k{k}"] = share([r], "fork_mass_above", "fork_mass")
    return out
