"""The study's runs as read from its raw-data CSV(s) (``python -m studies data``): `RunData` per run,
`load_study` (one file or several, parts side by side) and `group_eval_runs` (part, task, K ->
arm -> seed). The data layer of `studies.study_report`."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from studies.study_data import METRICS, read_csv


@dataclass
class RunData:
    """One run of the CSV: its run columns and its per-step metrics."""

    meta: dict[str, str]
    steps: dict[int, dict[str, float]] = field(default_factory=dict)

    def curve(self, key: str = "eval/accuracy") -> dict[int, float]:
        return {s: m[key] for s, m in sorted(self.steps.items()) if key in m}

    @property
    def wall_s(self) -> tuple[float, bool]:
        """(seconds, measured): ``wall_s``, or the sum of ``perf/step_s`` (measured = False)."""
        if self.meta.get("wall_s"):
            return float(self.meta["wall_s"]), True
        return sum(m.get("perf/step_s", 0.0) for m in self.steps.values()), False


def load_study(paths: str | Path | list[str | Path]) -> list[RunData]:
    """The runs of one CSV or several (keyed by part and run folder name), in file order. One
    run in two files is an error naming both: two data files are parts side by side, not pooled."""
    runs: dict[tuple[str, str], RunData] = {}
    source: dict[tuple[str, str], Path] = {}
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if len(set(paths)) < len(paths):
        twice = sorted({str(p) for p in paths if paths.count(p) > 1})
        raise ValueError(f"a data file is given twice: {', '.join(twice)}")
    for path in paths:
        for i, row in enumerate(read_csv(path), start=2):
            key = (row["part"], row["run"])
            if source.setdefault(key, path) != path:
                raise ValueError(f"{path}:{i}: run {key[1]} of part {key[0]} is also in {source[key]}")
            run = runs.setdefault(key, RunData({c: row[c] for c in row if c not in METRICS and c != "step"}))
            try:
                run.steps[int(row["step"])] = {m: float(row[m]) for m in METRICS if row.get(m)}
            except ValueError as e:
                raise ValueError(f"{path}:{i}: {e}") from None
    return list(runs.values())


Groups = dict[tuple[str, str, int], dict[str, dict[int, RunData]]]


def group_eval_runs(runs: list[RunData]) -> Groups:
    """(part, task, K) -> arm -> seed -> run, for the evaluation runs. Two runs of one arm and
    seed in a group (e.g. two batch sizes at one K in one part) are an error: use two parts."""
    out: Groups = defaultdict(lambda: defaultdict(dict))
    for r in runs:
        if r.meta["role"] == "eval":
            m = r.meta
            cell = out[(m["part"], m["task"], int(m["K"]))][m["arm"]]
            if int(m["seed"]) in cell:
                raise ValueError(f"part {m['part']}, task {m['task']}, K {m['K']}: arm {m['arm']} has seed "
                                 f"{m['seed']} twice ({cell[int(m['seed'])].meta['run']} and {m['run']}); put them "
                                 "in separate parts")
            cell[int(m["seed"])] = r
    return out
