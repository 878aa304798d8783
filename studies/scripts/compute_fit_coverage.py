"""How often the compute–performance fit's 95% intervals (`studies.compute_fit`) hold the true parameters:
synthetic arms of eq. 1 with known A, B and C_mid, refitted and bootstrapped over seeds, for several
interval methods at several seed counts. One JSON object per (noise, seeds) to stdout, and a Markdown table.

    python -m studies.scripts.compute_fit_coverage --seeds 3 4 6 8 --reps 200 --boot 400
    # what it measured: studies/results/compute_fit_coverage.md

The methods, from the same bootstrap refits θ*_b of an arm's estimate θ̂ over n seeds (each interval cut to
the fit's bounds of that parameter):

* ``percentile``: the 2.5th and 97.5th percentiles of θ*_b (the intervals before the re-calibration);
* ``bca``: Efron's bias-corrected and accelerated percentiles (z0 from the share of θ*_b below θ̂, the
  acceleration from the n leave-one-seed-out fits);
* ``expanded``: Hesterberg's expanded percentile interval, the percentiles at Φ(± √(n/(n−1)) t_{n−1, 0.975});
* ``t_scaled``: θ̂ ± √(n/(n−1)) t_{n−1, 0.975} · sd(θ*_b), the bootstrap's spread made the unbiased one and
  widened by Student's t (symmetric);
* ``scaled_percentile``: the percentile endpoints' distances from θ̂ times √(n/(n−1)) t_{n−1, 0.975} / z_0.975
  (`studies.compute_fit.t_scaled_interval`, what the report prints: the same widening, each side's own skew).

Noise models (``--noise``): ``iid``, every point N(0, 0.04) around the true curve; ``seed``, a per-seed
offset N(0, 0.03) plus N(0, 0.02) a point (seeds whose curves differ as a whole, as real ones do). The
true curve: R0 = 0.05 (exact at C = 0), A = 0.85, B = 2, C_mid = 30, evaluations every 5 steps to 120.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from studies.compute_fit import (
    B_MAX,
    C_MID_MAX,
    fit_curve,
    percentile_interval,
    pooled,
    resample_fits,
    t_scaled_interval,
)


def symmetric_t_interval(estimate: float, values: list[float], n: int, level: float = 0.95) -> tuple[float, float]:
    """θ̂ ± √(n/(n−1)) · t_{n−1, (1+level)/2} · sd(values)."""
    from scipy.stats import t

    half = math.sqrt(n / (n - 1)) * float(t.ppf((1 + level) / 2, n - 1)) * float(np.std(values, ddof=1))
    return estimate - half, estimate + half

TRUE = {"A": 0.85, "B": 2.0, "C_mid": 30.0}
R0 = 0.05
STEPS = np.arange(0, 125, 5, dtype=float)
PARAMS = ("A", "B", "C_mid")
METHODS = ("percentile", "bca", "expanded", "t_scaled", "scaled_percentile")


def synthetic_arm(n_seeds: int, noise: str, rng: np.random.Generator) -> dict[int, dict[float, float]]:
    """seed -> {C: R}: eq. 1 at `TRUE` plus the `noise` model's noise, R0 exact at C = 0."""
    from studies.compute_fit import sigmoid_curve

    clean = sigmoid_curve(STEPS, **TRUE, R0=R0)
    out = {}
    for s in range(n_seeds):
        shift = rng.normal(0, 0.03) if noise == "seed" else 0.0
        sd = 0.02 if noise == "seed" else 0.04
        out[s] = {float(c): (R0 if c == 0 else float(r + shift + rng.normal(0, sd))) for c, r in zip(STEPS, clean)}
    return out


def bounds(name: str, R0: float, C_max: float) -> tuple[float, float]:
    """The fit's range of parameter `name`."""
    return {"A": (R0, 1.0), "B": (0.0, B_MAX), "C_mid": (0.0, C_MID_MAX * C_max)}[name]


