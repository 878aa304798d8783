"""Tests for cispo.rollout: the KV-cached TorchSampler against references (uncached decoding, one full
forward, each prompt alone, the sampling distribution) and its stopping rules."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from cispo.rollout import RolloutBatch, Sampler, SamplingConfig, TorchSampler  # noqa: E402

EOS, PAD = 1, 0
PROMPTS = [[2, 3, 4], [5], [6, 7, 8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 2, 3, 4, 5]]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def sampler(model):
    return TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD)


@pytest.fixture(scope="module")
def gpt2_sampler():
    """GPT-2 has absolute position embeddings: unlike RoPE, they expose wrong position ids under padding."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=20, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                  pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    return TorchSampler(transformers.GPT2LMHeadModel(cfg).eval(), eos_token_id=EOS, pad_token_id=PAD)


def gen(sampler, prompts=PROMPTS, seed=0, **cfg):
    return sampler.generate(prompts, SamplingConfig(**cfg), torch.Generator().manual_seed(seed))


def full_forward_logp(model, b: RolloutBatch, temperature: float) -> torch.Tensor:
    """Reference logp_rollout: one forward of [prompt + response], log_softmax(logits / T) at the response."""
    P, T = b.prompt_ids.shape[1], b.response_ids.shape[1]
    ids = torch.cat([b.prompt_ids, b.response_ids], 1)
    mask = torch.cat([b.prompt_mask, b.response_mask.long()], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1 : P + T - 1].float()
    logp = F.log_softmax(logits / (temperature or 1.0), -1).gather(-1, b.response_ids[..., None]).squeeze(-1)
    return logp * b.response_mask


def check_layout(b: RolloutBatch, max_new_tokens: int):
    """Shapes, dtypes and the padding invariants every batch must satisfy."""
    B, T = b.response_ids.shape
    assert b.prompt_ids.dtype == b.response_ids.dtype == torch.long
    assert b.response_mask.dtype == b.logp_rollout.dtype == torch.float32
    assert b.response_mask.shape == b.logp_rollout.shape == (B, T) and len(b.finish_reason) == B == len(b)
    lengths = b.response_lengths
    assert T == int(lengths.max()) <= max_new_tokens  # trimmed to the longest row
    # mask is 1...1 0...0; padding holds pad ids and zero log-probs
    assert torch.equal(b.response_mask, (torch.arange(T) < lengths[:, None]).float())
    assert (b.response_ids[b.response_mask == 0] == PAD).all() and (b.logp_rollout[b.response_mask == 0] == 0).all()
    assert (b.logp_rollout[b.response_mask == 1] <= 0).all()
    for row, reason, n in zip(b.response_ids, b.finish_reason, lengths.tolist()):
        assert reason in ("eos", "length", "repetition")
        assert (row[: n - 1] != EOS).all()  # nothing is generated after an EOS
        assert (row[n - 1] == EOS) == (reason == "eos")
        if reason == "length":
            assert n == max_new_tokens


def test_protocol_and_prompt_layout(sampler):
    assert isinstance(sampler, Sampler)
    b = gen(sampler, max_new_tokens=4)
    check_layout(b, 4)
    assert b.prompt_ids.shape == (len(PROMPTS), max(map(len, PROMPTS)))
    for ids, mask, p in zip(b.prompt_ids, b.prompt_mask, PROMPTS):  # left-padded
        assert ids[mask == 1].tolist() == p and (ids[mask == 0] == PAD).all()
        assert mask.tolist() == [0] * (len(mask) - len(p)) + [1] * len(p)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_cached_matches_uncached(sampler, temperature, top_p):
    kw = dict(max_new_tokens=12, temperature=temperature, top_p=top_p)
    a, b = gen(sampler, use_cache=True, **kw), gen(sampler, use_cache=False, **kw)
    check_layout(a, 12)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert a.finish_reason == b.finish_reason
    torch.testing.assert_close(a.logp_rollout, b.logp_rollout, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 1.0), (0.0, 1.0)])
