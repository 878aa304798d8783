"""A run whose environment is an agent program (``data.agent``), end to end: a tiny chat model over a character
tokenizer with a tool-taking chat template (tests/envs/test_agent_env.py), a program that makes three calls over
plain HTTP and returns a reward, the behaviour log-probs taken as log pi_old (``algo.logp_old=rollout``). The
calls reach ``samples.jsonl``, the rewards the step's metrics, the updates happen and the run finishes."""

import json
import shlex
import sys
from pathlib import Path

import pytest

from cispo.models.loading import save_policy
from cispo.training.runner import train
from tests.conftest import small_config
from tests.envs.test_agent_env import chat_model, chat_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


FIXTURES = Path(__file__).resolve().parents[1] / "envs" / "fixtures"


def agent_keys(kind: str, program: str) -> str:
    """The key that runs `program` of the fixtures: a function of agent_programs.py (``kind="function"``) or
    agent_command.py as a command."""
    if kind == "function":
        return f"data.agent={FIXTURES / 'agent_programs.py'}:{program}"
    script = shlex.quote(str(FIXTURES / "agent_command.py"))
    return f"data.agent_command={shlex.quote(sys.executable)} {script} {program}"


@pytest.mark.parametrize("kind", ["function", "command"])
def test_a_two_step_run_of_an_agent_program(tmp_path, kind):
    tok = chat_tokenizer()
    model = save_policy(chat_model(tok), tok, tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"add {a} and {a + 1}"}) + "\n" for a in range(10)))
    cfg = small_config(model, tmp_path / "runs", f"data.path={prompts}", "data.reward=env", "model.chat_template=true",
                       agent_keys(kind, "three_calls"), "data.agent_timeout_s=30",
                       "rollout.max_turns=4", "max_new_tokens=60", "steps=2", "prompts_per_step=2", "group_size=3",
                       "eval.every=0", "checkpoint_every=0", "dynamic_sampling=false", "log_samples_every=1",
                       "algo.logp_old=rollout")
    assert train(cfg) is not None
    run = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert rows and all(r["agent"]["calls"] >= 1 for r in rows)
    assert any(r["agent"]["ended"] == "returned" and r["agent"]["calls"] == 3 for r in rows)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/turns" in m]
    assert len(steps) == 2 and all(m["rollout/turns"] > 0 for m in steps)
    assert any(m.get("optim/step_updates", 0) > 0 for m in steps)


@pytest.mark.parametrize("kind, extra", [("function", ()), ("command", ()), ("function", ("rollout.async_steps=1",))],
                         ids=["function", "command", "function-async"])
def test_kill_9_mid_episode_then_resume_equals_an_uninterrupted_run(tmp_path, kind, extra):
    """A ``cispo train`` process killed with SIGKILL while step 2's agent episodes are in flight (each has had
    its first call answered; `gated` then waits, as every episode started after step 1's checkpoint does),
    and resumed from that checkpoint, ends with the metrics and weights of the same run never stopped: what
    a killed episode had sampled is not kept, and step 2's episodes are played again from the checkpoint's
    generators. A command's processes do not outlive the killed trainer. With ``rollout.async_steps=1`` the
    checkpoint also holds a batch of agent episodes sampled ahead (whose samples the episodes' openings copied:
    the held batch names each by its index in the prompt stream)."""
    import os
    import subprocess
    import time

    import torch
    from safetensors.torch import load_file

    from cispo.config import TrainConfig, apply_overrides
    from cispo.records.tracking import read_metrics
    from tests.conftest import strip_perf

    tok = chat_tokenizer()
    model = save_policy(chat_model(tok), tok, tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"add {a} and {a + 1}"}) + "\n" for a in range(10)))

    def args(out):
        return [f"model.path={model}", f"out_dir={out}", "model.device=cpu", "progress=false", "threads=1",
                f"data.path={prompts}", "data.reward=env", "model.chat_template=true", agent_keys(kind, "gated"),
                "data.agent_timeout_s=60", "rollout.max_turns=4", "max_new_tokens=40", "steps=3",
                "prompts_per_step=2", "group_size=3", "updates_per_batch=2", "lr=1e-3", "warmup_updates=1",
                "eval.every=0", "eval.num_samples=0", "checkpoint_every=1", "keep_checkpoints=3",
                "dynamic_sampling=false", "run_name=r", "algo.logp_old=rollout", *extra]

    full = train(apply_overrides(TrainConfig(), args(tmp_path / "full")))
    gate = tmp_path / "gate"
    gate.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CISPO_TEST_GATE": str(gate),
           "CISPO_TEST_GATE_AFTER": str(tmp_path / "cut" / "r" / "checkpoints" / "step_000001")}
    proc = subprocess.Popen([sys.executable, "-m", "cispo", "train", *args(tmp_path / "cut")], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not any(gate.iterdir()):  # a step-2 episode has had its first call answered and waits
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no step-2 episode in flight after 300 s"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    if kind == "command":  # killed with the trainer (PR_SET_PDEATHSIG)
        from tests.envs.test_agent_command import alive

        pids = [int(p.read_text()) for p in gate.iterdir()]
        for _ in range(100):  # a bounded wait for the kernel's SIGKILL, not a timing
            if not any(alive(p) for p in pids):
                break
            time.sleep(0.05)
        assert pids and not any(alive(p) for p in pids), "an agent command outlived the killed trainer"
    cut = tmp_path / "cut" / "r"
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step_000001"]
    assert [r["step"] for r in read_metrics(cut / "metrics.jsonl")] == [0, 1]  # killed in step 2's rollout
    resumed = train(apply_overrides(TrainConfig(), args(tmp_path / "cut")), resume=True)
    rows_full = strip_perf(read_metrics(full.run_dir / "metrics.jsonl"))
    assert [r["step"] for r in rows_full] == [0, 1, 2, 3]
    assert strip_perf(read_metrics(resumed.run_dir / "metrics.jsonl")) == rows_full
    assert any(m.get("optim/step_updates", 0) > 0 for m in rows_full[1:])  # step 2 or 3 moved the weights
    final = "checkpoints/step_000003/model/model.safetensors"
    a, b = load_file(full.run_dir / final), load_file(resumed.run_dir / final)
    assert all(torch.equal(a[k], b[k]) for k in a)
