"""examples/calc_agent.py (the inline calculator as an `openai`-client program, through ``/v1/completions``) plays
exactly the built-in inline calculator's episodes (``data.task=wordmath_calc``): greedy, on a tiny random Llama
with SmolLM2's real tokenizer and chat template whose logits are pinned to a script of three calls (one whose
last token runs on past ``</calc>``, one plain, one that fails) and an answer, both give the same prompt ids,
response ids, log-probs, env mask, segments and reward."""

from __future__ import annotations

import pytest
import torch

from cispo.data.rewards import describe_error
from cispo.data.tasks import wordmath_calc
from cispo.envs.agent_env import AgentEnvironments, load_agent
from cispo.envs.tool_calls import inline_observation
from cispo.envs.tool_env import build_environment
from cispo.envs.tools import calculator, policy_error
from cispo.models.loading import stop_token_ids
from cispo.rollout import SamplingConfig, TorchSampler
from cispo.training.sampling import policy_text

PIN = 10.0
"""The logit added to the script's next token: it wins greedy, its log-prob still the model's own (not ~0)."""
CALLS = (("3 * 4 = <calc>3*4</calc>.", "3*4"), (" 12 + 5 = <calc>12+5</calc>", "12+5"), (" <calc>12/0</calc>", "12/0"))


def shown(expression: str) -> str:
    """What the built-in environment shows of a call: `inline_observation` of the value or of the error."""
    try:
        return inline_observation(calculator(expression))
    except Exception as e:  # noqa: BLE001
        return inline_observation(policy_error(describe_error(e)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    from cispo.models.packaged import save_tiny_smollm2

    path = save_tiny_smollm2(tmp_path_factory.mktemp("calc-agent") / "tiny-smollm2")
    return transformers.AutoTokenizer.from_pretrained(str(path)), transformers.AutoModelForCausalLM.from_pretrained(
        str(path))


def script(tok, answer: str) -> tuple[list[int], list[int]]:
    """The response the pinned policy writes and the environment answers: its ids and env mask."""
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    ids, mask = [], []
    for call, expression in CALLS:
        policy, observation = encode(call), encode(shown(expression))
        ids += policy + observation
        mask += [0] * len(policy) + [1] * len(observation)
    tail = encode(f"\n#### {answer}") + [tok.convert_tokens_to_ids("<|im_end|>")]
    return ids + tail, mask + [0] * len(tail)


def pinned(model, prompt_len: int, response: list[int]):
    """``model`` with the logits of absolute position ``prompt_len - 1 + i`` raised by `PIN` at ``response[i]``
    (a forward hook: every call of the model, prefill or one decode step, through its ``position_ids``)."""
    target = torch.tensor(response)

    def hook(module, args, kwargs, output):
        logits = output.logits  # [B, t, V]
        pos = kwargs["position_ids"][:, -logits.shape[1]:]  # [B, t]
        i = pos - (prompt_len - 1)
        b, t = ((i >= 0) & (i < len(response))).nonzero(as_tuple=True)
        logits[b, t, target[i[b, t]]] += PIN
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


def play(family, sampler, prompts, samples):
    episodes = family.start(samples)
    try:
        prompts = prompts or [list(o) for o in episodes.openings]
        batch = sampler.generate(prompts, SamplingConfig(max_new_tokens=160, temperature=0.0), episodes=episodes)
        return prompts, batch, [episodes.record(i, fed=int(batch.env_mask[i].sum())) for i in range(len(samples))]
    finally:
        family.close()


def rows(batch) -> list[tuple[list, list, list]]:
    out = []
    for i in range(batch.response_ids.shape[0]):
        n = int(batch.response_lengths[i])
        out.append((batch.response_ids[i, :n].tolist(), batch.logp_rollout[i, :n].tolist(),
                    batch.env_mask[i, :n].tolist()))
    return out


def test_the_calc_agent_plays_the_built_in_calculators_episodes_token_for_token(tiny):
    pytest.importorskip("openai")
    tok, model = tiny
    sample = wordmath_calc.samples(0, 1)[0]
    builtin = build_environment(tok, task=wordmath_calc.NAME, max_turns=4, isolation="main")
    prompt = builtin.render_prompt(sample)
    response, env_mask = script(tok, sample["answer"])
    sampler = TorchSampler(model, stop_token_ids(model, tok, True), tok.pad_token_id, decode="hf")
    handle = pinned(model, len(prompt), response)
    try:
        _, env_batch, env_records = play(builtin, sampler, [prompt, prompt], [sample, sample])
        agent = AgentEnvironments(load_agent("examples/calc_agent.py:run", trial=False), tok, max_turns=4,
                                  timeout_s=30)
        agent_prompts, agent_batch, agent_records = play(agent, sampler, None, [sample, sample])
    finally:
        handle.remove()

    assert agent_prompts == [prompt, prompt]  # the agent's ChatML is the chat template's rendering
    assert tok.decode(response[len(tok.encode(CALLS[0][0], add_special_tokens=False)) - 1]) == ">."  # runs on
    for ids, logp, mask in rows(env_batch):
        assert ids == response and mask == env_mask  # the script was played: three calls, then the answer
        assert all(-PIN < lp < -1e-3 for lp, m in zip(logp, mask) if m == 0)  # the model's own log-probs
    assert rows(agent_batch) == rows(env_batch)  # same ids, log-probs (exactly), env mask
    assert [r["segments"] for r in agent_records] == [r["segments"] for r in env_records]
    for r in env_records:
        assert r["tool_calls"] == 3 and r["tool_errors"] == 1
    for r in agent_records:
        assert r["agent"] == {**r["agent"], "calls": 4, "ended": "returned", "error": None, "rewritten": 0}

    def reward(batch, i):
        n = int(batch.response_lengths[i])
        text = policy_text(tok, batch.response_ids[i, :n], batch.env_mask[i, :n])
        return wordmath_calc.reward(None, text, sample["answer"])

    assert [reward(agent_batch, i) for i in range(2)] == [reward(env_batch, i) for i in range(2)] == [1.0, 1.0]


def test_a_special_token_inside_the_stop_string_stops_no_text_completion(smol):
    """``</calc`` + ``<|im_start|>`` + ``>`` reads ``</calc>`` without its special tokens, but the built-in calculator
    takes it for no call (its text keeps the special token); a text completion stopped at ``</calc>`` goes on too."""
    import json
    import urllib.request

    def one_call(sample, base_url, api_key):
        body = json.dumps({"prompt": "Q\n", "stop": ["</calc>"]}).encode()
        req = urllib.request.Request(base_url + "/completions", body,
                                     {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    encode = lambda text: smol.encode(text, add_special_tokens=False)  # noqa: E731
    forged = encode("<calc>2+3</calc") + [smol.convert_tokens_to_ids("<|im_start|>")] + encode(">")
    builtin = build_environment(smol, task=wordmath_calc.NAME, max_turns=4, isolation="main")
    family = AgentEnvironments(one_call, smol, max_turns=4, timeout_s=10)
    try:
        assert not builtin.start([{"prompt": "q"}]).pauses(0, forged)
        episodes = family.start([{"prompt": "q"}])
        assert not episodes.pauses(0, forged)
        assert episodes.pauses(0, encode("<calc>2+3</calc>"))
    finally:
        builtin.close()
        family.close()
