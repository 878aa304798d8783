"""The processes that run user reward code outside the trainer: the reward pool's workers
(`cispo.data.rewards.pool`) and the trial import of a reward module (`trial_import`).

Each is a fresh interpreter (``spawn``: never a fork of a process that holds CUDA or torch's
threads, and no shared fork server whose death would fail every worker) that

1. starts a session of its own (``os.setsid``): a signal sent to the trainer's process group
   (a scheduler's or systemd's SIGTERM, Ctrl-C in a terminal) reaches neither it nor the
   processes its reward starts;
2. is stopped, with every process of its session, by SIGKILL to that process group at once
   (``terminate`` / ``kill``), and the group is also killed when the process, dead by itself
   (``os._exit``, a crash), is reaped, whoever reaps it (``is_alive``, ``join``, the clean-up of
   finished children that every ``Process.start`` runs): children a reward starts do not outlive
   their worker. A child that starts a session of its own (``start_new_session=True``) leaves
   the group and is not followed;
3. (a pool worker) ignores SIGTERM sent to it directly (`ignore_sigterm`; systemd and Slurm
   signal every process of a job): its call finishes and the trainer decides (it stops after
   the step);
4. writes its stdout / stderr (file descriptors 1 and 2, so C code and child processes too)
   to a private file (`OutputCapture`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys
import tempfile
import threading
from multiprocessing.context import SpawnContext, SpawnProcess

from cispo.data.rewards import cap_message

__all__ = ["GroupProcess", "worker_context", "ignore_sigterm", "OutputCapture", "trial_import", "signal_name",
           "OUTPUT_TAIL_CHARS", "OUTPUT_LIMIT_BYTES"]

OUTPUT_TAIL_CHARS = 500
"""How much of a failing call's own output (its end) its error message carries."""
OUTPUT_LIMIT_BYTES = 64 << 20
"""The most such a process may write to one file (its captured output included) before writes fail."""


# ---------------------------------------------------------------------------------------
# A process in a session of its own, killed with its group
# ---------------------------------------------------------------------------------------


class GroupProcess(SpawnProcess):
    """A spawned process that leads its own session; `terminate` / `kill` SIGKILL its whole
    process group, and so does reaping it once it has ended by itself, whoever reaps it
    (`is_alive`, ``join``, ``exitcode``, or multiprocessing's clean-up of finished children that
    every ``Process.start`` runs): the reap is `_GroupPopen.poll`."""

    @staticmethod
    def _Popen(process_obj):
        return _GroupPopen(process_obj) if os.name == "posix" else SpawnProcess._Popen(process_obj)

    def run(self) -> None:
        try:
            os.setsid()
        except (AttributeError, OSError):  # not POSIX
            pass
        super().run()

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        if self._popen is None:  # never started
            return
        if os.name == "posix":
            self._popen.kill_group()
        else:
            super().kill()


def _exited(pid: int, block: bool) -> bool:
    """Whether child ``pid`` has exited (waiting for it if ``block``), without reaping it."""
    if not hasattr(os, "waitid"):  # e.g. macOS: no group kill for a process that ended by itself
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)) is not None
    except ChildProcessError:  # already reaped
        return False


if os.name == "posix":  # multiprocessing.popen_fork does not import elsewhere
    from multiprocessing import popen_spawn_posix

    class _GroupPopen(popen_spawn_posix.Popen):
        """``spawn``'s Popen for a `GroupProcess`. Its group is killed only while the process is
        unreaped (its pid, so its group id, cannot have been reused), under one lock with the reap."""

        def __init__(self, process_obj) -> None:
            self._reaping = threading.RLock()
            super().__init__(process_obj)

        def poll(self, flag: int = os.WNOHANG):
            if flag != os.WNOHANG and self.returncode is None:  # a blocking reap: wait outside the lock
                if not _exited(self.pid, block=True):
                    return super().poll(flag)  # no os.waitid, or reaped meanwhile
                flag = os.WNOHANG
            with self._reaping:
                if self.returncode is None and _exited(self.pid, block=False):  # ended by itself:
                    self.kill_group()                                           # what it started goes too
                return super().poll(flag)

        def kill_group(self) -> None:
            """SIGKILL to it and every process of its session (to it alone before its ``setsid``)."""
            with self._reaping:
                if self.returncode is not None:  # reaped
                    return
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):  # before its setsid
                    self._send_signal(signal.SIGKILL)


class GroupContext(SpawnContext):
    """``spawn``, with `GroupProcess` as its ``Process``."""

    Process = GroupProcess


