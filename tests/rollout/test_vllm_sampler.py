"""The Sampler protocol contract, run against every backend, plus VLLMSampler's pure parts.

Backends of the contract test:

* ``torch``: ``TorchSampler`` (always);
* ``fake-vllm``: ``VLLMSampler`` on a stand-in ``vllm`` module (``tests/fake_vllm.py``) that runs the Hugging
  Face model with vLLM's documented semantics (processed log-probs, per-request seeds, stop tokens, finish
  reasons, ``load_weights`` by Hugging Face name) and accepts only vLLM 0.33.0's ``LLM`` arguments. It
  exercises all of VLLMSampler's own code on a CPU; it proves nothing about vLLM itself;
* ``vllm``: ``VLLMSampler`` on the real engine, only where vLLM is importable and a CUDA GPU is present.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from cispo.models.loading import build_tokenizer, save_policy  # noqa: E402
from cispo.rollout import RolloutBatch, Sampler, SamplingConfig, TorchSampler, truncated_is_weights  # noqa: E402
from cispo.rollout.vllm_sampler import (  # noqa: E402
    VLLMSampler,
    finalize_response,
    repetition_stop_length,
)
from tests import fake_vllm  # noqa: E402  (tests/fake_vllm.py)

PAD, EOS = 0, 1  # cispo.models.loading.build_tokenizer's ids
CHARS = "0123456789+-=abcdefghijklmnopqrstuvwxyz"
PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14, 15], [16, 17], [18, 19, 20, 21], [22, 5, 6, 7, 8]]


def real_vllm_skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'cispo[vllm]' on a CUDA machine)"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


REAL_VLLM_SKIP = real_vllm_skip_reason()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama + character tokenizer, saved like a real checkpoint. head_dim 64: a size every
    vLLM attention backend supports."""
    tok = build_tokenizer(CHARS)
    assert (tok.pad_token_id, tok.eos_token_id) == (PAD, EOS)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
    return save_policy(model, tok, tmp_path_factory.mktemp("tiny"))


load_hf = fake_vllm.load_hf


@torch.no_grad()
def force_token(model, tok: int, logit: float = 30.0):
    """Make ``model`` predict ``tok`` with probability ~1 everywhere: every token gets the same embedding, so
    every position ends with the same hidden state h (attention mixes identical values), and the output
    row of ``tok`` is set so that its logit is ``logit`` (the others stay ~0.1)."""
    emb = model.get_input_embeddings().weight
    emb.copy_(emb[5].expand_as(emb).clone())
    h = model.model(input_ids=torch.tensor([[5, 6]], device=emb.device)).last_hidden_state[0, -1]
    model.lm_head.weight[tok] = h * (logit / h.dot(h))
    return model


# --------------------------------------------------------------------------- the stand-in (tests/fake_vllm.py)


def make_fake_sampler(model_dir, logprobs_mode=True, multiprocess=False, head_dtype=True, old_reload=False,
                      **kw) -> VLLMSampler:
    with pytest.MonkeyPatch.context() as mp:
        fake_vllm.install(mp, logprobs_mode=logprobs_mode, multiprocess=multiprocess, head_dtype=head_dtype,
                          old_reload=old_reload)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the real env untouched
        return VLLMSampler(model_dir, eos_token_id=EOS, pad_token_id=PAD, **kw)


# --------------------------------------------------------------------------- the backends


@pytest.fixture(scope="module")
def real_vllm_sampler(model_dir):
    if REAL_VLLM_SKIP:
        pytest.skip(REAL_VLLM_SKIP)
    return VLLMSampler(model_dir, eos_token_id=EOS, pad_token_id=PAD, gpu_memory_utilization=0.3,
                       enable_sleep_mode=True, enforce_eager=True, max_model_len=128)


@pytest.fixture(scope="module", params=["torch", "fake-vllm", "vllm"])
def backend(request, model_dir):
    """(name, sampler, reference HF model on the CPU holding the sampler's weights)."""
    if request.param == "torch":
        model = load_hf(model_dir)
        return "torch", TorchSampler(model, EOS, PAD), model
    if request.param == "fake-vllm":
        return "fake-vllm", make_fake_sampler(model_dir), load_hf(model_dir)
    return "vllm", request.getfixturevalue("real_vllm_sampler"), load_hf(model_dir)


