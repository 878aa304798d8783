"""Multi-turn episodes on vLLM (the torch sampler's are in test_multiturn_sampling.py), through ``VLLMSampler``
(``cispo.rollout.vllm_episodes``), on the stand-in engine of ``tests/fake_vllm.py`` only (no vLLM, no GPU
here): one engine call per turn, each row's context re-sent as ids, the environment's stop strings given to the engine,
the segment's end read
from the returned token ids. Most tests script what the engine writes (its ``_step``: the k-th response
token from the script, whatever the context), so every id is known; the last compares a greedy episode
with the torch sampler's on a real (tiny random) model."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cispo.models.loading import build_tokenizer, save_policy  # noqa: E402
from cispo.rollout import SamplingConfig, TorchSampler  # noqa: E402
from cispo.rollout.vllm_episodes import REPETITION, STOP_ID, STOP_STRING, scan_segment  # noqa: E402
from cispo.rollout.vllm_sampler import VLLMSampler  # noqa: E402
from tests import fake_vllm  # noqa: E402  (tests/fake_vllm.py)

PAD, EOS, UNK = 0, 1, 2  # build_tokenizer's ids
CHARS = "0123456789+-=abcdefghijklmnopqrstuvwxyz"

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def ids(text: str) -> list[int]:
    """The character tokenizer's ids of ``text`` (one per character)."""
    return [3 + CHARS.index(c) for c in text]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CHARS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    """A tiny random Llama and the character tokenizer, saved like a checkpoint (what the engine loads)."""
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
    return save_policy(model, tok, tmp_path_factory.mktemp("tiny-episodes"))


def make_sampler(path) -> VLLMSampler:
    with pytest.MonkeyPatch.context() as mp:
        fake_vllm.install(mp)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return VLLMSampler(path, eos_token_id=EOS, pad_token_id=PAD)


def script_engine(sampler: VLLMSampler, scripts: dict[tuple, list[int]]) -> None:
    """The engine writes ``scripts[prompt][k]`` as the token at response position k (the context's length past
    the prompt, observations counted), with log-prob ``-0.01 * (k + 1)``: a script is the whole response
    expected, and what it holds at an observation's positions is never asked for (they come as context)."""

    def step(context, sp, gen):
        prompt = next(p for p in scripts if tuple(context[: len(p)]) == p)
        k = len(context) - len(prompt)
        return scripts[prompt][k], -0.01 * (k + 1)

    sampler.llm._step = step


def spy(sampler: VLLMSampler) -> list[list[tuple]]:
    """Each engine call's requests: (prompt ids, SamplingParams, completion), one list per call."""
    calls, real = [], sampler.llm.generate

    def generate(prompts, params, use_tqdm=True):
        outs = real(prompts, params, use_tqdm)
        calls.append([(list(p["prompt_token_ids"]), sp, o.outputs[0]) for p, sp, o in zip(prompts, params, outs)])
        return outs

    sampler.llm.generate = generate
    return calls


class Env:
    """Pauses a segment whose text ends with "=" (its stop string: the engine stops there too) once it has at
    least ``min_len[row]`` ids; answers a row's k-th pause with ``observations[row][k]``, then None."""

    stop_strings = ("=",)

    def __init__(self, tok, observations: list[list[list[int]]], min_len=None):
        self.tok, self.observations = tok, observations
        self.min_len = min_len or [1] * len(observations)
        self.turns = [0] * len(observations)
        self.calls: list[tuple] = []

    def pauses(self, row, segment_ids):
        return len(segment_ids) >= self.min_len[row] and self.tok.decode(segment_ids).endswith("=")

    def respond(self, rows, segments, by_stop_token):
        self.calls.append((list(rows), [list(s) for s in segments], list(by_stop_token)))
        out = []
        for r in rows:
            self.turns[r] += 1
            k, obs = self.turns[r], self.observations[r]
            out.append(obs[k - 1] if k <= len(obs) else None)
        return out


