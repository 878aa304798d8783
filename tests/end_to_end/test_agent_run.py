"""A run whose environment is an agent program (``data.agent``), end to end: a tiny chat model over a character
tokenizer with a tool-taking chat template (tests/envs/test_agent_env.py), a program that makes three calls over
plain HTTP and returns a reward, the behaviour log-probs taken as log pi_old (``algo.logp_old=rollout``). The
calls reach ``samples.jsonl``, the rewards the step's metrics, the updates happen and the run finishes."""

import json

import pytest

from cispo.models.loading import save_policy
from cispo.training.runner import train
from tests.conftest import small_config
from tests.envs.test_agent_env import chat_model, chat_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_two_step_run_of_an_agent_program(tmp_path):
    tok = chat_tokenizer()
    model = save_policy(chat_model(tok), tok, tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"add {a} and {a + 1}"}) + "\n" for a in range(10)))
    cfg = small_config(model, tmp_path / "runs", f"data.path={prompts}", "data.reward=env", "model.chat_template=true",
                       "data.agent=tests/envs/fixtures/agent_programs.py:three_calls", "data.agent_timeout_s=30",
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
