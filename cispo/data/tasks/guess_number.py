"""``guess_number``: find a secret number from the answers to your guesses — a task whose episodes have state.

The sample holds a secret integer in ``LOW..HIGH`` (``secret``; the prompt does not show it). The policy writes
one guess per line, ``Guess: 8``, each line ended by a newline; the environment (``cispo.envs.guess``) answers
``higher`` or ``lower`` (the secret is higher / lower than the guess) on a line of its own, or ends the episode at
the right guess. So what the policy sees next depends on what it wrote, and using the answers (halving the interval
they leave) is what finds the number in few guesses: binary search finds any of 1..15 in at most 4.

**The rules, in one home.** `read_guess` reads a line (exactly ``Guess: <number>``, spaces and a final period
allowed: a hedge ``Guess: 8 or 9``, an echo ``higher``, words around the number or two guesses on one line are
unreadable), `answer` says what the environment answers. A line counts only once ended by its newline: a turn
that ends (EOS, the chat turn's end) or is cut before one makes no guess.

**The reward reads the policy's own lines.** The task declares ``scores_policy_text``: the reward gets what the
policy wrote, the environment's answers taken out by their mask. It is 1.0 iff one of the policy's finished lines
reads the secret: the environment ends the episode at the right guess and after its last allowed turn, so this is
exactly "the environment said correct" (`tests/envs/test_guess.py` checks the two agree). The per-turn cost (-0.1
for every turn that does not find the number) is the environment's reward, not this one: the return of an episode
is this reward plus its turn rewards.

**The held-out set.** The prompt is the same for every secret, so held-out means the secrets: `samples` of the
``eval`` split cycles through every secret in order (an evaluation of 15 prompts sees each once), the ``train``
split draws them at random from a seeded stream.

**The warm start** (`demonstrations`, ``cispo sft data.task=guess_number``) teaches the rules, not the strategy:
each demonstrated guess is drawn uniformly from the interval the answers so far leave (always consistent with
them, never deliberately halving), until the number is found.
"""

from __future__ import annotations

import random
import re

NAME = "guess_number"
LOW, HIGH = 1, 15
"""The secret's range (inclusive): 15 = 2^4 - 1 numbers, which binary search finds in at most 4 guesses."""
MAX_NEW_TOKENS = 48
"""A guess line is ~6 tokens, an answer 2: four guesses and their answers with room to spare."""
HIGHER, LOWER, CORRECT = "higher", "lower", "correct"
UNREADABLE = "unreadable: write one line, Guess: <number>"
"""The environment's answer to a line `read_guess` cannot read (itself unreadable as a guess: no digits)."""
PROMPT = (f"I am thinking of a whole number from {LOW} to {HIGH}. Find it in as few guesses as you can. "
          f"Write each guess on its own line as: Guess: <number>\n"
          f"After each guess I answer {HIGHER} (the number is higher), {LOWER} (it is lower) or {CORRECT}.")
_GUESS = re.compile(r"\s*guess\s*:\s*(\d{1,4})\s*\.?\s*", re.IGNORECASE)


def read_guess(line: str) -> int | None:
    """The number of a guess line, exactly ``Guess: <number>`` (any case, spaces around, a final period), else
    None: a hedge (``Guess: 8 or 9``), an echo of an answer, words around the guess, two guesses."""
    match = _GUESS.fullmatch(line)
    return int(match.group(1)) if match else None


def answer(secret: int, guess: int) -> str:
    """What the environment answers a readable ``guess``: `HIGHER` (the secret is higher), `LOWER` or `CORRECT`."""
    return CORRECT if guess == secret else HIGHER if secret > guess else LOWER


def finished_lines(text: str) -> list[str]:
    """The lines of ``text`` ended by a newline (the text after the last newline was never ended: no guess)."""
    return text.split("\n")[:-1]


def guesses(text: str) -> list[int]:
    """The readable guesses of the policy's ``text``, in order (`read_guess` of each finished line)."""
    return [g for g in map(read_guess, finished_lines(text)) if g is not None]


def reward(prompt, completion: str, secret=None, **sample) -> float:
    """1.0 iff a finished line of ``completion`` (the policy's own text) reads ``secret`` (module docstring)."""
    return float(secret is not None and int(secret) in guesses(completion))


def extract_answer(completion: str) -> str | None:
    """The last readable guess (what maj@k votes on), or None."""
    found = guesses(completion)
    return str(found[-1]) if found else None


def used_fork(completion: str) -> bool:
    """The task tracks no fork string."""
    return False


def _sample(secret: int) -> dict:
    return {"prompt": PROMPT, "messages": [{"role": "user", "content": PROMPT}], "secret": secret,
            "answer": str(secret)}


def samples(seed: int, n: int, split: str = "train") -> list[dict]:
    """``n`` samples ``{"prompt", "messages", "secret", "answer"}``: ``train``, secrets drawn uniformly from a
    stream seeded by ``seed``; ``eval``, every secret in order, cycling (module docstring)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if split == "eval":
        return [_sample(LOW + i % (HIGH - LOW + 1)) for i in range(n)]
    rng = random.Random(f"{NAME}/train/{seed}")
    return [_sample(rng.randint(LOW, HIGH)) for _ in range(n)]


def random_play(secret: int, rng: random.Random) -> list[int]:
    """A game's guesses, each drawn uniformly from the interval the answers so far leave, until ``secret``."""
    lo, hi, out = LOW, HIGH, []
    while True:
        guess = rng.randint(lo, hi)
        out.append(guess)
        if guess == secret:
            return out
        lo, hi = (guess + 1, hi) if secret > guess else (lo, guess - 1)


def demonstrations(seed: int, n: int) -> list[dict]:
    """``n`` games of `random_play` on train secrets of stream ``seed`` for ``cispo sft``: ``{"messages",
    "answer", "parts"}``, ``parts`` the assistant's turn as ``(text, trained)`` pieces, the environment's answers
    untrained::

        "Guess: 8\\n" (trained)  "higher\\n" (not: the environment's)  "Guess: 13\\n"  "correct\\n" (not)"""
    rng = random.Random(f"{NAME}/demonstrations/{seed}")
    out = []
    for sample in samples(seed, n, "train"):
        parts = []
        for guess in random_play(sample["secret"], rng):
            parts += [(f"Guess: {guess}\n", True), (answer(sample["secret"], guess) + "\n", False)]
        out.append({"messages": sample["messages"], "answer": sample["answer"], "parts": parts})
    return out
