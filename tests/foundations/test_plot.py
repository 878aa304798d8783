"""`cispo plot RUN_DIR...` (cispo.foundations.plotting.plot_runs) and the [0, 1] clamp of fraction bands."""

from __future__ import annotations

import base64
import json

import pytest

from cispo.cli import main
from cispo.foundations.plotting import band_limits, find_runs, is_fraction


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
    assert is_fraction("eval/accuracy") and is_fraction("objective/frac_ppo_dropped")
    assert is_fraction("eval/accuracy_mean_at_4")
    assert is_fraction("rollout/fork_rate") and is_fraction("rollout/truncated")
    assert not is_fraction("rollout/reward_mean") and not is_fraction("objective/ratio_max")
    assert band_limits("eval/accuracy", [-0.2, 0.5], [0.9, 1.3]) == ([0.0, 0.5], [0.9, 1.0])
    assert band_limits("rollout/reward_mean", [-0.2], [1.3]) == ([-0.2], [1.3])  # rewards keep their range


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
    assert main(["plot", str(bad), "-o", str(tmp_path / "x.html")]) == 0  # the rows --resume keeps: a warning
    assert f"{bad / 'metrics.jsonl'}: left out 1 unreadable line(s) (line 2: JSONDecodeError" in capsys.readouterr().err
    run = _write_run(tmp_path / "ok", [0.1], [0.1])
    assert main(["plot", str(run), "--metrics", "no/such_metric", "-o", str(tmp_path / "x.html")]) == 2
    assert "none of the metrics no/such_metric" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", str(run), "--bogus"])


def test_find_runs_keeps_order_and_drops_duplicates(tmp_path):
    a = _write_run(tmp_path / "a", [0.0], [0.0])
    b = _write_run(tmp_path / "b", [0.0], [0.0])
    assert find_runs([b, a, tmp_path]) == [b, a]


def test_a_run_folder_with_only_metrics_jsonl_gz_is_found_and_plotted(tmp_path, capsys):
    """A run folder may hold only ``metrics.jsonl.gz`` (how committed research data is kept): `cispo plot` and
    `find_runs` (a run folder and a folder of runs) take it."""
    from cispo.foundations.jsonl import compress

    a = _write_run(tmp_path / "runs" / "a", [0.1, 0.4], [0.2, 0.81])
    b = _write_run(tmp_path / "runs" / "b", [0.1, 0.2], [0.2, 0.42])
    compress(a / "metrics.jsonl")
    assert sorted(p.name for p in a.iterdir()) == ["metrics.jsonl.gz"]
    assert find_runs([a]) == [a] and find_runs([tmp_path / "runs"]) == [a, b]
    out = tmp_path / "ab.html"
    assert main(["plot", str(tmp_path / "runs"), "-o", str(out)]) == 0
    page = out.read_text()
    assert "0.81 <small>(step 1)</small>" in page and "0.42 <small>(step 1)</small>" in page
    (a / "metrics.jsonl.gz").write_bytes(b"not gzip")
    assert main(["plot", str(a), "-o", str(out)]) == 2
    assert f"{a / 'metrics.jsonl.gz'}: not a readable gzip file" in capsys.readouterr().err


@pytest.fixture
def figures(monkeypatch):
    """The figures `cispo.foundations.plotting` saves: {panel title: (y limits, plotted y values)} per figure."""
    import cispo.foundations.plotting

    saved = []
    original = cispo.foundations.plotting.save_figure

    def spy(fig, path, title=""):
        saved.append({ax.get_title(): (ax.get_ylim(), [y for line in ax.get_lines() for y in line.get_ydata()])
                      for ax in fig.axes if ax.get_visible()})
        return original(fig, path, title)

    monkeypatch.setattr(cispo.foundations.plotting, "save_figure", spy)
    return saved