def gen(sampler, prompts=PROMPTS, seed=0, **cfg) -> RolloutBatch:
    return sampler.generate(prompts, SamplingConfig(**cfg), torch.Generator().manual_seed(seed))


def full_forward_logp(model, b: RolloutBatch, temperature: float, cfg: SamplingConfig | None = None) -> torch.Tensor:
    """log_softmax(logits / T) of the sampled tokens from one forward of [prompt + response] (T=0: untempered);
    with ``cfg``, the log-probs of the distribution it samples (`cispo.rollout.processing`)."""
    from cispo.rollout.processing import sequence_processed_logprobs

    P, T = b.prompt_ids.shape[1], b.response_ids.shape[1]
    ids = torch.cat([b.prompt_ids, b.response_ids], 1).cpu()
    mask = torch.cat([b.prompt_mask, b.response_mask.long()], 1).cpu()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1 : P + T - 1].float()
    if cfg is not None:
        logp = sequence_processed_logprobs(logits, b.response_ids.cpu(), cfg, b.prompt_ids.cpu(), b.prompt_mask.cpu())
        return logp.masked_fill(b.response_mask.cpu() == 0, 0.0)
    logp = F.log_softmax(logits / (temperature or 1.0), -1).gather(-1, b.response_ids.cpu()[..., None]).squeeze(-1)
    return logp * b.response_mask.cpu()


def check_contract(b: RolloutBatch, prompts, max_new_tokens: int):
    """Shapes, dtypes, padding, masks, finish reasons: what every backend must return."""
    assert isinstance(b, RolloutBatch)
    B, T = b.response_ids.shape
    assert B == len(prompts) == len(b) == len(b.finish_reason)
    assert b.prompt_ids.dtype == b.response_ids.dtype == b.prompt_mask.dtype == torch.long
    assert b.response_mask.dtype == b.logp_rollout.dtype == torch.float32
    assert b.response_mask.shape == b.logp_rollout.shape == (B, T)
    assert b.prompt_ids.shape == b.prompt_mask.shape == (B, max(map(len, prompts)))
    for ids, mask, p in zip(b.prompt_ids.cpu(), b.prompt_mask.cpu(), prompts):  # left-padded prompts
        assert mask.tolist() == [0] * (len(mask) - len(p)) + [1] * len(p)
        assert ids[mask == 1].tolist() == list(p) and (ids[mask == 0] == PAD).all()
    lengths = b.response_lengths.cpu()
    assert T == int(lengths.max()) <= max_new_tokens and int(lengths.min()) >= 1
    mask, resp, logp = b.response_mask.cpu(), b.response_ids.cpu(), b.logp_rollout.cpu()
    assert torch.equal(mask, (torch.arange(T) < lengths[:, None]).float())  # 1...1 0...0
    assert (resp[mask == 0] == PAD).all() and (logp[mask == 0] == 0).all()
    assert torch.isfinite(logp).all() and (logp[mask == 1] <= 1e-6).all()
    for row, reason, n in zip(resp, b.finish_reason, lengths.tolist()):
        assert reason in ("eos", "length", "repetition")
        assert (row[: n - 1] != EOS).all()  # nothing after an EOS
        assert (row[n - 1] == EOS) == (reason == "eos")
        if reason == "length":
            assert n == max_new_tokens


# --------------------------------------------------------------------------- the contract


def test_is_a_sampler(backend):
    assert isinstance(backend[1], Sampler)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.0),
                                dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=4),
                                dict(temperature=0.9, min_p=0.6), dict(temperature=1.0, repetition_penalty=1.6),
                                dict(temperature=0.0, repetition_penalty=1.6),
                                dict(temperature=0.8, top_k=8, top_p=0.9, min_p=0.02, repetition_penalty=1.2)])
