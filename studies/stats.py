"""The statistics of a comparison: per-run measures on a held-out accuracy curve, and the
intervals and corrections the study reports.

A *curve* is ``{step: held-out accuracy}`` (``eval/accuracy``, mean@k), step 0 the base model.
Every function is pure; the t quantiles and the binomial interval come from scipy (imported
on first use: ``cispo --help`` does not pay for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _scipy_stats():
    from scipy import stats

    return stats

# --------------------------------------------------------------------------------------
# Per-run measures
# --------------------------------------------------------------------------------------


def final_accuracy(curve: dict[int, float], last: int = 1) -> float:
    """Held-out accuracy at the last evaluated step; with ``last = n``, the mean of the last n
    evaluations (the study protocol: 2, which halves one evaluation's noise)."""
    steps = sorted(curve)[-last:]
    return sum(curve[s] for s in steps) / len(steps) if steps else float("nan")


def mean_accuracy(curve: dict[int, float]) -> float:
    """Mean held-out accuracy over the evaluations after step 0 (area under the curve, per
    evaluation); NaN with no such evaluation. The learning-rate tuning score."""
    vals = [v for s, v in curve.items() if s > 0 and v == v]
    return sum(vals) / len(vals) if vals else float("nan")


def steps_to_target(curve: dict[int, float], target: float) -> int | None:
    """First evaluated step > 0 whose held-out accuracy is >= target (None: never)."""
    for step in sorted(curve):
        if step > 0 and curve[step] >= target:
            return step
    return None


def censored_steps(curve: dict[int, float], target: float) -> tuple[float, bool]:
    """(steps to target, reached). A run that never reaches it is *censored*: it counts as its
    last evaluated step plus one evaluation interval (the last two evaluations' distance; 1
    with a single evaluation) — the earliest step at which it could still have reached it."""
    s = steps_to_target(curve, target)
    if s is not None:
        return float(s), True
    steps = sorted(curve)
    return float(steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 1)), False


def steps_to_own_fraction(curve: dict[int, float], fraction: float = 0.9, last: int = 1) -> int | None:
    """First evaluated step > 0 at which held-out accuracy is >= `fraction` × the run's own
    final accuracy (`final_accuracy(curve, last)`): how early the curve flattens."""
    return steps_to_target(curve, fraction * final_accuracy(curve, last))


def mean_over_last_steps(values: dict[int, float], n: int = 5) -> float:
    """Mean of a per-step metric over the run's last `n` steps that recorded it."""
    steps = sorted(values)[-n:]
    return sum(values[s] for s in steps) / len(steps) if steps else float("nan")


def pick_lr(scores: dict[float, float], tie: float = 0.0) -> float:
    """The smallest rate whose score is within `tie` of the best (|Δ| < tie) or equal to it;
    NaN scores never win (all NaN: the smallest rate)."""
    finite = {lr: v for lr, v in scores.items() if v == v}
    if not finite:
        return min(scores)
    best = max(finite.values())
    return min(lr for lr, v in finite.items() if v == best or best - v < tie)


def at_edge(lr: float, grid) -> bool:
    """Is `lr` the smallest or the largest of a grid of >= 2 rates?"""
    grid = list(grid)
    return len(grid) > 1 and lr in (min(grid), max(grid))


COLLAPSE_FLOOR = 0.1
"""A run whose peak held-out accuracy is below this never learned: it is neither collapsed nor
stable, and the collapse fraction leaves it out (counted apart as "never learned")."""


def collapsed(curve: dict[int, float], floor: float = COLLAPSE_FLOOR) -> bool | None:
    """Did the run collapse (the study protocol's definition)? Let P be the peak held-out
    accuracy, the maximum over all its evaluations (step 0 included), reached first at
    s_peak. The run collapsed when some evaluation after s_peak is below P / 2 and every later
    evaluation up to the end of the run is below P / 2 too ("falls below half its peak and
    stays there"). As that must hold at the last evaluation, and then holds from the first
    evaluation of the final run of values below P / 2, it is the same as: the last evaluation
    comes after s_peak and is below P / 2.

    None when P < ``floor`` (the run never learned: nothing to collapse from) or the run has
    fewer than two evaluations."""
    if len(curve) < 2:
        return None
    peak = max(curve.values())
    if peak < floor:
        return None
    s_peak = min(s for s, v in curve.items() if v == peak)
    last = max(curve)
    return last > s_peak and curve[last] < peak / 2


