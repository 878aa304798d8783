"""Curves from ``metrics.jsonl`` rows (or ``metrics.jsonl.gz``'s, `cispo.foundations.jsonl`):
one run (``curves.png``), any runs overlaid (``cispo plot RUN_DIR...``: one PNG and a
self-contained HTML page), and the bands of the comparison plots, clamped to [0, 1] for fractions.

Every panel whose metrics a run logged is drawn, and only those (``objective/kl``, logged as 0
when the KL penalty is off, counts once it is non-zero). A fraction is drawn on a [0, 1] axis
while its values lie in [0, 1]; ``accuracy`` is the mean task reward, so a reward outside
[0, 1] takes it outside, and then the axis follows the data."""

from __future__ import annotations

import base64
import contextlib
import html
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cispo.foundations.jsonl import glob_jsonl, has_jsonl, jsonl_path, parse_step_lines  # noqa: E402

PANELS = [  # (title, [(metric, label), ...])
    ("held-out accuracy", [("eval/accuracy", "mean@k"), ("eval/accuracy_greedy", "greedy")]),
    ("held-out reward", [("eval/reward_mean", "mean@k"), ("eval/reward_greedy", "greedy")]),  # no 0/1 verifier
    ("training reward", [("rollout/reward_mean", "reward"), ("rollout/accuracy", "accuracy")]),
    ("fork-token rate", [("rollout/fork_rate", "train samples"), ("eval/fork_rate", "held-out samples")]),
    ("gradient lost / capped", [("objective/frac_ppo_dropped", "PPO would drop"),
                                ("objective/frac_ppo_dropped_fork", "PPO would drop (fork tokens)"),
                                ("objective/frac_capped", "IS weight capped")]),
    ("policy entropy", [("objective/entropy", "entropy")]),
    ("response length", [("rollout/response_length", "mean tokens")]),
    ("KL", [("objective/kl", "KL(pi_theta || pi_ref), the penalty's"),
            ("objective/approx_kl", "KL(pi_old || pi_theta), k3")]),
]
ZERO_WHEN_OFF = ("objective/kl",)
"""Metrics logged as 0 when their feature is off: a run has them once a value is non-zero."""


FRACTION_PREFIXES = ("frac_", "accuracy")
FRACTION_NAMES = ("fork_rate", "truncated")


def is_fraction(key: str) -> bool:
    """True for metrics that are fractions in [0, 1] by definition (docs/metrics.md):
    ``*/frac_*``, ``*/accuracy*`` (``eval/accuracy_pass_at_4`` too), ``*/fork_rate``, ``*/truncated``."""
    name = key.rsplit("/", 1)[-1]
    return name.startswith(FRACTION_PREFIXES) or name in FRACTION_NAMES


def in_unit_interval(values) -> bool:
    """All finite ``values`` lie in [0, 1] (None and NaN are skipped)."""
    return all(0.0 <= v <= 1.0 for v in values if v is not None and math.isfinite(v))


def band_limits(key: str, low: list[float], high: list[float]) -> tuple[list[float], list[float]]:
    """A band ``[low, high]`` clamped to [0, 1] when ``key`` is a fraction whose band centres lie
    in [0, 1] (a mean ± interval of a fraction can run past its range; the values themselves
    cannot). An ``accuracy`` of rewards outside [0, 1] is not a fraction: not clamped."""
    if not (is_fraction(key) and in_unit_interval((lo + hi) / 2 for lo, hi in zip(low, high))):
        return list(low), list(high)
    return [min(max(v, 0.0), 1.0) for v in low], [min(max(v, 0.0), 1.0) for v in high]


def fill_band(ax, steps: list[int], low: list[float], high: list[float], key: str, **kwargs):
    """``ax.fill_between`` of ``band_limits(key, low, high)``."""
    low, high = band_limits(key, low, high)
    return ax.fill_between(steps, low, high, **kwargs)


