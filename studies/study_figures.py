"""The study's figures, from the runs of the raw-data CSV (``studies.study_report``)."""

from __future__ import annotations

import math
from pathlib import Path

from studies.stats import mean_accuracy, mean_band, paired_t


def plot_curves(groups, part: str, path: Path) -> Path | None:
    """Held-out accuracy vs step, mean ± 95% t-band over seeds, one panel per (task, K)."""
    keys = sorted(k for k in groups if k[0] == part)
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cispo.foundations.plotting import fill_band, save_figure, style_axis

    cols, rows = min(3, len(keys)), math.ceil(len(keys) / 3)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for arm, runs in groups[key].items():
            curves = [r.curve() for r in runs.values()]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            bands = [mean_band([c[s] for c in curves]) for s in steps]
            ax.plot(steps, [b[0] for b in bands], label=arm)
            fill_band(ax, steps, [b[0] - b[2] for b in bands], [b[0] + b[2] for b in bands], "eval/accuracy", alpha=0.2)
        style_axis(ax, f"{key[1]}, K = {key[2]}: held-out accuracy")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    return save_figure(fig, path, f"{part}: mean ± 95% band over seeds")


def plot_gaps(groups, part: str, contrast: str, path: Path) -> Path | None:
    """contrast − each arm, mean held-out accuracy over training, paired by seed, vs K (95%
    t-intervals); only for a part with more than one K."""
    keys = sorted(k for k in groups if k[0] == part and contrast in groups[k])
    if len({k[2] for k in keys}) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cispo.foundations.plotting import save_figure, style_gap_vs_k

    lines: dict[tuple[str, str], list] = {}
    for _, task, k in keys:
        arms = groups[(part, task, k)]
        for base in (a for a in arms if a != contrast):
            seeds = sorted(set(arms[contrast]) & set(arms[base]))
            if len(seeds) >= 2:
                t = paired_t([mean_accuracy(arms[contrast][s].curve()) - mean_accuracy(arms[base][s].curve())
                              for s in seeds])
                lines.setdefault((task, base), []).append((k, t))
    fig, ax = plt.subplots(figsize=(6, 4))
    for (task, base), pts in sorted(lines.items()):
        ax.errorbar([k for k, _ in pts], [t.mean for _, t in pts], yerr=[t.half for _, t in pts], marker="o", capsize=3,
                    label=f"{task}: {contrast} − {base}")
    style_gap_vs_k(ax, f"{part}: mean held-out accuracy over training, paired gap (95% CI)")
    return save_figure(fig, path)
