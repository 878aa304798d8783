"""The study's raw data: every run folder's evaluation curve and per-step key metrics in ONE
compact CSV (gzip), from which ``studies.study_report`` regenerates every table
and figure.

One row per (run, step) with at least one recorded metric. Columns (``COLUMNS``):

* run (repeated on each of its rows): ``part`` (study part: main, ksweep, ablation,
  stability, ...), ``role`` (``eval``: a reported run; ``tune``: a learning-rate tuning
  run), ``arm``, ``spec`` (the arm in words: preset(field=value) + run overrides),
  ``objective`` (the preset), ``task``, ``K`` (``algo.updates_per_batch``), ``seed``,
  ``lr`` (peak learning rate), ``prompts_per_step``, ``group_size``, ``warmup_updates``,
  ``steps`` (planned RL steps), ``eval_k`` (samples per held-out prompt: ``eval/accuracy``
  is mean@eval_k), ``run`` (run folder name), ``wall_s`` (seconds the run took, from
  ``study.json``; empty for a folder trained outside ``python -m studies compare``), ``commit`` (first
  12 hex digits of the git commit the run started at, from ``meta.json``), ``base_model``
  (``builtin:`` + 12 hex digits of the sha256 of the built-in model's ``SHA256SUMS``, or the
  ``model.path``; from ``study.json``);
* step: ``step``, then the metrics of ``METRICS`` under their ``metrics.jsonl`` names
  (docs/metrics.md), empty where the step did not record one (``eval/*`` only at evaluated
  steps; ``rollout/*``, ``objective/*``, ``optim/*`` only at steps with an update).

A run folder is one holding ``metrics.jsonl``, or ``metrics.jsonl.gz`` as the research data
committed under studies/results/ does (`cispo.foundations.jsonl`). Numbers are written with 6
significant digits; the gzip stream has no timestamp, so the same runs give the same bytes.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from pathlib import Path

from cispo.foundations.jsonl import glob_jsonl
from cispo.records.runfolder import is_finished
from cispo.records.tracking import read_metrics

RUN_COLUMNS = ["part", "role", "arm", "spec", "objective", "task", "K", "seed", "lr", "prompts_per_step", "group_size",
               "warmup_updates", "steps", "eval_k", "run", "wall_s", "commit", "base_model"]
METRICS = [
    "eval/accuracy", "eval/accuracy_greedy", "eval/fork_rate", "eval/response_length",
    "rollout/accuracy", "rollout/response_length", "rollout/fork_rate", "rollout/fork_tokens_per_response",
    "rollout/groups_kept", "rollout/truncated",
    "objective/frac_capped", "objective/frac_ppo_dropped", "objective/frac_ppo_dropped_fork",
    "objective/frac_ppo_dropped_low_prob", "objective/entropy", "objective/approx_kl",
    "objective/fork_pos_lowp_above", "objective/fork_pos_mass_above", "objective/other_pos_mass_above",
    "optim/lr", "optim/grad_norm", "perf/step_s",
]
COLUMNS = RUN_COLUMNS + ["step"] + METRICS


def find_run_dirs(paths: list[str | Path]) -> list[Path]:
    """Every folder holding a ``metrics.jsonl`` (or ``metrics.jsonl.gz``, the committed research
    data's) at or below `paths`, sorted."""
    found: set[Path] = set()
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such folder")
        found |= {m.parent for m in glob_jsonl(p, "**/metrics.jsonl")}
    return sorted(found)


def run_meta(run_dir: Path) -> dict:
    """The run's columns: ``study.json`` (written by ``python -m studies compare``) over ``config.yaml``.
    A run without ``study.json`` is an ``eval`` run of the arm named after its objective, in
    the part named after its parent folder."""
    from cispo.config.train import TrainConfig, load_yaml

    meta: dict = {"part": run_dir.parent.name, "role": "eval", "run": run_dir.name}
    if (run_dir / "config.yaml").exists():
        c = load_yaml(TrainConfig, run_dir / "config.yaml")
        name, over = c.algo.objective.name, c.algo.objective.overrides()
        meta.update(arm=name + ("(" + ",".join(f"{k}={v}" for k, v in over.items()) + ")" if over else ""),
                    objective=name, task=c.data.task, K=c.algo.updates_per_batch, seed=c.seed, lr=c.optim.lr,
                    prompts_per_step=c.rollout.prompts_per_step, group_size=c.rollout.group_size,
                    warmup_updates=c.optim.warmup_updates, steps=c.steps, eval_k=c.eval.num_samples)
    if (run_dir / "meta.json").exists():
        meta["commit"] = (json.loads((run_dir / "meta.json").read_text()).get("git_commit") or "")[:12]
    if (run_dir / "study.json").exists():
        meta.update({k: v for k, v in json.loads((run_dir / "study.json").read_text()).items() if k in RUN_COLUMNS})
    return meta


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return "" if v != v else f"{v:.6g}"
    return str(v)


def run_rows(run_dir: Path) -> list[list[str]]:
    """The CSV rows of one run folder."""
    meta = run_meta(run_dir)
    head = [_cell(meta.get(c)) for c in RUN_COLUMNS]
    out = []
    for r in read_metrics(run_dir / "metrics.jsonl"):
        vals = [r.get(m) for m in METRICS]
        if any(v is not None for v in vals):
            out.append(head + [str(r["step"])] + [_cell(v) for v in vals])
    return out


def collect(paths: list[str | Path], out: str | Path) -> tuple[Path, int, int, list[Path]]:
    """Write the CSV (gzip when `out` ends in ``.gz``) of every *finished* run below `paths`
    (`cispo.records.runfolder.is_finished`), so a part still running cannot slip half-curves into the data.
    -> (path, runs, rows, the unfinished run folders left out)."""
    dirs, unfinished = [], []
    for d in find_run_dirs(paths):
        (dirs if is_finished(d) else unfinished).append(d)
    rows = [row for d in dirs for row in run_rows(d)]
    key = [COLUMNS.index(c) for c in ("part", "role", "task", "arm", "K", "lr", "seed", "run")]
    rows.sort(key=lambda r: ([r[i] for i in key], int(r[COLUMNS.index("step")])))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows(rows)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = buf.getvalue().encode()
    out.write_bytes(gzip.compress(data, mtime=0) if out.suffix == ".gz" else data)
    return out, len(dirs), len(rows), unfinished


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """The CSV's rows as dicts of strings (gzip read by the name's ``.gz``). A file without the
    run columns is an error naming the missing ones."""
    path = Path(path)
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode()
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in RUN_COLUMNS + ["step", "eval/accuracy"] if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{path}: not a study data file: missing column(s) {', '.join(missing)}")
    return list(reader)
