"""``wordmath``: generated GSM8K-shaped word problems for a real chat model.

One to three operations on small whole numbers, in several templates with names and objects drawn
from lists; every problem has one whole-number answer. The split is by the problem itself: a
problem is held out iff a hash of its text falls in the held-out fifth, so train and held-out
problems never coincide, whatever the seeds. Prompts are chat messages: the task's system prompt
(which states the answer format) and the problem.

The verifier scores the **stated final answer** — ``#### N``, ``Answer: N`` / ``the answer is N`` or
``\\boxed{N}``, the first such marker that a number follows — and nothing else, so the ways a
last-number verifier was gamed on SmolLM2 score 0 (`final_answer`):

* the final answer equals the gold one → 1.0, after any amount of working;
* another number anywhere after it — on its line or on the lines after, in digits or in English
  words — → 0.0, unless it restates the same value: a hedge ("#### 51, or maybe 52", "#### 7\\nor 8",
  "#### 7 is wrong, it is nine", "#### 7 or the eighth", "#### 7 and a half"), a second different answer,
  or an echo of the question's numbers after the answer; a bare restatement ("#### 51\\nThe answer is: 51",
  "#### 7. Seven is the answer") is fine, and so are unit words and plain text ("#### 7 apples");
* no stated final answer → 0.0: an echo of the question ("30 + 21 =") and a bare number (right or
  wrong) state none. (A last-number rule would pay for listing several results, which RL found.)

Numbers in words (`_NUMBER_WORD`) are read a word at a time, a tens-units compound as one ("twenty-one",
"twentyone"): cardinals (`NUMBER_WORDS`), ordinals as their number (`ORDINAL_WORDS`: "the eighth" is 8; "first"
and "second" alone are plain text), and parts or multiples of a quantity — "half", "quarter", "twice",
"thrice", an ordinal's plural ("two thirds") — as another number always (`OTHER_QUANTITY_WORDS`). So a longer
number in words restates nothing ("#### 700 (seven hundred)" states 7 and 100) and "the one", "one more"
read 1: the rule errs strict, and the task asks for nothing after the answer. Other languages and Roman
numerals are not read.

A paid answer is ASCII digits ("7²", "7½", "٧" are not 7), compared exactly as decimals (never floats:
6.99999999999999999 is not 7; 7.0 is); a comma is read only between groups of three digits ("1,234"
and "1234" are the same answer; "1,2", "5,6", "10,00" are no number). Unicode minus signs
(`MINUS_SIGNS`) read as ``-``. Every scan is linear in the completion's length (no regex that
backtracks over it), so a hostile completion cannot stall the trainer's main thread, where this runs.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re
from decimal import Decimal
from fractions import Fraction

from cispo.foundations.forks import used_any

NAME = "wordmath"
FORK_TOKENS = ("Wait", "However", "Actually", "Hmm", "Alternatively", "Hold on", "Let me check", "Let me verify",
               "double-check", "recheck", "I made a mistake")
"""The reflective words and phrases the fork diagnostics track (``cispo.foundations.forks``: either case of the first
letter, with or without a leading space, whole words; ``data.fork_tokens`` overrides them)."""
SYSTEM_PROMPT = "You are a helpful math assistant. Be brief."
INSTRUCTION = "Write one short line of working, then the final answer as: #### <number>"
"""Appended to each problem in the user turn (a 135M model follows it there more often than in the
system prompt: 18 vs 8 of 40 base-model answers used the marker)."""
MAX_NEW_TOKENS = 96

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack", "Kira", "Liam", "Maya",
         "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara")
ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "books", "shells", "cards", "coins", "flowers")

# (operations, template, answer) — each template a function of the numbers drawn for it.
TEMPLATES = {
    "add": (1, "{n} has {a} {x}. {n} gets {b} more {x}. How many {x} does {n} have now?", lambda a, b: a + b),
    "sub": (1, "{n} had {a} {x} and gave {b} of them to a friend. How many {x} does {n} have left?",
            lambda a, b: a - b),
    "mul": (1, "A box holds {a} {x}. How many {x} are in {b} boxes?", lambda a, b: a * b),
    "div": (1, "{n} shares {a} {x} equally among {b} friends. How many {x} does each friend get?",
            lambda a, b: a // b),
    "mul_sub": (2, "{n} buys {a} packs of {x} with {b} {x} in each pack, then gives away {c}. How many {x} does "
                   "{n} have now?", lambda a, b, c: a * b - c),
    "add_sub": (2, "{n} has {a} {x}, finds {b} more, and then loses {c}. How many {x} does {n} have?",
                lambda a, b, c: a + b - c),
    "add_mul": (2, "{n} has {a} {x}. A friend gives {n} {b} bags with {c} {x} in each bag. How many {x} does {n} "
                   "have in total?", lambda a, b, c: a + b * c),
    "mul_add_div": (3, "{n} buys {a} packs of {b} {x} and gets {c} more as a gift, then shares all of them "
                       "equally among {d} friends. How many {x} does each friend get?",
                    lambda a, b, c, d: (a * b + c) // d),
}


WORKINGS = {"add": "{a} + {b}", "sub": "{a} - {b}", "mul": "{a} * {b}", "div": "{a} / {b}",
            "mul_sub": "{a} * {b} - {c}", "add_sub": "{a} + {b} - {c}", "add_mul": "{a} + {b} * {c}",
            "mul_add_div": "({a} * {b} + {c}) / {d}"}
"""Each template's answer as one arithmetic expression of its numbers (the worked answers of `workings`)."""

