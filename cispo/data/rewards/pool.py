"""User rewards in worker processes: a hang, an exit or a crash costs one call, never the run.

    >>> pool = pool_for("my_rewards.py:score", workers=4)
    >>> pool.score([(prompt, completion, sample), ...], timeout_s=60.0)   # [(reward, error), ...]

A thread running a hung call can never be killed (a few of them jam a thread pool), and a
reward calling ``sys.exit`` / ``os._exit`` or raising ``KeyboardInterrupt`` would end the
trainer. Here every call runs in a worker process of a `RewardPool`:

1. the worker loads the reward itself from its spec string (``file.py:fn``, ``module:fn``, a
   built-in name) as it starts, so nothing unpicklable crosses, and runs each call in its main
   thread (so math-verify's ``signal.alarm`` timeouts work there). `RewardPool.start` starts the
   workers ahead of the first call (the trainer does it before loading the model, so the two
   overlap and the first step does not wait ~2 s for them);
2. any ``BaseException`` of the call (``SystemExit``, ``KeyboardInterrupt``, ...) comes back as
   an error message; the worker lives on;
3. each worker has a pipe of its own, on which it is sent calls ahead (`AHEAD_S`) and says
   when it starts each and what each returned; one thread of the trainer (the pool's
   dispatcher) sends the calls and reads the pipes. So a call's outcome is what came back on its
   worker's pipe: a worker's death is acted on only after everything it sent before dying has
   been read (a pipe keeps its order), and it fails only the call that worker had started (one
   sent to it but not started goes to another worker). **A call whose result was sent is
   never reported as failed, and a death is never charged to another call.**
   A call past ``timeout_s`` (counted from when its worker said it started it) has its worker
   killed and replaced; a worker that dies (``os._exit``, a signal, out of memory) is replaced
   the same way. The call scores 0 with a message;
4. each worker (a `cispo.data.rewards.processes.GroupProcess`) leads a session of its own, so
   a signal to the trainer's process group (a scheduler stopping the job, Ctrl-C) does not
   reach it, and it ignores a SIGTERM sent to it directly: a step's calls finish. Stopping a
   worker (a timeout, `RewardPool.close`) SIGKILLs its process group, so the processes its
   reward started go with it (also when the worker died by itself);
5. the worker's stdout / stderr (file descriptors 1 and 2, so C code and child processes too)
   go to a private file emptied after every call; a failing call's message ends with the last
   `OUTPUT_TAIL_CHARS` of its output; a worker may write at most `OUTPUT_LIMIT_BYTES` to any
   file before its writes fail (``RLIMIT_FSIZE``, POSIX);
6. the arguments are pickled into the worker: a reward that mutates them changes its own copy.
   What comes back is never pickled: each result is JSON of builtin values made in the worker
   (`to_wire`: a number, text or None, an error message, numeric extras; a ``str`` / ``float``
   subclass copied without running its methods), so no object of the job's reaches the trainer,
   whose unpickling would run its code.

The same machinery runs other code that must not hurt the run: a pool's ``job`` (`RewardPool`;
default `reward_job`, the reward) is loaded once per worker from the spec, and its calls return an
`Outcome`: the tools of a multi-turn rollout (``cispo.envs.tools.ToolRunner``) run so.

Workers start with the ``spawn`` method: a fresh interpreter, never a fork of a process that
holds CUDA or torch's threads, and no fork server (a process in the trainer's group: a
SIGTERM to the group would kill it, and every worker it started would be taken for dead).

Why not a library pool. pebble (used here before, 5.2.3): its workers share one pipe, and two
of its threads race, one reading results and acknowledgements, one watching for dead workers.
A death seen before the dead worker's last messages were read was charged to the call it had
just *finished* (whose result, even a success, was then dropped), and the call that did die
waited out its timeout, or forever without one (the same family as pebble issue #153). loky
has no per-task timeout, and one crashed worker breaks the whole executor.
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import os
import pickle
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from multiprocessing.connection import wait

from cispo.data.rewards import Outcome, describe_error, reward_outcome
from cispo.data.rewards.processes import (
    OUTPUT_LIMIT_BYTES,
    OUTPUT_TAIL_CHARS,
    OutputCapture,
    ignore_sigterm,
    signal_name,
    worker_context,
)
from cispo.foundations.text import plain_str

__all__ = ["RewardPool", "pool_for", "reward_job", "shutdown_pools", "to_wire", "from_wire", "WIRE_TEXT_CHARS",
           "OUTPUT_TAIL_CHARS", "OUTPUT_LIMIT_BYTES"]

AHEAD_S = 0.05
"""A worker is sent as many calls ahead (waiting in its pipe while it runs one) as it runs in
about this long at the recent call time, at least 1, at most `MAX_AHEAD`: a fast reward's
worker does not wait for a round trip through the dispatcher after each call (on a loaded
machine each one cost ~10 ms), and a slow reward's calls are not held behind one another."""
MAX_AHEAD = 16
WIRE_TEXT_CHARS = 1 << 16
"""The most characters of any text a worker sends back (a tool's output, an error message, an extra's name)."""
MAX_SENDS = 3
"""The most workers one call is sent to when each dies (or is stopped) before the call starts."""
LIVENESS_CHECK_S = 0.1
"""The longest the dispatcher waits before asking each busy or starting worker whether it is
alive (besides watching its pipe and exit sentinel, which a process the reward forked may keep
open)."""


