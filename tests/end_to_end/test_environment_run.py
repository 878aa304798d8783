"""A run whose environment is a user's class (``data.environment``), end to end on the tiny built-in model: a
cispo `Env` with a reward per turn (tests/envs/fixtures/scripted_envs.py's `Countdown`: every digit ends a
turn, an odd one earns 0.5), under both ``algo.turn_credit`` modes. The turn rewards reach ``samples.jsonl``
and the step's metrics, and the run finishes."""

import json

import pytest
import torch

from cispo.training.runner import train
from tests.conftest import small_config

ENV = "tests/envs/fixtures/scripted_envs.py:Countdown"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("credit", [["algo.turn_credit=episode"],
                                    ["algo.turn_credit=reward_to_go", "algo.advantage_estimator=rloo"]])
def test_a_run_with_an_environment_class_and_turn_rewards(tiny_model, tmp_path, credit):
    cfg = small_config(tiny_model, tmp_path, f"data.environment={ENV}", "rollout.max_turns=3", "steps=2",
                       "eval.every=0", "checkpoint_every=0", "dynamic_sampling=false", "log_samples_every=1", *credit)
    summary = train(cfg)
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    rewarded = [r for r in rows if r.get("turn_rewards")]
    assert rewarded, "no episode recorded a turn reward"
    for r in rewarded:
        assert all(x in (0.0, 0.5) for x in r["turn_rewards"]) and len(r["turn_rewards"]) <= 3
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/turn_reward_mean" in m]
    assert len(steps) == 2 and all(m["rollout/turns"] > 0 for m in steps)
    assert summary is not None


def test_a_run_whose_environment_rewrites_the_history(tiny_model, tmp_path):
    """`Compactor` rewrites each episode's history at its second turn: the episode goes on in a second training
    row; the run trains on both (the batch's rows, ``rollout/rows_per_episode``) and finishes."""
    cfg = small_config(tiny_model, tmp_path, "data.environment=tests/envs/fixtures/scripted_envs.py:Compactor",
                       "rollout.max_turns=3", "steps=2", "eval.every=0", "checkpoint_every=0",
                       "dynamic_sampling=false", "log_samples_every=1", "algo.turn_credit=reward_to_go",
                       "algo.advantage_estimator=rloo")
    assert train(cfg) is not None
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    rewritten = [r for r in rows if r.get("rows", 1) == 2]
    assert rewritten, "no episode was rewritten"
    assert all("context" in [s["role"] for s in r["segments"]] for r in rewritten)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/rows_per_episode" in m]
    assert len(steps) == 2 and all(m["rollout/rows_per_episode"] > 1 for m in steps)
    assert all(m["rollout/rewrites"] > 0 and m["optim/step_updates"] > 0 for m in steps)


@pytest.mark.parametrize("extra", [[], ["rollout.async_steps=1", "algo.logp_old=rollout"]])
def test_a_run_with_rewritten_episodes_resumes_as_if_never_stopped(tiny_model, tmp_path, extra):
    """Checkpointed after step 1 and resumed there, a run whose episodes span two rows each ends as the
    uninterrupted one: the same metrics and weights (``async_steps=1``: the batch held in the checkpoint keeps
    each episode's rows)."""
    import shutil

    from safetensors.torch import load_file

    from cispo.records.tracking import read_metrics
    from tests.conftest import strip_perf

    def config(out):
        return small_config(tiny_model, out, "data.environment=tests/envs/fixtures/scripted_envs.py:Compactor",
                            "rollout.max_turns=3", "steps=2", "eval.every=0", "checkpoint_every=1",
                            "keep_checkpoints=2", "dynamic_sampling=false", "run_name=r", *extra)

    train(config(tmp_path / "a"))
    run, copy = tmp_path / "a" / "r", tmp_path / "b" / "r"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000002")
    train(config(tmp_path / "b"), resume=True)
    assert strip_perf(read_metrics(copy / "metrics.jsonl")) == strip_perf(read_metrics(run / "metrics.jsonl"))
    assert any(m.get("rollout/rows_per_episode", 1) > 1 for m in read_metrics(run / "metrics.jsonl"))
    a = load_file(run / "checkpoints" / "step_000002" / "model" / "model.safetensors")
    b = load_file(copy / "checkpoints" / "step_000002" / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
