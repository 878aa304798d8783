"""The rollout correction (cispo.rollout.correction): rho = pi_old / pi_rollout per token, per
sequence as the geometric mean (seq-mean) or as the product (seq-sum), truncated / masked (IcePop) / rejected, pinned on
hand-computed fixed ratios (values and which tokens are masked or truncated); its weight enters the
gradient as a constant; its config and metrics; a run with it."""

import math

import pytest
import torch

from cispo.config.train import ConfigError, TrainConfig, apply_overrides
from cispo.objective.loss import policy_loss, preset
from cispo.records.tracking import read_metrics
from cispo.rollout import rollout_is_weights, truncated_is_weights
from cispo.training.logp_old import rollout_correction
from cispo.training.metrics import mismatch_kl, mismatch_tail
from cispo.training.runner import train
from tests.conftest import small_config

F64 = dict(dtype=torch.float64)
# rho = pi_old / pi_rollout of 6 response tokens (row 1 has 2, then padding); logp_rollout = 0
RHO = torch.tensor([[0.25, 1.0, 3.0, 8.0], [0.6, 1.5, 1.0, 1.0]], **F64)
MASK = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]], **F64)
LOGP_OLD = torch.log(RHO)
LOGP_ROLLOUT = torch.zeros_like(RHO)
T, F = True, False


def weights(level, mode, lower, upper):
    return rollout_is_weights(LOGP_OLD, LOGP_ROLLOUT, MASK, level, mode, lower, upper)


# (level, mode, lower, upper) -> the weights c_it, the masked and the truncated tokens, by hand
GEO0, GEO1 = 6.0 ** 0.25, 0.9 ** 0.5  # geometric means: (0.25 * 1 * 3 * 8)^(1/4), (0.6 * 1.5)^(1/2)
CASES = {
    # TIS (tis_cap = 2): min(rho, 2)
    ("token", "truncate", None, 2.0): ([[0.25, 1, 2, 2], [0.6, 1.5, 0, 0]], [[F] * 4, [F] * 4],
                                       [[F, F, T, T], [F] * 4]),
    # TRL's token_truncate with both bounds: clip(rho, 0.5, 2)
    ("token", "truncate", 0.5, 2.0): ([[0.5, 1, 2, 2], [0.6, 1.5, 0, 0]], [[F] * 4, [F] * 4],
                                      [[T, F, T, T], [F] * 4]),
    # IcePop (verl's decoupled_token_icepop bounds): rho inside [0.5, 5], 0 outside
    ("token", "mask", 0.5, 5.0): ([[0, 1, 3, 0], [0.6, 1.5, 0, 0]], [[T, F, F, T], [F] * 4], [[F] * 4, [F] * 4]),
    # rejection: 1 inside, 0 outside
    ("token", "reject", 0.5, 5.0): ([[0, 1, 1, 0], [1, 1, 0, 0]], [[T, F, F, T], [F] * 4], [[F] * 4, [F] * 4]),
    # one upper bound only masks above it
    ("token", "mask", None, 2.0): ([[0.25, 1, 0, 0], [0.6, 1.5, 0, 0]], [[F, F, T, T], [F] * 4], [[F] * 4, [F] * 4]),
    # the geometric mean of each response: row 0's 1.565 is capped at 1.2 on all its tokens, row 1's 0.949 kept
    ("seq-mean", "truncate", None, 1.2): ([[1.2] * 4, [GEO1, GEO1, 0, 0]], [[F] * 4, [F] * 4], [[T] * 4, [F] * 4]),
    ("seq-mean", "mask", 0.9, 1.2): ([[0] * 4, [GEO1, GEO1, 0, 0]], [[T] * 4, [F] * 4], [[F] * 4, [F] * 4]),
    # the same bounds keep row 0 as a geometric mean (1.565) and drop it as a product (6 > 5)
    ("seq-mean", "reject", 0.5, 5.0): ([[1] * 4, [1, 1, 0, 0]], [[F] * 4, [F] * 4], [[F] * 4, [F] * 4]),
    ("seq-sum", "reject", 0.5, 5.0): ([[0] * 4, [1, 1, 0, 0]], [[T] * 4, [F] * 4], [[F] * 4, [F] * 4]),
    ("seq-sum", "truncate", None, 3.0): ([[3] * 4, [0.9, 0.9, 0, 0]], [[F] * 4, [F] * 4],
                                                  [[T] * 4, [F] * 4]),
    ("seq-sum", "mask", 0.95, None): ([[6] * 4, [0, 0, 0, 0]], [[F] * 4, [T, T, F, F]], [[F] * 4, [F] * 4]),
}


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "-".join(map(str, c)))
def test_weights_and_flags_hand_computed(case):
    want, masked, truncated = CASES[case]
    c = weights(*case)
    torch.testing.assert_close(c.weight, torch.tensor(want, dtype=torch.float32), atol=1e-6, rtol=0)
    assert c.weight.dtype == torch.float32 and not c.weight.requires_grad
    assert c.masked.tolist() == masked and c.truncated.tolist() == truncated


