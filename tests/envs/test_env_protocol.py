"""The environment protocol (cispo.envs.base / episodes / factory): a stateful `Env` driven as the samplers drive
it, per-turn rewards recorded exactly, observations as text, chat messages or ids, openings from ``reset``, a
failing step contained, a TRL ``environment_factory`` class run unchanged, and the same scripted episodes on the
torch sampler and the vLLM stand-in."""

from __future__ import annotations

import json
import re

import pytest
import torch

from cispo.envs.base import Env, Segment, StepResult
from cispo.envs.episodes import Environments, opened_sample
from cispo.envs.factory import FactoryEnvironments, load_environment_class
from cispo.envs.tools import ToolSpecError
from cispo.training.sampling import opened_groups
from tests.envs.fixtures.scripted_envs import Counter
from tests.envs.test_environments import ids


class Guess(Env):
    """Guess the secret: ``higher`` / ``lower`` after a wrong guess (-0.1 each), the episode ends at the secret;
    final reward 1 where it was found."""

    def __init__(self):
        self.secret, self.found, self.guesses = None, False, []

    def reset(self, sample):
        self.secret = sample["secret"]
        return None

    def step(self, segment: Segment) -> StepResult:
        guess = int("".join(c for c in segment.text if c.isdigit()) or -1)
        self.guesses.append(guess)
        if guess == self.secret:
            self.found = True
            return StepResult(None, reward=0.0, info={"guess": guess})
        return StepResult(" higher." if guess < self.secret else " lower.", reward=-0.1, info={"guess": guess})

    def final_reward(self):
        return 1.0 if self.found else 0.0

    def record(self):
        return {"guesses": list(self.guesses)}


class Family(Environments):
    def __init__(self, tokenizer, cls=Guess, max_turns=4, stop_strings=("?",)):
        self.tokenizer, self.cls, self.max_turns, self.stop_strings = tokenizer, cls, max_turns, stop_strings

    def make(self, sample):
        return self.cls()


def play(tok, episodes, row, texts):
    """Each text as a segment ended by the stop string ``?``: the observations' texts (None: the episode ended)."""
    out = []
    for text in texts:
        segment = ids(tok, text)
        assert episodes.pauses(row, segment)
        obs, = episodes.respond([row], [segment], [False])
        out.append(None if obs is None else tok.decode(obs))
        if obs is None:
            break
    return out


def test_a_stateful_env_over_three_turns_records_each_turns_reward(smol):
    episodes = Family(smol).start([{"prompt": "q", "secret": 7}])
    assert play(smol, episodes, 0, ["5?", "8?", "7?"]) == [" higher.", " lower.", None]
    record = episodes.record(0)
    # turns: -0.1, -0.1, 0.0; the final reward 1.0 counts toward the last turn
    assert record["turn_rewards"] == pytest.approx([-0.1, -0.1, 1.0])
    assert record["guesses"] == [5, 8, 7] and [i["guess"] for i in record["turn_info"]] == [5, 8, 7]
    assert [s["role"] for s in record["segments"]] == ["policy", "tool", "policy", "tool", "policy"]
    assert json.loads(json.dumps(record)) == record


def test_the_observation_depends_on_what_the_policy_did(smol):
    episodes = Family(smol).start([{"prompt": "q", "secret": 3}, {"prompt": "q", "secret": 9}])
    a, b = (episodes.respond([r], [ids(smol, "5?")], [False])[0] for r in (0, 1))
    assert smol.decode(a) == " lower." and smol.decode(b) == " higher."


def test_an_episode_cut_before_its_step_gets_the_final_reward_on_its_own_segment(smol):
    episodes = Family(smol).start([{"prompt": "q", "secret": 7}])
    play(smol, episodes, 0, ["5?"])
    episodes.pauses(0, ids(smol, "6"))  # the sampler's length cut this segment: no step
    assert episodes.record(0)["turn_rewards"] == pytest.approx([-0.1, 0.0])  # not found: final reward 0


def test_max_turns_ends_the_episode_after_its_last_observation(smol):
    episodes = Family(smol, max_turns=2).start([{"prompt": "q", "secret": 7}])
    assert play(smol, episodes, 0, ["1?", "2?", "3?"]) == [" higher.", " higher.", None]
    assert episodes.record(0)["turn_rewards"] == pytest.approx([-0.1, -0.1, -0.1])


