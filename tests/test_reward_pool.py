"""User rewards in worker processes (cispo.rewards.pool): a reward that exits, is interrupted,
dies, hangs, floods its output or mutates its arguments costs one counted call, never the run.

Timeouts are short so that the module stays fast; every pool is stopped at the end."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import cispo.tasks
from cispo.rewards import score_rewards
from cispo.rewards.loading import load_reward
from cispo.rewards.pool import OUTPUT_TAIL_CHARS, shutdown_pools
from cispo.runner import train
from cispo.tracking import read_metrics
from conftest import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOSTILE = '''
import os, sys, threading, time

def hostile(prompt, completion, **sample):
    """Misbehaves as the completion says; otherwise its length."""
    if completion == "exit":
        sys.exit(3)
    if completion == "interrupt":
        raise KeyboardInterrupt
    if completion == "exit0":
        os._exit(0)
    if completion == "die":
        os._exit(9)
    if completion == "hang":
        time.sleep(600)
    if completion in ("loud", "loud-fail"):
        print("x" * 1_000_000 + "END")
        if completion == "loud-fail":
            raise ValueError("failed after printing")
        return 1.0
    if completion == "mutate":
        sample["answer"].append("changed")
        return float(len(sample["answer"]))
    if completion == "main-thread":
        return float(threading.current_thread() is threading.main_thread())
    if completion == "math-verify-timeout":
        from cispo.rewards.math import _timeout  # None where signal.alarm cannot work
        return float(_timeout(5) == 5)
    return float(len(completion))
'''


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "hostile.py"
    path.write_text(HOSTILE)
    yield load_reward(f"{path}:hostile", workers=2)
    shutdown_pools()


def calls(*completions, sample=None):
    return [("p", c, dict(sample or {})) for c in completions]


def test_user_rewards_run_in_the_pool_builtins_in_the_main_thread(hostile):
    assert hostile.isolated and not load_reward("exact_match").isolated


def test_exit_interrupt_and_death_are_counted_errors(hostile):
    started = time.perf_counter()
    out = score_rewards(hostile, calls("exit", "interrupt", "exit0", "die", "ok"), timeout_s=30)
    assert out[0] == (0.0, "SystemExit: 3")
    assert out[1] == (0.0, "KeyboardInterrupt")
    assert out[2][0] == 0.0 and "worker process died (exit status 70)" in out[2][1]  # os._exit(0): not lost
    assert out[3][0] == 0.0 and "worker process died (exit status 9)" in out[3][1]
    assert out[4] == (2.0, None)
    assert time.perf_counter() - started < 20  # the lost calls were reported, not waited out
    assert score_rewards(hostile, calls("a", "abc"), timeout_s=30) == [(1.0, None), (3.0, None)]  # replaced


def test_hanging_calls_are_killed_and_do_not_jam_the_pool(hostile):
    started = time.perf_counter()
    out = score_rewards(hostile, calls(*["hang"] * 5, "ok"), timeout_s=0.3)  # 5 hangs > 2 workers
    assert [v for v, _ in out] == [0.0] * 5 + [2.0]
    assert all("timed out after 0.3 s (its worker process was killed and replaced)" == e for _, e in out[:5])
    assert time.perf_counter() - started < 20
    assert score_rewards(hostile, calls("abcd"), timeout_s=0.3) == [(4.0, None)]


def test_arguments_are_copies(hostile):
    sample = {"answer": ["gold"]}
    out = score_rewards(hostile, [("p", "mutate", sample)] * 3, timeout_s=30)
    assert out == [(2.0, None)] * 3  # each call saw the original one-element list
    assert sample == {"answer": ["gold"]}


def test_math_verify_timeouts_work_in_the_worker(hostile):
    out = score_rewards(hostile, calls("main-thread", "math-verify-timeout"), timeout_s=30)
    assert out == [(1.0, None), (1.0, None)]


def _run_script(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_output_is_captured_and_capped(tmp_path):
    (tmp_path / "hostile.py").write_text(HOSTILE)
    out = _run_script(f"""
        from cispo.rewards import score_rewards
        from cispo.rewards.loading import load_reward
        r = load_reward({str(tmp_path / 'hostile.py:hostile')!r}, workers=1)
        for value, error in score_rewards(r, [("p", "loud", {{}}), ("p", "loud-fail", {{}})], 30):
            print(value, len(error or ""), (error or "")[-40:])
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout) + len(out.stderr) < 5000  # 2 MB were printed in the workers
    ok, failed = out.stdout.splitlines()
    assert ok.startswith("1.0 0 ")
    value, length, tail = failed.split(" ", 2)
    assert value == "0.0" and int(length) < OUTPUT_TAIL_CHARS + 100 and "xxxEND" in tail