def test_contract_and_logp_matches_full_forward(backend, kw):
    """Every backend's logp_rollout is the log-prob of the distribution it sampled (penalty, temperature, min_p,
    top_k, top_p in vLLM's order, renormalised over the tokens kept): one forward of prompt + response through
    the same processing gives it back (ratio 1 on-policy)."""
    name, sampler, model = backend
    prompts = PROMPTS * 3
    cfg = SamplingConfig(max_new_tokens=24, **kw)
    b = sampler.generate(prompts, cfg, torch.Generator().manual_seed(3))
    check_contract(b, prompts, 24)
    ref = full_forward_logp(model, b, cfg.temperature, cfg)
    mask = b.response_mask.cpu().bool()
    got = b.logp_rollout.cpu()
    if name == "torch":
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        return
    tol_max, tol_mean = (1e-4, 1e-5) if name == "fake-vllm" else (0.5, 0.05)  # real vLLM: bf16, own kernels
    diff = (got - ref)[mask].abs()
    assert diff.mean() < tol_mean and diff.max() < tol_max, (diff.mean(), diff.max())
    if cfg.top_k or cfg.top_p < 1 or cfg.min_p:  # the truncation renormalises: log p - log S >= log p
        assert (got - full_forward_logp(model, b, cfg.temperature))[mask].max() > 1e-3


def test_both_finish_reasons_occur(backend):
    b = gen(backend[1], PROMPTS * 6, seed=1, max_new_tokens=40)
    check_contract(b, PROMPTS * 6, 40)
    assert {"eos", "length"} <= set(b.finish_reason)  # ~1/42 chance of EOS per step


