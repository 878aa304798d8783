"""The code sandbox against leaks: shadowed builtins, the tests' text, host
sockets, SysV IPC, child interpreters, the harness's memory, seccomp, the file-system view and the
refusals when bwrap or user namespaces are missing. Fixtures in tests/data/conftest.py."""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cispo.data.rewards.code import (
    SandboxConfig,
    SandboxUnavailable,
    make_code_reward,
    run_sandboxed,
    run_tests,
)
from tests.sandbox_helpers import ADD_TESTS, MEMORY_MB, REPO, config, program

# --------------------------------------------------------------------------- leaks of the verdict, the tests and the
# host


SHADOWING = {
    "globals": "isinstance = lambda *a: True\ntype = lambda *a: int\n",
    "builtins module": "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.type = lambda *a: int\n",
    "str subclass key": "class Key(str):\n    __hash__ = str.__hash__\n    def __eq__(self, other):\n"
                        "        return str.__eq__(self, other)\n"
                        "globals()[Key('isinstance')] = lambda *a: True\nglobals()[Key('type')] = lambda *a: int\n",
}


@pytest.mark.parametrize("name", sorted(SHADOWING))
def test_shadowing_isinstance_and_type_cannot_fake_a_pass(cfg, name):
    hack = SHADOWING[name] + "class Anything(int):\n    def __eq__(self, other):\n        return True\n" \
                             "def add(a, b):\n    return Anything(0)\n"
    typed = ["r = add(1, 2)\nassert type(r) is int and r == 3", "assert isinstance(add(1, 2), str)"]
    report = run_tests(hack, typed, cfg)
    assert report.verified and report.passed == 0, report.result.stderr


def test_tests_are_not_readable_by_the_solution(cfg):
    answer = secrets.randbelow(10 ** 12) + 10 ** 12
    snoop = program("""
        import os, re
        found = {}
        def scan(path):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                return
            try:
                data = os.read(fd, 1 << 20)
            except OSError:
                data = b""
            os.close(fd)
            match = re.search(rb"add\\(1, 2\\) == (\\d+)", data)
            if match:
                found[path] = int(match.group(1))
        for top in ("/tmp", "/sandbox", "/run", "/var/tmp", "/dev/shm", "/etc"):
            for folder, _, names in os.walk(top):
                for name in names:
                    scan(os.path.join(folder, name))
        for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self"]:
            scan(f"/proc/{pid}/cmdline")
            scan(f"/proc/{pid}/environ")
            for fd in os.listdir(f"/proc/{pid}/fd") if os.access(f"/proc/{pid}/fd", os.R_OK) else []:
                scan(f"/proc/{pid}/fd/{fd}")
        print("tests.json exists:", os.path.exists("tests.json"), "found:", sorted(found))
        def add(a, b):
            return next(iter(found.values()), 0)
    """)
    report = run_tests(snoop, [f"assert add(1, 2) == {answer}"], cfg)
    assert report.verified and report.passed == 0
    assert "tests.json exists: False found: []" in report.result.stdout, report.result.stdout


def test_host_unix_sockets_are_unreachable(netns, tmp_path):
    tag = secrets.token_hex(6)
    paths = [str(tmp_path / "host.sock")] + ([f"/run/cispo-test-{tag}.sock"] if os.access("/run", os.W_OK) else [])
    addresses = paths + [f"\0cispo-test-{tag}"]  # the last one: an abstract socket
    listeners = []
    try:
        for address in addresses:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(address)
            if not address.startswith("\0"):
                os.chmod(address, 0o777)  # anyone may connect: only the sandbox's view keeps it out
            listener.listen(1)
            listener.setblocking(False)
            listeners.append(listener)
        probe = program(f"""
            import socket
            for address in {addresses!r}:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(address)
                    s.sendall(b"pwned")
                    print("connected", repr(address))
                except OSError as exc:
                    print("failed", type(exc).__name__)
        """)
        result = run_sandboxed(probe, netns)
        assert result.returncode == 0 and "connected" not in result.stdout, result
        # paths: absent in the sandbox's view; the abstract name: another network namespace
        assert result.stdout.split("\n")[:-1] == ["failed FileNotFoundError"] * len(paths) + \
            ["failed ConnectionRefusedError"]
        for listener in listeners:
            with pytest.raises(BlockingIOError):
                listener.accept()  # the host received nothing
    finally:
        for listener in listeners:
            listener.close()
        for path in paths:
            Path(path).unlink(missing_ok=True)


