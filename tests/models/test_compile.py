"""model.compile (cispo.models.compile): the compiled decoder computes what the eager one does, falls back
to eager when compiling fails, and seeded compiled runs reproduce themselves.

Compiling costs seconds to tens of seconds (inductor, C++), so only ``test_compiled_matches_eager``
compiles in the default run; the rest that compile are marked slow."""

import json

import pytest
import torch

import cispo.models.compile as compile_mod
from cispo.config.train import TrainConfig, apply_overrides
from cispo.data.tasks import arithmetic
from cispo.foundations.experience import Experience
from cispo.models.compile import CompiledDecoder, compile_cache_dir, compile_wanted, compiled_decoder
from cispo.models.loading import build_model, build_tokenizer
from cispo.models.policy import policy_logprobs
from cispo.training.runner import train
from tests.conftest import small_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(tok, B=5, P=6, T=7, seed=0):
    """Left-padded prompts of different lengths and responses with trailing padding.  [B, P+T]"""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tok), (B, P + T), generator=g)
    attention = torch.ones(B, P + T, dtype=torch.long)
    response_mask = torch.ones(B, T)
    for i in range(B):
        attention[i, : i % 3] = 0  # left padding of the prompt
        response_mask[i, T - (i % 4):] = 0  # a shorter response
    attention[:, P:] = response_mask.long()
    ids[attention == 0] = tok.pad_token_id
    return Experience(ids, attention, response_mask, torch.zeros(B, T), torch.randn(B, generator=g))


def _logp_and_grads(model, exp, body):
    model.zero_grad(set_to_none=True)
    logp = policy_logprobs(model, exp, body=body)  # [B, T]
    (logp * exp.response_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        logp_nograd = policy_logprobs(model, exp, body=body)
    return logp.detach(), logp_nograd, grads


def _float64_throughout(monkeypatch):
    """Llama's RMSNorm and rotary table in the model's dtype: Hugging Face computes both in float32
    even in a float64 model, where inductor's float32 rsqrt / sin / cos differ from eager's by an ulp
    (log-probs then differ by ~3e-8). Without those casts the compiled decoder agrees with the eager
    one to ~1e-15."""
    from transformers.models.llama import modeling_llama as llama

    def rms_norm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(device=x.device, dtype=x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    monkeypatch.setattr(llama.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(llama.LlamaRotaryEmbedding, "forward", rotary)


def _check_compiled_matches_eager(dtype, tol):
    """Log-probs (with and without gradients) and every parameter's gradient of the compiled decoder
    within ``tol`` of the eager ones, on two batch shapes (the dynamic graph is reused, not rebuilt)."""
    tok = build_tokenizer(arithmetic.ALPHABET)
    model = build_model(tok, size="tiny", seed=0).to(dtype)
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.to(dtype)
    model.train()
    body = compiled_decoder(model, tok.pad_token_id)
    assert isinstance(body, CompiledDecoder) and body.failed is None
    for shape in ((5, 6, 7), (3, 4, 9), (1, 5, 5)):  # one row: run eager, not recompiled
        exp = _batch(tok, *shape)
        exp.response_mask = exp.response_mask.to(dtype)
        eager = _logp_and_grads(model, exp, None)
        compiled = _logp_and_grads(model, exp, body)
        mask = exp.response_mask.bool()
        assert (compiled[0] - eager[0])[mask].abs().max() <= tol
        assert (compiled[1] - eager[1])[mask].abs().max() <= tol
        for name, g in eager[2].items():
            assert (compiled[2][name] - g).abs().max() <= tol * max(1.0, float(g.abs().max())), name
    assert body.failed is None  # no fallback happened along the way
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    _logp_and_grads(model, _batch(tok, 4, 7, 3), body)  # other shapes again: no new graph
    _logp_and_grads(model, _batch(tok, 1, 3, 4), body)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames


def test_compiled_matches_eager_float32():
    """float32, the model as Hugging Face writes it: equal up to float32 rounding (found ~1e-7)."""
    _check_compiled_matches_eager(torch.float32, 1e-5)


@pytest.mark.slow
def test_compiled_matches_eager_float64(monkeypatch):
    """float64 with RMSNorm and the rotary table in float64 (``_float64_throughout``): equal to
    1e-12 (found ~1e-15: inductor fuses and reorders sums). As Hugging Face writes them (float32
    inside), the two differ by ~3e-8 in log-probs."""
    _float64_throughout(monkeypatch)
    _check_compiled_matches_eager(torch.float64, 1e-12)


def test_compile_failure_falls_back_to_eager(monkeypatch, capsys):
    """A compile that fails (here: the backend raises) gives one warning and the eager decoder (None),
    and a compiled wrapper whose compile fails later runs eager from then on."""
    tok = build_tokenizer(arithmetic.ALPHABET)
    model = build_model(tok, size="tiny", seed=0)

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real_compile(m, backend=broken_backend, **kw))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert compiled_decoder(model, tok.pad_token_id) is None
    err = capsys.readouterr().err
    assert err.count("model.compile: torch.compile failed") == 1 and "no compiler here" in err
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())

    wrapped = CompiledDecoder(model.model)
    exp = _batch(tok)
    logp = policy_logprobs(model, exp, body=wrapped)
    assert wrapped.failed is not None and torch.equal(logp, policy_logprobs(model, exp))
    assert capsys.readouterr().err.count("warning") == 1


def test_no_compiler_runs_eager(monkeypatch, capsys):
    monkeypatch.setattr(compile_mod, "has_cxx_compiler", lambda: False)
    tok = build_tokenizer(arithmetic.ALPHABET)
    assert compiled_decoder(build_model(tok, size="tiny", seed=0), tok.pad_token_id) is None
    assert "no C++ compiler" in capsys.readouterr().err


def test_compile_rule_and_config():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_wanted("on", cpu) and compile_wanted("on", cuda)
    assert not compile_wanted("off", cpu) and not compile_wanted("on", cpu, sharded=True)
    assert not compile_wanted("auto", cuda)  # not measured on a GPU
    assert not compile_wanted("auto", cpu, steps=compile_mod.AUTO_MIN_STEPS - 1)
    assert compile_wanted("auto", cpu, steps=compile_mod.AUTO_MIN_STEPS) == compile_mod.has_cxx_compiler()
    assert TrainConfig().model.compile == "auto"
    with pytest.raises(ValueError, match="model.compile"):
        apply_overrides(TrainConfig(), ["model.compile=on", "model.fsdp=true"])
    with pytest.raises(Exception, match="model.compile"):
        apply_overrides(TrainConfig(), ["model.compile=sometimes"])


def test_cache_dir_under_cispo_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    monkeypatch.setenv("CISPO_CACHE", str(tmp_path))
    assert compile_cache_dir() == str(tmp_path / "torch-compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache_dir() == str(tmp_path / "mine")


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "time/"))} for r in rows]


