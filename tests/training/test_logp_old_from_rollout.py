"""algo.logp_old=rollout: pi_old is the sampler's own log-probs where the sampler is
the trainer's policy, and no logp_old pass runs. Pinned against the recomputed pass on a tiny random
model: the same first step (same samples), logp_old within 1e-4 per token, the first update's ratio
statistics those of the recomputed path, the mismatch and entropy metrics measured by the first update
equal to the pass's; and the settings where it is not the same policy refused."""

import math

import pytest
import torch

import cispo.training.trainer as trainer
from cispo.config.train import apply_overrides
from cispo.rollout import Sampler
from cispo.training.logp_old import MEASURED, not_same_policy, rollout_as_old
from cispo.training.runner import train
from tests.conftest import small_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _first_step(tiny_model, out, mode, *extra):
    """One seeded step at ``algo.logp_old=mode``: the batch after the updates (logp_old, the measured
    log-probs and entropy, pi_ref), the first update's statistics, the step's metrics, and how many rows
    the no-grad policy passes of logp_old covered."""
    seen, calls = {}, []
    real_update, real_merge, real_logprobs = trainer.Trainer.update, trainer.merge_stats, trainer.policy_logprobs

    def update(self, exp, *args, **kwargs):
        result = real_update(self, exp, *args, **kwargs)
        seen.setdefault("exp", exp)
        return result

    def merge(*args, **kwargs):
        stats = real_merge(*args, **kwargs)
        seen.setdefault("first_update", stats)
        return stats

    def counting(model, exp, *args, **kwargs):
        if not torch.is_grad_enabled() and model.training:
            calls.append(len(exp))
        return real_logprobs(model, exp, *args, **kwargs)

    trainer.Trainer.update, trainer.merge_stats, trainer.policy_logprobs = update, merge, counting
    try:
        cfg = small_config(tiny_model, out / mode, "steps=1", "eval.every=0", "checkpoint_every=0",
                           "model.compile=off", "threads=1",  # threads by load would round differently
                           f"algo.logp_old={mode}", *extra)
        result = train(cfg)
    finally:
        trainer.Trainer.update, trainer.merge_stats, trainer.policy_logprobs = real_update, real_merge, real_logprobs
    from cispo.records.tracking import read_metrics

    seen["metrics"] = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    seen["pass_rows"] = sum(calls)
    return seen


@pytest.mark.parametrize("K", [1, 4])
def test_first_step_against_the_recomputed_pass(tiny_model, dense_task, tmp_path, K):
    rec = _first_step(tiny_model, tmp_path, "recompute", f"updates_per_batch={K}")
    out = _first_step(tiny_model, tmp_path, "rollout", f"updates_per_batch={K}")
    B = 4 * 4
    assert rec["pass_rows"] == B - B // K  # the first update's rows come from its forward (logp_old_from_update)
    assert out["pass_rows"] == 0  # no logp_old pass at all
    a, b = rec["exp"], out["exp"]
    assert torch.equal(a.response_ids, b.response_ids)  # the same samples: sampling precedes any update
    mask = a.response_mask.bool()
    assert torch.equal(b.logp_old, b.logp_rollout * b.response_mask)  # pi_old is the sampler's
    gap = (a.logp_old - b.logp_old)[mask].abs()
    assert 0 < gap.max() < 1e-4  # the sampler's decode vs the trainer's forward: float32 rounding

    # the first update's forward runs on pi_old's weights over the same micro-batches: what it measures
    # is bitwise what the recomputed path took as logp_old and entropy on those rows
    measured = mask & ~b.extras[MEASURED].isnan()
    assert measured.sum() == (mask.sum() if K == 1 else a.response_mask[measured.any(-1)].sum())
    assert 0 < measured.any(-1).sum() <= B // K
    assert torch.equal(b.extras[MEASURED][measured], a.logp_old[measured])
    assert torch.equal(b.extras["entropy"][measured], a.extras["entropy"][measured])

    # the first update's ratio statistics: 1 on the recomputed path (r = pi_theta / pi_old, same weights),
    # 1 to the sampler's rounding here
    first_rec, first_out = rec["first_update"], out["first_update"]
    assert first_rec["ratio_mean"] == first_rec["ratio_min"] == first_rec["ratio_max"] == 1.0
    for key in ("ratio_mean", "ratio_min", "ratio_max"):
        assert first_out[key] == pytest.approx(first_rec[key], abs=1e-4), key
    for key in ("frac_capped", "frac_ppo_dropped", "frac_ppo_dropped_low_prob", "skipped"):
        assert first_out[key] == first_rec[key], key
    assert abs(first_out["approx_kl"] - first_rec["approx_kl"]) < 1e-8
    for key in ("loss", "pg_loss", "grad_norm"):
        assert first_out[key] == pytest.approx(first_rec[key], rel=1e-3, abs=1e-6), key

    # the step's mismatch and entropy metrics: measured on the first update's rows, as the pass defines them
    m_rec, m_out = rec["metrics"], out["metrics"]
    keys = ("rollout/logp_abs_diff", "rollout/logp_corr", "rollout/mismatch_kl", "objective/entropy")
    assert all(math.isfinite(m_out[k]) for k in keys)
    assert m_out["rollout/logp_abs_diff"] > 0 and m_out["rollout/logp_corr"] < 1  # not the trivial 0 and 1
    if K == 1:  # every row measured: the recomputed path's own numbers
        for k in keys:
            assert m_out[k] == pytest.approx(m_rec[k], rel=1e-9, abs=1e-12), k
    for k in ("rollout/reward_mean", "rollout/response_length", "optim/step_updates"):
        assert m_out[k] == m_rec[k], k
    assert m_out["objective/ratio_mean"] == pytest.approx(m_rec["objective/ratio_mean"], abs=1e-3)