def test_the_process_exits_promptly_with_a_hung_call(tmp_path):
    (tmp_path / "hostile.py").write_text(HOSTILE)
    started = time.perf_counter()
    out = _run_script(f"""
        import threading, time
        from cispo.rewards import score_rewards
        from cispo.rewards.loading import load_reward
        r = load_reward({str(tmp_path / 'hostile.py:hostile')!r}, workers=2)
        print(score_rewards(r, [("p", "hang", {{}})], 0.3))       # timed out, killed
        threading.Thread(target=score_rewards, args=(r, [("p", "hang", {{}})], None), daemon=True).start()
        time.sleep(1.0)                                           # a call with no timeout is hung now
        print("exiting")
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "timed out after 0.3 s" in out.stdout and "exiting" in out.stdout
    assert time.perf_counter() - started < 30  # the hung reward sleeps 600 s


# ---------------------------------------------------------------------------------------
# In a run
# ---------------------------------------------------------------------------------------


def always_fails(prompt, completion, **sample):
    raise RuntimeError("verifier down")


def test_every_reward_failing_is_still_counted_in_training_and_evaluation(tiny_model, monkeypatch, tmp_path):
    base = cispo.tasks.get_task("addition")
    monkeypatch.setattr(cispo.tasks, "get_task", lambda name="addition": dataclasses.replace(base, reward=always_fails))
    result = train(small_config(tiny_model, tmp_path, "steps=2", "eval.every=0", "max_sampling_rounds=1"))
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if r["step"] > 0]
    assert train_rows and all(r["rollout/reward_errors"] == 16.0 for r in train_rows)  # P x G = 4 x 4, all dropped
    eval_rows = [r for r in rows if "eval/accuracy" in r]
    assert eval_rows and all(r["eval/reward_errors"] == 8 * (1 + 2) for r in eval_rows)  # greedy + 2 samples each


RUN_REWARD = '''
import os, sys

def reward(prompt, completion, **sample):
    """Exits, is interrupted or dies on some completions; a dense reward on the others."""
    kind = len(completion) % 5
    if kind == 0:
        sys.exit(0)
    if kind == 1:
        raise KeyboardInterrupt
    if kind == 2 and completion.count("1") % 3 == 0:
        os._exit(0)
    return completion.count("1") / max(len(completion), 1)
'''


def test_a_run_survives_a_reward_that_exits(tiny_model, tmp_path):
    rows = cispo.tasks.get_task("addition").train_samples(0, 64)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "hostile_reward.py").write_text(RUN_REWARD)
    cfg = small_config(tiny_model, tmp_path / "runs", "steps=2", "eval.every=0", f"data.path={data}",
                       f"data.reward={tmp_path / 'hostile_reward.py'}:reward", "data.reward_workers=2",
                       "data.reward_timeout_s=30")
    try:
        result = train(cfg)
    finally:
        shutdown_pools()
    metrics = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics if "rollout/reward_errors" in r] == [1, 2]
    assert sum(r["rollout/reward_errors"] for r in metrics if r["step"] > 0) > 0
    assert (result.run_dir / "checkpoints").is_dir()
