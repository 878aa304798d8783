"""``algo.fused_head``: the trainer's update with the fused LM head + objective (cispo.objective.fused_head)
equals the chunked path's — the same gradients in float64, the same logged metrics in float32 —
and the combinations it cannot do are refused at config time."""

import math

import pytest
import torch

from cispo.config.train import TrainConfig, apply_overrides
from cispo.objective.loss import preset
from cispo.records.tracking import read_metrics
from cispo.training.runner import train
from tests.conftest import small_config, strip_perf
from tests.training.test_runner import _ragged_setup


@pytest.fixture
def fused_calls(monkeypatch):
    """How often the trainer's updates ran the fused head (``cispo.models.policy.fused_head_loss``)."""
    import cispo.models.policy

    calls = []
    real = cispo.models.policy.fused_head_loss

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cispo.models.policy, "fused_head_loss", spy)
    return calls


def _float64_experience(exp, seed=5):
    """The batch's float fields in float64, with a log pi_ref and truncated-IS weights."""
    g = torch.Generator().manual_seed(seed)
    exp.response_mask = exp.response_mask.double()
    exp.advantages = exp.advantages.double()
    exp.logp_old = exp.logp_old.double()
    exp.logp_old[::3, 0] -= 6.0  # a few tokens far off-policy: r > 5, CISPO's IS cap bites
    exp.extras["logp_ref"] = (exp.logp_old + 0.3 * torch.randn(exp.logp_old.shape, generator=g,
                                                               dtype=torch.float64)) * exp.response_mask
    exp.extras["tis"] = torch.rand(exp.logp_old.shape, generator=g, dtype=torch.float64) * 1.5 + 0.5
    return exp


def _one_update(objective, fused, kl_coef):
    from cispo.training.trainer import Trainer

    policy, exp, config = _ragged_setup(torch.float64, rows=12)
    exp = _float64_experience(exp)
    cfg = config(f"objective={objective}", f"algo.fused_head={str(fused).lower()}", "updates_per_batch=1",
                 "micro_batch_size=5", "grad_clip=0", f"algo.objective.kl_coef={kl_coef}")
    obj = preset(objective, kl_coef=kl_coef)
    before = {k: p.detach().clone() for k, p in policy.model.named_parameters()}
    sgd = torch.optim.SGD(policy.model.parameters(), lr=cfg.optim.lr)
    trainer = Trainer(policy, sgd, obj, cfg, torch.Generator().manual_seed(3))
    stats = trainer.update(exp)
    assert trainer.update_count == 1
    grads = {k: (before[k] - p.detach()) / cfg.optim.lr for k, p in policy.model.named_parameters()}  # SGD: p -= lr g
    return grads, stats[0]


@pytest.mark.parametrize("objective", ["cispo", "dapo", "grpo"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_fused_update_has_the_same_gradients_in_float64(objective, kl_coef, fused_calls):
    ref, ref_stats = _one_update(objective, False, kl_coef)
    assert not fused_calls
    got, got_stats = _one_update(objective, True, kl_coef)
    assert len(fused_calls) == 3  # 12 rows in micro-batches of <= 5
    assert sum(g.abs().sum() for g in ref.values()) > 0
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-10, msg=k)
    assert got_stats.keys() == ref_stats.keys()
    for k in ref_stats:
        x, y = got_stats[k], ref_stats[k]
        assert math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-7) or (math.isnan(x) and math.isnan(y)), (k, x, y)
    if objective != "cispo":  # the PPO masks bite, so the flags and their counts are exercised
        assert ref_stats["frac_ppo_dropped"] > 0
    else:
        assert ref_stats["frac_capped"] > 0


def test_two_step_runs_log_the_same_metrics(tiny_model, dense_task, tmp_path, fused_calls):
    rows, calls = {}, {}
    for fused in ("false", "true"):
        result = train(small_config(tiny_model, tmp_path / fused, "steps=2", "eval.every=0",
                                    f"algo.fused_head={fused}"))
        rows[fused] = strip_perf(read_metrics(result.run_dir / "metrics.jsonl"))
        calls[fused] = len(fused_calls)
    assert calls["false"] == 0 and calls["true"] >= 8  # 2 steps x 4 updates, the fused path each time
    assert [r["step"] for r in rows["true"]] == [r["step"] for r in rows["false"]]
    assert any("objective/loss" in r for r in rows["true"])
    for a, b in zip(rows["true"], rows["false"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            x, y = a[k], b[k]
            if isinstance(x, float) and isinstance(y, float):
                assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6) or (math.isnan(x) and math.isnan(y)), (k, x, y)
            else:
                assert x == y, k


def test_fused_head_refuses_a_sequence_level_ratio_and_fsdp():
    with pytest.raises(ValueError, match="algo.fused_head needs a token-level ratio"):
        apply_overrides(TrainConfig(), ["objective=gspo", "algo.fused_head=true"])
    with pytest.raises(ValueError, match="algo.fused_head cannot be combined with model.fsdp"):
        apply_overrides(TrainConfig(), ["algo.fused_head=true", "model.fsdp=true"])
    assert apply_overrides(TrainConfig(), ["objective=grpo", "algo.fused_head=true"]).algo.fused_head
    assert not TrainConfig().algo.fused_head


@pytest.mark.parametrize("options", [
    ("model.lora_rank=4",),  # frozen LM head: no weight gradient asked of the fused pass
    ("model.dtype=bfloat16",),  # mixed precision: bf16 autocast over fp32 master weights
    ("model.gradient_checkpointing=true", "algo.tis_cap=2.0"),
])
def test_fused_head_trains_with_model_options(tiny_model, dense_task, tmp_path, fused_calls, options):
    if "model.lora_rank=4" in options:
        pytest.importorskip("peft")
    rows = {}
    for fused in ("false", "true"):
        result = train(small_config(tiny_model, tmp_path / fused, "steps=1", "eval.every=0",
                                    f"algo.fused_head={fused}", *options))
        rows[fused] = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    assert fused_calls
    assert rows["true"]["optim/updates"] == 4 and rows["true"]["optim/skipped"] == 0
    tol = 1e-2 if "model.dtype=bfloat16" in options else 1e-4  # bf16: summation order shows
    for k in ("objective/loss", "optim/grad_norm", "objective/ratio_mean"):
        assert math.isclose(rows["true"][k], rows["false"][k], rel_tol=tol, abs_tol=1e-6), (k, rows)