def row_of(batch, i):
    """(response ids, env mask, log-probs) of row ``i``, without the padding."""
    n = int(batch.response_mask[i].sum())
    return (batch.response_ids[i, :n].tolist(), batch.env_mask[i, :n].tolist(), batch.logp_rollout[i, :n].tolist())


# Observations with the unknown id in them: decoding ("<unk>") and re-encoding would not give them back.
OBS = [ids("x") + [UNK] + ids("y"), ids("pq"), [UNK, UNK] + ids("z")]
POLICY = [ids("12="), ids("3="), ids("45="), ids("6") + [EOS]]  # four segments: three turns, then EOS


def test_three_turns_train_exactly_the_ids_sampled_and_observed(model_dir, tok):
    sampler = make_sampler(model_dir)
    prompt = ids("a1")
    expected = POLICY[0] + OBS[0] + POLICY[1] + OBS[1] + POLICY[2] + OBS[2] + POLICY[3]
    script_engine(sampler, {tuple(prompt): expected})
    calls, env = spy(sampler), Env(tok, [OBS])
    batch = sampler.generate([prompt], SamplingConfig(max_new_tokens=40), torch.Generator().manual_seed(0),
                             episodes=env)
    response, env_mask, logp = row_of(batch, 0)
    assert response == expected and batch.finish_reason == ["eos"]
    # the ids trained on: what the engine generated, turn by turn, with the observations between
    generated = [call[0][2].token_ids for call in calls]
    assert generated == POLICY
    assert response == generated[0] + OBS[0] + generated[1] + OBS[1] + generated[2] + OBS[2] + generated[3]
    # each turn's request: the prompt + the response so far, as ids (the unknown ids too); the budget left
    done = 0
    for call, segment, obs in zip(calls, POLICY, OBS + [[]]):
        (context, params, completion), = call
        assert context == prompt + expected[:done] and params.max_tokens == 40 - done
        assert params.stop == ["="] and params.include_stop_str_in_output and params.detokenize
        assert list(completion.logprobs[0]) == [segment[0]]
        done += len(segment) + len(obs)
    assert env_mask == [0.0] * 3 + [1.0] * 3 + [0.0] * 2 + [1.0] * 2 + [0.0] * 3 + [1.0] * 3 + [0.0] * 2
    assert all(lp == 0.0 for lp, e in zip(logp, env_mask) if e)  # observations: log-prob 0
    assert logp == pytest.approx([0.0 if e else -0.01 * (k + 1) for k, e in enumerate(env_mask)])
    assert env.calls == [([0], [POLICY[k]], [k == 3]) for k in range(4)]  # the last segment ended by EOS


def test_rows_at_different_turns_share_an_engine_call(model_dir, tok):
    """Row 0's episode ends at its second pause (the environment says so); row 1 takes three turns; row 2's
    first "=" comes before its environment pauses (min_len 3), so its segment goes on in the next call,
    without an observation, beside rows already past their first turn."""
    sampler = make_sampler(model_dir)
    prompts = [ids("b1"), ids("c22"), ids("d")]
    scripts = [ids("1=") + ids("uv") + ids("2=") + ids("9999"),
               POLICY[0] + OBS[0] + POLICY[1] + OBS[1] + POLICY[2] + OBS[2] + POLICY[3],
               ids("5=") + ids("67=") + ids("w") + ids("8") + [EOS]]
    script_engine(sampler, {tuple(p): s for p, s in zip(prompts, scripts)})
    calls = spy(sampler)
    env = Env(tok, [[ids("uv")], OBS, [ids("w")]], min_len=[1, 1, 3])
    batch = sampler.generate(prompts, SamplingConfig(max_new_tokens=40), episodes=env)
    assert batch.finish_reason == ["eos", "eos", "eos"]
    assert row_of(batch, 0)[0] == ids("1=uv2=") and row_of(batch, 0)[1] == [0, 0, 1, 1, 0, 0]
    assert row_of(batch, 1)[0] == scripts[1]
    assert row_of(batch, 2)[0] == ids("5=67=w8") + [EOS] and row_of(batch, 2)[1] == [0] * 5 + [1] + [0] * 2
    live = [[prompts.index(next(p for p in prompts if ctx[: len(p)] == p)) for ctx, _, _ in call] for call in calls]
    assert live == [[0, 1, 2], [0, 1, 2], [1, 2], [1]]
    # call 2: row 2 continues its first segment (its context has no observation), row 1 is past its first turn
    assert calls[1][2][0] == prompts[2] + ids("5=") and calls[1][1][0] == prompts[1] + POLICY[0] + OBS[0]
    # the environment saw row 2's whole segment once, and ended row 0's episode at its second pause
    assert env.calls[0] == ([0, 1], [ids("1="), POLICY[0]], [False, False])
    assert env.calls[1] == ([0, 1, 2], [ids("2="), POLICY[1], ids("5=67=")], [False, False, False])


