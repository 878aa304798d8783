"""The lean decode loop (cispo.rollout.static_cache) against the forward path's sampler.

``TorchSampler(decode="static")`` must give the tokens of ``decode="hf"`` (the model's forward with
its DynamicCache) under the same seed, and their log-probs within float32 rounding: ragged prompts,
EOS in the middle of the batch (rows dropped from the compute batch), temperature / top-p / greedy,
the FP32 head or the model's own, float32 and float64, grouped-query attention, Llama / Qwen2 /
Mistral; the built-in model; other architectures fall back to the forward path.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cispo.rollout import (  # noqa: E402
    SamplingConfig,
    TorchSampler,
    static_cache,  # noqa: E402
)
from cispo.rollout.static_cache import StaticDecoder, unsupported_reason  # noqa: E402
from cispo.rollout.torch_sampler import _multinomial, inverse_cdf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

EOS, PAD, V = 1, 0, 24
PROMPTS = [[2, 3, 4], [5], [6, 7, 8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 2, 3, 4, 5], [7], [8, 9]] * 2
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS,
             bos_token_id=None)
ARCHS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)),  # q/k/v biases
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=None)),
}
CONFIGS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=0.0),
           dict(temperature=0.9, top_k=6, min_p=0.02, repetition_penalty=1.4)]  # the penalty's rows as rows stop


def build(name, dtype=torch.float32):
    torch.manual_seed(0)
    model = ARCHS[name]().to(dtype).eval()
    with torch.no_grad():  # make EOS likely, so that rows stop at different steps
        model.get_output_embeddings().weight[EOS].mul_(0.0).add_(model.get_output_embeddings().weight[2] * 0.5)
    return model


def both(model, cfg, fp32_head=False, prompts=PROMPTS, seed=0):
    out = {}
    for mode in ("hf", "static"):
        s = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD, fp32_head=fp32_head, decode=mode)
        out[mode] = s.generate(prompts, cfg, torch.Generator().manual_seed(seed))
    return out["hf"], out["static"]


def assert_same(a, b, atol):
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert a.finish_reason == b.finish_reason
    torch.testing.assert_close(b.logp_rollout, a.logp_rollout, atol=atol, rtol=0)


@pytest.fixture
def compactions(monkeypatch):
    """Counts how often the static decoder dropped stopped rows."""
    calls = []
    original = StaticDecoder._compact

    def spy(self, keep):
        calls.append(len(keep))
        original(self, keep)

    monkeypatch.setattr(StaticDecoder, "_compact", spy)
    return calls


def test_inverse_cdf_picks_the_interval_that_holds_u():
    p = torch.tensor([[0.5, 0.0, 0.25, 0.25]] * 7)
    u = torch.tensor([0.0, 0.49, 0.5, 0.74, 0.75, 0.999, 1 - 2 ** -53], dtype=torch.float64)
    assert inverse_cdf(p, u).tolist() == [0, 0, 2, 2, 3, 3, 3]  # token 1 (probability 0) never
    q = torch.tensor([[0.0, 0.0, 1e-12, 1 - 1e-12, 0.0]] * 3, dtype=torch.float64)
    u = torch.tensor([0.0, 5e-13, 2e-12], dtype=torch.float64)
    assert inverse_cdf(q, u).tolist() == [2, 2, 3]  # a 1e-12 token keeps its own interval; the trailing 0 never
    unnormalised = torch.tensor([[2.0, 6.0]] * 2)
    assert inverse_cdf(unnormalised, torch.tensor([0.24, 0.26], dtype=torch.float64)).tolist() == [0, 1]


def test_multinomial_draws_from_probs():
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    n = 200_000
    draws = _multinomial(p.expand(n, 5), torch.Generator().manual_seed(1))
    freq = torch.bincount(draws, minlength=5).double() / n
    sd = (p.double() * (1 - p.double()) / n).sqrt()
    assert freq[1] == 0 and ((freq - p.double()).abs() <= 5 * sd + 1e-12).all(), freq


def test_multinomial_of_a_sub_batch_takes_the_whole_batch_draw():
    p = torch.rand(6, 40)
    p = p / p.sum(-1, keepdim=True)
    rows = torch.tensor([1, 4, 5])
    g_full, g_sub = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    full = _multinomial(p, g_full)
    sub = _multinomial(p[rows], g_sub, rows, 6)
    assert torch.equal(sub, full[rows]) and torch.equal(g_full.get_state(), g_sub.get_state())


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("fp32_head", [False, True])
def test_static_equals_forward_path(arch, fp32_head, compactions):
    model = build(arch)
    assert unsupported_reason(model) is None
    ragged = []
    for kw in CONFIGS:
        a, b = both(model, SamplingConfig(max_new_tokens=12, **kw), fp32_head=fp32_head)
        assert_same(a, b, atol=1e-5)
        ragged.append("eos" in a.finish_reason and a.response_lengths.min() < a.response_lengths.max())
    assert ragged[0], "EOS must stop rows mid-batch"
    assert compactions, "stopped rows were never dropped from the compute batch"


@pytest.mark.parametrize("fp32_head", [False, True])
def test_static_equals_forward_path_in_float64(fp32_head):
    model = build("llama", torch.float64)
    for kw in CONFIGS:
        a, b = both(model, SamplingConfig(max_new_tokens=12, **kw), fp32_head=fp32_head)
        # logp_rollout is stored in float32: equal up to that rounding of float64 values
        assert_same(a, b, atol=3e-7)


def test_builtin_model(compactions):
    from cispo.data.tasks import get_task
    from cispo.models.loading import build_model, build_tokenizer

    task = get_task("addition")
    tok = build_tokenizer(task.alphabet)
    model = build_model(tok, size="tiny", seed=0).eval()
    prompts = [tok.encode(s["prompt"]) for s in task.train_samples(0, 16)]
    for kw in CONFIGS:
        cfg = SamplingConfig(max_new_tokens=16, repetition_stop_tokens=4, **kw)
        runs = {}
        for mode in ("hf", "static"):
            s = TorchSampler(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, decode=mode)
            runs[mode] = s.generate(prompts, cfg, torch.Generator().manual_seed(5))
        assert_same(runs["hf"], runs["static"], atol=1e-5)


def test_autocast_bf16_matches():
    model = build("llama")
    cfg = SamplingConfig(max_new_tokens=10, temperature=1.0)
    out = {}
    for mode in ("hf", "static"):
        s = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD, autocast=torch.bfloat16, fp32_head=True,
                         decode=mode)
        out[mode] = s.generate(PROMPTS, cfg, torch.Generator().manual_seed(0))
    assert_same(out["hf"], out["static"], atol=1e-5)


def test_auto_uses_static_only_where_supported(monkeypatch):
    built = []
    monkeypatch.setattr(static_cache.StaticDecoder, "__init__",
                        lambda self, *a, **k: built.append(1) or StaticDecoder_init(self, *a, **k))
    llama = TorchSampler(build("llama"), eos_token_id=EOS, pad_token_id=PAD)
    llama.generate(PROMPTS[:3], SamplingConfig(max_new_tokens=4), torch.Generator().manual_seed(0))
    assert built
    built.clear()
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2,
                                                                n_positions=64)).eval()
    assert "model_type" in unsupported_reason(gpt2)
    TorchSampler(gpt2, eos_token_id=EOS, pad_token_id=PAD).generate(
        PROMPTS[:3], SamplingConfig(max_new_tokens=4), torch.Generator().manual_seed(0))
    assert not built
    with pytest.raises(ValueError, match="decode='static'.*GPT2LMHeadModel.*model_type"):
        TorchSampler(gpt2, eos_token_id=EOS, pad_token_id=PAD, decode="static")


StaticDecoder_init = StaticDecoder.__init__


def test_unsupported_configs_and_bad_mode():
    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="eager"))
    assert "sdpa" in unsupported_reason(eager)
    window = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=16))
    assert unsupported_reason(window, total_len=16) is None
    assert "sliding window" in unsupported_reason(window, total_len=17)
    s = TorchSampler(window, eos_token_id=EOS, pad_token_id=PAD, decode="static")
    with pytest.raises(ValueError, match="sliding window"):
        s.generate([[2] * 10], SamplingConfig(max_new_tokens=8))
    with pytest.raises(ValueError, match="decode must be one of"):
        TorchSampler(build("llama"), eos_token_id=EOS, pad_token_id=PAD, decode="fast")


def test_lora_adapters_are_applied():
    pytest.importorskip("peft")
    from cispo.models.lora import apply_lora

    model = apply_lora(build("llama"), rank=4, alpha=8)
    with torch.no_grad():  # non-zero adapters (LoRA B starts at 0, which would hide a skipped adapter)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    assert unsupported_reason(model) is None
    a, b = both(model, SamplingConfig(max_new_tokens=10, temperature=1.0))
    assert_same(a, b, atol=1e-5)


def test_matmul_attention_is_sdpa():
    """The compiled step's attention in plain matmuls = Hugging Face's SDPA function, with grouped
    query heads and a padding mask, and without a mask."""
    from transformers.models.llama import modeling_llama as llama

    sdpa = llama.ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", llama.eager_attention_forward)
    attn = build("llama").model.layers[0].self_attn  # 4 query heads, 2 kv heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, s, 8, generator=g) for h, s in ((4, 1), (2, 9), (2, 9)))
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :4], mask[2, ..., :1] = False, False  # left padding
    for m in (mask, None):
        want, _ = sdpa(attn, q, k, v, m, dropout=0.0, scaling=0.3)
        got, _ = static_cache.matmul_attention(attn, q, k, v, m, scaling=0.3)
        assert got.shape == want.shape == (3, 1, 4, 8)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def compiled_sampler(model, **kw):
    return TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD, decode="static", compile_step=True, **kw)


def spy_on_compiled(sampler) -> list[int]:
    """Give `sampler` a fresh compiled layer stack; returns the list that gets the batch size of
    every call that ran compiled (not eager)."""
    from cispo.models.compile import CompiledLayerStack

    stack = sampler._layer_stack = CompiledLayerStack(static_cache.layer_stack, static_cache.matmul_attention)
    rows, run_compiled = [], stack.compiled
    stack.compiled = lambda *a, **k: rows.append(a[3].shape[0]) or run_compiled(*a, **k)
    return rows


def test_compiled_step_matches_eager(compactions):
    """``compile_step=True`` (model.compile): the layer stack compiled once, reused for other batch
    sizes, response columns, padded or not and rows dropped; tokens equal to the eager static
    decode's and log-probs within float32 rounding. A one-row batch runs eager."""
    from torch._dynamo.utils import counters

    model = build("llama")  # grouped-query attention
    compiled = compiled_sampler(model)
    rows = spy_on_compiled(compiled)  # the batch size of every call that ran compiled
    stack = compiled._layer_stack
    eager = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD, decode="static")
    for i, (prompts, kw) in enumerate([(PROMPTS, CONFIGS[0]), (PROMPTS[:5], CONFIGS[1]),
                                       ([[2, 3, 4]] * 6, CONFIGS[2]), (PROMPTS[:1], CONFIGS[0])]):
        cfg = SamplingConfig(max_new_tokens=12, **kw)
        want = eager.generate(prompts, cfg, torch.Generator().manual_seed(i))
        before = len(rows)
        got = compiled.generate(prompts, cfg, torch.Generator().manual_seed(i))
        assert stack.failed is None and compiled._layer_stack is stack
        assert_same(want, got, atol=1e-5)
        assert (len(rows) > before) == (len(prompts) > 1), "only a one-row batch runs eager"
        if i == 0:
            graphs = counters["stats"]["unique_graphs"]
            assert "eos" in got.finish_reason and compactions, "rows must stop and be dropped mid-batch"
    assert len(set(rows)) > 2, "several compute-batch sizes ran compiled"
    assert counters["stats"]["unique_graphs"] == graphs, "the compiled step was rebuilt"


