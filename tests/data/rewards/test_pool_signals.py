"""User rewards in worker processes (cispo.data.rewards.pool), continued: SIGTERM in the middle of a reward
call (to the trainer, to the job's process group) and resume, children a reward starts, and a step
whose calls fail during a stop. The pool itself is in test_reward_pool.py."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import cispo.data.tasks
from cispo.data.rewards import score_rewards
from cispo.data.rewards.loading import load_reward
from cispo.data.rewards.pool import shutdown_pools
from cispo.records.runfolder import run_dir_of
from cispo.records.tracking import read_metrics
from cispo.training.runner import train
from tests.conftest import reward_calls as calls
from tests.conftest import small_config

REPO = str(Path(__file__).resolve().parents[3])


# ---------------------------------------------------------------------------------------
# Signals, children, long messages
# ---------------------------------------------------------------------------------------


def _cli(model, out, data, reward, *extra):
    return [sys.executable, "-m", "cispo", "train", f"model.path={model}", "model.device=cpu", f"out_dir={out}",
            "run_name=r", "prompts_per_step=4", "group_size=4", "updates_per_batch=4", "max_new_tokens=10",
            "num_train_prompts=64", "num_eval_prompts=8", "eval.num_samples=2", "eval.every=0", "lr=1e-3",
            "warmup_updates=2", "progress=false", "threads=1", "model.compile=off", "checkpoint_every=0",
            f"data.path={data}", f"data.reward={reward}", "data.reward_workers=2", "data.reward_timeout_s=60", *extra]


def _prompts(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in cispo.data.tasks.get_task("addition").train_samples(0, 64)))
    return data


SIGNALLING_REWARD = '''
import os, signal, subprocess, time

def reward(prompt, completion, **sample):
    """A dense reward; the one call that takes the trigger file signals the job, as a scheduler
    would, while it runs: the trainer's process group, or (``every``) also this worker and the
    verifier process this call runs, which then dies of it."""
    trigger = os.environ.get("TRIGGER", "")
    try:
        os.rename(trigger, trigger + ".taken")  # exactly one call wins
    except OSError:
        return completion.count("1") / max(len(completion), 1)
    how, pgid = open(trigger + ".taken").read().split()
    verifier = subprocess.Popen(["sleep", "30"])
    os.killpg(int(pgid), signal.SIGTERM)
    if how == "every":
        os.kill(os.getpid(), signal.SIGTERM)
        verifier.send_signal(signal.SIGTERM)
    else:
        time.sleep(0.5)
        verifier.kill()
    if verifier.wait() == -signal.SIGTERM:
        raise RuntimeError("the verifier was killed by SIGTERM")
    return completion.count("1") / max(len(completion), 1)
'''


@pytest.fixture(scope="module")
def signalled(tiny_model, tmp_path_factory):
    """(the uninterrupted run's folder, a function running the run signalled and resumed)."""
    tmp = tmp_path_factory.mktemp("signalled")
    data, reward = _prompts(tmp), tmp / "signalling.py"
    reward.write_text(SIGNALLING_REWARD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRIGGER": str(tmp / "no-trigger")}
    ref = subprocess.run(_cli(tiny_model, tmp / "ref", data, f"{reward}:reward", "steps=5"), capture_output=True,
                         text=True, env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]

    def run(how: str):
        out, trigger = tmp / how, tmp / f"{how}.trigger"
        cmd = _cli(tiny_model, out, data, f"{reward}:reward")
        proc = subprocess.Popen(cmd + ["steps=1000"], stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env={**env, "TRIGGER": str(trigger)})
        try:
            deadline = time.time() + 120
            while not (out / "r" / "metrics.jsonl").exists() or \
                    not any(r["step"] >= 1 for r in read_metrics(out / "r" / "metrics.jsonl")):
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
                time.sleep(0.1)
            (tmp / "t").write_text(f"{how} {proc.pid}")  # the next call signals the run's process group
            os.replace(tmp / "t", trigger)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        resumed = subprocess.run(cmd + ["steps=5", "--resume"], capture_output=True, text=True, env=env)
        return proc.returncode, err, resumed

    return tmp / "ref" / "r", run


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _final_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / "step_000005" / "model" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["group", "every"])
def test_sigterm_mid_reward_call_then_resume_matches_the_uninterrupted_run(signalled, tiny_model, how):
    """SIGTERM to the run's process group (``group``: the workers are in sessions of their own
    and finish their calls; the step completes and is checkpointed), or to every process of the
    job (``every``, as systemd / Slurm: a worker ignores it, but the reward's verifier dies and
    its call fails; that step is not committed, the last complete one is checkpointed). Either
    way the resumed run ends with the uninterrupted run's metrics and weights."""
    import torch
    from safetensors.torch import load_file

    ref_dir, run = signalled
    rc, err, resumed = run(how)
    assert rc == 130, err[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if how == "group":
        assert "reward call(s) failed" not in err and "checkpoint saved, continue with --resume" in err
    else:
        assert "which is not saved" in err and "the verifier was killed by SIGTERM" in err, err[-3000:]
    out_dir = ref_dir.parent.parent / how / "r"
    expected = _strip(read_metrics(ref_dir / "metrics.jsonl"))
    assert _strip(read_metrics(out_dir / "metrics.jsonl")) == expected
    assert all(r.get("rollout/reward_errors", 0) == 0 for r in expected)
    a, b = _final_weights(ref_dir), _final_weights(out_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(tiny_model / "model.safetensors")
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the weights moved: the comparison can fail


TERM_REWARD = '''
import os, signal, time

def reward(prompt, completion, **sample):
    if completion == "signal":  # as a scheduler stopping the job, while this call runs
        os.killpg(int(os.environ["JOB_PGID"]), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
    return float(len(completion))
'''


def test_workers_finish_their_calls_through_a_sigterm_to_the_job(tmp_path):
    """SIGTERM to the trainer's process group and to the worker itself, during a call: the
    trainer gets it, the workers finish every call (before: they died, the calls scored 0)."""
    (tmp_path / "term.py").write_text(TERM_REWARD)
    code = textwrap.dedent(f"""
        import os, signal
        from cispo.data.rewards import score_rewards
        from cispo.data.rewards.loading import load_reward
        got = []
        signal.signal(signal.SIGTERM, lambda *a: got.append("SIGTERM"))
        os.environ["JOB_PGID"] = str(os.getpgid(0))
        r = load_reward({str(tmp_path / 'term.py:reward')!r}, workers=2)
        print(score_rewards(r, [("p", c, {{}}) for c in ("a", "signal", "bb", "ccc", "dddd")], 30), got)
        print(score_rewards(r, [("p", c, {{}}) for c in ("a", "bb")], 30))
    """)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=REPO,
                         start_new_session=True)  # a process group of its own, as a job's
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = out.stdout.splitlines()
    assert first == "[(1.0, None), (6.0, None), (2.0, None), (3.0, None), (4.0, None)] ['SIGTERM']"
    assert second == "[(1.0, None), (2.0, None)]"


def test_a_step_whose_reward_calls_fail_during_a_stop_is_not_committed(tiny_model, monkeypatch, tmp_path):
    """A SIGTERM that makes a reward call fail (the verifier it runs is killed with the job):
    the step is given up before its updates, the last complete step is checkpointed, and the
    resumed run ends with the uninterrupted run's metrics and weights."""
    import torch
    from safetensors.torch import load_file

    from tests.conftest import digit_reward

    base = cispo.data.tasks.get_task("addition")
    state = {"calls": 0, "armed": False}

    def reward(prompt, completion, **sample):
        state["calls"] += 1
        if state["armed"] and state["calls"] > 24 + 16:  # past the step-0 evaluation and one round of step 1
            state["armed"] = False
            os.kill(os.getpid(), signal.SIGTERM)
            raise RuntimeError("the verifier was killed by SIGTERM")
        return digit_reward(prompt, completion)

    monkeypatch.setattr(cispo.data.tasks, "get_task", lambda name="addition": dataclasses.replace(base, reward=reward))
    args = ("steps=3", "eval.every=0", "checkpoint_every=0")
    ref = train(small_config(tiny_model, tmp_path / "ref", *args))
    state.update(calls=0, armed=True)
    cfg = small_config(tiny_model, tmp_path / "run", *args)
    with pytest.raises(KeyboardInterrupt, match=r"stopped by SIGTERM during step (\d), which is not saved: 1 of its "
                       r"reward calls failed .*the verifier was killed by SIGTERM.*checkpoint of step") as info:
        train(cfg)
    stopped = int(re.search(r"during step (\d)", str(info.value)).group(1))
    run_dir = run_dir_of(cfg)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(stopped))  # the step in flight is not in the log
    assert (run_dir / "checkpoints" / f"step_{stopped - 1:06d}").is_dir()
    assert all(r.get("rollout/reward_errors", 0) == 0 for r in rows)
    resumed = train(cfg, resume=True)
    resumed_rows = _strip(read_metrics(resumed.run_dir / "metrics.jsonl"))
    assert resumed_rows == _strip(read_metrics(ref.run_dir / "metrics.jsonl"))
    a = load_file(ref.run_dir / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    b = load_file(resumed.run_dir / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    start = load_file(tiny_model / "model.safetensors")
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the weights moved: the comparison can fail


CHILD_REWARD = '''
import os, subprocess, sys, time

def reward(prompt, completion, **sample):
    """Starts a long-sleeping child (stdout inherited) in every call and waits until it shows in
    /proc as ``sleep SLEEP_FOR`` (Popen returns mid-exec, while its command line is still empty:
    the tests, counting children by command line, would miss it); then hangs or dies if asked."""
    child = subprocess.Popen(["sleep", os.environ["SLEEP_FOR"]])
    deadline = time.monotonic() + 30
    while not open(f"/proc/{child.pid}/cmdline", "rb").read() and time.monotonic() < deadline:
        time.sleep(0.001)
    if completion == "hang":
        time.sleep(600)
    if completion == "die":
        os._exit(9)
    return completion.count("1") / max(len(completion), 1)
'''


def _sleepers(seconds: str) -> list[int]:
    """Pids of the ``sleep SECONDS`` processes alive now (from /proc)."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and open(f"/proc/{d}/cmdline", "rb").read() == f"sleep\0{seconds}\0".encode():
                pids.append(int(d))
        except OSError:
            pass
    return pids


def _wait_until_none(seconds: str, within: float = 10.0) -> list[int]:
    deadline = time.time() + within
    while _sleepers(seconds) and time.time() < deadline:
        time.sleep(0.1)
    return _sleepers(seconds)


def _kill(pids):
    for pid in pids:  # a failed test leaves none of its own sleepers behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="lists processes from /proc")


@needs_proc
def test_children_a_reward_starts_do_not_outlive_the_run(tiny_model, tmp_path):
    """Every call starts ``sleep 300``; after a run, none is left, and a caller capturing the
    trainer's output returns when the run ends, not when the children do."""
    (tmp_path / "children.py").write_text(CHILD_REWARD)
    seconds = f"300.{os.getpid()}"  # a command line no other process has
    started = time.perf_counter()
    try:
        out = subprocess.run(_cli(tiny_model, tmp_path / "runs", _prompts(tmp_path), f"{tmp_path / 'children.py'}:reward",  # noqa: E501
                                  "steps=1"), capture_output=True, text=True, timeout=200,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "SLEEP_FOR": seconds})
        assert out.returncode == 0, out.stderr[-3000:]
        assert time.perf_counter() - started < 120
        assert _wait_until_none(seconds, within=2.0) == []  # before: 64 left (24 + 16 + 24 calls)
    finally:
        _kill(_sleepers(seconds))


@needs_proc
def test_children_die_with_a_timed_out_or_dead_worker(tmp_path, monkeypatch):
    """A worker stopped at its call's timeout, or dead by ``os._exit``, takes the processes its
    reward started with it (its process group is killed); so does closing the pool."""
    (tmp_path / "children.py").write_text(CHILD_REWARD)
    seconds = f"301.{os.getpid()}"
    monkeypatch.setenv("SLEEP_FOR", seconds)  # the workers are spawned with this environment
    try:
        reward = load_reward(f"{tmp_path / 'children.py'}:reward", workers=2)
        out = score_rewards(reward, calls("hang", "die"), timeout_s=1.0)
        assert [v for v, _ in out] == [0.0, 0.0] and "timed out" in out[0][1] and "exit status 9" in out[1][1]
        assert _wait_until_none(seconds, within=30.0) == []  # generous: the machine may be loaded
        assert score_rewards(reward, calls("11", "1a"), timeout_s=30) == [(1.0, None), (0.5, None)]
        assert len(_sleepers(seconds)) == 2  # the workers are alive, so are their children
        shutdown_pools()
        assert _wait_until_none(seconds, within=10.0) == []
    finally:
        shutdown_pools()
        _kill(_sleepers(seconds))


@needs_proc
@pytest.mark.parametrize("reaper", ["join", "active_children", "another_start"])
def test_a_child_dies_with_its_process_whoever_reaps_it(reaper):
    """A `GroupProcess` that ended by itself takes its child with it also when it is reaped by
    ``join``, by ``multiprocessing.active_children`` or by the clean-up of finished children that
    any ``Process.start`` runs (the reward pool starting a worker); before, only ``is_alive``
    killed its group and the other three left the child running."""
    import multiprocessing

    from cispo.data.rewards.processes import worker_context

    seconds = f"302.{os.getpid()}"
    proc = worker_context().Process(target=os.system, args=(f"sleep {seconds} & sleep 0.2",))
    other = worker_context().Process(target=os.getpid)
    try:
        proc.start()
        deadline = time.monotonic() + 30  # a wait for its child to run `sleep`, not a timing
        while not _sleepers(seconds) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(_sleepers(seconds)) == 1
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # it has ended; not reaped yet
        if reaper == "join":
            proc.join()
        elif reaper == "active_children":
            multiprocessing.active_children()
        else:
            other.start()
        assert _wait_until_none(seconds, within=10.0) == []
    finally:
        _kill(_sleepers(seconds))
        proc.join()
        if other.pid is not None:
            other.join()
