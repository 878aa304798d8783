"""DPPO's divergence masks (arXiv 2602.04879, "Rethinking the Trust Region in LLM RL"): the presets ``dppo_tv``
and ``dppo_kl``, settings of eq. 6 (mask rules ``dppo-tv`` / ``dppo-kl`` with ``delta_low`` / ``delta_high``).

Pinned three ways: the per-token gradient against the closed form written out here token by token,
d loss / d log pi_it = -M_it r_it A_i / N with M from the paper's trust region on the probability
(``dppo_keeps``); one token in each corner by hand; and the loss and gradient of verl 0.9.1's own
``dppo_tv`` / ``dppo_kl`` policy losses on the same inputs (skipped where verl is not installed).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cispo.objective.fused_head import token_objective
from cispo.objective.loss import ObjectiveConfig, policy_loss, preset
from tests.objective.test_loss import dppo_keeps, float64_default, grad_of, random_batch  # noqa: F401  (fixture)

RULES = {"dppo_tv": "dppo-tv", "dppo_kl": "dppo-kl"}


def closed_form_grad(lp, lo, A, mask, cfg):
    """-M r A / N per token (token-mean, the weight r unbounded as in both presets), M = ``dppo_keeps``."""
    n = int(mask.sum())
    grad = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            lpt, lot, a = float(lp[i, t]), float(lo[i, t]), float(A[i])
            keep = dppo_keeps(lpt, lot, a, cfg.mask_rule, cfg.delta_low, cfg.delta_high)
            grad[i, t] = -math.exp(lpt - lot) * a / n if keep else 0.0
    return grad


def test_the_presets_are_the_papers_settings():
    tv, kl = preset("dppo_tv"), preset("dppo_kl")
    assert (tv.mask_rule, tv.delta_low, tv.delta_high) == ("dppo-tv", 0.15, 0.15)
    assert (kl.mask_rule, kl.delta_low, kl.delta_high) == ("dppo-kl", 0.05, 0.05)
    for cfg in (tv, kl):  # unbounded detached weight, token-level ratio and loss
        assert (cfg.eps_high_is, cfg.eps_low_is, cfg.ratio_level, cfg.aggregation) == (None, None, "token",
                                                                                        "token-mean")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 5), T=st.integers(1, 7), spread=st.sampled_from([0.05, 0.4, 2.0]))
def test_dppo_matches_the_closed_form_per_token(seed, B, T, spread):
    lp, lo, A, mask = random_batch(seed, B, T, spread=spread)
    for name in RULES:
        cfg = preset(name)
        _, g = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg)[0], lp)
        assert torch.allclose(g, closed_form_grad(lp, lo, A, mask, cfg), rtol=1e-12, atol=1e-15), name
        loose = preset(name, delta_low=0.01, delta_high=0.02)  # thresholds that bite at every spread
        _, g = grad_of(lambda x: policy_loss(x, lo, A, mask, loose)[0], lp)
        assert torch.allclose(g, closed_form_grad(lp, lo, A, mask, loose), rtol=1e-12, atol=1e-15), name


# d loss / d log pi = -M r A for one token (N = 1), where DPPO and PPO's ratio clip disagree (the paper's figure 1).
@pytest.mark.parametrize("p_old, p, A, tv, kl, ppo", [
    (1e-4, 1e-2, 1.0, -100.0, -100.0, 0.0),  # a rare token x100 (D = 0.0095): kept by DPPO, dropped by PPO
    (0.99, 0.80, -1.0, 0.0, 0.0, 0.80 / 0.99),  # a sure token down 0.19 (D = 0.181), r = 0.808: only PPO keeps it
    (0.90, 0.99, 1.0, -1.1, 0.0, -1.1),  # up 0.09 <= 0.15, but D = 0.9 ln(0.9/0.99) + 0.1 ln(10) = 0.1445 > 0.05
    (0.50, 0.70, 1.0, 0.0, 0.0, 0.0),  # up 0.2 > 0.15, D = 0.0872 > 0.05, r = 1.4 > 1.2: dropped by all three
    (0.50, 0.70, -1.0, 1.4, 1.4, 1.4),  # the same rise with A < 0: no mask stops pushing it back down
])
def test_one_token_by_hand(p_old, p, A, tv, kl, ppo):
    lp = torch.tensor([[math.log(p)]])
    lo = torch.tensor([[math.log(p_old)]])
    for cfg, want in ((preset("dppo_tv"), tv), (preset("dppo_kl"), kl), (preset("ppo"), ppo)):
        _, g = grad_of(lambda x: policy_loss(x, lo, torch.tensor([A]), torch.ones(1, 1), cfg)[0], lp)
        assert g.item() == pytest.approx(want, rel=1e-9, abs=1e-12), (cfg.mask_rule, p_old, p, A)


def test_binary_kl_by_hand():
    """0.99 -> 0.80: 0.99 ln(0.99 / 0.8) + 0.01 ln(0.01 / 0.2) = 0.21097 - 0.02996 = 0.18101 (> 0.05: dropped)."""
    from cispo.objective.loss import binary_kl
    q = torch.tensor([0.99])
    d = binary_kl(q, q.log(), torch.tensor([0.8]).log())
    assert d.item() == pytest.approx(0.99 * math.log(0.99 / 0.8) + 0.01 * math.log(0.01 / 0.2), rel=1e-6)
    assert d.item() == pytest.approx(0.18101, abs=1e-5)


@pytest.mark.parametrize("name", list(RULES))
def test_the_fused_head_objective_agrees(name):
    lp, lo, A, mask = random_batch(11, 4, 6, spread=1.0)
    cfg = preset(name, delta_low=0.02, delta_high=0.03)
    loss, g = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg)[0], lp)
    terms = token_objective(cfg, lo, A, mask)
    loss2, g2 = grad_of(lambda x: terms(x.reshape(-1), None, 0, x.numel()), lp)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12)
    assert torch.allclose(g2, g, rtol=1e-12, atol=1e-15)


def test_bad_thresholds_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="delta_high"):
        ObjectiveConfig(mask_rule="dppo-tv", delta_high=-0.1)
    with pytest.raises(ValueError, match="dppo-kl"):
        ObjectiveConfig(mask_rule="dppo_kl")


# ---------------------------------------------------------------------------------------
# verl 0.9.1's own DPPO losses on the same tokens
# ---------------------------------------------------------------------------------------


def _verl_dppo(mode, logp_new, logp_old, adv, mask, delta_low, delta_high, clip_ratio_c):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig

    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=delta_high,
                         clip_ratio_low=delta_low, clip_ratio_high=delta_high, clip_ratio_c=clip_ratio_c,
                         loss_agg_mode="token-mean",
                         global_batch_info=dict(dp_size=1, batch_num_tokens=None, global_batch_size=None,
                                                loss_scale_factor=None))
    return get_policy_loss_fn(mode)(old_log_prob=logp_old, log_prob=logp_new, advantages=adv, response_mask=mask,
                                    loss_agg_mode="token-mean", config=config, rollout_is_weights=None)


@pytest.mark.parametrize("name, mode", [("dppo_tv", "dppo_tv"), ("dppo_kl", "dppo_kl")])
@pytest.mark.parametrize("deltas", [None, (0.02, 0.04)])
@pytest.mark.parametrize("clip_ratio_c", [1e4, 2.0])  # the recipe's (off) and a cap that bites: eps_high_is = c - 1
def test_verl_dppo_losses_equal_the_presets(name, mode, deltas, clip_ratio_c):
    pytest.importorskip("verl", reason="verl is not installed")
    lp, lo, A, mask = random_batch(5, 6, 9, spread=0.6)
    adv = A[:, None].expand_as(lp).clone()
    cfg = preset(name, eps_high_is=clip_ratio_c - 1)
    if deltas:
        cfg = preset(name, eps_high_is=clip_ratio_c - 1, delta_low=deltas[0], delta_high=deltas[1])
    ref_loss, ref_grad = grad_of(lambda x: _verl_dppo(mode, x, lo, adv, mask, cfg.delta_low, cfg.delta_high,
                                                      clip_ratio_c)[0], lp)
    loss, grad = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg)[0], lp)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=1e-15)
    assert torch.allclose(grad, ref_grad, rtol=1e-12, atol=1e-15)
    _, stats = policy_loss(lp, lo, A, mask, cfg)
    verl_metrics = _verl_dppo(mode, lp, lo, adv, mask, cfg.delta_low, cfg.delta_high, clip_ratio_c)[1]
    assert stats.frac_masked == pytest.approx(verl_metrics["actor/pg_clipfrac"], abs=1e-7)  # float32 stats
    masked = (grad == 0) & mask.bool()  # the masked tokens are exactly those without a gradient
    assert 0 < int(masked.sum()) < int(mask.sum()) or deltas is None
