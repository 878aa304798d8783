"""Built-in task `chain`: a running sum in several written steps, with a recheck after any step.

Where `addition` is one decision (fork once, after a guess), `chain` makes reflection
recur inside a longer chain of thought, as in MiniMax-M1 (arXiv 2506.13585, section 3):

    prompt        23+7+4+8+9=
    completion    23+7=20W3+7+0=10,2+0+1=03=30;30+4=34;34+8=32W4+8+0=12,3+0+1=04=42;42+9=41W2+9+0=11,4+0+1=05=51

* Every solution is a chain of `n` steps ``a+b=c`` (n from `STEPS`, the difficulty
  knob), ``a`` the running sum so far (two digits: it stays below 100), ``b`` the next
  number of the prompt (one digit).
* The base model adds directly with a systematic bug: it **drops carries** (``23+7=20``
  above: each column written as ``(x+y) mod 10``). A step
  without a carry is right, a step with one is wrong, and the error propagates: the next
  step starts from the written value.
* The reflective token ``W`` may follow **any** step. After it the model re-derives that
  step digit by digit from the right (``x+y+carry_in=carry_out digit``, the derivation
  of `cispo.data.tasks.arithmetic`), writes the corrected result after ``=``, and the chain
  goes on from the corrected value. Re-deriving a correct step repeats its value.
* **Reward** 1 when the number after the last ``=`` equals the sum of the prompt's numbers
  *and* the completion fits the **length budget**: the length of the shortest correct
  completion (a recheck after exactly the steps with a carry) plus `LENGTH_SLACK`
  characters (one recheck's worth), so checking after every step is not free: a policy
  must learn *where* a recheck helps. Steps carry with probability `CARRY_PROB` but
  never all of them, so the shortest correct completion rechecks ~3.2 steps of 4-6.

Variants whose base model errs on a **hidden subset** of the carrying steps (`chain_hidden`):
a step ``a+b`` is *buggy* when it carries and its (tens digit of ``a``, ``b``) pair
is in the task's bug set (`TASK_BUGS`; `HIDDEN_BUGS`: 24 of the 72 pairs a carrying step can
have); the base model adds every other step correctly, so a recheck pays only after a buggy
step, and where it pays is a 24-entry table the policy must learn, not the units digits.
With ``bugs=None`` (chain itself) every carrying step is buggy. `chain_hidden_graded` replaces the
length budget's all-or-nothing cost of an unneeded recheck by a fraction of the reward
(`graded_reward`, `balanced_recheck_cost`).

Splits: a prompt is held out when a fixed hash of its numbers falls in the lowest
`HELDOUT_PERCENT` percent; train prompts and the pretraining corpus use the rest.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from cispo.data.tasks.arithmetic import CorpusExample, _pair_hash, decision_keep_prob, derivation, strip_completion

FORK_TOKEN = "W"
"""The reflective ("wait, recheck that step") token."""
STEP_SEP = ";"
ALPHABET = "0123456789+=,;" + FORK_TOKEN
"""Every character prompts and completions use."""

SPARSE_CARRY_PROB = 0.15
"""`chain_sparse`: steps carry this rarely (at least one per prompt), so a recheck pays after
~1.2 of 4-6 steps and the reflective token must stay rare everywhere else."""

def _hidden_bugs() -> frozenset[tuple[int, int]]:
    """3 addends drawn for each tens digit 1-8 (a fixed seeded draw): 24 of the 72 pairs."""
    rng = random.Random("chain_hidden/bugs")
    return frozenset((tens, b) for tens in range(1, 9) for b in sorted(rng.sample(range(1, 10), 3)))


HIDDEN_BUGS = _hidden_bugs()
"""`chain_hidden`'s bug set: (tens digit of the running sum, addend) pairs on which the base model
drops the carry. A carrying step ``a+b`` (``a`` <= 89, since the sum stays below 100) has one of
8 x 9 = 72 such pairs; for each tens digit 1-8, 3 of the 9 addends are buggy."""
TASK_BUGS: dict[str, frozenset[tuple[int, int]]] = {
    "chain_hidden": HIDDEN_BUGS, "chain_hidden_strict": HIDDEN_BUGS, "chain_hidden_sharp": HIDDEN_BUGS,
    "chain_hidden_graded": HIDDEN_BUGS}
"""The bug set of each chain variant whose base model errs on a subset of the carrying steps
(a task not listed: `chain`, `chain_sparse`, errs on every carrying step)."""

STEPS = (4, 5, 6)
"""Default chain lengths (number of additions), drawn uniformly per prompt."""
CARRY_PROB = 0.7
"""Probability that a step involves a carry (so the base model gets it wrong)."""
MAX_SUM = 99
"""The running sum stays below 100, so every step is ``two digits + one digit`` and every
recheck derives two columns."""
HELDOUT_PERCENT = 10
LENGTH_SLACK = 22
"""Characters a completion may use beyond the shortest correct one (a recheck is 21
characters, ``W3+7+0=10,2+0+1=03=30``), so one unneeded recheck fits the budget, two do not."""
RECHECK_CHARS = 21
"""Length of every recheck (``W`` + two columns + ``=`` + a two-digit sum): `recheck` of any step."""
GRADED_COST = 0.225
"""`chain_hidden_graded`'s cost per unneeded recheck, a fraction of the reward: `balanced_recheck_cost`
of its training prompts at the base model's recheck rate 0.0364 per step (0.2247)."""

