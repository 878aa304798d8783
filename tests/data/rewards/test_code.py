"""Tests for cispo.data.rewards.code and cispo.data.rewards.sandbox: the sandboxed code reward and a
catalogue of hostile programs.

Every hostile program runs under the sandbox's limits (small ones here, to keep the file
fast on two cores); each test asserts what happened, and an autouse fixture checks that no
sandbox process of this test run outlives any test.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import re
import resource
import secrets
import signal
import socket
import sys
import time
import timeit
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cispo.data.rewards import code as code_mod
from cispo.data.rewards.code import (
    CodeReward,
    SandboxConfig,
    SandboxError,
    SandboxUnavailable,
    code_reward,
    code_reward_partial,
    extract_code,
    make_code_reward,
    run_sandboxed,
    run_tests,
)
from tests.sandbox_helpers import ADD, ADD_TESTS, REPO, config, program, sandbox_pids

# --------------------------------------------------------------------------- pure helpers


def test_extract_code():
    assert extract_code("def f(): pass") == "def f(): pass"
    assert extract_code("text\n```python\nx = 1\n```\nmore") == "x = 1\n"
    assert extract_code("```python\nx = 1\n```\n```py\nx = 2\n```") == "x = 2\n"  # the last one
    assert extract_code("```\nplain\n```\n```python\ntagged\n```") == "tagged\n"   # tagged first
    assert extract_code("```bash\nls\n```\n```\ny = 3\n```") == "y = 3\n"
    assert extract_code("answer:\n```python\nx = 1\n") == "x = 1\n"               # truncated fence


# The fence pattern extract_code used before it was made linear (quadratic on runs of backticks): the oracle.
_OLD_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def _extract_by_regex(text):
    blocks = [(m.group(1).lower(), m.group(2)) for m in _OLD_FENCE.finditer(text)]
    tagged = [code for tag, code in blocks if tag in ("python", "py", "python3")]
    untagged = [code for tag, code in blocks if not tag]
    return (tagged or untagged or [text])[-1]


def test_extract_code_equals_the_fence_regex_on_random_texts():
    rng = random.Random(0)
    pieces = ["`", "``", "```", "````", "\n", "python", "py", "PY", "bash", " ", "\t", "x", "-", "\n\n"]
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert extract_code(text) == _extract_by_regex(text), repr(text)


@pytest.mark.parametrize("unit", ["`", "```\n", "```python", "``` ``` \n"])
def test_extract_code_is_linear_on_hostile_completions(unit):
    """A complexity check, not a speed claim: 16x the text must take well under 16^2 = 256x the time
    (min of 3 runs each, in the same process; the regex took ~0.2 s at 16k characters, ~11 s at 128k)."""
    def seconds(n):
        text = unit * (n // len(unit))
        return min(timeit.repeat(lambda: extract_code(text), number=1, repeat=3))
    small, large = seconds(8_000), seconds(128_000)
    assert large < 64 * max(small, 1e-4), (small, large)


def test_config_validation():
    with pytest.raises(ValueError):
        SandboxConfig(network="host")
    with pytest.raises(ValueError):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxConfig(max_processes=0)
    assert hash(SandboxConfig()) == hash(SandboxConfig())


def test_missing_tests_is_an_error_not_a_score():
    with pytest.raises(ValueError):
        code_reward("p", ADD)
    with pytest.raises(ValueError):
        code_reward("p", ADD, tests=[])


def test_unavailable_platform_refuses_at_construction(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(SandboxUnavailable, match="Linux"):
        make_code_reward(SandboxConfig(timeout_s=4.25))


# --------------------------------------------------------------------------- rewards


def test_correct_solution_scores_one(cfg):
    assert code_reward("Write add.", ADD, tests=ADD_TESTS, config=cfg) == 1.0
    assert code_reward_partial("Write add.", ADD, tests=ADD_TESTS, config=cfg) == 1.0
    # a single string of statements is one test case
    assert code_reward("p", ADD, tests="assert add(1, 2) == 3\nassert add(0, 0) == 0", config=cfg) == 1.0


def test_wrong_and_broken_solutions_score_zero(cfg):
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    assert code_reward("p", wrong, tests=ADD_TESTS, config=cfg) == 0.0
    syntax = "```python\ndef add(a, b)\n    return a + b\n```"
    assert code_reward("p", syntax, tests=ADD_TESTS, config=cfg) == 0.0
    assert code_reward("p", "I don't know.", tests=ADD_TESTS, config=cfg) == 0.0
    report = run_tests("def add(a, b)\n    return a + b\n", ADD_TESTS, cfg)
    assert report.verified and report.passed == 0 and "SyntaxError" in report.result.stderr


def test_partial_credit_is_the_fraction_of_passing_cases(cfg):
    off_by_one = "```python\ndef add(a, b):\n    return a + b if a > 0 else a + b + 1\n```"
    assert code_reward_partial("p", off_by_one, tests=ADD_TESTS, config=cfg) == pytest.approx(2 / 3)
    assert code_reward("p", off_by_one, tests=ADD_TESTS, config=cfg) == 0.0
    report = run_tests(extract_code(off_by_one), ADD_TESTS, cfg)
    assert (report.passed, report.total, report.verified) == (2, 3, True)
    assert "AssertionError" in report.result.stderr


def test_make_code_reward_reads_the_sample_field_and_pickles(cfg):
    reward = make_code_reward(cfg, partial=True, tests_key="test_list")
    assert isinstance(reward, CodeReward)
    clone = pickle.loads(pickle.dumps(reward))
    sample = {"test_list": ["assert add(1, 1) == 2", "assert add(1, 1) == 3"], "answer": None}
    assert clone("Write add.", ADD, **sample) == 0.5


def test_sandbox_failure_scores_zero_never_raises(cfg, monkeypatch):
    def broken(*args, **kwargs):
        raise SandboxError("launcher exploded")

    monkeypatch.setattr(code_mod, "execute", broken)
    assert code_reward("p", ADD, tests=ADD_TESTS, config=cfg) == 0.0  # cfg was checked already


def test_ordinary_stdlib_use_still_passes(cfg):
    solution = program("""
        import collections, dataclasses, enum, functools, heapq, itertools, json, logging, math, re, typing
        logging.warning("logging works in the sandbox")
        from collections import namedtuple, Counter, deque
        Pair = namedtuple("Pair", "a b")
        Color = enum.Enum("Color", "RED GREEN")
        T = typing.TypeVar("T")
        class Kind(enum.IntEnum):
            A = 1
        @dataclasses.dataclass
        class Box:
            value: int
        @functools.lru_cache(maxsize=None)
        def add(a, b):
            try:
                raise ValueError("handled")
            except ValueError:
                pass
            total = Pair(a, b).a + Box(b).value
            assert Counter([total])[total] == 1 and heapq.nsmallest(1, [total]) == [total]
            return total
    """)
    report = run_tests(solution, ADD_TESTS, cfg)
    assert report.all_passed, report.result.stderr
    assert "logging works in the sandbox" in report.result.stderr


def test_an_input_larger_than_the_pipe_buffer_reaches_the_harness(cfg):
    """The input is written to the harness's stdin before the wait: 2 MB of code and 200 cases
    (far over a pipe's 64 KiB) get through, within the deadline."""
    solution = f"BLOB = {'x' * (2 << 20)!r}\ndef add(a, b):\n    return a + b\n"
    report = run_tests(solution, [f"assert add({i}, 1) == {i + 1} and len(BLOB) == {2 << 20}" for i in range(200)], cfg)
    assert report.all_passed and report.total == 200 and report.result.wall_s < 4, report.result.stderr[-500:]


def test_concurrent_calls_use_separate_sandboxes(cfg):
    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(lambda _: code_reward("p", ADD, tests=ADD_TESTS, config=cfg), range(4)))
    assert scores == [1.0] * 4


