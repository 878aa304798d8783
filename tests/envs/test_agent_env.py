"""An agent program as the environment (cispo.envs.agent_env, cispo.envs.endpoint): a tiny chat model over a
character tokenizer whose chat template takes tools (Hermes calls), driven by programs that call the endpoint
over plain HTTP or with the ``openai`` client (tests/envs/fixtures/agent_programs.py), sampled by the torch
sampler through the environment layer's turn loop."""

from __future__ import annotations

import json
import string
import urllib.error
import urllib.request

import pytest
import torch

from cispo.envs.agent_env import AgentEnvironments, load_agent
from cispo.envs.base import Env, StepResult
from cispo.envs.episodes import Environments
from cispo.envs.tools import ToolSpecError
from cispo.models.loading import build_model, build_tokenizer
from cispo.rollout import SamplingConfig, TorchSampler
from tests.envs.fixtures import agent_programs as programs

CHARS = string.ascii_letters + string.digits + " \n<>{}[]\":,._-+*/=?!'()|#"
TEMPLATE = ("{% if tools %}<s>{{ tools | tojson }}<eos>\n{% endif %}{% for m in messages %}<{{ m.role[0] }}>"
            "{% if m.content %}{{ m.content }}{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
            "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>"
            "{% endfor %}{% endif %}<eos>\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
"""A chat template in the tokenizer's characters: a turn is ``<u>...<eos>``, the tools' JSON first, Hermes calls."""
SAMPLING = SamplingConfig(max_new_tokens=90, temperature=1.0)  # room for three short turns and two observations


def chat_tokenizer():
    tok = build_tokenizer(CHARS, 1024)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def chat_model(tok):
    """A seeded tiny Llama whose end-of-turn token is likely enough that turns end on their own."""
    model = build_model(tok, size="tiny", seed=0, max_positions=1024)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 40
    return model


@pytest.fixture(scope="module")
def sampler(tok):
    return TorchSampler(chat_model(tok), tok.eos_token_id, tok.pad_token_id)


def play(family, sampler, samples, seed=0, sampling=SAMPLING):
    """The batch's episodes sampled from their openings: the batch and each row's record."""
    episodes = family.start(samples)
    try:
        batch = sampler.generate([list(o) for o in episodes.openings], sampling,
                                 generator=torch.Generator().manual_seed(seed), episodes=episodes)
        return batch, [episodes.record(i, fed=int(batch.env_mask[i].sum())) for i in range(len(samples))]
    finally:
        family.close()


def row(batch, i):
    n = int(batch.response_lengths[i])
    return batch.response_ids[i, :n].tolist(), batch.logp_rollout[i, :n].tolist(), batch.env_mask[i, :n].tolist()


def test_three_calls_over_http_are_the_same_episode_as_a_scripted_env(tok, sampler):
    """The program's 3 calls (each re-sending the conversation) sample exactly the ids and log-probs that a
    scripted `Env` with the same opening and the template's user turns as observations does."""
    sample = {"prompt": "add 2 and 3"}
    batch, records = play(AgentEnvironments(programs.three_calls, tok, max_turns=4, timeout_s=30), sampler,
                          [sample, sample])
    for r in records:
        assert r["agent"] == {**r["agent"], "calls": 3, "ended": "returned", "error": None}
    opening = tok.apply_chat_template([{"role": "user", "content": sample["prompt"]}], tools=[programs.CALC],
                                      add_generation_prompt=True, tokenize=True)
    opening = opening["input_ids"] if hasattr(opening, "keys") else opening

    class Scripted(Env):
        def __init__(self):
            self.turn, self.written = 0, 0

        def reset(self, sample):
            return list(opening)

        def step(self, segment):
            self.written += len(segment.text)
            self.turn += 1
            if self.turn == 3:
                return StepResult(None, reward=float(self.written % 3))
            return StepResult(tok.encode(f"\n<u>go on {self.turn - 1}<eos>\n<a>"))

    class Family(Environments):
        tokenizer, max_turns = tok, 4

        def make(self, sample):
            return Scripted()

    scripted, scripted_records = play(Family(), sampler, [sample, sample])
    assert [row(batch, i) for i in range(2)] == [row(scripted, i) for i in range(2)]
    assert sum(row(batch, 0)[2]) > 0
    assert [r["turn_rewards"] for r in records] == [r["turn_rewards"] for r in scripted_records]
    assert [r["segments"] for r in records] == [r["segments"] for r in scripted_records]


def test_the_openai_client_drives_an_episode(tok, sampler):
    pytest.importorskip("openai")
    _, records = play(AgentEnvironments(programs.with_openai, tok, max_turns=4, timeout_s=30), sampler,
                      [{"prompt": "add 2 and 3"}])
    assert records[0]["agent"]["calls"] == 3 and records[0]["agent"]["ended"] == "returned"
    assert records[0]["turn_rewards"][-1] == 1.0 and records[0]["agent"]["error"] is None


def test_a_tool_call_comes_back_typed_and_its_result_is_the_tool_turn(tok):
    """A Hermes call in the policy's turn is the reply's ``tool_calls`` (arguments cast to the schema); the
    program's tool message is rendered after the policy's turn as the next observation."""
    family = AgentEnvironments(programs.adds, tok, max_turns=4, timeout_s=30)
    seen: list = []
    try:
        episodes = family.start([{"prompt": "add", "seen": seen}])
        call = '<tool_call>{"name": "add", "arguments": {"a": "2", "b": 3}}</tool_call>'
        turn = tok.encode(call) + [tok.eos_token_id]
        obs, = episodes.respond([0], [turn], [True])
        assert seen[0]["finish_reason"] == "tool_calls"
        call = seen[0]["message"]["tool_calls"][0]
        assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
        assert tok.decode(obs) == "\n<t>5<eos>\n<a>"
        end, = episodes.respond([0], [tok.encode("five") + [tok.eos_token_id]], [True])
        assert end is None and seen[1]["message"] == {"role": "assistant", "content": "five"}
        assert episodes.record(0)["turn_rewards"] == [0.0, 1.0]
    finally:
        family.close()


def test_a_request_without_the_token_is_refused(tok):
    family = AgentEnvironments(programs.no_reward, tok, max_turns=1)
    try:
        url = family.server.url + "/v1"
        body = {"messages": [{"role": "user", "content": "hi"}]}
        assert programs.post(url, None, body)[0] == 401
        assert programs.post(url, "wrong", body)[0] == 401
        status, err = programs.post(url, family.server.api_key, body)
        assert status == 400 and "no session given" in err["error"]["message"]
        assert programs.post(url.replace("/v1", "/sessions/nope/v1"), family.server.api_key, body)[0] == 410
        assert programs.post(url, family.server.api_key, {**body, "n": 2, "user": "x"})[0] == 400
        req = urllib.request.Request(url + "/models", headers={"Authorization": f"Bearer {family.server.api_key}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["data"][0]["id"] == "policy"
    finally:
        family.close()


def test_agents_that_raise_hang_or_return_no_reward_are_recorded_and_the_batch_goes_on(tok, sampler):
    kinds = ["raises", "hangs", "no_reward", "async_one_call", "three_calls"]
    family = AgentEnvironments(programs.by_kind, tok, max_turns=4, timeout_s=2)
    batch, records = play(family, sampler, [{"prompt": "add 2 and 3", "kind": k} for k in kinds])
    agent = {k: r["agent"] for k, r in zip(kinds, records)}
    assert agent["raises"]["ended"] == "failed" and "RuntimeError: the agent's own bug" in agent["raises"]["error"]
    assert agent["hangs"]["ended"] == "failed" and "within 2 s" in agent["hangs"]["error"]
    assert agent["no_reward"] == {**agent["no_reward"], "ended": "returned", "reward": None, "error": None}
    assert "turn_rewards" not in records[kinds.index("no_reward")]
    assert agent["async_one_call"]["reward"] == 1.0
    assert agent["three_calls"]["calls"] == 3 and agent["three_calls"]["ended"] == "returned"


def test_a_rewritten_history_goes_on_in_a_second_row_of_exactly_the_sampled_ids(tok, sampler):
    """The second call drops the first answer: the episode's second training row is that call's rendering as
    prompt; each row's response is what was sampled (observations none), and the program gets both answers."""
    from cispo.envs.rows import sample_episode_rows

    family = AgentEnvironments(programs.rewriter, tok, max_turns=4, timeout_s=10)
    try:
        episodes = family.start([{"prompt": "add 2 and 3"}])
        opening = list(episodes.openings[0])
        rows, = sample_episode_rows(sampler, [opening], SAMPLING, torch.Generator().manual_seed(0), episodes)
        record = episodes.record(0, fed=0)
    finally:
        family.close()
    second = tok.apply_chat_template([{"role": "user", "content": "add 2 and 3"}, {"role": "user", "content": "again"}],
                                     add_generation_prompt=True, tokenize=True)
    second = second["input_ids"] if hasattr(second, "keys") else second
    assert [r.prompt_ids for r in rows] == [opening, list(second)]
    assert all(r.env_mask.sum() == 0 and r.finish_reason == "eos" for r in rows)
    assert record["agent"] == {**record["agent"], "calls": 2, "rewritten": 1, "ended": "returned", "reward": 1.0}
    assert record["rewrites"] == 1 and record["turn_rewards"] == [0.0, 1.0]


def test_max_tokens_ends_a_turn_with_finish_reason_length(tok):
    seen = []

    def one_call(sample, base_url, api_key):
        seen.append(programs.post(base_url, api_key, {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 3, "stop": ["zz"]})[1])

    family = AgentEnvironments(one_call, tok, max_turns=2)
    try:
        episodes = family.start([{"prompt": "hi"}])
        assert not episodes.pauses(0, tok.encode("ab")) and episodes.pauses(0, tok.encode("abc"))
        assert episodes.respond([0], [tok.encode("abc")], [False]) == [None]
        assert seen[0]["choices"][0]["finish_reason"] == "length"
        assert seen[0]["choices"][0]["message"]["content"] == "abc"
    finally:
        family.close()
    family = AgentEnvironments(one_call, tok, max_turns=2)
    try:
        episodes = family.start([{"prompt": "hi"}])
        assert episodes.pauses(0, tok.encode("azz"))
        episodes.respond([0], [tok.encode("azz")], [False])
        assert seen[1]["choices"][0] == {**seen[1]["choices"][0], "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": "a"}}
    finally:
        family.close()


def test_an_agent_spec_loads_and_a_bad_one_is_one_line():
    assert load_agent("tests/envs/fixtures/agent_programs.py:three_calls").__name__ == "three_calls"
    with pytest.raises(ToolSpecError, match="data.agent 'tests/envs/fixtures/agent_programs.py:nope'"):
        load_agent("tests/envs/fixtures/agent_programs.py:nope")


def test_the_torch_sampler_and_the_vllm_stand_in_serve_the_same_episodes(tok, tmp_path):
    """Greedy, the same weights: the same ids, masks and records through either sampler (vLLM: one generate per
    turn, ``tests/fake_vllm.py``)."""
    pytest.importorskip("transformers")
    from cispo.models.loading import save_policy
    from tests import fake_vllm
    from tests.rollout.test_vllm_episodes import make_sampler

    path = save_policy(chat_model(tok), tok, tmp_path / "model")
    greedy = SamplingConfig(max_new_tokens=40, temperature=0.0)
    out = {}
    for name in ("torch", "vllm"):
        sampler = TorchSampler(fake_vllm.load_hf(path), tok.eos_token_id, tok.pad_token_id) if name == "torch" \
            else make_sampler(path)
        family = AgentEnvironments(programs.three_calls, tok, max_turns=4, timeout_s=30)
        out[name] = play(family, sampler, [{"prompt": "add 2 and 3"}, {"prompt": "add 4 and 5"}], sampling=greedy)
    (t, t_records), (v, v_records) = out["torch"], out["vllm"]
    assert [row(v, i)[0] for i in range(2)] == [row(t, i)[0] for i in range(2)]
    assert torch.equal(v.env_mask, t.env_mask) and t.env_mask.sum() > 0
    strip = [{**r, "agent": {**r["agent"], "session": None}} for r in t_records]
    assert [{**r, "agent": {**r["agent"], "session": None}} for r in v_records] == strip


def test_programs_that_never_call_cost_one_timeout_together(tok):
    import time

    family = AgentEnvironments(programs.sleeps_first, tok, max_turns=2, timeout_s=1)
    try:
        start = time.monotonic()
        episodes = family.start([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
        assert time.monotonic() - start < 2.5
        assert episodes.openings == [None, None, None]
        assert all(r["agent"]["ended"] == "failed" and "within 1 s" in r["agent"]["error"]
                   for r in (episodes.record(i) for i in range(3)))
    finally:
        family.close()


def test_an_episode_the_budget_cuts_answers_the_call_with_the_text_so_far(tok):
    seen: list = []
    family = AgentEnvironments(programs.rewards_a_cut_answer, tok, max_turns=2, timeout_s=10)
    try:
        episodes = family.start([{"prompt": "a", "seen": seen}])
        assert not episodes.pauses(0, tok.encode("abc"))  # the sampler's last look at the row: then it is cut
        record = episodes.record(0)
    finally:
        family.close()
    assert seen[0]["finish_reason"] == "length" and seen[0]["message"]["content"] == "abc"
    assert record["agent"] == {**record["agent"], "ended": "cut", "reward": 2.0} and record["turn_rewards"] == [2.0]


def test_a_text_completion_goes_on_in_the_row_past_its_stop_string(tok):
    """``/v1/completions``: a ReAct-style program stops the answer at ``Obs:``, which the text leaves out; its next
    prompt (the prompt, the answer, ``Obs: 5``) goes on in the row with only ``5`` fed: the row holds ``Obs:``."""
    seen = []

    def react(sample, base_url, api_key):
        prompt = "Q: 2+3?\n"
        for _ in range(2):
            req = urllib.request.Request(base_url + "/completions", json.dumps(
                {"prompt": prompt, "stop": ["Obs:"], "max_tokens": 20}).encode(),
                {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                seen.append(json.loads(r.read()))
            prompt += seen[-1]["choices"][0]["text"] + "Obs: 5\n"
        return 1.0

    family = AgentEnvironments(react, tok, max_turns=2, timeout_s=10)
    try:
        episodes = family.start([{"prompt": "q"}])
        assert episodes.openings[0] == tok.encode("Q: 2+3?\n")
        assert episodes.pauses(0, tok.encode("calc 2+3 Obs:"))
        obs, = episodes.respond([0], [tok.encode("calc 2+3 Obs:")], [False])
        assert tok.decode(obs) == " 5\n"
        assert seen[0]["object"] == "text_completion" and seen[0]["choices"][0]["text"] == "calc 2+3 "
        end, = episodes.respond([0], [tok.encode("5") + [tok.eos_token_id]], [True])
        assert end is None and seen[1]["choices"][0] == {**seen[1]["choices"][0], "text": "5", "finish_reason": "stop"}
        assert episodes.record(0)["agent"]["reward"] == 1.0
    finally:
        family.close()


def test_include_stop_str_in_output_answers_the_text_as_sampled(tok):
    """vLLM's ``include_stop_str_in_output``: the answer keeps the stop string and what its last token wrote past
    it, so a next prompt that appends to the answer feeds only what it adds; a value that is no bool is a 400."""
    seen = []

    def post(base_url, api_key, body):
        req = urllib.request.Request(base_url + "/completions", json.dumps(body).encode(),
                                     {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return {"status": e.code}

    def react(sample, base_url, api_key):
        seen.append(post(base_url, api_key, {"prompt": "Q\n", "stop": ["Obs"], "include_stop_str_in_output": 1}))
        prompt = "Q\n"
        for _ in range(2):
            body = {"prompt": prompt, "stop": ["Obs"], "include_stop_str_in_output": True}
            seen.append(post(base_url, api_key, body))
            prompt += seen[-1]["choices"][0]["text"] + " 5\n"
        return 1.0

    family = AgentEnvironments(react, tok, max_turns=2, timeout_s=10)
    try:
        episodes = family.start([{"prompt": "q"}])
        segment = tok.encode("calc Obs:")
        assert episodes.pauses(0, segment)
        obs, = episodes.respond([0], [segment], [False])
        assert seen[0] == {"status": 400} and seen[1]["choices"][0]["text"] == "calc Obs:"
        assert tok.decode(obs) == " 5\n"
        end, = episodes.respond([0], [tok.encode("5") + [tok.eos_token_id]], [True])
        assert end is None and episodes.record(0)["agent"] == {**episodes.record(0)["agent"], "rewritten": 0}
    finally:
        family.close()