def test_metrics_are_shares_of_response_tokens():
    m = weights("token", "mask", 0.5, 5.0).metrics(MASK)
    assert m == {"rollout/is_weight_mean": pytest.approx((1 + 3 + 0.6 + 1.5) / 6), "rollout/is_masked": 2 / 6,
                 "rollout/is_truncated": 0.0}
    m = weights("token", "truncate", 0.5, 2.0).metrics(MASK)
    assert (m["rollout/is_masked"], m["rollout/is_truncated"]) == (0.0, 3 / 6)
    assert all(math.isnan(v) for v in weights("token", "mask", 0.5, 5.0).metrics(torch.zeros_like(MASK)).values())


def test_tis_is_the_token_truncate_case():
    args = (LOGP_OLD.float(), LOGP_ROLLOUT.float(), MASK.float())
    tis = truncated_is_weights(*args, cap=2.0)
    assert torch.equal(tis, rollout_is_weights(*args, "token", "truncate", None, 2.0).weight)
    assert rollout_correction(TrainConfig().algo) is None
    algo = apply_overrides(TrainConfig(), ["algo.tis_cap=2.5"]).algo
    assert rollout_correction(algo) == dict(level="token", mode="truncate", lower=None, upper=2.5)
    algo = apply_overrides(TrainConfig(), ["rollout_is=seq-mean", "rollout_is_mode=mask", "rollout_is_lower=0.5",
                                           "rollout_is_upper=5"]).algo
    assert rollout_correction(algo) == dict(level="seq-mean", mode="mask", lower=0.5, upper=5.0)


def test_weight_is_detached_and_finite_for_huge_ratios():
    lo = torch.tensor([[0.0, 500.0, -500.0]], requires_grad=True, **F64)
    for level in ("token", "seq-mean", "seq-sum"):
        c = rollout_is_weights(lo, torch.zeros(1, 3, **F64), torch.ones(1, 3, **F64), level, "mask", 0.5, 5.0)
        assert not c.weight.requires_grad and torch.isfinite(c.weight).all()
    c = rollout_is_weights(lo, torch.zeros(1, 3, **F64), torch.ones(1, 3, **F64), "token", "truncate", 0.1, 3.0)
    assert c.weight.tolist() == [[1.0, 3.0, pytest.approx(0.1)]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="level"):
        weights("seq", "mask", 0.5, 5.0)
    with pytest.raises(ValueError, match="mode"):
        weights("token", "clip", 0.5, 5.0)
    with pytest.raises(ValueError, match="lower must be < upper"):
        weights("token", "mask", 5.0, 0.5)
    with pytest.raises(ValueError, match="needs a bound"):
        weights("token", "mask", None, None)
    with pytest.raises(ValueError, match="upper"):
        weights("token", "mask", None, 0.0)
    with pytest.raises(ValueError, match="shape"):
        rollout_is_weights(LOGP_OLD, LOGP_ROLLOUT[:, :2], MASK)


