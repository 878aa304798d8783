"""Rewards: plain callables ``(prompt, completion, **sample) -> float`` and reward shaping.

A verifier (the built-in task's, a math checker, code tests, a reward model) is any
callable with that signature; ``sample`` carries the data set's other fields (e.g.
``answer``). Functions written for TRL or verl are adapted when loaded
(`cispo.data.rewards.loading`). User rewards run in worker processes that can be killed
(`cispo.data.rewards.pool`); `score_rewards` says which path a reward takes. Shaping terms are
added on top by the trainer.
"""

from __future__ import annotations

import contextlib as _contextlib
import math as _math
import numbers as _numbers
import sys as _sys
from collections.abc import Callable
from typing import NamedTuple

from cispo.foundations.text import valid_text as _valid_text

RewardFn = Callable[..., float]

__all__ = ["RewardFn", "RewardSpecError", "Outcome", "Scored", "overlong_penalty", "shaped_reward", "safe_reward",
           "reward_outcome", "score_rewards", "score_outcomes", "score_completions", "combine", "check_reward_value",
           "describe_error", "cap_message", "closing_reward_pools", "MESSAGE_HEAD_CHARS", "MESSAGE_TAIL_CHARS"]


class RewardSpecError(ValueError):
    """A reward spec that names no usable callable (or reward model); also
    ``cispo.data.rewards.loading.RewardSpecError``."""


MESSAGE_HEAD_CHARS = MESSAGE_TAIL_CHARS = 2000
"""A reward's error message longer than their sum keeps only its first and last characters
(`cap_message`): a 20 MB exception text is neither printed nor stored whole."""


def overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13).

    With L_max = ``max_length`` and L_cache = ``cache_length``::

        0                               if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
        -1                              if |y| > L_max
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"overlong penalty needs 0 < cache_length <= max_length, got {cache_length}, {max_length}")
    safe = max_length - cache_length
    if length <= safe:
        return 0.0
    if length <= max_length:
        return (safe - length) / cache_length
    return -1.0


def shaped_reward(task_reward: float, length: int, max_length: int, overlong_buffer: int | None,
                  scope: str = "all") -> float:
    """The reward RL sees: R = task_reward + overlong_penalty(|y|) (`overlong_penalty`; 0 when
    ``overlong_buffer`` is None). ``scope="paid"``: the penalty only where task_reward > 0, so that
    R = task_reward + 1[task_reward > 0] * overlong_penalty(|y|) — it ranks long against short among
    answers the verifier pays, and cannot make a group of unpaid answers informative (all 0)."""
    if not overlong_buffer or (scope == "paid" and task_reward <= 0):
        return task_reward
    return task_reward + overlong_penalty(length, max_length, overlong_buffer)


# ---------------------------------------------------------------------------------------
# Calling a reward safely
# ---------------------------------------------------------------------------------------


def check_reward_value(value) -> float:
    """The reward as a finite float, or ValueError saying what was wrong with it."""
    if isinstance(value, _numbers.Real) or hasattr(value, "__float__"):  # bool, int, float, numpy, 0-dim tensor
        out = float(value)
        if not _math.isfinite(out):
            raise ValueError(f"returned {out}")
        return out
    raise ValueError(f"returned {type(value).__name__} ({value!r:.60}), not a number")


def cap_message(text: str, head: int = MESSAGE_HEAD_CHARS, tail: int = MESSAGE_TAIL_CHARS) -> str:
    """``text``, or, when longer than ``head + tail`` characters, its first ``head`` and last
    ``tail`` with a note of how many were cut between them."""
    if len(text) <= head + tail:
        return text
    return f"{text[:head]} [... {len(text) - head - tail} characters cut ...] {text[len(text) - tail:]}"


def describe_error(e: BaseException) -> str:
    """``"Type: message"`` (or just ``"Type"``) of an exception, for a reward's error record; a
    long message is cut (`cap_message`), one whose ``str`` itself fails is said to be unreadable, and
    a lone surrogate in it (text UTF-8 cannot write to ``samples.jsonl``) is replaced (`valid_text`)."""
    try:
        message = str(e)
    except Exception as inner:  # noqa: BLE001 - a hostile __str__
        message = f"(its message could not be read: {type(inner).__name__})"
    return _valid_text(cap_message(f"{type(e).__name__}: {message}" if message else type(e).__name__))


class Outcome(NamedTuple):
    """One reward call's result. ``value``: the reward as a finite float (0.0 when the call failed),
    or None when the reward returned None — it *abstains* (TRL's "not applicable"): among several
    rewards it is left out of the sum (`combine`); a completion on which every reward abstains
    has no reward (advantage 0, `combine`), with ``error`` saying so. ``error``: why the call failed
    (or the abstention's message), else None.
    ``extras``: ``(key, value)`` numbers the call reported besides its reward (a verl dict's other
    keys, TRL's ``log_metric`` / ``log_extra``), logged as ``rollout/reward_extra/<key>``."""

    value: float | None
    error: str | None
    extras: tuple = ()