@pytest.mark.slow
def test_seeded_compiled_runs_reproduce(tiny_model, tmp_path, dense_task, monkeypatch):
    """Two compiled runs with the same seed log the same metrics; a compiled run stays within
    float32 rounding of the eager one (not bit-equal: inductor fuses operations)."""
    built = []
    real = compile_mod.compiled_decoder
    monkeypatch.setattr(compile_mod, "compiled_decoder", lambda *a: built.append(real(*a)) or built[-1])
    runs = []
    for name, mode in (("a", "on"), ("b", "on"), ("eager", "off")):
        cfg = small_config(tiny_model, tmp_path, f"run_name={name}", f"model.compile={mode}", "steps=2",
                           "eval.every=0", "checkpoint_every=0")
        runs.append(_comparable(_metrics(train(cfg).run_dir)))
    assert len(built) == 2 and all(isinstance(b, CompiledDecoder) and b.failed is None for b in built)
    assert runs[0] == runs[1]
    for a, e in zip(runs[0], runs[2]):
        for k, v in e.items():
            if isinstance(v, float) and v == v and k.startswith("objective/") and "ratio" not in k:
                assert abs(a[k] - v) <= 1e-4 * max(1.0, abs(v)), k


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("model.gradient_checkpointing=true",), ("model.lora_rank=4",)],
                         ids=["gradient checkpointing", "LoRA"])
def test_compiled_run_with(tiny_model, tmp_path, dense_task, monkeypatch, capsys, extra):
    """model.compile=on next to gradient checkpointing or LoRA adapters: the run completes compiled
    (no fallback warning), its losses within float32 rounding of the eager run's."""
    if "model.lora_rank=4" in extra:
        pytest.importorskip("peft")
    runs = []
    for name, mode in (("c", "on"), ("e", "off")):
        cfg = small_config(tiny_model, tmp_path, f"run_name={name}", f"model.compile={mode}", "steps=2",
                           "eval.every=0", "checkpoint_every=0", *extra)
        runs.append([r for r in _metrics(train(cfg).run_dir) if "objective/loss" in r])
    assert "model.compile: torch.compile failed" not in capsys.readouterr().err
    for c, e in zip(*runs):
        assert abs(c["objective/loss"] - e["objective/loss"]) <= 1e-4 * max(1.0, abs(e["objective/loss"]))


@pytest.mark.parametrize("mode", ["on", "off"])
def test_sampler_compiles_its_step_with_the_trainer(tiny_model, tmp_path, monkeypatch, mode):
    """model.compile decides for the sampler's decode step as for the trainer's passes."""
    import cispo.training.run_policy as run_policy
    from cispo.data.tasks import get_task

    monkeypatch.setattr(run_policy, "train_body", lambda *a, **k: None)  # not the trainer's compile here
    cfg = small_config(tiny_model, tmp_path, f"model.compile={mode}")
    policy = run_policy.load_policy_for(cfg, get_task(cfg.data.task), torch.device("cpu"))
    assert policy.sampler.compile_step == (mode == "on")
