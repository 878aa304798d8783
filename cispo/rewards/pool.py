"""User rewards in worker processes: a hang, an exit or a crash costs one call, never the run.

    >>> pool = pool_for("my_rewards.py:score", workers=4)
    >>> pool.score([(prompt, completion, sample), ...], timeout_s=60.0)   # [(reward, error), ...]

A thread running a hung call can never be killed (a few of them jam a thread pool), and a
reward calling ``sys.exit`` / ``os._exit`` or raising ``KeyboardInterrupt`` would end the
trainer. Here every call runs in a worker of a `pebble.ProcessPool`:

1. the worker loads the reward itself from its spec string (``file.py:fn``, ``module:fn``, a
   built-in name) as it starts, so nothing unpicklable crosses, and runs each call in its main
   thread (so math-verify's ``signal.alarm`` timeouts work there). `RewardPool.start` starts the
   workers ahead of the first call (the trainer does it before loading the model, so the two
   overlap and the first step does not wait ~2 s for them);
2. any ``BaseException`` of the call (``SystemExit``, ``KeyboardInterrupt``, ...) comes back as
   an error message; the worker lives on;
3. a call past ``timeout_s`` (counted from its start in a worker): pebble stops that worker
   and starts a new one; a worker that dies (``os._exit``, a signal, out of memory) is replaced
   the same way. The call scores 0 with a message;
4. each worker (a `cispo.rewards.processes.GroupProcess`) leads a session of its own, so
   a signal to the trainer's process group (a scheduler stopping the job, Ctrl-C) does not
   reach it, and it ignores a SIGTERM sent to it directly: a step's calls finish. Stopping a
   worker (a timeout, `RewardPool.close`) SIGKILLs its process group, so the processes its
   reward started go with it (also when the worker died by itself);
5. the worker's stdout / stderr (file descriptors 1 and 2, so C code and child processes too)
   go to a private file emptied after every call; a failing call's message ends with the last
   `OUTPUT_TAIL_CHARS` of its output; a worker may write at most `OUTPUT_LIMIT_BYTES` to any
   file before its writes fail (``RLIMIT_FSIZE``, POSIX);
6. the arguments are pickled into the worker: a reward that mutates them changes its own copy.

Workers start with the ``spawn`` method: a fresh interpreter, never a fork of a process that
holds CUDA or torch's threads, and no fork server (a process in the trainer's group: a
SIGTERM to the group would kill it, and pebble would take every worker it started for dead).

Why pebble and not loky: pebble's per-task timeout stops and replaces only that task's worker,
and a dying worker fails only its own task; loky has no per-task timeout, and one crashed worker
breaks the whole executor (every pending call fails, the pool must be rebuilt).
"""

from __future__ import annotations

import atexit
import os
from concurrent.futures import TimeoutError as FutureTimeout

import pebble

from cispo.rewards import check_reward_value, describe_error
from cispo.rewards.processes import (OUTPUT_LIMIT_BYTES, OUTPUT_TAIL_CHARS, OutputCapture, signal_name,
                                     ignore_sigterm, worker_context)

__all__ = ["RewardPool", "pool_for", "shutdown_pools", "OUTPUT_TAIL_CHARS", "OUTPUT_LIMIT_BYTES"]

EXIT_ZERO_CODE = 70
"""Exit status a worker reports when a reward calls ``os._exit(0)``: pebble would take 0 for a
normal exit and wait for the lost call until its timeout."""


# ---------------------------------------------------------------------------------------
# In the worker
# ---------------------------------------------------------------------------------------


class _Worker:
    """A worker's reward (loaded once) and its captured output."""

    def __init__(self, spec: str) -> None:
        self.output = OutputCapture()
        self.pid = os.getpid()
        self.reward, self.load_error = None, None
        try:
            from cispo.rewards.loading import load_reward

            self.reward = load_reward(spec, isolation="main", trial=False)  # the trainer's load tried it
        except BaseException as e:  # noqa: BLE001 - reported with every call
            self.load_error = f"loading the reward in its worker failed: {describe_error(e)}"

    def exit_guard(self, real_exit):
        """``os._exit`` for the call's duration: 0 in this worker becomes `EXIT_ZERO_CODE`;
        child processes the reward forks keep their own codes."""

        def _exit(code: int) -> None:
            real_exit(EXIT_ZERO_CODE if code == 0 and os.getpid() == self.pid else code)

        return _exit