def _returned_none() -> str:
    """The message of a reward that returned None, as `check_reward_value` words it."""
    try:
        check_reward_value(None)
    except ValueError as e:
        return describe_error(e)
    raise AssertionError("check_reward_value accepted None")


def reward_outcome(fn: RewardFn, prompt: str, completion: str, sample: dict) -> Outcome:
    """`Outcome` of ``fn(prompt, completion, **sample)`` called here, in this thread: a loaded
    `cispo.data.rewards.loading.Reward` through its ``score`` (which also gathers its extras), any
    other callable directly. An ``Exception`` or a value that is neither a finite number nor None
    (NaN, a string, ...) fails the call (``value`` 0.0); None abstains (``value`` None). A
    ``BaseException`` (``SystemExit``) passes: the worker processes catch it, trusted code is trusted."""
    from cispo.data.rewards.loading import Reward

    try:
        value, extras = fn.score(prompt, completion, **sample) if isinstance(fn, Reward) else \
            (fn(prompt, completion, **sample), ())
        if value is None:
            return Outcome(None, _returned_none(), tuple(extras))
        return Outcome(check_reward_value(value), None, tuple(extras))
    except Exception as e:  # noqa: BLE001 - a reward must never take the run down
        return Outcome(0.0, describe_error(e))


def safe_reward(fn: RewardFn, prompt: str, completion: str, sample: dict):
    """``(reward, error)``: ``fn(prompt, completion, **sample)`` called here, in this thread, as a
    finite float, or ``(0.0, message)`` when it raised an Exception or returned something that is
    not a finite number (None, NaN, a string, ...). For trusted rewards: nothing bounds its time
    and a ``BaseException`` (``SystemExit``) passes; user rewards go through `score_rewards`."""
    return as_pair(reward_outcome(fn, prompt, completion, sample))


def as_pair(outcome: Outcome) -> tuple[float, str | None]:
    """``(reward, error)`` of one reward scored alone: an abstention (None) scores 0 with its message."""
    return (0.0 if outcome.value is None else outcome.value), outcome.error


def submit_outcomes(reward_fn: RewardFn, calls: list, timeout_s: float | None = None):
    """Start scoring ``calls = [(prompt, completion, sample), ...]`` with one reward and return a
    function that waits for and returns their `Outcome` s, in order: a reward's worker processes
    start on the batch at once, so several rewards' pools run side by side while the trainer
    scores the ones that run in it (`score_completions`).

    Where the calls run (one rule): a `cispo.data.rewards.loading.Reward` whose ``isolated`` is set
    (by default every ``module:function`` / ``file.py:function`` reward; ``data.reward_isolation``
    overrides) runs in worker processes (`cispo.data.rewards.pool`): the whole batch is submitted at
    once, each call is killed past ``timeout_s`` and any exit or crash is one failed call. A reward
    model (``rm:<folder>``, `cispo.data.rewards.reward_model`) scores the batch in this process,
    batched. Any other callable (the built-in names, the built-in tasks' rewards) is trusted and
    called here, in this (main) thread, one after another, with no time limit (`reward_outcome`)."""
    from cispo.data.rewards.loading import Reward
    from cispo.data.rewards.reward_model import RewardModel

    if isinstance(reward_fn, Reward) and reward_fn.isolated:
        from cispo.data.rewards.pool import pool_for

        futures = pool_for(reward_fn.spec, reward_fn.workers).submit(calls, timeout_s)
        return lambda: [f.result() for f in futures]
    if isinstance(reward_fn, RewardModel):
        return lambda: reward_fn.score_batch(calls)
    return lambda: [reward_outcome(reward_fn, p, c, s) for p, c, s in calls]


def score_outcomes(reward_fn: RewardFn, calls: list, timeout_s: float | None = None) -> list[Outcome]:
    """The `Outcome` of each of ``calls = [(prompt, completion, sample), ...]`` with one reward, in
    order (where they run: `submit_outcomes`)."""
    return submit_outcomes(reward_fn, calls, timeout_s)()


# ---------------------------------------------------------------------------------------
# Several rewards, weighted (data.reward=[a.py:f, b.py:g], data.reward_weights)
# ---------------------------------------------------------------------------------------


class Scored(NamedTuple):
    """One completion's score: ``value`` the task reward (`combine`), ``error`` why (some of) its calls
    failed or None, ``parts`` each ``data.reward``'s value by metric name (None where it abstained;
    empty for a built-in task's reward), ``extras`` the ``(key, number)`` pairs its calls reported."""

    value: float
    error: str | None
    parts: dict
    extras: tuple


