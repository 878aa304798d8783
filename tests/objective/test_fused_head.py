"""The fused head + objective (cispo.objective.fused_head) against autograd on the naive path.

The loss, d loss / d hidden, d loss / d W (and bias) must equal those of ``naive_token_logprobs``
(full logits) followed by ``cispo.objective.loss.policy_loss`` — in float64 to rounding, for CISPO, PPO /
DAPO masks, GRPO's per-sequence aggregation, REINFORCE, a KL term, an entropy bonus, a soft cap,
a temperature, chunks that split sequences; GSPO's sequence-level ratio is refused.
"""

import pytest
import torch

from cispo.objective.fused_head import aggregation_weights, fused_head_loss, token_objective
from cispo.objective.logprobs import LogitTransform, naive_token_logprobs
from cispo.objective.loss import AGGREGATIONS, aggregate, policy_loss, preset

B, T, H, V = 5, 7, 12, 29
LBAR = torch.tensor([6.0, 6.0, 3.0, 3.0, 3.5], dtype=torch.float64)  # group mean lengths (prompt-mean-token-mean)


def inputs(dtype=torch.float64, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.7
    b = torch.randn(V, generator=g, dtype=dtype) if bias else None
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor([7, 3, 5, 1, 6])[:, None]).to(dtype)  # ragged  [B, T]
    adv = torch.randn(B, generator=g, dtype=dtype)
    # logp_old near logp_new, spread enough that ratios leave the trust region and the IS cap
    with torch.no_grad():
        lp = naive_token_logprobs(hidden, weight, targets, bias=b)
    logp_old = lp + torch.randn(B, T, generator=g, dtype=dtype) * 0.8
    logp_old[0, :2] = lp[0, :2] - 2.0  # r = e^2 > 5: above CISPO's IS cap
    logp_ref = lp + torch.randn(B, T, generator=g, dtype=dtype) * 0.3
    return hidden, weight, b, targets, mask, adv, logp_old, logp_ref


def reference(hidden, weight, b, targets, mask, adv, logp_old, cfg, logp_ref=None, entropy_coef=0.0, temperature=1.0,
              transform=None):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    logp, ent = naive_token_logprobs(hidden, weight, targets, bias=b, temperature=temperature, with_entropy=True,
                                     transform=transform)
    loss, _ = policy_loss(logp, logp_old, adv, mask, cfg, logp_ref=logp_ref, group_mean_length=LBAR)
    if entropy_coef:
        loss = loss - entropy_coef * aggregate(ent, mask, cfg.aggregation, token_sum_norm=cfg.token_sum_norm,
                                               group_mean_length=LBAR)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, None if b is None else b.grad, logp.detach()


def fused(hidden, weight, b, targets, mask, adv, logp_old, cfg, logp_ref=None, entropy_coef=0.0, temperature=1.0,
          transform=None, chunk_size=4):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    objective = token_objective(cfg, logp_old, adv, mask, logp_ref=logp_ref, entropy_coef=entropy_coef,
                                group_mean_length=LBAR)
    loss, logp, _ = fused_head_loss(hidden, weight, targets, objective, bias=b, temperature=temperature,
                                    chunk_size=chunk_size, with_entropy=bool(entropy_coef), transform=transform)
    (2.0 * loss).backward()  # the backward scales by the incoming gradient
    return (loss.detach(), hidden.grad / 2, weight.grad / 2, None if b is None else b.grad / 2, logp)


def check(ref, got, tol=1e-12):
    for r, g in zip(ref, got):
        if r is None:
            assert g is None
            continue
        torch.testing.assert_close(g, r, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["cispo", "ppo", "dapo", "grpo", "reinforce"])
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_presets_equal_autograd_in_float64(name, chunk_size):
    hidden, weight, b, targets, mask, adv, logp_old, _ = inputs()
    cfg = preset(name)
    ref = reference(hidden, weight, b, targets, mask, adv, logp_old, cfg)
    check(ref, fused(hidden, weight, b, targets, mask, adv, logp_old, cfg, chunk_size=chunk_size))
    assert ref[1].abs().sum() > 0 and ref[2].abs().sum() > 0  # a gradient that can differ


def test_masks_and_caps_are_exercised():
    hidden, weight, b, targets, mask, adv, logp_old, _ = inputs()
    with torch.no_grad():
        r = torch.exp(naive_token_logprobs(hidden, weight, targets) - logp_old)[mask.bool()]
    assert (r > 1.28).any() and (r < 0.8).any() and (r > 5.0).any()  # DAPO's high edge, PPO's low, CISPO's cap


def test_kl_entropy_bias_temperature_softcap():
    hidden, weight, b, targets, mask, adv, logp_old, logp_ref = inputs(bias=True)
    for aggregation in AGGREGATIONS:
        cfg = preset("cispo", kl_coef=0.1, aggregation=aggregation, token_sum_norm=8.0)
        kw = dict(logp_ref=logp_ref, entropy_coef=0.03, temperature=0.7,
                  transform=LogitTransform(scale=1.5, softcap=3.0))
        ref = reference(hidden, weight, b, targets, mask, adv, logp_old, cfg, **kw)
        check(ref, fused(hidden, weight, b, targets, mask, adv, logp_old, cfg, **kw))


def test_float32_close():
    hidden, weight, b, targets, mask, adv, logp_old, _ = inputs(torch.float32)
    cfg = preset("dapo")
    check(reference(hidden, weight, b, targets, mask, adv, logp_old, cfg),
          fused(hidden, weight, b, targets, mask, adv, logp_old, cfg), tol=1e-5)


def test_aggregation_weights_reproduce_aggregate():
    _, _, _, _, mask, _, _, _ = inputs()
    x = torch.randn(B, T, dtype=torch.float64)
    for aggregation in AGGREGATIONS:
        for kw in ({}, dict(num_tokens=40.0, num_seqs=9.0)):
            a = aggregation_weights(mask, aggregation, token_sum_norm=10.0, group_mean_length=LBAR, **kw)
            expected = aggregate(x, mask, aggregation, token_sum_norm=10.0, group_mean_length=LBAR, **kw)
            torch.testing.assert_close((a * x).sum(), expected, atol=1e-14, rtol=1e-14)


def test_gspo_refused():
    _, _, _, _, mask, adv, logp_old, _ = inputs()
    with pytest.raises(ValueError, match="sequence-level ratio"):
        token_objective(preset("gspo"), logp_old, adv, mask)