@pytest.mark.parametrize("max_new_tokens, expected_env", [
    (8, [0, 0, 0, 1, 1, 1, 0, 0]),  # the second segment fills the budget: its observation gets no room
    (5, [0, 0, 0, 1, 1]),  # the first observation is cut after 2 of its 3 ids
])
def test_an_observation_that_does_not_fit_ends_the_row_with_length(model_dir, tok, max_new_tokens, expected_env):
    sampler = make_sampler(model_dir)
    prompt = ids("e")
    script = POLICY[0] + OBS[0] + POLICY[1] + OBS[1] + POLICY[2]
    script_engine(sampler, {tuple(prompt): script})
    calls, env = spy(sampler), Env(tok, [OBS])
    batch = sampler.generate([prompt], SamplingConfig(max_new_tokens=max_new_tokens), episodes=env)
    response, env_mask, _ = row_of(batch, 0)
    assert batch.finish_reason == ["length"] and len(response) == max_new_tokens
    assert response == script[:max_new_tokens] and env_mask == expected_env
    assert [call[0][1].max_tokens for call in calls] == [max_new_tokens, max_new_tokens - 6][: len(calls)]
    assert len(env.calls) == len(calls)  # every pause was answered, also the one with no room left


def test_a_policy_row_cut_by_the_budget_ends_with_length(model_dir, tok):
    sampler = make_sampler(model_dir)
    prompt = ids("f")
    script_engine(sampler, {tuple(prompt): ids("123456789")})
    env = Env(tok, [OBS])
    batch = sampler.generate([prompt], SamplingConfig(max_new_tokens=6), episodes=env)
    assert batch.finish_reason == ["length"] and row_of(batch, 0)[0] == ids("123456") and env.calls == []