KINDS = sorted(TEMPLATES)
WEIGHTS = {1: 4.0, 2: 1.5, 3: 0.5}  # per template of 1 / 2 / 3 operations: 2/3 of the problems take one


def _numbers(kind: str, rng: random.Random) -> tuple[int, ...] | None:
    """Numbers for template ``kind`` (None: this draw breaks a constraint; draw again). Small on
    purpose: SmolLM2-135M's own arithmetic is the bottleneck (it wrote "14 - 8 = 20")."""
    r = rng.randint
    if kind == "add":
        return r(2, 20), r(2, 10)
    if kind == "sub":
        a = r(6, 20)
        return a, r(2, a - 1)
    if kind == "mul":
        return r(2, 6), r(2, 5)
    if kind == "div":
        b, q = r(2, 5), r(2, 6)
        return b * q, b
    if kind == "mul_sub":
        a, b = r(2, 5), r(2, 5)
        return a, b, r(1, a * b - 1)
    if kind == "add_sub":
        a, b = r(5, 20), r(2, 10)
        return a, b, r(1, a + b - 1)
    if kind == "add_mul":
        return r(2, 10), r(2, 4), r(2, 5)
    if kind == "mul_add_div":
        a, b, d = r(2, 4), r(2, 5), r(2, 4)
        c = (-(a * b)) % d + d * r(0, 2)
        return (a, b, c, d) if c > 0 else None
    raise KeyError(kind)


def _large_numbers(kind: str, rng: random.Random) -> tuple[int, ...] | None:
    """`_numbers` with 2-3 digit operands (at least one per template; divisors and multipliers of 1 digit
    where the problem reads so): arithmetic SmolLM2-135M cannot do in its head, where a calculator pays
    (studies/results/agents/search-plan.md)."""
    r = rng.randint
    if kind == "add":
        return r(100, 999), r(12, 99)
    if kind == "sub":
        a = r(100, 999)
        return a, r(12, a - 1)
    if kind == "mul":
        return r(12, 99), r(12, 49)
    if kind == "div":
        b, q = r(3, 12), r(12, 99)
        return b * q, b
    if kind == "mul_sub":
        a, b = r(12, 49), r(12, 49)
        return a, b, r(12, a * b - 1)
    if kind == "add_sub":
        a, b = r(100, 999), r(12, 99)
        return a, b, r(12, a + b - 1)
    if kind == "add_mul":
        return r(100, 999), r(3, 12), r(12, 49)
    if kind == "mul_add_div":
        a, b, d = r(3, 12), r(12, 49), r(3, 9)
        return a, b, (-(a * b)) % d + d * r(1, 9), d
    raise KeyError(kind)