def test_logp_matches_full_forward(model, sampler, temperature, top_p):
    b = gen(sampler, max_new_tokens=10, temperature=temperature, top_p=top_p, seed=3)
    torch.testing.assert_close(b.logp_rollout, full_forward_logp(model, b, temperature), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kw", [dict(temperature=0.6, top_p=0.8), dict(temperature=1.0, top_k=3),
                                dict(temperature=0.9, min_p=0.3), dict(temperature=1.0, repetition_penalty=1.8),
                                dict(temperature=0.0, repetition_penalty=1.5),
                                dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3)])
def test_processed_logp_is_one_forward_through_the_same_processing(model, sampler, kw):
    """On-policy the sampler's logp_rollout and a recompute through the same processing agree (ratio 1):
    the KV-cached loop's log-probs are those of one forward over prompt + response, processed position by
    position (its repetition penalty over the prompt and the response before it)."""
    from cispo.rollout.processing import sequence_processed_logprobs

    cfg = SamplingConfig(max_new_tokens=10, **kw)
    b = sampler.generate(PROMPTS, cfg, torch.Generator().manual_seed(3))
    P, T = b.prompt_ids.shape[1], b.response_ids.shape[1]
    ids = torch.cat([b.prompt_ids, b.response_ids], 1)
    mask = torch.cat([b.prompt_mask, b.response_mask.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    again = sequence_processed_logprobs(logits[:, P - 1 : P + T - 1].float(), b.response_ids, cfg, b.prompt_ids,
                                        b.prompt_mask).masked_fill(b.response_mask == 0, 0.0)  # padding: any
    torch.testing.assert_close(b.logp_rollout, again, atol=1e-4, rtol=0)
    ratio = (again - b.logp_rollout).exp()[b.response_mask == 1]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)
    if kw.get("top_k") or kw.get("top_p", 1) < 1 or kw.get("min_p"):  # renormalised: log p >= untruncated
        assert (b.logp_rollout >= full_forward_logp(model, b, kw["temperature"]) - 1e-5).all()


@pytest.mark.parametrize("which", ["sampler", "gpt2_sampler"])
def test_greedy_rows_do_not_depend_on_the_batch(request, which):
    sampler = request.getfixturevalue(which)
    batch = gen(sampler, max_new_tokens=8, temperature=0.0)
    for i, p in enumerate(PROMPTS):
        alone = gen(sampler, [p], max_new_tokens=8, temperature=0.0)
        n = int(alone.response_lengths[0])
        assert int(batch.response_lengths[i]) == n and batch.finish_reason[i] == alone.finish_reason[0]
        assert torch.equal(batch.response_ids[i, :n], alone.response_ids[0, :n])
        torch.testing.assert_close(batch.logp_rollout[i, :n], alone.logp_rollout[0, :n], atol=1e-5, rtol=0)


def test_cached_matches_uncached_gpt2(gpt2_sampler):
    a, b = (gen(gpt2_sampler, max_new_tokens=8, temperature=1.0, use_cache=c) for c in (True, False))
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logp_rollout, b.logp_rollout, atol=1e-5, rtol=0)


def test_eos_stops_rows_and_response_is_trimmed(sampler):
    b = gen(sampler, PROMPTS * 6, max_new_tokens=25, seed=1)
    check_layout(b, 25)
    # with ~1/20 chance of EOS per step both kinds of rows occur for this seed
    assert {"eos", "length"} <= set(b.finish_reason)


def test_same_seed_reproduces_and_seeds_differ(sampler):
    a, b, c = (gen(sampler, max_new_tokens=10, seed=s) for s in (5, 5, 6))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp_rollout, b.logp_rollout)
    assert not torch.equal(a.response_ids, c.response_ids)


def expected_stop(probs: list[float], n: int, thr: float = 0.99) -> int | None:
    """Index + 1 of the token at which the run of tokens with p > thr first reaches n, else None."""
    run = 0
    for i, p in enumerate(probs):
        run = run + 1 if p > thr else 0
        if run == n:
            return i + 1
    return None


