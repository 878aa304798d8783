"""ScaleRL's compute–performance curve (arXiv 2510.13786, eq. 1), fitted per arm: a
saturating sigmoid of held-out accuracy R against compute C,

    R(C) − R0 = (A − R0) / (1 + (C_mid / C)^B)

* R0: the accuracy at C = 0, the mean step-0 held-out accuracy of the arm's runs; fixed, not fitted;
* A: the asymptote, fitted in [R0, 1];
* B: the scaling efficiency (how sharply the gain arrives), fitted in (0, 10];
* C_mid: the compute at which half the gain A − R0 is reached, fitted in (0, 10 · max C].

The fit (`fit_curve`): least squares (``scipy.optimize.curve_fit``, trust-region reflective with
those bounds) on the pooled (C, R) points of all the arm's seeds with C > 0 (the points at C = 0
are R0's). When every seed is evaluated at the same C this is the fit to the seed-mean curve: the
pooled sum of squares is n_seeds × the mean curve's plus a constant. The intervals
(`bootstrap_fit`): a t-scaled percentile bootstrap over seeds — draw as many seeds as the arm has,
with replacement, pool their points, refit (R0 stays fixed); 95%: the refits' 2.5th and 97.5th
percentiles, each one's distance from the estimate θ̂ times √(n/(n−1)) · t_{n−1, 0.975} / z_0.975
(`t_scaled_interval`), cut to the fit's bounds. The plain percentile
interval of the same refits under-covers over few seeds (nominal 95%: 72–76% at 3 seeds, 84–89% at
6, on synthetic curves of known parameters); the t-scaled one covers 91–97% from 3 seeds on
(``python -m studies.scripts.compute_fit_coverage``; the cells measured: studies/results/
compute_fit_coverage.md). Under `MIN_SEEDS` seeds the intervals are still
given but flagged: they are wide, and their coverage rests on the refits' spread from very few units.

The compute axis C (`AXES`, `compute_curve`): ``steps``, the RL step of each evaluation; or
``step_seconds``, the run's cumulative ``perf/step_s`` up to that step (wall-clock seconds of the
training steps as measured — at 1 CPU thread for the study's runs —, evaluation time left out;
``python -m studies data`` writes ``perf/step_s`` per step).

Descriptive: no test, and no decision rests on it. A *curve* is ``{C: R}`` (`studies.stats`
has ``{step: R}``). Pure functions; scipy is imported on first use.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from studies.study_runs import RunData

AXES = ("steps", "step_seconds")
"""The compute axes `compute_curve` knows."""
B_MAX = 10.0
"""B's upper bound."""
C_MID_MAX = 10.0
"""C_mid's upper bound, in units of the largest C fitted."""
MIN_SEEDS = 6
"""Fewer seeds than this: the intervals are flagged (`ArmFit.few_seeds`); fewer than 3: not given."""
_TINY = 1e-6
"""The open lower bounds of B and C_mid / max C (curve_fit's bounds are closed)."""


@dataclass(frozen=True)
class Fit:
    """One fit of eq. 1; `rmse` = sqrt(mean squared residual) over the `n_points` points with C > 0,
    the largest of whose C is `C_max` (C_mid's bound is 10 · C_max)."""

    A: float
    B: float
    C_mid: float
    R0: float
    rmse: float
    n_points: int
    C_max: float


@dataclass(frozen=True)
class Bootstrap:
    """t-scaled bootstrap intervals (lo, hi) of A, B and C_mid (`t_scaled_interval`, cut to the fit's
    bounds; NaN under 3 seeds) over `n_boot` resamples of the seeds, of which `failed` could not be fitted
    (left out of the intervals)."""

    A: tuple[float, float]
    B: tuple[float, float]
    C_mid: tuple[float, float]
    n_boot: int
    failed: int


@dataclass(frozen=True)
class ArmFit:
    """An arm's fit on the pooled points of its `seeds` seeds, and its bootstrap intervals."""

    fit: Fit
    boot: Bootstrap
    seeds: int

    @property
    def few_seeds(self) -> bool:
        """Fewer seeds than `MIN_SEEDS`: the intervals are to be read as rough (or are missing, under 3)."""
        return self.seeds < MIN_SEEDS


def sigmoid_curve(C, A: float, B: float, C_mid: float, R0: float) -> np.ndarray:
    """R(C) = R0 + (A − R0) / (1 + (C_mid / C)^B), elementwise (shape of C); R(0) = R0 (the limit)."""
    C = np.asarray(C, dtype=float)
    with np.errstate(divide="ignore", over="ignore"):
        return R0 + (A - R0) / (1.0 + (C_mid / C) ** B)


def initial_values(C: np.ndarray, R: np.ndarray, R0: float) -> tuple[float, float, float]:
    """(A, B, C_mid) to start from: A the largest R (clipped to [R0, 1]), B = 1, C_mid the smallest
    C at which R reaches half that gain, R0 + (A − R0) / 2 (the largest C if none does)."""
    A = min(max(float(R.max()), R0), 1.0)
    half = C[R >= R0 + (A - R0) / 2]
    return A, 1.0, float(half.min() if half.size else C.max())


