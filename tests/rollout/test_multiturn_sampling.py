"""Multi-segment (multi-turn) sampling in the torch sampler. A scripted environment answers each
policy segment with fixed observation ids; the sampler feeds them through the row's KV cache. The ids in
the response are exactly the sampled and the fed ids, observations are masked (``env_mask``, log-prob 0),
the continuation's log-probs equal a fresh forward of the whole context, rows at different turns share
a batch, and the token cap cuts an observation."""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from cispo.rollout import SamplingConfig, TorchSampler  # noqa: E402

EOS, PAD = 1, 0
PROMPTS = [[2, 3, 4], [5], [6, 7, 8, 9, 10], [2, 3, 4]]
OBS = [[11, 12, 13], [14], [15, 16]]  # the observation of turn 1, 2, 3

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class Scripted:
    """Pauses a row's segment after ``every[row]`` sampled tokens (a stop string, in ids) or at a stop id;
    answers turn k with OBS[k] until the turns run out, then ends the episode."""

    def __init__(self, every, turns=3):
        self.every, self.turns = every, turns
        self.calls: dict[int, list] = {}

    def pauses(self, row, segment_ids):
        return len(segment_ids) >= self.every[row]

    def respond(self, rows, segments, by_stop_token):
        out = []
        for row, segment, by_token in zip(rows, segments, by_stop_token):
            made = self.calls.setdefault(row, [])
            made.append((list(segment), by_token))
            out.append(OBS[len(made) - 1] if len(made) <= self.turns else None)
        return out


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def rollout(model, decode="auto", every=(2, 3, 4, 2), max_new_tokens=40, use_cache=True, seed=0):
    env = Scripted(list(every))
    sampler = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD, decode=decode)
    cfg = SamplingConfig(max_new_tokens=max_new_tokens, use_cache=use_cache)
    return sampler.generate(PROMPTS, cfg, torch.Generator().manual_seed(seed), episodes=env), env


def segments(batch, row):
    """The row's response split into (role, ids) runs."""
    n = int(batch.response_mask[row].sum())
    ids, env = batch.response_ids[row, :n].tolist(), batch.env_mask[row, :n].tolist()
    runs = []
    for tok, e in zip(ids, env):
        role = "env" if e else "policy"
        if runs and runs[-1][0] == role:
            runs[-1][1].append(tok)
        else:
            runs.append((role, [tok]))
    return runs


@pytest.mark.parametrize("decode", ["static", "hf"])
def test_observations_are_fed_between_policy_segments(model, decode):
    batch, env = rollout(model, decode)
    assert batch.env_mask is not None and batch.env_mask.shape == batch.response_mask.shape
    for row in range(len(PROMPTS)):
        runs = segments(batch, row)
        observed = [ids for role, ids in runs if role == "env"]
        policy = [ids for role, ids in runs if role == "policy"]
        made = env.calls[row]
        assert [seg for seg, _ in made] == policy[: len(made)]  # the environment saw exactly the policy's ids
        assert observed == OBS[: len(observed)]  # the fed ids are exactly the observation's, in order
        assert len(observed) == min(len(made), 3)
        if len(made) == 4:  # the fourth pause ended the episode
            assert batch.finish_reason[row] == "eos" and runs[-1][0] == "policy"
    # observations carry no log-prob; policy tokens do
    assert (batch.logp_rollout[batch.env_mask == 1] == 0).all()
    assert (batch.logp_rollout[(batch.env_mask == 0) & (batch.response_mask == 1)] < 0).all()


def test_rows_at_different_turns_share_a_step(model):
    batch, env = rollout(model, every=(2, 5, 9, 3))
    turn_at = []  # per row, the column of its first observation
    for row in range(len(PROMPTS)):
        cols = batch.env_mask[row].nonzero().flatten().tolist()
        turn_at.append(cols[0] if cols else None)
    assert len({c for c in turn_at if c is not None}) > 1  # the rows paused at different columns


@pytest.mark.parametrize("decode", ["static", "hf"])
def test_the_cached_continuation_equals_a_fresh_forward_of_the_whole_context(model, decode):
    batch, _ = rollout(model, decode)
    P, T = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.response_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask.long()], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1 : P + T - 1].float()
    ref = F.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    policy = (batch.response_mask == 1) & (batch.env_mask == 0)
    torch.testing.assert_close(batch.logp_rollout[policy], ref[policy], atol=1e-5, rtol=0)


def test_cached_and_uncached_decoding_agree_with_an_environment(model):
    a, _ = rollout(model, use_cache=True)
    b, _ = rollout(model, use_cache=False)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.env_mask, b.env_mask)
    torch.testing.assert_close(a.logp_rollout, b.logp_rollout, atol=1e-5, rtol=0)


def test_the_token_cap_cuts_an_observation(model):
    batch, env = rollout(model, every=(2, 2, 2, 2), max_new_tokens=4)
    checked = 0
    for row in range(len(PROMPTS)):  # 2 policy tokens, then 2 of the 3 observation ids fit
        if env.calls.get(row) and not env.calls[row][0][1]:
            checked += 1
            assert batch.response_ids[row].tolist() == [*env.calls[row][0][0], 11, 12]
            assert batch.env_mask[row].tolist() == [0, 0, 1, 1]
            assert batch.finish_reason[row] == "length"
    assert checked >= 2  # rows that paused by the stop string (not a stop id) were checked


