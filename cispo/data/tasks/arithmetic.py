"""Built-in verifiable task: multi-digit addition with a rare "wait / recheck" fork.

The task reproduces, in miniature, the mechanism CISPO is about (MiniMax-M1,
arXiv 2506.13585, section 3): a *rare* reflective token ("Wait", "Recheck") after which
the model re-derives its answer and is far more often right. Such tokens start with a
low probability under the base model, so their IS ratio is the first to leave a PPO
trust region; CISPO keeps their gradient.

Formats (both operands have the same number of digits, 2, 3 or 4)::

    prompt                     4821+1396=
    direct completion          6217                       (then <eos>)
    forked completion          6207W1+6+0=07,2+9+0=11,8+3+1=12,4+1+1=06=6217

A forked completion is: a direct guess (sometimes wrong), the fork token ``W``, one step
per digit from the right (``a+b+carry_in=carry_out sum_digit``, always two digits), and
the corrected answer after a final ``=``. The final answer is the number after the last
``=`` of the completion (or the whole completion if it has none); anything else is
malformed and earns no reward.

Splits: a pair {a, b} is held out when a fixed integer hash of the unordered pair falls
in the lowest `HELDOUT_PERCENT` percent. Train prompts and the pretraining corpus only
use the other pairs, so held-out evaluation is never contaminated.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

FORK_TOKEN = "W"
"""The fork ("wait, let me recheck") token: one character, so one token."""

ALPHABET = "0123456789+=," + FORK_TOKEN
"""Every character the task's prompts and completions use."""

DIGITS = (2, 3, 4)
"""Operand lengths of the default task, drawn uniformly per prompt."""
HELDOUT_PERCENT = 10

_NUMBER = re.compile(r"(0|[1-9][0-9]*)")
_MASK64 = (1 << 64) - 1


# --------------------------------------------------------------------------- splits


