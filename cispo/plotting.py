"""Curves of one run (``curves.png``), from its ``metrics.jsonl`` rows."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [  # (title, [(metric, label), ...])
    ("held-out accuracy", [("eval/accuracy", "mean@k"), ("eval/accuracy_greedy", "greedy")]),
    ("training reward", [("rollout/reward_mean", "reward"), ("rollout/accuracy", "accuracy")]),
    ("fork-token rate", [("rollout/fork_rate", "train samples"), ("eval/fork_rate", "held-out samples")]),
    ("gradient lost / capped", [("objective/frac_ppo_dropped", "PPO would drop"),
                                ("objective/frac_ppo_dropped_fork", "PPO would drop (fork tokens)"),
                                ("objective/frac_capped", "IS weight capped")]),
    ("policy entropy", [("objective/entropy", "entropy")]),
    ("response length", [("rollout/response_length", "mean tokens")]),
]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(rows: list[dict], path: Path, title: str = "") -> Path:
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (name, keys) in zip(axes.flat, PANELS):
        for key, label in keys:
            x, y = series(rows, key)
            if x:
                ax.plot(x, y, marker="o" if len(x) < 15 else None, ms=3, label=label)
        style_axis(ax, name)
    return save_figure(fig, path, title)


def style_axis(ax, title: str) -> None:
    """A panel's title, step axis, grid and legend (when it has labelled lines)."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def save_figure(fig, path: Path, title: str = "") -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
