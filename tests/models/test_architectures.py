"""One definition of the policy's distribution for every architecture.

Tiny random models of several Hugging Face architectures, built from configs: the trainer's
chunked-head log-probs (``cispo.models.policy.policy_logprobs``) and the sampler's must equal
``log_softmax(model(...).logits / temperature)`` in eval mode, including each model's own
logit post-processing (Gemma's soft cap, Cohere's ``logit_scale``, Granite's ``logits_scaling``).
The measured agreement is reported in docs/real-models.md (run with ``-s`` to print it).
"""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from cispo.foundations.experience import Completion, collate  # noqa: E402
from cispo.models.policy import policy_logprobs  # noqa: E402
from cispo.objective.logprobs import LogitTransform, logit_transform  # noqa: E402
from cispo.rollout import SamplingConfig, TorchSampler  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

V, EOS, PAD = 64, 1, 0
SMALL = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)


def _gemma(cls_cfg, cls_model, **kw):
    return lambda: cls_model(cls_cfg(**SMALL, head_dim=8, **kw))


ARCHS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)),
    # a binding soft cap: the cap (2) is well inside the logits' range (the head is scaled up below)
    "gemma2": _gemma(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, final_logit_softcapping=2.0,
                     attn_logit_softcapping=50.0, query_pre_attn_scalar=8),
    "gemma3": _gemma(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, final_logit_softcapping=2.0,
                     query_pre_attn_scalar=8),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=64, pad_token_id=PAD, eos_token_id=EOS,
        bos_token_id=EOS)),
    "cohere": lambda: transformers.CohereForCausalLM(transformers.CohereConfig(**SMALL, logit_scale=0.25)),
    "granite": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(**SMALL, logits_scaling=4.0)),
}
EXPECTED_TRANSFORM = {"gemma2": LogitTransform(softcap=2.0), "gemma3": LogitTransform(softcap=2.0),
                      "cohere": LogitTransform(scale=0.25), "granite": LogitTransform(scale=0.25)}
TEMPERATURE = 0.7
PROMPTS = [[2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13]]


def build(name):
    torch.manual_seed(0)
    model = ARCHS[name]().eval()
    with torch.no_grad():  # large logits, so that the soft cap (and any scaling) matters
        model.get_output_embeddings().weight.mul_(20.0)
    return model


def reference_logp(model, exp, temperature):
    """log_softmax(model(...).logits / T) of the response tokens, one plain forward."""
    T = exp.response_mask.shape[1]
    P = exp.input_ids.shape[1] - T
    pos = (exp.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=pos).logits
    logp = F.log_softmax(logits[:, P - 1 : -1].float() / temperature, -1)  # [B, T, V]
    return logp.gather(-1, exp.response_ids[..., None]).squeeze(-1) * exp.response_mask


def agreement(name, fp32_head=False):
    """(max |trainer - reference|, max |sampler - reference|, max |reference without the model's
    post-processing - reference|) in nats over the sampled response tokens. ``fp32_head``: the
    sampler computes its logits with the trainer's head instead of ``model(...).logits``."""
    model = build(name)
    sampler = TorchSampler(model, EOS, PAD, fp32_head=fp32_head)
    batch = sampler.generate(PROMPTS, SamplingConfig(max_new_tokens=8, temperature=TEMPERATURE),
                             torch.Generator().manual_seed(0))
    lengths = batch.response_lengths.tolist()
    completions = [Completion({}, p, batch.response_ids[i, : lengths[i]], batch.logp_rollout[i, : lengths[i]],
                              batch.finish_reason[i], "") for i, p in enumerate(PROMPTS)]
    exp = collate(completions, torch.zeros(len(PROMPTS)), PAD)
    ref = reference_logp(model, exp, TEMPERATURE)
    with torch.no_grad():
        trainer = policy_logprobs(model, exp, TEMPERATURE) * exp.response_mask
        model.config.final_logit_softcapping = None  # what the trainer computed before: no post-processing
        for attr in ("logit_scale", "logits_scaling"):
            if hasattr(model.config, attr):
                setattr(model.config, attr, 1.0)
        plain = policy_logprobs(model, exp, TEMPERATURE) * exp.response_mask
    return (float((trainer - ref).abs().max()), float((exp.logp_rollout - ref).abs().max()),
            float((plain - ref).abs().max()))