def test_without_an_environment_there_is_no_env_mask(model):
    sampler = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD)
    batch = sampler.generate(PROMPTS, SamplingConfig(max_new_tokens=8), torch.Generator().manual_seed(0))
    assert batch.env_mask is None


def rollout_with(model, every, prefill, decode="static", temperature=1.0, max_new_tokens=40, prompts=PROMPTS,
                 seed=0, **cfg):
    env = Scripted(list(every))
    sampler = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD, decode=decode, prefill_observations=prefill)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, **cfg)
    return sampler.generate(prompts, sampling, torch.Generator().manual_seed(seed), episodes=env), env


def assert_same_rollout(a, b):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask) and torch.equal(a.env_mask, b.env_mask)
    assert a.finish_reason == b.finish_reason
    torch.testing.assert_close(a.logp_rollout, b.logp_rollout, atol=1e-5, rtol=0)


@pytest.mark.parametrize("every,max_new_tokens", [((2, 5, 9, 3), 40), ((2, 2, 2, 2), 4), ((1, 3, 2, 4), 7)])
@pytest.mark.parametrize("decode", ["static", "hf"])
def test_greedy_rollouts_are_the_same_observations_prefilled_or_fed_token_by_token(model, every, max_new_tokens,
                                                                                    decode):
    """Greedy draws no random numbers, so the schedules must give the same tokens: rows at different turns,
    an observation cut by the cap (max_new_tokens 4 and 7), the two rows that share a prompt."""
    chunked, _ = rollout_with(model, every, True, temperature=0.0, max_new_tokens=max_new_tokens)
    fed, _ = rollout_with(model, every, False, decode=decode, temperature=0.0, max_new_tokens=max_new_tokens)
    assert chunked.env_mask.sum() > 0
    assert_same_rollout(chunked, fed)


def test_greedy_rollouts_agree_with_the_repetition_penalty_and_stop(model):
    """The repetition penalty sees the prefilled observation ids as it sees fed ones."""
    kw = dict(temperature=0.0, repetition_penalty=1.5, repetition_stop_tokens=6, repetition_stop_prob=0.5)
    chunked, _ = rollout_with(model, (2, 5, 9, 3), True, **kw)
    fed, _ = rollout_with(model, (2, 5, 9, 3), False, **kw)
    assert_same_rollout(chunked, fed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_rollouts_equal_the_reference_on_the_same_schedule(model, seed):
    """Under sampling the static decode and the no-cache reference (which recomputes every row's whole
    context each step) follow one schedule, so they draw the same tokens; groups of rows share a prompt."""
    prompts = [p for p in PROMPTS[:3] for _ in range(3)]
    every = [2, 5, 1, 3, 4, 2, 6, 1, 3]
    a, _ = rollout_with(model, every, True, prompts=prompts, seed=seed)
    b, _ = rollout_with(model, every, True, prompts=prompts, seed=seed, use_cache=False)
    assert a.env_mask.sum() > 0
    assert_same_rollout(a, b)


def test_an_observation_takes_one_forward(model):
    """One row, turns after every 2 sampled tokens: the prefilled schedule calls the decoder once per
    sampled token (the prefill, then after each token but the last), token by token once per token."""
    calls = []
    hook = model.model.embed_tokens.register_forward_hook(lambda *_: calls.append(1))
    try:
        counts = []
        for prefill in (True, False):
            calls.clear()
            batch, _ = rollout_with(model, (2,), prefill, temperature=0.0, prompts=PROMPTS[:1])
            counts.append(len(calls))
    finally:
        hook.remove()
    n = int(batch.response_mask.sum())
    policy = n - int(batch.env_mask.sum())
    assert batch.finish_reason == ["eos"] and int(batch.env_mask.sum()) == 3 + 1 + 2  # every observation fed
    assert counts == [policy, n]


def test_left_aligned_contexts_by_value():
    from cispo.rollout.torch_sampler import left_aligned

    prompt = torch.tensor([[0, 2, 3], [4, 5, 6]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    response = torch.tensor([[7, 8, 9, 0], [10, 11, 0, 0]])
    ids, mask = left_aligned(prompt, prompt_mask, response, torch.tensor([3, 1]), PAD)
    # row 0: 2 prompt ids + 3 response ids = 5; row 1: 3 + 1 = 4, one pad on the left
    assert ids.tolist() == [[2, 3, 7, 8, 9], [0, 4, 5, 6, 10]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]


def test_chunk_mask_and_mark_seen_by_value():
    from cispo.rollout.static_cache import chunk_mask
    from cispo.rollout.torch_sampler import mark_seen

    columns = torch.tensor([[False, True, True, True, True], [True, True, True, True, True]])
    cols = torch.tensor([[2, 3], [4, 4]])  # row 0: two new tokens at 2 and 3; row 1: one at 4 (and padding)
    mask = chunk_mask(columns, cols)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].int().tolist() == [[0, 1, 1, 0, 0], [0, 1, 1, 1, 0]]
    assert mask[1, 0].int().tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    context = torch.zeros(2, 8, dtype=torch.bool)
    mark_seen(context, torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([1, 0]), torch.tensor([3, 1]))
    assert context.nonzero().tolist() == [[0, 2], [0, 3], [1, 4]]
