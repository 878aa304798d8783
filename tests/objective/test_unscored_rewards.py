"""Rewards TRL users know by their numbers: a response no reward could score (every reward returned None:
NaN, left out of its group's mean and std, advantage 0) and TRL's ``scale_rewards="batch"`` (the std of the
raw rewards over the batch: ``batch-raw-std``). Hand-computed cases, then TRL 1.16's own lines on the same
rewards (skipped where trl is not installed)."""

from __future__ import annotations

import math

import pytest
import torch

from cispo.foundations.experience import Completion, is_informative
from cispo.objective.advantages import group_advantages, raw_std, reward_to_go

nan = math.nan


def test_an_unscored_reward_is_left_out_of_its_groups_mean_and_std():
    # group 0: rewards 1, 3, NaN, 5 -> mean 3 over the three scored, std sqrt(((−2)² + 0 + 2²) / 2) = 2
    # group 1: 0, NaN, NaN, 0 -> constant among the scored: all 0
    rewards = torch.tensor([1.0, 3.0, nan, 5.0, 0.0, nan, nan, 0.0])
    A = group_advantages(rewards, 4, "grpo", eps=0.0)
    assert torch.allclose(A, torch.tensor([-1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]), atol=1e-6)
    assert group_advantages(rewards, 4, "drgrpo").tolist() == [-2.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    # rloo: 1 - (3 + 5) / 2 = -3, 3 - (1 + 5) / 2 = 0, 5 - (1 + 3) / 2 = 3
    assert group_advantages(rewards, 4, "rloo").tolist() == [-3.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    assert not torch.isnan(group_advantages(rewards, 4, "batch-std")).any()


def test_a_group_with_one_scored_reward_or_none_carries_no_signal():
    rewards = torch.tensor([nan, 2.0, nan, nan, nan, nan])
    for estimator in ("grpo", "drgrpo", "rloo", "batch-std", "batch-raw-std"):
        assert group_advantages(rewards, 3, estimator).tolist() == [0.0] * 6, estimator


def test_a_fully_scored_batch_is_computed_as_before_bit_for_bit():
    """The NaN-aware code takes the same operations where every reward is scored."""
    torch.manual_seed(0)
    R = torch.randn(24)
    g = R.reshape(-1, 4)
    grpo = ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-6)).reshape(-1)
    rloo = (g - (g.sum(-1, keepdim=True) - g) / 3).reshape(-1)
    assert torch.equal(group_advantages(R, 4, "grpo"), grpo)
    assert torch.equal(group_advantages(R, 4, "drgrpo"), (g - g.mean(-1, keepdim=True)).reshape(-1))
    assert torch.equal(group_advantages(R, 4, "rloo"), rloo)


def test_batch_raw_std_divides_by_the_std_of_the_raw_rewards():
    # groups (0, 2) and (10, 12): centred -1, 1, -1, 1; the raw rewards' std is
    # sqrt(((−6)² + (−4)² + 4² + 6²) / 3) = sqrt(104 / 3); batch-std's that of the centred ones: sqrt(4 / 3)
    R = torch.tensor([0.0, 2.0, 10.0, 12.0], dtype=torch.float64)
    raw = group_advantages(R, 2, "batch-raw-std", eps=0.0)
    assert torch.allclose(raw, torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=torch.float64) / math.sqrt(104 / 3))
    centred = group_advantages(R, 2, "batch-std", eps=0.0)
    assert torch.allclose(centred, torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=torch.float64) / math.sqrt(4 / 3))
    # over ranks: the std from the sums of R and R^2 and the count
    assert math.isclose(float(raw_std(R.sum(), R.square().sum(), 4)), math.sqrt(104 / 3), rel_tol=1e-12)


def test_reward_to_go_leaves_an_unscored_episode_out_of_the_baselines():
    # one segment each, no turn reward: RLOO on the finals over the scored episodes
    final = torch.tensor([1.0, nan, 3.0, 5.0], dtype=torch.float64)
    A = reward_to_go(torch.zeros(4, 1, dtype=torch.float64), final, torch.ones(4, dtype=torch.long), 4)
    assert A[:, 0].tolist() == [-3.0, 0.0, 0.0, 3.0]


def _completion(parts: dict, reward: float = 0.0) -> Completion:
    return Completion({}, [1], torch.tensor([2]), torch.tensor([-1.0]), "eos", "x", reward, reward,
                      reward_parts=parts)


def test_a_completion_every_reward_abstained_on_has_no_return_and_no_vote_in_dynamic_sampling():
    unscored = _completion({"a": None, "b": None})
    assert not unscored.scored and math.isnan(unscored.episode_return)
    assert _completion({"a": None, "b": 0.0}).scored and _completion({}).scored  # a failed call, a built-in task
    one = _completion({"a": 1.0}, 1.0)
    assert not is_informative([one, unscored, _completion({"a": 1.0}, 1.0)])  # NaN is not "different"
    assert is_informative([one, unscored, _completion({"a": 0.0}, 0.0)])
    assert not is_informative([unscored, unscored])


def test_the_rollout_metrics_skip_an_unscored_return():
    from cispo.training.metrics import mean_std

    assert mean_std([1.0, nan, 3.0]) == (2.0, 1.0)
    assert all(math.isnan(x) for x in mean_std([nan]))


# ---------------------------------------------------------------------------------------
# TRL 1.16's own numbers (GRPOTrainer._generate_and_score_completions, sum_then_normalize)
# ---------------------------------------------------------------------------------------


def _trl_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, G: int, scale_rewards: str):
    """TRL 1.16's lines, written out with its own ``nanstd``: unscorable rows NaN, nan-aware group mean and
    std (or the batch's), advantage NaN -> 0."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), rewards


@pytest.mark.parametrize("scale_rewards, estimator", [("group", "grpo"), ("none", "drgrpo"),
                                                      ("batch", "batch-raw-std")])
def test_the_same_advantages_as_trl_with_unscorable_completions(scale_rewards, estimator):
    pytest.importorskip("trl", reason="trl is not installed")
    from cispo.data.rewards import Outcome, combine

    torch.manual_seed(1)
    G, B = 4, 16
    per_func = torch.randn(B, 2, dtype=torch.float64)
    per_func[torch.rand(B, 2) < 0.3] = nan  # a reward abstains
    per_func[[2, 9, 10]] = nan  # every reward abstains: unscorable
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    expected, trl_rewards = _trl_advantages(per_func.clone(), weights, G, scale_rewards)
    completions = []
    for row in per_func.tolist():
        outcomes = [Outcome(None if math.isnan(v) else v, None) for v in row]
        scored = combine(outcomes, weights.tolist(), ("f", "g"))
        completions.append(_completion(scored.parts, scored.value))
    returns = torch.tensor([c.episode_return for c in completions], dtype=torch.float64)
    assert torch.equal(returns.isnan(), trl_rewards.isnan())
    A = group_advantages(returns, G, estimator, eps=1e-4)
    assert (A - expected).abs().max() < 1e-7  # TRL's nanstd takes its Bessel factor count / (count - 1) in float32
    assert A[[2, 9, 10]].tolist() == [0.0, 0.0, 0.0]
