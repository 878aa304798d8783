"""Tables of the study report kept apart from ``studies.study_report`` (which calls
them): pure functions of per-run values already computed there, so this module imports only
the statistics and the mechanism gate, never the report.

* **Steps to target, per seed and paired** (protocol amendment of 2026-12-03, 07:39 UTC, for
  part ``v3_chain``: "steps-to-target differences are reported with their unadjusted intervals,
  outside the family"). Per run T_s = steps to the reference arm's final accuracy, censored at
  the last step + one evaluation interval (`stats.censored_steps`). For a pair (A, B), over the
  seeds both ran: d_s = T_A,s − T_B,s, mean d ± the two-sided 95% t half-width, t_{n−1}
  (`stats.paired_t`), **no** Holm adjustment and **no** p-value (the protocol asks for the
  interval; the Holm family covers final and mean accuracy only). The censored runs of each
  side are counted beside, and the seeds on which both sides are censored (d_s = 0 by
  construction, not a measured tie).
* **The mechanism check's level per arm** (same amendment: "each run's level on the mechanism
  check ... gives the gate's two figures ..., averaged per arm"): per run, `mechanism_gate.gate`'s
  figures (steps of 11–40 with the paper's case; the mean positive-fork and other-token mass
  shares above 1 + eps_high over steps 1–40), then mean ± 95% t half-width over the arm's
  runs. Descriptive: no verdict, no test.
* **The compute–performance fit** (``--compute-fit``; ScaleRL, arXiv 2510.13786, eq. 1), per arm:
  R0, A, B and C_mid of `compute_fit.fit_arm` with their t-scaled bootstrap intervals over seeds.
  Descriptive: no test.
"""

from __future__ import annotations

import math

from studies.compute_fit import B_MAX, C_MID_MAX, MIN_SEEDS, ArmFit
from studies.stats import mean_band, paired_t, wilson

Steps = dict[int, tuple[float, bool]]
"""seed -> (steps to target, reached) of one arm (`stats.censored_steps`)."""


def pm(values: list[float], p: int = 3) -> str:
    """``mean ± 95% t half-width`` of the non-NaN values, ``n/a`` with none."""
    values = [v for v in values if v == v]
    if not values:
        return "n/a"
    mb = mean_band(values)
    return f"{mb[0]:.{p}f} ± {mb[2]:.{p}f}"


def ci(lo: float, hi: float, p: int = 3) -> str:
    """An interval as ``[lo, hi]`` with signs (``inf`` spelled out)."""
    f = lambda v: "inf" if v == math.inf else "-inf" if v == -math.inf else f"{v:+.{p}f}"  # noqa: E731
    return f"[{f(lo)}, {f(hi)}]"


# --------------------------------------------------------------------------------------
# Steps to target
# --------------------------------------------------------------------------------------