def _pair_hash(a: int, b: int) -> int:
    """A fixed 64-bit hash of the unordered pair {a, b} (splitmix64 finaliser)."""
    lo, hi = min(a, b), max(a, b)
    x = (lo * 1_000_003 + hi + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def is_heldout(a: int, b: int) -> bool:
    """Whether the pair belongs to the held-out split (same for a+b and b+a)."""
    return _pair_hash(a, b) % 100 < HELDOUT_PERCENT


def _operand_range(n_digits: int) -> tuple[int, int]:
    return 10 ** (n_digits - 1), 10**n_digits - 1


def sample_pairs(seed: int, n: int, split: str = "train", digits: tuple[int, ...] = DIGITS,
                 stream: str = "prompts") -> list[tuple[int, int]]:
    """`n` operand pairs from `split` ("train" or "eval"), seeded and reproducible.

    Each pair first draws its number of digits uniformly from `digits`; both operands
    then have exactly that many. Pairs may repeat (mostly the few 2-digit ones). `stream`
    names an independent random stream (the corpus draws from its own).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"addition/{stream}/{split}/{','.join(map(str, digits))}/{seed}")
    want_heldout = split == "eval"
    pairs = []
    while len(pairs) < n:
        lo, hi = _operand_range(rng.choice(digits))
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if is_heldout(a, b) == want_heldout:
            pairs.append((a, b))
    return pairs


def samples(seed: int, n: int, split: str = "train", digits: tuple[int, ...] = DIGITS) -> list[dict]:
    """`n` prompt dicts ``{"prompt": "4821+1396=", "answer": "6217"}`` from `split`."""
    return [{"prompt": make_prompt(a, b), "answer": str(a + b)}
            for a, b in sample_pairs(seed, n, split, digits)]


# --------------------------------------------------------------------------- formats


def make_prompt(a: int, b: int) -> str:
    """``"4821+1396="``."""
    return f"{a}+{b}="


def parse_prompt(prompt: str) -> tuple[int, int]:
    """Inverse of `make_prompt`; raises ValueError on anything else."""
    m = re.fullmatch(r"([0-9]+)\+([0-9]+)=", prompt)
    if m is None:
        raise ValueError(f"not an addition prompt: {prompt!r}")
    return int(m.group(1)), int(m.group(2))


def derivation(a: int, b: int) -> str:
    """Digit-by-digit sum from the right, one ``a+b+carry_in=carry_out digit`` step each.

    ``derivation(4821, 1396) == "1+6+0=07,2+9+0=11,8+3+1=12,4+1+1=06"``. Operands
    shorter than the longer one are read with leading zeros.
    """
    da, db = str(a)[::-1], str(b)[::-1]
    n = max(len(da), len(db))
    da, db = da.ljust(n, "0"), db.ljust(n, "0")
    steps, carry = [], 0
    for x, y in zip(da, db):
        s = int(x) + int(y) + carry
        steps.append(f"{x}+{y}+{carry}={s // 10}{s % 10}")
        carry = s // 10
    return ",".join(steps)


def direct_completion(a: int, b: int) -> str:
    """The completion without the fork: just the answer."""
    return str(a + b)


def forked_completion(a: int, b: int, guess: str | None = None) -> str:
    """``guess + FORK_TOKEN + derivation + "=" + answer``; `guess` defaults to the answer."""
    guess = str(a + b) if guess is None else guess
    return f"{guess}{FORK_TOKEN}{derivation(a, b)}={a + b}"


def corrupt(number: str, rng: random.Random) -> str:
    """`number` with one digit replaced by a different one (never a leading zero)."""
    i = rng.randrange(len(number))
    choices = [d for d in "0123456789" if d != number[i] and not (i == 0 and d == "0")]
    return number[:i] + rng.choice(choices) + number[i + 1:]


# --------------------------------------------------------------------------- verifier


def strip_completion(completion: str, eos: str = "<eos>") -> str:
    """The completion up to (not including) the first `eos` string, if any."""
    cut = completion.find(eos)
    return completion if cut < 0 else completion[:cut]


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion, or None when it is malformed.

    The answer is the text after the last ``=`` of the completion (the whole completion
    when it has no ``=``), cut at ``<eos>``. It must be a plain decimal number without a
    leading zero, so a derivation cut off after a step (``...=06``) is not an answer.
    """
    text = strip_completion(completion)
    tail = text.rsplit("=", 1)[-1]
    return tail if _NUMBER.fullmatch(tail) else None


def used_fork(completion: str) -> bool:
    """Whether the completion emitted the fork token (before any ``<eos>``)."""
    return FORK_TOKEN in strip_completion(completion)


def reward(prompt: str, completion: str, answer: str | None = None, **sample) -> float:
    """1.0 when the completion's final answer equals the true sum, else 0.0.

    `answer` comes from the sample dict; when absent it is computed from the prompt.
    Extra sample fields are ignored.
    """
    if answer is None:
        a, b = parse_prompt(prompt)
        answer = str(a + b)
    return 1.0 if extract_answer(completion) == str(answer) else 0.0


# --------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class CorpusExample:
    """One pretraining example.

    `loss_mask` has one entry per completion character followed by one for the final
    EOS (the tokenizer is character-level): 1 = the next-token loss counts there, 0 = it
    does not, another positive value = it counts with that weight (`cispo.models.pretrain`). The
    prompt never carries loss.
    """

    prompt: str
    completion: str
    loss_mask: tuple[int, ...]
    forked: bool

    @property
    def answer(self) -> str:
        """The true sum of the prompt's ``+``-separated numbers (an addition or a chain prompt)."""
        return str(sum(int(x) for x in self.prompt.removesuffix("=").split("+")))


def decision_keep_prob(fork_fraction: float, derivation_fraction: float) -> float:
    """Probability that a forked example's fork token carries loss.

    Derivations are practised in `derivation_fraction` of the examples, but the choice
    "fork or stop" after the guess is only trained as W with frequency `fork_fraction`:
    with q this probability, ``d*q / ((1-d) + d*q) = f``.
    """
    f, d = fork_fraction, derivation_fraction
    if not 0.0 <= f <= d <= 1.0 or f >= 1.0:
        raise ValueError(f"need 0 <= fork_fraction <= derivation_fraction <= 1, got {f}, {d}")
    if d == 0.0:
        return 0.0
    return min(1.0, f * (1.0 - d) / (d * (1.0 - f)))


def corpus(seed: int, n: int, *, fork_fraction: float = 0.03, derivation_fraction: float = 0.03,
           wrong_guess_fraction: float = 0.5, digits: tuple[int, ...] = DIGITS) -> list[CorpusExample]:
    """`n` seeded pretraining examples on train-split pairs.

    * A fraction `derivation_fraction` of the examples are forked (guess, ``W``,
      derivation, corrected answer); the rest are direct (the answer alone).
    * In a fraction `wrong_guess_fraction` of forked examples the pre-fork guess has one
      corrupted digit, so the fork reads as a correction. The guess before a fork never
      carries loss (the model is not taught wrong sums), so the direct answer is practised
      only in the ``1 - derivation_fraction`` direct examples.
    * The token that decides "fork or stop" right after the guess carries loss in every
      direct example and in just enough forked ones that the trained frequency of the fork
      there is `fork_fraction` (`decision_keep_prob`). With ``derivation_fraction ==
      fork_fraction`` every fork token carries loss (a plain corpus); a larger
      `derivation_fraction` gives the model more derivations and fewer direct answers to
      learn from without making the fork any less rare.
    """
    q = decision_keep_prob(fork_fraction, derivation_fraction)
    rng = random.Random(f"addition/corpus/{','.join(map(str, digits))}/{seed}")
    out = []
    for a, b in sample_pairs(seed, n, "train", digits, stream="corpus"):
        prompt, ans = make_prompt(a, b), str(a + b)
        if rng.random() >= derivation_fraction:
            completion = ans
            out.append(CorpusExample(prompt, completion, (1,) * (len(completion) + 1), False))
            continue
        wrong = rng.random() < wrong_guess_fraction
        guess = corrupt(ans, rng) if wrong else ans
        completion = forked_completion(a, b, guess)
        mask = [0] * len(guess)                            # the guess
        mask.append(1 if rng.random() < q else 0)          # the fork token (the decision)
        mask += [1] * (len(completion) - len(guess) - 1)   # derivation and final answer
        mask.append(1)                                     # EOS
        out.append(CorpusExample(prompt, completion, tuple(mask), True))
    return out