def test_repetition_stop_on_almost_greedy(sampler):
    # the random model's logits are nearly flat (gaps ~1e-3), so "almost greedy" needs temperature 1e-4
    b = gen(sampler, max_new_tokens=10, temperature=1e-4, repetition_stop_tokens=3)
    check_layout(b, 10)
    for reason, n in zip(b.finish_reason, b.response_lengths.tolist()):
        assert (reason, n) == ("repetition", 3) or (reason == "eos" and n <= 3)
    assert b.num_repetition_stops >= 1
    off = gen(sampler, max_new_tokens=10, temperature=1e-4)
    assert off.num_repetition_stops == 0 and "repetition" not in off.finish_reason
    # at temperature 1e-3 some tokens are unsure (p < 0.99) and reset the run
    b = gen(sampler, max_new_tokens=10, temperature=1e-3, repetition_stop_tokens=3)
    for row_logp, reason, n in zip(b.logp_rollout, b.finish_reason, b.response_lengths.tolist()):
        stop = expected_stop(row_logp[:n].exp().tolist(), 3)
        assert (reason == "repetition") == (stop == n) and (stop is None or stop >= n)
    assert max(b.response_lengths.tolist()) > 3
    # at temperature 1 the random model is never that confident
    assert gen(sampler, max_new_tokens=10, repetition_stop_tokens=1).num_repetition_stops == 0


class Bigram(torch.nn.Module):
    """Next-token logits depend on the last token only. It takes `past_key_values` (the pre-5.x name)
    and has no `logits_to_keep`, exercising the sampler's fallbacks."""

    def __init__(self, next_probs: dict[int, dict[int, float]], vocab: int = 10):
        super().__init__()
        table = torch.full((vocab, vocab), 1e-9)
        for a, row in next_probs.items():
            for b_, p in row.items():
                table[a, b_] = p
        self.logits = torch.nn.Parameter(table.log())
        self.calls = 0

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False):
        self.calls += 1
        return SimpleNamespace(logits=self.logits[input_ids], past_key_values=(past_key_values or 0) + 1)


# 2 -> 3 -> 4 -> 5 -> 2 -> ..., every step confident (p=0.999) except 3 -> 4 (p=0.6); 6 -> 7 -> EOS confident.
CHAIN = {2: {3: 0.999}, 3: {4: 0.6, 5: 0.4}, 4: {5: 0.999}, 5: {2: 0.999}, 6: {7: 0.999}, 7: {EOS: 0.999}}


@pytest.mark.parametrize(
    "n,expected",
    [
        (3, [([3, 4, 5, 2, 3], "repetition"), ([7, EOS], "eos")]),  # the counter resets at 4; 3 reaches N
        (2, [([3, 4, 5, 2], "repetition"), ([7, EOS], "eos")]),  # EOS wins when it also reaches N
        (4, [([3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5, 2], "length"), ([7, EOS], "eos")]),
        (None, [([3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5, 2], "length"), ([7, EOS], "eos")]),
    ],
)
@pytest.mark.parametrize("use_cache", [True, False])
def test_repetition_counter_on_a_scripted_model(n, expected, use_cache):
    model = Bigram(CHAIN)
    s = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD)
    b = s.generate([[9, 2], [6]], SamplingConfig(max_new_tokens=12, temperature=0.0, repetition_stop_tokens=n,
                                                 use_cache=use_cache))
    check_layout(b, 12)
    got = [(r[m == 1].tolist(), reason) for r, m, reason in zip(b.response_ids, b.response_mask, b.finish_reason)]
    assert got == expected
    assert model.calls == b.response_ids.shape[1]  # one prefill, then one call per step; stops when all done


