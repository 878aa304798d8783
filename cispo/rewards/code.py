"""Code reward: run model-written Python against tests in a sandbox (Linux only).

    >>> reward = make_code_reward(SandboxConfig(timeout_s=5))     # checks the sandbox once
    >>> reward("Write add.", "```python\\ndef add(a, b):\\n    return a + b\\n```",
    ...        tests=["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    1.0

Threat model
------------
The completion is untrusted code written by a policy that is being optimised to make the
reward go up. We assume it may, by accident or by reward hacking, loop forever, allocate
without bound, fork without bound, write or delete files, read secrets from the
environment or the disk, use the network, flood its output, or fake success
(``sys.exit(0)``, ``os._exit(0)``, printing a success marker). All of these are contained,
each by a kernel mechanism rather than by inspecting the code:

=====================  ==================================================================
limit                  enforced by
=====================  ==================================================================
wall clock             the parent's deadline; then SIGKILL to the sandbox's PID-namespace
                       init, which makes the kernel kill every process in the namespace
CPU time               ``RLIMIT_CPU`` (SIGXCPU at ``cpu_s``, SIGKILL one second later),
                       per process
memory                 ``RLIMIT_AS`` (address space) per process: allocations fail with
                       ``MemoryError``; the total is bounded by ``max_processes x memory_mb``
processes / threads    ``RLIMIT_NPROC`` on a dedicated unprivileged uid (root: the sandbox
                       drops to uid ``uid + slot``; a uid is never shared by two concurrent
                       runs); a new PID namespace, so nothing outlives the run
files                  a new mount namespace in which the whole file system is re-mounted
                       read-only and ``nosuid`` (the host's mounts are untouched);
                       ``/tmp`` (also seen at ``/var/tmp`` and ``/dev/shm``) is a fresh
                       private ``tmpfs`` of ``tmp_mb`` MiB that is the working directory
                       and dies with the run; ``RLIMIT_FSIZE`` caps
                       each file; a fresh ``/proc`` shows only the sandbox's processes
network                a new, empty network namespace (``network="none"``): no interface is
                       up, not even loopback, so neither the host's services on 127.0.0.1
                       nor the outside can be reached. If it cannot be created the sandbox
                       refuses to run (``SandboxUnavailable``)
environment            the program gets only ``PATH``, ``LANG``, ``HOME``, ``TMPDIR``;
                       Python runs with ``-I -S`` (no ``PYTHON*`` variables, no user or site
                       packages, script directory not on ``sys.path``); stdin is
                       ``/dev/null``
output                 stdout and stderr are read incrementally; past ``max_output_bytes``
                       the run is killed (``killed_reason="output_limit"``) and the kept
                       output is the first ``max_output_bytes`` bytes
privileges             ``PR_SET_NO_NEW_PRIVS`` (set-uid binaries such as ``su`` gain
                       nothing), supplementary groups dropped
faked success          see "The test harness" below: exiting early (``sys.exit(0)``,
                       ``os._exit(0)``), printing or writing a fake success line, patching
                       ``builtins.exec`` or ``sys.stdout`` cannot produce a verified pass
=====================  ==================================================================

The test harness (`run_tests`, the rewards)
-------------------------------------------
The parent draws a random 128-bit nonce per call and passes it on an inherited pipe. The
harness reads it, closes the pipe, computes for every possible outcome ``k`` of ``n`` test
cases the line ``"k n HMAC-SHA256(nonce, 'k n')"``, and forgets the nonce — all before the
solution's code exists in the process. The solution and then each test case run in a worker
thread (``_thread``, so no ``Thread`` object exposes its arguments); the main thread, whose
frame holds the precomputed lines, waits on a lock and afterwards only calls C functions
(flush, ``os.write`` to a dedicated result pipe, ``os._exit``), so no code of the solution
— no signal handler (only the main thread may install one; SIGINT is ignored so
``_thread.interrupt_main`` does nothing) and no finalizer — ever runs on that stack. The
parent accepts the count only from a line whose HMAC verifies and only if the process
exited 0 within the limits. Capturing the harness's own line (e.g. by ``dup2``-ing over the
result pipe) yields a line for the true count only. Every exception, ``SystemExit``
included, fails the case that raised it (or all cases, if raised while loading the
solution). The solution's builtins and functions are captured before it runs.

How a run works: the trainer spawns a small launcher (its own Python, ``-I -S``) in a new
session. The launcher unshares mount, PID (and network) namespaces — as root directly, as
an ordinary user inside a new user namespace — and forks the namespace's init, which
mounts the private ``/tmp`` and ``/proc``, makes ``/`` read-only, copies the files in and
forks the program: that child sets the rlimits, drops to the sandbox uid (root only), sets
no-new-privs and ``exec``s the interpreter. The trainer reads the output, enforces the
deadline and the output cap, and at the end *always* SIGKILLs the init (through a pidfd)
and the launcher's process group, then waits until the init is gone — the kernel has then
killed every process of the run, including daemons that called ``setsid``. The staging
directory is removed. No ``preexec_fn`` is used, so calling the reward from threads is safe.

Not contained / out of scope
----------------------------
* This is **not a security boundary against a determined attacker**: a kernel exploit
  (a 0-day in any reachable system call), CPU side channels (Spectre-class), timing and
  resource-usage covert channels, and denial of service through shared kernel resources
  are out of scope. No seccomp filter is installed. For hostile code use a VM-grade
  sandbox (gVisor, Firecracker, Kata) and keep this module as the inner layer.
* Reading the file system: it is read-only, not hidden. As root, anything world-readable on
  the host (the repository, ``/etc``) can be read by the sandbox uid; root-only files cannot.
  As an ordinary user the program runs as that user and can read what the user can (e.g.
  ``~/.ssh``): list such directories in ``SandboxConfig.hide_paths``.
* Memory is limited per process (``RLIMIT_AS``), not in total (that needs cgroups); the
  private ``/tmp`` tmpfs uses up to ``tmp_mb`` MiB of RAM.
* Verdict forgery by introspection: the tests run in the same interpreter as the solution
  (they must call its functions), so the worker thread's own state (the pass counter) is
  protected only by an audit hook installed before the solution runs: it refuses
  ``sys._getframe`` / ``inspect.currentframe`` (except from ``namedtuple``, ``typing`` and
  ``enum``, which only read a module name), ``tb_frame`` / ``gi_frame`` / ``cr_frame`` /
  ``ag_frame``, ``gc.get_objects`` / ``get_referrers`` / ``get_referents``,
  ``sys._current_frames``, ``sys.settrace`` / ``setprofile``, ``ctypes``, opening
  ``/proc/*/mem``, ``os.symlink`` and new audit hooks; the harness is non-dumpable (no
  ``ptrace`` or ``/proc/<pid>/mem`` by other processes). Audit hooks are not a sandbox
  (CPython documents them as such): an interpreter bug or an overlooked introspection
  path would let a solution forge its count; the worst case is a wrong reward, still inside
  the process sandbox. Legitimate code that uses these features (``traceback.print_exc``,
  ``inspect.currentframe``, ``signal`` handlers — the solution runs outside the main
  thread) fails; ``logging`` works, without the caller's file and line.
* The tests themselves can be gamed: an object whose ``__eq__`` always returns True passes
  ``assert f(x) == y``. Write tests that check types (``assert type(r) is int and r == 3``)
  and monitor rewarded completions.
* In ``network="allow"`` mode the program has the host's network, as the sandbox uid.

Platform: Linux with namespaces (kernel >= 5.3 for pidfds; ``mount_setattr``, 5.12+, is
used when present). As root the sandbox needs ``CAP_SYS_ADMIN`` (not available inside many
containers); as an ordinary user it needs unprivileged user namespaces
(``kernel.unprivileged_userns_clone=1`` / ``user.max_user_namespaces > 0``). As root the
sandbox user must be able to execute the interpreter: if ``sys.executable`` lives under a
private directory (e.g. ``/root/.pyenv``), ``/usr/bin/python3`` is used (set ``python=``).
"""

