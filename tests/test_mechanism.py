"""The mechanism check (issue 28, item 3): positive-advantage, low-probability fork tokens above
1 + eps_high (the paper's case: PPO's upper mask drops their gradient, CISPO keeps it), and the
share of the gradient-mass proxy (1 - p) |w A| that lies above the bound — on a batch whose every
number is computed by hand below."""

import math

import pytest
import torch

from cispo.experience import Experience
from cispo.metrics import MECHANISM_COUNT, mechanism_metrics, mechanism_sums
from cispo.objective import policy_loss, preset


def batch():
    """Row 0 (A = +1): a rare fork (p_old 0.05, r 1.5), a common fork (p_old 0.5, r 1.5), a plain
    token (p_old 0.5, r 1.0). Row 1 (A = -1): a rare fork above the bound (never counted: A < 0)."""
    p_old = torch.tensor([[0.05, 0.5, 0.5], [0.05, 0.5, 0.5]], dtype=torch.float64)
    r = torch.tensor([[1.5, 1.5, 1.0], [1.5, 1.0, 1.0]], dtype=torch.float64)
    logp_old = p_old.log()
    logp_new = logp_old + r.log()
    exp = Experience(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long),
                     torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64),
                     torch.tensor([1.0, -1.0], dtype=torch.float64), logp_old=logp_old)
    is_fork = torch.tensor([[True, True, False], [True, False, False]])
    return exp, logp_new, is_fork


@pytest.mark.parametrize("name, overrides, w_fork", [("cispo", {}, 1.5), ("dapo", {}, 1.5),
                                                     ("cispo", {"eps_high_is": 0.2}, 1.2)])  # the weight capped
def test_the_counts_and_the_mass_shares_by_hand(name, overrides, w_fork):
    exp, logp_new, is_fork = batch()
    _, stats = policy_loss(logp_new, exp.logp_old, exp.advantages, exp.response_mask, preset(name, **overrides))
    sums = mechanism_sums(exp, stats, is_fork, eps_high=0.2)
    assert sums["fork_pos_lowp_above"] == 1  # only row 0's rare fork: the other is common, row 1's has A < 0
    rare, common = (1 - 0.05 * 1.5) * w_fork, (1 - 0.5 * 1.5) * w_fork  # (1 - p_new) |w A|, A = 1
    assert sums["fork_mass"] == pytest.approx(rare + common) and sums["fork_mass_above"] == pytest.approx(rare + common)
    assert sums["other_mass"] == pytest.approx((1 - 0.5) * 1.0) and sums["other_mass_above"] == 0.0
    out = mechanism_metrics([sums, {**sums, "fork_pos_lowp_above": 0, "fork_mass_above": 0.0}])
    assert out[MECHANISM_COUNT] == 1.0 and out[f"{MECHANISM_COUNT}_k1"] == 1.0 and out[f"{MECHANISM_COUNT}_k2"] == 0.0
    assert out["objective/fork_pos_mass_above"] == pytest.approx(0.5)  # pooled over the two updates
    assert out["objective/fork_pos_mass_above_k2"] == 0.0 and out["objective/other_pos_mass_above"] == 0.0


def test_no_positive_fork_token_is_nan_not_zero():
    exp, logp_new, is_fork = batch()
    _, stats = policy_loss(logp_new, exp.logp_old, exp.advantages, exp.response_mask, preset("cispo"))
    sums = mechanism_sums(exp, stats, torch.zeros_like(is_fork), eps_high=0.2)
    assert math.isnan(mechanism_metrics([sums])["objective/fork_pos_mass_above"])


def test_a_run_logs_the_check_per_update(tiny_model, tmp_path):
    """Through the trainer on the built-in task (its fork token W): one value per update index."""
    from cispo.runner import train
    from cispo.tracking import read_metrics
    from conftest import small_config

    result = train(small_config(tiny_model, tmp_path, "steps=1", "eval.every=0", "dynamic_sampling=false"))
    row = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["step"] == 1][0]
    ks = sorted(int(k.rsplit("_k", 1)[1]) for k in row if k.startswith(MECHANISM_COUNT + "_k"))
    assert ks == list(range(1, int(row["optim/step_updates"]) + 1)) and ks
    assert row[MECHANISM_COUNT] == sum(row[f"{MECHANISM_COUNT}_k{k}"] for k in ks)