TURN_END = 8  # a chat template's end of turn that is not the EOS (ChatML's <|im_end|> beside <|endoftext|>)


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_row_stops_at_any_of_several_stop_ids(use_cache):
    """eos_token_id may list several ids (a generation config's, a chat template's end of turn): a row
    stops at the first it samples, which it keeps (mask 1), and is padded after; with EOS alone the
    turn end is just another token."""
    model = Bigram({2: {3: 0.999}, 3: {2: 0.999}, 6: {7: 0.999}, 7: {TURN_END: 0.999}, TURN_END: {EOS: 0.999}})
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0, use_cache=use_cache)
    b = TorchSampler(model, eos_token_id=[EOS, TURN_END], pad_token_id=PAD).generate([[9, 2], [6]], greedy)
    assert b.response_ids.tolist() == [[3, 2, 3, 2, 3, 2], [7, TURN_END, PAD, PAD, PAD, PAD]]
    assert b.response_mask.tolist() == [[1.0] * 6, [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    assert b.finish_reason == ["length", "eos"] and b.logp_rollout[1, 2:].eq(0).all()
    eos_only = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD).generate([[6]], greedy)
    assert eos_only.response_ids.tolist() == [[7, TURN_END, EOS]] and eos_only.finish_reason == ["eos"]


@pytest.mark.parametrize("decode", ["static", "hf"])
def test_several_stop_ids_end_rows_in_both_decode_loops(model, decode):
    stops = (EOS, 5, 9)
    s = TorchSampler(model, eos_token_id=list(stops), pad_token_id=PAD, decode=decode)
    assert s.stop_token_ids == stops and s.eos_token_id == EOS
    b = s.generate(PROMPTS * 4, SamplingConfig(max_new_tokens=20), torch.Generator().manual_seed(1))
    ends = []
    for row, reason, n in zip(b.response_ids.tolist(), b.finish_reason, b.response_lengths.tolist()):
        assert not set(row[: n - 1]) & set(stops) and (row[n - 1] in stops) == (reason == "eos")
        ends += [row[n - 1]] if reason == "eos" else []
    assert {5, 9} & set(ends)  # rows stopped at ids other than EOS (3 of 20 ids stop: most rows do)
    with pytest.raises(ValueError, match="eos_token_id must be a token id or a non-empty list"):
        TorchSampler(model, eos_token_id=[], pad_token_id=PAD)


@pytest.mark.parametrize("truncation", [dict(top_p=1e-6), dict(top_k=1)])
def test_one_kept_token_samples_the_argmax_with_probability_one(sampler, truncation):
    """top_k=1 (or a tiny top_p) is greedy decoding, and the distribution sampled puts all its mass on that
    token: logp_rollout = log 1 = 0."""
    greedy = gen(sampler, max_new_tokens=10, temperature=0.0)
    for temperature in (1.0, 2.0):
        b = gen(sampler, max_new_tokens=10, temperature=temperature, seed=7, **truncation)
        assert torch.equal(b.response_ids, greedy.response_ids)
        assert b.logp_rollout.abs().max() < 1e-6


@pytest.mark.parametrize("temperature,top_p,more", [(1.5, 1.0, {}), (0.8, 0.6, {}), (1.2, 1.0, dict(top_k=4)),
                                                     (1.0, 1.0, dict(min_p=0.25)),
                                                     (1.0, 1.0, dict(repetition_penalty=3.0))])
def test_first_token_distribution(model, sampler, temperature, top_p, more):
    """The first token's frequencies are the processed distribution (transformers' own logits processors) and
    logp_rollout is its log-prob of the token drawn."""
    prompt, n = [4, 9, 2], 4000
    processors = transformers.LogitsProcessorList(
        ([transformers.RepetitionPenaltyLogitsProcessor(more["repetition_penalty"])] if more.get("repetition_penalty")
         else []) + [transformers.TemperatureLogitsWarper(temperature)]
        + ([transformers.MinPLogitsWarper(more["min_p"])] if more.get("min_p") else [])
        + ([transformers.TopKLogitsWarper(more["top_k"])] if more.get("top_k") else [])
        + ([transformers.TopPLogitsWarper(top_p)] if top_p < 1 else []))
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1:]
    probs = F.softmax(processors(torch.tensor([prompt]), logits.clone()), -1)[0]
    b = gen(sampler, [prompt] * n, max_new_tokens=1, temperature=temperature, top_p=top_p, seed=11, **more)
    torch.testing.assert_close(b.logp_rollout[:, 0], probs.log()[b.response_ids[:, 0]], atol=1e-5, rtol=0)
    freq = torch.bincount(b.response_ids[:, 0], minlength=probs.numel()).float() / n
    assert (freq[probs == 0] == 0).all()
    assert (freq - probs).abs().max() < 0.03  # ~4 standard errors at n=4000
    kept = probs > 0
    chi2 = (n * (freq[kept] - probs[kept]) ** 2 / probs[kept]).sum()
    assert chi2 < 3 * int(kept.sum())  # loose: E[chi2] = dof