@pytest.mark.parametrize("name", ["cispo", "dapo"])
def test_gradient_carries_the_weight_as_a_constant(name):
    """d loss / d log pi_it = -c_it * sg(w_it) * A_i * M_it / N: the correction multiplies the advantage once,
    on top of the objective's own IS weight w of r = pi_theta / pi_old."""
    c = weights("token", "mask", 0.5, 5.0).weight.double()  # [[0, 1, 3, 0], [0.6, 1.5, 0, 0]]
    A = torch.tensor([1.0, -2.0], **F64)
    log_r = torch.tensor([[0.1, 1.9, 0.3, 0.0], [-0.4, 0.05, 0.0, 0.0]], **F64)  # r = e^1.9 = 6.7 > 5: capped
    logp_old = torch.full((2, 4), -1.0, **F64)
    lp = (logp_old + log_r).requires_grad_()
    cfg = preset(name)
    loss, _ = policy_loss(lp, logp_old, A[:, None] * c, MASK, cfg)
    loss.backward()
    r = log_r.exp()
    w = r.clamp(max=5.0) if name == "cispo" else r
    keep = torch.ones_like(r)
    if name == "dapo":  # PPO's mask, 0.2 / 0.28, of the corrected advantage's sign (c >= 0: A's)
        keep = torch.where(((A[:, None] > 0) & (r > 1.28)) | ((A[:, None] < 0) & (r < 0.8)), 0.0, 1.0)
    want = -c * w * A[:, None] * keep * MASK / MASK.sum()
    torch.testing.assert_close(lp.grad, want, atol=1e-15, rtol=1e-12)
    assert lp.grad[0, 0] == 0 and lp.grad[0, 3] == 0  # the masked tokens: no gradient


def test_mismatch_kl_hand_computed():
    k3 = [x - 1 - math.log(x) for x in (0.25, 1.0, 3.0, 8.0, 0.6, 1.5)]
    assert mismatch_kl(LOGP_OLD, LOGP_ROLLOUT, MASK.bool()) == pytest.approx(sum(k3) / 6)
    assert mismatch_kl(LOGP_OLD, LOGP_OLD, MASK.bool()) == 0.0
    assert math.isnan(mismatch_kl(LOGP_OLD, LOGP_ROLLOUT, torch.zeros(2, 4, dtype=torch.bool)))


def test_k2_k3_rejection_hand_computed():
    """d = (ln rho)^2 / 2 (k2) and rho - 1 - ln rho (k3) of rho = 0.25, 1, 3, 8 | 0.6, 1.5:
    k2 = 0.961, 0, 0.603, 2.162 | 0.130, 0.082;  k3 = 0.636, 0, 0.901, 4.921 | 0.111, 0.095.
    At 0.7 the two keep different tokens (0.25 by k3 only, 3 by k2 only); at seq-mean k3 the rows' means are
    1.615 and 0.103, so 1.0 rejects row 0 whole."""
    k2 = rollout_is_weights(LOGP_OLD, LOGP_ROLLOUT, MASK, "token", "reject-k2", max_divergence=0.7)
    k3 = rollout_is_weights(LOGP_OLD, LOGP_ROLLOUT, MASK, "token", "reject-k3", max_divergence=0.7)
    assert k2.weight.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]
    assert k3.weight.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]
    assert k3.masked.tolist() == [[F, F, T, T], [F, F, F, F]] and not k3.truncated.any()
    seq = rollout_is_weights(LOGP_OLD, LOGP_ROLLOUT, MASK, "seq-mean", "reject-k3", max_divergence=1.0)
    assert seq.weight.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    assert seq.metrics(MASK)["rollout/is_masked"] == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="max_divergence"):
        rollout_is_weights(LOGP_OLD, LOGP_ROLLOUT, MASK, "token", "reject-k2")


def test_k2_k3_rejection_config():
    ok = apply_overrides(TrainConfig(), ["rollout_is=seq-mean", "rollout_is_mode=reject-k3",
                                         "rollout_is_max_divergence=0.01"])
    assert rollout_correction(ok.algo)["max_divergence"] == 0.01
    for overrides, words in ((["rollout_is=token", "rollout_is_mode=reject-k2"], "set it"),
                             (["rollout_is=token", "rollout_is_max_divergence=0.1"], "leave it out"),
                             (["rollout_is=token", "rollout_is_mode=reject-k2", "rollout_is_max_divergence=0.1",
                               "rollout_is_lower=0.5"], "is not read")):
        with pytest.raises(ConfigError, match=words):
            apply_overrides(TrainConfig(), overrides)


