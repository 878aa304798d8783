"""The code sandbox's test fixtures, shared by test_code_reward.py and test_code_sandbox_leaks.py:
a small sandbox config (with a memory limit of this test run's own, so that its processes can be
told apart) and an autouse check that no sandbox process outlives a test."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from cispo.data.rewards.code import SandboxConfig, SandboxUnavailable, check_sandbox

REPO = Path(__file__).resolve().parents[1]
# A memory limit of our own (it shows in the harness's command line), so sandboxes of other
# test runs on the machine never look like ours.
MEMORY_MB = 256 + os.getpid() % 64

ADD = "```python\ndef add(a, b):\n    return a + b\n```"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 5) == 4", "assert add(2, 2) == 4"]


def config(**overrides) -> SandboxConfig:
    base = dict(timeout_s=5.0, cpu_s=5, memory_mb=MEMORY_MB, max_processes=16, max_output_bytes=16_000)
    return SandboxConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def cfg() -> SandboxConfig:
    """The default test config; without network namespaces, the same with network="allow"."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the code sandbox needs Linux")
    try:
        check_sandbox(config())
        return config()
    except SandboxUnavailable as exc:
        reason = str(exc)
    try:
        check_sandbox(config(network="allow"))
    except SandboxUnavailable as exc:
        pytest.skip(f"no sandbox on this machine: {exc}")
    pytest.network_unavailable_reason = reason
    return config(network="allow")


@pytest.fixture
def netns(cfg) -> SandboxConfig:
    if cfg.network != "none":
        pytest.skip(f"network namespaces unavailable: {getattr(pytest, 'network_unavailable_reason', '')}")
    return cfg


def sandbox_pids() -> list[int]:
    """Live processes of this test run's sandboxes: bwrap, the harness and its forks (their
    command line names the harness and our memory limit)."""
    marker = b'"AS": %d' % (MEMORY_MB << 20)
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if entry.isdigit() and b"/sandbox/harness.py" in cmdline and marker in cmdline:
            pids.append(int(entry))
    return pids


@pytest.fixture(autouse=True)
def nothing_survives():
    """After each test no process of this run's sandboxes may be alive (stragglers are killed)."""
    yield
    leftovers = sandbox_pids() if sys.platform.startswith("linux") else []
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert leftovers == [], f"sandbox processes survived the test: {leftovers}"


def program(src: str) -> str:
    return textwrap.dedent(src).strip() + "\n"