from __future__ import annotations

import fcntl
import functools
import hmac
import json
import logging
import os
import re
import secrets
import select
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

__all__ = [
    "SandboxConfig",
    "SandboxResult",
    "SandboxError",
    "SandboxUnavailable",
    "TestReport",
    "CodeReward",
    "check_sandbox",
    "run_sandboxed",
    "run_tests",
    "extract_code",
    "code_reward",
    "code_reward_partial",
    "make_code_reward",
]

log = logging.getLogger(__name__)


class SandboxError(RuntimeError):
    """The sandbox could not run the program (set-up failure, not a failure of the program)."""


class SandboxUnavailable(SandboxError):
    """The isolation the configuration asks for cannot be created on this machine."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run. Frozen (hashable): the availability check is cached per config."""

    timeout_s: float = 5.0
    """Wall-clock limit of the whole run, interpreter start-up included; then SIGKILL."""
    cpu_s: int = 5
    """``RLIMIT_CPU`` per process, in seconds: SIGXCPU at ``cpu_s``, SIGKILL at ``cpu_s + 1``."""
    memory_mb: int = 512
    """``RLIMIT_AS`` (virtual address space) per process, in MiB."""
    max_processes: int = 64
    """``RLIMIT_NPROC``: processes plus threads of the sandbox uid (the harness counts as two:
    main and worker thread; as an ordinary user the launcher and the namespace init count too)."""
    max_output_bytes: int = 64_000
    """Cap on stdout and on stderr (each); past it the run is killed and the output truncated."""
    max_file_mb: int = 16
    """``RLIMIT_FSIZE``: largest file the program may write, in MiB."""
    tmp_mb: int = 64
    """Size of the private ``tmpfs`` mounted on ``/tmp`` (the working directory), in MiB."""
    network: Literal["none", "allow"] = "none"
    """``"none"``: a new, empty network namespace, or refuse to run. ``"allow"``: host network."""
    python: str | None = None
    """Interpreter for the program. None: ``sys.executable`` when the sandbox uid can execute
    it (and read its standard library), else ``/usr/bin/python3``."""
    hide_paths: tuple[str, ...] = ()
    """Directories covered by an empty read-only ``tmpfs`` inside the sandbox (e.g. ``("/home",)``
    or ``(os.path.expanduser("~/.ssh"),)``). Not needed for root-only files when running as root;
    as an ordinary user the program runs as that user and can read what the user can."""
    uid: int = 61234
    """First uid (and gid) of the range the sandbox drops to when running as root; pick a
    range no account uses. Unused when not root (the user namespace maps the caller's uid)."""
    uid_slots: int = 64
    """Size of that range: how many runs may execute at the same time (each has its own uid)."""

    def __post_init__(self):
        if self.network not in ("none", "allow"):
            raise ValueError(f"network must be 'none' or 'allow', got {self.network!r}")
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_processes", "max_output_bytes",
                     "max_file_mb", "tmp_mb", "uid_slots"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not all(isinstance(p, str) and p.startswith("/") for p in self.hide_paths):
            raise ValueError(f"hide_paths must be absolute paths, got {self.hide_paths!r}")
        if not 0 < self.uid < 2**31 - self.uid_slots:
            raise ValueError(f"SandboxConfig.uid out of range: {self.uid}")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did."""

    returncode: int | None
    """The program's exit status (negative: killed by that signal); None when the sandbox
    killed it first (timeout, output limit)."""
    stdout: str
    """Standard output, decoded (UTF-8, errors replaced), at most ``max_output_bytes`` bytes."""
    stderr: str
    """Standard error, likewise."""
    timed_out: bool
    """The wall-clock limit was reached."""
    killed_reason: str | None
    """None if the program ended on its own, else ``"timeout"``, ``"output_limit"``,
    ``"cpu_limit"`` (SIGXCPU), ``"file_size_limit"`` (SIGXFSZ) or ``"signal:<NAME>"``."""
    wall_s: float
    """Seconds from spawning the sandbox to its complete tear-down."""
    truncated: bool = False
    """stdout or stderr was cut at ``max_output_bytes``."""

    @property
    def ok(self) -> bool:
        """Exited with status 0 within every limit."""
        return self.returncode == 0 and self.killed_reason is None


@dataclass(frozen=True)
class TestReport:
    """Outcome of `run_tests`."""

    __test__ = False  # not a pytest test class

    passed: int
    """Test cases that ran without raising."""
    total: int
    """Test cases given."""
    verified: bool
    """The harness's nonce line was found and the process exited 0 within the limits: only
    then are ``passed`` / ``total`` trusted (otherwise ``passed`` is 0)."""
    result: SandboxResult

    @property
    def all_passed(self) -> bool:
        return self.verified and self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.verified and self.total else 0.0


# --------------------------------------------------------------------------------------
# Programs that run inside the sandbox (kept as source: stdlib only, run with -I -S).
# --------------------------------------------------------------------------------------

# The launcher: unshare namespaces, fork the namespace init, which prepares the mounts and
# forks the program (rlimits, drop privileges, no-new-privs, exec). Reports on a status pipe:
#   P<init pid>   (then waits for one byte on the ack pipe, so the pid cannot be recycled
#                  before the parent holds a pidfd on it)
#   S<wait status of the program>
#   E<stage> <message>   (set-up failure)
_LAUNCHER = r'''
import ctypes, errno, json, os, resource

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 442, -100, 0x8000, 1, 2

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.syscall.restype = ctypes.c_long


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def enc(s):
    return None if s is None else s.encode()


def mount(source, target, fstype, flags, data=None):
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), "mount %s" % target)


with open("spec.json", encoding="utf-8") as f:
    spec = json.load(f)
STATUS, ACK = spec["status_fd"], spec["ack_fd"]
os.set_inheritable(STATUS, False)
os.set_inheritable(ACK, False)


def report(msg):
    try:
        os.write(STATUS, msg)
    except OSError:
        pass


def fail(stage, exc):
    report(("E%s %s: %s\n" % (stage, type(exc).__name__, str(exc).replace("\n", " "))).encode())
    os._exit(125)


def make_readonly():
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    ret = libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_long(AT_FDCWD), ctypes.c_char_p(b"/"),
                       ctypes.c_ulong(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    if ret != 0:
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, "mount_setattr: " + os.strerror(err))
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            entries = [line.split() for line in f]
        for fields in entries:
            target = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            options = fields[5].split(",")
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
            for name, bit in (("nodev", MS_NODEV), ("noexec", MS_NOEXEC), ("noatime", MS_NOATIME),
                              ("nodiratime", MS_NODIRATIME), ("relatime", MS_RELATIME)):
                if name in options:
                    flags |= bit
            libc.mount(None, target.encode(), None, flags, None)
    if not os.statvfs("/").f_flag & os.ST_RDONLY:
        raise OSError("could not make / read-only")


def program():
    try:
        for name, soft, hard in spec["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if spec["drop_to"] is not None:
            uid, gid = spec["drop_to"]
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:
        fail("exec", exc)


def init(files):
    try:
        check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PDEATHSIG)")
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, spec["tmpfs_options"])
        writable = ["/tmp"]
        for extra in ("/var/tmp", "/dev/shm"):
            if os.path.isdir(extra) and not os.path.islink(extra):
                mount("/tmp", extra, None, MS_BIND)
                writable.append(extra)
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        for path in spec["hide_paths"]:
            if os.path.isdir(path) and not os.path.islink(path):
                mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=1,mode=0555")
        make_readonly()
        for path in writable:
            mount(None, path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)
        os.chdir("/tmp")
        for name, data in files.items():
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.close(fd)
    except BaseException as exc:
        fail("mount", exc)
    pid = os.fork()
    if pid == 0:
        program()
    for fd in spec["program_fds"]:
        os.close(fd)
    while True:
        try:
            child, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        if child == pid:
            report(b"S%d\n" % status)
            os._exit(0)


try:
    check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PDEATHSIG)")
    flags = CLONE_NEWNS | CLONE_NEWPID | (CLONE_NEWNET if spec["netns"] else 0)
    if os.geteuid() == 0:
        check(libc.unshare(flags), "unshare")
    else:
        uid, gid = os.getuid(), os.getgid()
        check(libc.unshare(flags | CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", "%d %d 1" % (uid, uid)),
                           ("/proc/self/gid_map", "%d %d 1" % (gid, gid))):
            with open(path, "w") as f:
                f.write(text)
except BaseException as exc:
    fail("unshare", exc)

files = {}
for name in spec["files"]:
    with open(name, "rb") as f:
        files[name] = f.read()
pid = os.fork()
if pid == 0:
    init(files)
report(b"P%d\n" % pid)
os.read(ACK, 1)
os.close(ACK)
os.waitpid(pid, 0)
os._exit(0)
'''

# The test harness (run as the sandbox uid). argv: nonce fd, result fd. See `run_tests`.
_HARNESS = r'''
import os, sys


def _harden():
    import collections, enum, logging, typing, _thread
    logging._srcfile = None  # log records without caller lookup (it needs frames, refused below)
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0: no ptrace, no /proc/<pid>/mem by others
    except Exception:
        pass
    for name in list(sys.modules):
        if name in ("ctypes", "_ctypes") or name.startswith("ctypes."):
            del sys.modules[name]
    # Code objects allowed to call sys._getframe (they only read the caller's module name).
    allowed = set()
    for fn in (getattr(collections, "namedtuple", None), getattr(typing, "_caller", None),
               getattr(getattr(enum, "EnumType", None), "_create_", None)):
        code = getattr(fn, "__code__", None)
        if code is not None:
            allowed.add(code)
    denied = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                        "sys._current_exceptions", "sys.settrace", "sys.setprofile", "sys.addaudithook",
                        "os.symlink"})
    denied_imports = frozenset({"ctypes", "_ctypes", "_testcapi", "_testinternalcapi", "_xxsubinterpreters"})
    frame_attrs = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
    busy = set()
    get_ident, getframe, basename, fsdecode = _thread.get_ident, sys._getframe, os.path.basename, os.fsdecode

    def hook(event, args):
        if event in denied or event.startswith("ctypes."):
            raise RuntimeError("%s is not allowed in the sandbox" % event)
        if event == "object.__getattr__" and args[1] in frame_attrs:
            raise RuntimeError("frame access (%s) is not allowed in the sandbox" % args[1])
        if event == "import" and args[0] in denied_imports:
            raise RuntimeError("importing %s is not allowed in the sandbox" % args[0])
        if event == "open" and isinstance(args[0], (str, bytes)) and basename(fsdecode(args[0])) == "mem":
            raise RuntimeError("opening %r is not allowed in the sandbox" % (args[0],))
        if event == "sys._getframe":
            tid = get_ident()
            if tid in busy:
                return
            busy.add(tid)
            try:
                caller = getframe(1).f_code
            finally:
                busy.discard(tid)
            if caller not in allowed:
                raise RuntimeError("sys._getframe is not allowed in the sandbox")

    sys.addaudithook(hook)


def _runner(source, compiled, box, done, exec_, compile_, excepthook, exc_info, base_exception):
    # Runs in a worker thread: the solution never runs on the main thread, whose frame holds
    # the markers, and cannot install signal handlers (main thread only).
    passed = 0
    try:
        ns = {"__name__": "solution", "__builtins__": __builtins__}
        try:
            exec_(compile_(source, "solution.py", "exec"), ns)
            loaded = True
        except base_exception:
            loaded = False
            try:
                excepthook(*exc_info())
            except base_exception:
                pass
        if loaded:
            for code in compiled:
                if code is None:
                    continue
                try:
                    exec_(code, ns)
                except base_exception:
                    try:
                        excepthook(*exc_info())
                    except base_exception:
                        pass
                else:
                    passed += 1
    finally:
        box[0] = passed
        done.release()


def _main():
    import builtins, hmac, json, signal, _thread
    nonce_fd, result_fd = int(sys.argv[1]), int(sys.argv[2])
    nonce = b""
    while True:
        chunk = os.read(nonce_fd, 4096)
        if not chunk:
            break
        nonce += chunk
    os.close(nonce_fd)
    with open("tests.json", encoding="utf-8") as f:
        tests = json.load(f)
    with open("solution.py", "rb") as f:
        source = f.read()
    total = len(tests)
    # One authenticated line per possible outcome; the nonce itself is never written anywhere.
    markers = tuple(b"%d %d %s\n" % (k, total, hmac.new(nonce, b"%d %d" % (k, total), "sha256").hexdigest().encode())
                    for k in range(total + 1))
    del nonce
    write, exit_ = os.write, os._exit
    flush_out, flush_err = sys.stdout.flush, sys.stderr.flush
    compiled = []
    for i, test in enumerate(tests):
        try:
            compiled.append(builtins.compile(test, "<test %d>" % i, "exec"))
        except BaseException:
            compiled.append(None)
            sys.__excepthook__(*sys.exc_info())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # _thread.interrupt_main() then does nothing
    _harden()
    box, done = [0], _thread.allocate_lock()
    done.acquire()
    _thread.start_new_thread(_runner, (source, compiled, box, done, builtins.exec, builtins.compile,
                                       sys.__excepthook__, sys.exc_info, BaseException))
    del source, compiled
    # From here the main thread only calls C functions: no Python code of the solution can
    # run on this stack (no signal handlers, no finalizers).
    done.acquire()
    flush_out()
    flush_err()
    write(result_fd, markers[box[0]])
    exit_(0)


_main()
'''

# --------------------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------------------

_PROGRAM_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp", "TMPDIR": "/tmp"}
_LAUNCHER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
_STATUS_CAP = 1 << 16
_RESULT_CAP = 1 << 16
_TEARDOWN_S = 5.0


def _require_linux() -> None:
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the code sandbox needs Linux namespaces; this is {sys.platform}")


def _world_accessible(path: str, want_read: bool = False) -> bool:
    """Can an unrelated unprivileged user reach (and execute or read) ``path``?"""
    real = os.path.realpath(path)
    try:
        parts = real.split("/")
        for i in range(1, len(parts)):
            ancestor = "/".join(parts[:i]) or "/"
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                return False
        mode = os.stat(real).st_mode
    except OSError:
        return False
    return bool(mode & stat.S_IXOTH) and (not want_read or bool(mode & stat.S_IROTH))


@functools.lru_cache(maxsize=None)
def _sandbox_python(configured: str | None, as_root: bool) -> str:
    if configured:
        return configured
    if not as_root:
        return sys.executable
    stdlib = os.path.dirname(os.__file__)
    if sys.executable and _world_accessible(sys.executable) and _world_accessible(stdlib, want_read=True):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _world_accessible(candidate):
            return candidate
    raise SandboxUnavailable(
        f"the unprivileged sandbox user cannot execute {sys.executable} (or read {stdlib}) and no "
        "system python3 was found; set SandboxConfig.python to an interpreter readable by everyone")


class _UidSlot:
    """An exclusive uid from ``[cfg.uid, cfg.uid + cfg.uid_slots)``: an ``flock`` on a lock file
    in a root-only directory, so concurrent runs (threads or processes) never share a uid."""

    def __init__(self, cfg: SandboxConfig):
        directory = "/run/cispo-sandbox" if os.access("/run", os.W_OK) else os.path.join(
            tempfile.gettempdir(), f"cispo-sandbox-locks-{os.geteuid()}")
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise SandboxError(f"lock directory {directory} is not a private directory of this user")
        deadline = time.monotonic() + max(cfg.timeout_s, 10.0)
        start = secrets.randbelow(cfg.uid_slots)
        while True:
            for k in range(cfg.uid_slots):
                uid = cfg.uid + (start + k) % cfg.uid_slots
                fd = os.open(os.path.join(directory, f"uid-{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.uid, self._fd = uid, fd
                return
            if time.monotonic() > deadline:
                raise SandboxError(f"all {cfg.uid_slots} sandbox uids are busy")
            time.sleep(0.02)

    def release(self) -> None:
        os.close(self._fd)  # closing the descriptor drops the flock


def _kill_uid(uid: int) -> None:
    """Last resort: ``kill(-1, SIGKILL)`` as ``uid`` kills every process of that uid at once."""
    code = f"import os; os.setgroups([]); os.setgid({uid}); os.setuid({uid}); os.kill(-1, 9)"
    try:
        subprocess.run([sys.executable, "-I", "-S", "-c", code], env=_LAUNCHER_ENV, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False)
    except Exception:  # pragma: no cover - best effort
        log.exception("could not sweep processes of uid %d", uid)


def _killed_reason(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    sig = -returncode
    if sig == signal.SIGXCPU:
        return "cpu_limit"
    if sig == signal.SIGXFSZ:
        return "file_size_limit"
    try:
        return f"signal:{signal.Signals(sig).name}"
    except ValueError:
        return f"signal:{sig}"


def _execute(cfg: SandboxConfig, files: dict[str, bytes], script: str,
             nonce: bytes | None = None) -> tuple[SandboxResult, bytes]:
    """Run ``python -I -S <script> [nonce_fd result_fd]`` in the sandbox with ``files`` in its
    working directory. Returns the result and the bytes written to the result pipe."""
    _require_linux()
    as_root = os.geteuid() == 0
    python = _sandbox_python(cfg.python, as_root)
    start = time.monotonic()  # re-set at spawn: waiting for a free uid does not count
    staging = tempfile.mkdtemp(prefix="cispo-sandbox-")
    slot: _UidSlot | None = None
    proc: subprocess.Popen | None = None
    pidfd: int | None = None
    init_pid: int | None = None
    fds: list[int] = []  # parent-side descriptors to close at the end

    def pipe() -> tuple[int, int]:
        r, w = os.pipe()
        fds.extend((r, w))
        return r, w

    def close(fd: int) -> None:
        if fd in fds:
            fds.remove(fd)
            os.close(fd)

    bufs = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray(), "result": bytearray()}
    timed_out = truncated = False
    killed: str | None = None
    returncode: int | None = None
    setup_error: str | None = None

    def kill() -> None:
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc is not None and proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    try:
        if as_root:
            slot = _UidSlot(cfg)
        status_r, status_w = pipe()
        ack_r, ack_w = pipe()
        child_fds = [status_w, ack_r]
        program_fds: list[int] = []
        argv = [python, "-I", "-S", script]
        result_r = None
        if nonce is not None:
            nonce_r, nonce_w = pipe()
            result_r, result_w = pipe()
            os.write(nonce_w, nonce)
            close(nonce_w)
            program_fds = [nonce_r, result_w]
            argv += [str(nonce_r), str(result_w)]
        mib = 1 << 20
        rlimits = [
            ("RLIMIT_AS", cfg.memory_mb * mib, cfg.memory_mb * mib),
            ("RLIMIT_CPU", cfg.cpu_s, cfg.cpu_s + 1),
            ("RLIMIT_FSIZE", cfg.max_file_mb * mib, cfg.max_file_mb * mib),
            ("RLIMIT_CORE", 0, 0),
            ("RLIMIT_NOFILE", 256, 256),
            ("RLIMIT_NPROC", cfg.max_processes, cfg.max_processes),
        ]
        uid, gid = (slot.uid, slot.uid) if slot else (os.getuid(), os.getgid())
        spec = {
            "status_fd": status_w,
            "ack_fd": ack_r,
            "program_fds": program_fds,
            "netns": cfg.network == "none",
            "tmpfs_options": f"size={cfg.tmp_mb}m,nr_inodes=4096,mode=0700,uid={uid},gid={gid}",
            "rlimits": rlimits,
            "drop_to": [uid, gid] if slot else None,
            "argv": argv,
            "env": _PROGRAM_ENV,
            "files": sorted(files),
            "hide_paths": list(cfg.hide_paths),
        }
        for name, data in {**files, "spec.json": json.dumps(spec).encode()}.items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"bad sandbox file name {name!r}")
            with open(os.path.join(staging, name), "wb") as f:
                f.write(data)

        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER], cwd=staging, env=_LAUNCHER_ENV,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=child_fds + program_fds, start_new_session=True, close_fds=True)
        for fd in child_fds + program_fds:
            close(fd)

        streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_r: "status"}
        if result_r is not None:
            streams[result_r] = "result"
        caps = {"stdout": cfg.max_output_bytes, "stderr": cfg.max_output_bytes,
                "status": _STATUS_CAP, "result": _RESULT_CAP}
        deadline = start + cfg.timeout_s
        grace_end: float | None = None  # after a kill: how long to wait for the pipes to close
        status_seen = 0
        with selectors.DefaultSelector() as sel:
            for fd in streams:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                now = time.monotonic()
                if killed is None and now >= deadline:
                    timed_out, killed = True, "timeout"
                    kill()
                    grace_end = now + _TEARDOWN_S
                if grace_end is not None and now >= grace_end:
                    break
                wait = (grace_end if grace_end is not None else deadline) - now
                for key, _ in sel.select(timeout=max(0.0, min(wait, 1.0))):
                    try:
                        data = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    name = streams[key.fd]
                    buf = bufs[name]
                    room = caps[name] - len(buf)
                    buf += data[: max(room, 0)]
                    if len(data) > room and killed is None:
                        truncated = truncated or name in ("stdout", "stderr")
                        killed = "output_limit"
                        kill()
                        grace_end = time.monotonic() + _TEARDOWN_S
                    if name == "status":
                        *lines, _ = bytes(bufs["status"][status_seen:]).split(b"\n")
                        for line in lines:
                            status_seen += len(line) + 1
                            tag, body = line[:1], line[1:].decode("utf-8", "replace")
                            if tag == b"P" and init_pid is None:
                                init_pid = int(body)
                                try:
                                    pidfd = os.pidfd_open(init_pid)
                                except (AttributeError, OSError):
                                    pidfd = None
                                if killed is not None:
                                    kill()
                                try:
                                    os.write(ack_w, b"k")
                                except OSError:
                                    pass
                                close(ack_w)
                            elif tag == b"S":
                                returncode = os.waitstatus_to_exitcode(int(body))
                            elif tag == b"E" and setup_error is None:
                                setup_error = body
    finally:
        kill()  # always: nothing of the run survives it
        for fd in list(fds):
            close(fd)
        if proc is not None:
            for stream in (proc.stdout, proc.stderr):
                stream.close()
            try:
                proc.wait(timeout=_TEARDOWN_S)
            except subprocess.TimeoutExpired:  # pragma: no cover - the launcher ignores nothing
                proc.kill()
                proc.wait()
        gone = False
        if pidfd is not None:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            gone = bool(poller.poll(_TEARDOWN_S * 1000))
            os.close(pidfd)
        if not gone and init_pid is not None:
            if pidfd is not None:
                log.warning("sandbox init %d did not exit in %.0f s", init_pid, _TEARDOWN_S)
            if slot is not None:  # no pidfd (old kernel) or a stuck init: kill the uid's processes
                _kill_uid(slot.uid)
        if slot is not None:
            slot.release()
        shutil.rmtree(staging, ignore_errors=True)

    if setup_error is not None:
        stage = setup_error.split(" ", 1)[0]
        cls = SandboxUnavailable if stage in ("unshare", "mount") else SandboxError
        raise cls(f"sandbox set-up failed at {setup_error}")
    if killed is None and returncode is None:
        stderr_tail = bytes(bufs["stderr"][-500:]).decode("utf-8", "replace")
        raise SandboxError(f"the sandbox ended without reporting the program's status: {stderr_tail}")
    result = SandboxResult(
        returncode=returncode,
        stdout=bytes(bufs["stdout"]).decode("utf-8", "replace"),
        stderr=bytes(bufs["stderr"]).decode("utf-8", "replace"),
        timed_out=timed_out,
        killed_reason=killed or _killed_reason(returncode),
        wall_s=time.monotonic() - start,
        truncated=truncated,
    )
    return result, bytes(bufs["result"])


def run_sandboxed(code: str, cfg: SandboxConfig | None = None) -> SandboxResult:
    """Run the Python program ``code`` in a fresh sandbox (see the module docstring).

    Raises `SandboxUnavailable` if the isolation cannot be created, `SandboxError` on other
    set-up failures; whatever the program does is reported in the result, never raised.
    """
    cfg = cfg or SandboxConfig()
    return _execute(cfg, {"main.py": code.encode("utf-8", "surrogatepass")}, "main.py")[0]


_checked: set[SandboxConfig] = set()
_checked_lock = threading.Lock()


def check_sandbox(cfg: SandboxConfig | None = None) -> None:
    """Raise `SandboxUnavailable` (with the reason) unless ``cfg``'s sandbox works here.

    Runs a trivial program once per config (cached). `make_code_reward` calls it.
    """
    cfg = cfg or SandboxConfig()
    with _checked_lock:
        if cfg in _checked:
            return
    _require_linux()
    if os.geteuid() == 0:
        import pwd

        taken = []
        for uid in range(cfg.uid, cfg.uid + cfg.uid_slots):
            try:
                taken.append(f"{uid} ({pwd.getpwuid(uid).pw_name})")
            except KeyError:
                pass
        if taken:
            log.warning("sandbox uids in use by accounts: %s; their processes would share the "
                        "sandbox's process limit and could be killed by its fallback clean-up. Choose another "
                        "SandboxConfig.uid range.", ", ".join(taken))
    probe = "import sys\nprint('sandbox-ok', sys.version_info[0])\n"
    try:
        result = run_sandboxed(probe, cfg)
    except SandboxUnavailable:
        raise
    except Exception as exc:
        raise SandboxUnavailable(f"the code sandbox does not work here: {exc}") from exc
    if not (result.ok and result.stdout.startswith("sandbox-ok 3")):
        raise SandboxUnavailable(
            f"the code sandbox does not work here: returncode={result.returncode}, "
            f"killed={result.killed_reason}, stderr={result.stderr[-500:]!r}")
    with _checked_lock:
        _checked.add(cfg)


def _normalize_tests(tests: str | Sequence[str] | None) -> list[str]:
    if tests is None:
        raise ValueError("code_reward needs the tests (a string of assert statements or a list of them)")
    if isinstance(tests, str):
        tests = [tests]
    tests = [str(t) for t in tests]
    if not tests:
        raise ValueError("code_reward got an empty list of tests")
    return tests


def run_tests(code: str, tests: str | Sequence[str], cfg: SandboxConfig | None = None) -> TestReport:
    """Run ``code``, then each test case (a string of statements, usually asserts) in the same
    namespace, in the sandbox. A case passes if it runs without raising. A string ``tests`` is
    one case; a list is one case per element.

    The solution runs as module ``solution`` (``if __name__ == "__main__":`` blocks are
    skipped). The counts are trusted only from the harness's nonce line (see the module
    docstring); any sandbox failure gives ``verified=False``.
    """
    cfg = cfg or SandboxConfig()
    cases = _normalize_tests(tests)
    nonce = secrets.token_hex(16).encode()
    files = {
        "solution.py": code.encode("utf-8", "surrogatepass"),
        "tests.json": json.dumps(cases).encode(),
        "harness.py": _HARNESS.encode(),
    }
    result, channel = _execute(cfg, files, "harness.py", nonce=nonce)
    passed, verified = 0, False
    if result.ok:
        for match in re.finditer(rb"^(\d+) (\d+) ([0-9a-f]{64})$", channel, re.M):
            k, total = int(match.group(1)), int(match.group(2))
            expected = hmac.new(nonce, b"%d %d" % (k, total), "sha256").hexdigest().encode()
            if total == len(cases) and k <= total and hmac.compare_digest(expected, match.group(3)):
                passed, verified = k, True
                break
    return TestReport(passed=passed, total=len(cases), verified=verified, result=result)


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(completion: str) -> str:
    """The code of a completion: the last fenced block tagged ``python``/``py``/``python3``,
    else the last untagged fenced block, else the whole text. An unterminated last fence
    (a truncated answer) counts, up to the end of the text."""
    python_blocks, plain_blocks = [], []
    for match in _FENCE.finditer(completion):
        tag = match.group(1).lower()
        if tag in ("python", "py", "python3"):
            python_blocks.append(match.group(2))
        elif not tag:
            plain_blocks.append(match.group(2))
    if python_blocks:
        return python_blocks[-1]
    if plain_blocks:
        return plain_blocks[-1]
    return completion


def _score(completion: str, tests, cfg: SandboxConfig | None, partial: bool) -> float:
    cfg = cfg or SandboxConfig()
    cases = _normalize_tests(tests)  # a data error: raised, not scored
    check_sandbox(cfg)  # once per config; SandboxUnavailable is raised, not scored
    try:
        report = run_tests(extract_code(completion), cases, cfg)
    except Exception:
        log.warning("code reward: sandbox failure, scoring 0.0", exc_info=True)
        return 0.0
    if partial:
        return report.fraction
    return 1.0 if report.all_passed else 0.0


def code_reward(prompt: str, completion: str, tests: str | Sequence[str] | None = None, *,
                config: SandboxConfig | None = None, **sample) -> float:
    """1.0 if the completion's code passes every test case in the sandbox, else 0.0.

    ``tests``: a string of statements (one case) or a list of cases, usually from the data
    set's ``tests`` field. ``config`` binds the sandbox limits (``functools.partial`` or
    `make_code_reward`). Every failure of the program or the sandbox scores 0.0 and is never
    raised into the trainer; only missing tests (``ValueError``) and an unusable sandbox
    (`SandboxUnavailable`, checked on the first call for each config) raise.
    """
    return _score(completion, tests, config, partial=False)


def code_reward_partial(prompt: str, completion: str, tests: str | Sequence[str] | None = None, *,
                        config: SandboxConfig | None = None, **sample) -> float:
    """The fraction of test cases that pass (pass ``tests`` as a list for partial credit)."""
    return _score(completion, tests, config, partial=True)


@dataclass(frozen=True)
class CodeReward:
    """A picklable reward ``(prompt, completion, **sample) -> float`` bound to a sandbox config.

    Reads the test cases from the sample field ``tests_key``. Build it with `make_code_reward`.
    """

    config: SandboxConfig = field(default_factory=SandboxConfig)
    partial: bool = False
    """Score the fraction of passing cases instead of all-or-nothing."""
    tests_key: str = "tests"

    def __call__(self, prompt: str, completion: str, **sample) -> float:
        return _score(completion, sample.get(self.tests_key), self.config, self.partial)


def make_code_reward(config: SandboxConfig | None = None, *, partial: bool = False,
                     tests_key: str = "tests") -> CodeReward:
    """A code reward bound to ``config``; raises `SandboxUnavailable` now if the sandbox
    cannot be created here (so a misconfigured machine fails at start-up, not as zero reward)."""
    config = config or SandboxConfig()
    check_sandbox(config)
    return CodeReward(config=config, partial=partial, tests_key=tests_key)
