"""Faults and bad input: each is a clear message or a counted, logged skip — never a
traceback from deep inside torch, never a NaN loss, never lost work."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import cispo.data.tasks
import cispo.training.gradients
from cispo.cli import main
from cispo.data.rewards import safe_reward
from cispo.records.tracking import read_metrics
from cispo.training.runner import train
from tests.conftest import digit_reward, small_config

# ---------------------------------------------------------------------------------------
# Rewards that misbehave
# ---------------------------------------------------------------------------------------


def raises(prompt, completion, **s):
    raise RuntimeError("verifier crashed")


@pytest.mark.parametrize(
    "fn, message",
    [
        (raises, "RuntimeError: verifier crashed"),
        (lambda p, c, **s: None, "NoneType"),
        (lambda p, c, **s: float("nan"), "nan"),
        (lambda p, c, **s: float("inf"), "inf"),
        (lambda p, c, **s: "1.0", "returned str"),
        (lambda p, c, **s: [1.0], "list"),
    ],
)
def test_bad_reward_values_score_zero_with_a_reason(fn, message):
    value, error = safe_reward(fn, "1+1=", "2", {})
    assert value == 0.0 and message in error


def test_good_reward_values_pass_through():
    import numpy as np

    assert safe_reward(lambda p, c, **s: True, "", "", {}) == (1.0, None)
    assert safe_reward(lambda p, c, **s: np.float32(0.5), "", "", {}) == (0.5, None)
    assert safe_reward(lambda p, c, answer: float(c == answer), "", "7", {"answer": "7"}) == (1.0, None)


def test_run_survives_a_flaky_reward(tiny_model, monkeypatch, tmp_path, capsys):
    calls = {"n": 0}

    def flaky(prompt, completion, **sample):
        calls["n"] += 1
        if calls["n"] % 5 == 0:
            raise ValueError("boom")
        return None if calls["n"] % 7 == 0 else digit_reward(prompt, completion)

    base = cispo.data.tasks.get_task("addition")
    monkeypatch.setattr(cispo.data.tasks, "get_task", lambda name="addition": dataclasses.replace(base, reward=flaky))
    result = train(small_config(tiny_model, tmp_path, "steps=2", "eval.every=0"))
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    assert sum(r.get("rollout/reward_errors", 0) for r in rows) > 0
    assert all(math.isfinite(r["objective/loss"]) for r in rows[1:])
    assert "reward call(s) failed and scored 0 (first: ValueError: boom)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# Numerical faults
# ---------------------------------------------------------------------------------------


def poison_losses(monkeypatch, every):
    """Make every ``every``-th loss NaN (1 = all of them)."""
    real = cispo.training.gradients.policy_loss
    count = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        count["n"] += 1
        return (loss * float("nan") if count["n"] % every == 0 else loss), stats

    monkeypatch.setattr(cispo.training.gradients, "policy_loss", poisoned)


def test_non_finite_update_is_skipped_and_changes_nothing(tiny_model, dense_task, monkeypatch, tmp_path):
    from cispo.models.loading import load_policy

    poison_losses(monkeypatch, every=2)  # half the optimizer steps see a NaN gradient
    result = train(small_config(tiny_model, tmp_path, "steps=1", "eval.every=0", "warmup_updates=0"))
    row = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    assert row["optim/skipped"] == 2 and row["optim/updates"] == 2
    weights = load_file(next((result.run_dir / "checkpoints").iterdir()) / "model" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    opt = torch.load(next((result.run_dir / "checkpoints").iterdir()) / "optimizer.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for s in opt["state"].values() for v in s.values() if torch.is_tensor(v))
    assert all(s["step"] == 2 for s in opt["state"].values())  # skipped steps left Adam's count alone
    model, _ = load_policy(tiny_model)
    assert any(not torch.equal(weights[k], v) for k, v in model.state_dict().items() if k in weights)


def test_repeated_faults_stop_with_a_checkpoint(tiny_model, dense_task, monkeypatch, tmp_path):
    from cispo.models.loading import load_policy

    poison_losses(monkeypatch, every=1)
    cfg = small_config(tiny_model, tmp_path, "steps=10", "eval.every=0", "max_bad_steps=2", "checkpoint_every=0")
    with pytest.raises(FloatingPointError, match="2 consecutive steps"):
        train(cfg)
    ckpt = tmp_path / "cispo__addition__seed0" / "checkpoints" / "step_000002"
    weights = load_file(ckpt / "model" / "model.safetensors")
    model, _ = load_policy(tiny_model)  # nothing was ever applied: the starting weights
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items() if k in weights)


# ---------------------------------------------------------------------------------------
# Bad configuration
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("algo.updates_per_batch=0", "algo.updates_per_batch must be >= 1"),
        ("group_size=1", "rollout.group_size must be >= 2"),
        ("algo.objective.eps_high_is=-1", "eps_high_is must be a finite number >= 0"),
        ("objective=dapoo", "did you mean 'dapo'"),
        ("max_steps=10", "max_steps: unknown key (did you mean 'steps'? 'max_steps' in TRL"),  # learning_rate is read
        ("optim.lrr=1e-3", "did you mean 'optim.lr'"),
        ("lr=abc", "expected float"),
        ("steps", "expected key=value"),
    ],
)
def test_bad_config_values_are_clear_errors(override, message, capsys):
    assert main(["train", override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_yaml_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "run.yaml"
    bad.write_text("steps: 10\noptim:\n  lr: fast\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert f"{bad}:3: optim.lr: expected float" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# Prompts longer than the context
# ---------------------------------------------------------------------------------------


def test_overlong_prompts_are_skipped_and_counted(tiny_model, tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}] * 30 + [{"prompt": "1" * 200, "answer": "1"}] * 3
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = small_config(tiny_model, tmp_path, f"data.path={data}", "data.reward=exact_match", "steps=1",
                       "eval.every=0", "num_eval_prompts=2", "dynamic_sampling=false")
    train(cfg)
    assert "prompts are longer than the context (128 tokens)" in capsys.readouterr().err
    only_long = tmp_path / "long.jsonl"
    only_long.write_text("".join(json.dumps({"prompt": "9" * 200, "answer": "1"}) + "\n" for _ in range(10)))
    cfg = small_config(tiny_model, tmp_path / "b", f"data.path={only_long}", "data.reward=exact_match")
    with pytest.raises(ValueError, match="nothing left to train on"):
        train(cfg)


# ---------------------------------------------------------------------------------------
# Signals and kills
# ---------------------------------------------------------------------------------------


def _train_cmd(model, out, *extra):
    return [sys.executable, "-m", "cispo", "train", f"model.path={model}", "model.device=cpu", f"out_dir={out}",
            "run_name=r", "prompts_per_step=4", "group_size=4", "updates_per_batch=4", "max_new_tokens=10",
            "num_train_prompts=64", "num_eval_prompts=8", "eval.num_samples=2", "eval.every=0", "lr=1e-3",
            "warmup_updates=2", "progress=false", "threads=1",
            # the random tiny model scores 0 everywhere: keep its groups, so the run updates (a run
            # without a single update exits 1)
            "dynamic_sampling=false", *extra]


def _wait_for_step(metrics, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.exists() and any(r["step"] >= step for r in read_metrics(metrics)):
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    proc.kill()  # do not leave a 1000-step run behind
    proc.wait()
    raise TimeoutError(f"no step {step} in {metrics} after {timeout} s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_resume_continues(tiny_model, tmp_path, sig, capsys):
    """The signalled run is a real process; the ``--resume`` goes through the same CLI entry point
    (``cispo.cli.main``) in this process, from the checkpoint on disk: a second interpreter start
    (~6 CPU-s of imports) proves nothing more about the checkpoint."""
    out = tmp_path / "runs"
    proc = subprocess.Popen(_train_cmd(tiny_model, out, "steps=1000", "checkpoint_every=0",
                                       "model.compile=off"),  # not compile.AUTO_MIN_STEPS's compile
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    _wait_for_step(out / "r" / "metrics.jsonl", 1, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "checkpoint saved, continue with --resume" in err
    last = max(r["step"] for r in read_metrics(out / "r" / "metrics.jsonl"))
    assert (out / "r" / "checkpoints" / f"step_{last:06d}").is_dir()
    threads = torch.get_num_threads()
    try:  # threads=1 of the arguments sets this process's torch thread count: restored after
        rc = main(_train_cmd(tiny_model, out, f"steps={last + 1}", "--resume")[3:])  # from "train" on
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out / "r" / "metrics.jsonl")] == list(range(last + 2))


@pytest.mark.slow
def test_sigkill_at_any_moment_then_resume_matches_uninterrupted(tiny_model, tmp_path):
    """Kill -9 at several moments; each resume ends with exactly the metrics and weights of
    an uninterrupted run (CPU, same seed)."""
    data, reward = tmp_path / "prompts.jsonl", tmp_path / "dense.py"
    data.write_text("".join(json.dumps(r) + "\n" for r in cispo.data.tasks.get_task("addition").train_samples(0, 64)))
    reward.write_text("def reward(prompt, completion, **sample):\n"
                      "    return completion.count('1') / max(len(completion), 1)\n")
    # a dense reward, so that the weights move (with the built-in task's reward a random tiny model
    # scores 0 everywhere and the final-weights comparison would compare unchanged weights)
    steps = ("steps=8", f"data.path={data}", f"data.reward={reward}:reward")
    ref = subprocess.run(_train_cmd(tiny_model, tmp_path / "ref", *steps, "checkpoint_every=2"), capture_output=True,
                         text=True)
    assert ref.returncode == 0, ref.stderr
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]  # noqa: E731
    expected = strip(read_metrics(tmp_path / "ref" / "r" / "metrics.jsonl"))
    a = load_file(tmp_path / "ref" / "r" / "checkpoints" / "step_000008" / "model" / "model.safetensors")
    start = load_file(tiny_model / "model.safetensors")
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the weights moved: the comparison below can fail
    for i, kill_after in enumerate((2, 3, 5)):
        out = tmp_path / f"kill{i}"
        proc = subprocess.Popen(_train_cmd(tiny_model, out, *steps, "checkpoint_every=2"), stderr=subprocess.PIPE,
                                text=True)
        _wait_for_step(out / "r" / "metrics.jsonl", kill_after, proc)
        proc.kill()
        proc.wait()
        res = subprocess.run(_train_cmd(tiny_model, out, *steps, "checkpoint_every=2", "--resume"),
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert strip(read_metrics(out / "r" / "metrics.jsonl")) == expected
        b = load_file(out / "r" / "checkpoints" / "step_000008" / "model" / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_soak_memory_stays_flat(tmp_path):
    """120 steps of a tiny run: resident memory grows by less than 40 MiB after warm-up."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # the repository root
    from benchmarks.step.soak import soak

    r = soak(steps=120, warmup=10, workdir=tmp_path)
    assert r["growth_mib"] < 40, r


