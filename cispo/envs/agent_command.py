"""An agent program given as a command (``data.agent_command="python my_agent.py"``): its own process, any
language, one per episode.

The command line is split as a POSIX shell would split it (``shlex``), but runs without a shell (write
``sh -c '...'`` for pipes or variables), in the trainer's working folder, with the trainer's environment and:

* ``OPENAI_BASE_URL`` — the ``base_url`` of the episode's session on the endpoint (`cispo.envs.endpoint`),
  ``OPENAI_API_KEY`` — the endpoint's key: the official ``openai`` clients (Python, JavaScript) read both, so
  ``OpenAI()`` drives the policy unchanged; ``CISPO_SESSION_ID`` — the session's id;
* the sample, one JSON object, on its standard input.

What it prints on standard output is its result: the last non-empty line, a number, is the episode's reward;
nothing printed: no reward of its own (the task's reward scores the transcript); a last line that is not a
number: no reward, recorded (``agent.error``; write logs to standard error). A non-zero exit status or a
signal is a failed episode (recorded with the end of its standard error), never a crashed run.

Limits (set in the child before it runs the command, `limits`): it leads a session and process group of its
own, and its whole group is killed (SIGKILL) when its episode ends — the program returned, made no request
within ``data.agent_timeout_s``, or was still running when the sampler ended the episode and its time to
return ran out — and when the run ends; its address space is capped at ``data.agent_memory_mb``
(``RLIMIT_AS``; an allocation past it fails); on Linux it is killed when the trainer's process dies (even by
SIGKILL: ``PR_SET_PDEATHSIG``). Processes it starts in sessions of their own leave its group and are not
followed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass

from cispo.data.rewards.processes import signal_name
from cispo.envs.tools import ToolSpecError, limit_memory
from cispo.foundations.text import valid_text

__all__ = ["AgentCommand", "AgentProcess", "AgentCommandError", "reward_of_output", "OUTPUT_TAIL_BYTES"]

OUTPUT_TAIL_BYTES = 4096
"""How much of the end of a command's standard output (its result) and standard error (a failure's message)
is read."""


class AgentCommandError(Exception):
    """An episode's command failed: a non-zero exit, a signal, a result that is not a number."""


@dataclass(frozen=True)
class AgentCommand:
    """The command of ``data.agent_command``, split (``argv``), and the most address space each of its
    processes may take (``memory_bytes``; None: no cap)."""

    argv: tuple[str, ...]
    memory_bytes: int | None = None

    @classmethod
    def parse(cls, command: str, memory_mb: int = 0) -> AgentCommand:
        """``command`` split as a shell would; ToolSpecError, one line, where it is empty, cannot be split, or
        its program is found nowhere (on ``PATH``, or as a path)."""
        try:
            argv = tuple(shlex.split(command))
        except ValueError as e:
            raise ToolSpecError(f"data.agent_command {command!r} cannot be split into words: {e}") from None
        if not argv:
            raise ToolSpecError("data.agent_command is empty")
        if shutil.which(argv[0]) is None:
            raise ToolSpecError(f"data.agent_command {command!r}: no program {argv[0]!r} here (not on PATH, not "
                                f"an executable file)")
        return cls(argv, memory_mb << 20 if memory_mb else None)

    def describe(self) -> str:
        limit = f"{self.memory_bytes >> 20} MiB each" if self.memory_bytes else "no memory cap"
        return f"command {shlex.join(self.argv)!r} ({limit})"


def limits(memory_bytes: int | None) -> None:
    """In the child, before the command runs: its address space capped (`limit_memory`); killed when the
    thread that started it ends (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the trainer's rollout thread, so
    also when the trainer dies; nothing elsewhere). The session of its own comes from ``start_new_session``."""
    if memory_bytes:
        limit_memory(memory_bytes)
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _libc_prctl():
    """libc's ``prctl`` on Linux, loaded here in the parent: the child between fork and exec imports nothing."""
    if os.uname().sysname != "Linux":
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()
with contextlib.suppress(ImportError):  # imported here: the child's `limit_memory` then imports nothing
    import resource  # noqa: F401


def reward_of_output(stdout: str) -> float | None:
    """The reward a command printed: its last non-empty line as a finite number; None where it printed
    nothing; AgentCommandError where that line is not one."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        value = float(lines[-1])
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise AgentCommandError(f"its output's last line is not a finite number (the reward), but "
                                f"{lines[-1][:200]!r}: no reward (write logs to standard error)")
    return value


def _tail(f) -> str:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - OUTPUT_TAIL_BYTES))
    return valid_text(f.read().decode("utf-8", "replace"))


def _wait_unreaped(pid: int) -> None:
    """Wait until child ``pid`` has exited, leaving it unreaped (``waitid`` with ``WNOWAIT``; where there is no
    ``waitid``, return at once: the caller's reap waits)."""
    if hasattr(os, "waitid"):
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


class AgentProcess:
    """One episode's command, started at once (module docstring): `result` waits for its end, `kill` ends it
    and its process group."""

    def __init__(self, command: AgentCommand, sample: dict, base_url: str, api_key: str, session_id: str) -> None:
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "CISPO_SESSION_ID": session_id}
        self._lock = threading.Lock()
        self.killed = False  # by `kill`
        self.reaped = False
        with tempfile.TemporaryFile() as stdin:
            stdin.write(json.dumps(sample, default=str).encode())
            stdin.seek(0)
            self.stdout, self.stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            try:
                self.proc = subprocess.Popen(command.argv, stdin=stdin, stdout=self.stdout, stderr=self.stderr,
                                             env=env, start_new_session=True,
                                             preexec_fn=lambda: limits(command.memory_bytes))
            except BaseException:
                self.close()
                raise

    def result(self) -> float | None:
        """Wait for the command's end: its reward (`reward_of_output`); AgentCommandError where it failed.
        What it left running in its group is killed before it is reaped (its id cannot be another's yet)."""
        try:
            _wait_unreaped(self.proc.pid)
            with self._lock:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                code, self.reaped = self.proc.wait(), True
            if code != 0:
                how = f"killed by {signal_name(-code)}" if code < 0 else f"exit status {code}"
                if self.killed and code < 0:
                    how += " (its episode had ended)"
                err = _tail(self.stderr).strip()
                raise AgentCommandError(f"the agent command failed: {how}" + (f"; its standard error (end): {err}"
                                                                              if err else ""))
            return reward_of_output(_tail(self.stdout))
        finally:
            self.close()

    def kill(self) -> None:
        """SIGKILL to the command's process group (it leads it) unless it has been reaped."""
        with self._lock:
            if not self.reaped:
                self.killed = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        for f in (self.stdout, self.stderr):
            f.close()
