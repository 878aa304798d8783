"""`cispo plot RUN_DIR...` (cispo.plotting.plot_runs) and the [0, 1] clamp of fraction bands."""

from __future__ import annotations

import base64
import json

import matplotlib.axes
import pytest

from cispo.cli import main
from cispo.plotting import band_limits, find_runs, is_fraction


def _write_run(folder, rewards, accuracy, bad_line=None):
    folder.mkdir(parents=True)
    rows = [{"step": s, "rollout/reward_mean": r, "eval/accuracy": a, "objective/frac_capped": 0.01 * s}
            for s, (r, a) in enumerate(zip(rewards, accuracy))]
    lines = [json.dumps(r) for r in rows]
    if bad_line is not None:
        lines.insert(1, bad_line)
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_fraction_metrics_and_band_clamp():
    assert is_fraction("eval/accuracy") and is_fraction("objective/frac_ppo_dropped") and is_fraction("eval/accuracy_mean_at_4")
    assert is_fraction("rollout/fork_rate") and is_fraction("rollout/truncated")
    assert not is_fraction("rollout/reward_mean") and not is_fraction("objective/ratio_max")
    assert band_limits("eval/accuracy", [-0.2, 0.5], [0.9, 1.3]) == ([0.0, 0.5], [0.9, 1.0])
    assert band_limits("rollout/reward_mean", [-0.2], [1.3]) == ([-0.2], [1.3])  # rewards keep their range


def test_comparison_bands_stay_in_unit_interval(tmp_path, monkeypatch):
    """Three seeds at accuracy 0.95 ± 0.08: the raw 95% band passes 1; the drawn one must not."""
    from cispo.experiments.compare import plot_comparison

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


def test_cispo_plot_overlays_runs_into_png_and_self_contained_html(tmp_path, capsys):
    a = _write_run(tmp_path / "runs" / "cispo__addition__seed0", [0.1, 0.4, 0.7], [0.2, 0.5, 0.81])
    _write_run(tmp_path / "runs" / "grpo__addition__seed0", [0.1, 0.2, 0.3], [0.2, 0.3, 0.42])
    out = tmp_path / "report" / "ab.html"
    assert main(["plot", str(a), str(tmp_path / "runs"), "-o", str(out)]) == 0  # a folder of runs too
    png, page = out.with_suffix(".png"), out.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}" in page
    assert "<script" not in page and "http" not in page.replace("http-equiv", "")  # nothing to fetch
    # the table: one row per run (a appears once: de-duplicated), the final values with their steps
    assert page.count("<tr><td>cispo__addition__seed0</td>") == 1 and "<tr><td>grpo__addition__seed0</td>" in page
    assert "0.81 <small>(step 2)</small>" in page and "0.42 <small>(step 2)</small>" in page
    assert str(png) in capsys.readouterr().out


def test_cispo_plot_errors_name_the_path_and_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing"), "-o", str(tmp_path / "x.html")]) == 2
    assert "missing: no metrics.jsonl" in capsys.readouterr().err
    bad = _write_run(tmp_path / "bad", [0.1, 0.2], [0.1, 0.2], bad_line='{"step": 1, "rollout/reward_mean": ')
    assert main(["plot", str(bad), "-o", str(tmp_path / "x.html")]) == 2
    assert f"{bad / 'metrics.jsonl'}, line 2: not a JSON object" in capsys.readouterr().err
    run = _write_run(tmp_path / "ok", [0.1], [0.1])
    assert main(["plot", str(run), "--metrics", "no/such_metric", "-o", str(tmp_path / "x.html")]) == 2
    assert "none of the metrics no/such_metric" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", str(run), "--bogus"])


def test_find_runs_keeps_order_and_drops_duplicates(tmp_path):
    a = _write_run(tmp_path / "a", [0.0], [0.0])
    b = _write_run(tmp_path / "b", [0.0], [0.0])
    assert find_runs([b, a, tmp_path]) == [b, a]