# ---------------------------------------------------------------------------------------
# In the worker
# ---------------------------------------------------------------------------------------


def reward_job(spec: str):
    """The reward pool's job, loaded once in each worker: the reward of ``spec`` (the trainer's load tried
    it), as ``call(prompt, completion, sample) -> Outcome`` (`reward_outcome`)."""
    from cispo.data.rewards.loading import load_reward

    return functools.partial(reward_outcome, load_reward(spec, isolation="main", trial=False))


class _Worker:
    """A worker's job (loaded once from its spec by ``job(spec)``) and its captured output."""

    def __init__(self, spec: str, job, what: str) -> None:
        self.output = OutputCapture()
        self.call, self.load_error = None, None
        try:
            self.call = job(spec)
        except BaseException as e:  # noqa: BLE001 - reported with every call
            self.load_error = f"loading the {what} in its worker failed: {describe_error(e)}"


_WORKERS: dict[tuple, _Worker] = {}


def start_worker(spec: str, job=reward_job, what: str = "reward") -> None:
    """SIGTERM ignored (`ignore_sigterm`), then the job loaded (a load error is kept and reported
    with every call)."""
    ignore_sigterm()
    _WORKERS[(spec, job)] = _Worker(spec, job, what)


def score_call(spec: str, *args, job=reward_job, what: str = "reward") -> Outcome:
    """Runs in a worker: the call's `Outcome` (a reward's: `reward_outcome`, its reward, or None where
    it abstained, and its extras; another job's: what its call returned), or ``(0.0, message)``;
    never raises."""
    worker = _WORKERS.get((spec, job)) or _WORKERS.setdefault((spec, job), _Worker(spec, job, what))
    outcome = Outcome(0.0, worker.load_error)
    if worker.load_error is None:
        try:
            outcome = worker.call(*args)
        except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, ...: one failed call
            outcome = Outcome(0.0, describe_error(e))
    tail = worker.output.take()
    if outcome.error is not None and tail.strip():
        outcome = outcome._replace(error=f"{outcome.error} | output (end): {tail.strip()!r}")
    return outcome


def worker_main(spec: str, conn, job=reward_job, what: str = "reward") -> None:
    """A worker process: load the job, send its pid (ready), then for each pickled call it
    receives send null (started), run it and send ``[value, error, seconds, extras]`` (`to_wire`),
    until the pool closes the pipe. Every message is JSON of builtin values."""
    os.set_inheritable(conn.fileno(), False)  # programs the job runs do not hold the pipe
    start_worker(spec, job, what)
    conn.send_bytes(json.dumps(os.getpid()).encode())
    while True:
        try:
            call = conn.recv_bytes()
        except (EOFError, OSError):  # the pool closed
            return
        conn.send_bytes(b"null")
        started = time.perf_counter()
        try:
            outcome = score_call(spec, *pickle.loads(call), job=job, what=what)
        except BaseException as e:  # noqa: BLE001 - e.g. an argument whose class cannot be imported here
            outcome = Outcome(0.0, f"could not run in a worker process: {describe_error(e)}")
        conn.send_bytes(to_wire(outcome, time.perf_counter() - started, what))


def _plain_text(value) -> str | None:
    """A ``str`` (or an instance of a subclass) as a builtin ``str`` (`plain_str`: no method of the subclass
    runs), at most `WIRE_TEXT_CHARS`; None for anything else."""
    return plain_str(value)[:WIRE_TEXT_CHARS] if issubclass(type(value), str) else None


def _plain_number(value) -> float | None:
    """An ``int`` / ``float`` (or a subclass's instance, ``bool`` too) as a builtin ``float``, read by the
    builtin types' own methods; None for anything else."""
    if issubclass(type(value), float):
        return float.__float__(value)
    return float(int.__int__(value)) if issubclass(type(value), int) else None


