"""Rewards: plain callables ``(prompt, completion, **sample) -> float`` and reward shaping.

A verifier (the built-in task's, a math checker, code tests, a reward model) is any
callable with that signature; ``sample`` carries the data set's other fields (e.g.
``answer``). Shaping terms are added on top by the trainer.
"""

from __future__ import annotations

from typing import Callable

RewardFn = Callable[..., float]

__all__ = ["RewardFn", "overlong_penalty", "safe_reward", "check_reward_value"]


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


# ---------------------------------------------------------------------------------------
# Calling a reward safely
# ---------------------------------------------------------------------------------------

import concurrent.futures as _futures  # noqa: E402
import math as _math  # noqa: E402
import numbers as _numbers  # noqa: E402

_POOL: _futures.ThreadPoolExecutor | None = None


def _pool() -> _futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = _futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="cispo-reward")
    return _POOL


def check_reward_value(value) -> float:
    """The reward as a finite float, or ValueError saying what was wrong with it."""
    if isinstance(value, _numbers.Real) or hasattr(value, "__float__"):  # bool, int, float, numpy, 0-dim tensor
        out = float(value)
        if not _math.isfinite(out):
            raise ValueError(f"returned {out}")
        return out
    raise ValueError(f"returned {type(value).__name__} ({value!r:.60}), not a number")


def safe_reward(fn: RewardFn, prompt: str, completion: str, sample: dict, timeout_s: float | None = None):
    """``(reward, error)``: ``fn(prompt, completion, **sample)`` as a finite float, or
    ``(0.0, message)`` when it raised, returned something that is not a finite number
    (None, NaN, a string, …) or ran past ``timeout_s`` (then its thread is abandoned:
    Python cannot kill it). The trainer counts and logs the errors; it never crashes on them."""
    try:
        if timeout_s is None:
            value = fn(prompt, completion, **sample)
        else:
            value = _pool().submit(fn, prompt, completion, **sample).result(timeout=timeout_s)
        return check_reward_value(value), None
    except _futures.TimeoutError:
        return 0.0, f"timed out after {timeout_s} s"
    except Exception as e:  # noqa: BLE001 - a reward must never take the run down
        return 0.0, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