def test_accuracy_of_rewards_outside_the_unit_interval_is_drawn_on_its_own_scale(tmp_path, figures):
    """`accuracy` is the mean task reward: with rewards in [-1, 5] a [0, 1] axis would show nothing."""
    wide = _write_run(tmp_path / "wide", [-1.0, 2.0, 4.5], [-0.5, 2.5, 5.0])
    unit = _write_run(tmp_path / "unit", [0.1, 0.2, 0.3], [0.2, 0.4, 0.6])
    assert main(["plot", str(wide), "-o", str(tmp_path / "w.html")]) == 0
    assert main(["plot", str(unit), "-o", str(tmp_path / "u.html")]) == 0
    (low, high), values = figures[0]["eval/accuracy"]
    assert low <= min(values) == -0.5 and high >= max(values) == 5.0
    assert figures[1]["eval/accuracy"][0] == (-0.03, 1.03)  # a true fraction keeps the [0, 1] axis
    assert band_limits("eval/accuracy", [1.5, 2.0], [2.5, 3.0]) == ([1.5, 2.0], [2.5, 3.0])  # no clamp either


def test_every_logged_family_is_a_default_panel(tmp_path, figures):
    """KL (the penalty's once non-zero, and approx_kl), entropy and the capped fraction: drawn by
    `cispo plot` and in a run's curves.png; panels with no data are left out of curves.png."""
    from cispo.foundations.plotting import plot_run, shown_metrics

    rows = [{"step": s, "rollout/reward_mean": 0.1 * s, "objective/entropy": 1.0 - 0.1 * s,
             "objective/frac_capped": 0.01 * s, "objective/approx_kl": 0.001 * s, "objective/kl": 0.0}
            for s in range(1, 4)]
    with_kl = [{**r, "objective/kl": 0.02 * r["step"]} for r in rows]
    keys = shown_metrics({"off": rows})
    assert {"objective/entropy", "objective/frac_capped", "objective/approx_kl"} <= set(keys)
    assert "objective/kl" not in keys  # logged as 0: the penalty is off
    assert "objective/kl" in shown_metrics({"off": rows, "on": with_kl})
    assert shown_metrics({"off": rows}, ["objective/kl"]) == ["objective/kl"]  # asked for: drawn even at 0
    plot_run(with_kl, tmp_path / "curves.png")
    panels = figures[-1]
    assert {"KL", "policy entropy", "gradient lost / capped", "training reward"} == set(panels)
    assert sorted(panels["KL"][1]) == sorted([0.001, 0.002, 0.003, 0.02, 0.04, 0.06])


# --------------------------------------------------------------------------- damaged metrics and outputs: one line,
# never a traceback

def _plot(run, out, capsys):
    """``cispo plot run -o out``: (exit code, stderr lines)."""
    code = main(["plot", str(run), "-o", str(out)])
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("tail", [b'{"step": 3, "rollout/reward_mean": 0.', b"\0" * 300, b'{"step": 3, "x": "\xff'],
                         ids=["torn", "nul", "not-utf8"])
def test_a_crashed_or_running_run_is_plotted_from_the_rows_resume_keeps(tmp_path, capsys, figures, tail):
    """A torn, NUL-filled or non-UTF-8 last line (a kill, a power loss, a run still writing) is left
    out without a word, exactly as ``--resume`` and `read_metrics` leave it out (was: exit 2)."""
    from cispo.foundations.jsonl import parse_step_lines
    from cispo.records.tracking import read_metrics

    run = _write_run(tmp_path / "run", [0.1, 0.4, 0.7], [0.2, 0.5, 0.8])
    path = run / "metrics.jsonl"
    path.write_bytes(path.read_bytes() + tail)
    assert _plot(run, tmp_path / "p.html", capsys) == (0, [])
    assert figures[0]["rollout/reward_mean"][1] == [0.1, 0.4, 0.7]
    assert read_metrics(path) == parse_step_lines(path)[0] and len(read_metrics(path)) == 3