# --------------------------------------------------------------------------------------
# Intervals
# --------------------------------------------------------------------------------------


def t_quantile(level: float, df: int) -> float:
    """Two-sided Student-t quantile: P(|T_df| <= q) = level."""
    return float(_scipy_stats().t.ppf(0.5 + level / 2, df))


def mean_band(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, std, half-width of the two-sided t-interval at ``level``); std and half-width 0
    for a single value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0, 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, std, t_quantile(level, n - 1) * std / math.sqrt(n)


@dataclass(frozen=True)
class Paired:
    """A paired t-interval of differences d_i = a_i - b_i over n seeds."""

    n: int
    mean: float
    half: float  # half-width at the interval's level
    p: float  # two-sided p-value of H0: E[d] = 0 (1 when every d_i = 0, NaN with n < 2 and d != 0)

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half


def paired_t(diffs: list[float], level: float = 0.95) -> Paired:
    """mean d ± t_{n-1} s_d / sqrt(n), and the paired t-test's two-sided p-value."""
    n = len(diffs)
    mean, std, half = mean_band(diffs, level)
    if n < 2:
        p = float("nan")
    elif std == 0:
        p = 1.0 if mean == 0 else 0.0
    else:
        p = float(2 * _scipy_stats().t.sf(abs(mean) / (std / math.sqrt(n)), n - 1))
    return Paired(n, mean, half, p)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values for a family of m tests (in the input order):
    sort ascending, p_(j) * (m - j + 1) for j = 1..m, made monotone, capped at 1. A test is
    rejected at family-wise level alpha when its adjusted p <= alpha. NaN stays NaN and does
    not count in m."""
    idx = sorted((i for i, p in enumerate(pvalues) if p == p), key=lambda i: pvalues[i])
    m, out, running = len(idx), [float("nan")] * len(pvalues), 0.0
    for j, i in enumerate(idx):
        running = max(running, min(1.0, pvalues[i] * (m - j)))
        out[i] = running
    return out


def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k / n; (0, 1) when n = 0."""
    if n == 0:
        return 0.0, 1.0
    ci = _scipy_stats().binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs (NaN with fewer than two distinct xs)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else float("nan")


def fieller_ratio(num: list[float], den: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(R, lo, hi): the ratio of means R = mean(num) / mean(den) of paired samples, with
    Fieller's interval {R : (x̄ - R ȳ)² <= t² Var(x̄ - R ȳ)}, Var(x̄ - R ȳ) = (s_xx - 2R s_xy +
    R² s_yy) / n, t the two-sided t_{n-1} quantile. It is (-inf, inf) when ȳ is not
    distinguishable from 0 at ``level`` (the quadratic opens downwards)."""
    n = len(num)
    if n != len(den) or n == 0:
        raise ValueError(f"fieller_ratio: need paired samples of equal length >= 1, got {len(num)} and {len(den)}")
    x, y = sum(num) / n, sum(den) / n
    r = x / y if y else float("inf")
    if n < 2:
        return r, float("-inf"), float("inf")
    sxx = sum((a - x) ** 2 for a in num) / (n - 1)
    syy = sum((b - y) ** 2 for b in den) / (n - 1)
    sxy = sum((a - x) * (b - y) for a, b in zip(num, den)) / (n - 1)
    q = t_quantile(level, n - 1) ** 2 / n
    a, b, c = y * y - q * syy, -2 * (x * y - q * sxy), x * x - q * sxx
    disc = b * b - 4 * a * c
    if a <= 0 or disc < 0:
        return r, float("-inf"), float("inf")
    root = math.sqrt(disc)
    return r, (-b - root) / (2 * a), (-b + root) / (2 * a)