def test_mismatch_tail_hand_computed():
    """rho of the 6 tokens: 0.25, 1, 3, 8, 0.6, 1.5. Outside [0.9, 1.1]: all but the 1 (5/6); outside [0.5, 2]:
    0.25, 3, 8 (3/6); sorted 0.25, 0.6, 1, 1.5, 3, 8: p99 at place 0.99 * 5 = 4.95, 3 + 0.95 (8 - 3) = 7.75."""
    tail = mismatch_tail(LOGP_OLD, LOGP_ROLLOUT, MASK.bool())
    assert tail == pytest.approx({"rollout/ratio_out_0.9_1.1": 5 / 6, "rollout/ratio_out_0.5_2": 3 / 6,
                                  "rollout/ratio_max": 8.0, "rollout/ratio_min": 0.25, "rollout/ratio_p99": 7.75})
    rho = RHO[MASK.bool()]
    assert tail["rollout/ratio_p99"] == pytest.approx(float(torch.quantile(rho, 0.99)))
    same = mismatch_tail(LOGP_OLD, LOGP_OLD, MASK.bool())
    assert same["rollout/ratio_out_0.9_1.1"] == 0.0 and same["rollout/ratio_max"] == 1.0
    empty = mismatch_tail(LOGP_OLD, LOGP_ROLLOUT, torch.zeros(2, 4, dtype=torch.bool))
    assert len(empty) == 5 and all(math.isnan(v) for v in empty.values())


def test_the_tail_metrics_are_logged_with_the_mismatch():
    """Every step that has a behaviour policy logs them beside rollout/logp_abs_diff (``batch_metrics``), a
    sampler NaN left out as in the other agreement metrics."""
    from cispo.foundations.experience import Experience
    from cispo.training.metrics import batch_metrics

    logp_rollout = LOGP_ROLLOUT.clone()
    logp_rollout[0, 1] = math.nan  # the rho = 1 token: left out, 5 of 5 outside [0.9, 1.1]
    exp = Experience(torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long), MASK, logp_rollout,
                     torch.zeros(2), LOGP_OLD, {"entropy": torch.ones(2, 4)})
    metrics = batch_metrics(exp)
    assert metrics["rollout/ratio_out_0.9_1.1"] == 1.0 and metrics["rollout/ratio_max"] == pytest.approx(8.0)
    assert "rollout/logp_abs_diff" in metrics


@pytest.mark.parametrize("overrides, problem", [
    (["rollout_is=token", "tis_cap=2"], "algo.tis_cap cannot be set with algo.rollout_is=token"),
    (["rollout_is=seq-mean", "rollout_is_upper=null"], "algo.rollout_is needs a bound"),
    (["rollout_is_lower=3", "rollout_is_upper=2"], "algo.rollout_is_upper must be > algo.rollout_is_lower"),
    (["rollout_is_lower=-1"], "algo.rollout_is_lower must be >= 0"),
    (["rollout_is=token", "rollout_is_mode=mask", "rollout_is_lower=1.5", "rollout_is_upper=2"],
     "algo.rollout_is_lower = 1.5 must be <= 1: an on-policy token's ratio is 1"),
    (["rollout_is=sequence"], "expected one of 'token', 'seq-mean', 'seq-sum'"),  # not verl's word
    (["rollout_is_mode=clip"], "expected one of 'truncate', 'mask', 'reject'"),
])
def test_config_refuses(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        apply_overrides(TrainConfig(), overrides)


# ---------------------------------------------------------------------------------------
# In a run: the tiny model samples with the trainer's own weights (rho ~ 1), so bounds below 1 act on
# every token: all masked (no gradient: the weights stay), or all truncated.
# ---------------------------------------------------------------------------------------


def test_a_run_logs_the_mismatch_and_its_correction(tiny_model, dense_task, tmp_path):
    result = train(small_config(tiny_model, tmp_path, "steps=1", "eval.every=0", "rollout_is=seq-sum",
                                "rollout_is_mode=truncate", "rollout_is_upper=1e-3"))
    row = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    assert row["optim/updates"] == 4 and row["optim/skipped"] == 0
    assert row["rollout/is_truncated"] == 1.0 and row["rollout/is_masked"] == 0.0
    assert row["rollout/is_weight_mean"] == pytest.approx(1e-3)
    assert 0.0 <= row["rollout/mismatch_kl"] < 1e-4


def test_a_fully_masked_batch_moves_nothing(tiny_model, dense_task, tmp_path):
    from safetensors.torch import load_file

    result = train(small_config(tiny_model, tmp_path, "steps=1", "eval.every=0", "rollout_is=token",
                                "rollout_is_mode=mask", "rollout_is_upper=1e-3"))
    row = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    assert row["rollout/is_masked"] == 1.0 and row["rollout/is_weight_mean"] == 0.0
    assert row["objective/loss"] == 0.0
    ckpt = sorted((result.run_dir / "checkpoints").iterdir())[-1]
    moved, base = load_file(ckpt / "model" / "model.safetensors"), load_file(tiny_model / "model.safetensors")
    assert all(torch.equal(moved[k], base[k]) for k in base)
