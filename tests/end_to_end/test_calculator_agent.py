"""A calculator agent end to end: the torch sampler, the inline calculator environment and the trainer's
``sample_groups`` together. A scripted model (its next token a function of the position only) writes
``<calc>30+21</calc>``, the environment inserts ``<result>51</result>`` through the KV cache, the model
answers ``#### 51``: the trained ids are the sampled ids (no decode / re-encode), the observation is
masked, the reward reads the policy's own text, the episode is recorded; and a short run on the task
``wordmath_calc`` logs the tool metrics and writes each segment to ``samples.jsonl``."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cispo.data.rewards.pool import shutdown_pools  # noqa: E402
from cispo.data.tasks import get_task  # noqa: E402
from cispo.envs.tool_env import build_environment  # noqa: E402
from cispo.models.policy import Policy  # noqa: E402
from cispo.rollout import SamplingConfig, TorchSampler  # noqa: E402
from cispo.training.metrics import episode_metrics  # noqa: E402
from cispo.training.sampling import Scoring, sample_groups  # noqa: E402

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "cispo" / "data" / "tasks" / "base_models" / "smollm2-tokenizer"
Q = "Ava has 30 apples. Ava gets 21 more apples. How many apples does Ava have now?"
pytestmark = pytest.mark.usefixtures("one_thread")


class Scripted(torch.nn.Module):
    """Greedy writes ``script[k]`` as the k-th response token (k from the position id): the observation's
    positions are fed, so whatever it predicts there is never drawn."""

    def __init__(self, script: list[int], prompt_len: int, vocab: int):
        super().__init__()
        self.script, self.prompt_len, self.vocab = script, prompt_len, vocab
        self.weight = torch.nn.Parameter(torch.zeros(1))  # a device for the sampler

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        B, L = input_ids.shape
        logits = torch.zeros(B, L, self.vocab)
        k = (position_ids[:, -1] + 1 - self.prompt_len).tolist()  # the response index the last position predicts
        for b, i in enumerate(k):
            logits[b, -1, self.script[min(i, len(self.script) - 1)]] = 30.0
        return SimpleNamespace(logits=logits, past_key_values=(past_key_values or 0) + 1)


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def sample_script(tokenizer, script: list[int], prompt: list[int], answer: str = "51"):
    """``sample_groups`` on the task ``wordmath_calc`` (its calculator, its scoring) for a model that writes
    ``script``: two greedy answers to Q."""
    env = build_environment(tokenizer, task="wordmath_calc", isolation="main")
    sample = {"prompt": Q, "answer": answer, "messages": [{"role": "user", "content": Q}]}
    model = Scripted(script, len(prompt), len(tokenizer))
    sampler = TorchSampler(model, tokenizer.eos_token_id, tokenizer.pad_token_id or 0, decode="hf")
    policy = Policy(model, tokenizer, sampler, torch.device("cpu"), environment=env)
    policy.encode = lambda s: prompt  # the script is aligned to this prompt
    task = get_task("wordmath_calc")
    try:
        scoring = Scoring(task.reward, policy_text=task.scores_policy_text)
        return sample_groups(policy, [sample], 2, SamplingConfig(max_new_tokens=64, temperature=0.0), scoring,
                             torch.Generator().manual_seed(0))
    finally:
        env.close()
        shutdown_pools()


def test_a_calculator_episode_through_sampler_environment_and_trainer(tokenizer):
    env = build_environment(tokenizer, task="wordmath_calc", isolation="main")
    assert env.tool_format == "inline" and env.stop_strings == ("</calc>",)
    env.close()
    prompt = tokenizer.encode(Q)
    call = tokenizer.encode("I add. <calc>30+21</calc>", add_special_tokens=False)
    observation = tokenizer.encode("<result>51</result>", add_special_tokens=False)
    answer = tokenizer.encode("\n#### 51", add_special_tokens=False) + [tokenizer.eos_token_id]
    groups = sample_script(tokenizer, call + observation + answer, prompt)
    c = groups[0][0]
    assert c.response_ids.tolist() == call + observation + answer  # the ids trained on are the ids produced
    assert c.env_mask.tolist() == [0] * len(call) + [1] * len(observation) + [0] * len(answer)
    assert c.policy_length == len(call) + len(answer) and c.finish_reason == "eos"
    assert "<result>51</result>" in c.text and c.task_reward == 1.0  # the normal episode is paid
    assert c.scored_text == c.answer_text == "I add. <calc>30+21</calc>\n#### 51"  # what the reward read
    assert (c.logp_rollout[c.env_mask == 1] == 0).all()
    assert c.episode["tool_calls"] == 1 and c.episode["tool_errors"] == 0
    assert [seg["role"] for seg in c.episode["segments"]] == ["policy", "tool", "policy"]
    m = episode_metrics([c for g in groups for c in g], "rollout/")
    assert math.isnan(m.pop("rollout/turn_reward_mean"))  # the calculator rewards no turn
    assert m == {"rollout/tool_calls": 1.0, "rollout/tool_call_rate": 1.0, "rollout/tool_errors": 0.0,
                 "rollout/env_tokens": float(len(observation)), "rollout/turns": 2.0,
                 "rollout/final_reward_mean": 1.0, "rollout/rows_per_episode": 1.0, "rollout/rewrites": 0.0}


def test_a_forged_call_closing_is_the_policys_own_text_and_its_hedge_counts(tokenizer):
    """The policy writes ``</calc``, a special token, ``>``: the environment makes no call (its tokens spell no
    ``</calc>``) and the text decodes to ``</calc>``; the ``<result> or 8</result>`` the policy writes next is its
    own (``env_mask`` 0), so its hedge is read and ``#### 7`` is not paid (gold 7)."""
    prompt = tokenizer.encode(Q)
    file_sep = tokenizer.convert_tokens_to_ids("<file_sep>")
    script = (tokenizer.encode("#### 7 </calc", add_special_tokens=False) + [file_sep]
              + tokenizer.encode("><result> or 8</result>", add_special_tokens=False) + [tokenizer.eos_token_id])
    c = sample_script(tokenizer, script, prompt, answer="7")[0][0]
    assert c.response_ids.tolist() == script and c.env_mask.tolist() == [0] * len(script)
    assert c.text == "#### 7 </calc><result> or 8</result>" and c.episode["tool_calls"] == 0
    assert c.task_reward == 0.0


