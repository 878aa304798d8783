"""``algo.mask_truncated_completions`` (TRL's): a response cut at max_new_tokens is left out of the loss (no
gradient, not in the token count) while its reward still counts in its group's advantages and the row still counts
as a sequence in a seq-mean aggregation (TRL's ``grpo`` loss means over every row) — against hand-computed
values and the closed-form gradient."""

import dataclasses

import pytest
import torch

from cispo.config.train import TrainConfig, apply_overrides
from cispo.foundations.experience import Completion
from cispo.objective.loss import preset
from tests.training.test_turn_credit_update import _policy, update_then_replay

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def row(reward: float, finish: str, n: int, seed: int) -> Completion:
    g = torch.Generator().manual_seed(seed)
    return Completion({"prompt": "p"}, torch.randint(3, 12, (2 + seed % 3,), generator=g).tolist(),
                      torch.randint(3, 12, (n,), generator=g), torch.zeros(n), finish, "", task_reward=reward,
                      reward=reward)


# Two groups of three; rows 1 and 3 hit max_new_tokens (5) without a stop token, row 5 the repetition stop.
GROUPS = [[row(1.0, "eos", 3, 0), row(0.0, "length", 5, 1), row(0.5, "eos", 2, 2)],
          [row(0.0, "length", 5, 3), row(1.0, "eos", 4, 4), row(1.0, "repetition", 4, 5)]]
# drgrpo by hand, every reward counted: group 1 mean 0.5 -> (0.5, -0.5, 0); group 2 mean 2/3 -> (-2/3, 1/3, 1/3)
ADVANTAGES = [0.5, -0.5, 0.0, -2 / 3, 1 / 3, 1 / 3]
TRUNCATED = [False, True, False, True, False, False]


def trainer_for(aggregation: str, mask: bool):
    from cispo.training.trainer import Trainer

    policy = _policy()
    cfg = apply_overrides(TrainConfig(), [
        "group_size=3", "prompts_per_step=2", "updates_per_batch=1", "grad_clip=0", "lr=1e-2", "warmup_updates=0",
        "advantage_estimator=drgrpo", "micro_batch_size=2", f"algo.mask_truncated_completions={str(mask).lower()}"])
    objective = dataclasses.replace(preset("cispo"), aggregation=aggregation)
    return policy, cfg, Trainer(policy, torch.optim.SGD(policy.model.parameters(), lr=cfg.optim.lr), objective, cfg,
                                torch.Generator().manual_seed(0))


def test_truncated_rows_keep_their_advantage_and_lose_their_tokens():
    _, _, trainer = trainer_for("token-mean", mask=True)
    exp = trainer.experience(GROUPS)
    torch.testing.assert_close(exp.advantages, torch.tensor(ADVANTAGES))  # the same as without the mask
    assert exp.response_mask.sum(-1).tolist() == [3, 0, 2, 0, 4, 4]  # the repetition-stopped row stays
    _, _, plain = trainer_for("token-mean", mask=False)
    unmasked = plain.experience(GROUPS)
    torch.testing.assert_close(unmasked.advantages, exp.advantages)
    assert unmasked.response_mask.sum(-1).tolist() == [3, 5, 2, 5, 4, 4]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_the_update_follows_trls_masked_loss(aggregation):
    """One SGD update: its gradient is that of -sum_it sg(w_it) A_i log pi_it over the untruncated rows' tokens,
    divided by their token count (token-mean) or, per row, by |o_i| and by all six rows (seq-mean-token-mean:
    the truncated rows count as sequences, as TRL's grpo loss's mean over the batch)."""
    from cispo.models.policy import policy_logprobs

    policy, cfg, trainer = trainer_for(aggregation, mask=True)
    exp = trainer.experience(GROUPS)
    exp.advantages = exp.advantages.double()
    exp.response_mask = exp.response_mask.double()
    with torch.no_grad():
        logp = policy_logprobs(policy.model, exp, 1.0, True)  # [B, T]
    g = torch.Generator().manual_seed(1)
    exp.logp_old = (logp + 0.5 * torch.randn(logp.shape, generator=g, dtype=torch.float64)) * exp.response_mask
    got, lp = update_then_replay(policy, trainer, exp, cfg.optim.lr)
    keep = torch.tensor([not t for t in TRUNCATED], dtype=torch.float64)  # [B]
    lengths = torch.tensor([3, 5, 2, 5, 4, 4], dtype=torch.float64)  # what was sampled
    mask = (torch.arange(lp.shape[1]) < lengths[:, None]).double() * keep[:, None]  # [B, T]
    w = torch.exp(lp.detach() - exp.logp_old).clamp(max=5.0)  # CISPO's sg(min(r, 1 + 4))
    A = exp.advantages[:, None]  # ADVANTAGES in float32 (the first test), as the trainer holds them
    terms = w * A * lp * mask  # [B, T]
    if aggregation == "token-mean":
        loss = -terms.sum() / mask.sum()  # 13 tokens
    else:
        loss = -(terms.sum(-1) / lengths).sum() / 6  # every row a sequence
    loss.backward()
    for k, p in policy.model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-8, atol=1e-10, msg=k)
    assert sum(float(v.abs().sum()) for v in got.values()) > 0
