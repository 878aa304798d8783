"""Code reward: run model-written Python against test cases in the sandbox (Linux only).

    >>> reward = make_code_reward(SandboxConfig(timeout_s=5))     # checks the sandbox once
    >>> reward("Write add.", "```python\\ndef add(a, b):\\n    return a + b\\n```",
    ...        tests=["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    1.0

The reward is 1.0 if every case passes (`code_reward`) or the fraction that pass
(`code_reward_partial`). The isolation is `cispo.rewards.sandbox` (bubblewrap, rlimits,
seccomp); the harness it runs (`_harness.py`) gets the code, the cases and a fresh nonce on
its stdin and reports the count as an HMAC-signed line on a pipe, so a solution cannot print,
exit or write its way to a pass. See docs/code-sandbox.md.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import Sequence

from cispo.rewards.sandbox import (SandboxConfig, SandboxError, SandboxResult, SandboxUnavailable, check_sandbox,
                                   execute, run_sandboxed)

__all__ = ["SandboxConfig", "SandboxResult", "SandboxError", "SandboxUnavailable", "TestReport", "CodeReward",
           "check_sandbox", "run_sandboxed", "run_tests", "extract_code", "code_reward", "code_reward_partial",
           "make_code_reward"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TestReport:
    """Outcome of `run_tests`."""

    __test__ = False  # not a pytest test class

    passed: int
    """Test cases that ran without raising."""
    total: int
    """Test cases given."""
    verified: bool
    """The harness's signed line was found and the process exited 0 within the limits: only
    then are ``passed`` / ``total`` trusted (otherwise ``passed`` is 0)."""
    result: SandboxResult

    @property
    def all_passed(self) -> bool:
        return self.verified and self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.verified and self.total else 0.0


def _normalize_tests(tests: str | Sequence[str] | None) -> list[str]:
    if tests is None:
        raise ValueError("code_reward needs the tests (a string of assert statements or a list of them)")
    tests = [tests] if isinstance(tests, str) else [str(t) for t in tests]
    if not tests:
        raise ValueError("code_reward got an empty list of tests")
    return tests


def run_tests(code: str, tests: str | Sequence[str], cfg: SandboxConfig | None = None) -> TestReport:
    """Run ``code``, then each test case (statements, usually asserts) in the sandbox. A case
    passes if it runs without raising. A string ``tests`` is one case; a list is one per element.

    The solution runs as module ``solution``; the cases run after it, in a namespace holding
    its names and the builtins as they were before it ran. The count is trusted only from the
    harness's HMAC line (key: a nonce drawn here); any sandbox failure gives ``verified=False``.
    """
    cfg = cfg or SandboxConfig()
    cases = _normalize_tests(tests)
    nonce = secrets.token_bytes(16)
    result, channel = execute(cfg, {"mode": "tests", "code": code, "tests": cases, "nonce": nonce.hex()})
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
    blocks = python_blocks or plain_blocks
    return blocks[-1] if blocks else completion


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
    Reads the test cases from the sample field ``tests_key``. Build it with `make_code_reward`."""

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
