"""The comparison's figure and the data collection's run discovery, on hand-made run folders."""

from __future__ import annotations

import json

import matplotlib.axes

from cispo.foundations.jsonl import compress
from studies.study_data import find_run_dirs


def _write_run(folder, accuracy):
    folder.mkdir(parents=True)
    rows = [{"step": s, "eval/accuracy": a} for s, a in enumerate(accuracy)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_comparison_bands_stay_in_unit_interval(tmp_path, monkeypatch):
    """Three seeds at accuracy 0.95 ± 0.08: the raw 95% band passes 1; the drawn one must not."""
    from studies.compare import plot_comparison

    calls = []
    original = matplotlib.axes.Axes.fill_between

    def spy(ax, x, y1, y2=0, **kw):
        calls.append((ax, list(y1), list(y2)))
        return original(ax, x, y1, y2, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between", spy)
    seeds = [[{"step": s, "eval/accuracy": a, "objective/entropy": 2 * a} for s in range(3)] for a in (0.87, 0.95, 1.0)]
    plot_comparison({"cispo": seeds}, tmp_path / "c.png", "t")
    drawn = {}  # panel title -> bands (titles are set after the bands are drawn)
    for ax, y1, y2 in calls:
        drawn.setdefault(ax.get_title(), []).append((y1, y2))
    [(acc_low, acc_high)] = drawn["held-out accuracy (mean@k)"]
    assert max(acc_high) == 1.0 and min(acc_low) >= 0.0
    [(_, entropy_high)] = drawn["policy entropy"]
    assert max(entropy_high) > 2.0  # not a fraction: not clamped


def test_data_finds_run_folders_that_hold_only_metrics_jsonl_gz(tmp_path):
    """Committed runs keep ``metrics.jsonl.gz`` only: `find_run_dirs` takes them, in order."""
    a = _write_run(tmp_path / "runs" / "a", [0.1, 0.4])
    b = _write_run(tmp_path / "runs" / "b", [0.1, 0.2])
    compress(a / "metrics.jsonl")
    assert sorted(p.name for p in a.iterdir()) == ["metrics.jsonl.gz"]
    assert find_run_dirs([tmp_path]) == [a, b]