def test_training_mode_is_restored(model, sampler):
    try:
        model.train()
        model.model.layers[0].eval()  # mixed modes are restored module by module
        gen(sampler, max_new_tokens=3)
        assert model.training and model.model.layers[1].training and not model.model.layers[0].training
        model.eval()
        gen(sampler, max_new_tokens=3)
        assert not any(m.training for m in model.modules())
    finally:
        model.eval()


def test_outputs_are_usable_by_autograd(sampler):
    b = gen(sampler, max_new_tokens=5)
    w = torch.ones_like(b.logp_rollout, requires_grad=True)
    ((w * b.logp_rollout - b.logp_rollout.detach()) * b.response_mask).sum().backward()
    assert not b.logp_rollout.is_inference() and torch.equal(w.grad, b.logp_rollout * b.response_mask)


def test_bad_inputs_raise(sampler):
    cfg = SamplingConfig(max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        sampler.generate([], cfg)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.generate([[2], []], cfg)
    for bad in (dict(max_new_tokens=0), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-0.1),
                dict(temperature=float("nan")), dict(repetition_stop_tokens=0), dict(repetition_stop_prob=1.0),
                dict(top_k=-1), dict(top_k=2.5), dict(min_p=1.0), dict(min_p=-0.1), dict(repetition_penalty=0.0)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def test_optional_capabilities_have_no_op_defaults():
    """A backend that implements only ``generate`` still has every capability the trainer calls
    (weight sync, sleep / wake, lock-step), each doing nothing; the base ``generate`` is abstract."""

    class OnlyGenerate(Sampler):
        def generate(self, prompt_ids, cfg, generator=None):
            return "batch"

    s = OnlyGenerate()
    assert s.generate([[1]], SamplingConfig()) == "batch"
    assert s.update_weights(object()) == 0
    assert s.sleep() is None and s.wake_up() is None and s.lock_step(lambda done: done) is None
    with pytest.raises(NotImplementedError):
        Sampler().generate([[1]], SamplingConfig())


def test_lock_step_decodes_until_every_rank_is_done(sampler):
    """Under ``lock_step`` the decode loop asks ``all_ranks_done`` after every token: a rank
    whose rows all stopped keeps decoding (padding only) while another rank is still going."""
    calls = []

    def others_busy_for_two_more(done):  # another rank needs two more tokens after this one is done
        calls.append(done)
        return done and sum(calls) >= 3

    prompts = PROMPTS[1:2] * 2

    def stops_early(batch):  # both rows stop on their own, well before the budget
        return batch.finish_reason == ["eos", "eos"] and batch.response_ids.shape[1] < 38

    seed = next(s for s in range(200) if stops_early(gen(sampler, prompts, seed=s, max_new_tokens=40)))
    try:
        sampler.lock_step(others_busy_for_two_more)
        b = gen(sampler, prompts, seed=seed, max_new_tokens=40)
    finally:
        sampler.lock_step(None)
    alone = gen(sampler, prompts, seed=seed, max_new_tokens=40)
    T = alone.response_ids.shape[1]
    assert stops_early(alone)
    assert b.response_ids.shape[1] == T + 2  # two more, padding-only steps
    assert torch.equal(b.response_ids[:, :T], alone.response_ids)
    assert torch.equal(b.response_mask[:, :T], alone.response_mask)
    assert b.response_mask[:, T:].sum() == 0 and (b.response_ids[:, T:] == PAD).all()