# ---------------------------------------------------------------------------------------
# Non-finite weights and optimizer settings
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("optim.lr=inf", "optim.lr is inf: must be a finite number"),
    ("optim.lr=nan", "optim.lr is nan: must be a finite number"),
    ("optim.lr=1e30", "optim.lr must be in (0, 1]"),
    ("optim.eps=0", "optim.eps must be > 0"),
    ("optim.betas=[0.9,1.0]", "optim.betas must both be in [0, 1)"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0"),
    ("rollout.temperature=inf", "rollout.temperature is inf"),
])
def test_optimizer_settings_that_make_the_weights_non_finite_are_refused(override, message, capsys):
    """Before: ``optim.eps=0``, ``optim.lr=inf`` and ``lr=1e30`` were accepted, NaN weights were
    checkpointed and the run then crashed."""
    assert main(["train", override, "out_dir=/nonexistent-never-created"]) == 2
    assert message in capsys.readouterr().err


def test_weights_that_turn_non_finite_are_never_checkpointed(tiny_model, dense_task, monkeypatch, tmp_path):
    """A step that leaves a NaN weight stops the run with a sentence before it is logged or
    saved; the newest checkpoint stays the last finite one (before: the NaN weights were saved
    over it, and --resume found "no intact checkpoint")."""
    from cispo.training.rl_step import RLStep

    real, count = RLStep.__call__, {"n": 0}

    def poisoned(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        count["n"] += 1
        if count["n"] == 3:
            with torch.no_grad():
                next(self.trainer.policy.model.parameters()).view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(RLStep, "__call__", poisoned)
    cfg = small_config(tiny_model, tmp_path, "steps=4", "eval.every=0", "checkpoint_every=1", "keep_checkpoints=1")
    with pytest.raises(FloatingPointError, match=r"non-finite \(NaN / inf\) during step 3 \(.*\); that step is "
                                                 r"neither logged nor saved, and the newest checkpoint \(step 2"):
        train(cfg)
    run_dir = tmp_path / "cispo__addition__seed0"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000002"]
    weights = load_file(run_dir / "checkpoints" / "step_000002" / "model" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    monkeypatch.setattr(RLStep, "__call__", real)
    assert train(cfg, resume=True).summary  # the finite checkpoint resumes


def test_update_metrics_of_a_step_whose_every_ratio_is_nan():
    """Before: ``min() arg is an empty sequence`` (cispo/training/metrics.py) after NaN weights."""
    from cispo.training.metrics import update_metrics

    out = update_metrics([{"ratio_min": float("nan"), "ratio_max": float("nan"), "loss": float("nan")}])
    assert math.isnan(out["objective/ratio_min"]) and math.isnan(out["objective/ratio_max"])



def tied_on_most_prompts(prompt, completion, **sample):
    """`digit_reward` on one prompt in four, 0 on the others: dynamic sampling drops most groups."""
    return completion.count("1") / max(len(completion), 1) if sum(map(ord, prompt)) % 4 == 0 else 0.0


def test_steps_of_fewer_than_k_updates_all_non_finite_stop_the_run(tiny_model, monkeypatch, tmp_path):
    """Issue 61 item 12: a window of ``max_bad_steps`` steps whose every update was non-finite stops the run also
    when a step makes fewer updates than ``algo.updates_per_batch`` (``fixed_size`` mini-batches on a batch that
    dynamic sampling left short). It was accepted: the run ended as if normally, its weights never moved."""
    base = cispo.data.tasks.get_task("addition")
    monkeypatch.setattr(cispo.data.tasks, "get_task",
                        lambda name="addition": dataclasses.replace(base, reward=tied_on_most_prompts))
    poison_losses(monkeypatch, every=1)
    cfg = small_config(tiny_model, tmp_path, "steps=6", "eval.every=0", "max_bad_steps=2", "checkpoint_every=0",
                       "algo.minibatch_policy=fixed_size", "max_sampling_rounds=1")
    with pytest.raises(FloatingPointError, match="2 consecutive steps"):
        train(cfg)
    rows = read_metrics(tmp_path / "cispo__addition__seed0" / "metrics.jsonl")
    tried = [r for r in rows[1:] if r.get("optim/skipped")]  # a step that kept no group tries no update
    assert tried and all(r["optim/skipped"] < 4 and r["optim/step_updates"] == 0 for r in tried)  # < K, all skipped