def test_an_env_without_rewards_records_none(smol):
    class Echo(Env):
        def step(self, segment):
            return StepResult(segment.text[::-1])

    episodes = Family(smol, cls=Echo, max_turns=1).start([{"prompt": "q"}])
    assert play(smol, episodes, 0, ["ab?", "c?"]) == ["?ba", None]
    assert "turn_rewards" not in episodes.record(0)


def test_a_step_that_raises_ends_its_episode_and_nothing_else(smol):
    class Broken(Guess):
        def step(self, segment):
            if self.guesses:
                raise RuntimeError("the environment broke")
            return super().step(segment)

    episodes = Family(smol, cls=Broken).start([{"prompt": "q", "secret": 7}] * 2)
    out = episodes.respond([0, 1], [ids(smol, "5?"), ids(smol, "9?")], [False, False])
    assert [smol.decode(o) for o in out] == [" higher.", " lower."]
    out = episodes.respond([0, 1], [ids(smol, "6?"), ids(smol, "7?")], [False, False])
    assert out == [None, None]
    assert "RuntimeError: the environment broke" in episodes.record(0)["env_error"]


def test_observations_as_messages_and_as_ids(qwen):
    class Chat(Env):
        def __init__(self):
            self.n = 0

        def step(self, segment):
            self.n += 1
            return StepResult([{"role": "user", "content": "higher"}] if self.n == 1 else [5, 6, 7])

    episodes = Family(qwen, cls=Chat, stop_strings=()).start([{"prompt": "q"}])
    end = ids(qwen, "<|im_end|>")
    first, = episodes.respond([0], [ids(qwen, "5") + end], [True])
    before = qwen.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "5"}],
                                      tokenize=False)
    after = qwen.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "5"},
                                      {"role": "user", "content": "higher"}], tokenize=False,
                                     add_generation_prompt=True)
    assert qwen.decode(first) == after[len(before) - len("<|im_end|>\n") + len("<|im_end|>"):]
    second, = episodes.respond([0], [ids(qwen, "6") + end], [True])
    assert second == [5, 6, 7]


def test_an_observation_of_another_kind_ends_the_episode_with_the_error(smol):
    class Odd(Env):
        def step(self, segment):
            return StepResult(3.5)

    episodes = Family(smol, cls=Odd).start([{"prompt": "q"}])
    assert episodes.respond([0], [ids(smol, "a?")], [False]) == [None]
    assert "observation must be text" in episodes.record(0)["env_error"]


def test_openings_from_reset():
    sample = {"prompt": "Find it.", "secret": 3}
    assert opened_sample(sample, None) is sample
    assert opened_sample(sample, " Between 1 and 8.")["messages"] == [{"role": "user",
                                                                         "content": "Find it. Between 1 and 8."}]
    assert opened_sample(sample, [4, 5])["prompt_ids"] == [4, 5]
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert opened_sample(sample, chat)["messages"] == chat
    with pytest.raises(TypeError, match="reset must return"):
        opened_sample(sample, 3)
    assert opened_groups([sample], [" a", " a"], 2)[0]["messages"][0]["content"] == "Find it. a"
    with pytest.raises(ToolSpecError, match="data.environment: reset opened the episodes of one prompt differently"):
        opened_groups([sample], [" a", " b"], 2)


def test_a_trl_environment_factory_class_runs_unchanged(qwen):
    family = FactoryEnvironments(Counter, qwen, "chat", max_turns=4)
    assert [s["function"]["name"] for s in family.schemas] == ["increment"]
    episodes = family.start([{"prompt": "q", "answer": "5"}])
    assert episodes.openings == [" Count with the tool."]
    end = ids(qwen, "<|im_end|>")

    def call(n):
        text = '<tool_call>\n{"name": "increment", "arguments": {"n": "' + str(n) + '"}}\n</tool_call>'
        obs, = episodes.respond([0], [ids(qwen, text) + end], [True])
        return qwen.decode(obs)

    assert "<tool_response>\n2\n</tool_response>" in call(2)  # "2" cast to the int the schema says
    assert "<tool_response>\n5\n</tool_response>" in call(3)  # the instance kept its state
    assert episodes.respond([0], [ids(qwen, "Done.") + end], [True]) == [None]
    record = episodes.record(0)
    assert record["tool_calls"] == 2 and record["tool_errors"] == 0
    assert record["turn_rewards"] == [0.0, 0.0, 1.0]  # get_reward: total == 5, toward the last turn
    other = family.start([{"prompt": "q"}])  # a fresh instance per episode
    assert "<tool_response>\n1\n</tool_response>" in qwen.decode(
        other.respond([0], [ids(qwen, '<tool_call>\n{"name": "increment", "arguments": {"n": 1}}\n</tool_call>')
                            + end], [True])[0])