def paired_steps(a: Steps, b: Steps) -> dict | None:
    """d_s = T_a,s − T_b,s over the seeds both ran, summarised by `stats.paired_t` (95%), with
    the censored counts of each side and of both; None with fewer than 2 shared seeds."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    return {"seeds": seeds, "t": paired_t([a[s][0] - b[s][0] for s in seeds]),
            "censored_a": sum(not a[s][1] for s in seeds), "censored_b": sum(not b[s][1] for s in seeds),
            "censored_both": sum(not a[s][1] and not b[s][1] for s in seeds)}


def steps_per_seed_table(cells: list[tuple[str, int, float, dict[str, Steps]]], reference: str,
                         final_evals: int) -> str:
    """One row per (task, K, arm) of `cells` = [(task, K, target, arm -> Steps)]: T per seed,
    ``*`` where censored, ``–`` where the arm has no run of that seed."""
    seeds = sorted({s for *_, arms in cells for steps in arms.values() for s in steps})
    lines = ["| task | K | target | arm | " + " | ".join(f"seed {s}" for s in seeds) + " | reached |",
             "|---|---|---|---|" + "---|" * (len(seeds) + 1)]
    for task, k, target, arms in cells:
        for arm, steps in arms.items():
            cell = lambda s, steps=steps: (  # noqa: E731
                "–" if s not in steps else f"{steps[s][0]:g}" + ("" if steps[s][1] else "*"))
            lines.append(f"| {task} | {k} | {target:.3f} | {arm} | " + " | ".join(cell(s) for s in seeds)
                         + f" | {sum(r for _, r in steps.values())}/{len(steps)} |")
    lines += ["", f"Steps to target per run: the first evaluated step at which held-out accuracy is ≥ the target, "
              f"{reference}'s final held-out accuracy (mean over its seeds of the mean of its last {final_evals} "
              "evaluations) at that task and K. `*`: never reached, censored at the last step + one evaluation "
              "interval."]
    return "\n".join(lines)


def paired_steps_table(rows: list[dict]) -> str:
    """`rows`: dicts with task, K, a, b and the output of `paired_steps`."""
    lines = ["| task | K | difference | seeds | mean steps | 95% CI | censored (first / second / both) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["t"]
        lines.append(f"| {r['task']} | {r['K']} | {r['a']} − {r['b']} | {t.n} | {t.mean:+.1f} | {ci(t.lo, t.hi, 1)} "
                     f"| {r['censored_a']} / {r['censored_b']} / {r['censored_both']} |")
    lines += ["", "Steps to target paired by seed, d = T_first − T_second (negative: the first arm reaches the target "
              "sooner); mean with its two-sided 95% t-interval, **unadjusted and outside the Holm family** (the family "
              "covers final and mean accuracy), no test. A censored run counts its censoring step, so a censored side "
              "makes d a bound, not a measurement; on a seed where both are censored d = 0 by construction."]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# The mechanism check's level per arm
# --------------------------------------------------------------------------------------


LEVELS = (("late_steps_with_paper_case", 1), ("fork_pos_mass_above_mean", 3), ("other_pos_mass_above_mean", 3))
"""The gate's figures averaged per arm (`mechanism_gate.gate` keys), with their decimals."""


def has_mechanism_log(rows: list[dict]) -> bool:
    """Did the run log the mechanism check (``objective/fork_pos_lowp_above``) at some step?"""
    return any("objective/fork_pos_lowp_above" in r for r in rows)


def mechanism_level_table(cells: list[tuple[str, int, dict[str, list[dict]]]]) -> str:
    """`cells` = [(task, K, arm -> [`mechanism_gate.gate` of each run])]: per arm, each figure's
    mean ± 95% t half-width over its runs (a mass share over the runs that had a positive fork
    token in steps 1–40; their number beside)."""
    lines = ["| task | K | arm | runs | steps 11–40 with the paper's case | positive-W mass share above the bound "
             "| other tokens' share | runs with a positive W |", "|---|---|---|---|---|---|---|---|"]
    for task, k, arms in cells:
        for arm, gates in arms.items():
            with_w = sum(g["fork_pos_mass_above_mean"] == g["fork_pos_mass_above_mean"] for g in gates)
            lines.append(f"| {task} | {k} | {arm} | {len(gates)} | "
                         + " | ".join(pm([g[key] for g in gates], p) for key, p in LEVELS) + f" | {with_w} |")
    lines += ["", "Per run, the figures of `python -m studies.mechanism_gate` (criteria (i) and (ii) of the "
              "v3 gate, over the run's steps 1–40): the steps of 11–40 in which a positive-advantage fork token "
              "with p_old < 0.1 had r > 1 + eps_high, and the mean over steps 1–40 (steps without a positive fork "
              "token left out) of the positive fork tokens' and the other positive tokens' gradient-mass share above "
              "the bound. Then mean ± 95% t half-width over the arm's runs. Descriptive only: the level, not the "
              "gate's verdict."]
    return "\n".join(lines)