NUMBERS = {"small": _numbers, "large": _large_numbers}
"""`samples`' operand sizes: ``small`` (the task's own) or ``large`` (2-3 digits)."""


def problem(rng: random.Random, numbers: str = "small") -> tuple[str, int]:
    """One problem and its answer, its operands drawn by ``NUMBERS[numbers]``."""
    text, answer, _ = _problem(rng, numbers)
    return text, answer


def _problem(rng: random.Random, numbers: str) -> tuple[str, int, str]:
    """`problem` and its answer's expression (`WORKINGS`), e.g. ``("A box holds 3 ...", 12, "3 * 4")``."""
    draw = NUMBERS[numbers]
    while True:
        kind = rng.choices(KINDS, weights=[WEIGHTS[TEMPLATES[k][0]] for k in KINDS])[0]
        numbers_ = draw(kind, rng)
        if numbers_ is None:
            continue
        _, text, answer = TEMPLATES[kind]
        names = dict(zip("abcd", numbers_))
        return (text.format(n=rng.choice(NAMES), x=rng.choice(ITEMS), **names), answer(*numbers_),
                WORKINGS[kind].format(**names))


def held_out(text: str) -> bool:
    """The split: a problem is held out iff the first byte of its SHA-256 is below 256 / 5."""
    return hashlib.sha256(text.encode()).digest()[0] < 52


def samples(seed: int, n: int, split: str = "train", numbers: str = "small") -> list[dict]:
    """``n`` distinct problems of ``split`` (``train`` / ``eval``), seeded: ``{"prompt", "messages",
    "answer", "solution"}`` (``solution``: GSM8K's ``#### N`` form). ``numbers``: the operands' size
    (`NUMBERS`; ``large`` draws from its own seeded stream, ``small`` from the task's as always)."""
    return [{"prompt": text, "answer": str(answer), "solution": f"#### {answer}",
             "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                          {"role": "user", "content": f"{text}\n{INSTRUCTION}"}]}
            for text, answer, _ in workings(seed, n, split, numbers)]


def workings(seed: int, n: int, split: str = "train", numbers: str = "small") -> list[tuple[str, int, str]]:
    """`samples`' problems as ``(text, answer, expression)``: the same ``n`` problems in the same order, each
    with the expression whose value is its answer (`WORKINGS`: ``"(3 * 12 + 4) / 4"``), from which a worked
    answer is written (the agents search's warm start, ``wordmath_calc.demonstrations``)."""
    if numbers not in NUMBERS:
        raise ValueError(f"numbers must be one of {sorted(NUMBERS)}, got {numbers!r}")
    rng = random.Random(f"{NAME}/{split}/{seed}" if numbers == "small" else f"{NAME}/{numbers}/{split}/{seed}")
    out, seen = [], set()
    while len(out) < n:
        text, answer, expression = _problem(rng, numbers)
        if held_out(text) != (split == "eval") or text in seen:
            continue
        seen.add(text)
        out.append((text, answer, expression))
    return out


# --- the verifier: the stated final answer, in one pass --------------------------------------------------
# Linear in the completion's length: every repeat below is possessive (``*+``, ``++``: a failed match
# gives nothing back), each scan reads a stretch of text once, and the working's expressions are
# bounded (`MAX_EXPRESSION_CHARS`). (Issue 44: ``answer\s*(?:is\s*:?|:)\s*\$?\s*`` took 41 s on
# "answer is" and 1000 spaces.)

MINUS_SIGNS = "\u2010\u2011\u2012\u2013\u2014\u2212\ufe58\ufe63\uff0d"
"""Dashes written for a minus sign (U+2212 MINUS SIGN; the hyphen, figure, en and em dashes; their small
and full-width forms): each is read as ``-``, in the answer and in the working."""
_AS_MINUS = str.maketrans(dict.fromkeys(MINUS_SIGNS, "-"))

_NUMERAL = r"-?[0-9](?:[0-9]|[.,](?=[0-9]))*+"
"""A run of ASCII digits joined by single ``.`` / ``,`` ("1,000.5", "1,2", "7.0.1"), with its sign."""
_NUMERALS = re.compile(_NUMERAL)
_WELL_FORMED = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})++|[0-9]++)(?:\.[0-9]++)?")
_MARKER = re.compile(r"(?:####|answer\s*+(?:is\s*+:?|[:：])|(?P<boxed>\\boxed\{))\s*+\$?\s*+", re.IGNORECASE)
_BOXED_END = re.compile(r"\s*+\}")

_UNITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
          "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_TENS = ("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
NUMBER_WORDS = {**{w: i for i, w in enumerate(_UNITS)}, **{w: 20 + 10 * i for i, w in enumerate(_TENS)},
                "hundred": 100, "thousand": 1000, "million": 10 ** 6, "billion": 10 ** 9, "dozen": 12}
"""English number words read as numbers after a final answer ("#### 7 or maybe eight" hedges)."""
_UNIT_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth")
ORDINAL_WORDS = {**{w: i for i, w in enumerate(_UNIT_ORDINALS[2:], 3)}, "tenth": 10, "eleventh": 11, "twelfth": 12,
                 **{f"{w[:-1] if w.endswith('t') else w}th": NUMBER_WORDS[w] for w in _UNITS[13:]},
                 **{f"{w[:-1]}ieth": NUMBER_WORDS[w] for w in _TENS},
                 **{f"{w}th": NUMBER_WORDS[w] for w in ("hundred", "thousand", "million", "billion")}}
"""Ordinal words read as their number after a final answer ("#### 7, no, the eighth" hedges; "the seventh"
restates 7), and in compounds ("twenty-first"). "first" and "second" alone are plain text: "at first", "a
second look" and "seconds" say no number ("1st", "2nd" in digits are read as numerals)."""
OTHER_QUANTITY_WORDS = ("half", "halves", "quarter", "quarters", "twice", "thrice")
"""Words that state a part or a multiple of a quantity: after a final answer they are always another
number ("#### 7 and a half", "#### 7, or twice that"); so is an ordinal's plural, a fraction ("two thirds")."""
_NUMBER_WORD = re.compile(
    rf"\b(?:(?P<tens>{'|'.join(_TENS)})[- ]?+(?P<unit>{'|'.join(_UNITS[1:10] + _UNIT_ORDINALS)})"
    rf"|(?P<ordinal>{'|'.join(ORDINAL_WORDS)})(?P<plural>s?+)|(?P<word>{'|'.join(NUMBER_WORDS)})"
    rf"|(?P<other>{'|'.join(OTHER_QUANTITY_WORDS)}))\b", re.IGNORECASE)
"""A number in English words, one word (or one tens-units compound: "twenty-one", "twenty one", "twentyone",
"twenty-first") at a time."""


def _number(numeral: str) -> Decimal | None:
    """The exact value of a `_NUMERAL` (never a float: 6.99999999999999999 is not 7), or None unless it
    is well formed: a comma only between groups of three digits ("1,000"; not "1,2", "5,6", "10,00")."""
    return Decimal(numeral.replace(",", "")) if _WELL_FORMED.fullmatch(numeral) else None