_WORKERS: dict[str, _Worker] = {}


def start_worker(spec: str) -> None:
    """A worker's initializer: SIGTERM ignored (`ignore_sigterm`), then the reward loaded (a load
    error is kept and reported with every call)."""
    ignore_sigterm()
    _WORKERS[spec] = _Worker(spec)


def ready() -> int:
    """A no-op call (returns the worker's pid): scheduling it makes pebble start the workers."""
    return os.getpid()


def score_call(spec: str, prompt, completion, sample: dict) -> tuple[float, str | None]:
    """Runs in a worker: ``(reward, None)`` or ``(0.0, message)``; never raises."""
    worker = _WORKERS.get(spec) or _WORKERS.setdefault(spec, _Worker(spec))
    value, error = 0.0, worker.load_error
    if error is None:
        real_exit = os._exit
        os._exit = worker.exit_guard(real_exit)
        try:
            value = check_reward_value(worker.reward(prompt, completion, **sample))
        except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, ...: one failed call
            value, error = 0.0, describe_error(e)
        finally:
            os._exit = real_exit
    tail = worker.output.take()
    if error is not None and tail.strip():
        error = f"{error} | output (end): {tail.strip()!r}"
    return value, error


# ---------------------------------------------------------------------------------------
# In the trainer
# ---------------------------------------------------------------------------------------


class RewardPool:
    """Worker processes for one reward spec; `score` runs a batch of calls in them."""

    def __init__(self, spec: str, workers: int) -> None:
        self.spec, self.workers = spec, workers
        self._pool = _new_pool(spec, workers)

    def start(self) -> None:
        """Start the workers now, without waiting for them: each loads the reward as it starts
        (pebble starts every worker when the first call is scheduled; this schedules a no-op)."""
        self._pool.schedule(ready)

    def score(self, calls, timeout_s: float | None) -> list[tuple[float, str | None]]:
        """``[(reward, error)]`` for ``calls = [(prompt, completion, sample), ...]``, in order.
        All calls are submitted at once and gathered; each has its own ``timeout_s``."""
        if not self._pool.active:  # the pool itself broke (never a reward's doing): start over
            self._pool = _new_pool(self.spec, self.workers)
        futures = [self._pool.schedule(score_call, args=(self.spec, p, c, s), timeout=timeout_s)
                   for p, c, s in calls]
        return [_outcome(f, timeout_s) for f in futures]

    def close(self) -> None:
        """Stop at once: running calls are abandoned, every worker's process group killed."""
        self._pool.stop()
        self._pool.join()


def _new_pool(spec: str, workers: int) -> pebble.ProcessPool:
    return pebble.ProcessPool(max_workers=workers, initializer=start_worker, initargs=(spec,),
                              context=worker_context())


def _outcome(future, timeout_s) -> tuple[float, str | None]:
    try:
        return future.result()
    except FutureTimeout:
        return 0.0, f"timed out after {timeout_s} s (its worker process was killed and replaced)"
    except pebble.ProcessExpired as e:
        how = f"killed by {signal_name(-e.exitcode)}" if e.exitcode < 0 else f"exit status {e.exitcode}"
        return 0.0, f"the reward's worker process died ({how}); it was replaced"
    except Exception as e:  # noqa: BLE001 - e.g. arguments that cannot be pickled
        return 0.0, f"could not run in a worker process: {describe_error(e)}"


_POOLS: dict[tuple[str, int], RewardPool] = {}


def pool_for(spec: str, workers: int) -> RewardPool:
    """The pool for ``spec`` (created on first use, its workers started by `RewardPool.start` or the
    first call; kept until `shutdown_pools`)."""
    key = (spec, workers)
    if key not in _POOLS:
        _POOLS[key] = RewardPool(spec, workers)
    return _POOLS[key]


def shutdown_pools() -> None:
    """Stop every reward pool (also at interpreter exit), killing calls still running and the
    processes they started (SIGKILL to each worker's process group)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(shutdown_pools)
