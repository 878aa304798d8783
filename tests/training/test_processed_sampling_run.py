"""A run that samples from a processed distribution (rollout.top_k, min_p, top_p, repetition_penalty), with the
rollout correction weighing it against the trainer's pi_old, truncated responses masked and a cosine schedule:
it trains, its correction sees the truncation (weights pi_old / pi_rollout <= 1 at the kept tokens), and
``algo.logp_old=rollout`` is refused beside the processing."""

import pytest

from cispo.config.train import TrainConfig, apply_overrides
from cispo.config.yaml_input import ConfigError
from cispo.records.tracking import read_metrics
from cispo.training.runner import train
from tests.conftest import small_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("knob", ["top_k=5", "top_p=0.9", "min_p=0.1", "repetition_penalty=1.3"])
def test_the_samplers_log_probs_are_not_pi_old_under_processing(knob):
    with pytest.raises(ConfigError, match=r"algo\.logp_old =rollout .*top_p, top_k, min_p or repetition_penalty"):
        apply_overrides(TrainConfig(), ["algo.logp_old=rollout", knob])
    assert apply_overrides(TrainConfig(), ["algo.logp_old=rollout"]).algo.logp_old == "rollout"


def test_a_run_with_the_sampling_knobs_trains_and_its_correction_sees_the_truncation(tiny_model, dense_task, tmp_path):
    result = train(small_config(tiny_model, tmp_path, "top_k=4", "repetition_penalty=1.2", "min_p=0.02",
                                "algo.rollout_is=token", "algo.rollout_is_upper=2", "mask_truncated_completions=true",
                                "lr_scheduler_type=cosine", "warmup_updates=16", "warmup_ratio=0.25"))  # 16: default
    rows = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "rollout/is_weight_mean" in r]
    assert len(rows) == 3 and all(r["optim/updates"] > 0 for r in rows)
    # pi_old / pi_rollout at a kept token is the mass the truncation kept (<= 1) times the penalty's reweighting:
    # the mean weight is below 1, where an unprocessed on-policy run's is 1 to float rounding
    # (a step whose responses were all truncated keeps no token: it has no mean)
    weights = [r["rollout/is_weight_mean"] for r in rows if r["rollout/is_weight_mean"] is not None]
    assert len(weights) >= 2 and all(w < 0.999 for w in weights)