def _word_value(m: re.Match) -> int | None:
    """The number a `_NUMBER_WORD` match states: a cardinal's or an ordinal's value, None for a part or a multiple
    of a quantity (`OTHER_QUANTITY_WORDS`, an ordinal's plural: a fraction), which restates no answer."""
    tens, unit, ordinal, plural, word, _ = (g and g.lower() for g in m.groups())
    if tens:
        return NUMBER_WORDS[tens] + (NUMBER_WORDS[unit] if unit in NUMBER_WORDS else _UNIT_ORDINALS.index(unit) + 1)
    if ordinal:
        return None if plural else ORDINAL_WORDS[ordinal]
    return NUMBER_WORDS[word] if word else None


def _other_numeral(text: str) -> bool:
    """Whether ``text`` holds a numeral that is not ASCII digits ("²", "½", "³", "٣")."""
    return not text.isascii() and any(c.isnumeric() for c in text if not c.isascii())


def _restates_only(tail: str, value: Decimal) -> bool:
    """Whether every number in ``tail`` equals ``value``: each numeral (`_number`; an ill-formed one
    never does) and each English number word ("eight", "twenty-one"), and it holds no other numeral."""
    return (not _other_numeral(tail)
            and all(_number(m.group()) == value for m in _NUMERALS.finditer(tail))
            and all(_word_value(m) == value for m in _NUMBER_WORD.finditer(tail)))


def final_answer(completion: str) -> tuple[int, Decimal | None] | None:
    """The completion's final answer: ``(where its marker starts, its value)``, None when it states none.

    The rule: the final answer is the first marker (``####``, ``answer is`` / ``answer:``,
    ``\\boxed{``) that a number follows (after spaces and a ``$``). Its value is None — never paid —
    unless that number is ASCII digits, well formed (`_number`), and, boxed, alone in its braces;
    and unless every number after it, on its line *and on the lines after*, restates it
    (`_restates_only`): "#### 7 or maybe eight", "#### 7\\nor 8", "#### 7²" and an echo of the
    question's numbers after the answer state another number. Unicode minus signs read as ``-``."""
    text = completion.translate(_AS_MINUS)
    for m in _MARKER.finditer(text):
        numeral = _NUMERALS.match(text, m.end())
        if numeral is None:
            word = _NUMBER_WORD.match(text, m.end())
            if word is not None or (m.end() < len(text) and text[m.end()].isnumeric()):
                return m.start(), None  # "the answer is eight", "#### ½": stated, not in digits
            continue  # "#### Step 1", "The answer is: ...": a marker, no answer
        end = numeral.end()
        if m.group("boxed"):
            close = _BOXED_END.match(text, end)
            if close is None:
                return m.start(), None  # "\boxed{7 + 1}"
            end = close.end()
        value = _number(numeral.group())
        return m.start(), value if value is not None and _restates_only(text[end:], value) else None
    return None


def _canonical(value: Decimal) -> str:
    """``value`` written plainly and exactly, at any length: "1234", "51" (for 51.0), "7.5"."""
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _gold(answer) -> Decimal:
    value = _number(str(answer).strip())
    if value is None:
        raise ValueError(f"wordmath: the gold answer {answer!r} is not a number")
    return value


def extract_answer(completion: str) -> str | None:
    """The final answer (`final_answer`) written plainly, what maj@k votes on; None when there is
    none or it is not paid whatever the gold (another number follows it, not ASCII digits, ...)."""
    stated = final_answer(completion)
    return None if stated is None or stated[1] is None else _canonical(stated[1])


def reward(prompt, completion: str, answer=None, **sample) -> float:
    """1.0 iff the completion's final answer (`final_answer`) equals ``answer`` exactly and no other
    number follows it."""
    stated = final_answer(completion)
    return 1.0 if stated is not None and stated[1] is not None and stated[1] == _gold(answer) else 0.0


# --- wordmath_working: the instruction's "one short line of working" is part of the answer -------------

