"""Math reward: symbolic equivalence of the final answer with the gold one, by math-verify.

    >>> math_reward("Q", r"so the answer is $\\boxed{0.5}$", answer=r"\\frac{1}{2}")
    1.0

Needs the optional dependency ``math-verify`` (``pip install "cispo[math]"``); importing this
module works without it, calling the reward raises ImportError.

How a completion is scored:

1. the gold answer is reduced with `cispo.rewards.exact.gold_answer` (GSM8K ``#### 72``,
   ``\\boxed{..}``) and, unless it already has ``$`` / ``\\boxed``, parsed as LaTeX in ``$..$``
   (gold parses are cached); if it does not parse, its text is compared as a string;
2. fast path: the completion's final answer (`cispo.rewards.exact.extract_final_answer`)
   equals the gold after normalisation -> 1.0 without sympy;
3. math-verify extracts the prediction from the whole completion (``\\boxed{..}`` first, then
   "final answer is ..." anchors, then the last LaTeX / plain expression) and, failing that,
   from our extracted final answer; ``verify(gold, pred)`` decides. ``\\frac{1}{2}`` = ``0.5``,
   ``2\\sqrt{2}`` = ``\\sqrt{8}``, ``1,000`` = ``1000``; ``1/3`` != ``0.333``.

Any error inside math-verify (including its timeouts) scores 0.0; nothing is raised into
the trainer, except a missing ``answer`` field (a configuration error).

Timeouts: math-verify bounds parsing and comparison with ``signal.alarm``, which only works in
the main thread of the main interpreter on POSIX. There we pass ``timeout_seconds`` (default
5 s, per parse / per comparison); elsewhere (a worker thread, Windows) the timeout is disabled
(math-verify logs a warning once) and a pathological expression can take long -- run rewards
in the main thread or in worker *processes* if that matters. The alarm replaces any SIGALRM
handler of the caller for its duration (and restores it after).
"""

from __future__ import annotations

import os
import threading
from functools import lru_cache

from cispo.rewards.exact import _golds, answers_match, extract_final_answer

__all__ = ["math_reward", "require_math_verify", "DEFAULT_TIMEOUT_SECONDS"]

DEFAULT_TIMEOUT_SECONDS = 5
INSTALL_HINT = 'math_reward needs the optional dependency math-verify: pip install "cispo[math]"  (or: pip install "math-verify>=0.7")'


@lru_cache(maxsize=1)
def require_math_verify():
    """Import math-verify (once): ``(parse, verify, pred_config, TimeoutException)``.

    Raises ImportError with the install command if it is missing."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        from math_verify.errors import TimeoutException
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    # boxed answers win over "final answer is" anchors; plain expressions ("42", "1/2") too.
    pred_config = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    return parse, verify, pred_config, TimeoutException


def _timeout(timeout_seconds: int | None) -> int | None:
    """The timeout math-verify may use here: None unless signals work in this thread."""
    if not timeout_seconds or timeout_seconds <= 0:
        return None
    if os.name != "posix" or threading.current_thread() is not threading.main_thread():
        return None
    return max(1, int(timeout_seconds))  # signal.alarm takes whole seconds


def _wrap_gold(gold: str) -> str:
    return gold if ("$" in gold or "\\boxed" in gold) else f"${gold}$"


@lru_cache(maxsize=8192)
def _parse_gold(gold: str, timeout: int | None) -> tuple:
    parse, _, _, TimeoutException = require_math_verify()
    try:
        parsed = parse(_wrap_gold(gold), parsing_timeout=timeout)
    except (Exception, TimeoutException):
        parsed = []
    return tuple(parsed) if parsed else (gold,)


def math_reward(prompt: str, completion: str, answer: object = None, *,
                timeout_seconds: int | None = DEFAULT_TIMEOUT_SECONDS, **sample) -> float:
    """1.0 if the completion's final answer is mathematically equivalent to ``answer`` (a
    string, number, or list of acceptable answers), else 0.0. See the module docstring."""
    parse, verify, pred_config, TimeoutException = require_math_verify()
    golds = _golds(answer, "math_reward")
    pred_text = extract_final_answer(completion) if isinstance(completion, str) else None
    if pred_text is not None and any(answers_match(pred_text, g) for g in golds):
        return 1.0
    if not isinstance(completion, str) or not completion.strip():
        return 0.0
    timeout = _timeout(timeout_seconds)
    try:
        pred = parse(completion, extraction_config=pred_config, parsing_timeout=timeout)
        if not pred and pred_text:
            pred = parse(f"${pred_text}$", parsing_timeout=timeout)
        if not pred:
            return 0.0
        for g in golds:
            if verify(list(_parse_gold(g, timeout)), pred, timeout_seconds=timeout):
                return 1.0
    except (Exception, TimeoutException):
        return 0.0
    return 0.0