def _sysv_keys() -> set[int]:
    keys = set()
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            keys |= {int(line.split()[0]) for line in f.readlines()[1:] if line.strip()}
    return keys


def test_sysv_ipc_objects_do_not_reach_the_host(cfg):
    key = 0x5A000000 + secrets.randbelow(1 << 24)
    before = _sysv_keys()
    create = program(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        flags = 0o1666  # IPC_CREAT | 0666
        ids = [libc.shmget({key}, 4096, flags), libc.msgget({key}, flags), libc.semget({key}, 1, flags)]
        print("ids", ids, "errno", ctypes.get_errno())
        print("visible inside", all(str({key}) in open(f"/proc/sysvipc/{{k}}").read() for k in ("shm", "msg", "sem")))
    """)
    result = run_sandboxed(create, cfg)
    assert result.returncode == 0 and "visible inside True" in result.stdout, result
    assert all(int(i) >= 0 for i in result.stdout.split("[")[1].split("]")[0].split(","))
    assert key not in _sysv_keys() and key not in before  # the objects died with the IPC namespace


def test_child_interpreters_are_still_contained(netns):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    child = program(f"""
        import ctypes, json, os, resource, socket
        out = {{"as": resource.getrlimit(resource.RLIMIT_AS)[0], "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0]}}
        s = socket.socket()
        s.settimeout(1)
        try:
            s.connect(("127.0.0.1", {listener.getsockname()[1]}))
            out["net"] = "connected"
        except OSError as exc:
            out["net"] = type(exc).__name__
        for path in ("/etc/passwd", {str(REPO / 'README.md')!r}):
            try:
                open(path).read()
                out[path] = "read"
            except OSError as exc:
                out[path] = type(exc).__name__
        try:
            bytearray(10 ** 10)
        except MemoryError:
            out["memory"] = "MemoryError"
        libc = ctypes.CDLL(None, use_errno=True)
        out["ptrace"] = (libc.ptrace(0, 0, 0, 0), ctypes.get_errno())  # PTRACE_TRACEME
        out["seccomp"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")][0]
        print(json.dumps(out))
    """)
    parent = program(f"""
        import os, subprocess, sys
        subprocess.run([sys.executable, "-c", {child!r}])
        with open("child.py", "w") as f:
            f.write({child!r})
        sys.stdout.flush()
        os.system(sys.executable + " child.py")  # through /bin/sh
    """)
    try:
        result = run_sandboxed(parent, config(network=netns.network, memory_mb=MEMORY_MB))
        assert result.returncode == 0, result.stderr
        lines = [json.loads(line) for line in result.stdout.splitlines()]
        assert len(lines) == 2
        for out in lines:
            assert out["as"] == MEMORY_MB << 20 and out["nproc"] == 16 and out["memory"] == "MemoryError"
            assert out["net"] == "ConnectionRefusedError"  # the namespace's loopback, not the host's
            assert out["/etc/passwd"] == out[str(REPO / "README.md")] == "FileNotFoundError"
            assert out["ptrace"] == [-1, errno.EPERM] and out["seccomp"] == "2"
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_a_child_cannot_read_the_harness_memory(cfg):
    spy = program("""
        import os, subprocess, sys
        for who, pid in (("worker", os.getpid()), ("judge", os.getppid())):  # the solution's process, the judge
            for what in ("mem", "fd/1"):
                probe = f"print(open('/proc/{pid}/{what}', 'rb').read(1))"
                done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
                print("child:", who, what, (done.stderr.strip().splitlines() or ["read"])[-1].split(":")[0])
        def add(a, b):
            return 0
    """)
    report = run_tests(spy, ADD_TESTS, cfg)
    assert report.verified and report.passed == 0
    for line in ("child: worker mem PermissionError", "child: judge mem PermissionError",
                 "child: judge fd/1 PermissionError"):
        assert line in report.result.stdout, report.result.stdout


def test_seccomp_refuses_kernel_attack_surface(cfg):
    probe = program("""
        import ctypes, socket
        libc = ctypes.CDLL(None, use_errno=True)
        def call(fn, *args):
            return fn(*args), ctypes.get_errno()
        print("ptrace", call(libc.ptrace, 0, 0, 0, 0))
        print("unshare", call(libc.unshare, 0x10000000))  # CLONE_NEWUSER
        print("mount", call(libc.mount, b"none", b"/tmp", b"tmpfs", 0, None))
        print("keyctl", call(libc.syscall, 250, 0, 0, 0, 0))  # SYS_keyctl on x86_64
        try:
            socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK
            print("vsock opened")
        except OSError as exc:
            print("vsock", exc.errno)
    """)
    result = run_sandboxed(probe, cfg)
    assert result.returncode == 0, result.stderr
    for name in ("ptrace", "unshare", "mount"):
        assert f"{name} (-1, {errno.EPERM})" in result.stdout, result.stdout
    if os.uname().machine == "x86_64":
        assert f"keyctl (-1, {errno.EPERM})" in result.stdout
    assert f"vsock {errno.EAFNOSUPPORT}" in result.stdout


def test_the_file_system_view_is_minimal_and_read_only(cfg):
    probe = program("""
        import os
        print(sorted(os.listdir("/")), sorted(os.listdir("/etc")), sorted(os.listdir("/run")))
        for path in ("/usr/pwned", "/pwned", "/etc/pwned"):
            try:
                open(path, "w")
            except OSError as exc:
                print(path, type(exc).__name__, exc.errno)
    """)
    result = run_sandboxed(probe, cfg)
    assert result.returncode == 0, result.stderr
    top, etc, run = (eval(part + "]") for part in result.stdout.splitlines()[0][:-1].split("] "))
    assert set(top) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sandbox", "sbin",
                        "tmp", "usr", "var"} | {sys.base_prefix.split("/")[1]}
    assert etc in ([], ["ld.so.cache"]) and run == []
    assert result.stdout.count(f"OSError {errno.EROFS}") == 3


def test_a_missing_bwrap_is_a_clear_error(tmp_path):
    with pytest.raises(SandboxUnavailable, match="nonexistent"):
        make_code_reward(SandboxConfig(bwrap=str(tmp_path / "nonexistent" / "bwrap")))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to map the sandbox uid into a test user namespace")
def test_without_user_namespaces_the_sandbox_refuses(cfg):
    """A real kernel refusal: inside a user namespace whose max_user_namespaces is 0, bwrap
    cannot create its namespaces, and make_code_reward raises (no unsandboxed run)."""
    inner = program("""
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
        from cispo.data.rewards.code import SandboxUnavailable, make_code_reward
        try:
            make_code_reward()
            print("SANDBOX RAN")
        except SandboxUnavailable as exc:
            print("refused:", exc)
    """)
    outer = f"import os, sys\nprint('ready', flush=True)\nsys.stdin.readline()\n" \
            f"os.execv(sys.executable, [sys.executable, '-c', {inner!r}])\n"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(["unshare", "--user", "--", sys.executable, "-c", outer], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout.readline() == "ready\n"
    for name in ("uid_map", "gid_map"):  # root and the sandbox uid, as themselves
        Path(f"/proc/{proc.pid}/{name}").write_text("0 0 1\n65534 65534 1\n")
    out, _ = proc.communicate("go\n", timeout=60)
    assert "refused:" in out and "SANDBOX RAN" not in out, out
    assert "max_" in out or "namespace" in out.lower(), out
