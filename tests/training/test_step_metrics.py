"""Every step logs its rollout metrics — rewards, lengths, tool calls, turns — over every response it sampled,
kept or dropped: also a step in which dynamic sampling dropped every group and nothing was updated."""

import math
from types import SimpleNamespace

import pytest
import torch

from cispo.data.prompts import FillReport
from cispo.foundations.experience import Completion
from cispo.training.rl_step import RLStep
from cispo.training.sampling import StepRollout


def episode(segments, reward, turn_rewards=None, tool_calls=0, tool_errors=0):
    """A multi-turn completion: segments [(role, n_tokens)], env_mask 1 on the "env" ones."""
    env = [float(role == "env") for role, n in segments for _ in range(n)]
    record = {"tool_calls": tool_calls, "tool_errors": tool_errors}
    if turn_rewards is not None:
        record["turn_rewards"] = turn_rewards
    return Completion({"prompt": "p"}, [1], torch.arange(len(env)) + 2, torch.zeros(len(env)), "eos", "t",
                      task_reward=reward, reward=reward, env_mask=torch.tensor(env), episode=record)


class NoUpdateTrainer:
    """`Trainer.step` on a step whose groups were all dropped: nothing to train on."""

    policy = None

    def step(self, groups):
        assert groups == []
        return None, {"optim/updates": 0.0, "optim/step_updates": 0.0}


def sampler(rollout):
    task = SimpleNamespace(accuracy=False, fork_tokens=(), used_fork=None)
    cfg = SimpleNamespace(data=SimpleNamespace(retire_pass_rate=None))
    return SimpleNamespace(task=task, cfg=cfg, sample=lambda policy, *_: rollout)


# Two groups of G = 2, both uninformative (equal returns in each), dropped by dynamic sampling.
#   group 0: 2 policy segments of 3 and 2 tokens around a 4-token observation; reward 1, turn rewards [0.5]
#            (return 1.5 each); 1 tool call, 0 errors
#   group 1: one 5-token policy segment, reward 0, no turn reward key (return 0); 0 calls, 1 error
DROPPED = [
    [episode([("policy", 3), ("env", 4), ("policy", 2)], 1.0, [0.5], tool_calls=1)] * 2,
    [episode([("policy", 5)], 0.0, tool_errors=1)] * 2,
]


def test_a_step_whose_groups_are_all_dropped_still_logs_rewards_lengths_and_episodes():
    rollout = StepRollout([], FillReport(rounds=1, groups_sampled=2, groups_kept=0), [], DROPPED)
    seen = []
    metrics = RLStep(NoUpdateTrainer(), sampler(rollout))(on_samples=lambda groups, exp: seen.append(groups))
    assert seen == [DROPPED]  # samples.jsonl still gets the dropped groups
    assert metrics["optim/step_updates"] == 0.0 and metrics["rollout/groups_kept"] == 0.0
    assert metrics["rollout/groups_sampled"] == 2.0 and metrics["rollout/rounds"] == 1.0
    # returns R_i: 1.5, 1.5, 0, 0 -> mean 0.75, population std 0.75
    assert metrics["rollout/reward_mean"] == pytest.approx(0.75)
    assert metrics["rollout/reward_std"] == pytest.approx(0.75)
    # policy tokens: 3 + 2 = 5 for each of the four
    assert metrics["rollout/response_length"] == 5.0 and metrics["rollout/response_length_max"] == 5.0
    assert metrics["rollout/truncated"] == 0.0
    assert metrics["rollout/tool_calls"] == pytest.approx(0.5)  # (1 + 1 + 0 + 0) / 4
    assert metrics["rollout/tool_call_rate"] == pytest.approx(0.5)
    assert metrics["rollout/tool_errors"] == pytest.approx(0.5)  # (0 + 0 + 1 + 1) / 4
    assert metrics["rollout/env_tokens"] == pytest.approx(2.0)  # (4 + 4 + 0 + 0) / 4
    assert metrics["rollout/turns"] == pytest.approx(1.5)  # (2 + 2 + 1 + 1) / 4
    assert metrics["rollout/turn_reward_mean"] == pytest.approx(0.5)  # the two rewarded turns, 0.5 each
    assert metrics["rollout/final_reward_mean"] == pytest.approx(0.5)  # (1 + 1 + 0 + 0) / 4
    assert "rollout/logp_corr" not in metrics  # needs the trainer's pass: only with an update


def test_a_batch_held_without_its_dropped_groups_reports_the_kept_ones():
    """A batch sampled ahead and held by an older checkpoint has no ``sampled``: the kept groups stand in."""
    kept = [[episode([("policy", 2)], 1.0, tool_calls=2), episode([("policy", 4)], 0.0)]]
    rollout = StepRollout(kept, FillReport(1, 1, 1), [], [])
    metrics = RLStep.rollout_metrics(SimpleNamespace(sampler=sampler(rollout)), rollout)
    assert metrics["rollout/reward_mean"] == 0.5 and metrics["rollout/response_length"] == 3.0
    assert metrics["rollout/tool_calls"] == 1.0 and math.isnan(metrics["rollout/turn_reward_mean"])