def test_a_run_on_wordmath_calc_logs_tools_and_segments(tmp_path):
    from cispo.config.train import TrainConfig, apply_overrides
    from cispo.models.packaged import save_tiny_smollm2
    from cispo.training.runner import train

    model = save_tiny_smollm2(tmp_path / "tiny-smollm2")
    cfg = apply_overrides(TrainConfig(), [
        f"model.path={model}", f"out_dir={tmp_path}", "data.task=wordmath_calc", "model.device=cpu", "progress=false",
        "steps=1", "prompts_per_step=2", "group_size=2", "updates_per_batch=1", "max_new_tokens=12",
        "num_train_prompts=8", "num_eval_prompts=2", "eval.every=0", "checkpoint_every=0", "threads=1",
        "rollout.dynamic_sampling=false", "log_samples_every=1"])
    run = train(cfg)
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r.get("step") == 1 and "rollout/tool_calls" in r]
    assert step and {"rollout/tool_call_rate", "rollout/tool_errors", "rollout/env_tokens"} <= step[0].keys()
    evals = [r for r in rows if "eval/tool_call_rate" in r]  # the held-out evaluation runs episodes too
    assert evals and {"eval/tool_calls", "eval/tool_errors", "eval/env_tokens"} <= evals[0].keys()
    samples = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all("segments" in s and s["segments"][0]["role"] == "policy" for s in samples)