def fit_curve(C, R, R0: float, label: str = "curve") -> Fit:
    """Eq. 1 fitted to the points (C, R) with C > 0 (shape (n,) each), R0 fixed: A in [R0, 1],
    B in (0, 10], C_mid in (0, 10 · max C]. C is scaled by its largest value for the fit (all three
    parameters of order 1) and C_mid scaled back. ValueError naming `label` with fewer than 3
    distinct C > 0, with non-finite values, with R0 outside [0, 1), or when the fit does not converge."""
    from scipy.optimize import OptimizeWarning, curve_fit

    C, R = np.asarray(C, dtype=float), np.asarray(R, dtype=float)
    keep = C > 0  # the points at C = 0 are R0's
    C, R = C[keep], R[keep]
    if not (np.isfinite(C).all() and np.isfinite(R).all() and math.isfinite(R0)):
        raise ValueError(f"{label}: non-finite compute or accuracy values")
    if np.unique(C).size < 3:
        raise ValueError(f"{label}: {np.unique(C).size} distinct compute value(s) C > 0; fitting A, B and C_mid "
                         "needs at least 3")
    if not 0 <= R0 < 1:
        raise ValueError(f"{label}: R0 = {R0:g} is outside [0, 1): no gain to fit")
    scale = float(C.max())
    A0, B0, mid0 = initial_values(C, R, R0)
    lower, upper = (R0, _TINY, _TINY), (1.0, B_MAX, C_MID_MAX)
    p0 = np.clip([A0, B0, mid0 / scale], lower, upper)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)  # about the covariance, which is not used
            (A, B, mid), _ = curve_fit(lambda c, a, b, m: sigmoid_curve(c, a, b, m, R0), C / scale, R, p0=p0,
                                       bounds=(lower, upper), maxfev=10_000, xtol=1e-12, ftol=1e-12, gtol=1e-12)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{label}: the fit of eq. 1 did not converge ({e})") from None
    rmse = float(np.sqrt(np.mean((sigmoid_curve(C / scale, A, B, mid, R0) - R) ** 2)))
    return Fit(float(A), float(B), float(mid * scale), R0, rmse, int(C.size), scale)


