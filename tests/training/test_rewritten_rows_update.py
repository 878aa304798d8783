"""The trainer's update on episodes of several training rows (an environment's context rewrote the history,
``cispo.envs.rows``): the gradient is the closed form over every row's policy tokens, each row with its episode's
advantage, ``token-mean`` counting tokens and ``seq-mean-token-mean`` each row as a sequence (TRL's message mode,
SkyRL's step-wise trajectories); the rows' prompts differ from their group's, so the shared-prompt forward runs
them as prompts of their own."""

import dataclasses

import pytest
import torch

from cispo.config.train import TrainConfig, apply_overrides
from cispo.objective.loss import preset
from tests.training.test_turn_credit_update import _policy, episode, update_then_replay

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def with_rows(first, *more):
    """``first`` (an episode) continued by the rows ``more`` (each an episode whose prompt is its own)."""
    first.continuations = list(more)
    return first


def groups():
    a = with_rows(episode("ppep", 2.0, [1.0, 0.0], seed=1), episode("ppp", 0.0, seed=8))  # 2 rows
    b = episode("pepp", 1.0, [0.0, 2.0], seed=2)
    c = with_rows(episode("pp", 0.0, [0.0], seed=3), episode("pep", 0.0, seed=9), episode("p", 0.0, seed=10))
    d = episode("ppp", 1.0, seed=4)
    for x in (a, c):  # the continuation rows' turn rewards live on the episode's record
        x.episode = {"turn_rewards": x.turn_rewards + [0.5] * len(x.continuations)}
    for group, prompt in (([a, b], SHARED), ([c, d], SHARED[::-1])):  # a group's first rows share its prompt
        for x in group:
            x.prompt_ids = list(prompt)
    return [[a, b], [c, d]]


SHARED = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 4


@pytest.mark.parametrize("aggregation, share", [("token-mean", False), ("seq-mean-token-mean", False),
                                                ("token-mean", True)])
def test_the_update_over_an_episodes_rows_follows_the_closed_form_gradient(aggregation, share, monkeypatch):
    from cispo.models.policy import policy_logprobs
    from cispo.training.trainer import Trainer

    policy = _policy()
    policy.share_prompts = share
    cfg = apply_overrides(TrainConfig(), ["group_size=2", "prompts_per_step=2", "updates_per_batch=1", "grad_clip=0",
                                          "lr=1e-2", "warmup_updates=0", "advantage_estimator=rloo",
                                          *(["micro_batch_size=8", "algo.micro_batch_split_cost=null"] if share
                                            else ["micro_batch_size=2"])])
    objective = dataclasses.replace(preset("cispo"), aggregation=aggregation)
    trainer = Trainer(policy, torch.optim.SGD(policy.model.parameters(), lr=cfg.optim.lr), objective, cfg,
                      torch.Generator().manual_seed(0))
    batch = groups()
    exp = trainer.experience(batch)
    shared = []
    if share:  # each group's first rows share its prompt; the continuation rows run prompts of their own
        import cispo.models.policy as policy_module

        real = policy_module.shared_prefix_hidden
        monkeypatch.setattr(policy_module, "shared_prefix_hidden",
                            lambda body, e, rows: shared.append((len(rows[0]), len(e))) or real(body, e, rows))
    returns = [[c.episode_return for c in g] for g in batch]  # RLOO over G = 2 episodes: A = R_i - R_j
    A_episode = [g[0] - g[1] for g in returns]
    A_rows = [A_episode[0]] * 2 + [-A_episode[0]] + [A_episode[1]] * 3 + [-A_episode[1]]
    assert len(exp) == 7 and exp.advantages.tolist() == pytest.approx(A_rows)
    exp.advantages, exp.response_mask = exp.advantages.double(), exp.response_mask.double()
    with torch.no_grad():
        logp = policy_logprobs(policy.model, exp, 1.0, True)  # [B, T]
    g = torch.Generator().manual_seed(1)
    exp.logp_old = (logp + 0.5 * torch.randn(logp.shape, generator=g, dtype=torch.float64)) * exp.response_mask
    got, lp = update_then_replay(policy, trainer, exp, cfg.optim.lr)
    mask = exp.response_mask
    w = torch.exp(lp.detach() - exp.logp_old).clamp(max=5.0)  # sg(w_it)   [B, T]
    per_token = w * exp.advantages[:, None] * lp * mask  # [B, T]
    if aggregation == "token-mean":
        loss = -per_token.sum() / mask.sum()
    else:  # each training row one sequence
        loss = -(per_token.sum(-1) / mask.sum(-1)).sum() / len(exp)
    loss.backward()
    for k, p in policy.model.named_parameters():
        # the shared forward's gradient differs from the plain one by ~5e-7 here, as much without continuation rows
        tol = dict(rtol=1e-5, atol=1e-5) if share else dict(rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(got[k], p.grad, **tol, msg=k)
    assert sum(float(v.abs().sum()) for v in got.values()) > 0
    assert not share or (5, 7) in shared, "the 7 rows' 5 distinct prompts: 2 groups' shared ones + 3 continuations"