def finite(value) -> float | None:
    """``value`` as a float when it is a finite number; else None: null, NaN, +-inf, a bool, a
    string, an object or array, an int too large for a float (``1e400`` parses to inf, ``10**400``
    to such an int). The only values a plot draws."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows whose ``key`` and step are finite numbers (`finite`)."""
    pts = [(r["step"], y) for r in rows if (y := finite(r.get(key))) is not None and finite(r["step"]) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def has_metric(rows: list[dict], key: str, asked: bool = False) -> bool:
    """Some row has a finite value of ``key``; a non-zero one for `ZERO_WHEN_OFF` metrics unless
    ``asked`` (named by the user)."""
    values = series(rows, key)[1]
    return any(values) if key in ZERO_WHEN_OFF and not asked else bool(values)


def grid(n: int, cols: int = 3, size: tuple[float, float] = (4.5, 3.3)):
    """A figure of ``n`` panels in rows of ``cols``: (fig, the first ``n`` axes); the rest hidden."""
    cols = max(1, min(cols, n))
    nrows = max(1, math.ceil(n / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(size[0] * cols, size[1] * nrows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)[:n]


def unit_axis_if_fraction(ax, key: str, values) -> None:
    """A [0, 1] y-axis for a fraction whose ``values`` lie in [0, 1]; else the data's own range."""
    if is_fraction(key) and in_unit_interval(values):
        ax.set_ylim(-0.03, 1.03)


def plot_run(rows: list[dict], path: Path, title: str = "") -> Path:
    """``curves.png`` of one run: each of `PANELS` whose metrics the run has (`has_metric`)."""
    panels = [(name, [(k, label) for k, label in keys if has_metric(rows, k)]) for name, keys in PANELS]
    panels = [(name, keys) for name, keys in panels if keys] or PANELS[:1]
    fig, axes = grid(len(panels), size=(13 / 3, 3.25))
    for ax, (name, keys) in zip(axes, panels):
        for key, label in keys:
            x, y = series(rows, key)
            ax.plot(x, y, marker="o" if len(x) < 15 else None, ms=3, label=label)
        style_axis(ax, name)
    return save_figure(fig, path, title)


def style_axis(ax, title: str, xlabel: str = "step") -> None:
    """A panel's title, x label, grid and legend (when it has labelled lines)."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


K_LABEL = "K (off-policy updates per generation batch)"


def style_gap_vs_k(ax, title: str) -> None:
    """A paired-gap-against-K panel: log2 K axis, the zero line, then `style_axis`."""
    ax.set_xscale("log", base=2)
    ax.axhline(0, color="k", lw=0.5)
    style_axis(ax, title, K_LABEL)


def save_figure(fig, path: Path, title: str = "") -> Path:
    """``fig`` written to ``path`` (PNG), and closed also when that fails."""
    if title:
        fig.suptitle(title)
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return Path(path)


# --------------------------------------------------------------------------- `cispo plot`

OVERLAY_METRICS = [key for _, keys in PANELS for key, _ in keys]
"""Default metrics of ``cispo plot`` (those present in at least one run are drawn)."""


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run folders (holding ``metrics.jsonl`` or ``metrics.jsonl.gz``) named by ``paths``: a run
    folder itself, or a folder whose sub-folders are runs (e.g. a ``python -m studies compare`` output).
    ``FileNotFoundError`` names a path that is neither."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if has_jsonl(p / "metrics.jsonl"):
            runs.append(p)
        elif p.is_dir() and (found := sorted({q.parent for q in glob_jsonl(p, "*/metrics.jsonl")})):
            runs.extend(found)
        else:
            raise FileNotFoundError(f"{p}: no metrics.jsonl there nor in its sub-folders (not a run folder)")
    return list(dict.fromkeys(runs))


def read_rows(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (or of its ``.gz``, `jsonl_path`): the rows ``--resume``
    keeps (`parse_step_lines`, the one parser). A torn or NUL-filled last line (a run killed
    mid-write, or still writing) is left out silently; unreadable lines before it are left out too,
    with one line on stderr naming the file and them.
    ``ValueError`` naming the file when it cannot be read at all."""
    path = jsonl_path(path)
    try:
        rows, bad, last = parse_step_lines(path)
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    inner = [(n, what) for n, what in bad if n != last]
    if inner:
        named = "; ".join(f"line {n}: {what}" for n, what in inner[:3])
        more = f"; and {len(inner) - 3} more" if len(inner) > 3 else ""
        print(f"cispo plot: warning: {path}: left out {len(inner)} unreadable line(s) ({named}{more})",
              file=sys.stderr)
    return rows


def run_labels(runs: list[Path]) -> list[str]:
    """Short unique labels: the folder names, or the paths where names repeat."""
    names = [r.name for r in runs]
    return [n if names.count(n) == 1 else str(r) for n, r in zip(names, runs)]


def final_value(rows: list[dict], key: str) -> tuple[int, float] | None:
    """(step, value) of the last row with a finite value for ``key`` (`series`); None if none has one."""
    steps, values = series(rows, key)
    return (steps[-1], values[-1]) if steps else None


def shown_metrics(runs: dict[str, list[dict]], metrics: list[str] | None = None) -> list[str]:
    """The metrics of ``metrics`` (default ``OVERLAY_METRICS``) that some run has (`has_metric`);
    ``ValueError`` if none."""
    keys = [k for k in (metrics or OVERLAY_METRICS) if any(has_metric(rows, k, metrics is not None)
                                                          for rows in runs.values())]
    if not keys:
        raise ValueError(f"none of the metrics {', '.join(metrics or OVERLAY_METRICS)} is in these runs")
    return keys


def plot_overlay(runs: dict[str, list[dict]], path: Path, metrics: list[str] | None = None, title: str = "") -> Path:
    """One panel per metric (`shown_metrics`), one line per run: ``runs`` maps label -> metrics
    rows. ``ValueError`` if no run has any."""
    keys = shown_metrics(runs, metrics)
    fig, axes = grid(len(keys))
    for ax, key in zip(axes, keys):
        drawn = []
        for i, (label, rows) in enumerate(runs.items()):
            x, y = series(rows, key)
            if x:  # one colour per run in every panel
                ax.plot(x, y, marker="o" if len(x) < 15 else None, ms=3, label=label, color=f"C{i % 10}")
                drawn += y
        unit_axis_if_fraction(ax, key, drawn)
        style_axis(ax, key)
    return save_figure(fig, path, title)


def _cell(value) -> str:
    if value is None:
        return "&ndash;"
    step, v = value
    return f"{v:.4g} <small>(step {step})</small>"


def report_html(runs: dict[str, list[dict]], png: bytes, keys: list[str], title: str) -> str:
    """A self-contained HTML page: ``png`` embedded as base64 and a table of each run's final
    value of each metric of ``keys`` (no script, no external file)."""
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join(
        f"<tr><td>{html.escape(label)}</td><td>{max((r['step'] for r in rows), default='&ndash;')}</td>"
        + "".join(f"<td>{_cell(final_value(rows, k))}</td>" for k in keys) + "</tr>"
        for label, rows in runs.items()
    )
    image = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:1em}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}} td:first-child{{text-align:left}}</style>
