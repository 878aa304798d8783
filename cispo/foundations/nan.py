"""Metrics that may be undefined: NaN marks a metric with nothing to average (no fork token in
the batch, no evaluation this step). Plain Python, no torch, so that reading run folders
(``python -m studies compare``'s tables, ``python -m studies data``) does not load it."""

from __future__ import annotations


def is_nan(x) -> bool:
    """A float NaN (a metric that is not defined)."""
    return isinstance(x, float) and x != x


def nan_mean(values) -> float:
    """The mean of ``values`` that are neither None nor NaN; NaN when none is left."""
    kept = [v for v in values if v is not None and not is_nan(v)]
    return sum(kept) / len(kept) if kept else float("nan")