def test_an_environment_class_loads_from_its_spec():
    assert load_environment_class("tests/envs/fixtures/scripted_envs.py:Countdown").__name__ == "Countdown"
    with pytest.raises(Exception, match="data.environment 'tests/envs/fixtures/scripted_envs.py:Nope'"):
        load_environment_class("tests/envs/fixtures/scripted_envs.py:Nope")


# --------------------------------------------------------------------------- the two samplers


def test_the_torch_and_vllm_samplers_play_the_same_scripted_episodes(tmp_path):
    """A stateful `Env` whose every sampled token ends a turn (its stop strings are every character), answered
    with text that depends on the token: greedy, the same weights, the same ids, masks, records and rewards."""
    from cispo.models.loading import build_tokenizer, save_policy
    from cispo.rollout import SamplingConfig, TorchSampler
    from tests import fake_vllm
    from tests.rollout.test_vllm_episodes import CHARS, EOS, PAD, make_sampler
    from tests.rollout.test_vllm_episodes import model_dir as build  # noqa: F401

    transformers = pytest.importorskip("transformers")
    tok = build_tokenizer(CHARS)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                   pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        path = save_policy(transformers.LlamaForCausalLM(cfg), tok, tmp_path / "tiny")

    class Mirror(Env):
        def __init__(self):
            self.seen = []

        def step(self, segment):
            self.seen.append(segment.text)
            return StepResult("x" + segment.text, reward=float(len(self.seen)), done=len(self.seen) >= 3)

    prompts = [[5, 6, 7], [8], [9, 10, 11]]
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0)
    out = {}
    for name in ("torch", "vllm"):
        family = Family(tok, cls=Mirror, stop_strings=tuple(CHARS))
        episodes = family.start([{"prompt": "p"}] * len(prompts))
        sampler = TorchSampler(fake_vllm.load_hf(path), EOS, PAD) if name == "torch" else make_sampler(path)
        batch = sampler.generate(prompts, sampling, episodes=episodes)
        out[name] = batch, [episodes.record(i, fed=int(batch.env_mask[i].sum())) for i in range(len(prompts))]
    (t, t_rec), (v, v_rec) = out["torch"], out["vllm"]
    assert v.response_ids.tolist() == t.response_ids.tolist() and torch.equal(v.env_mask, t.env_mask)
    assert v.env_mask.sum() > 0 and v_rec == t_rec
    assert any(r.get("turn_rewards") == [1.0, 2.0, 3.0] for r in t_rec)


# --------------------------------------------------------------------------- the documented example


def test_the_documented_example_environment_plays_and_is_the_one_in_the_docs(qwen):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (root / "examples" / "quiz_env.py").read_text()
    body = code[code.index("class Quiz(Env):"):].strip()
    assert body in (root / "docs" / "api.md").read_text(), "docs/api.md's example is not examples/quiz_env.py's"
    quiz = load_environment_class("examples/quiz_env.py:Quiz")
    episodes = Family(qwen, cls=quiz, stop_strings=()).start([{"prompt": "Add."}])
    opening = episodes.openings[0]
    a, b = map(int, re.findall(r"\d+", opening))
    end = ids(qwen, "<|im_end|>")
    obs, = episodes.respond([0], [ids(qwen, f"{a + b + 1}") + end], [True])
    assert "No. What is" in qwen.decode(obs) and "<|im_start|>user" in qwen.decode(obs)
    for _ in range(3):
        a, b = map(int, re.findall(r"(\d+) \+ (\d+)", qwen.decode(obs))[-1])
        obs, = episodes.respond([0], [ids(qwen, f"It is {a + b}.") + end], [True])
        if obs is None:
            break
    assert obs is None and episodes.record(0)["turn_rewards"] == [0.0, 1.0, 1.0, 1.0]
