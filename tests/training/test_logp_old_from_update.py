"""algo.logp_old_from_update: the first update's detached log-probs stand in for
its rows' logp_old pass, bitwise: the same metrics and weights as the separate pass, one no-grad
forward over 1/K of the batch fewer."""

import json

import pytest
import torch

import cispo.training.trainer as trainer
from cispo.config.train import apply_overrides
from cispo.training.logp_old import logp_old_from_update
from cispo.training.runner import train
from tests.conftest import small_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(tiny_model, out, name, *extra):
    """Metrics (without timings) and final weights of a seeded eager run; the rows each no-grad
    policy pass of logp_old covered."""
    calls = []
    real = trainer.policy_logprobs

    def counting(model, exp, *a, **kw):
        if not torch.is_grad_enabled() and model.training:
            calls.append(len(exp))
        return real(model, exp, *a, **kw)

    trainer.policy_logprobs = counting
    try:
        cfg = small_config(tiny_model, out, f"run_name={name}", "model.compile=off", "eval.every=0",
                           "checkpoint_every=0", "threads=1", *extra)  # one thread: bitwise, whatever the load
        result = train(cfg)
    finally:
        trainer.policy_logprobs = real
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in r.items() if not k.startswith(("perf/", "time/"))} for r in rows]
    from safetensors.torch import load_file

    last = sorted((result.run_dir / "checkpoints").iterdir())[-1]  # the checkpoint at the end
    return metrics, load_file(last / "model" / "model.safetensors"), calls


@pytest.mark.parametrize("schedule", [("updates_per_batch=4", "micro_batch_size=3"),
                                      ("updates_per_batch=1", "algo.epochs=2", "micro_batch_size=3")],
                         ids=["K=4", "K=1,epochs=2"])
def test_same_run_bit_for_bit(tiny_model, tmp_path, dense_task, schedule):
    """On and off: identical metrics (NaN-aware) and weights, bit for bit; on, the no-grad logp_old
    pass covers B - B/K rows per step (none at K=1), off all B. Micro-batches of 3 rows: a row's
    log-prob depends on its micro-batch by float rounding, so this fails if the separate pass
    ran the first mini-batch's rows as other micro-batches than the update does (checked)."""
    on = _run(tiny_model, tmp_path, "on", *schedule, "algo.logp_old_from_update=true")
    off = _run(tiny_model, tmp_path, "off", *schedule, "algo.logp_old_from_update=false")
    assert json.dumps(on[0]) == json.dumps(off[0])  # NaN == NaN as text
    assert all(torch.equal(on[1][n], off[1][n]) for n in off[1])
    B, K = 4 * 4, 4 if "updates_per_batch=4" in schedule else 1
    steps = 3  # small_config
    assert sum(off[2]) == steps * B
    assert sum(on[2]) == steps * (B - B // K)


@pytest.mark.parametrize("extra,expected", [
    ((), True),
    (("algo.logp_old_from_update=false",), False),
    (("model.dropout=true",), False),
    (("algo.tis_cap=2",), False),
    (("algo.rollout_is=seq-mean", "algo.rollout_is_mode=mask"), False),
    (("algo.fused_head=true",), False),
])
def test_where_it_applies(tiny_model, tmp_path, extra, expected):
    cfg = small_config(tiny_model, tmp_path, *extra)
    policy = type("P", (), {"model": torch.nn.Linear(1, 1)})()
    assert logp_old_from_update(cfg, policy) is expected
    assert apply_overrides(cfg, []).algo.logp_old_from_update == ("algo.logp_old_from_update=false" not in extra)
