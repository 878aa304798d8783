"""The rollout correction on the same tokens as verl 0.9.1's and TRL 1.16's own code: verl's k1 rejection
bounds (``rollout_rs``, on pi_rollout / pi_old: cispo's bounds are their reciprocals) and a sampler log-prob
that is NaN (TRL: weight 1, still counted). Each test skips where its framework is not installed."""

from __future__ import annotations

import math

import pytest
import torch

from cispo.config.name_readers import verl_k1_bounds
from cispo.rollout.correction import rollout_is_weights


def _tokens(seed: int = 0):
    """logp_old, logp_rollout [4, 18] and a ragged response mask (71 response tokens)."""
    g = torch.Generator().manual_seed(seed)
    logp_rollout = -torch.rand(4, 18, generator=g, dtype=torch.float64) * 3
    logp_old = logp_rollout + torch.randn(4, 18, generator=g, dtype=torch.float64)  # log rho ~ N(0, 1)
    lengths = torch.tensor([18, 17, 18, 18])
    mask = (torch.arange(18) < lengths[:, None]).double()
    return logp_old, logp_rollout, mask


def test_verl_k1_bounds_are_the_reciprocals():
    assert verl_k1_bounds("0.5_5.0") == (0.2, 2.0)
    assert verl_k1_bounds(2.0) == (0.5, 2.0)  # one number U: verl's "1/U_U", symmetric
    with pytest.raises(ValueError):
        verl_k1_bounds("5.0_0.5")


@pytest.mark.parametrize("spec", ["0.5_5.0", "0.999_1.001", "2.0", "0.25_1.5"])
@pytest.mark.parametrize("option, level", [("token_k1", "token"), ("seq_sum_k1", "seq-sum"),
                                           ("seq_mean_k1", "seq-mean")])
def test_verl_rollout_rs_keeps_the_tokens_cispos_reject_keeps(option, level, spec):
    pytest.importorskip("verl", reason="verl is not installed")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    logp_old, logp_rollout, mask = _tokens()
    kept_verl, _ = compute_rollout_rejection_mask(logp_old - logp_rollout, mask, option, spec)  # verl's log_ratio
    lower, upper = verl_k1_bounds(spec)
    weights = rollout_is_weights(logp_old, logp_rollout, mask, level, "reject", lower, upper)
    assert torch.equal(weights.weight > 0, kept_verl.bool())
    if spec == "0.5_5.0" and option == "token_k1":  # read as [L, U] on cispo's rho, the old mapping: differs
        naive = rollout_is_weights(logp_old, logp_rollout, mask, level, "reject", 0.5, 5.0).weight > 0
        assert int((naive != kept_verl.bool()).sum()) > 0


@pytest.mark.parametrize("k", ["k2", "k3"])
@pytest.mark.parametrize("option, level", [("token", "token"), ("seq_sum", "seq-sum"), ("seq_mean", "seq-mean")])
@pytest.mark.parametrize("threshold", [0.02, 0.3, 2.0, 10.0])
def test_verl_k2_k3_rejection_keeps_the_tokens_cispos_keeps(k, option, level, threshold):
    pytest.importorskip("verl", reason="verl is not installed")
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    logp_old, logp_rollout, mask = _tokens(3)
    kept_verl, _ = compute_rollout_rejection_mask(logp_old - logp_rollout, mask, f"{option}_{k}", threshold)
    weights = rollout_is_weights(logp_old, logp_rollout, mask, level, f"reject-{k}", max_divergence=threshold)
    m = mask.bool()
    assert torch.equal((weights.weight > 0)[m], kept_verl.bool()[m])
    assert torch.equal(weights.masked, ~kept_verl.bool() & m)


# ---------------------------------------------------------------------------------------
# TRL 1.16: a sampler log-prob that is NaN (GRPOTrainer._generate_and_score_completions)
# ---------------------------------------------------------------------------------------


def _trl_is_ratio(logp_old, logp_sampling, mask, mode: str, clip_min, clip_max):
    """TRL 1.16's lines, written out: the NaN difference zeroed (ratio 1), the sequence ratio the product."""
    diff = torch.nan_to_num((logp_old - logp_sampling) * mask, nan=0.0)
    logps_diff = diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(logps_diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@pytest.mark.parametrize("mode, level, cispo_mode", [("token_truncate", "token", "truncate"),
                                                     ("token_mask", "token", "mask"),
                                                     ("sequence_truncate", "seq-sum", "truncate"),
                                                     ("sequence_mask", "seq-sum", "mask")])
def test_a_nan_sampler_logprob_gets_trls_weight(mode, level, cispo_mode):
    logp_old, logp_rollout, mask = _tokens(1)
    logp_old, logp_rollout = logp_old * 0.1 + logp_rollout * 0.9, logp_rollout  # small mismatch: few masked
    logp_rollout[0, 3] = logp_rollout[2, 10] = math.nan  # vLLM could not score these
    weights = rollout_is_weights(logp_old, logp_rollout, mask, level, cispo_mode, 0.5, 3.0)
    assert torch.isfinite(weights.weight).all()
    if level == "token":
        assert weights.weight[0, 3] == 1.0 and weights.weight[2, 10] == 1.0
    expected = _trl_is_ratio(logp_old, logp_rollout, mask, mode, 0.5, 3.0).expand_as(mask)
    m = mask.bool()
    assert (weights.weight[m].double() - expected[m]).abs().max() < 1e-6  # cispo's weight is float32


def test_the_nan_sampler_logprobs_are_counted_and_left_out_of_the_agreement_metrics():
    from cispo.foundations.experience import Experience
    from cispo.training.metrics import batch_metrics

    logp_old, logp_rollout, mask = (t.float() for t in _tokens(2))
    logp_rollout[1, 4] = math.nan
    exp = Experience(torch.zeros(4, 20, dtype=torch.long), torch.ones(4, 20, dtype=torch.long), mask, logp_rollout,
                     torch.zeros(4), logp_old, {"entropy": torch.ones(4, 18)})
    metrics = batch_metrics(exp)
    assert metrics["rollout/logp_rollout_nan"] == 1.0
    assert all(math.isfinite(metrics[k]) for k in ("rollout/logp_corr", "rollout/logp_abs_diff",
                                                    "rollout/mismatch_kl", "objective/entropy"))