def test_unreadable_inner_lines_are_left_out_and_named_in_one_warning(tmp_path, capsys, figures):
    """NUL bytes and non-UTF-8 bytes before the last line: the other rows are drawn (as ``--resume``
    keeps them) and one warning names the file and each line (was: a decode error naming no file)."""
    run = _write_run(tmp_path / "run", [0.1, 0.4, 0.7], [0.2, 0.5, 0.8])
    path = run / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"\0\0\0\n" + b'{"step": 9, "x": "\xff"}\n' + b"".join(lines[1:]))
    code, err = _plot(run, tmp_path / "p.html", capsys)
    assert code == 0 and len(err) == 1
    assert err[0].startswith(f"cispo plot: warning: {path}: left out 2 unreadable line(s) (line 2: NUL bytes")
    assert "line 3: UnicodeDecodeError" in err[0]
    assert figures[0]["rollout/reward_mean"][1] == [0.1, 0.4, 0.7]


def test_values_that_are_not_finite_numbers_are_not_drawn(tmp_path, capsys, figures):
    """10**400 (an int no float holds), 1e400 (inf), NaN, objects, arrays, strings, booleans and a
    too large step are skipped; a line nested too deeply for the JSON parser is an unreadable line
    named with its file and line (was: OverflowError / RecursionError tracebacks)."""
    run = tmp_path / "run"
    run.mkdir()
    key = "rollout/reward_mean"
    odd = [str(10**400), "1e400", "NaN", '{"a": 1}', "[1, 2]", '"0.5"', "true", "[" * 200 + "]" * 200]
    lines = [f'{{"step": {s}, "{key}": {v}}}' for s, v in enumerate(odd, start=1)]
    lines += [json.dumps({"step": 10**400, key: 0.5}), json.dumps({"step": 20, key: 0.25}),
              f'{{"step": 21, "{key}": ' + "[" * 100_000 + "]" * 100_000 + "}", json.dumps({"step": 22, key: 0.75})]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code, err = _plot(run, tmp_path / "p.html", capsys)
    assert code == 0 and len(err) == 1
    assert f"{run / 'metrics.jsonl'}: left out 1 unreadable line(s) (line 11: JSON nested too deeply" in err[0]
    assert figures[0][key][1] == [0.25, 0.75]
    assert "0.75 <small>(step 22)</small>" in (tmp_path / "p.html").read_text()


@pytest.mark.parametrize("suffix", [".png", ".html"])
def test_an_output_whose_png_or_html_is_a_folder_is_one_line(tmp_path, capsys, suffix):
    run = _write_run(tmp_path / "run", [0.1], [0.2])
    (tmp_path / ("out" + suffix)).mkdir()
    code, err = _plot(run, tmp_path / "out.html", capsys)
    folder = tmp_path / ("out" + suffix)
    said = f"cispo plot: error: {folder}: a folder; -o names the file to write (out.png and out.html are written)"
    assert code == 2 and err == [said]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out" + suffix, "run"]  # nothing written


def test_an_output_that_cannot_be_written_is_one_line(tmp_path, capsys):
    run = _write_run(tmp_path / "run", [0.1], [0.2])
    (tmp_path / "file").write_text("")
    code, err = _plot(run, tmp_path / "file" / "out.html", capsys)  # its folder would be inside a file
    assert code == 2 and len(err) == 1 and err[0].startswith(f"cispo plot: error: {tmp_path / 'file'}: cannot write it")


def test_resume_drops_a_line_nested_too_deeply_instead_of_a_traceback(tmp_path):
    """The one parser (`parse_step_lines`) serves ``--resume`` too: such a line is dropped and named."""
    from cispo.records.tracking import JsonlSink, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + '}\n{"step": 1}\n')
    with pytest.warns(RuntimeWarning, match=r"line 2: JSON nested too deeply to read"):
        JsonlSink(path).truncate_after(1)
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]