_CONTEXT = GroupContext()


def worker_context() -> GroupContext:
    """The multiprocessing context for processes that run reward code (module docstring)."""
    return _CONTEXT


_OWNER_PID: int | None = None


def ignore_sigterm() -> None:
    """In a pool worker: SIGTERM does nothing (the pool stops it with `GroupProcess.terminate`).
    A Python handler, not ``SIG_IGN``, so that programs the reward runs get the default back
    at ``exec``; a fork of the worker (a reward's own multiprocessing) keeps the default."""
    global _OWNER_PID
    _OWNER_PID = os.getpid()
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    if os.getpid() != _OWNER_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# ---------------------------------------------------------------------------------------
# Captured output
# ---------------------------------------------------------------------------------------


class OutputCapture:
    """File descriptors 1 and 2 of this process, from now on, into a private (unlinked) file;
    at most `OUTPUT_LIMIT_BYTES` may be written to any file (``RLIMIT_FSIZE``, POSIX)."""

    def __init__(self) -> None:
        fd, path = tempfile.mkstemp(prefix="cispo-reward-output-")
        os.close(fd)
        out = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._read, self._write = os.open(path, os.O_RDONLY), os.open(path, os.O_WRONLY)
        os.unlink(path)
        _flush()
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        try:
            import resource

            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            limit = OUTPUT_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(OUTPUT_LIMIT_BYTES, hard)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), no kill
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        except (ImportError, AttributeError, ValueError, OSError):  # not POSIX: no cap on file size
            pass

    def take(self) -> str:
        """The last `OUTPUT_TAIL_CHARS` written since the last `take`; the file is emptied."""
        _flush()
        size = os.fstat(self._read).st_size
        tail = os.pread(self._read, 4 * OUTPUT_TAIL_CHARS, max(0, size - 4 * OUTPUT_TAIL_CHARS))
        os.ftruncate(self._write, 0)
        return tail.decode("utf-8", "replace")[-OUTPUT_TAIL_CHARS:]


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


# ---------------------------------------------------------------------------------------
# Trial import
# ---------------------------------------------------------------------------------------


def trial_import(module: str, path: str | None = None) -> str | None:
    """Import ``module`` (from the file ``path`` if given, under the name ``module``) once in a
    throw-away `GroupProcess`, with this process's ``sys.path`` and working directory. None if
    the import came back (raising an ``Exception`` counts as coming back: the caller's own
    import reports it); else what happened, e.g. ``"exited with sys.exit(0)"``, ``"ended its
    process (exit status 0: os._exit, or exit() in C code)"``. The process and everything the
    import started are killed when it is done; its output is kept out of the trainer's."""
    recv, send = _CONTEXT.Pipe(duplex=False)
    proc = _CONTEXT.Process(target=_import_in_child, args=(module, path, list(sys.path), os.getcwd(), send),
                            name="cispo-reward-trial-import")
    proc.start()
    send.close()
    try:
        try:
            outcome, output = recv.recv()  # blocks until it reports, or EOF when it dies first
            died = None
        except EOFError:
            outcome, output, died = None, "", True
    finally:
        recv.close()
        proc.terminate()  # done (or dead): it and every process the import started
        proc.join()
    if died:
        code = proc.exitcode
        outcome = (f"was killed by {signal_name(-code)}" if code < 0 else
                   f"ended its process (exit status {code}: os._exit, or exit() in C code)")
    if outcome is not None and output.strip():
        outcome = f"{outcome}; its output (end): {output.strip()!r}"
    return outcome


def _import_in_child(module: str, path: str | None, sys_path: list, cwd: str, conn) -> None:
    """`trial_import`, in the throw-away process: ``(None or what went wrong, output tail)``."""
    sys.path[:] = sys_path
    os.chdir(cwd)
    capture = OutputCapture()
    outcome = None
    try:
        if path is None:
            importlib.import_module(module)
        else:
            spec = importlib.util.spec_from_file_location(module, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module] = mod
            spec.loader.exec_module(mod)
    except SystemExit as e:
        outcome = f"exited with sys.exit({cap_message(repr(e.code), 100, 100)})"
    except Exception:  # noqa: BLE001 - the caller's own import reports it, with its usual message
        pass
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt, GeneratorExit, ...
        outcome = f"raised {type(e).__name__}" + (f": {cap_message(str(e), 100, 100)}" if str(e) else "")
    conn.send((outcome, capture.take()))
    conn.close()


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15; ``"signal N"`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
