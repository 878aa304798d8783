"""Curves of several `chain` runs (one line per run): held-out accuracy, reflective tokens
per response and response length by step, from each run folder's ``metrics.jsonl`` (or
``metrics.jsonl.gz``, as committed under studies/results/).
Runs named ``<setting>_s<seed>`` (e.g. ``chain_cispo_s0``) share a colour per setting,
one line style per seed.

    python -m studies.scripts.plot_chain studies/results/chain_curves.png runs/chain_cispo_s0 runs/chain_cispo_s1 ...
"""

from __future__ import annotations

import sys
from pathlib import Path

from cispo.foundations.plotting import read_rows, save_figure, series, style_axis

PANELS = [("held-out accuracy (greedy)", "eval/accuracy_greedy"),
          ("held-out accuracy (mean@4, T=1)", "eval/accuracy"),
          ("reflective tokens (W) per response, train samples", "rollout/fork_tokens_per_response"),
          ("response length (tokens), train samples", "rollout/response_length")]


def main(out: str, *run_dirs: str) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
    colors, seen = {}, {}
    for run in run_dirs:
        name = Path(run).name
        group = name.rsplit("_s", 1)[0]            # runs of one setting (e.g. chain_cispo) share a colour
        color = colors.setdefault(group, f"C{len(colors)}")
        style = ("-", "--", ":", "-.")[seen.setdefault(group, -1) + 1 & 3]
        seen[group] += 1
        rows = read_rows(Path(run) / "metrics.jsonl")
        for ax, (_, key) in zip(axes, PANELS):
            x, y = series(rows, key)
            ax.plot(x, y, style, color=color, marker="o" if len(x) < 15 else None, ms=3, label=name)
    for ax, (title, _) in zip(axes, PANELS):
        style_axis(ax, title)
    save_figure(fig, Path(out), "chain task: one line per run (objective, seed), 16 prompts x 8 samples per step")


if __name__ == "__main__":
    main(*sys.argv[1:])
