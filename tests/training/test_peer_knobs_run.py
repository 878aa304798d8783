"""The knobs TRL and verl users reach for, in one run: the dppo_tv objective with an entropy bonus,
GDPO's advantages and verl's k3 rejection, on both LM-head paths; every step logs the tail of the engine gap and
the spread of the entropy."""

import math

import pytest

from cispo.records.tracking import read_metrics
from cispo.training.runner import train
from tests.conftest import small_config


@pytest.mark.parametrize("fused", ["false", "true"])
def test_a_run_with_the_peer_knobs(tiny_model, dense_task, tmp_path, fused):
    result = train(small_config(tiny_model, tmp_path, "steps=1", "eval.every=0", "objective=dppo_tv",
                                "entropy_coef=0.01", "advantage_estimator=gdpo", "algo.rollout_is=token",
                                "algo.rollout_is_mode=reject-k3", "algo.rollout_is_max_divergence=0.5",
                                f"algo.fused_head={fused}"))
    row = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    assert row["optim/updates"] == 4 and row["optim/skipped"] == 0
    assert math.isfinite(row["objective/loss"]) and 0 <= row["objective/frac_masked"] <= 1
    for key in ("rollout/ratio_out_0.9_1.1", "rollout/ratio_out_0.5_2", "rollout/ratio_max", "rollout/ratio_p99"):
        assert math.isfinite(row[key]), key
    assert row["rollout/ratio_out_0.5_2"] <= row["rollout/ratio_out_0.9_1.1"] <= 1
    if fused == "false":  # the fused head's forward gives no entropy of pi_old
        assert row["objective/entropy_p50"] <= row["objective/entropy_p80"] <= row["objective/entropy_max"]
