"""Code reward: run model-written Python against test cases in the sandbox (Linux only; docs/code-sandbox.md)."""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

from cispo.data.rewards._harness import signed_lines
from cispo.data.rewards.sandbox import (
    SandboxConfig,
    SandboxError,
    SandboxResult,
    SandboxUnavailable,
    check_sandbox,
    execute,
    run_sandboxed,
)

__all__ = ["SandboxConfig", "SandboxResult", "SandboxError", "SandboxUnavailable", "TestReport", "CodeReward",
           "check_sandbox", "run_sandboxed", "run_tests", "extract_code", "code_reward", "code_reward_partial",
           "make_code_reward"]

log = logging.getLogger(__name__)
_TAG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")


@dataclass(frozen=True)
class TestReport:
    """Outcome of `run_tests`; ``passed`` and ``total`` are trusted only if ``verified`` (else ``passed`` is 0)."""

    __test__ = False  # not a pytest test class
    passed: int  # test cases that ran without raising
    total: int
    verified: bool  # the harness's signed line verified and the run exited 0 within every limit
    result: SandboxResult

    @property
    def all_passed(self) -> bool:
        return self.verified and self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.verified and self.total else 0.0


def _normalize_tests(tests: str | Sequence[str] | None) -> list[str]:
    """The test cases as a non-empty list (a string is one case); missing tests are a data error."""
    tests = [tests] if isinstance(tests, str) else [str(t) for t in tests or ()]
    if not tests:
        raise ValueError("code_reward needs the tests: a string of assert statements or a non-empty list of them")
    return tests


def run_tests(code: str, tests: str | Sequence[str], cfg: SandboxConfig | None = None) -> TestReport:
    """Run ``code``, then each test case, in the sandbox; a case passes if it runs without raising.
    The count is trusted only from the harness's HMAC line (key: a nonce drawn here)."""
    cases = _normalize_tests(tests)
    n, nonce = len(cases), secrets.token_bytes(16)
    result, channel = execute(cfg or SandboxConfig(), {"mode": "tests", "code": code, "tests": cases,
                                                       "nonce": nonce.hex()})
    # The harness's line for each count k (the program is gone: a plain lookup is no timing oracle).
    signed = {line: k for k, line in enumerate(signed_lines(nonce, n))}
    counts = [signed[line] for line in channel.splitlines(keepends=True) if line in signed] if result.ok else []
    return TestReport(passed=counts[0] if counts else 0, total=n, verified=bool(counts), result=result)


def _fences(text: str):
    """``(tag, body)`` of each fenced block, in order: ```` ``` ```` and an info line (its leading word the
    tag), then the body up to the next ```` ``` ```` or the end of the text. One left-to-right scan: linear
    in ``len(text)`` however many backtick runs a hostile completion holds."""
    start = text.find("```")
    while start >= 0:
        newline = text.find("\n", start + 3)
        if newline < 0:  # no line after this fence, nor after any later one
            return
        end = text.find("```", newline + 1)
        yield _TAG.match(text, start + 3, newline).group(1), text[newline + 1: len(text) if end < 0 else end]
        if end < 0:
            return
        start = text.find("```", end + 3)


def extract_code(completion: str) -> str:
    """The last fenced block tagged ``python``/``py``/``python3``, else the last untagged one, else the
    whole text; an unterminated last fence (a truncated answer) counts up to the end."""
    blocks = [(tag.lower(), code) for tag, code in _fences(completion)]
    tagged = [code for tag, code in blocks if tag in ("python", "py", "python3")]
    untagged = [code for tag, code in blocks if not tag]
    return (tagged or untagged or [completion])[-1]


@dataclass(frozen=True)
class CodeReward:
    """A picklable reward ``(prompt, completion, **sample) -> float`` bound to a sandbox config; it reads
    the cases from the sample field ``tests_key``. Build it with `make_code_reward`."""

    config: SandboxConfig = field(default_factory=SandboxConfig)
    partial: bool = False  # score the fraction of passing cases instead of all-or-nothing
    tests_key: str = "tests"

    def __call__(self, prompt: str, completion: str, **sample) -> float:
        cases = _normalize_tests(sample.get(self.tests_key))  # a data error: raised, not scored
        check_sandbox(self.config)  # once per config; SandboxUnavailable is raised, not scored
        try:
            report = run_tests(extract_code(completion), cases, self.config)
        except Exception:
            log.warning("code reward: sandbox failure, scoring 0.0", exc_info=True)
            return 0.0
        return report.fraction if self.partial else float(report.all_passed)


def code_reward(prompt: str, completion: str, tests: str | Sequence[str] | None = None, *,
                config: SandboxConfig | None = None, **sample) -> float:
    """1.0 if the completion's code passes every test case in the sandbox, else 0.0. Failures of the
    program or the sandbox score 0.0; missing tests (``ValueError``) and `SandboxUnavailable` raise."""
    return CodeReward(config or SandboxConfig())(prompt, completion, tests=tests)


def code_reward_partial(prompt: str, completion: str, tests: str | Sequence[str] | None = None, *,
                        config: SandboxConfig | None = None, **sample) -> float:
    """The fraction of test cases that pass (pass ``tests`` as a list for partial credit)."""
    return CodeReward(config or SandboxConfig(), partial=True)(prompt, completion, tests=tests)


def make_code_reward(config: SandboxConfig | None = None, *, partial: bool = False,
                     tests_key: str = "tests") -> CodeReward:
    """A code reward bound to ``config``; raises `SandboxUnavailable` now if the sandbox cannot be created."""
    check_sandbox(config or SandboxConfig())
    return CodeReward(config or SandboxConfig(), partial, tests_key)
