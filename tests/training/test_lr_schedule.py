"""``optim.lr_scheduler_type``, ``optim.warmup_ratio``: the learning rate of every optimizer update against
transformers' own ``get_scheduler`` (HF Trainer's formulas; cispo's warm-up one update ahead), its unit (the
run's optimizer updates, steps x K x epochs), its checks, and a resumed run that continues it bit for bit."""

import math

import pytest
import torch

from cispo.config.sft import SFTConfig
from cispo.config.train import TrainConfig, apply_overrides
from cispo.config.yaml_input import ConfigError
from cispo.records.tracking import read_metrics
from cispo.training.gradients import lr_at, planned_updates, warmup_of
from tests.conftest import small_config, strip_perf

transformers = pytest.importorskip("transformers")


def hf_lrs(kind: str, warmup: int, total: int, lr: float) -> list[float]:
    """The learning rate of each optimizer update of a run of ``total`` under transformers' ``get_scheduler``,
    stepped as the HF Trainer steps it (after every optimizer step), and of one update more."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = transformers.get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=total)
    out = []
    for _ in range(total + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def optim(*overrides):
    return apply_overrides(TrainConfig(), ["lr=0.3", *overrides]).optim


@pytest.mark.parametrize("kind", ["constant_with_warmup", "linear", "cosine", "constant"])
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (4, 37), (10, 10)])
def test_each_update_runs_at_hfs_rate_after_the_warmup_and_one_update_ahead_in_it(kind, warmup, total):
    o = optim(f"optim.lr_scheduler_type={kind}", f"warmup_updates={warmup}")
    ours = [lr_at(u, o, total) for u in range(total)]
    hf = hf_lrs(kind, warmup, total, 0.3)
    w = 0 if kind == "constant" else warmup
    for u in range(total):
        if u < w:  # HF's warm-up factor of the update after: (u + 1) / W
            assert math.isclose(ours[u], 0.3 * (u + 1) / w, rel_tol=1e-12)
            assert u + 1 == w or math.isclose(ours[u], hf[u + 1], rel_tol=1e-12)
        else:
            assert math.isclose(ours[u], hf[u], rel_tol=1e-12, abs_tol=1e-15), (u, ours[u], hf[u])
    if w:
        assert ours[0] == 0.3 / w and hf[0] == 0.0  # HF's first update is spent at lr 0
    if kind in ("linear", "cosine") and w < total:
        assert ours[-1] < ours[w] and ours[-1] > 0  # decays toward 0 at update N, the last update still moves


def test_the_schedule_counts_the_runs_optimizer_updates_and_the_ratio_is_hfs():
    cfg = apply_overrides(TrainConfig(), ["steps=50", "updates_per_batch=4", "algo.epochs=2", "warmup_ratio=0.03"])
    assert planned_updates(cfg) == 400
    args = transformers.TrainingArguments(output_dir="unused", warmup_steps=0.03, report_to=[])
    assert warmup_of(cfg.optim, 400) == args.get_warmup_steps(400) == 12
    assert warmup_of(optim("warmup_updates=5"), 400) == 5
    default = TrainConfig().optim  # MiniMax-M1's: 16 updates of warm-up, then flat (unchanged)
    assert [lr_at(u, default, 1000) for u in (0, 15, 16, 999)] == [1e-4 / 16, 1e-4, 1e-4, 1e-4]


@pytest.mark.parametrize("overrides,message", [
    (["warmup_ratio=1.5"], "optim.warmup_ratio must be in [0, 1]"),
    (["warmup_ratio=0.1", "warmup_updates=4"], "optim.warmup_ratio is set beside optim.warmup_updates=4"),
    (["optim.lr_scheduler_type=polynomial"], "lr_scheduler_type"),
])
def test_bad_schedules_are_config_errors(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message.replace("[", r"\[").replace("]", r"\]")):
        apply_overrides(TrainConfig(), overrides)
    if overrides[0].startswith("warmup_ratio"):
        with pytest.raises((ConfigError, ValueError), match=r"optim\.warmup_ratio"):
            apply_overrides(SFTConfig(), [o.replace("warmup_updates=4", "warmup_updates=3") for o in overrides])


def test_resume_continues_the_schedule(tiny_model, dense_task, tmp_path, monkeypatch):
    """A cosine schedule whose warm-up crosses the step-2 checkpoint: the run cut there (planned for 4 steps, as a
    killed run is) and resumed logs the rates and ends with the weights of the run never cut."""
    from safetensors.torch import load_file

    import cispo.training.trainer as trainer_module
    from cispo.training.runner import train

    sched = ("optim.lr_scheduler_type=cosine", "warmup_updates=10")
    full = train(small_config(tiny_model, tmp_path / "full", "steps=4", *sched))
    with monkeypatch.context() as m:  # the cut run plans the full run's updates, as one killed after step 2 did
        m.setattr(trainer_module, "planned_updates", lambda cfg: 16)
        train(small_config(tiny_model, tmp_path / "cut", "steps=2", *sched))
    resumed = train(small_config(tiny_model, tmp_path / "cut", "steps=4", *sched), resume=True)
    rows_full = strip_perf(read_metrics(full.run_dir / "metrics.jsonl"))
    assert rows_full == strip_perf(read_metrics(resumed.run_dir / "metrics.jsonl"))
    lrs = [r["optim/lr"] for r in rows_full if "optim/lr" in r]
    o = optim(*sched, "lr=1e-3")
    assert lrs == [lr_at(u, o, 16) for u in (3, 7, 11, 15)]  # the last update of each step (K = 4)
    assert lrs[0] < lrs[1] < lrs[2] > lrs[3] > 0  # warming up over 10 updates, then the cosine
    last = [sorted((r.run_dir / "checkpoints").iterdir())[-1] / "model" / "model.safetensors" for r in (full, resumed)]
    wf, wr = (load_file(p) for p in last)
    assert all(torch.equal(wf[k], wr[k]) for k in wf)
