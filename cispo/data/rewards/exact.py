"""Exact-match reward and the final-answer extraction it shares with `cispo.data.rewards.math`.

    >>> exact_match("Q", "6 * 7 = 42, so the answer is 42.", answer="42")
    1.0
    >>> exact_match("Q", r"... hence $\\boxed{1,000}$", answer="1000")
    1.0

Extraction (`extract_final_answer`), first rule that applies:

1. the content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces);
2. the text after the last ``answer is`` / ``answer:`` / ``####`` marker (case-insensitive),
   up to the end of its line (or the next non-empty line if the marker ends its line);
3. the last number in the text, else its last non-empty line.

The gold answer is reduced with `gold_answer`: a GSM8K solution (``... #### 72``) becomes
``72``, a boxed gold its boxed content, anything else is used whole.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation

__all__ = ["exact_match", "extract_final_answer", "extract_boxed", "gold_answer", "normalize_answer",
           "answers_match"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE = re.compile(r"\\boxed\s+([^\s${}]+)")
_MARKER = re.compile(r"answer\s*(?:is\b\s*:?|:)|####", re.IGNORECASE)
_NUMBER = re.compile(r"(?:(?<![\w)\]}])[-+])?(?:(?:\d+(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
_NUMBER_FULL = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_LEADING_NUMBER = re.compile(r"^([-+]?(?:\d+(?:\.\d+)?|\.\d+))(?![\d/^.])")
_UNIT_WORD = re.compile(r" [^\W\d_]")  # "42 dollars", not "2 + 2 = 4"
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in
    `text`, with nested braces balanced; None if there is none (an unclosed one is ignored).
    One pass over the braces with a stack (linear: a run of nested ``\\boxed{`` once took each
    opener's own scan to the end, quadratic)."""
    openers = {m.end() - 1: m.start() for m in _BOXED.finditer(text)}  # index of a boxed's "{" -> its start
    last: str | None = None
    last_pos = -1
    stack: list[int] = []  # indices of the "{" not closed yet
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            open_at = stack.pop()
            if open_at in openers and openers[open_at] > last_pos:
                last, last_pos = text[open_at + 1 : i], openers[open_at]
    for m in _BOXED_BARE.finditer(text):
        if m.start() > last_pos:
            last, last_pos = m.group(1), m.start()
    return last


def extract_final_answer(text: str) -> str | None:
    """The final answer of a completion as a raw string (see the module docstring), or None
    if `text` is empty."""
    if not isinstance(text, str) or not text.strip():
        return None
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    markers = list(_MARKER.finditer(text))
    if markers:
        rest = text[markers[-1].end() :]
        for line in rest.splitlines():
            if line.strip():
                return line.strip()
        # marker at the very end: fall through to the last number / line
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def gold_answer(answer: object) -> str:
    """The reference answer to compare with: a GSM8K solution's text after its last ``####``,
    a boxed gold's content, else the answer itself (as a string, stripped)."""
    s = str(answer)
    boxed = extract_boxed(s)
    if boxed is not None:
        return boxed.strip()
    if "####" in s:
        tail = s.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else tail
    return s.strip()


def normalize_answer(s: str, ignore_case: bool = True) -> str:
    """Strip math delimiters (``$``, ``\\(``, ``\\[``), markdown bold, ``\\text{..}`` wrappers,
    thousands separators in numbers and trailing periods; collapse whitespace; lower-case when
    `ignore_case`."""
    s = s.replace("\\$", "").replace("$", "")
    for d in ("\\(", "\\)", "\\[", "\\]", "**"):
        s = s.replace(d, "")
    s = _TEXT_WRAP.sub(r"\1", s)
    s = _THOUSANDS.sub("", s)
    s = " ".join(s.split())
    s = s.rstrip(". ").strip()
    return s.lower() if ignore_case else s


def _as_number(s: str) -> Decimal | None:
    if not _NUMBER_FULL.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def answers_match(pred: str | None, gold: str, ignore_case: bool = True) -> bool:
    """Whether a raw extracted answer equals a gold answer after `normalize_answer`.

    Numbers compare by value (``42.0`` == ``42``); a numeric gold also matches a prediction
    that starts with that number followed by a word (``42 dollars``, not ``2 + 2 = 4``)."""
    if pred is None:
        return False
    p, g = normalize_answer(pred, ignore_case), normalize_answer(gold, ignore_case)
    if not g:
        return False
    if p == g:
        return True
    g_num = _as_number(g)
    if g_num is None:
        return False
    p_num = _as_number(p)
    if p_num is None:
        m = _LEADING_NUMBER.match(p)
        if m is None or not _UNIT_WORD.match(p, m.end()):
            return False
        p_num = _as_number(m.group(1))
    return p_num is not None and p_num == g_num


def _golds(answer: object, reward: str) -> list[str]:
    if answer is None:
        raise ValueError(f"{reward} needs the sample's 'answer' field (load the data with an answer_field)")
    answers: Iterable = answer if isinstance(answer, (list, tuple)) else [answer]
    return [gold_answer(a) for a in answers]


def exact_match(prompt: str, completion: str, answer: object = None, *, ignore_case: bool = True,
                **sample) -> float:
    """1.0 if the completion's final answer equals ``answer`` after normalisation, else 0.0.

    ``answer`` may be a list of acceptable answers. Raises ValueError if it is missing."""
    golds = _golds(answer, "exact_match")
    pred = extract_final_answer(completion)
    return 1.0 if any(answers_match(pred, g, ignore_case) for g in golds) else 0.0


def no_reward(prompt: str, completion: str, **sample) -> float:
    """0 for every completion (``data.reward=env``): the episode's reward is its environment's alone (the turn
    rewards of ``step`` and its ``final_reward``, TRL's ``get_reward``)."""
    return 0.0
