"""Metric sinks. ``metrics.jsonl`` is always written: one JSON object per line, with
``step`` and the namespaced metrics of ``docs/metrics.md``."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no nan / inf
    return value


class JsonlSink:
    """Appends ``{"step": s, **metrics}`` lines to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after ``step`` (a resumed run logs them again)."""
        if not self.path.exists():
            return
        rows = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line in rows if json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))


def read_metrics(path: Path) -> list[dict]:
    """All rows of a ``metrics.jsonl`` (missing values as None)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
