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
from typing import Callable

RewardFn = Callable[..., float]

__all__ = ["RewardFn", "overlong_penalty", "shaped_reward", "safe_reward", "score_rewards", "check_reward_value", "describe_error",
           "cap_message", "closing_reward_pools", "MESSAGE_HEAD_CHARS", "MESSAGE_TAIL_CHARS"]

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
    long message is cut (`cap_message`), one whose ``str`` itself fails is said to be unreadable."""
    try:
        message = str(e)
    except Exception as inner:  # noqa: BLE001 - a hostile __str__
        message = f"(its message could not be read: {type(inner).__name__})"
    return cap_message(f"{type(e).__name__}: {message}" if message else type(e).__name__)


def safe_reward(fn: RewardFn, prompt: str, completion: str, sample: dict):
    """``(reward, error)``: ``fn(prompt, completion, **sample)`` called here, in this thread, as a
    finite float, or ``(0.0, message)`` when it raised an Exception or returned something that is
    not a finite number (None, NaN, a string, ...). For trusted rewards: nothing bounds its time
    and a ``BaseException`` (``SystemExit``) passes; user rewards go through `score_rewards`."""
    try:
        return check_reward_value(fn(prompt, completion, **sample)), None
    except Exception as e:  # noqa: BLE001 - a reward must never take the run down
        return 0.0, describe_error(e)


def score_rewards(reward_fn: RewardFn, calls: list, timeout_s: float | None = None) -> list:
    """``[(reward, error), ...]`` for ``calls = [(prompt, completion, sample), ...]``, in order.

    Where the calls run (one rule): a `cispo.data.rewards.loading.Reward` whose ``isolated`` is set
    (by default every ``module:function`` / ``file.py:function`` reward; ``data.reward_isolation``
    overrides) runs in worker processes (`cispo.data.rewards.pool`): the whole batch is submitted at
    once, each call is killed past ``timeout_s`` and any exit or crash is one failed call. Any
    other callable (the built-in names, the built-in tasks' rewards) is trusted and called here,
    in this (main) thread, one after another, with no time limit (`safe_reward`)."""
    from cispo.data.rewards.loading import Reward

    if isinstance(reward_fn, Reward) and reward_fn.isolated:
        from cispo.data.rewards.pool import pool_for

        return pool_for(reward_fn.spec, reward_fn.workers).score(calls, timeout_s)
    return [safe_reward(reward_fn, p, c, s) for p, c, s in calls]


def start_reward_workers(reward_fn: RewardFn) -> None:
    """Start now, without waiting, the worker processes of a reward whose calls run in them
    (`score_rewards`' rule), each loading the reward as it starts; nothing for any other reward.
    A run calls it before loading its model: the workers start (~2 s: a fresh interpreter each,
    then the reward's imports) while the model loads, instead of at the first reward call."""
    from cispo.data.rewards.loading import Reward

    if isinstance(reward_fn, Reward) and reward_fn.isolated:
        from cispo.data.rewards.pool import pool_for

        pool_for(reward_fn.spec, reward_fn.workers).start()


@_contextlib.contextmanager
def closing_reward_pools():
    """Stop every reward worker pool when the block ends (normally or by an exception)."""
    try:
        yield
    finally:
        pool = _sys.modules.get("cispo.data.rewards.pool")  # never imported: nothing to stop
        if pool is not None:
            pool.shutdown_pools()