def test_a_stop_string_inside_a_token_keeps_the_token(tmp_path):
    """SmolLM2 spells ``</calc>.`` as ``</``, ``calc``, ``>.``: the engine cuts its *text* after ``</calc>``, but
    the response keeps the ``>.`` id; the real inline calculator (``cispo.envs.tool_env``) pauses there."""
    from cispo.envs.tool_env import build_environment
    from cispo.models.packaged import save_tiny_smollm2

    path = save_tiny_smollm2(tmp_path / "tiny-smollm2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    with pytest.MonkeyPatch.context() as mp:
        fake_vllm.install(mp)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        sampler = VLLMSampler(path, tokenizer, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = encode("Tom has 30 apples and gets 21. How many?")
    call, observation = encode("I add. <calc>30+21</calc>."), encode("<result>51</result>")
    answer = encode(" #### 51") + [tokenizer.eos_token_id]
    assert tokenizer.decode(call[-1:]) == ">."
    script_engine(sampler, {tuple(prompt): call + observation + answer})
    calls = spy(sampler)
    env = build_environment(tokenizer, task="wordmath_calc", isolation="main")
    try:
        episodes = env.start([{"prompt": "q", "answer": "51"}])
        batch = sampler.generate([prompt], SamplingConfig(max_new_tokens=64, temperature=0.0), episodes=episodes)
    finally:
        env.close()
    first = calls[0][0][2]
    assert first.token_ids == call and first.text.endswith("</calc>") and first.stop_reason == "</calc>"
    assert calls[0][0][1].stop == ["</calc>"]
    response, env_mask, logp = row_of(batch, 0)
    assert response == call + observation + answer and batch.finish_reason == ["eos"]
    assert env_mask == [0.0] * len(call) + [1.0] * len(observation) + [0.0] * len(answer)
    record = episodes.record(0)
    assert record["tool_calls"] == 1 and record["tool_errors"] == 0
    assert [s["role"] for s in record["segments"]] == ["policy", "tool", "policy"]


def test_scan_segment_follows_the_torch_sampler_rules():
    seen = []

    def pauses(segment):
        seen.append(list(segment))
        return segment[-1] == 9

    cfg = SamplingConfig(max_new_tokens=16, repetition_stop_tokens=3)
    hi, lo = -1e-4, -2.0  # p > 0.99, p < 0.99
    stops = {EOS}
    assert scan_segment([5, 9, 6], [lo] * 3, [4], 0, stops, cfg, pauses) == (2, STOP_STRING, 0)
    assert seen == [[4, 5], [4, 5, 9]]  # asked on the segment's ids so far, earlier turns' included
    seen.clear()
    # a stop id is a pause by token even where the run reaches N; pauses() is not asked on it
    assert scan_segment([5, EOS], [hi, hi], [], 1, stops, cfg, pauses) == (2, STOP_ID, 3)
    assert seen == [[5]]
    # the run carried from earlier turns ends the row before any pause at that token
    assert scan_segment([9], [hi], [], 2, stops, cfg, pauses) == (1, REPETITION, 3)
    assert scan_segment([5, 6], [hi, lo], [], 1, stops, cfg, pauses) == (2, None, 0)


@pytest.mark.parametrize("max_new_tokens,penalty", [(30, 1.0), (12, 1.0), (30, 1.5)])  # 12: rows cut by the budget
def test_a_greedy_episode_matches_the_torch_samplers(model_dir, max_new_tokens, penalty):
    """Same weights, greedy, an environment that pauses by ids (no stop strings: the engine runs each segment on
    and the scan cuts it): the same response ids, env_mask, finish reasons and (to float error) log-probs as
    ``TorchSampler``'s, and the environment asked the same questions. With a repetition penalty, both penalise
    the observations' tokens too (the engine's context re-sent as the prompt; the torch sampler's fed tokens)."""

    class ById:
        def __init__(self, every):
            self.every, self.calls = every, []

        def pauses(self, row, segment_ids):
            return len(segment_ids) >= self.every[row]

        def respond(self, rows, segments, by_stop_token):
            out = []
            for r, s, b in zip(rows, segments, by_stop_token):
                self.calls.append((r, list(s), b))
                n = sum(c[0] == r for c in self.calls)  # this row's turn
                out.append([[11, 12, 13], [14], [15, 16]][n - 1] if n <= 3 else None)
            return out

    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [5, 6, 7]]
    cfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0, repetition_penalty=penalty)
    out = {}
    for name in ("torch", "vllm"):
        env = ById([2, 3, 4, 2])
        sampler = TorchSampler(fake_vllm.load_hf(model_dir), EOS, PAD) if name == "torch" else make_sampler(model_dir)
        out[name] = sampler.generate(prompts, cfg, episodes=env), env
    (t, t_env), (v, v_env) = out["torch"], out["vllm"]
    assert v.response_ids.tolist() == t.response_ids.tolist()
    assert torch.equal(v.env_mask, t.env_mask) and torch.equal(v.response_mask, t.response_mask)
    assert v.finish_reason == t.finish_reason and v.env_mask.sum() > 0
    assert ("length" in v.finish_reason) == (max_new_tokens == 12)
    torch.testing.assert_close(v.logp_rollout, t.logp_rollout, atol=1e-4, rtol=0)
    assert sorted(v_env.calls) == sorted(t_env.calls)
