"""The fork diagnostics per string and the mechanism check: positive-advantage, low-probability fork
tokens above 1 + eps_high (the paper's case: PPO's upper mask drops their gradient, CISPO keeps it), and the
share of the gradient-mass proxy (1 - p) |w A| that lies above the bound — on a batch whose every number is
computed by hand below."""

import math

import pytest
import torch

from cispo.foundations.experience import Experience
from cispo.objective.loss import policy_loss, preset
from cispo.training.metrics import FORK_COLUMNS, MECHANISM_COUNT, fork_metrics, fork_rollout_metrics, fork_sums

NAMES = ("wait", "however")
COL = {c: i for i, c in enumerate(FORK_COLUMNS)}


def batch():
    """Row 0 (A = +1): a rare "Wait" (p_old 0.05, r 1.5), a common "However" (p_old 0.5, r 1.5), a plain
    token (p_old 0.5, r 1.0). Row 1 (A = -1): a rare "Wait" above the bound (never counted as positive),
    two plain tokens."""
    p_old = torch.tensor([[0.05, 0.5, 0.5], [0.05, 0.5, 0.5]], dtype=torch.float64)
    r = torch.tensor([[1.5, 1.5, 1.0], [1.5, 1.0, 1.0]], dtype=torch.float64)
    logp_old = p_old.log()
    logp_new = logp_old + r.log()
    exp = Experience(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long),
                     torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64),
                     torch.tensor([1.0, -1.0], dtype=torch.float64), logp_old=logp_old,
                     extras={"fork_index": torch.tensor([[0, 1, -1], [0, -1, -1]])})
    return exp, logp_new


@pytest.mark.parametrize("name, overrides, w_fork, capped", [
    ("cispo", {}, 1.5, [0, 0, 0]), ("dapo", {}, 1.5, [0, 0, 0]),
    ("cispo", {"eps_high_is": 0.2}, 1.2, [2, 1, 0])])  # the weight capped at 1.2: both rows' r = 1.5 tokens
def test_the_counts_and_the_mass_shares_by_hand(name, overrides, w_fork, capped):
    exp, logp_new = batch()
    _, stats = policy_loss(logp_new, exp.logp_old, exp.advantages, exp.response_mask, preset(name, **overrides))
    sums = fork_sums(exp, stats, len(NAMES), eps_high=0.2)  # rows: wait, however, other
    column = lambda c: sums[:, COL[c]].tolist()  # noqa: E731
    assert column("tokens") == [2, 1, 3] and column("pos") == [1, 1, 1] and column("capped") == capped
    assert column("ppo_dropped") == [1, 1, 0]  # A > 0 and r = 1.5 > 1 + eps_high; row 1's A < 0, r > 1: kept
    assert column("pos_above") == [1, 1, 0]
    assert column("pos_lowp_above") == [1, 0, 0]  # only row 0's rare Wait: However is common, row 1 has A < 0
    rare, common = (1 - 0.05 * 1.5) * w_fork, (1 - 0.5 * 1.5) * w_fork  # (1 - p_new) |w A|, A = 1
    assert column("mass") == pytest.approx([rare, common, (1 - 0.5) * 1.0])
    assert column("mass_above") == pytest.approx([rare, common, 0.0])

    later = sums.clone()  # a second update in which nothing is above the bound any more
    later[:, [COL["pos_above"], COL["pos_lowp_above"], COL["mass_above"]]] = 0.0
    out = fork_metrics([sums, later], NAMES)
    assert out[MECHANISM_COUNT] == 1.0 and out[f"{MECHANISM_COUNT}_k1"] == 1.0 and out[f"{MECHANISM_COUNT}_k2"] == 0.0
    assert out["objective/fork_pos_mass_above"] == pytest.approx(0.5)  # pooled over the two updates
    assert out["objective/fork_pos_mass_above_k2"] == 0.0 and out["objective/other_pos_mass_above"] == 0.0
    # per string and per update index
    assert out["fork/wait/tokens_k1"] == 2.0 and out["fork/however/tokens_k2"] == 1.0
    assert out["fork/wait/pos_above"] == 1.0 and out["fork/wait/pos_above_k1"] == 1.0
    assert out["fork/wait/pos_above_k2"] == 0.0 and out["fork/however/pos_lowp_above"] == 0.0
    assert out["fork/wait/frac_ppo_dropped_k1"] == 0.5 and out["fork/however/frac_ppo_dropped"] == 1.0
    assert out["fork/wait/frac_capped"] == capped[0] / 2 and out["fork/other/frac_ppo_dropped_k2"] == 0.0
    assert out["fork/however/pos_mass_above_k1"] == 1.0 and out["fork/however/pos_mass_above_k2"] == 0.0
    assert out["fork/wait/pos_mass_above"] == pytest.approx(0.5) and out["fork/other/pos_mass_above"] == 0.0


