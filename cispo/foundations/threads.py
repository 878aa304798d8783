"""How many torch CPU threads a run uses (``threads`` in the config).

The models this library trains on a CPU are small: one more thread pays (forward + backward +
AdamW 1.5x with two threads on an idle 2-core machine, docs/performance.md), but only while a
core is free for it. Under load a second thread waits for a core and slows the run down, and
``python -m studies compare`` already fills the cores with one single-threaded run per worker (it passes
``threads=1``).
"""

from __future__ import annotations

import os

AUTO_MAX_THREADS = 2  # measured: 1 vs 2 threads; more is not measured on the project's models


def pick_threads(requested: int | None, cpu_count: int, load: float) -> int:
    """The thread count: ``requested`` when given (the user's override), else the rule

        2 if load < cpu_count - 1 else 1

    i.e. two threads when, besides the core this run takes, another one is idle (``load``: the
    1-minute load average, runnable processes averaged over the cores), one otherwise."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"threads must be an int >= 1 or None (auto), got {requested!r}")
        return requested
    return AUTO_MAX_THREADS if cpu_count >= 2 and load < cpu_count - 1 else 1


def cpu_count() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_threads(requested: int | None) -> int:
    """:func:`pick_threads` for this process now: the 1-minute load average (none: 1 thread) and its
    share of the cores (under ``torchrun``, ``LOCAL_WORLD_SIZE`` processes share them). A positive
    ``OMP_NUM_THREADS`` in the environment counts as the user's request when ``requested`` is None."""
    if requested is None:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        requested = int(env) if env.isdigit() and int(env) >= 1 else None
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = float("inf")
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return pick_threads(requested, max(1, cpu_count() // local), load)
