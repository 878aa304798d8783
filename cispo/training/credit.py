"""Credit assignment of a step's batch (``algo.turn_credit``): from scored groups to the advantages the
trainer collates, and the dynamic-sampling test that goes with them.

* ``episode`` (default): one advantage per response, group-relative over the episodes' returns
  R_i = final reward + the sum of the turn rewards (`cispo.foundations.experience.Completion.episode_return`;
  ``algo.advantage_estimator``). Without turn rewards R_i is the reward and nothing changes.
* ``reward_to_go``: one advantage per policy segment, from the rewards that follow it, with the leave-one-out
  baseline over turn index (`cispo.objective.advantages.reward_to_go`, whose comment states the estimator and
  why it is unbiased); each token of segment k carries A_{i,k}, the environment's tokens 0 (masked anyway).

Policy segment k of a response is the k-th maximal run of its ``env_mask == 0`` tokens (the whole response
without an ``env_mask``); ``episode["turn_rewards"]`` holds one reward per segment the environment stepped on,
so a row cut by the length limit may hold one segment more than rewards (that segment's reward counts 0).

An episode of several training rows (`cispo.foundations.experience.Completion.rows`: an environment's context
rewrote its history) is one episode here: the group baseline is over the G episodes of a prompt, whatever
number of rows each has, and every row carries its episode's advantage (``episode``); under ``reward_to_go``
its segments are counted across its rows, in order (row r's first segment follows row r-1's last), each
token getting its segment's A_{i,k}. The advantages are laid out by training row: group by group, episode by
episode, each episode's rows in order (`training_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from cispo.foundations.experience import Completion, Group, is_informative
from cispo.objective.advantages import group_advantages, reward_to_go, segment_index, segment_to_tokens

TURN_CREDITS = ("episode", "reward_to_go")


def env_mask_of(c: Completion) -> torch.Tensor:
    """The response's env_mask [T_i], zeros (every token the policy's) for a single-turn response."""
    return torch.zeros(c.length, dtype=torch.long) if c.env_mask is None else c.env_mask


def row_segments(c: Completion) -> int:
    """The policy segments of one training row's response."""
    index = segment_index(env_mask_of(c))  # [T_i]
    return int(index.max()) + 1 if index.numel() else 0


def num_segments(c: Completion) -> int:
    """n_i: the episode's policy segments (turns), over all its rows; 1 for a single-turn response."""
    return sum(row_segments(r) for r in c.rows)


def training_rows(groups: list[Group]) -> list[Completion]:
    """The batch's training rows, group by group, episode by episode, each episode's rows in order."""
    return [r for g in groups for c in g for r in c.rows]


def rows_per_episode(groups: list[Group]) -> torch.Tensor:
    """LongTensor [N]: each episode's number of training rows (1 but where a context rewrote its history)."""
    return torch.tensor([len(c.rows) for g in groups for c in g], dtype=torch.long)


def turn_inputs(completions: list[Completion]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reward_to_go`'s inputs: turn_rewards [N, K] (0-padded; K = the most segments), final [N] (``reward``)
    and num_segments [N], in float64 (final NaN where no reward scored the response: `Completion.scored`).
    ``ValueError`` where a response has more turn rewards than segments, or more than one fewer (the
    environment steps on every segment but one cut by the length limit)."""
    n = [num_segments(c) for c in completions]
    K = max(n, default=0)
    rewards = torch.zeros(len(completions), K, dtype=torch.float64)
    for i, c in enumerate(completions):
        turns = c.turn_rewards
        if turns and not n[i] - 1 <= len(turns) <= n[i]:
            raise ValueError(f"a response with {n[i]} policy segment(s) has {len(turns)} turn reward(s): "
                             "episode['turn_rewards'] holds one per segment the environment stepped on")
        rewards[i, : len(turns)] = torch.tensor(turns, dtype=torch.float64)
    final = torch.tensor([c.reward if c.scored else math.nan for c in completions], dtype=torch.float64)
    return rewards, final, torch.tensor(n)


def segment_advantages(groups: list[Group]) -> torch.Tensor:
    """A_{i,k} of every response of ``groups`` (laid out group by group)   -> [N, K] float64"""
    flat = [c for g in groups for c in g]
    return reward_to_go(*turn_inputs(flat), len(groups[0]))


def token_advantages(completions: list[Completion], per_segment: torch.Tensor) -> torch.Tensor:
    """Each training row's tokens' advantages: its segment's (``per_segment`` [N, K], one row per episode of
    ``completions``; an episode's segments counted across its rows), 0 at the environment's tokens and past
    the response   -> [R, T] (R the training rows, `Completion.rows` in order; T the longest row)"""
    rows = [(i, r) for i, c in enumerate(completions) for r in c.rows]
    T = max((r.length for _, r in rows), default=0)
    env = torch.ones(len(rows), T, dtype=torch.long)  # padding as the environment's: no segment
    offset = torch.zeros(len(rows), 1, dtype=torch.long)  # segments of the episode's earlier rows
    seen: dict[int, int] = {}
    for j, (i, r) in enumerate(rows):
        env[j, : r.length] = env_mask_of(r)
        offset[j] = seen.get(i, 0)
        seen[i] = seen.get(i, 0) + row_segments(r)
    index = segment_index(env)  # [R, T]
    index = torch.where(index >= 0, index + offset, -1)
    episode = torch.tensor([i for i, _ in rows], dtype=torch.long)  # [R]
    return segment_to_tokens(per_segment[episode], index)  # A_it   [R, T]


def batch_advantages(groups: list[Group], algo, batch_scale=None) -> torch.Tensor:
    """The advantages of the batch of ``groups`` under ``algo.turn_credit``, one per training row
    (`training_rows`): [B] group-relative over the episodes' returns R_i (``algo.advantage_estimator``;
    ``batch_scale``: ``batch-std``'s scale over every rank), each episode's repeated on each of its rows, or
    [B, T] per token (``reward_to_go``)."""
    G = len(groups[0])
    if algo.turn_credit == "reward_to_go":
        return token_advantages([c for g in groups for c in g], segment_advantages(groups))  # A_it   [B, T]
    returns = torch.tensor([c.episode_return for g in groups for c in g])  # R_i   [N]
    A = group_advantages(returns, G, algo.advantage_estimator, batch_scale=batch_scale)  # A_i   [N]
    counts = rows_per_episode(groups)  # [N]
    return A if bool((counts == 1).all()) else A.repeat_interleave(counts)  # [B]


def informative_test(turn_credit: str) -> Callable[[Group], bool]:
    """Dynamic sampling's test of a group under ``turn_credit``: returns not all equal (``episode``), or some
    segment's advantage non-zero (``reward_to_go``: equal returns may still differ turn by turn)."""
    if turn_credit == "reward_to_go":
        return lambda group: bool(segment_advantages([group]).ne(0).any())
    return is_informative