def test_the_reference_pass_still_runs(tiny_model, dense_task, tmp_path):
    """With a KL term the frozen reference's log-probs are computed as before (the same numbers); only
    the policy's pass is skipped."""
    kl = ("algo.objective.kl_coef=0.1",)
    rec = _first_step(tiny_model, tmp_path, "recompute", *kl)
    out = _first_step(tiny_model, tmp_path, "rollout", *kl)
    assert out["pass_rows"] == 0
    ref_a, ref_b = rec["exp"].extras["logp_ref"], out["exp"].extras["logp_ref"]
    assert torch.equal(ref_a, ref_b) and ref_b[out["exp"].response_mask.bool()].abs().min() > 0
    assert out["metrics"]["objective/kl"] == pytest.approx(rec["metrics"]["objective/kl"], rel=1e-2, abs=1e-7)


def test_fused_head_measures_the_mismatch_but_no_entropy(tiny_model, dense_task, tmp_path):
    out = _first_step(tiny_model, tmp_path, "rollout", "algo.fused_head=true")
    assert out["pass_rows"] == 0
    assert math.isfinite(out["metrics"]["rollout/logp_abs_diff"])
    assert out["metrics"]["objective/entropy"] is None  # NaN, null in metrics.jsonl: the fused head gives none


@pytest.mark.parametrize("extra,named", [
    (("rollout.engine=vllm",), "rollout.engine=vllm"),
    (("model.dropout=true",), "model.dropout=true"),
    (("model.lora_rank=4", "model.lora_dropout=0.1"), "model.lora_dropout=0.1"),
    (("model.dtype=bfloat16",), "model.dtype=bfloat16"),
    (("model.dtype=float16",), "model.dtype=float16"),
    (("algo.tis_cap=2",), "algo.tis_cap=2"),
    (("algo.rollout_is=token",), "algo.rollout_is=token"),
    (("model.fsdp=true",), "model.fsdp=true"),
])
def test_refused_where_the_sampler_is_not_the_same_policy(tiny_model, tmp_path, extra, named):
    small_config(tiny_model, tmp_path, *extra)  # fine with the recomputed pass
    with pytest.raises(ValueError, match="algo.logp_old=rollout") as e:
        small_config(tiny_model, tmp_path, "algo.logp_old=rollout", *extra)
    assert named in str(e.value)


def test_greedy_sampling_is_refused_for_every_run(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="rollout.temperature"):
        small_config(tiny_model, tmp_path, "algo.logp_old=rollout", "rollout.temperature=0")


def test_default_and_values(tiny_model, tmp_path):
    assert small_config(tiny_model, tmp_path).algo.logp_old == "recompute"
    cfg = small_config(tiny_model, tmp_path, "algo.logp_old=rollout", "model.dtype=float32")
    assert apply_overrides(cfg, []).algo.logp_old == "rollout"
    with pytest.raises(ValueError, match="logp_old"):
        small_config(tiny_model, tmp_path, "algo.logp_old=bypass")


class _Sampler(Sampler):
    def __init__(self, model, autocast=None, fp32_head=True):
        self.model, self.autocast, self.fp32_head = model, autocast, fp32_head


class _Policy:
    def __init__(self, sampler=None, autocast=None, dtype=torch.float32):
        self.model = torch.nn.Linear(2, 2).to(dtype)
        self.sampler = sampler(self.model) if sampler else _Sampler(self.model, autocast)
        self.autocast = autocast


def test_what_the_config_cannot_tell_is_checked_at_the_run(tiny_model, tmp_path, capsys):
    cfg = small_config(tiny_model, tmp_path, "algo.logp_old=rollout")
    assert not_same_policy(_Policy()) is None
    engine = _Policy(lambda m: Sampler())  # an engine with weights of its own: no model
    assert "does not sample from the trainer's model" in not_same_policy(engine)
    assert "autocast" in not_same_policy(_Policy(lambda m: _Sampler(m, torch.bfloat16)))
    assert not_same_policy(_Policy(lambda m: _Sampler(m, fp32_head=False))) is None  # float32 either way
    assert "bfloat16" in not_same_policy(_Policy(autocast=torch.bfloat16))  # a model saved in bf16
    assert "bfloat16" in not_same_policy(_Policy(dtype=torch.bfloat16))
    capsys.readouterr()
    low = _Policy(autocast=torch.bfloat16)
    assert rollout_as_old(cfg, low) is False and rollout_as_old(cfg, low) is False
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "logp_old is recomputed instead" in said[0]  # one line, not one per step
    assert rollout_as_old(cfg, _Policy()) is True
    assert rollout_as_old(small_config(tiny_model, tmp_path), _Policy()) is False  # recompute: never