@pytest.mark.parametrize("fp32_head", [True, False], ids=["sampler_fp32_head", "sampler_model_logits"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_trainer_and_sampler_logprobs_are_the_models_distribution(name, fp32_head):
    model = build(name)
    assert logit_transform(model.config) == EXPECTED_TRANSFORM.get(name, LogitTransform())
    trainer_err, sampler_err, without_transform = agreement(name, fp32_head)
    print(f"\n{name}: max |trainer - ref| = {trainer_err:.1e}, max |sampler - ref| = {sampler_err:.1e}, "
          f"without post-processing {without_transform:.2f} nats")
    assert trainer_err < 1e-4
    assert sampler_err < 1e-4
    if name in EXPECTED_TRANSFORM:  # the post-processing matters here: skipping it is caught
        assert without_transform > 0.05


def test_gemma2_softcap_gradient_matches_autograd():
    """The chunked head's backward through the soft cap equals autograd of the model's logits."""
    model = build("gemma2").double()
    ids = torch.tensor([[2, 3, 4, 5, 6, 7]])
    exp = collate([Completion({}, [2, 3], ids[0, 2:], torch.zeros(4), "length", "")], torch.ones(1), PAD)
    logp = policy_logprobs(model, exp, TEMPERATURE, chunk_size=2)
    (g_ours,) = torch.autograd.grad(logp.sum(), model.get_output_embeddings().weight)
    pos = (exp.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=pos).logits
    ref = F.log_softmax(logits[:, 1:-1] / TEMPERATURE, -1).gather(-1, exp.response_ids[..., None]).sum()
    (g_ref,) = torch.autograd.grad(ref, model.get_output_embeddings().weight)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-8, atol=1e-10)


def test_chunked_head_with_transform_matches_naive_in_float64():
    """Log-probs, entropies and their gradients through scale + soft cap, chunked vs full."""
    from cispo.objective.logprobs import naive_token_logprobs, token_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 7, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = (3 * torch.randn(V, 8, dtype=torch.float64, generator=g)).requires_grad_()
    b = torch.randn(V, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, V, (5, 7), generator=g)
    t = LogitTransform(scale=0.5, softcap=1.5)
    outs = []
    for fn, kw in ((token_logprobs, {"chunk_size": 3}), (naive_token_logprobs, {})):
        logp, ent = fn(h, w, y, bias=b, temperature=0.7, with_entropy=True, transform=t, **kw)
        grads = torch.autograd.grad((logp * 1.3).sum() + (ent * 0.4).sum(), (h, w, b))
        outs.append((logp, ent, *grads))
    for ours, ref in zip(*outs):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_an_unknown_logit_post_processing_is_refused_at_load(monkeypatch):
    """load_policy_for compares the chunked head with the model's own logits once: a model whose
    post-processing logit_transform does not know (simulated: Cohere with the transform forgotten)
    is an error, not training on the wrong log-probs."""
    import cispo.models.policy
    from cispo.training.run_policy import check_head

    model = build("cohere").train()
    check_head(model, "cohere")  # known: passes, and leaves the model in train mode
    assert model.training
    monkeypatch.setattr(cispo.models.policy, "logit_transform", lambda config: LogitTransform())
    with pytest.raises(ValueError, match="post-processes its logits"):
        check_head(model, "cohere")


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_bf16_mixed_precision_sampler_and_trainer_agree(name):
    """Under bf16 autocast both compute the head in FP32 from the same hidden states: the sampler's
    log-probs are the trainer's (the model's own bf16 head would differ by ~1e-2 nats)."""
    model = build(name)
    sampler = TorchSampler(model, EOS, PAD, autocast=torch.bfloat16, fp32_head=True)
    batch = sampler.generate(PROMPTS, SamplingConfig(max_new_tokens=8, temperature=TEMPERATURE),
                             torch.Generator().manual_seed(0))
    lengths = batch.response_lengths.tolist()
    exp = collate([Completion({}, p, batch.response_ids[i, : lengths[i]], batch.logp_rollout[i, : lengths[i]],
                               batch.finish_reason[i], "") for i, p in enumerate(PROMPTS)], torch.zeros(3), PAD)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        trainer = policy_logprobs(model, exp, TEMPERATURE) * exp.response_mask
    assert float((trainer - exp.logp_rollout).abs().max()) < 1e-4