def to_wire(outcome: Outcome, seconds: float, what: str = "reward") -> bytes:
    """What a worker sends back for one call, made here in the worker: ``[value, error, seconds, extras]``
    as JSON of builtin values only — the value a number, text (a tool's) or None, the error text or None,
    the extras ``[text, number]`` pairs (`_plain_text`, `_plain_number`: a subclass is copied without
    running its methods). A value of another type is a failed call. So no object of the job's is pickled
    into the trainer, where unpickling it would run its code (``__reduce__``)."""
    try:
        value = _plain_text(outcome.value) if issubclass(type(outcome.value), str) else _plain_number(outcome.value)
        error = None if outcome.error is None else (_plain_text(outcome.error) or f"the {what} failed")
        if value is None and outcome.value is not None:
            value, error = 0.0, error or f"the {what}'s result is neither a number nor text"
        extras = [[_plain_text(k), _plain_number(v)] for k, v in outcome.extras]
        extras = [pair for pair in extras if None not in pair]
        return json.dumps([value, error, float(seconds), extras]).encode()
    except BaseException as e:  # noqa: BLE001 - a hostile extras sequence, ...: one failed call
        return json.dumps([0.0, f"the {what}'s result could not be sent ({describe_error(e)})", float(seconds),
                           []]).encode()


def from_wire(data: bytes) -> tuple:
    """``(value, error, seconds, extras)`` of a worker's result message (`to_wire`); ValueError where it is
    no such message (nothing a worker sends is unpickled here)."""
    try:
        value, error, seconds, extras = json.loads(data)
        extras = tuple((k, float(v)) for k, v in extras if isinstance(k, str) and type(v) in (int, float))
    except (ValueError, TypeError, RecursionError, MemoryError):
        raise ValueError("a message that is no call's result") from None
    if not (value is None or type(value) in (int, float, str)) or not (error is None or type(error) is str) \
            or type(seconds) not in (int, float):
        raise ValueError("a message that is no call's result")
    return value, error, float(seconds), extras


# ---------------------------------------------------------------------------------------
# In the trainer
# ---------------------------------------------------------------------------------------