# --------------------------------------------------------------------------- hostile catalogue


def test_infinite_loop_is_killed_at_the_wall_clock_limit(cfg):
    short = config(network=cfg.network, timeout_s=1.0)
    result = run_sandboxed("while True:\n    pass\n", short)
    assert result.timed_out and result.killed_reason == "timeout" and result.returncode is None
    assert 1.0 <= result.wall_s < 1.0 + 1.5
    t0 = time.monotonic()
    looping = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert code_reward("p", looping, tests=ADD_TESTS, config=short) == 0.0
    assert time.monotonic() - t0 < 1.0 + 1.5


def test_cpu_time_limit(cfg):
    result = run_sandboxed("while True:\n    pass\n", config(network=cfg.network, cpu_s=1, timeout_s=10))
    assert result.killed_reason == "cpu_limit" and not result.timed_out
    assert result.returncode == -signal.SIGXCPU  # within timeout_s = 10 (wall time depends on the load)


@pytest.mark.parametrize("bomb", [
    "x = bytearray(10 ** 10)\n",
    "x = []\nwhile True:\n    x.append(bytearray(10 ** 6))\n",
])
def test_memory_bomb_fails_and_the_parent_is_fine(cfg, bomb):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run_sandboxed(bomb, cfg)
    assert result.returncode == 1 and "MemoryError" in result.stderr and not result.timed_out
    assert result.wall_s < 4
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB
    solution = "def add(a, b):\n    x = bytearray(10 ** 10)\n    return a + b\n"
    assert not run_tests(solution, ADD_TESTS, cfg).all_passed


