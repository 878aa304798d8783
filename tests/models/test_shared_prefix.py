"""Shared-prefix forward: the training forward with each prompt run once for the rows that share it. Its
log-probs and the gradient of the objective through them equal the plain forward's to float32 rounding
(tiny Llama and Qwen2, with LoRA, with the FP32 head and without); a model it does not cover says why."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cispo.foundations.experience import Completion, collate  # noqa: E402
from cispo.models.policy import policy_logprobs  # noqa: E402
from cispo.models.shared_prefix import shared_prompts, unsupported_reason  # noqa: E402
from cispo.objective.loss import policy_loss  # noqa: E402
from cispo.objective.presets import preset  # noqa: E402

PAD, EOS = 0, 1
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS,
                  bos_token_id=None)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).float()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).float()


def grouped_batch(G: int = 3, seed: int = 0):
    """Two prompts (one shorter: left-padded) x G responses of different lengths, plus one lone prompt."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    completions = []
    for k, prompt in enumerate(prompts):
        for _i in range(G if k < 2 else 1):
            n = int(torch.randint(1, 7, (1,), generator=g))
            ids = torch.randint(2, 40, (n,), generator=g)
            completions.append(Completion({"prompt": ""}, prompt, ids, torch.zeros(n), "eos", ""))
    advantages = torch.randn(len(completions), generator=g)
    return collate(completions, advantages, PAD)


def loss_grads(model, exp, share: bool, fp32_head: bool):
    model.zero_grad(set_to_none=True)
    logp = policy_logprobs(model, exp, 1.0, fp32_head, share_prompts=share)  # [B, T]
    old = (logp.detach() + 0.3 * torch.sin(torch.arange(logp.numel()).reshape(logp.shape))) * exp.response_mask
    loss, _ = policy_loss(logp, old, exp.advantages, exp.response_mask, preset("cispo"))
    loss.backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def share_every_call(monkeypatch):
    """Share wherever rows share a prompt (the default shares only where it saves a quarter of a call)."""
    import cispo.models.shared_prefix as shared_prefix

    monkeypatch.setattr(shared_prefix, "MIN_SAVING", 0.0)


def test_rows_sharing_a_prompt_are_found():
    exp = grouped_batch()
    first, copies = shared_prompts(exp)
    assert len(first) == 3 and copies.tolist() == [copies[0]] * 3 + [copies[3]] * 3 + [copies[6]]
    assert all(int(copies[f]) == u for u, f in enumerate(first.tolist()))  # first[u] is a row of prompt u


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("fp32_head", [True, False])
@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompts_give_the_plain_forwards_logps_and_gradient(kind, fp32_head, lora):
    model = tiny(kind)
    if lora:
        from cispo.models.lora import apply_lora, lora_parameters

        pytest.importorskip("peft")
        model = apply_lora(model, rank=4, alpha=8)
        with torch.no_grad():
            for _, p in lora_parameters(model):
                p.normal_(0, 0.3)
    model.train()
    exp = grouped_batch()
    assert unsupported_reason(model) is None
    lp_plain, g_plain = loss_grads(model, exp, False, fp32_head)
    lp_shared, g_shared = loss_grads(model, exp, True, fp32_head)
    torch.testing.assert_close(lp_shared, lp_plain, atol=2e-6, rtol=0)
    assert g_plain.keys() == g_shared.keys() and g_plain
    for name, g in g_plain.items():
        torch.testing.assert_close(g_shared[name], g, atol=1e-6, rtol=1e-4, msg=name)
    assert max(g.abs().max() for g in g_plain.values()) > 1e-3  # a gradient worth comparing


def test_a_model_it_does_not_cover_says_why():
    cfg = transformers.GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    assert "gpt2" in unsupported_reason(transformers.GPT2LMHeadModel(cfg))


def test_a_call_shares_only_where_it_saves_a_quarter_of_its_positions():
    """G = 4 rows of one prompt of P tokens with responses of T: saves 3P of 4(P + T - 1)."""
    def exp(P, T):
        rows = [Completion({"prompt": ""}, list(range(2, 2 + P)), torch.full((T,), 5), torch.zeros(T), "eos", "")
                for _ in range(4)]
        return collate(rows, torch.zeros(4), PAD)

    assert shared_prompts(exp(62, 64), min_saving=0.25) is not None  # SmolLM2's chat prompts: 37 % saved
    assert shared_prompts(exp(6, 34), min_saving=0.25) is None  # the built-in addition task: 11 %
    assert shared_prompts(exp(6, 34), min_saving=0.0) is not None

