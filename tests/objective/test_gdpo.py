"""GDPO's advantages (arXiv 2601.05242; TRL's ``multi_objective_aggregation="normalize_then_sum"``,
``algo.advantage_estimator=gdpo``): each reward normalised within its group, then the weighted sum normalised
over the batch. Pinned by hand on one batch and against TRL 1.16's own lines on random batches with rewards
that abstain (None: NaN), a completion no reward scored, and groups where a reward scored once."""

from __future__ import annotations

import math

import pytest
import torch

from cispo.foundations.experience import Completion
from cispo.objective.advantages import gdpo_advantages, gdpo_rewards, group_advantages
from cispo.training.credit import batch_advantages


def _trl_normalize_then_sum(rewards_per_func, reward_weights, num_generations):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions, the normalize_then_sum branch, line for line
    (with its own nanstd), then its nan_to_num."""
    from trl.trainer.utils import nanstd

    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = (grouped - mean_k) / (std_k + 1e-4)
    reward_k = reward_k.view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def test_gdpo_by_hand():
    """Two groups of two, two rewards (weights 1, 2): in each group a reward that differs normalises to
    +-1/sqrt(2) (std of two values a, b is |a - b| / sqrt(2)), one that is equal to 0. Group 0: r1 = (1, 0),
    r2 = (0, 0) -> Rt = (0.7071, -0.7071); group 1: r1 = (1, 1), r2 = (0, 1) -> Rt = 2 (-0.7071, 0.7071).
    Mean 0; std = sqrt((2 * 0.5 + 2 * 2) / 3) = sqrt(5 / 3) = 1.2910."""
    parts = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 2.0], dtype=torch.float64)
    s = 1 / math.sqrt(2)
    rt = gdpo_rewards(parts, w, 2, eps=0.0)
    torch.testing.assert_close(rt, torch.tensor([s, -s, -2 * s, 2 * s], dtype=torch.float64))
    A = gdpo_advantages(parts, w, 2, eps=0.0)
    torch.testing.assert_close(A, rt / math.sqrt(5 / 3))
    # the summed rewards' own GRPO (sum, then normalise) differs: group 0's sums (1, 0), group 1's (1, 3)
    plain = group_advantages((parts * w).sum(-1), 2, "grpo", eps=0.0)
    assert not torch.allclose(plain, A)


@pytest.mark.parametrize("seed", range(8))
def test_gdpo_equals_trls_normalize_then_sum(seed):
    pytest.importorskip("trl", reason="TRL is not installed")
    g = torch.Generator().manual_seed(seed)
    G, groups, K = 4, 5, 3
    parts = torch.randint(0, 3, (G * groups, K), generator=g).double() * torch.rand(K, generator=g, dtype=torch.float64)
    parts[torch.rand(parts.shape, generator=g) < 0.25] = math.nan  # rewards that abstain (None)
    parts[3] = math.nan  # a completion no reward scored
    parts[4:8, 0] = torch.tensor([math.nan, math.nan, math.nan, 1.0])  # reward 0 scores once in group 1
    w = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    want = _trl_normalize_then_sum(parts.clone(), w, G)
    got = gdpo_advantages(parts, w, G, eps=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got[3] == 0 and got.abs().sum() > 0


def _completion(parts: dict) -> Completion:
    return Completion(sample={}, prompt_ids=[1], response_ids=torch.tensor([2]), logp_rollout=torch.zeros(1),
                      finish_reason="eos", text="", reward=sum(v for v in parts.values() if v is not None),
                      reward_parts=parts)


def test_the_trainer_reads_each_rewards_score():
    """`batch_advantages` with algo.advantage_estimator=gdpo: the reward_parts of each response (None: NaN),
    data.reward_weights, cispo's eps."""
    from types import SimpleNamespace

    rows = [{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": None}, {"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 1.0}]
    groups = [[_completion(r) for r in rows[:2]], [_completion(r) for r in rows[2:]]]
    algo = SimpleNamespace(turn_credit="episode", advantage_estimator="gdpo")
    got = batch_advantages(groups, algo, reward_weights=[1.0, 2.0])
    parts = torch.tensor([[1.0, 0.0], [0.0, math.nan], [1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    want = gdpo_advantages(parts, torch.tensor([1.0, 2.0], dtype=torch.float64), 2).float()
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="gdpo"):
        group_advantages(torch.zeros(4), 2, "gdpo")


def test_gdpo_config_and_trls_name():
    from cispo.config.train import ConfigError, TrainConfig, apply_overrides

    cfg = apply_overrides(TrainConfig(), ["multi_objective_aggregation=normalize_then_sum"])
    assert cfg.algo.advantage_estimator == "gdpo"
    with pytest.raises(ConfigError, match="overlong_buffer"):
        apply_overrides(TrainConfig(), ["advantage_estimator=gdpo", "rollout.overlong_buffer=4"])
