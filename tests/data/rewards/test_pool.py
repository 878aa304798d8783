"""User rewards in worker processes (cispo.data.rewards.pool): a reward that exits, is interrupted,
dies, hangs, floods its output or mutates its arguments costs one counted call, never the run.

Timeouts are short so that the module stays fast; every pool is stopped at the end."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import cispo.data.tasks
from cispo.data.rewards import score_rewards
from cispo.data.rewards.loading import load_reward
from cispo.data.rewards.pool import OUTPUT_TAIL_CHARS, shutdown_pools
from cispo.records.tracking import read_metrics
from cispo.training.runner import train
from tests.conftest import reward_calls as calls
from tests.conftest import small_config

REPO = str(Path(__file__).resolve().parents[3])

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
    if completion == "ok-then-die":  # returns; the worker dies once back waiting for its next call
        main = threading.main_thread().ident

        def die_when_idle():
            while sys._current_frames()[main].f_code.co_name != "_recv":  # its result is sent
                time.sleep(0.001)
            os._exit(9)

        threading.Thread(target=die_when_idle, daemon=True).start()
        return 11.0
    if completion == "huge":
        raise ValueError("start" + "x" * 20_000_000 + "end")
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
        from cispo.data.rewards.math import _timeout  # None where signal.alarm cannot work
        return float(_timeout(5) == 5)
    return float(len(completion))
'''


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "hostile.py"
    path.write_text(HOSTILE)
    yield load_reward(f"{path}:hostile", workers=2)
    shutdown_pools()


def test_user_rewards_run_in_the_pool_builtins_in_the_main_thread(hostile):
    assert hostile.isolated and not load_reward("exact_match").isolated


def test_exit_interrupt_and_death_are_counted_errors(hostile):
    started = time.perf_counter()
    out = score_rewards(hostile, calls("exit", "interrupt", "exit0", "die", "ok"), timeout_s=60)
    assert out[0] == (0.0, "SystemExit: 3")
    assert out[1] == (0.0, "KeyboardInterrupt")
    assert out[2][0] == 0.0 and "worker process died (exit status 0)" in out[2][1]  # os._exit(0): not lost
    assert out[3][0] == 0.0 and "worker process died (exit status 9)" in out[3][1]
    assert out[4] == (2.0, None)
    # the lost calls were reported, not waited out: under one timeout (not a bound on worker
    # start-up, which took 23-37 s on a loaded machine, more than the 20 s this said before)
    assert time.perf_counter() - started < 60
    assert score_rewards(hostile, calls("a", "abc"), timeout_s=30) == [(1.0, None), (3.0, None)]  # replaced


@pytest.mark.parametrize("late_s", [0.0, 0.3])
def test_a_death_fails_only_the_call_it_ended(hostile, monkeypatch, late_s):
    """A result sent before its worker died is kept, and a death fails only the call its worker
    had started, also when the pool reads its pipes late (``late_s``: as on a loaded machine),
    so that a worker's last result and its death are both waiting. Before (pebble 5.2.3: 6 of 80
    runs of the test above alone on a loaded machine, 5 of 5 batches with its reading thread
    0.3 s late), the death was charged to the call just finished (its result dropped), the call
    that did die waited out its 30 s (forever without a timeout), or every call of the batch
    failed (BrokenProcessPool)."""
    import cispo.data.rewards.pool as pool

    real_wait = pool.wait
    monkeypatch.setattr(pool, "wait", lambda objects, timeout=None: time.sleep(late_s) or real_wait(objects, timeout))
    one_worker = dataclasses.replace(hostile, workers=1)  # the calls run in this order, on one worker at a time
    out = score_rewards(one_worker, calls("ab", "die", "abc", "ok-then-die"), timeout_s=30)
    assert out[0] == (2.0, None)
    assert out[1][0] == 0.0 and "worker process died (exit status 9)" in out[1][1]  # not waited out
    assert out[2] == (3.0, None)
    assert out[3] == (11.0, None)  # its worker died after sending it, between calls: no call failed
    assert score_rewards(one_worker, calls("abcd"), timeout_s=30) == [(4.0, None)]  # replaced


def test_hanging_calls_are_killed_and_do_not_jam_the_pool(hostile):
    started = time.perf_counter()
    out = score_rewards(hostile, calls(*["hang"] * 5, "ok"), timeout_s=0.3)  # 5 hangs > 2 workers
    assert [v for v, _ in out] == [0.0] * 5 + [2.0]
    assert all("timed out after 0.3 s (its worker process was killed and replaced)" == e for _, e in out[:5])
    assert time.perf_counter() - started < 120  # each hang sleeps 600 s: killed (the rest is starting workers)
    assert score_rewards(hostile, calls("abcd"), timeout_s=0.3) == [(4.0, None)]


def test_arguments_are_copies(hostile):
    sample = {"answer": ["gold"]}
    out = score_rewards(hostile, [("p", "mutate", sample)] * 3, timeout_s=30)
    assert out == [(2.0, None)] * 3  # each call saw the original one-element list
    assert sample == {"answer": ["gold"]}


def test_a_20_mb_exception_message_is_cut(hostile):
    """Before: the whole 20 MB came back, was printed each step and written to samples.jsonl."""
    from cispo.data.rewards import MESSAGE_HEAD_CHARS, MESSAGE_TAIL_CHARS, safe_reward

    [(value, error)] = score_rewards(hostile, calls("huge"), timeout_s=30)
    _, main_thread_error = safe_reward(hostile, "p", "huge", {})
    for message in (error, main_thread_error):
        assert message.startswith("ValueError: startxxx") and message.endswith("xxxend")
        assert len(message) < MESSAGE_HEAD_CHARS + MESSAGE_TAIL_CHARS + 100
        cut = len("ValueError: start") + 20_000_003 - MESSAGE_HEAD_CHARS - MESSAGE_TAIL_CHARS
        assert f"[... {cut} characters cut ...]" in message
    assert value == 0.0


def test_an_exception_whose_str_fails_is_still_described():
    from cispo.data.rewards import describe_error

    class Hostile(Exception):
        def __str__(self):
            raise RuntimeError("no")

    assert describe_error(Hostile()) == "Hostile: (its message could not be read: RuntimeError)"


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
        from cispo.data.rewards import score_rewards
        from cispo.data.rewards.loading import load_reward
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
        from cispo.data.rewards import score_rewards
        from cispo.data.rewards.loading import load_reward
        r = load_reward({str(tmp_path / 'hostile.py:hostile')!r}, workers=2)
        print(score_rewards(r, [("p", "hang", {{}})], 0.3))       # timed out, killed
        threading.Thread(target=score_rewards, args=(r, [("p", "hang", {{}})], None), daemon=True).start()
        time.sleep(1.0)                                           # a call with no timeout is hung now
        print("exiting")
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "timed out after 0.3 s" in out.stdout and "exiting" in out.stdout
    assert time.perf_counter() - started < 120  # the hung reward sleeps 600 s


# ---------------------------------------------------------------------------------------
# In a run
# ---------------------------------------------------------------------------------------


def always_fails(prompt, completion, **sample):
    raise RuntimeError("verifier down")


def test_every_reward_failing_is_still_counted_in_training_and_evaluation(tiny_model, monkeypatch, tmp_path):
    base = cispo.data.tasks.get_task("addition")
    monkeypatch.setattr(cispo.data.tasks, "get_task",
                        lambda name="addition": dataclasses.replace(base, reward=always_fails))
    result = train(small_config(tiny_model, tmp_path, "steps=2", "eval.every=0", "max_sampling_rounds=1"))
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if r["step"] > 0]
    assert train_rows and all(r["rollout/reward_errors"] == 16.0 for r in train_rows)  # P x G = 4 x 4, all dropped
    eval_rows = [r for r in rows if "eval/accuracy" in r]
    assert eval_rows and all(r["eval/reward_errors"] == 8 * (1 + 2) for r in eval_rows)  # greedy + 2 samples each


def fails_in_half_a_pair(prompt, completion, **sample):
    raise RuntimeError("verifier down \ud800 here")


def test_a_rewards_message_that_is_not_valid_unicode_is_saved_replaced(tiny_model, monkeypatch, tmp_path):
    """Was: a reward's exception message holding a lone surrogate reached samples.jsonl as it was: a
    UnicodeEncodeError that ended the run at its first step. Now the message is valid text (U+FFFD for
    each lone surrogate) and the run goes on, its reward errors counted."""
    base = cispo.data.tasks.get_task("addition")
    monkeypatch.setattr(cispo.data.tasks, "get_task",
                        lambda name="addition": dataclasses.replace(base, reward=fails_in_half_a_pair))
    result = train(small_config(tiny_model, tmp_path, "steps=1", "eval.every=0", "max_sampling_rounds=1",
                                "dynamic_sampling=false"))
    assert read_metrics(result.run_dir / "metrics.jsonl")[-1]["rollout/reward_errors"] == 16.0
    rows = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows and {r["reward_error"] for r in rows} == {"RuntimeError: verifier down \ufffd here"}


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
    rows = cispo.data.tasks.get_task("addition").train_samples(0, 64)
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


# ---------------------------------------------------------------------------------------
# Started in set-up, while the model loads, not at the first step
# ---------------------------------------------------------------------------------------

MARKING_REWARD = '''
import os, sys
with open(os.environ["CISPO_TEST_IMPORTS"], "a") as f:  # one line per process that imports this file
    f.write(f"{os.getpid()}\\n")

def reward(prompt, completion, **sample):
    return completion.count("1") / max(len(completion), 1)
'''


def test_started_workers_load_the_reward_before_any_call(tmp_path, monkeypatch):
    from cispo.data.rewards import start_reward_workers

    marks = tmp_path / "imports.txt"
    monkeypatch.setenv("CISPO_TEST_IMPORTS", str(marks))
    (tmp_path / "marking.py").write_text(MARKING_REWARD)
    reward = load_reward(f"{tmp_path / 'marking.py'}:reward", workers=2)  # the trial import: one line
    here = os.getpid()
    try:
        start_reward_workers(reward)
        deadline = time.monotonic() + 120  # a wait for the workers, not a timing: they start on their own
        while len(set(marks.read_text().split()) - {str(here)}) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(set(marks.read_text().split()) - {str(here)}) == 3  # trial + 2 workers, no call made
        assert score_rewards(reward, calls("11", "1x"), timeout_s=30) == [(1.0, None), (0.5, None)]
    finally:
        shutdown_pools()


def test_the_pool_is_started_before_the_first_step(tiny_model, tmp_path, monkeypatch):
    """With a file reward the workers exist once set-up is done: step 1 does not pay for starting them."""
    import multiprocessing

    from cispo.data.rewards.processes import GroupProcess
    from cispo.training.rl_step import RLStep

    rows = cispo.data.tasks.get_task("addition").train_samples(0, 64)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("CISPO_TEST_IMPORTS", str(tmp_path / "imports.txt"))
    (tmp_path / "marking.py").write_text(MARKING_REWARD)
    seen = []
    step = RLStep.__call__

    def first_step_sees_workers(self, *args, **kwargs):
        if not seen:
            seen.append([p for p in multiprocessing.active_children() if isinstance(p, GroupProcess)])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(RLStep, "__call__", first_step_sees_workers)
    cfg = small_config(tiny_model, tmp_path / "runs", "steps=1", "eval.every=0", "data.num_eval_prompts=0",
                       f"data.path={data}", f"data.reward={tmp_path / 'marking.py'}:reward", "data.reward_workers=2")
    try:
        train(cfg)
    finally:
        shutdown_pools()
    assert len(seen[0]) == 2  # both workers, started during set-up (no evaluation ran before step 1)
