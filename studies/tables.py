"""The tables and plots of a comparison and a K sweep, from the runs' metrics rows
(``arm -> [rows of each seed]``): mean ± band per arm, steps-to-target, collapses, the
contrast arm's paired gaps per K. ``studies.compare`` runs the runs; the study's
regeneration from the raw-data file is ``studies.study_report``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cispo.foundations.nan import nan_mean
from studies.stats import (
    COLLAPSE_FLOOR,
    censored_steps,
    collapsed,
    final_accuracy,
    mean_accuracy,
    mean_band,
    steps_to_target,
    wilson,
)


def curve(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if r.get(key) is not None}


def analyse(runs: dict[str, list[list[dict]]], reference: str, final_evals: int = 1) -> dict[str, Any]:
    """The comparison table: final accuracy (mean of the last `final_evals` evaluations),
    steps-to-target, collapses, mechanism metrics."""
    acc = {a: [curve(rows, "eval/accuracy") for rows in rs] for a, rs in runs.items()}
    final = {a: [final_accuracy(c, final_evals) for c in cs] for a, cs in acc.items()}
    target = mean_band(final[reference])[0] if reference in final else None
    table = {"target": target, "reference": reference, "final_evals": final_evals, "arms": {}}
    for algo, rs in runs.items():
        reached = [steps_to_target(c, target) for c in acc[algo]] if target is not None else []
        reached90 = [steps_to_target(c, 0.9 * target) for c in acc[algo]] if target is not None else []
        hit = [s for s in reached if s is not None]
        flags = [collapsed(c) for c in acc[algo]]
        learned = [f for f in flags if f is not None]
        mean_of = lambda key, rs=rs: mean_band([nan_mean(curve(rows, key).values()) for rows in rs])  # noqa: E731
        table["arms"][algo] = {
            "seeds": len(rs),
            "final_accuracy": mean_band(final[algo]),
            "initial_accuracy": mean_band([c[0] for c in acc[algo]]),
            "steps_to_target": mean_band(hit) if hit else None,
            "reached_target": f"{len(hit)}/{len(rs)}",
            # the target itself sits at the plateau, where one evaluation's noise decides
            # whether a run "reaches" it; 90% of it measures the climb
            "steps_to_90": mean_band(hit90) if (hit90 := [s for s in reached90 if s is not None]) else None,
            "reached_90": f"{len(hit90)}/{len(rs)}",
            "mean_accuracy": mean_band([mean_accuracy(c) for c in acc[algo]]),
            "collapsed": f"{sum(learned)}/{len(learned)}",
            "collapse_interval": wilson(sum(learned), len(learned)),
            "final_fork_rate": mean_band([_last(curve(rows, "eval/fork_rate")) for rows in rs]),
            "frac_ppo_dropped_fork": mean_of("objective/frac_ppo_dropped_fork"),
            "frac_capped": mean_of("objective/frac_capped"),
            "entropy": mean_of("objective/entropy"),
        }
    return table


def _last(c: dict[int, float]) -> float:
    return c[max(c)] if c else float("nan")


def _fmt_lr(lr) -> str:
    return "n/a" if lr is None else f"{lr:g}"


def format_table(table: dict) -> str:
    """Markdown."""
    fmt = lambda mb, p=3: "n/a" if mb is None else f"{mb[0]:.{p}f} ± {mb[1]:.{p}f}"  # noqa: E731
    lines = [
        f"Target: {table['reference']}'s final held-out accuracy = "
        + ("n/a" if table["target"] is None else f"{table['target']:.3f}"),
        "",
        "| arm | lr | seeds | held-out acc. start | final | mean over training | steps to target | reached "
        "| steps to 90% of target | reached | collapsed [95% CI] | final fork rate | PPO-dropped fork tokens "
        "| IS weight capped | entropy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for algo, row in table["arms"].items():
        lo, hi = row["collapse_interval"]
        lines.append(
            f"| {algo} | {_fmt_lr(table.get('learning_rates', {}).get(algo))} | {row['seeds']} "
            f"| {fmt(row['initial_accuracy'])} | {fmt(row['final_accuracy'])} "
            f"| {fmt(row.get('mean_accuracy'))} | {fmt(row['steps_to_target'], 1)} | {row['reached_target']} "
            f"| {fmt(row.get('steps_to_90'), 1)} | {row.get('reached_90', 'n/a')} "
            f"| {row['collapsed']} [{lo:.2f}, {hi:.2f}] "
            f"| {fmt(row['final_fork_rate'])} "
            f"| {fmt(row['frac_ppo_dropped_fork'])} | {fmt(row['frac_capped'])} | {fmt(row['entropy'])} |"
        )
    lines.append("")
    last = table.get("final_evals", 1)
    lines.append((f"final: mean of the last {last} evaluations; " if last > 1 else "")
                 + "mean ± std over seeds; steps averaged over the seeds that reached the level; mean over training: "
                 "held-out accuracy averaged over the evaluations after step 0 (area under the curve); collapsed: "
                 f"runs whose accuracy fell below half its peak and stayed there (`stats.collapsed`), of those whose "
                 f"peak reached {COLLAPSE_FLOOR}, with a Wilson interval.")
    return "\n".join(lines)


PLOTS = [
    ("eval/accuracy", "held-out accuracy (mean@k)"),
    ("rollout/fork_rate", "fork-token rate (training samples)"),
    ("objective/frac_ppo_dropped_fork", "fork tokens a PPO mask drops"),
    ("objective/frac_capped", "IS weights capped"),
    ("objective/entropy", "policy entropy"),
    ("rollout/accuracy", "training accuracy"),
]


def plot_comparison(runs: dict[str, list[list[dict]]], path: Path, title: str) -> Path:
    """Mean ± 95% band over seeds (clamped to [0, 1] for fractions), one curve per arm,
    one panel per metric."""
    import matplotlib.pyplot as plt

    from cispo.foundations.plotting import fill_band, save_figure, style_axis

    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (key, name) in zip(axes.flat, PLOTS):
        for algo, rs in runs.items():
            curves = [curve(rows, key) for rows in rs]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            stats = [mean_band([c[s] for c in curves]) for s in steps]
            m = [s[0] for s in stats]
            ax.plot(steps, m, label=algo)
            fill_band(ax, steps, [a - s[2] for a, s in zip(m, stats)], [a + s[2] for a, s in zip(m, stats)], key,
                      alpha=0.2)
        style_axis(ax, name)
    return save_figure(fig, path, title)


def sweep_gaps(per_k: dict[int, dict[str, list[list[dict]]]], reference: str, contrast: str = "cispo",
               final_evals: int = 1) -> dict:
    """Per K and baseline: contrast − baseline in final accuracy (paired by seed), mean
    accuracy over training and steps-to-target (target: the reference's final accuracy at that
    K; a run that never reaches it counts as its last step + one evaluation interval, a
    censored value: `stats.censored_steps`)."""
    out = {}
    for k, runs in per_k.items():
        target = analyse(runs, reference, final_evals)["target"]
        row = {"target": target, "contrast": contrast}
        for base in [a for a in runs if a != contrast]:
            if contrast not in runs:
                continue
            pairs = [(curve(c, "eval/accuracy"), curve(b, "eval/accuracy")) for c, b in zip(runs[contrast], runs[base])]
            acc_gap = [final_accuracy(c, final_evals) - final_accuracy(b, final_evals) for c, b in pairs]
            auc_gap = [mean_accuracy(c) - mean_accuracy(b) for c, b in pairs]
            row[base] = {"final_accuracy_gap": mean_band(acc_gap), "mean_accuracy_gap": mean_band(auc_gap)}
            if target is not None:
                stt_gap = [censored_steps(c, target)[0] - censored_steps(b, target)[0] for c, b in pairs]
                row[base]["steps_to_target_gap"] = mean_band(stt_gap)
        out[k] = row
    return out


def _bases(gaps: dict) -> list[str]:
    return sorted({b for row in gaps.values() for b in row if b not in ("target", "contrast")})


def format_sweep(gaps: dict) -> str:
    bases = _bases(gaps)
    c = next((row.get("contrast", "cispo") for row in gaps.values()), "cispo").upper()
    head = "| K | " + " | ".join(f"{c} − {b.upper()} final acc. | {c} − {b.upper()} mean acc. over training "
                                 f"| {c} − {b.upper()} steps to target" for b in bases)
    lines = [head + " |", "|---|" + "---|---|---|" * len(bases)]
    for k, row in sorted(gaps.items()):
        cells = []
        for b in bases:
            g = row.get(b)
            if g is None:
                cells += ["n/a", "n/a", "n/a"]
                continue
            a, m, s = g["final_accuracy_gap"], g.get("mean_accuracy_gap"), g.get("steps_to_target_gap")
            cells += [f"{a[0]:+.3f} ± {a[2]:.3f}", "n/a" if m is None else f"{m[0]:+.3f} ± {m[2]:.3f}",
                      "n/a" if s is None else f"{s[0]:+.1f} ± {s[2]:.1f}"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"mean ± 95% half-width over seeds (paired by seed), not corrected for multiple comparisons "
                 f"(`python -m studies report` applies Holm); negative steps = {c} reaches the target sooner.")
    return "\n".join(lines)


def plot_sweep(gaps: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cispo.foundations.plotting import save_figure, style_gap_vs_k

    ks = sorted(gaps)
    bases = _bases(gaps)
    c = next((row.get("contrast", "cispo") for row in gaps.values()), "cispo").upper()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for b in bases:
        for ax, key in zip(axes, ("final_accuracy_gap", "mean_accuracy_gap", "steps_to_target_gap")):
            pts = [(k, gaps[k][b][key]) for k in ks if b in gaps[k] and key in gaps[k][b]]
            if not pts:
                continue
            x = [p[0] for p in pts]
            m = [p[1][0] for p in pts]
            h = [p[1][2] for p in pts]
            ax.errorbar(x, m, yerr=h, marker="o", capsize=3, label=f"{c} − {b.upper()}")
    for ax, name in zip(axes, ("final held-out accuracy gap", "mean held-out accuracy over training, gap",
                               "steps-to-target gap")):
        style_gap_vs_k(ax, name)
    return save_figure(fig, path)