def test_fork_bomb_is_contained_and_nothing_survives(cfg):
    bomb = program("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    result = run_sandboxed(bomb, config(network=cfg.network, timeout_s=1.5, max_processes=8))
    assert result.timed_out and result.killed_reason == "timeout" and result.wall_s < 4
    assert sandbox_pids() == []

    # Daemons (some escaping the process group with setsid) sleeping long after the program
    # exits: the run still ends at once and takes them with it.
    daemons = program("""
        import os, time
        n = 0
        try:
            while True:
                pid = os.fork()
                if pid == 0:
                    if n % 2:
                        os.setsid()
                    time.sleep(60)
                    os._exit(0)
                n += 1
        except OSError as exc:
            print("forked", n, exc.errno)
        print("visible", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
    """)
    result = run_sandboxed(daemons, config(network=cfg.network, max_processes=8))
    assert result.returncode == 0 and result.wall_s < 4, result
    forked = int(result.stdout.split()[1])
    assert 1 <= forked < 8
    visible = json.loads(result.stdout.split("visible ", 1)[1])
    assert max(visible) < 20  # a fresh PID namespace: only the sandbox's own processes
    assert sandbox_pids() == []


def test_writing_outside_the_sandbox_is_contained(cfg):
    tag = secrets.token_hex(6)
    home = os.path.expanduser("~")
    targets = [f"/tmp/pwned_{tag}", f"/var/tmp/pwned_{tag}", f"/dev/shm/pwned_{tag}", "/etc/passwd",
               str(REPO / f"pwned_{tag}"), os.path.join(home, f"pwned_{tag}"), str(REPO / "README.md")]
    passwd_before = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    readme_before = (REPO / "README.md").read_bytes()
    attack = program(f"""
        import json, os
        outcome = {{}}
        for path in {targets!r}:
            try:
                with open(path, "a") as f:
                    f.write("pwned\\n")
                outcome[path] = "wrote"
            except OSError as exc:
                outcome[path] = type(exc).__name__
        try:
            os.remove("/etc/passwd")
            outcome["rm"] = "removed"
        except OSError as exc:
            outcome["rm"] = type(exc).__name__
        try:
            with open("big", "wb") as f:
                f.write(b"x" * (3 << 20))
            outcome["big"] = "wrote"
        except OSError as exc:
            outcome["big"] = type(exc).__name__
        print(json.dumps(outcome))
    """)
    result = run_sandboxed(attack, config(network=cfg.network, max_file_mb=1))
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    # /tmp, /var/tmp and /dev/shm are the sandbox's private tmpfs: writes land there and vanish
    for path in targets[:3]:
        assert outcome[path] == "wrote" and not os.path.exists(path)
    for path in targets[3:]:
        # refused; or, for a path under /tmp (a checkout in /tmp, as in CI), absent from the
        # sandbox's private /tmp — contained either way (checked on the host below)
        assert outcome[path] in ("PermissionError", "OSError", "FileNotFoundError"), (path, outcome[path])
    assert outcome["rm"] in ("PermissionError", "OSError") and os.path.exists("/etc/passwd")
    assert outcome["big"] == "OSError"  # RLIMIT_FSIZE: EFBIG
    assert not (REPO / f"pwned_{tag}").exists() and not os.path.exists(os.path.join(home, f"pwned_{tag}"))
    assert hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest() == passwd_before
    assert (REPO / "README.md").read_bytes() == readme_before


def test_environment_secrets_are_not_inherited(cfg, monkeypatch):
    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("CISPO_TEST_SECRET_TOKEN", secret)
    monkeypatch.setenv("PYTHONSTARTUP", "/nonexistent")
    snoop = program("""
        import os
        print(sorted(os.environ.items()))
        for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self"]:
            try:
                print(pid, open(f"/proc/{pid}/environ", "rb").read())
            except OSError as exc:
                print(pid, type(exc).__name__)
    """)
    result = run_sandboxed(snoop, cfg)
    assert result.returncode == 0 and secret not in result.stdout + result.stderr
    env = dict(eval(result.stdout.splitlines()[0]))
    assert set(env) == {"PATH", "LANG", "HOME", "TMPDIR", "PWD"}  # bwrap sets PWD for --chdir
    leak = "```python\nimport os\ndef secret():\n    return os.environ.get('CISPO_TEST_SECRET_TOKEN')\n```"
    assert code_reward("p", leak, tests=[f"assert secret() == {secret!r}"], config=cfg) == 0.0


def test_network_is_unreachable_even_on_loopback(netns):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        probe = program(f"""
            import socket
            print("interfaces", [name for _, name in socket.if_nameindex()])
            for host, port in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("10.255.255.1", 80)]:
                s = socket.socket()
                s.settimeout(1)
                try:
                    s.connect((host, port))
                    s.sendall(b"pwned")
                    print("connected", host)
                except OSError as exc:
                    print("failed", host, type(exc).__name__, exc.errno)
                finally:
                    s.close()
            try:
                socket.getaddrinfo("example.com", 80)
                print("resolved")
            except OSError as exc:
                print("dns failed", type(exc).__name__)
        """)
        result = run_sandboxed(probe, netns)
        assert result.returncode == 0, result.stderr
        assert "interfaces ['lo']" in result.stdout  # the namespace's own loopback, not the host's
        assert "connected" not in result.stdout and "resolved" not in result.stdout
        failures = [line for line in result.stdout.splitlines() if line.startswith("failed ")]
        assert len(failures) == 3 and "dns failed" in result.stdout
        assert failures[0].endswith(f" {errno.ECONNREFUSED}")  # nobody listens on this 127.0.0.1
        assert all(line.endswith(f" {errno.ENETUNREACH}") for line in failures[1:])  # no route out
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's listener
    finally:
        listener.close()


@pytest.mark.parametrize("flood", [
    "print('x' * 10 ** 8)\n",
    "while True:\n    print('spam spam spam')\n",
    "import sys\nwhile True:\n    sys.stderr.write('e' * 4096)\n",
])
def test_huge_output_is_truncated_and_stopped(cfg, flood):
    result = run_sandboxed(flood, cfg)
    assert result.killed_reason == "output_limit" and result.truncated and not result.timed_out
    assert len(result.stdout.encode()) <= cfg.max_output_bytes
    assert len(result.stderr.encode()) <= cfg.max_output_bytes
    assert len(result.stdout) + len(result.stderr) >= cfg.max_output_bytes  # kept up to the cap
    assert result.wall_s < 3


@pytest.mark.parametrize("trick", [
    "import sys\nsys.exit(0)\n",
    "import os\nos._exit(0)\n",
    "import sys\nprint('all tests passed')\nsys.stdout.flush()\nraise SystemExit(0)\n",
    "def add(a, b):\n    raise SystemExit(0)\n",
    "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 0\n",
    # a fake result line on the harness's result pipe, then exit
    "import os, sys\nfor k in range(4):\n    os.write(int(sys.argv[2]), b'3 3 ' + b'0' * 64 + b'\\n')\nos._exit(0)\n",
    # stop the harness from running the tests
    "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None\n"
    "def add(a, b):\n    return 0\n",
])
def test_early_exit_and_fake_markers_do_not_pass(cfg, trick):
    assert code_reward("p", f"```python\n{trick}```", tests=ADD_TESTS, config=cfg) == 0.0
    assert code_reward_partial("p", f"```python\n{trick}```", tests=ADD_TESTS, config=cfg) == 0.0


FORGERIES = {
    # walk the frames up to the harness and steal its state
    "getframe": """
        import sys
        f = sys._getframe(0)
        while f.f_back is not None:
            f = f.f_back
            for name, value in list(f.f_locals.items()):
                if isinstance(value, list) and value == [0]:
                    value[0] = 3
        def add(a, b):
            return 0
    """,
    "traceback": """
        try:
            1 / 0
        except ZeroDivisionError as exc:
            frame = exc.__traceback__.tb_frame
        def add(a, b):
            return 0
    """,
    "gc": """
        import gc
        for obj in gc.get_objects():
            if isinstance(obj, tuple) and len(obj) == 4 and all(isinstance(x, bytes) for x in obj):
                print(obj[-1])
        def add(a, b):
            return 0
    """,
    # a signal handler receives the interrupted frame (only the main thread may install one)
    "signal": """
        import os, signal
        signal.signal(signal.SIGUSR1, lambda signum, frame: print(frame.f_back.f_locals))
        os.kill(os.getpid(), signal.SIGUSR1)
        def add(a, b):
            return 0
    """,
    # capture the harness's own line by dup2-ing over every descriptor (the result file is not among
    # them: only the judge, a process of its own, holds it), then claim all passed
    "replay": """
        import os, sys, threading
        r, w = os.pipe()
        saved = {fd: os.dup(fd) for fd in range(3, 64) if fd not in (r, w) and os.path.exists(f"/proc/self/fd/{fd}")}
        for fd in saved:
            os.dup2(w, fd)
        def relay():
            k, n, mac = os.read(r, 4096).split()
            for fd in saved.values():
                os.write(fd, n + b" " + n + b" " + mac + b"\\n")
        threading.Thread(target=relay, daemon=True).start()
        def add(a, b):
            return 0
    """,
    "memory": """
        data = open("/proc/self/mem", "rb")
        def add(a, b):
            return 0
    """,
    "symlink": """
        import os
        os.symlink("/proc/self/mem", "m")
        def add(a, b):
            return 0
    """,
    "ctypes": """
        import ctypes
        def add(a, b):
            return 0
    """,
    "settrace": """
        import sys
        sys.settrace(lambda frame, event, arg: None)
        def add(a, b):
            return 0
    """,
    "stdout": """
        import sys
        class Rewrite:
            def write(self, s):
                return sys.__stdout__.write(s.replace(" 0 ", " 3 "))
            def flush(self):
                pass
        sys.stdout = Rewrite()
        def add(a, b):
            return 0
    """,
}


# What stops each forgery, as the harness's stderr says it. The verdict is the judge's, a process of
# its own that runs no code of the solution's: what the solution reaches is the worker's own state.
BLOCKED_BY = {
    "getframe": "sys._getframe is not allowed", "traceback": "frame access (tb_frame) is not allowed",
    "gc": "gc.get_objects is not allowed",
    "signal": "AssertionError",  # the handler runs and sees the worker's frames: nothing of the verdict there
    "replay": "WorkerLost",  # the dup2s cut the worker off from the judge; the judge's own line stands
    "memory": "opening '/proc/self/mem' is not allowed", "symlink": "os.symlink is not allowed",
    "ctypes": "importing ctypes is not allowed", "settrace": "sys.settrace is not allowed",
    "stdout": "AssertionError",  # the result does not go through stdout: the tests ran and failed
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forging_the_verdict_is_blocked(cfg, name):
    report = run_tests(program(FORGERIES[name]), ADD_TESTS, cfg)
    assert not report.all_passed and report.passed == 0, (name, report)
    assert report.result.returncode == 0 and not report.result.timed_out
    assert report.verified and BLOCKED_BY[name] in report.result.stderr, report.result.stderr
    assert code_reward_partial("p", program(FORGERIES[name]), tests=ADD_TESTS, config=cfg) == 0.0


def test_always_equal_object_does_not_pass(cfg):
    """An object of the solution's stays in the worker; compared with plain data it is never equal
    (was a known limit until the judge ran the cases in a process of its own)."""
    hack = "class Anything:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Anything()\n"
    report = run_tests(hack, ADD_TESTS, cfg)
    assert report.verified and report.passed == 0, report.result.stderr


def test_type_checking_tests_defeat_the_always_equal_object(cfg):
    hack = "class Anything:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Anything()\n"
    typed = ["r = add(1, 2)\nassert type(r) is int and r == 3", "assert isinstance(add(1, 2), int)"]
    assert run_tests(hack, typed, cfg).passed == 0
    assert run_tests(extract_code(ADD), typed, cfg).all_passed