def test_the_batch_as_sampled_per_string():
    exp, _ = batch()
    out = fork_rollout_metrics(exp, NAMES)
    assert out["fork/wait/count"] == 2.0 and out["fork/wait/rate"] == 1.0 and out["fork/however/rate"] == 0.5
    assert out["fork/wait/p_old"] == pytest.approx(0.05) and out["fork/wait/frac_lowp"] == 1.0
    assert out["fork/however/p_old"] == pytest.approx(0.5) and out["fork/however/frac_lowp"] == 0.0
    assert out["fork/other/count"] == 3.0 and out["fork/other/p_old"] == pytest.approx(0.5)
    assert "fork/other/rate" not in out


def test_no_positive_fork_token_is_nan_not_zero():
    exp, logp_new = batch()
    exp.extras["fork_index"] = torch.full((2, 3), -1)
    _, stats = policy_loss(logp_new, exp.logp_old, exp.advantages, exp.response_mask, preset("cispo"))
    out = fork_metrics([fork_sums(exp, stats, len(NAMES), eps_high=0.2)], NAMES)
    assert math.isnan(out["objective/fork_pos_mass_above"]) and math.isnan(out["fork/wait/frac_capped"])
    assert out["fork/wait/pos"] == 0.0 and out[MECHANISM_COUNT] == 0.0
    assert "fork/wait/tokens_k1" not in out and out["fork/other/tokens_k1"] == 6.0  # per update: sampled strings only


def test_a_run_logs_the_check_per_update(tiny_model, tmp_path):
    """Through the trainer on the built-in task (its fork token W): one value per update index."""
    from cispo.records.tracking import read_metrics
    from cispo.training.runner import train
    from tests.conftest import small_config

    result = train(small_config(tiny_model, tmp_path, "steps=1", "eval.every=0", "dynamic_sampling=false"))
    row = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["step"] == 1][0]
    ks = sorted(int(k.rsplit("_k", 1)[1]) for k in row if k.startswith(MECHANISM_COUNT + "_k"))
    assert ks == list(range(1, int(row["optim/step_updates"]) + 1)) and ks
    assert row[MECHANISM_COUNT] == sum(row[f"{MECHANISM_COUNT}_k{k}"] for k in ks)
    # the per-string block of the task's one fork string "W": every row is in one update's mini-batch
    assert sum(row.get(f"fork/w/tokens_k{k}", 0.0) for k in ks) == row["fork/w/count"]  # none: no _k keys
    assert sum(row.get(f"fork/w/pos_lowp_above_k{k}", 0.0) for k in ks) == row[MECHANISM_COUNT]
    assert sum(row[f"fork/other/tokens_k{k}"] for k in ks) == row["fork/other/count"]


def test_the_mechanism_on_every_token_by_hand():
    """The all-token measures on the batch above, with row 1's last token pushed
    down to r = 0.5 (below 1 - eps_low = 0.8): DAPO's weight is r, so the proxy (1 - r p_old) |r A| is
    row 0: 0.925 * 1.5, 0.25 * 1.5, 0.5 * 1 (A = +1); row 1: 0.925 * 1.5, 0.5 * 1, 0.75 * 0.5 (A = -1)."""
    exp, _ = batch()
    r = torch.tensor([[1.5, 1.5, 1.0], [1.5, 1.0, 0.5]], dtype=torch.float64)
    _, stats = policy_loss(exp.logp_old + r.log(), exp.logp_old, exp.advantages, exp.response_mask, preset("dapo"))
    sums = fork_sums(exp, stats, len(NAMES), eps_high=0.2, eps_low=0.2)
    out = fork_metrics([sums], NAMES)
    positive = 0.925 * 1.5 + 0.25 * 1.5 + 0.5
    negative = 0.925 * 1.5 + 0.5 + 0.75 * 0.5
    assert out["objective/all_pos_lowp_above"] == 1.0 and out["objective/all_pos_lowp_above_k1"] == 1.0
    assert out["objective/all_pos_mass_above"] == pytest.approx((0.925 * 1.5 + 0.25 * 1.5) / positive)
    assert out["objective/all_pos_mass_lowp_above"] == pytest.approx(0.925 * 1.5 / positive)
    assert out["objective/all_neg_mass_below"] == pytest.approx(0.75 * 0.5 / negative)
    assert out["objective/all_neg_mass_below_k1"] == out["objective/all_neg_mass_below"]
    # eps_low is the lower bound's own: at 0.6 (bound 0.4) no negative token is below it
    wide = fork_metrics([fork_sums(exp, stats, len(NAMES), eps_high=0.2, eps_low=0.6)], NAMES)
    assert wide["objective/all_neg_mass_below"] == 0.0
