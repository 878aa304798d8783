"""The metrics of one RL step, and the NaN-skipping mean every average over metrics uses.

A metric that is not defined for a step (a fork rate on a task without a fork word, a
fraction over zero tokens) is NaN; averages over optimizer steps and over ranks skip it
(`reduce_over_ranks`: counts are summed over ranks, the rest averaged).
"""

from __future__ import annotations

import math
import re

import torch

from cispo.data.prompts import FillReport
from cispo.foundations.experience import Experience
from cispo.foundations.forks import OTHER
from cispo.foundations.nan import is_nan, nan_mean
from cispo.objective.loss import LOW_PROB, ObjectiveStats
from cispo.training.credit import num_segments

# Per-rank counts and rates: the step's value is their sum over ranks (each rank samples its
# own groups); the largest length is the largest over ranks; every other metric is a mean.
SUMMED_OVER_RANKS = frozenset({"rollout/groups_sampled", "rollout/groups_kept", "rollout/reward_errors",
                               "rollout/repetition_stops", "rollout/logp_rollout_nan", "perf/tokens_per_s"})
MAXED_OVER_RANKS = frozenset({"rollout/response_length_max"})


def reduce_over_ranks(per_rank: list[dict]) -> dict:
    """One step's metrics from every rank's: summed for `SUMMED_OVER_RANKS`, max for
    `MAXED_OVER_RANKS`, else `nan_mean` over the ranks that report the key."""
    out = {}
    for key in sorted({k for m in per_rank for k in m}):
        values = [v for m in per_rank if (v := m.get(key)) is not None and not is_nan(v)]
        if not values:
            out[key] = float("nan")
        elif is_summed_count(key):
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


