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
(`bootstrap_fit`): percentile bootstrap over seeds — draw as many seeds as the arm has, with
replacement, pool their points, refit; 95%: the 2.5th and 97.5th percentiles of the refits that
succeeded (R0 stays fixed).

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
    """Percentile intervals (lo, hi) of A, B and C_mid over `n_boot` resamples of the seeds, of
    which `failed` could not be fitted (left out of the intervals)."""

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
    (NaN, NaN) when empty."""
    if not values:
        return float("nan"), float("nan")
    lo, hi = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def bootstrap_fit(curves_by_seed: Mapping[int, Mapping[float, float]], R0: float, n_boot: int = 1000, seed: int = 0,
                  label: str = "curve", level: float = 0.95) -> Bootstrap:
    """Percentile bootstrap over seeds: `n_boot` times draw len(curves_by_seed) seeds with
    replacement (``numpy.random.default_rng(seed)``, seeds taken in sorted order), pool their
    points, `fit_curve` with R0 fixed; each parameter's interval from the refits that succeeded
    (`Bootstrap.failed` counts the others)."""
    curves = [curves_by_seed[s] for s in sorted(curves_by_seed)]
    draws = np.random.default_rng(seed).integers(0, len(curves), size=(n_boot, len(curves)))
    fits, failed = [], 0
    for idx in draws:
        try:
            fits.append(fit_curve(*pooled([curves[i] for i in idx]), R0, label))
        except ValueError:
            failed += 1
    A, B, mid = (percentile_interval([getattr(f, p) for f in fits], level) for p in ("A", "B", "C_mid"))
    return Bootstrap(A, B, mid, n_boot, failed)


def fit_arm(curves_by_seed: Mapping[int, Mapping[float, float]], label: str = "curve", n_boot: int = 1000,
            seed: int = 0) -> ArmFit:
    """An arm's fit: R0 = `start_value`, eq. 1 on the pooled points of all its seeds
    (`fit_curve`), and the bootstrap intervals over its seeds (`bootstrap_fit`)."""
    R0 = start_value(curves_by_seed, label)
    fit = fit_curve(*pooled(list(curves_by_seed.values())), R0, label)
    return ArmFit(fit, bootstrap_fit(curves_by_seed, R0, n_boot, seed, label), len(curves_by_seed))


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