def comparison_values(rows: list[dict], part: str) -> dict[str, str]:
    """Each comparison as a quotable value, ``diff/PART/TASK/K16/MEASURE/A-B`` -> "+0.117
    [-0.102, +0.336], Holm p 1" (the table's row: mean, unadjusted 95% CI, Holm-adjusted p)."""
    out = {}
    for r in rows:
        t, p = r["t"], (1 if r["measure"].startswith("steps") else 3)
        out[f"diff/{part}/{r['task']}/K{r['K']}/{r['measure']}/{r['a']}-{r['b']}"] = \
            f"{t.mean:+.{p}f} {ci(t.lo, t.hi, p)}, Holm p {r['holm_p']:.2g}"
    return out


def tally(flags: list[bool | None]) -> tuple[int, int, int, int]:
    """(never learned, runs, collapsed, runs that learned) of an arm's per-run collapse flags
    (`stats.collapsed`: None = never learned)."""
    learned = [f for f in flags if f is not None]
    return len(flags) - len(learned), len(flags), sum(learned), len(learned)


def count_values(part: str, cells: list[tuple[str, int, str, list[bool | None]]]) -> dict[str, str]:
    """Per arm, the never-learned and collapsed counts as quotable values with their Wilson 95%
    intervals: ``never/PART/TASK/K16/ARM`` -> "0 of 8 [0.00, 0.32]" (out of all its runs),
    ``collapsed/...`` likewise out of the runs that learned. `cells`: (task, K, arm, per run
    collapsed, or None when it never learned)."""
    out = {}
    for task, k, arm, flags in cells:
        never, n, hit, learned = tally(flags)
        for name, count, of in (("never", never, n), ("collapsed", hit, learned)):
            lo, hi = wilson(count, of)
            out[f"{name}/{part}/{task}/K{k}/{arm}"] = f"{count} of {of} [{lo:.2f}, {hi:.2f}]"
    return out


def drop_steps(curve: dict[int, float], floor: float) -> list[int]:
    """The evaluated steps at which held-out accuracy is below half the run's peak so far, once
    that peak has reached `floor`: a run that falls and may recover (the protocol's collapse needs
    it to stay below half its overall peak to the end). Post hoc: chosen after seeing part
    v3_chain's curves, descriptive only."""
    out, peak = [], 0.0
    for step in sorted(curve):
        if peak >= floor and curve[step] < peak / 2:
            out.append(step)
        peak = max(peak, curve[step])
    return out


def drop_table(cells: list[tuple[str, int, str, dict[int, dict[int, float]]]], floor: float) -> str:
    """Per arm, the runs with at least one drop (`drop_steps`) with the Wilson 95% interval, and
    for each such run its seed, peak, lowest evaluation at a drop (step), last evaluation and
    drop steps. `cells`: (task, K, arm, seed -> held-out curve)."""
    lines = ["| task | K | arm | runs | runs with a drop | Wilson 95% CI | seed: peak, lowest at a drop (step), last; "
             "steps below half the peak so far |", "|---|---|---|---|---|---|---|"]
    for task, k, arm, curves in cells:
        hit = {s: d for s, c in sorted(curves.items()) if (d := drop_steps(c, floor))}
        lo, hi = wilson(len(hit), len(curves))
        where = []
        for s, d in hit.items():
            c = curves[s]
            low = min(d, key=lambda x: (c[x], x))
            where.append(f"{s}: {max(c.values()):.3f}, {c[low]:.3f} ({low}), {c[max(c)]:.3f}; {', '.join(map(str, d))}")
        lines.append(f"| {task} | {k} | {arm} | {len(curves)} | {len(hit)} | [{lo:.2f}, {hi:.2f}] | "
                     f"{' · '.join(where) or 'none'} |")
    lines += ["", "**Post hoc** (chosen after seeing this part's curves; not in the protocol, no decision rests on "
              "it): a drop is an evaluation below half the run's peak held-out accuracy so far, once that peak is "
              f">= {floor:g}; unlike the protocol's collapse, the run may recover. Wilson 95% intervals out of the "
              "arm's runs."]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# The compute–performance fit (ScaleRL eq. 1)
# --------------------------------------------------------------------------------------


AXIS_WORDS = {"steps": ("RL steps", 1), "step_seconds": ("cumulative seconds of the training steps (`perf/step_s`, "
                                                          "evaluation left out)", 0)}
