"""The mini-batch rule when dynamic sampling leaves the batch short (``algo.minibatch_policy``).

``fixed_updates`` (the earlier rule) keeps K updates on shrinking mini-batches — a diverged
`chain` run did 8 full-size Adam steps on single responses; ``fixed_size`` keeps the configured
mini-batch and runs fewer updates, as DAPO's recipe does."""

from __future__ import annotations

import pytest
import torch

import cispo.training.sampling as sampling
import cispo.training.trainer as trainer
from cispo.config.train import AlgoConfig
from cispo.training.batching import minibatches
from tests.conftest import small_config


def rows_per_update(policy: str, kept: int, full: int = 64, k: int = 16) -> list[int]:
    order = torch.randperm(kept, generator=torch.Generator().manual_seed(kept))
    parts = minibatches(order, AlgoConfig(updates_per_batch=k, minibatch_policy=policy), full, kept)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(kept))  # every kept row, once
    return [len(p) for p in parts]


@pytest.mark.parametrize("kept", [1, 3, 4, 5, 8, 12, 17, 31, 32, 48, 63, 64])
def test_fixed_size_never_updates_on_fewer_rows_than_the_minibatch(kept):
    size = 64 // 16
    rows = rows_per_update("fixed_size", kept)
    assert all(r >= size for r in rows) if kept >= size else rows == [kept]
    assert len(rows) == max(1, min(16, kept // size))  # K_eff


def test_fixed_updates_keeps_k_and_shrinks_the_minibatches():
    assert rows_per_update("fixed_updates", 8) == [1] * 8 + [0] * 8  # 16 parts, half of them empty
    assert rows_per_update("fixed_updates", 64) == rows_per_update("fixed_size", 64) == [4] * 16  # a full batch


def test_a_run_with_a_short_batch_updates_on_full_minibatches(tiny_model, dense_task, tmp_path, monkeypatch):
    """Through the trainer: with 1 of 4 groups kept (G = 4: 4 rows, mini-batch 16 / 4 = 4 rows), one
    update on the 4 rows instead of K = 4 updates on one row each."""
    seen = []
    real = trainer.micro_batch_loss

    def spy(policy, sub, *args, **kwargs):
        seen.append(len(sub))
        return real(policy, sub, *args, **kwargs)

    kept = {"n": 1}
    real_fill = sampling.fill_groups

    def fill_one(*args, **kwargs):  # keep only the first informative group: a batch 1/4 full
        groups, report = real_fill(*args, **kwargs)
        return groups[: kept["n"]], report

    monkeypatch.setattr(trainer, "micro_batch_loss", spy)
    monkeypatch.setattr(sampling, "fill_groups", fill_one)
    for policy, want in (("fixed_size", [4]), ("fixed_updates", [1, 1, 1, 1])):
        seen.clear()
        cfg = small_config(tiny_model, tmp_path / policy, "steps=1", "eval.every=0", "dynamic_sampling=false",
                           f"algo.minibatch_policy={policy}", "algo.micro_batch_split_cost=null")
        metrics = trainer_step(cfg)
        assert seen == want, (policy, seen)
        assert metrics["optim/step_updates"] == len(want)


def trainer_step(cfg):
    """Run ``cfg`` (one step) through the public entry point; the step's metrics."""
    from cispo.records.tracking import read_metrics
    from cispo.training.runner import train
    result = train(cfg)
    return [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["step"] == 1][0]


def test_the_policy_is_a_config_choice():
    with pytest.raises(Exception, match="fixed_size"):
        small_config("x", "y", "algo.minibatch_policy=fixed")