def mismatch_kl(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 estimate of KL(pi_rollout || pi_old) on the sampled response tokens: mean of rho - 1 - log rho,
    rho = pi_old / pi_rollout (the tokens are samples of pi_rollout; verl's ``rollout_corr/k3_kl``), log rho
    clamped to +-20 (finite, as the correction's weights); NaN with no token."""
    log_rho = (logp_old.double() - logp_rollout.double())[mask].clamp(-20.0, 20.0)  # log rho   [n]
    return float((log_rho.exp() - 1.0 - log_rho).mean()) if log_rho.numel() else math.nan


def reports_accuracy(task) -> bool:
    """Whether ``task``'s reward mean is an accuracy (``rollout/accuracy``, ``eval/accuracy...``): its
    ``accuracy`` flag — a built-in task's reward, or a built-in 0/1 verifier (``math``, ``exact_match``,
    ``code``; `cispo.data.rewards.loading.Reward.binary`). A user's function, a reward model or several
    rewards are not: their means are ``reward`` names (`cispo.data.prompts.PromptSource.accuracy`)."""
    return bool(task.accuracy)


def tracked_fork(task):
    """``task.used_fork`` when the task tracks fork strings, else None (fork rates are then null, not 0)."""
    return task.used_fork if task.fork_tokens else None


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation of ``values`` that are not NaN (a response no reward scored:
    `cispo.foundations.experience.Completion.episode_return`); NaN for none."""
    values = [v for v in values if not is_nan(v)]
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def reward_metrics(completions, prefix: str) -> dict:
    """Each ``data.reward``'s ``<prefix>rewards/<name>/mean`` and ``/std`` over the completions where it
    returned a number (`cispo.foundations.experience.Completion.reward_parts`; a failed call counts as
    the 0 it scored, an abstention (None) not at all), and ``<prefix>reward_extra/<key>``: the mean of
    every number the calls reported under ``key`` (``reward_extras``: a verl dict's other keys, TRL's
    ``log_metric`` / ``log_extra``). Nothing for a built-in task's reward (no parts)."""
    out = {}
    for name in dict.fromkeys(n for c in completions for n in c.reward_parts):
        mean, std = mean_std([v for c in completions if (v := c.reward_parts.get(name)) is not None])
        out[f"{prefix}rewards/{name}/mean"], out[f"{prefix}rewards/{name}/std"] = mean, std
    extras: dict[str, list[float]] = {}
    for c in completions:
        for key, value in c.reward_extras:
            extras.setdefault(key, []).append(value)
    out.update({f"{prefix}reward_extra/{key}": sum(v) / len(v) for key, v in extras.items()})
    return out


def rollout_metrics(completions, report: FillReport, used_fork, accuracy: bool = True) -> dict:
    """Every step's rollout metrics, over ``completions``: every response the step sampled, in kept and
    dropped groups alike, so that a step without an update (every group dropped) logs them too — the returns
    (R_i, `cispo.foundations.experience.Completion.episode_return`), ``rollout/accuracy`` only where
    ``accuracy`` (`reports_accuracy`), each reward's parts, lengths, fork rate, stops, the episodes'
    `episode_metrics` — and the refill's counts (``report``)."""
    flat = list(completions)
    lengths = torch.tensor([c.policy_length for c in flat], dtype=torch.float)
    forked = [used_fork(c.text) for c in flat] if used_fork else []
    reward_mean, reward_std = mean_std([c.episode_return for c in flat])
    return {
        "rollout/reward_mean": reward_mean,
        "rollout/reward_std": reward_std,
        **({"rollout/accuracy": sum(c.task_reward for c in flat) / len(flat)} if accuracy else {}),
        **reward_metrics(flat, "rollout/"),
        "rollout/response_length": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/fork_rate": sum(forked) / len(flat) if forked else float("nan"),
        "rollout/truncated": sum(c.finish_reason == "length" for c in flat) / len(flat),
        "rollout/repetition_stops": float(sum(c.finish_reason == "repetition" for c in flat)),
        "rollout/rounds": float(report.rounds),
        "rollout/groups_sampled": float(report.groups_sampled),
        "rollout/groups_kept": float(report.groups_kept),
        **episode_metrics(flat, "rollout/"),
    }


def batch_metrics(exp: Experience) -> dict:
    """The kept batch's log-prob agreement (the sampler's vs log pi_old, over the response tokens the sampler
    scored: ``rollout/logp_rollout_nan`` counts those it gave NaN, left out as TRL leaves them out) and entropy:
    a step with an update."""
    nan_rollout = exp.response_mask.bool() & exp.logp_rollout.isnan()  # [B, T]
    mask = exp.response_mask.bool() & ~nan_rollout
    return {
        "rollout/logp_rollout_nan": float(nan_rollout.sum()),
        "rollout/logp_corr": pearson(exp.logp_rollout[mask], exp.logp_old[mask]),
        "rollout/logp_abs_diff": float((exp.logp_rollout - exp.logp_old)[mask].abs().mean()),
        "rollout/mismatch_kl": mismatch_kl(exp.logp_old, exp.logp_rollout, mask),
        "objective/entropy": float(exp.extras["entropy"][exp.response_mask.bool()].mean()),
    }


def episode_metrics(completions, prefix: str) -> dict:
    """Multi-turn rollouts (completions with an ``episode`` record), per response: ``<prefix>tool_calls``,
    ``tool_call_rate`` (the share of responses that call a tool at least once), ``tool_errors``, ``env_tokens``
    (the environment's tokens), ``turns`` (policy segments), ``turn_reward_mean`` (the mean reward of a
    policy turn, over every turn the environment rewarded; NaN for none), ``final_reward_mean`` (the final
    reward, ``reward``: ``reward_mean`` is the return, final + turn rewards), ``rows_per_episode`` (training
    rows: 1 but where a context rewrote the history) and ``rewrites`` (contexts that began a new row, per
    episode). Nothing for single-turn ones."""
    episodes = [c for c in completions if c.episode is not None]
    if not episodes:
        return {}
    records = [c.episode for c in episodes]
    calls = [r.get("tool_calls", 0) for r in records]
    turn_rewards = [r for c in episodes for r in c.turn_rewards]
    n = len(records)
    return {
        f"{prefix}tool_calls": sum(calls) / n,
        f"{prefix}tool_call_rate": sum(k > 0 for k in calls) / n,
        f"{prefix}tool_errors": sum(r.get("tool_errors", 0) for r in records) / n,
        f"{prefix}env_tokens": sum(c.length - c.policy_length for c in episodes) / n,
        f"{prefix}turns": sum(num_segments(c) for c in episodes) / n,
        f"{prefix}turn_reward_mean": sum(turn_rewards) / len(turn_rewards) if turn_rewards else float("nan"),
        f"{prefix}final_reward_mean": sum(c.reward for c in episodes) / n,
        f"{prefix}rows_per_episode": sum(len(c.rows) for c in episodes) / n,
        f"{prefix}rewrites": sum(r.get("rewrites", 0) for r in records) / n,
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
# Reflective (fork) strings, and the mechanism check: does PPO's upper mask act on
# rare positive fork tokens? One row of sums per tracked string (`cispo.foundations.forks`), one for the rest.
# ---------------------------------------------------------------------------------------

MECHANISM_COUNT = "objective/fork_pos_lowp_above"  # and its per-update "..._k{k}" keys: summed over ranks
FORK_COLUMNS = ("tokens", "capped", "ppo_dropped", "pos", "pos_above", "pos_lowp_above", "mass", "mass_above",
                "mass_lowp_above", "neg_mass", "neg_mass_below")
"""The columns of `fork_sums`."""
_COL = {name: i for i, name in enumerate(FORK_COLUMNS)}
_FORK_COUNT = re.compile(r"^fork/[^/]+/(count|tokens|pos|pos_above|pos_lowp_above)(_k\d+)?$")


def is_summed_count(key: str) -> bool:
    """A per-rank count whose value for the step is the sum over ranks."""
    return key in SUMMED_OVER_RANKS or key.startswith(MECHANISM_COUNT) or bool(_FORK_COUNT.match(key))


def fork_labels(exp: Experience, n_strings: int) -> torch.Tensor:
    """Each response token's row of `fork_sums`: the index of the fork string whose match it starts
    (``exp.extras["fork_index"]``, `cispo.foundations.forks.ForkTokens.index`), else ``n_strings`` (the other
    tokens).  -> [b, T] long"""
    T = exp.response_mask.shape[1]
    index = exp.extras["fork_index"][:, :T]  # [b, T]
    return torch.where(index >= 0, index, torch.full_like(index, n_strings))


@torch.no_grad()
def fork_sums(exp: Experience, stats: ObjectiveStats, n_strings: int, eps_high: float,
              eps_low: float = 0.2) -> torch.Tensor:
    """One micro-batch's counts per fork string (rows 0..S-1, in ``ForkTokens.names`` order) and for
    the other response tokens (row S), in the columns `FORK_COLUMNS`:

    * ``tokens``; ``capped`` (w != r, eq. 5) and ``ppo_dropped`` (M = 0, eq. 7) among them;
    * ``pos``: those with A > 0; ``pos_above``: of them, r > 1 + eps_high — the ones whose gradient
      PPO's upper mask drops (CISPO keeps it, capped); ``pos_lowp_above``: of those, p_old < 0.1 — the
      paper's case;
    * ``mass`` / ``mass_above``: the gradient-mass proxy (1 - p) |w A| summed over the A > 0 tokens /
      over those with r > 1 + eps_high (|d log p / d logit| = 1 - p); ``mass_lowp_above``: of the
      latter, p_old < 0.1 (the paper's case, by mass);
    * ``neg_mass`` / ``neg_mass_below``: the same proxy over the A < 0 tokens / over those with
      r < 1 - eps_low (what PPO's lower mask drops and CISPO keeps).

    ``stats`` must carry its per-token flags, ``ratio`` and ``weight``.  -> [S + 1, F] float64"""
    mask = exp.response_mask.bool()  # [b, T]
    T = mask.shape[1]
    A = exp.token_advantages  # A_it   [b, T]
    positive = (A > 0) & mask  # [b, T]
    ratio, weight = stats.ratio[:, :T], stats.weight[:, :T]  # [b, T]
    above = positive & (ratio > 1.0 + eps_high)  # [b, T]
    p_new = torch.exp(exp.logp_old[:, :T]) * ratio  # pi_theta = r pi_old    [b, T]
    mass = (1.0 - p_new).clamp(min=0) * (weight * A).abs()  # [b, T]
    low_prob = exp.logp_old[:, :T] < math.log(LOW_PROB)  # [b, T]
    negative = (A < 0) & mask  # [b, T]
    below = negative & (ratio < 1.0 - eps_low)  # [b, T]
    columns = {"tokens": mask, "capped": stats.capped[:, :T], "ppo_dropped": stats.ppo_dropped[:, :T],
               "pos": positive, "pos_above": above, "pos_lowp_above": above & low_prob,
               "mass": mass * positive, "mass_above": mass * above, "mass_lowp_above": mass * (above & low_prob),
               "neg_mass": mass * negative, "neg_mass_below": mass * below}
    values = torch.stack([columns[c].double() for c in FORK_COLUMNS], dim=-1)[mask]  # [n, F]
    labels = fork_labels(exp, n_strings)[mask]  # [n]
    out = torch.zeros(n_strings + 1, len(FORK_COLUMNS), dtype=torch.float64, device=values.device)
    return out.index_add_(0, labels, values).cpu()


def frac_ppo_dropped_fork(sums: torch.Tensor) -> float:
    """The PPO-dropped share of the fork tokens (every string) in ``fork_sums``' totals; NaN for none."""
    forks = sums[:-1].sum(0)  # [F]
    n = float(forks[_COL["tokens"]])
    return float(forks[_COL["ppo_dropped"]]) / n if n else float("nan")


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole > 0 else float("nan")


def _update_block(row: torch.Tensor, suffix: str) -> dict:
    """One row of ``fork_sums`` (one string, or the other tokens) as metrics named ``<name><suffix>``."""
    c = {name: float(row[i]) for name, i in _COL.items()}
    return {f"pos{suffix}": c["pos"], f"pos_above{suffix}": c["pos_above"],
            f"pos_lowp_above{suffix}": c["pos_lowp_above"],
            f"frac_capped{suffix}": _ratio(c["capped"], c["tokens"]),
            f"frac_ppo_dropped{suffix}": _ratio(c["ppo_dropped"], c["tokens"]),
            f"pos_mass_above{suffix}": _ratio(c["mass_above"], c["mass"])}


def all_token_metrics(row: torch.Tensor, suffix: str) -> dict:
    """The mechanism on every response token, from ``fork_sums`` summed over its rows:
    ``objective/all_pos_lowp_above`` (A > 0, p_old < 0.1, r > 1 + eps_high: the paper's case, counted),
    ``all_pos_mass_above`` (the share of the positive gradient-mass proxy above 1 + eps_high: what DAPO's
    upper mask drops), ``all_pos_mass_lowp_above`` (the share of it both above and p_old < 0.1) and
    ``all_neg_mass_below`` (the share of the negative tokens' proxy below 1 - eps_low: what the lower mask
    drops), each named with ``suffix`` (``""`` pooled over the step's updates, ``_k{k}`` for update k)."""
    c = {name: float(row[i]) for name, i in _COL.items()}
    return {f"objective/all_pos_lowp_above{suffix}": c["pos_lowp_above"],
            f"objective/all_pos_mass_above{suffix}": _ratio(c["mass_above"], c["mass"]),
            f"objective/all_pos_mass_lowp_above{suffix}": _ratio(c["mass_lowp_above"], c["mass"]),
            f"objective/all_neg_mass_below{suffix}": _ratio(c["neg_mass_below"], c["neg_mass"])}


def fork_metrics(per_update: list[torch.Tensor], names: tuple[str, ...]) -> dict:
    """The step's fork diagnostics from each optimizer step's ``fork_sums`` (update index k = 1..K·epochs):

    * over every fork string, the mechanism check: ``objective/fork_pos_lowp_above`` (summed over the
      updates) and ``objective/fork_pos_mass_above`` (the share of the positive fork tokens' gradient
      mass above 1 + eps_high, pooled), each also per update (``..._k{k}``); the same share for the
      other tokens, ``objective/other_pos_mass_above``;
    * per string ``s`` of ``names`` (metric names, ``cispo.foundations.forks.slug``) and for ``other``:
      ``fork/<s>/{pos, pos_above, pos_lowp_above}`` (counts), ``frac_capped``, ``frac_ppo_dropped``
      (shares of its tokens), ``pos_mass_above`` (share of its positive mass) pooled over the updates,
      and each per update, ``fork/<s>/<metric>_k{k}``, with ``fork/<s>/tokens_k{k}`` — the per-update
      keys only in a step that has a token of ``s`` (12 strings x K = 16 would be 1344 keys a step)."""
    total = sum(per_update)  # [S + 1, F]
    forks = lambda sums: sums[:-1].sum(0)  # noqa: E731  every fork string   [F]
    mass_share = lambda row: _ratio(float(row[_COL["mass_above"]]), float(row[_COL["mass"]]))  # noqa: E731
    out = {MECHANISM_COUNT: float(forks(total)[_COL["pos_lowp_above"]]),
           "objective/fork_pos_mass_above": mass_share(forks(total)),
           "objective/other_pos_mass_above": mass_share(total[-1]),
           **all_token_metrics(total.sum(0), "")}
    for k, sums in enumerate(per_update, start=1):
        out[f"{MECHANISM_COUNT}_k{k}"] = float(forks(sums)[_COL["pos_lowp_above"]])
        out[f"objective/fork_pos_mass_above_k{k}"] = mass_share(forks(sums))
        out.update(all_token_metrics(sums.sum(0), f"_k{k}"))
    for row, name in enumerate((*names, OTHER)):
        blocks = {**_update_block(total[row], "")}
        for k, sums in enumerate(per_update if total[row, _COL["tokens"]] > 0 else [], start=1):
            blocks[f"tokens_k{k}"] = float(sums[row, _COL["tokens"]])
            blocks.update(_update_block(sums[row], f"_k{k}"))
        out.update({f"fork/{name}/{key}": value for key, value in blocks.items()})
    return out


@torch.no_grad()
def fork_rollout_metrics(exp: Experience, names: tuple[str, ...]) -> dict:
    """The batch's fork strings as sampled, per string ``s`` of ``names`` and for ``other``:
    ``fork/<s>/count`` (tokens that start a match), ``fork/<s>/rate`` (responses with one; not for
    ``other``), ``fork/<s>/p_old`` (the mean of pi_old of those tokens, the policy that sampled them)
    and ``fork/<s>/frac_lowp`` (their share with p_old < 0.1)."""
    mask = exp.response_mask.bool()  # [B, T]
    labels = fork_labels(exp, len(names))  # [B, T]
    p_old = torch.exp(exp.logp_old.double())  # [B, T]
    out = {}
    for row, name in enumerate((*names, OTHER)):
        here = (labels == row) & mask  # [B, T]
        n = int(here.sum())
        out[f"fork/{name}/count"] = float(n)
        if name != OTHER:
            out[f"fork/{name}/rate"] = float(here.any(-1).double().mean()) if len(exp) else float("nan")
        out[f"fork/{name}/p_old"] = float(p_old[here].mean()) if n else float("nan")
        out[f"fork/{name}/frac_lowp"] = float((p_old[here] < LOW_PROB).double().mean()) if n else float("nan")
    return out