def test_compiled_step_falls_back_to_eager(monkeypatch, capsys):
    """A compile that fails gives one warning and then the eager static decode, exactly."""
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real_compile(m, backend=broken_backend, **kw))
    model = build("llama")
    cfg = SamplingConfig(max_new_tokens=8)
    s = compiled_sampler(model)
    for seed in (0, 1):
        got = s.generate(PROMPTS, cfg, torch.Generator().manual_seed(seed))
        want = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD).generate(
            PROMPTS, cfg, torch.Generator().manual_seed(seed))
        assert_same(want, got, atol=0)
    assert "no compiler here" in s._layer_stack.failed
    assert capsys.readouterr().err.count("compiling the decode step failed") == 1


def test_compiled_step_under_bf16_autocast():
    """Mixed precision (``model.dtype=bf16`` keeps FP32 weights and samples under autocast): the
    compiled step under autocast gives the eager bf16 step's tokens, and log-probs within bf16
    rounding of its (the fused kernels round intermediates at other points; the bound is twice
    the eager bf16 step's own distance from FP32)."""
    model = build("llama")
    cfg = SamplingConfig(max_new_tokens=10, temperature=1.0)
    kw = dict(autocast=torch.bfloat16, fp32_head=True)
    eager = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD, decode="static", **kw)
    fp32 = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD, decode="static")
    compiled = compiled_sampler(model, **kw)
    rows = spy_on_compiled(compiled)
    for seed in (0, 1):
        want = eager.generate(PROMPTS, cfg, torch.Generator().manual_seed(seed))
        before = len(rows)
        got = compiled.generate(PROMPTS, cfg, torch.Generator().manual_seed(seed))
        exact = fp32.generate(PROMPTS, cfg, torch.Generator().manual_seed(seed))
        assert compiled._layer_stack.failed is None and len(rows) > before, "the step ran compiled"
        same = want.response_mask.bool() & exact.response_mask.bool() & (want.response_ids == exact.response_ids)
        m = same.long().cumprod(dim=1).bool()  # [B, T] up to each row's first token that differs from FP32's
        bf16_error = (want.logp_rollout - exact.logp_rollout)[m].abs().max().item()
        assert m.float().mean() > 0.5 and bf16_error > 1e-5, "bf16 must round, on mostly equal tokens"
        assert_same(want, got, atol=2 * bf16_error)


# SmolLM2-135M-Instruct's config.json as cispo.models.packaged converts it (builtin:smollm2-135m), with 2 of its
# 30 layers and a 24-token vocabulary: 9 query heads over 3 key/value heads of 64, tied embeddings,
# rope theta 1e5 (the real model's sampling must take the static-cache decode, the fast one).
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192,
                     rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, hidden_act="silu",
                     num_hidden_layers=2, vocab_size=V, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)


def test_smollm2_shape_takes_the_static_decode(monkeypatch):
    """``decode="auto"`` (the default) decodes a Llama of SmolLM2's shape with the static cache, with the
    forward path's tokens and log-probs."""
    built = []
    monkeypatch.setattr(static_cache.StaticDecoder, "__init__",
                        lambda self, *a, **k: built.append(1) or StaticDecoder_init(self, *a, **k))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_SHAPE)).eval()
    assert model.config.model_type == "llama" and unsupported_reason(model) is None
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0)
    auto = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD).generate(PROMPTS, cfg,
                                                                            torch.Generator().manual_seed(0))
    assert built, "decode='auto' did not take the static-cache decode"
    a, b = both(model, cfg)
    assert_same(a, b, atol=1e-5)
    assert_same(auto, b, atol=0)