_NUMBER = re.compile(r"(0|[1-9][0-9]*)")
_PROMPT = re.compile(r"[0-9]+(\+[0-9]+)+=")
_STEP = re.compile(r"([0-9]+)\+([0-9]+)=([0-9]+)(?:W([0-9+=,]*)=([0-9]+))?")


# --------------------------------------------------------------------------- arithmetic


def has_carry(a: int, b: int) -> bool:
    """Whether adding `a` and `b` (non-negative) column by column carries anywhere."""
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


def is_buggy(a: int, b: int, bugs: frozenset[tuple[int, int]] | None = None) -> bool:
    """Whether the base model gets ``a+b`` wrong: it carries and (``bugs`` None, chain's base
    model) always, or its (tens digit of `a`, `b`) pair is in `bugs`."""
    return has_carry(a, b) and (bugs is None or (a // 10 % 10, b) in bugs)


def dropped_carry_sum(a: int, b: int) -> int:
    """The base model's bug: each column written as ``(x + y) mod 10``, carries dropped.

    ``dropped_carry_sum(95, 91) == 86``, ``dropped_carry_sum(186, 24) == 100``,
    ``dropped_carry_sum(62, 48) == 0`` (written without leading zeros).
    """
    out, place = 0, 1
    while a or b:
        out += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def recheck(a: int, b: int) -> str:
    """The text after a step ``a+b=r``: ``W`` + digit-by-digit derivation + ``=`` + the sum."""
    return f"{FORK_TOKEN}{derivation(a, b)}={a + b}"


# --------------------------------------------------------------------------- prompts


def _chain_hash(numbers: tuple[int, ...]) -> int:
    h = 0
    for x in numbers:
        h = _pair_hash(h & 0xFFFFFFFF, x)
    return h


def is_heldout(numbers) -> bool:
    return _chain_hash(tuple(numbers)) % 100 < HELDOUT_PERCENT


def make_prompt(numbers) -> str:
    """``"23+7+4+8+9="``."""
    return "+".join(map(str, numbers)) + "="


def parse_prompt(prompt: str) -> tuple[int, ...]:
    """Inverse of `make_prompt`; raises ValueError on anything else."""
    if not _PROMPT.fullmatch(prompt):
        raise ValueError(f"not a chain prompt: {prompt!r}")
    return tuple(int(x) for x in prompt[:-1].split("+"))


def _draw_chain(rng: random.Random, steps: tuple[int, ...], carry_prob: float, min_carries: int = 0) -> tuple[int, ...]:
    """Numbers for one prompt: a 2-digit start, then n one-digit numbers whose additions
    carry with probability `carry_prob` each (at least one step never carries, at least
    `min_carries` do) and whose running sum stays at most `MAX_SUM`. The carry pattern is drawn
    first; numbers that cannot follow it are redrawn (so the number of carrying steps is
    binomial, conditioned on those bounds)."""
    n = rng.choice(steps)
    while True:
        carries = [rng.random() < carry_prob for _ in range(n)]
        if not all(carries) and sum(carries) >= min_carries:
            break
    while True:
        numbers = [rng.randint(10, MAX_SUM)]
        total = numbers[0]
        for carry in carries:
            units = total % 10
            choices = range(10 - units, 10) if carry else range(1, 10 - units)   # carry iff units + b >= 10
            if not choices:
                break
            b = rng.choice(choices)
            numbers.append(b)
            total += b
        if len(numbers) == n + 1 and total <= MAX_SUM:
            return tuple(numbers)


def sample_chains(seed: int, n: int, split: str = "train", steps: tuple[int, ...] = STEPS,
                  carry_prob: float = CARRY_PROB, stream: str = "prompts", min_carries: int = 0,
                  bugs: frozenset[tuple[int, int]] | None = None,
                  bug_range: tuple[int, int | None] = (0, None)) -> list[tuple[int, ...]]:
    """`n` seeded prompts' numbers from `split` ("train" or "eval"); with `bugs`, only chains
    whose number of buggy steps (`buggy_steps`) lies in `bug_range` = (min, max or None)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    bounds = f"/min{min_carries}" if min_carries else ""  # chain's own streams unchanged
    if bugs is not None:
        bounds += f"/bugs{bug_range[0]}-{bug_range[1]}"
    rng = random.Random(f"chain/{stream}/{split}/{','.join(map(str, steps))}/{carry_prob}{bounds}/{seed}")
    lo, hi = bug_range
    out = []
    while len(out) < n:
        numbers = _draw_chain(rng, steps, carry_prob, min_carries)
        if bugs is not None and not lo <= len(buggy_steps(numbers, bugs)) <= (len(numbers) if hi is None else hi):
            continue
        if is_heldout(numbers) == (split == "eval"):
            out.append(numbers)
    return out


def samples(seed: int, n: int, split: str = "train", steps: tuple[int, ...] = STEPS,
            carry_prob: float = CARRY_PROB, min_carries: int = 0,
            bugs: frozenset[tuple[int, int]] | None = None,
            bug_range: tuple[int, int | None] = (0, None)) -> list[dict]:
    """``{"prompt": "23+7+4+8+9=", "answer": "51"}`` dicts from `split`."""
    return [{"prompt": make_prompt(ns), "answer": str(sum(ns))}
            for ns in sample_chains(seed, n, split, steps, carry_prob, min_carries=min_carries, bugs=bugs,
                                    bug_range=bug_range)]


# --------------------------------------------------------------------------- completions


def completion(numbers, recheck_after=(), base_bug: bool = True, bugs: frozenset[tuple[int, int]] | None = None) -> str:
    """The chain for `numbers` with a recheck after the steps (0-based) in `recheck_after`.

    With `base_bug`, unchecked buggy steps (`is_buggy` with `bugs`: for chain every step with a
    carry) are written as the base model does (carry dropped) and the chain goes on from that value.
    """
    total, parts = numbers[0], []
    for i, b in enumerate(numbers[1:]):
        r = dropped_carry_sum(total, b) if base_bug and is_buggy(total, b, bugs) else total + b
        step = f"{total}+{b}={r}"
        if i in recheck_after:
            step += recheck(total, b)
            r = total + b
        parts.append(step)
        total = r
    return STEP_SEP.join(parts)


def carry_steps(numbers) -> list[int]:
    """0-based steps whose addition carries (those chain's base model gets wrong), on the true sums."""
    return buggy_steps(numbers)


def buggy_steps(numbers, bugs: frozenset[tuple[int, int]] | None = None) -> list[int]:
    """0-based steps the base model gets wrong (`is_buggy`), on the true sums; `bugs` None:
    `carry_steps`."""
    total, out = numbers[0], []
    for i, b in enumerate(numbers[1:]):
        if is_buggy(total, b, bugs):
            out.append(i)
        total += b
    return out


def reference(numbers, bugs: frozenset[tuple[int, int]] | None = None) -> str:
    """The shortest correct completion: a recheck after exactly the buggy steps (chain: those
    with a carry)."""
    return completion(numbers, recheck_after=set(buggy_steps(numbers, bugs)), bugs=bugs)


def length_budget(numbers, slack: int = LENGTH_SLACK, bugs: frozenset[tuple[int, int]] | None = None) -> int:
    """Longest completion (characters, EOS excluded) that can earn the reward: the shortest
    correct one plus `slack` characters."""
    return len(reference(numbers, bugs)) + slack


# --------------------------------------------------------------------------- verifier


@dataclass(frozen=True)
class Step:
    """One parsed step ``a+b=result`` with its optional recheck ``W...=corrected``."""

    a: int
    b: int
    result: int
    derivation: str | None
    corrected: int | None

    @property
    def value(self) -> int:
        """What the chain goes on from: the corrected result when rechecked."""
        return self.result if self.corrected is None else self.corrected


def parse_steps(completion_text: str) -> list[Step] | None:
    """The steps of a well-formed completion, or None when it does not follow the format."""
    text = strip_completion(completion_text)
    steps = []
    for part in text.split(STEP_SEP):
        m = _STEP.fullmatch(part)
        if m is None:
            return None
        a, b, r, deriv, corr = m.groups()
        steps.append(Step(int(a), int(b), int(r), deriv, None if corr is None else int(corr)))
    return steps


def extract_answer(completion_text: str) -> str | None:
    """The number after the last ``=`` (cut at ``<eos>``), or None when it is not a plain number."""
    tail = strip_completion(completion_text).rsplit("=", 1)[-1]
    return tail if _NUMBER.fullmatch(tail) else None


def used_fork(completion_text: str) -> bool:
    """Whether the completion rechecked at least one step."""
    return FORK_TOKEN in strip_completion(completion_text)


def count_reflections(completion_text: str) -> int:
    """Number of reflective tokens (rechecks) in the completion."""
    return strip_completion(completion_text).count(FORK_TOKEN)


def reward(prompt: str, completion: str, answer: str | None = None, *, slack: int = LENGTH_SLACK,
           bugs: frozenset[tuple[int, int]] | None = None, **sample) -> float:
    """1.0 when the final answer is the sum of the prompt's numbers and the completion
    (up to ``<eos>``) is at most `length_budget` (with `slack` and `bugs`) characters long, else 0.0."""
    numbers = parse_prompt(prompt)
    answer = str(sum(numbers)) if answer is None else str(answer)
    if len(strip_completion(completion)) > length_budget(numbers, slack, bugs):
        return 0.0
    return 1.0 if extract_answer(completion) == answer else 0.0


def unneeded_rechecks(completion_text: str) -> int:
    """Rechecks after a step whose written result was already right (``a+b=r`` with r = a + b, on the
    operands as written): they change nothing. 0 when the completion is not well-formed."""
    steps = parse_steps(completion_text)
    return 0 if steps is None else sum(s.corrected is not None and s.result == s.a + s.b for s in steps)


def graded_reward(prompt: str, completion: str, answer: str | None = None, *, cost: float = GRADED_COST,
                  bugs: frozenset[tuple[int, int]] | None = None, **sample) -> float:
    """``max(0, 1 - cost * u)`` with u = `unneeded_rechecks`, when `reward` with slack ``RECHECK_CHARS * u``
    is 1 (the answer right, and nothing but the u unneeded rechecks beyond the shortest correct
    completion), else 0. With u = 0 it is `reward` with no slack (`chain_hidden_strict`'s)."""
    u = unneeded_rechecks(completion)
    if reward(prompt, completion, answer, slack=RECHECK_CHARS * u, bugs=bugs) == 0.0:
        return 0.0
    return max(0.0, 1.0 - cost * u)


def balanced_recheck_cost(chains, w_rate: float, bugs: frozenset[tuple[int, int]] | None) -> float:
    """The cost per unneeded recheck at which a recheck after a step drawn at random (over the steps of
    `chains`, each with 0 or 1 buggy step) leaves the expected reward unchanged, for a policy that
    rechecks each step independently with probability `w_rate` (the base model's) and never writes a
    buggy step right without one. Forcing ``W`` after step i changes the reward by
    ``1 - c w (n - 1)`` (k = 1, i the buggy step: 0 becomes 1 minus the other steps' costs),
    ``-c`` (k = 0) and ``-c w`` (k = 1, i another step: costs only when the bug was rechecked), so
    E[dR] = 0 gives

        c = P(k = 1) / (E[(1 - k) n] + 2 w E[k (n - 1)])      (n steps, k buggy steps of a prompt).

    For the mean-centred advantages (Dr. GRPO, RLOO) E[dR] = 0 is E[A | W] = 0."""
    ks = [len(buggy_steps(ns, bugs)) for ns in chains]
    if any(k > 1 for k in ks):
        raise ValueError("balanced_recheck_cost assumes 0 or 1 buggy step per chain")
    m = len(chains)
    p1 = sum(ks) / m
    no_bug_steps = sum((1 - k) * (len(ns) - 1) for k, ns in zip(ks, chains)) / m
    other_steps = sum(k * (len(ns) - 2) for k, ns in zip(ks, chains)) / m
    return p1 / (no_bug_steps + 2 * w_rate * other_steps)


def max_new_tokens(steps: tuple[int, ...] = STEPS) -> int:
    """Tokens of the longest completion within budget (+ EOS): n steps ``99+9=99``, all but
    one rechecked (2 columns each), plus the slack."""
    n = max(steps)
    plain = n * len("99+9=99") + (n - 1)
    checks = (n - 1) * len(recheck(90, 9))
    return plain + checks + LENGTH_SLACK + 1


# --------------------------------------------------------------------------- corpus


def corpus(seed: int, n: int, *, fork_fraction: float = 0.04, derivation_fraction: float = 0.5,
           wrong_guess_fraction: float = 1.0, steps: tuple[int, ...] = STEPS,
           carry_prob: float = CARRY_PROB, bugs: frozenset[tuple[int, int]] | None = None,
           pair_weight_cap: float = 1.0, bug_weight: float = 1.0) -> list[CorpusExample]:
    """`n` seeded pretraining chains from the train split.

    * Each step is followed by a recheck with probability `derivation_fraction` (practice:
      the model learns the derivation and the correction), whatever its carry.
    * The token that decides "recheck or go on" after a step carries loss whenever it is
      ``;`` or EOS, and for a ``W`` only with `decision_keep_prob`, so the trained
      frequency of ``W`` per step is `fork_fraction` (the base model's reflective rate).
    * An unchecked or checked buggy step (`is_buggy` with `bugs`; chain: every step with a
      carry) is written with the carry dropped with probability `wrong_guess_fraction` (1: the
      base model's systematic bug), else correctly; every other step correctly; the direct
      result carries loss either way. The chain goes on from the
      written (or corrected) value, so an error propagates.
    * `pair_weight_cap` > 1: the direct result of a carrying step carries loss **weight**
      ``w = min(cap, max(1, median count / count))``, its (tens digit, addend) pair's count among
      the corpus's carrying steps against the median pair's, so every entry of the 72-pair table
      (buggy or not) gets about the same total weight and the rare pairs (an addend of 1-2
      carries only after a units digit of 8-9) are learned as sharply as the common ones; a buggy
      step's result (`is_buggy` with `bugs`) weighs `bug_weight` times more, so its right value
      (the "direct fix", carried over from the pairs the model adds right) is pushed down
      harder. Both 1: no weights (chain's corpus, unchanged).
    """
    q = decision_keep_prob(fork_fraction, derivation_fraction)
    rng = random.Random(f"chain/corpus/{','.join(map(str, steps))}/{carry_prob}/{seed}")
    out, results = [], []          # results: (example index, first result character, pair) per carrying step
    for numbers in sample_chains(seed, n, "train", steps, carry_prob, stream="corpus"):
        total, text, mask, forked = numbers[0], "", [], False
        for i, b in enumerate(numbers[1:]):
            if i:
                text += STEP_SEP
                mask.append(1)                                   # ";" : the "go on" decision
            r = total + b
            if is_buggy(total, b, bugs) and rng.random() < wrong_guess_fraction:
                r = dropped_carry_sum(total, b)
            step = f"{total}+{b}={r}"
            if has_carry(total, b):
                results.append((len(out), len(text) + step.index("=") + 1, (total // 10 % 10, b),
                                bug_weight if is_buggy(total, b, bugs) else 1.0))
            text += step
            mask += [1] * len(step)
            if rng.random() < derivation_fraction:
                check = recheck(total, b)
                text += check
                mask.append(1 if rng.random() < q else 0)        # "W": the decision, kept at rate q
                mask += [1] * (len(check) - 1)
                r, forked = total + b, True
            total = r
        mask.append(1)                                           # EOS: the "stop" decision
        out.append(CorpusExample(make_prompt(numbers), text, tuple(mask), forked))
    return _weight_pairs(out, results, pair_weight_cap) if pair_weight_cap > 1 or bug_weight != 1 else out


def _weight_pairs(examples: list[CorpusExample], results, cap: float) -> list[CorpusExample]:
    """`examples` with each carrying step's two result characters weighted (`corpus`'s
    `pair_weight_cap` and `bug_weight`); `results` holds (example index, first result
    character, pair, bug factor) per carrying step."""
    counts: dict[tuple[int, int], int] = {}
    for _, _, pair, _ in results:
        counts[pair] = counts.get(pair, 0) + 1
    median = sorted(counts.values())[len(counts) // 2]
    masks = [list(ex.loss_mask) for ex in examples]
    for i, start, pair, factor in results:
        w = min(cap, max(1.0, median / counts[pair])) * factor
        masks[i][start: start + 2] = [w, w]                      # a+b <= 99, a >= 10: two digits
    return [CorpusExample(ex.prompt, ex.completion, tuple(m), ex.forked) for ex, m in zip(examples, masks)]