"""`compute_fit.AXES` -> (what C is, C_mid's decimals)."""


def _at_bound(v: float, lo: float, hi: float) -> str:
    """``*`` when `v` sits at `lo` or `hi` (to 1e-6 of the larger bound's size), else nothing."""
    return "*" if min(abs(v - lo), abs(v - hi)) <= 1e-6 * max(1.0, abs(hi)) else ""


def _interval(lo_hi: tuple[float, float], p: int) -> str:
    return f"[{lo_hi[0]:.{p}f}, {lo_hi[1]:.{p}f}]"


def compute_fit_table(cells: list[tuple[str, int, str, ArmFit | str]], axis: str, n_boot: int) -> str:
    """One row per (task, K, arm) of `cells` = [(task, K, arm, `compute_fit.fit_runs`)]: R0, A, B and
    C_mid with their 95% t-scaled bootstrap intervals, rmse, points, seeds (``†``: fewer than
    `compute_fit.MIN_SEEDS`, rough intervals) and failed refits; ``*`` marks an estimate at a bound of the
    fit; an arm that could not be fitted gets the reason."""
    if axis not in AXIS_WORDS:
        raise ValueError(f"unknown compute axis {axis!r}: one of {', '.join(AXIS_WORDS)}")
    words, p = AXIS_WORDS[axis]
    lines = ["| task | K | arm | seeds | R0 | A | 95% CI | B | 95% CI | C_mid | 95% CI | rmse | points "
             "| failed refits |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for task, k, arm, a in cells:
        if isinstance(a, str):
            lines.append(f"| {task} | {k} | {arm} | | | no fit: {a} | | | | | | | | |")
            continue
        f, b = a.fit, a.boot
        lines.append(f"| {task} | {k} | {arm} | {a.seeds}{'†' if a.few_seeds else ''} | {f.R0:.3f} "
                     f"| {f.A:.3f}{_at_bound(f.A, f.R0, 1.0)} "
                     f"| {_interval(b.A, 3)} | {f.B:.2f}{_at_bound(f.B, 0.0, B_MAX)} | {_interval(b.B, 2)} "
                     f"| {f.C_mid:.{p}f}{_at_bound(f.C_mid, 0.0, C_MID_MAX * f.C_max)} | {_interval(b.C_mid, p)} "
                     f"| {f.rmse:.3f} | {f.n_points} | {b.failed}/{b.n_boot} |")
    lines += ["", f"**Descriptive** (no test, no decision rests on it): ScaleRL's compute–performance curve (arXiv "
              "2510.13786, eq. 1), R(C) − R0 = (A − R0) / (1 + (C_mid / C)^B), R the held-out accuracy, "
              f"C the {words}. Per arm, least squares on the pooled points of all its seeds with C > 0; R0 = the mean "
              f"step-0 held-out accuracy of its runs, fixed; A in [R0, 1], B in (0, {B_MAX:g}], C_mid in "
              f"(0, {C_MID_MAX:g} × the largest C]; `*`: the estimate sits at one of these bounds (a limit of the fit, "
              f"not a measurement). rmse over the fitted points. 95% t-scaled bootstrap intervals over the n seeds: "
              "the refits' 2.5th and 97.5th percentiles, each one's distance from the estimate times √(n/(n−1)) · "
              "t_{n−1, 0.975} / z_0.975 "
              f"({n_boot} resamples of the seeds with replacement, generator seed 0, R0 fixed; failed refits left "
              "out), cut to the fit's bounds; on synthetic curves of known parameters they hold the truth 91–97% of "
              "the time from 3 seeds on, where the plain percentile interval of the same refits holds it 72–76% at 3 "
              "seeds and 84–89% at 6 (`python -m studies.scripts.compute_fit_coverage`). "
              f"`†`: fewer than {MIN_SEEDS} seeds, rough intervals (none under 3). A, B and C_mid trade off against "
              "each other (a higher A with a smaller B can fit the same "
              "points), so one parameter's interval is not a comparison of two curves; where two arms' intervals "
              "overlap, the fit does not show them to differ."]
    return "\n".join(lines)
