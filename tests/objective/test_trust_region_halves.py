"""The two halves of the trust region and the sign-decoupled IS-weight bounds.

``cispo_lowmask`` / ``cispo_highmask`` keep CISPO's capped, detached weight and add one half of
DAPO's mask; ``is_bounds_by_sign`` gives the A < 0 tokens their own weight bounds (DISPO's four
regimes). Each is pinned by its per-token gradient against the closed form written out here, token
by token — d loss / d log pi_it = -M_it * w_it * A_i / N (token-mean) — not against eq. 6's code.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cispo.objective.fused_head import token_objective
from cispo.objective.loss import ObjectiveConfig, policy_loss, preset
from tests.objective.test_loss import float64_default, grad_of, oracle_eq6, random_batch  # noqa: F401  (shared fixture)

DAPO_LOW, DAPO_HIGH = 0.2, 0.28


def closed_form_grad(lp, lo, A, mask, *, upper_mask, lower_mask, bounds_pos, bounds_neg):
    """The per-token gradient of the loss, written out: -M w A / N with w = clip(r) of the token's sign,
    M = 0 for the masked halves (A > 0, r > 1.28: upper; A < 0, r < 0.8: lower)."""
    n = int(mask.sum())
    grad = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        a = float(A[i])
        low, high = bounds_neg if a < 0 else bounds_pos
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(float(lp[i, t] - lo[i, t]))
            w = min(r, 1 + high) if high is not None else r
            w = max(w, 1 - low) if low is not None else w
            dropped = (upper_mask and a > 0 and r > 1 + DAPO_HIGH) or (lower_mask and a < 0 and r < 1 - DAPO_LOW)
            grad[i, t] = 0.0 if dropped else -w * a / n
    return grad


CASES = {
    "cispo_lowmask": dict(upper_mask=False, lower_mask=True, bounds_pos=(None, 4.0), bounds_neg=(None, 4.0)),
    "cispo_highmask": dict(upper_mask=True, lower_mask=False, bounds_pos=(None, 4.0), bounds_neg=(None, 4.0)),
}


def test_the_halves_presets_are_cispo_plus_one_half_of_dapos_mask():
    for name, rule in (("cispo_lowmask", "ppo-low"), ("cispo_highmask", "ppo-high")):
        cfg = preset(name)
        assert (cfg.mask_rule, cfg.eps_low, cfg.eps_high) == (rule, DAPO_LOW, DAPO_HIGH)
        cispo = preset("cispo")
        assert (cfg.eps_high_is, cfg.eps_low_is, cfg.aggregation, cfg.ratio_level) == \
               (cispo.eps_high_is, cispo.eps_low_is, cispo.aggregation, cispo.ratio_level)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 5), T=st.integers(1, 7), spread=st.sampled_from([0.05, 0.4, 2.0]))
def test_halves_match_the_closed_form_per_token(seed, B, T, spread):
    lp, lo, A, mask = random_batch(seed, B, T, spread=spread)
    for name, case in CASES.items():
        loss, g = grad_of(lambda x: policy_loss(x, lo, A, mask, preset(name))[0], lp)
        assert torch.allclose(g, closed_form_grad(lp, lo, A, mask, **case), rtol=1e-12, atol=1e-15), name
        assert loss.item() == pytest.approx(oracle_eq6(lp, lo, A, mask, preset(name)), rel=1e-10, abs=1e-12)


# d loss / d log pi = -M w A: the hand-computed value for each corner of the (A, r) plane.
@pytest.mark.parametrize("log_r, A, lowmask, highmask", [
    (math.log(0.5), -1.0, 0.0, 0.5),           # A < 0 below 0.8: the lower half drops it, CISPO pushes it down
    (math.log(2.0), 1.0, -2.0, 0.0),           # A > 0 above 1.28: the upper half drops it, CISPO keeps r A
    (math.log(9.0), 1.0, -5.0, 0.0),           # ... and caps the weight at 5 where it keeps it
    (math.log(2.0), -1.0, 2.0, 2.0),           # the corners no half masks keep w A in both
    (math.log(0.5), 1.0, -0.5, -0.5),
])
def test_one_token_in_each_corner(log_r, A, lowmask, highmask):
    for name, want in (("cispo_lowmask", lowmask), ("cispo_highmask", highmask)):
        lp = torch.tensor([[-1.0]])
        _, g = grad_of(lambda x: policy_loss(x, lp - log_r, torch.tensor([A]), torch.ones(1, 1), preset(name))[0], lp)
        assert g.item() == pytest.approx(want, abs=1e-12), name


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 5), T=st.integers(1, 7), spread=st.sampled_from([0.1, 1.0]),
       bounds=st.sampled_from([((0.2, 0.28), (None, 4.0)), ((None, 0.5), (0.3, None)), ((0.0, 0.0), (None, None))]))
def test_sign_decoupled_bounds_match_the_closed_form(seed, B, T, spread, bounds):
    (low_pos, high_pos), (low_neg, high_neg) = bounds
    cfg = ObjectiveConfig(eps_low_is=low_pos, eps_high_is=high_pos, is_bounds_by_sign=True, eps_low_is_neg=low_neg,
                          eps_high_is_neg=high_neg)
    lp, lo, A, mask = random_batch(seed, B, T, spread=spread)
    loss, g = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg)[0], lp)
    want = closed_form_grad(lp, lo, A, mask, upper_mask=False, lower_mask=False, bounds_pos=(low_pos, high_pos),
                            bounds_neg=(low_neg, high_neg))
    assert torch.allclose(g, want, rtol=1e-12, atol=1e-15)
    assert loss.item() == pytest.approx(oracle_eq6(lp, lo, A, mask, cfg), rel=1e-10, abs=1e-12)


def test_sign_bounds_are_off_unless_asked_and_count_as_capped():
    lp, lo, A, mask = random_batch(3, 4, 6, spread=2.0)
    plain = ObjectiveConfig(eps_low_is_neg=0.0, eps_high_is_neg=0.0)  # ignored without is_bounds_by_sign
    assert torch.equal(grad_of(lambda x: policy_loss(x, lo, A, mask, plain)[0], lp)[1],
                       grad_of(lambda x: policy_loss(x, lo, A, mask, preset("cispo"))[0], lp)[1])
    frozen = ObjectiveConfig(is_bounds_by_sign=True, eps_low_is_neg=0.0, eps_high_is_neg=0.0)  # w = 1 where A < 0
    _, stats = policy_loss(lp, lo, A, mask, frozen)
    ratio = torch.exp(lp - lo)
    neg = (A[:, None] < 0).expand_as(lp) & mask.bool()
    pos = (A[:, None] >= 0).expand_as(lp) & mask.bool()
    want = ((neg & (ratio != 1)) | (pos & (ratio > 5))).sum() / mask.sum()
    assert stats.frac_capped == pytest.approx(float(want))


@pytest.mark.parametrize("name", ["cispo_lowmask", "cispo_highmask"])
def test_the_fused_head_objective_agrees(name):
    """fused_head's chunked token objective computes the same loss and gradient as policy_loss."""
    lp, lo, A, mask = random_batch(11, 4, 6, spread=1.0)
    cfg = preset(name)
    loss, g = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg)[0], lp)
    terms = token_objective(cfg, lo, A, mask)
    loss2, g2 = grad_of(lambda x: terms(x.reshape(-1), None, 0, x.numel()), lp)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12)
    assert torch.allclose(g2, g, rtol=1e-12, atol=1e-15)


def test_unknown_mask_rule_names_the_choices():
    with pytest.raises(ValueError, match="ppo-low"):
        ObjectiveConfig(mask_rule="ppo_low")
    with pytest.raises(ValueError, match="eps_high_is_neg"):
        ObjectiveConfig(is_bounds_by_sign=True, eps_high_is_neg=-1.0)