</head><body><h1>{html.escape(title)}</h1>
<img alt="curves" style="max-width:100%" src="data:image/png;base64,{image}">
<h2>Final values</h2>
<table><tr><th>run</th><th>last step</th>{head}</tr>
{body}</table>
</body></html>
"""


def plot_runs(paths: list[str | Path], out: Path, metrics: list[str] | None = None,
              title: str = "") -> tuple[Path, Path]:
    """``cispo plot``: overlay the runs at ``paths`` (see ``find_runs``) into ``out`` with suffix
    ``.png`` and ``.html`` (the page embeds the PNG and a table of final metrics). Returns both paths."""
    run_dirs = find_runs(paths)
    runs = {label: read_rows(run / "metrics.jsonl") for label, run in zip(run_labels(run_dirs), run_dirs)}
    png, page = output_paths(out)
    title = title or ", ".join(runs)
    with writing(png):
        plot_overlay(runs, png, metrics, title if len(title) < 120 else "")
    with writing(page):
        page.write_text(report_html(runs, png.read_bytes(), shown_metrics(runs, metrics), title), encoding="utf-8")
    return png, page


@contextlib.contextmanager
def writing(path: Path):
    """An ``OSError`` of the block (no permission, a full disk) as a ``ValueError`` naming ``path``."""
    try:
        yield
    except OSError as e:
        raise ValueError(f"{path}: cannot write it ({e.strerror or e})") from None


def output_paths(out: str | Path) -> tuple[Path, Path]:
    """The ``.png`` and ``.html`` that ``cispo plot -o out`` writes, their folder made;
    ``ValueError`` naming one that is a folder, or the folder when it cannot be made."""
    out = Path(out)
    png, page = out.with_suffix(".png"), out.with_suffix(".html")
    for path in (png, page):
        if path.is_dir():
            raise ValueError(f"{path}: a folder; -o names the file to write ({png.name} and {page.name} are written)")
    with writing(out.parent):
        out.parent.mkdir(parents=True, exist_ok=True)
    return png, page
