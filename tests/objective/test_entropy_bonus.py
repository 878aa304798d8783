"""The entropy bonus (``ObjectiveConfig.entropy_coef``, ``algo.objective.entropy_coef``; verl's
``actor.entropy_coeff``): loss -= c * agg(H_it), H_it the full-vocabulary entropy of pi_theta at each response
token, with its gradient, computed chunk by chunk.

Pinned by the gradient of the LM head's input against the closed form written out here,
d(-c mean_t H_t) / dz_tj = c p_tj (log p_tj + H_t) / N (z the logits, p = softmax z), and in the trainer:
the chunked and the fused head give the same update in float64, and it differs from the update without it
by the bonus's own gradient.
"""

from __future__ import annotations

import pytest
import torch

from cispo.objective.logprobs import token_logprobs
from cispo.objective.loss import ObjectiveConfig, policy_loss, preset


def _head(seed=0, N=9, H=6, V=11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (1, N), generator=g)
    mask = (torch.arange(N) < N - 2).double()[None]  # two padding tokens   [1, N]
    return hidden, weight, targets, mask


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_the_bonus_gradient_is_the_closed_form(chunk_size):
    hidden, weight, targets, mask = _head()
    c = 0.3
    cfg = preset("cispo", entropy_coef=c)
    h = hidden.clone().requires_grad_()
    logp, ent = token_logprobs(h, weight, targets, chunk_size=chunk_size, with_entropy=True)
    # A = 0: the policy term adds nothing, the loss is the bonus alone
    loss, _ = policy_loss(logp, logp.detach(), torch.zeros(1), mask, cfg, entropy=ent)
    loss.backward()
    z = hidden[0] @ weight.T  # logits   [N, V]
    logp_all = torch.log_softmax(z, -1)  # [N, V]
    p = logp_all.exp()
    H = -(p * logp_all).sum(-1, keepdim=True)  # H_t   [N, 1]
    n = mask.sum()
    dz = c * p * (logp_all + H) / n * mask[0, :, None]  # d loss / dz_tj   [N, V]
    torch.testing.assert_close(h.grad[0], dz @ weight, rtol=1e-12, atol=1e-14)
    assert loss.item() == pytest.approx(-c * float((H[:, 0] * mask[0]).sum() / n), rel=1e-12)


def test_the_bonus_is_aggregated_like_the_policy_term_and_needs_the_entropy():
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    ent = torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = (torch.arange(5)[None] < torch.tensor([5, 2, 4])[:, None]).double()
    A = torch.randn(3, generator=g, dtype=torch.float64)
    for agg in ("token-mean", "seq-mean-token-mean"):
        base, _ = policy_loss(lp, lp, A, mask, preset("cispo", aggregation=agg))
        with_bonus, _ = policy_loss(lp, lp, A, mask, preset("cispo", aggregation=agg, entropy_coef=0.5), entropy=ent)
        if agg == "token-mean":
            want = (ent * mask).sum() / mask.sum()
        else:
            want = ((ent * mask).sum(-1) / mask.sum(-1)).mean()
        assert (base - with_bonus).item() == pytest.approx(0.5 * float(want), rel=1e-12)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, lp, A, mask, preset("cispo", entropy_coef=0.1))
    with pytest.raises(ValueError, match="entropy_coef"):
        ObjectiveConfig(entropy_coef=-1.0)


def _update_grads(fused: bool, entropy_coef: float):
    from cispo.training.trainer import Trainer
    from tests.training.test_fused_head_update import _float64_experience
    from tests.training.test_runner import _ragged_setup

    policy, exp, config = _ragged_setup(torch.float64, rows=12)
    exp = _float64_experience(exp)
    cfg = config("objective=cispo", f"algo.fused_head={str(fused).lower()}", "updates_per_batch=1",
                 "micro_batch_size=5", "grad_clip=0", f"entropy_coef={entropy_coef}")
    assert cfg.algo.objective.resolve().entropy_coef == entropy_coef
    obj = cfg.algo.objective.resolve()
    before = {k: p.detach().clone() for k, p in policy.model.named_parameters()}
    sgd = torch.optim.SGD(policy.model.parameters(), lr=cfg.optim.lr)
    Trainer(policy, sgd, obj, cfg, torch.Generator().manual_seed(3)).update(exp)
    return {k: (before[k] - p.detach()) / cfg.optim.lr for k, p in policy.model.named_parameters()}


def test_the_trainer_takes_the_bonus_on_both_heads():
    plain = _update_grads(False, 0.0)
    chunked = _update_grads(False, 0.05)
    fused = _update_grads(True, 0.05)
    for k in chunked:
        torch.testing.assert_close(fused[k], chunked[k], rtol=1e-10, atol=1e-10, msg=k)
    assert sum(float((chunked[k] - plain[k]).abs().sum()) for k in plain) > 1e-6  # the bonus moved the update


def test_per_token_entropy_metrics_by_hand():
    """H = 0.1, 0.2, 0.3, 0.4, 2.0: mean 0.6; median 0.3; p80 at place 0.8 * 4 = 3.2: 0.4 + 0.2 (2.0 - 0.4) = 0.72;
    max 2.0: the mean hides one forking token."""
    from cispo.training.metrics import entropy_metrics

    h = torch.tensor([0.3, 0.1, 2.0, 0.4, 0.2])
    got = entropy_metrics(h)
    assert got == pytest.approx({"objective/entropy": 0.6, "objective/entropy_p50": 0.3,
                                 "objective/entropy_p80": 0.72, "objective/entropy_max": 2.0})
    assert got["objective/entropy_p80"] == pytest.approx(float(torch.quantile(h, 0.8)))
    assert all(v != v for v in entropy_metrics(torch.tensor([0.1, float("nan")])).values())  # none measured: NaN