def test_same_seed_reproduces(backend):
    name, sampler, _ = backend
    if name == "vllm":
        pytest.skip("determinism is only required of TorchSampler (vLLM is not batch-invariant)")
    a, b, c = (gen(sampler, seed=s, max_new_tokens=10) for s in (5, 5, 6))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logp_rollout, b.logp_rollout)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_bad_inputs_raise(backend):
    sampler = backend[1]
    cfg = SamplingConfig(max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        sampler.generate([], cfg)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.generate([[2], []], cfg)


# --------------------------------------------------------------------------- post-hoc repetition stop


@pytest.mark.parametrize(
    "probs,n,expected",
    [
        ([0.999, 0.999, 0.999, 0.5], 3, 3),
        ([0.999, 0.5, 0.999, 0.999, 0.999, 0.999], 3, 5),  # the run resets at 0.5
        ([0.999, 0.99, 0.999, 0.999], 2, 4),  # 0.99 is not > 0.99
        ([0.999] * 4, 5, None),
        ([0.2, 0.999], 1, 2),
        ([], 1, None),
    ],
)
def test_repetition_stop_length(probs, n, expected):
    assert repetition_stop_length(probs, n, 0.99) == expected


LP_HI, LP_LO = math.log(0.999), math.log(0.5)


@pytest.mark.parametrize(
    "ids,lps,engine,n,expected",
    [
        # no repetition stop: finish reasons mapped
        ([5, 6, EOS], [LP_LO] * 3, "stop", None, ([5, 6, EOS], "eos")),
        ([5, 6, 7, 8], [LP_LO] * 4, "length", None, ([5, 6, 7, 8], "length")),
        ([5, 6, 7, EOS], [LP_LO] * 4, "length", None, ([5, 6, 7, EOS], "eos")),  # EOS as the last allowed token
        # cut at the N-th confident token; the tokens after it are discarded
        ([5, 6, 7, 8], [LP_LO, LP_HI, LP_HI, LP_LO], "length", 2, ([5, 6, 7], "repetition")),
        ([5, 6, 7, EOS], [LP_HI, LP_HI, LP_HI, LP_HI], "stop", 2, ([5, 6], "repetition")),
        # the token that reaches N is the EOS: "eos" wins; at the last allowed token "repetition" beats "length"
        ([5, 6, EOS], [LP_LO, LP_HI, LP_HI], "stop", 2, ([5, 6, EOS], "eos")),
        ([5, 6, 7, 8], [LP_LO, LP_LO, LP_HI, LP_HI], "length", 2, ([5, 6, 7, 8], "repetition")),
        ([5, 6, 7, 8], [LP_HI, LP_LO, LP_HI, LP_LO], "length", 2, ([5, 6, 7, 8], "length")),
    ],
)
def test_finalize_response(ids, lps, engine, n, expected):
    cfg = SamplingConfig(max_new_tokens=4, repetition_stop_tokens=n)
    out_ids, out_lps, reason = finalize_response(ids, lps, engine, EOS, cfg)
    assert (out_ids, reason) == expected and out_lps == lps[: len(out_ids)]


@pytest.mark.parametrize(
    "ids,engine,expected",
    [
        ([5, 8], "stop", ([5, 8], "eos")),  # the engine stopped on the second stop id
        ([5, 8, 6, 7], "length", ([5, 8], "eos")),  # never expected: cut at the first stop id all the same
        ([5, 6, 7, 8], "length", ([5, 6, 7, 8], "eos")),  # a stop id as the last allowed token
    ],
)
def test_finalize_response_with_several_stop_ids(ids, engine, expected):
    out_ids, _, reason = finalize_response(ids, [LP_LO] * len(ids), engine, [EOS, 8], SamplingConfig(max_new_tokens=4))
    assert (out_ids, reason) == expected


def test_the_engine_stops_on_every_stop_id(model_dir):
    """eos_token_id a list (the tokenizer's EOS and a chat turn end): all of it goes to SamplingParams'
    stop_token_ids, and a model that always says 7 stops at its first token."""
    with pytest.MonkeyPatch.context() as mp:
        fake_vllm.install(mp)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        sampler = VLLMSampler(model_dir, eos_token_id=[EOS, 7], pad_token_id=PAD)
    sampler.update_weights(force_token(load_hf(model_dir), 7))
    b = gen(sampler, max_new_tokens=6)
    assert sampler.llm.calls[-1][0].stop_token_ids == [EOS, 7]
    assert b.response_ids.tolist() == [[7]] * len(PROMPTS) and b.finish_reason == ["eos"] * len(PROMPTS)


def test_finalize_response_rejects_inconsistent_engine_output():
    cfg = SamplingConfig(max_new_tokens=4)
    with pytest.raises(RuntimeError, match="not on EOS"):
        finalize_response([5, 6], [0.0, 0.0], "stop", EOS, cfg)
    with pytest.raises(RuntimeError, match="max_model_len"):
        finalize_response([5, 6], [0.0, 0.0], "length", EOS, cfg)
    with pytest.raises(RuntimeError, match="finish_reason"):
        finalize_response([5, 6], [0.0, 0.0], "abort", EOS, cfg)


def test_repetition_stop_through_the_sampler(model_dir):
    """A model that always predicts token 7 with p ~ 1: every row is cut at N and marked "repetition"."""
    sampler = make_fake_sampler(model_dir)
    sampler.update_weights(force_token(load_hf(model_dir), 7))
    b = gen(sampler, max_new_tokens=12, repetition_stop_tokens=4)
    check_contract(b, PROMPTS, 12)
    assert b.finish_reason == ["repetition"] * len(PROMPTS) and b.response_lengths.tolist() == [4] * len(PROMPTS)
    assert (b.response_ids == 7).all()
    # the engine generated all 12 tokens per row; only the first 4 are kept
    assert all(sp.max_tokens == 12 for sp in sampler.llm.calls[-1])


# --------------------------------------------------------------------------- VLLMSampler with the stand-in


def test_sampling_params_and_engine_arguments(model_dir):
    sampler = make_fake_sampler(model_dir, gpu_memory_utilization=0.25, max_model_len=96)
    kw = sampler.llm.kwargs
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["generation_config"] == "vllm"
    assert kw["gpu_memory_utilization"] == 0.25 and kw["dtype"] == "auto" and kw["max_model_len"] == 96
    assert kw["tokenizer"] == str(model_dir)
    # TRL-like defaults: 4096 batched tokens, CUDA graphs on; the rest left to vLLM; one engine, no launcher
    assert kw["max_num_batched_tokens"] == 4096 and kw["enforce_eager"] is False
    assert not {"max_num_seqs", "distributed_executor_backend", "hf_overrides"} & set(kw)
    gen(sampler, [[5, 6]] * 3, seed=0, max_new_tokens=7, temperature=0.6, top_p=0.95)
    params = sampler.llm.calls[-1]
    assert len(params) == 3 and len({p.seed for p in params}) == 3  # one seed per request, from the generator
    p = params[0]
    assert (p.temperature, p.top_p, p.max_tokens, p.logprobs) == (0.6, 0.95, 7, 0)
    assert (p.top_k, p.min_p, p.repetition_penalty) == (0, 0.0, 1.0)  # off, as vLLM's own defaults
    sampler.generate([[5]], SamplingConfig(max_new_tokens=2, top_k=7, min_p=0.05, repetition_penalty=1.1))
    p = sampler.llm.calls[-1][0]
    assert (p.top_k, p.min_p, p.repetition_penalty) == (7, 0.05, 1.1)
    assert p.stop_token_ids == [EOS] and p.ignore_eos and not p.detokenize and p.n == 1
    sampler.generate([[5]], SamplingConfig(max_new_tokens=2))
    assert sampler.llm.calls[-1][0].seed is None  # no generator: the engine's seeded stream


def test_raw_logprobs_fallback_warns(model_dir):
    with pytest.warns(UserWarning, match="no logprobs_mode"):
        sampler = make_fake_sampler(model_dir, logprobs_mode=False)
    assert "logprobs_mode" not in sampler.llm.kwargs and sampler.logprob_semantics.startswith("raw")
    with pytest.warns(UserWarning, match="raw log-probs"):
        b = gen(sampler, max_new_tokens=5, temperature=0.5)
    # raw = untempered: equal to the temperature-1 recomputation
    ref = full_forward_logp(load_hf(model_dir), b, 1.0)
    torch.testing.assert_close(b.logp_rollout, ref, atol=1e-4, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen(sampler, max_new_tokens=5, temperature=1.0)  # exact there: no warning


def test_prompt_too_long_for_the_engine(model_dir):
    sampler = make_fake_sampler(model_dir)
    with pytest.raises(ValueError, match="max_model_len"):
        sampler.generate([[5] * 100], SamplingConfig(max_new_tokens=30))


@pytest.mark.parametrize("multiprocess", [False, True])
def test_update_weights_changes_what_is_sampled(model_dir, multiprocess):
    sampler = make_fake_sampler(model_dir, multiprocess=multiprocess)
    trainer = load_hf(model_dir)
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    before = sampler.generate(PROMPTS, greedy)
    force_token(trainer, 9)
    n = sampler.update_weights(trainer)
    assert n == len(trainer.state_dict())
    after = sampler.generate(PROMPTS, greedy)
    assert (after.response_ids == 9).all() and not (before.response_ids == 9).all()
    assert "reset_prefix_cache" in sampler.llm.calls
    torch.testing.assert_close(after.logp_rollout, full_forward_logp(trainer, after, 0.0), atol=1e-4, rtol=0)


def test_update_weights_merges_lora(model_dir):
    pytest.importorskip("peft")
    from cispo.models.lora import apply_lora, lora_parameters

    sampler = make_fake_sampler(model_dir)
    trainer = apply_lora(load_hf(model_dir), rank=4, alpha=8)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for _, p in lora_parameters(trainer):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    sampler.update_weights(trainer)  # the engine knows only plain names: a LoRA name would raise KeyError
    loaded = sampler.llm.engine_model.loaded
    assert loaded and not any("lora" in n or "base_layer" in n for n in loaded)
    b = gen(sampler, max_new_tokens=8, temperature=0.9)
    # W + s*B*A (engine) vs W x + s*B*(A x) (trainer): equal up to float32 rounding
    torch.testing.assert_close(b.logp_rollout, full_forward_logp(trainer, b, 0.9), atol=1e-3, rtol=0)
    base = full_forward_logp(load_hf(model_dir), b, 0.9)
    assert (b.logp_rollout - base).abs().max() > 1e-2  # the adapters matter


def test_every_argument_is_one_vllm_0_33_takes(model_dir):
    """Every setting reaches ``vllm.LLM`` under its 0.33 name; a misspelt free-form one is vLLM's TypeError."""
    sampler = make_fake_sampler(model_dir, dtype="bfloat16", max_model_len=96, max_num_seqs=64,
                                max_num_batched_tokens=2048, enforce_eager=True, enable_sleep_mode=True, seed=7,
                                fp32_head=True, kv_cache_dtype="fp8", hf_overrides={"rope_theta": 5e5})
    kw = sampler.llm.kwargs
    assert set(kw) - {"model"} <= fake_vllm.LLM_ARGUMENTS
    got = (kw["dtype"], kw["max_model_len"], kw["max_num_seqs"], kw["max_num_batched_tokens"])
    assert got == ("bfloat16", 96, 64, 2048)
    assert kw["enforce_eager"] is True and kw["enable_sleep_mode"] is True and kw["seed"] == 7
    assert kw["kv_cache_dtype"] == "fp8"
    assert kw["hf_overrides"] == {"rope_theta": 5e5, "head_dtype": "float32"}  # merged with the FP32 head's
    with pytest.raises(TypeError, match="max_model_length"):
        make_fake_sampler(model_dir, max_model_length=96)


def test_fp32_head_goes_to_the_engine_or_is_recorded_as_missing(model_dir):
    fake_vllm_sampler = make_fake_sampler(model_dir, fp32_head=True)
    assert fake_vllm_sampler.llm.kwargs["hf_overrides"] == {"head_dtype": "float32"}
    info = fake_vllm_sampler.info()
    assert info["fp32_head_requested"] and info["fp32_head_in_engine"] and info["vllm_version"] == "0.33.0"
    assert "hf_overrides" not in make_fake_sampler(model_dir, fp32_head=False).llm.kwargs
    # a vLLM without ModelConfig.head_dtype would ignore the key: not passed, warned once, recorded
    import cispo.rollout.vllm_sampler as vs

    vs._WARNED.discard("fp32_head")
    with pytest.warns(UserWarning, match="no head_dtype override"):
        old = make_fake_sampler(model_dir, fp32_head=True, head_dtype=False)
    assert "hf_overrides" not in old.llm.kwargs
    assert old.info()["fp32_head_requested"] and not old.info()["fp32_head_in_engine"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_fake_sampler(model_dir, fp32_head=True, head_dtype=False)  # once per process


def test_untested_vllm_version_warns(model_dir):
    with pytest.MonkeyPatch.context() as mp:
        fake_vllm.install(mp, version="0.32.0")
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with pytest.warns(UserWarning, match=r"tested with vllm >= 0.33.0, < 0.34; this is vllm 0.32.0"):
            VLLMSampler(model_dir, eos_token_id=EOS, pad_token_id=PAD)


@pytest.mark.parametrize("multiprocess", [False, True])
def test_weights_go_through_the_public_reload_weights(model_dir, multiprocess):
    """vLLM 0.33's ``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``, not the private
    ``model_executor`` path; nothing is read from disk."""
    sampler = make_fake_sampler(model_dir, multiprocess=multiprocess)
    trainer = force_token(load_hf(model_dir), 9)
    assert sampler.update_weights(trainer) == len(trainer.state_dict())
    assert ("reload_weights", "iterator") in sampler.llm.calls and ("reload_weights", "disk") not in sampler.llm.calls
    assert sampler.info()["weight_push"] == "reload_weights"
    b = sampler.generate(PROMPTS, SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert (b.response_ids == 9).all()


@pytest.mark.parametrize("multiprocess", [False, True])
def test_an_older_vllm_falls_back_to_the_private_path(model_dir, multiprocess):
    """A ``reload_weights`` without ``weights_iterator`` (TypeError before it runs): the model's own
    ``load_weights`` through ``model_executor`` (or a function through ``collective_rpc``)."""
    sampler = make_fake_sampler(model_dir, old_reload=True, multiprocess=multiprocess)
    trainer = force_token(load_hf(model_dir), 9)
    assert sampler.update_weights(trainer) == len(trainer.state_dict())
    assert sampler.info()["weight_push"] == "load_weights (private)"
    assert not any(isinstance(c, tuple) and c[0] == "reload_weights" for c in sampler.llm.calls)
    assert (sampler.generate(PROMPTS, SamplingConfig(max_new_tokens=4, temperature=0.0)).response_ids == 9).all()
    sampler.update_weights(load_hf(model_dir))  # the choice is kept: straight to the private path
    assert not (sampler.generate(PROMPTS, SamplingConfig(max_new_tokens=4, temperature=0.0)).response_ids == 9).all()


@pytest.fixture
def cuda_log(monkeypatch):
    """``torch.cuda.empty_cache`` calls, in order with the engine's calls (``sampler.llm.calls``)."""
    log = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    return log


def test_sleep_level_2_discards_the_weights_and_the_push_restores_them(model_dir, cuda_log, monkeypatch):
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        make_fake_sampler(model_dir).sleep()
    sampler = make_fake_sampler(model_dir, enable_sleep_mode=True)
    assert sampler.llm.kwargs["enable_sleep_mode"] is True and sampler.sleep_level == 2
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: sampler.llm.calls.append("empty_cache"))
    trainer = force_token(load_hf(model_dir), 9)
    sampler.sleep()  # the trainer calls it without a level: level 2, as TRL and verl
    assert sampler.llm.calls[-1] == ("sleep", 2)
    assert all(torch.isnan(p).all() for p in sampler.llm.engine_model.hf.parameters())  # discarded
    sampler.update_weights(trainer)  # frees the cache, wakes the weights, pushes them
    calls = [c for c in sampler.llm.calls if not isinstance(c, list)]
    i = calls.index(("wake_up", ["weights"]))
    assert calls[i - 1] == "empty_cache" and calls[i + 1] == ("reload_weights", "iterator")
    b = gen(sampler, max_new_tokens=3)  # frees the cache again, wakes the KV cache
    calls = [c for c in sampler.llm.calls if not isinstance(c, list)]
    j = calls.index(("wake_up", ["kv_cache"]))
    assert calls[j - 1] == "empty_cache" and (b.response_ids == 9).all()
    assert ("reload_weights", "disk") not in calls  # 0.33 keeps the buffers itself: no checkpoint re-read
    sampler.sleep()
    sampler.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):  # level 2 lost the weights
        gen(sampler, max_new_tokens=3)


def test_sleep_level_1_keeps_the_weights(model_dir, cuda_log):
    sampler = make_fake_sampler(model_dir, enable_sleep_mode=True, sleep_level=1)
    sampler.sleep()
    assert sampler.llm.calls[-1] == ("sleep", 1)
    gen(sampler, max_new_tokens=3)  # wakes everything at once, no push needed
    assert ("wake_up", None) in sampler.llm.calls and cuda_log == ["empty_cache"]
    with pytest.raises(ValueError, match="sleep_level"):
        make_fake_sampler(model_dir, enable_sleep_mode=True, sleep_level=3)


# --------------------------------------------------------------------------- the real engine (GPU only)


def test_real_vllm_update_weights_and_sleep(real_vllm_sampler, model_dir):
    sampler = real_vllm_sampler
    assert sampler.logprobs_mode == "processed_logprobs", f"vLLM {sampler.vllm_version} lacks logprobs_mode"
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    original = load_hf(model_dir)
    trainer = force_token(load_hf(model_dir).to("cuda"), 9)
    try:
        sampler.update_weights(trainer)
        b = sampler.generate(PROMPTS, greedy)
        assert (b.response_ids == 9).all()
        sampler.sleep(level=1)
        assert torch.equal(sampler.generate(PROMPTS, greedy).response_ids, b.response_ids)  # woken, same weights
    finally:
        sampler.update_weights(original)  # the module's other tests expect the saved weights
    b = sampler.generate(PROMPTS, greedy)
    ref = full_forward_logp(original, b, 0.0)
    assert (b.logp_rollout.cpu() - ref)[b.response_mask.cpu().bool()].abs().mean() < 0.05


# --------------------------------------------------------------------------- TIS and the import error


def test_truncated_is_weights_hand_computed():
    f32 = dict(dtype=torch.float32)
    logp_old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]], **f32)
    logp_rollout = torch.tensor([[-1.0, -2.5, -2.0], [-2.0, -1.2, 0.0]], **f32)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], **f32)
    w = truncated_is_weights(logp_old, logp_rollout, mask, cap=2.0)
    want = torch.tensor([[1.0, math.exp(0.5), 2.0], [math.exp(-1.0), math.exp(0.2), 0.0]], **f32)
    torch.testing.assert_close(w, want, atol=1e-6, rtol=0)
    assert w.dtype == torch.float32 and not w.requires_grad
    # detached even when the inputs carry a gradient; huge ratios are capped without overflow
    lo = torch.tensor([[0.0, 500.0]], requires_grad=True, **f32)
    w = truncated_is_weights(lo, torch.tensor([[-1000.0, 0.0]], **f32), torch.ones(1, 2), cap=3.0)
    assert not w.requires_grad and torch.equal(w, torch.tensor([[3.0, 3.0]], **f32))
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(logp_old, logp_rollout, mask, cap=0.0)
    with pytest.raises(ValueError, match="shape"):
        truncated_is_weights(logp_old, logp_rollout[:, :2], mask)


def test_missing_vllm_gives_install_hint(monkeypatch, model_dir):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import fails even where vLLM is installed
    with pytest.raises(ImportError, match=r'pip install "cispo\[vllm\]" \(needs a CUDA GPU; see docs/install.md\)'):
        VLLMSampler(model_dir, eos_token_id=EOS, pad_token_id=PAD)


def test_lazy_export():
    import cispo.rollout

    assert cispo.rollout.VLLMSampler is VLLMSampler
    with pytest.raises(AttributeError):
        cispo.rollout.NoSuchThing  # noqa: B018
