"""Rewards: plain callables ``(prompt, completion, **sample) -> float`` and reward shaping.

A verifier (the built-in task's, a math checker, code tests, a reward model) is any
callable with that signature; ``sample`` carries the data set's other fields (e.g.
``answer``). Shaping terms are added on top by the trainer.
"""

from __future__ import annotations

from typing import Callable

RewardFn = Callable[..., float]

__all__ = ["RewardFn", "overlong_penalty"]


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