def combine(outcomes: list[Outcome], weights, names) -> Scored:
    """One completion's `Scored` from each reward's `Outcome`, TRL's rule (``GRPOTrainer``: ``nansum``
    over the functions) where TRL has one:

    * the task reward is Σ_i w_i r_i over the rewards that returned a number;
    * a reward that returned None *abstains* (TRL's "not applicable": a maths checker on a code
      prompt): it is left out of the sum and of its own ``rewards/<name>`` mean and std;
    * a failed call (raised, returned a non-number, timed out, crashed its worker) counts as r_i = 0
      and is a reward error, as one reward's failed call is (TRL stops the step instead);
    * a completion every reward abstained on is *unscorable*, as in TRL: its value is 0 here and it is a
      reward error (with one reward, its None's message), and its parts are all None, which makes its return
      NaN (`cispo.foundations.experience.Completion.scored`): it is left out of its group's mean and std
      and gets advantage 0 (`cispo.objective.advantages.group_advantages`);
    * a sum that is not finite (finite rewards and weights can overflow: 1e308 + 1e308, 1e10 * 1e308)
      scores 0 and is a reward error, as a reward that returned inf is: no advantage is made of inf.

    ``names`` None: a built-in task's reward (no parts). With several rewards each error is prefixed by
    its reward's name and joined by `` | ``. The error is valid text (`valid_text`) wherever the reward ran:
    it is written to ``samples.jsonl``."""
    several = len(outcomes) > 1
    failed = [(n, o.error) for n, o in zip(names or [None] * len(outcomes), outcomes)
              if o.error is not None and o.value is not None]
    errors = [f"{n}: {e}" if several else e for n, e in failed]
    paid = [(w, o.value) for w, o in zip(weights, outcomes) if o.value is not None]
    value = sum(w * v for w, v in paid) if paid else 0.0
    if not paid:
        errors.append("every reward returned None (none applies to it): no reward, advantage 0" if several
                      else outcomes[0].error)
    elif not _math.isfinite(value):
        errors.append(f"the weighted sum of the rewards is {value} (it overflows a float): scored 0")
        value = 0.0
    parts = dict(zip(names, (o.value for o in outcomes))) if names else {}
    return Scored(value, _valid_text(" | ".join(errors)) or None, parts, tuple(x for o in outcomes for x in o.extras))


def score_completions(reward_fn: RewardFn, calls: list, timeout_s: float | None = None) -> list[Scored]:
    """The `Scored` of each of ``calls = [(prompt, completion, sample), ...]``, in order, under
    ``reward_fn``: several rewards (`cispo.data.rewards.loading.RewardSet`), one loaded reward, or any
    callable (a built-in task's reward). Each reward keeps its own home (`submit_outcomes`): every
    worker pool gets the batch first, so the pools run side by side while the rewards that run in
    this process (built-ins, a reward model) score it; each call is killed past ``timeout_s`` where it
    runs in a worker."""
    from cispo.data.rewards.loading import RewardSet, members_of, reward_names

    members = members_of(reward_fn)
    weights = reward_fn.weights if isinstance(reward_fn, RewardSet) else (1.0,)
    waits = [submit_outcomes(m, calls, timeout_s) for m in members]  # the pools start at once
    per_reward = [wait() for wait in waits]  # [R][B]
    names = reward_names(reward_fn)
    return [combine([outcomes[j] for outcomes in per_reward], weights, names) for j in range(len(calls))]


def score_rewards(reward_fn: RewardFn, calls: list, timeout_s: float | None = None) -> list:
    """``[(reward, error), ...]`` for ``calls = [(prompt, completion, sample), ...]`` with one reward,
    in order (`score_outcomes`, each as `as_pair`); where the calls run: `submit_outcomes`."""
    return [as_pair(o) for o in score_outcomes(reward_fn, calls, timeout_s)]


def start_reward_workers(reward_fn: RewardFn) -> None:
    """Start now, without waiting, the worker processes of a reward whose calls run in them
    (`submit_outcomes`' rule; each of several rewards, `cispo.data.rewards.loading.RewardSet`), each
    loading the reward as it starts; nothing for any other reward. A run calls it before loading its
    model: the workers start (~2 s: a fresh interpreter each, then the reward's imports) while the
    model loads, instead of at the first reward call."""
    from cispo.data.rewards.loading import Reward, members_of

    for member in members_of(reward_fn):
        if isinstance(member, Reward) and member.isolated:
            from cispo.data.rewards.pool import pool_for

            pool_for(member.spec, member.workers).start()


@_contextlib.contextmanager
def closing_reward_pools():
    """Stop every reward worker pool when the block ends (normally or by an exception)."""
    try:
        yield
    finally:
        pool = _sys.modules.get("cispo.data.rewards.pool")  # never imported: nothing to stop
        if pool is not None:
            pool.shutdown_pools()