def pooled(curves: list[Mapping[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """The points of several curves ``{C: R}`` in one pair of arrays (C, R), shape (Σ len,) each."""
    pts = [(c, r) for curve in curves for c, r in curve.items()]
    return np.array([c for c, _ in pts], dtype=float), np.array([r for _, r in pts], dtype=float)


def start_value(curves_by_seed: Mapping[int, Mapping[float, float]], label: str = "curve") -> float:
    """R0: the mean over seeds of R at C = 0. ValueError naming `label` when no seed has a point there."""
    at0 = [curve[0] for curve in curves_by_seed.values() if 0 in curve]
    if not at0:
        raise ValueError(f"{label}: no evaluation at C = 0 (step 0) to take R0 from")
    return sum(at0) / len(at0)


def percentile_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """The (1 − level)/2 and (1 + level)/2 quantiles of `values` (numpy's linear interpolation);
    (NaN, NaN) when empty. Too narrow over few seeds (see `t_scaled_interval`); kept for comparison."""
    if not values:
        return float("nan"), float("nan")
    lo, hi = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def t_scaled_interval(estimate: float, values: list[float], n: int, level: float = 0.95) -> tuple[float, float]:
    """The percentile interval of the refits θ* over `n` seeds widened about the estimate θ̂: each endpoint's
    distance from θ̂ times c = √(n/(n−1)) · t_{n−1, (1+level)/2} / z_{(1+level)/2} (a distance below 0, an
    endpoint past θ̂, counts as 0). A bootstrap over n units spreads like the divisor-n estimate, so √(n/(n−1));
    the spread itself is estimated from n units, so Student's t for n − 1 degrees of freedom in place of the
    normal z. Keeping each side's own distance keeps the refits' skew, which matters where a parameter sits at
    a bound of the fit (A at 1) or has a long tail (C_mid); c > 1 always, so the interval holds the percentile
    one. (NaN, NaN) with fewer than 2 values or seeds. Measured by ``python -m studies.scripts.compute_fit_coverage``
    (synthetic curves of known parameters, nominal 95%): the percentile interval holds the truth 72–76% of the
    time at 3 seeds and 84–89% at 6; this one 91–97% from 3 seeds on."""
    if len(values) < 2 or n < 2:
        return float("nan"), float("nan")
    from scipy.stats import norm, t

    c = math.sqrt(n / (n - 1)) * float(t.ppf((1 + level) / 2, n - 1)) / float(norm.ppf((1 + level) / 2))
    lo, hi = percentile_interval(values, level)
    return estimate - c * max(estimate - lo, 0.0), estimate + c * max(hi - estimate, 0.0)


def resample_fits(curves_by_seed: Mapping[int, Mapping[float, float]], R0: float, n_boot: int = 1000,
                  seed: int = 0, label: str = "curve") -> tuple[list[Fit], int]:
    """The fits of `n_boot` resamples of the seeds (len(curves_by_seed) drawn with replacement,
    ``numpy.random.default_rng(seed)``, seeds in sorted order), R0 fixed, and how many could not be fitted.
    A resample's fit depends only on which seeds it holds how often, so each such multiset is fitted once."""
    curves = [curves_by_seed[s] for s in sorted(curves_by_seed)]
    draws = np.random.default_rng(seed).integers(0, len(curves), size=(n_boot, len(curves)))
    done: dict[tuple[int, ...], Fit | None] = {}
    fits, failed = [], 0
    for idx in draws:
        key = tuple(sorted(int(i) for i in idx))
        if key not in done:
            try:
                done[key] = fit_curve(*pooled([curves[i] for i in key]), R0, label)
            except ValueError:
                done[key] = None
        if done[key] is None:
            failed += 1
        else:
            fits.append(done[key])
    return fits, failed


def fit_bounds(fit: Fit) -> dict[str, tuple[float, float]]:
    """The range `fit_curve` allows each parameter: A in [R0, 1], B in [0, B_MAX], C_mid in [0, C_MID_MAX · C_max]."""
    return {"A": (fit.R0, 1.0), "B": (0.0, B_MAX), "C_mid": (0.0, C_MID_MAX * fit.C_max)}


def bootstrap_fit(curves_by_seed: Mapping[int, Mapping[float, float]], fit: Fit, n_boot: int = 1000, seed: int = 0,
                  label: str = "curve", level: float = 0.95) -> Bootstrap:
    """t-scaled bootstrap over seeds around `fit` (the arm's own fit, whose R0 the refits keep): the refits
    of `resample_fits`; each parameter's `t_scaled_interval` over the n seeds from the refits that
    succeeded (`Bootstrap.failed` counts the others), cut to the parameter's range (`fit_bounds`); NaN
    with fewer than 3 seeds (Student's t at 1 degree of freedom gives no usable width)."""
    fits, failed = resample_fits(curves_by_seed, fit.R0, n_boot, seed, label)
    n, out = len(curves_by_seed), {}
    for name, (lo_b, hi_b) in fit_bounds(fit).items():
        lo, hi = t_scaled_interval(getattr(fit, name), [getattr(f, name) for f in fits], n, level)
        out[name] = (max(lo, lo_b), min(hi, hi_b)) if n >= 3 else (float("nan"), float("nan"))
    return Bootstrap(out["A"], out["B"], out["C_mid"], n_boot, failed)


def fit_arm(curves_by_seed: Mapping[int, Mapping[float, float]], label: str = "curve", n_boot: int = 1000,
            seed: int = 0) -> ArmFit:
    """An arm's fit: R0 = `start_value`, eq. 1 on the pooled points of all its seeds
    (`fit_curve`), and the bootstrap intervals over its seeds (`bootstrap_fit`)."""
    R0 = start_value(curves_by_seed, label)
    fit = fit_curve(*pooled(list(curves_by_seed.values())), R0, label)
    return ArmFit(fit, bootstrap_fit(curves_by_seed, fit, n_boot, seed, label), len(curves_by_seed))


def compute_curve(curve: Mapping[int, float], step_s: Mapping[int, float], axis: str) -> dict[float, float]:
    """One run's held-out curve ``{step: R}`` on the compute axis, ``{C: R}``: ``steps``: C = step;
    ``step_seconds``: C = Σ ``perf/step_s`` over the run's steps ≤ step (step 0: 0 s).
    ValueError for another axis, or for ``step_seconds`` when the run logged no ``perf/step_s``."""
    if axis == "steps":
        return {float(s): r for s, r in curve.items()}
    if axis != "step_seconds":
        raise ValueError(f"unknown compute axis {axis!r}: one of {', '.join(AXES)}")
    if not step_s:
        raise ValueError("no perf/step_s in the data: fit against steps instead")
    done = sorted(step_s)
    cum = np.concatenate([[0.0], np.cumsum([step_s[t] for t in done])])  # cum[i]: seconds of the first i steps
    return {float(cum[np.searchsorted(done, s, side="right")]): r for s, r in curve.items()}


def fit_runs(runs: Mapping[int, RunData], axis: str, label: str, n_boot: int = 1000, seed: int = 0) -> ArmFit | str:
    """`fit_arm` of an arm's runs (seed -> run) on `axis`; the ValueError's message when it cannot fit."""
    try:
        curves = {s: compute_curve(r.curve(), r.curve("perf/step_s"), axis) for s, r in runs.items()}
        return fit_arm(curves, label, n_boot, seed)
    except ValueError as e:
        return str(e) if str(e).startswith(label) else f"{label}: {e}"