MAX_EXPRESSION_CHARS = 200
"""The longest left side ``E`` of an equation ``E = c`` that is evaluated; a longer one is not checked,
and working that holds one does not count (`shows_working`)."""
_EQUALS = re.compile(rf"=\s*+\$?\s*+({_NUMERAL})")
_EXPRESSION_RUN = re.compile(r"[0-9\s.,+\-*/x×÷()$]++")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST, source: str) -> Fraction:
    """The exact value of an arithmetic syntax tree of numbers, + - * / and parentheses parsed from
    ``source`` (each number read from its text, so 0.1 + 0.2 is 0.3); ValueError otherwise."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(ast.get_source_segment(source, node))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left, source), _evaluate(node.right, source))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, source)
    raise ValueError("not arithmetic")


def _left_side(run: str) -> str:
    """The expression a run of arithmetic characters ends in: its last clause (a ". ", ", " or ": "
    ends one), from its first digit or parenthesis, ``x`` / ``×`` as ``*``, ``÷`` as ``/``, no
    thousands commas or ``$``."""
    tail = re.split(r"[.,:]\s", run)[-1]
    lhs = re.sub(r"^[^\d(]*+", "", tail).replace("x", "*").replace("×", "*").replace("÷", "/")
    return re.sub(r"(?<=\d),(?=\d{3})", "", lhs).replace("$", "").strip()


def equations(working: str) -> list[tuple[Fraction | None, Fraction | None]]:
    """Every ``E = c`` in ``working`` whose left side ``E`` is arithmetic with at least one operator
    (``x`` / ``×`` read as times, ``÷`` as divided by), in order: ``(exact value of E, c)``. "2 x 4 = 8 - 7 = 1"
    holds two; "6 marbles - 3 marbles = 3" none (the text between numbers is not arithmetic). An ``E``
    longer than `MAX_EXPRESSION_CHARS` or nested too deeply to read on the stack left, or a ``c`` that is no
    well-formed number ("= 1,05"), is ``None``: an equation that cannot be checked."""
    working = working.translate(_AS_MINUS)
    run_starts = {m.end(): m.start() for m in _EXPRESSION_RUN.finditer(working)}  # "=" ends any run
    out = []
    for m in _EQUALS.finditer(working):
        lhs = _left_side(working[run_starts.get(m.start(), m.start()):m.start()])
        c = _number(m.group(1))
        exact = None if c is None else Fraction(c)
        if len(lhs) > MAX_EXPRESSION_CHARS:
            out.append((None, exact))
            continue
        try:
            tree = ast.parse(lhs, mode="eval").body
            if not isinstance(tree, ast.BinOp):
                continue
            out.append((_evaluate(tree, lhs), exact))
        except (SyntaxError, ValueError, ZeroDivisionError):
            continue
        except (RecursionError, MemoryError):  # nested past what the stack holds here: not checked
            out.append((None, exact))
    return out


def shows_working(completion: str) -> bool:
    """Whether the text before the final answer (`final_answer`) holds the instruction's working: at least
    one equation ``E = c`` (`equations`), every one of them checked and true (``E`` = c exactly), the
    last one ending in the stated answer. A bare "#### 5", a guess after a trivial or wrong equation
    ("1 + 1 = 2 #### 7", "6 * 3 = 3 #### 3") and an echo of the question show none."""
    stated = final_answer(completion)
    if stated is None or stated[1] is None:
        return False
    shown = equations(completion[:stated[0]])
    return (bool(shown) and all(e is not None and e == c for e, c in shown)
            and shown[-1][1] == Fraction(stated[1]))


def reward_working(prompt, completion: str, answer=None, **sample) -> float:
    """`reward` (the final answer equals ``answer``, nothing after it) times `shows_working`: 1.0 iff the
    answer is right *and* reached by a line of true working that ends in it, as the task's instruction asks."""
    return reward(prompt, completion, answer) if shows_working(completion) else 0.0


def used_fork(completion: str) -> bool:
    """Whether the completion uses one of `FORK_TOKENS` (whole words, ``cispo.foundations.forks.used_any``)."""
    return used_any(FORK_TOKENS, completion)
