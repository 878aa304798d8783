"""``wordmath``: generated GSM8K-shaped word problems for a real chat model (issue 31).

One to three operations on small whole numbers, in several templates with names and objects drawn
from lists; every problem has one whole-number answer. The split is by the problem itself: a
problem is held out iff a hash of its text falls in the held-out fifth, so train and held-out
problems never coincide, whatever the seeds. Prompts are chat messages: the task's system prompt
(which states the answer format) and the problem.

The verifier scores the **stated final answer** — ``#### N``, ``Answer: N`` / ``the answer is N`` or
``\\boxed{N}`` —
and nothing else, so the ways a last-number verifier was gamed on SmolLM2 score 0:

* every stated final answer equals the gold one → 1.0, after any amount of working;
* several *different* stated final answers (hedging) → 0.0, even if one is right; so is a final
  answer followed by another number on its line ("#### 51, or maybe 52");
* no stated final answer → 0.0: an echo of the question ("30 + 21 =") and a bare number (right or
  wrong) state none. (A last-number rule would pay for listing several results, which RL found.)

Numbers are whole; "1,234" and "1234" are the same answer. math-verify is not needed for integer
answers: they are compared as integers.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re

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


def problem(rng: random.Random) -> tuple[str, int]:
    """One problem and its answer."""
    while True:
        kind = rng.choices(KINDS, weights=[WEIGHTS[TEMPLATES[k][0]] for k in KINDS])[0]
        numbers = _numbers(kind, rng)
        if numbers is None:
            continue
        _, text, answer = TEMPLATES[kind]
        names = dict(zip("abcd", numbers))
        return text.format(n=rng.choice(NAMES), x=rng.choice(ITEMS), **names), answer(*numbers)


def held_out(text: str) -> bool:
    """The split: a problem is held out iff the first byte of its SHA-256 is below 256 / 5."""
    return hashlib.sha256(text.encode()).digest()[0] < 52


def samples(seed: int, n: int, split: str = "train") -> list[dict]:
    """``n`` distinct problems of ``split`` (``train`` / ``eval``), seeded: ``{"prompt", "messages",
    "answer", "solution"}`` (``solution``: GSM8K's ``#### N`` form)."""
    rng = random.Random(f"{NAME}/{split}/{seed}")
    out, seen = [], set()
    while len(out) < n:
        text, answer = problem(rng)
        if held_out(text) != (split == "eval") or text in seen:
            continue
        seen.add(text)
        out.append({"prompt": text, "answer": str(answer), "solution": f"#### {answer}",
                    "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                 {"role": "user", "content": f"{text}\n{INSTRUCTION}"}]})
    return out


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_MARKERS = re.compile(rf"####\s*\$?\s*({_NUMBER})|answer\s*(?:is\s*:?|[:：])\s*\$?\s*({_NUMBER})|"
                      rf"\\boxed\{{\s*({_NUMBER})\s*\}}", re.IGNORECASE)
_ANY_NUMBER = re.compile(r"\d")


def _value(text: str) -> int | float:
    number = float(text.replace(",", ""))
    return int(number) if number.is_integer() else number


def stated_answers(completion: str) -> list[int | float | None]:
    """Every stated final answer of ``completion``, in order; None for one that another number
    follows on its line (a hedge such as "#### 51, or maybe 52")."""
    out = []
    for m in _MARKERS.finditer(completion):
        rest = completion[m.end():].split("\n", 1)[0]
        out.append(None if _ANY_NUMBER.search(rest) else _value(next(g for g in m.groups() if g)))
    return out


def extract_answer(completion: str) -> str | None:
    """The one stated final answer (what maj@k votes on); None when there is none or they differ."""
    stated = set(stated_answers(completion))
    return str(stated.pop()) if len(stated) == 1 and None not in stated else None


def reward(prompt, completion: str, answer=None, **sample) -> float:
    """1.0 iff the completion states a final answer and every one it states equals ``answer``."""
    stated = stated_answers(completion)
    return 1.0 if stated and all(v is not None and v == _value(str(answer)) for v in stated) else 0.0


# --- wordmath_working: the instruction's "one short line of working" is part of the answer -------------

_EQUALS = re.compile(rf"=\s*\$?\s*({_NUMBER})")
_EXPRESSION_TAIL = re.compile(r"[\d\s.,+\-*/x×÷()$]*$")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> float:
    """The value of an arithmetic syntax tree of numbers, + - * / and parentheses (ValueError otherwise)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError("not arithmetic")


def equations(working: str) -> list[tuple[float, float]]:
    """Every ``E = c`` in ``working`` whose left side ``E`` is arithmetic with at least one operator
    (``x`` / ``×`` read as times, ``÷`` as divided by), in order: ``(value of E, c)``. "2 x 4 = 8 - 7 = 1"
    holds two; "6 marbles - 3 marbles = 3" none (the text between numbers is not arithmetic)."""
    out = []
    for m in _EQUALS.finditer(working):
        tail = _EXPRESSION_TAIL.search(working[:m.start()]).group()
        tail = re.split(r"[.,:]\s", tail)[-1]  # a sentence or clause break ends the expression
        lhs = re.sub(r"^[^\d(]*", "", tail).replace("x", "*").replace("×", "*").replace("÷", "/")
        lhs = re.sub(r"(?<=\d),(?=\d{3})", "", lhs).replace("$", "").strip()
        try:
            tree = ast.parse(lhs, mode="eval").body
            if not isinstance(tree, ast.BinOp):
                continue
            out.append((_evaluate(tree), _value(m.group(1))))
        except (SyntaxError, ValueError, ZeroDivisionError):
            continue
    return out


def shows_working(completion: str) -> bool:
    """Whether the text before the first stated final answer holds the instruction's working: at least
    one equation ``E = c`` (`equations`), every one of them true (``E`` = c), the last one ending in the
    stated answer. A bare "#### 5", a guess after a trivial or wrong equation ("1 + 1 = 2 #### 7",
    "6 * 3 = 3 #### 3") and an echo of the question show none."""
    first = _MARKERS.search(completion)
    stated = extract_answer(completion)
    if first is None or stated is None:
        return False
    shown = equations(completion[:first.start()])
    return bool(shown) and all(abs(e - c) < 1e-9 for e, c in shown) and shown[-1][1] == _value(stated)


def reward_working(prompt, completion: str, answer=None, **sample) -> float:
    """`reward` (every stated final answer equals ``answer``) times `shows_working`: 1.0 iff the answer
    is right *and* reached by a line of true working that ends in it, as the task's instruction asks."""
    return reward(prompt, completion, answer) if shows_working(completion) else 0.0


def used_fork(completion: str) -> bool:
    """Whether the completion uses one of `FORK_TOKENS` (whole words, ``cispo.foundations.forks.used_any``)."""
    return used_any(FORK_TOKENS, completion)
