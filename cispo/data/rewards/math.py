"""Math reward: symbolic equivalence of the final answer with the gold one, by math-verify.

    >>> math_reward("Q", r"so the answer is $\\boxed{0.5}$", answer=r"\\frac{1}{2}")
    1.0

Needs the optional dependency ``math-verify`` (``pip install "cispo[math]"``); importing this
module works without it, calling the reward raises ImportError.

How a completion is scored (``mode``):

* ``strict`` (``math_reward``, ``data.reward=math``): only a *stated* final answer counts:
  the content of the last ``\\boxed{..}``, else the text after the last match of
  ``answer_pattern`` (default ``ANSWER_PATTERN``: ``Answer:`` as in DAPO-Math's prompts,
  ``answer is``, GSM8K's ``####``), up to the end of its line. A completion without one
  scores 0: "... in 20" is not an answer of 20 (a random model would otherwise collect reward
  for numbers it happens to end on, and RL finds that).
* ``boxed`` (``math_reward_boxed``): only ``\\boxed{..}``.
* ``lenient`` (``math_reward_lenient``, ``data.reward=math_lenient``): the old rule: math-verify
  extracts a prediction from the whole completion (boxed, "final answer is" anchors, else
  the last LaTeX / plain expression) and falls back to
  `cispo.data.rewards.exact.extract_final_answer` (whose last resort is the last number).

``make_math_reward(mode, answer_pattern)`` builds another variant (use it from your own
``file.py:function`` reward). Then:

1. the gold answer is reduced with `cispo.data.rewards.exact.gold_answer` (GSM8K ``#### 72``,
   ``\\boxed{..}``) and, unless it already has ``$`` / ``\\boxed``, parsed as LaTeX in ``$..$``
   (gold parses are cached); if it does not parse, its text is compared as a string;
2. fast path: the extracted answer equals the gold after normalisation -> 1.0 without sympy;
3. math-verify parses the prediction and ``verify(gold, pred)`` decides. ``\\frac{1}{2}`` =
   ``0.5``, ``2\\sqrt{2}`` = ``\\sqrt{8}``, ``1,000`` = ``1000``; ``1/3`` != ``0.333``.

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
import re
import threading
from functools import lru_cache, partial

from cispo.data.rewards.exact import _golds, answers_match, extract_boxed, extract_final_answer

__all__ = ["math_reward", "math_reward_boxed", "math_reward_lenient", "make_math_reward", "marked_answer",
           "require_math_verify", "ANSWER_PATTERN", "DEFAULT_TIMEOUT_SECONDS", "MODES"]

MODES = ("strict", "boxed", "lenient")
ANSWER_PATTERN = r"\banswer\s*(?:is\b\s*:?|:)|####"
"""Where a stated answer begins (case-insensitive): ``Answer:``, ``the answer is``, ``####``."""

DEFAULT_TIMEOUT_SECONDS = 5
INSTALL_HINT = ('math_reward needs the optional dependency math-verify: pip install "cispo[math]"  '
                '(or: pip install "math-verify>=0.7")')


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


def marked_answer(completion: str, answer_pattern: str | None = ANSWER_PATTERN) -> str | None:
    """The stated final answer: the last ``\\boxed{..}``'s content, else the rest of the line after
    the last (case-insensitive) match of ``answer_pattern`` (None: boxed only); None if neither."""
    if not isinstance(completion, str):
        return None
    boxed = extract_boxed(completion)
    if boxed is not None:
        return boxed.strip() or None
    if answer_pattern:
        marks = list(re.finditer(answer_pattern, completion, re.IGNORECASE))
        if marks:
            line = completion[marks[-1].end():].lstrip(" \t").split("\n", 1)[0].strip()
            return line or None
    return None


def math_reward(prompt: str, completion: str, answer: object = None, *, mode: str = "strict",
                answer_pattern: str | None = ANSWER_PATTERN,
                timeout_seconds: int | None = DEFAULT_TIMEOUT_SECONDS, **sample) -> float:
    """1.0 if the completion's final answer is mathematically equivalent to ``answer`` (a
    string, number, or list of acceptable answers), else 0.0. ``mode``: ``strict`` (a stated
    answer only), ``boxed`` or ``lenient``; see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"math_reward mode must be one of {MODES}, got {mode!r}")
    parse, verify, pred_config, TimeoutException = require_math_verify()
    golds = _golds(answer, "math_reward")
    if mode == "lenient":
        pred_text = extract_final_answer(completion) if isinstance(completion, str) else None
    else:
        pred_text = marked_answer(completion, answer_pattern if mode == "strict" else None)
        if pred_text is None:
            return 0.0
    if pred_text is not None and any(answers_match(pred_text, g) for g in golds):
        return 1.0
    if not isinstance(completion, str) or not completion.strip():
        return 0.0
    timeout = _timeout(timeout_seconds)
    try:
        if mode == "lenient":
            pred = parse(completion, extraction_config=pred_config, parsing_timeout=timeout)
            if not pred and pred_text:
                pred = parse(f"${pred_text}$", parsing_timeout=timeout)
        else:
            pred = parse(_wrap_gold(pred_text), parsing_timeout=timeout)
        if not pred:
            return 0.0
        for g in golds:
            if verify(list(_parse_gold(g, timeout)), pred, timeout_seconds=timeout):
                return 1.0
    except (Exception, TimeoutException):
        return 0.0
    return 0.0


def make_math_reward(mode: str = "strict", answer_pattern: str | None = ANSWER_PATTERN):
    """``math_reward`` with ``mode`` and ``answer_pattern`` fixed: a reward callable."""
    if mode not in MODES:
        raise ValueError(f"math_reward mode must be one of {MODES}, got {mode!r}")
    re.compile(answer_pattern or "")  # a bad pattern fails here, not at the first reward
    return partial(math_reward, mode=mode, answer_pattern=answer_pattern)


math_reward_boxed = make_math_reward("boxed")
math_reward_lenient = make_math_reward("lenient")