def bca(estimate: float, values: np.ndarray, jack: np.ndarray, level: float) -> tuple[float, float]:
    """Efron's BCa interval from the bootstrap values and the leave-one-out estimates `jack`."""
    from scipy.stats import norm

    share = np.clip(np.mean(values < estimate) + 0.5 * np.mean(values == estimate), 1e-6, 1 - 1e-6)
    z0 = norm.ppf(share)
    d = jack.mean() - jack
    den = 6 * (d ** 2).sum() ** 1.5
    a = (d ** 3).sum() / den if den > 0 else 0.0
    out = []
    for zq in (norm.ppf((1 - level) / 2), norm.ppf((1 + level) / 2)):
        out.append(float(np.quantile(values, norm.cdf(z0 + (z0 + zq) / (1 - a * (z0 + zq))))))
    return out[0], out[1]


def intervals(estimate: float, values: np.ndarray, jack: np.ndarray, n: int, level: float = 0.95) -> dict:
    """Each method's (lo, hi) for one parameter."""
    from scipy.stats import norm, t

    q = math.sqrt(n / (n - 1)) * t.ppf((1 + level) / 2, n - 1)
    lo, hi = percentile_interval(list(values), level)
    tail = norm.cdf(-q)
    return {"percentile": (lo, hi), "bca": bca(estimate, values, jack, level),
            "expanded": tuple(float(v) for v in np.quantile(values, [tail, 1 - tail])),
            "t_scaled": symmetric_t_interval(estimate, list(values), n, level),
            "scaled_percentile": t_scaled_interval(estimate, list(values), n, level)}


def one_rep(n: int, noise: str, boot: int, rng: np.random.Generator) -> dict[str, dict[str, bool]] | None:
    """Whether each method's interval of each parameter holds the truth, for one synthetic arm (None: the
    arm's own fit failed)."""
    curves = synthetic_arm(n, noise, rng)
    try:
        fit = fit_curve(*pooled(list(curves.values())), R0)
        jack = {p: [] for p in PARAMS}
        for left in curves:
            f = fit_curve(*pooled([c for s, c in curves.items() if s != left]), R0)
            for p in PARAMS:
                jack[p].append(getattr(f, p))
    except ValueError:
        return None
    fits, _ = resample_fits(curves, R0, boot, int(rng.integers(2**31)))
    out = {}
    for p in PARAMS:
        values = np.array([getattr(f, p) for f in fits])
        lo_b, hi_b = bounds(p, R0, fit.C_max)
        out[p] = {m: max(lo, lo_b) <= TRUE[p] <= min(hi, hi_b)
                  for m, (lo, hi) in intervals(getattr(fit, p), values, np.array(jack[p]), n).items()}
    return out


def coverage(n: int, noise: str, reps: int, boot: int, seed: int) -> dict:
    """Each method's share of `reps` synthetic arms whose interval holds the true value, per parameter."""
    rng = np.random.default_rng(seed)
    hits = {m: {p: 0 for p in PARAMS} for m in METHODS}
    done = 0
    for _ in range(reps):
        rep = one_rep(n, noise, boot, rng)
        if rep is None:
            continue
        done += 1
        for p in PARAMS:
            for m in METHODS:
                hits[m][p] += rep[p][m]
    return {"noise": noise, "seeds": n, "reps": done, "boot": boot,
            "coverage": {m: {p: hits[m][p] / done for p in PARAMS} for m in METHODS}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 6, 8])
    p.add_argument("--noise", nargs="+", default=["iid", "seed"], choices=["iid", "seed"])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--boot", type=int, default=400)
    p.add_argument("--rng", type=int, default=0)
    a = p.parse_args(argv)
    rows = []
    for noise in a.noise:
        for n in a.seeds:
            r = coverage(n, noise, a.reps, a.boot, a.rng)
            print(json.dumps(r), flush=True)
            rows.append(r)
    print("\n| noise | seeds | arms | method | A | B | C_mid |\n|---|---|---|---|---|---|---|")
    for r in rows:
        for m in METHODS:
            c = r["coverage"][m]
            cells = " | ".join(f"{c[q]:.2f}" for q in PARAMS)
            print(f"| {r['noise']} | {r['seeds']} | {r['reps']} | {m} | {cells} |")


if __name__ == "__main__":
    main()