class _Call:
    """One call: its pickled arguments, time limit and future `Outcome`; whether its
    worker said it started (and its deadline then), and how many workers it was sent to."""

    def __init__(self, call: tuple, timeout_s: float | None) -> None:
        self.timeout_s, self.future, self.payload = timeout_s, Future(), b""
        self.started, self.deadline, self.sends = False, None, 0
        try:
            self.payload = pickle.dumps(tuple(call), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - arguments that cannot be pickled
            self.future.set_result(Outcome(0.0, f"could not run in a worker process: {describe_error(e)}"))


class _CallTime:
    """The recent time of one call in a worker (an exponential moving average), and so how many
    calls to send a worker ahead (`AHEAD_S`)."""

    def __init__(self) -> None:
        self.seconds: float | None = None

    def add(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else 0.8 * self.seconds + 0.2 * seconds

    def ahead(self) -> int:
        if self.seconds is None:
            return 1
        return max(1, min(MAX_AHEAD, int(AHEAD_S / max(self.seconds, 1e-6))))


class _Proc:
    """A worker process, the trainer's end of its pipe, and the calls sent to it, in order (the
    first one runs)."""

    def __init__(self, spec: str, call_time: _CallTime, job=reward_job, what: str = "reward") -> None:
        self.call_time, self.what = call_time, what
        self.conn, theirs = worker_context().Pipe()
        self.process = worker_context().Process(target=worker_main, args=(spec, theirs, job, what),
                                                name=f"cispo-{what}-worker")
        self.process.start()
        theirs.close()
        self.ready, self.calls = False, collections.deque()
        self.failure: str | None = None

    @property
    def deadline(self) -> float | None:
        return self.calls[0].deadline if self.calls else None

    def take_messages(self) -> bool:
        """Read every message already sent: the ready pid, then for each call its start (null,
        which sets its deadline) and its result (`from_wire`, which completes it). False once the
        pipe is closed (the worker is gone), or once it sent a message that is none of these (then
        `failure` says so, and its started call fails with it)."""
        if self.failure is not None:
            return False
        try:
            while self.conn.poll(0):
                data = self.conn.recv_bytes()
                if not self.ready:
                    self.ready = True
                elif not self.calls:
                    raise ValueError("a message while it had no call")
                elif data == b"null":
                    call = self.calls[0]
                    call.started = True
                    call.deadline = None if call.timeout_s is None else time.monotonic() + call.timeout_s
                else:
                    value, error, seconds, extras = from_wire(data)
                    self.calls.popleft().future.set_result(Outcome(value, error, extras))
                    self.call_time.add(seconds)
        except (EOFError, OSError):
            return False
        except ValueError as e:
            self.failure = f"the {self.what}'s worker process sent {e}; it was replaced"
            return False
        return True

    def end(self, outcome: str | None = None) -> list[_Call]:
        """Kill and reap it (its process group with it) and keep the results it sent before;
        its started call gets ``outcome`` (None: the cause of its death). The calls it had not
        started are returned, to be sent to another worker (each at most `MAX_SENDS` times)."""
        self.process.kill()
        self.process.join()
        self.take_messages()
        self.conn.close()
        calls, self.calls = self.calls, collections.deque()
        unstarted = []
        for call in calls:
            if call.started or call.sends >= MAX_SENDS:
                why = outcome if call.started and outcome else _death(self.process.exitcode, self.what)
                call.future.set_result(Outcome(0.0, why))
            else:
                unstarted.append(call)
        return unstarted


def _how(exitcode: int) -> str:
    return f"killed by {signal_name(-exitcode)}" if exitcode < 0 else f"exit status {exitcode}"


def _death(exitcode: int, what: str = "reward") -> str:
    return f"the {what}'s worker process died ({_how(exitcode)}); it was replaced"


class RewardPool:
    """Worker processes for one reward spec; `score` runs a batch of calls in them.

    ``job`` (default: the reward, `reward_job`) generalises the pool to other code that must not hurt
    the run: a picklable module-level function ``job(spec) -> call``, run once in each worker, whose
    ``call(*args)`` returns an `Outcome` (the tools of ``cispo.envs.tools`` run so); ``what`` names it
    in the pool's messages ("the tool's worker process died")."""

    def __init__(self, spec: str, workers: int, job=reward_job, what: str = "reward") -> None:
        self.spec, self.workers, self.job, self.what = spec, workers, job, what
        self._lock = threading.Lock()
        self._queue: collections.deque[_Call] = collections.deque()
        self._wake_read, self._wake_write = worker_context().Pipe(duplex=False)
        self._procs: list[_Proc] = []
        self._dispatcher: threading.Thread | None = None
        self._closing = False
        self._start_failed = False
        self._call_time = _CallTime()

    def start(self) -> None:
        """Start the workers now, without waiting for them (each loads the reward as it starts)."""
        with self._lock:
            self._start_locked()

    def submit(self, calls, timeout_s: float | None) -> list[Future]:
        """Queue ``calls = [(prompt, completion, sample), ...]`` at once; a future `Outcome` each, in
        order; each call has its own ``timeout_s``."""
        batch = [_Call(call, timeout_s) for call in calls]
        with self._lock:
            self._start_locked()
            self._queue.extend(c for c in batch if not c.future.done())
        self._wake()
        return [c.future for c in batch]

    def score(self, calls, timeout_s: float | None) -> list[Outcome]:
        """The `Outcome` of each of ``calls``, in order (`submit`, then gathered)."""
        batch = self.submit(calls, timeout_s)
        futures.wait(batch)  # one wake-up for the batch, not one per call
        return [f.result() for f in batch]

    def close(self) -> None:
        """Stop at once: running and queued calls fail, every worker's process group is killed."""
        with self._lock:
            self._closing = True
            dispatcher = self._dispatcher
        self._wake()
        if dispatcher is not None and dispatcher is not threading.current_thread():
            dispatcher.join()

    # -- the dispatcher thread -----------------------------------------------------------

    def _start_locked(self) -> None:
        if self._dispatcher is None:
            self._closing, self._start_failed = False, False
            self._procs = [self._new_proc() for _ in range(self.workers)]
            self._dispatcher = threading.Thread(target=self._dispatch, name="cispo-reward-pool", daemon=True)
            self._dispatcher.start()

    def _new_proc(self) -> _Proc:
        return _Proc(self.spec, self._call_time, self.job, self.what)

    def _wake(self) -> None:
        """Make the dispatcher look at the queue (or at ``_closing``) now. Never silenced: with every
        worker idle it waits on this pipe alone, so a lost wake-up would leave the batch waiting."""
        self._wake_write.send_bytes(b"")

    def _dispatch(self) -> None:
        """Until closed: keep `workers` processes, send queued calls to idle ready ones, read
        what they send, end the dead and the timed out. On any failure of its own, every call
        fails with the reason (no caller waits forever)."""
        reason = f"the {self.what} pool was closed before this call finished"
        try:
            while not self._closing:
                self._top_up()
                self._send_calls()
                ready = wait([self._wake_read] + [x for p in self._procs for x in (p.conn, p.process.sentinel)],
                             self._wait_s())
                while self._wake_read.poll(0):
                    self._wake_read.recv_bytes()
                self._collect(set(ready))
                self._expire()
        except BaseException as e:  # noqa: BLE001 - reported on every call
            reason = f"the {self.what} pool failed: {describe_error(e)}"
        finally:
            with self._lock:
                queued, self._dispatcher = list(self._queue), None
                self._queue.clear()
                procs, self._procs = self._procs, []
            for proc in procs:
                calls = list(proc.calls)
                try:
                    queued += proc.end(reason)
                finally:  # its calls fail even if ending it failed
                    queued += [c for c in calls if not c.future.done()]
            for call in queued:
                if not call.future.done():
                    call.future.set_result(Outcome(0.0, reason))

    def _top_up(self) -> None:
        if not self._start_failed or self._queue:  # a worker died while starting: wait for work
            self._procs += [self._new_proc() for _ in range(self.workers - len(self._procs))]

    def _send_calls(self) -> None:
        """Queued calls to ready workers: one to each, then a second to each, ... up to
        `_CallTime.ahead` each."""
        for depth in range(1, self._call_time.ahead() + 1):
            for proc in self._procs:
                while proc.ready and len(proc.calls) < depth:
                    with self._lock:
                        if not self._queue:
                            return
                        call = self._queue.popleft()
                    try:
                        proc.conn.send_bytes(call.payload)
                    except OSError:  # it died: the call waits for another worker
                        with self._lock:
                            self._queue.appendleft(call)
                        break
                    call.sends += 1
                    proc.calls.append(call)

    def _requeue(self, calls: list[_Call]) -> None:
        with self._lock:
            self._queue.extendleft(reversed(calls))

    def _wait_s(self) -> float | None:
        """Until the next deadline, at most `LIVENESS_CHECK_S` while a worker is busy or starting."""
        if all(p.ready and not p.calls for p in self._procs):
            return None
        deadlines = [p.deadline - time.monotonic() for p in self._procs if p.deadline is not None]
        return max(0.0, min(deadlines + [LIVENESS_CHECK_S]))

    def _collect(self, ready: set) -> None:
        """Results first, then deaths: a worker is ended only after its pipe has been read."""
        for proc in list(self._procs):
            watched = proc.conn in ready or proc.process.sentinel in ready or not (proc.ready and not proc.calls)
            if not watched:
                continue
            open_pipe = proc.take_messages()
            if proc.ready:
                self._start_failed = False
            if open_pipe and proc.process.is_alive():
                continue
            self._procs.remove(proc)
            self._requeue(proc.end(proc.failure))
            if not proc.ready:  # e.g. os._exit while importing the reward in the worker
                self._start_failed = True
                if not any(p.ready for p in self._procs):
                    how = _how(proc.process.exitcode)
                    self._fail_queued(f"the {self.what}'s worker process died while starting ({how})")

    def _expire(self) -> None:
        now = time.monotonic()
        for proc in list(self._procs):
            if proc.deadline is not None and now >= proc.deadline and proc.take_messages() \
                    and proc.deadline is not None and now >= proc.deadline:
                timeout_s = proc.calls[0].timeout_s
                self._call_time.add(timeout_s)  # no more calls held behind hanging ones
                self._procs.remove(proc)
                self._requeue(proc.end(f"timed out after {timeout_s} s (its worker process was killed and replaced)"))

    def _fail_queued(self, reason: str) -> None:
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
        for call in queued:
            call.future.set_result(Outcome(0.0, reason))


_POOLS: dict[tuple, RewardPool] = {}


def pool_for(spec: str, workers: int, job=reward_job, what: str = "reward") -> RewardPool:
    """The pool for ``spec`` (and ``job``: `RewardPool`), created on first use, its workers started by
    `RewardPool.start` or the first call; kept until `shutdown_pools`."""
    key = (spec, workers, job, what)
    if key not in _POOLS:
        _POOLS[key] = RewardPool(spec, workers, job, what)
    return _POOLS[key]


def shutdown_pools() -> None:
    """Stop every worker pool, rewards' and tools' (also at interpreter exit), killing calls still running and the
    processes they started (SIGKILL to each worker's process group)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(shutdown_pools)
