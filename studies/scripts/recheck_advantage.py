"""The advantage a sampled ``W`` gets under a base-model-like policy, by reward and advantage estimator
(the graded-cost candidate: does a graded cost per unneeded recheck balance a context-blind ``W``?).

The policy is the measured base model reduced to two facts: ``W`` after each step independently with
probability `w` (studies/results/v3/gate/chain_hidden_sharp_base_model.json: 0.0364), and a buggy step
written with the carry dropped unless rechecked. For each of `n` training prompts of
`chain_hidden_sharp`'s stream, a group of 8 such completions is scored by the reward (`strict`:
`chain_hidden_strict`'s, no slack; `graded`: `chain.graded_reward` at `chain.GRADED_COST`) and given
group advantages (`cispo.objective.advantages`: ``grpo`` (R - mean) / std, ``drgrpo`` R - mean); every ``W`` of
the group gets its response's advantage. Printed: the mean advantage of a ``W``, split into needed
(after a buggy step) and unneeded ones.

    python -m studies.scripts.recheck_advantage 20000 studies/results/v3/gate/chain_hidden_graded_recheck_advantage.json
"""

from __future__ import annotations

import json
import random
import sys

import torch

from cispo.data.tasks import chain as ch
from cispo.objective.advantages import group_advantages

W_RATE = 0.0364
GROUP = 8
REWARDS = {"strict": lambda p, c: ch.reward(p, c, slack=0, bugs=ch.HIDDEN_BUGS),
           "graded": lambda p, c: ch.graded_reward(p, c, cost=ch.GRADED_COST, bugs=ch.HIDDEN_BUGS)}


def w_advantages(reward_name: str, estimator: str, n: int, w: float = W_RATE, seed: int = 1) -> dict:
    """Mean group advantage of the sampled ``W`` tokens, all / needed / unneeded, with their counts."""
    rng = random.Random(seed)
    sums = {"needed": [0.0, 0], "unneeded": [0.0, 0]}
    for numbers in ch.sample_chains(0, n, "train", bugs=ch.HIDDEN_BUGS, bug_range=(0, 1)):
        steps, bugs = len(numbers) - 1, set(ch.buggy_steps(numbers, ch.HIDDEN_BUGS))
        rechecked = [{i for i in range(steps) if rng.random() < w} for _ in range(GROUP)]
        prompt = ch.make_prompt(numbers)
        rewards = [REWARDS[reward_name](prompt, ch.completion(numbers, s, bugs=ch.HIDDEN_BUGS)) for s in rechecked]
        for s, a in zip(rechecked, group_advantages(torch.tensor(rewards), GROUP, estimator).tolist()):
            for i in s:
                cell = sums["needed" if i in bugs else "unneeded"]
                cell[0] += a
                cell[1] += 1
    total = sum(v[0] for v in sums.values()), sum(v[1] for v in sums.values())
    return {"mean_A_of_W": total[0] / total[1], "W": total[1],
            **{f"mean_A_{k}": v[0] / v[1] for k, v in sums.items()}, **{f"W_{k}": v[1] for k, v in sums.items()}}


def main(n: int, out: str) -> None:
    torch.set_num_threads(1)
    report = {"command": "python -m studies.scripts.recheck_advantage " + " ".join(sys.argv[1:]),
              "w_rate": W_RATE, "group_size": GROUP, "graded_cost": ch.GRADED_COST, "prompts": n,
              "cells": {f"{r}/{e}": w_advantages(r, e, n) for r in REWARDS for e in ("grpo", "drgrpo")}}
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["cells"], indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
