"""Tests for cispo.models.lora: adapters injected into the Hugging Face model keep every interface the library
uses (policy_logprobs, samplers), only they train, they start as the identity, and merging them gives a
plain checkpoint that load_policy reloads with the same logits."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from cispo.foundations.experience import Experience  # noqa: E402
from cispo.models.loading import build_tokenizer, load_policy  # noqa: E402
from cispo.models.lora import (  # noqa: E402
    apply_lora,
    has_lora,
    lora_parameters,
    merge_and_save,
    merge_lora,
    merged_named_weights,
)
from cispo.models.policy import decoder, lm_head, policy_logprobs  # noqa: E402
from cispo.rollout import SamplingConfig, TorchSampler  # noqa: E402

EOS, PAD = 1, 0


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_llama(seed=0, tie=False):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def batch(B=3, P=4, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 20, (B, P + T), generator=g)
    attn = torch.ones(B, P + T, dtype=torch.long)
    attn[0, :2] = 0  # a left-padded prompt
    ids[0, :2] = PAD
    resp_mask = torch.ones(B, T)
    resp_mask[1, 3:] = 0  # a short response
    ids[1, P + 3:] = PAD
    attn[1, P + 3:] = 0
    return Experience(ids, attn, resp_mask, torch.zeros(B, T), torch.zeros(B))


def randomize_adapters(model, seed=1, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def test_only_lora_params_train_and_interfaces_resolve():
    model = apply_lora(tiny_llama(), rank=4, alpha=8)
    assert has_lora(model) and isinstance(model, transformers.LlamaForCausalLM)  # the HF object is kept
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora = {n for n, _ in lora_parameters(model)}
    assert trainable == lora and len(lora) == 2 * 7 * 2  # A and B, 7 linear layers per block, 2 blocks
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert isinstance(decoder(model), transformers.LlamaModel)  # base_model_prefix still resolves
    assert type(lm_head(model)) is torch.nn.Linear  # the output projection is not adapted


def test_initial_model_equals_base():
    base = tiny_llama()
    ids = torch.randint(2, 20, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(ids).logits
        model = apply_lora(base, rank=4, alpha=8)
        after = model(ids).logits
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_policy_logprobs_gradient_reaches_only_lora():
    model = apply_lora(tiny_llama(), rank=4, alpha=8, dropout=0.1)
    model.train()
    exp = batch()
    lp = policy_logprobs(model, exp, temperature=0.7)
    assert lp.shape == exp.response_mask.shape
    (lp * exp.response_mask).sum().backward()
    for name, p in model.named_parameters():
        if ".lora_" in name:
            assert p.grad is not None, name
        else:
            assert p.grad is None and not p.requires_grad, name
    # B starts at 0, so only the B matrices get a non-zero gradient on the first step
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".lora_B." in n)
    assert all(p.grad.abs().sum() == 0 for n, p in model.named_parameters() if ".lora_A." in n)


def test_optimizer_step_changes_only_adapters():
    model = apply_lora(tiny_llama(), rank=4, alpha=8)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    exp = batch()
    for _ in range(2):
        opt.zero_grad()
        (policy_logprobs(model, exp) * exp.response_mask).sum().neg().backward()
        opt.step()
    assert all(torch.equal(p, base_before[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if ".lora_B." in n)


def test_sampler_runs_on_a_lora_model():
    model = apply_lora(tiny_llama(), rank=4, alpha=8)
    randomize_adapters(model)
    b = TorchSampler(model, EOS, PAD).generate([[2, 3], [4]], SamplingConfig(max_new_tokens=5),
                                               torch.Generator().manual_seed(0))
    assert b.response_ids.shape[0] == 2


@pytest.mark.parametrize("tie", [False, True])
def test_merged_weights_match_merge_and_reload(tmp_path, tie):
    model = apply_lora(tiny_llama(tie=tie), rank=4, alpha=8)
    randomize_adapters(model)
    tok = build_tokenizer("abcdefghijklmnopq")  # 3 specials + 17 chars = the model's 20 ids
    assert len(tok) == 20
    path = merge_and_save(model, tok, tmp_path / "merged")
    assert any(path.glob("*.safetensors"))
    reloaded, tok2 = load_policy(path)
    assert not has_lora(reloaded) and tok2.eos_token_id == EOS
    ids = torch.randint(2, 20, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        got = reloaded(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (want - tiny_llama(tie=tie)(ids).logits).abs().max() > 1e-3  # the adapters did change the model
    # the weights pushed to a rollout engine are the saved ones, under the plain names
    merged = dict(merged_named_weights(model))
    plain = reloaded.state_dict()
    assert set(merged) == set(plain)
    for k in plain:
        torch.testing.assert_close(merged[k], plain[k], atol=1e-6, rtol=0)
    # and the LoRA model is untouched by merging
    assert has_lora(model) and any(".lora_B." in n for n, _ in model.named_parameters())


def test_merge_lora_gives_plain_trainable_model():
    model = apply_lora(tiny_llama(), rank=2, alpha=4, target_modules=["q_proj", "v_proj"])
    assert len(lora_parameters(model)) == 2 * 2 * 2
    plain = merge_lora(model)
    assert not has_lora(plain) and all(p.requires_grad for p in plain.parameters())
    assert not hasattr(plain, "peft_config")


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        apply_lora(tiny_llama(), rank=0)
    with pytest.raises(ValueError, match="dropout"):
        apply_lora(tiny_llama(), dropout=1.0)
    with pytest.raises(ValueError, match="lm_head"):
        apply_lora(tiny_llama(), target_modules=["q_proj", "lm_head"])
    model = apply_lora(tiny_llama())
    with pytest.raises(ValueError, match="already"):
        apply_lora(model)


def test_missing_peft_gives_install_hint(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r'pip install "cispo\[lora\]"'):
        apply_lora(tiny_llama())


def test_training_checkpoint_round_trip(tmp_path):
    """cispo.training.checkpoint saves the LoRA model as it is (adapter names included); a run resumed with the same
    LoRA set-up (apply_lora before load_checkpoint) gets its adapters and optimizer state back."""
    from cispo.training.checkpoint import Checkpoint, load_checkpoint, save_checkpoint

    tok = build_tokenizer("abcdefghijklmnopq")
    model = apply_lora(tiny_llama(), rank=4, alpha=8)
    randomize_adapters(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ckpt = save_checkpoint(tmp_path, 1, Checkpoint(model, tok, opt, {"step": 1}, {"g": torch.zeros(2)}))
    fresh = apply_lora(tiny_llama(), rank=4, alpha=8)
    opt2 = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
    state, _ = load_checkpoint(ckpt, fresh, opt2)
    assert state["step"] == 1
    want = model.state_dict()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_checkpoint_holds_merged_model_and_peft_adapter(tmp_path):
    """model/ is a plain checkpoint of the merged weights (load_policy: same logits as the LoRA model);
    adapter/ is peft's own format (PeftModel.from_pretrained on the base: same logits again)."""
    from peft import PeftModel

    from cispo.training.checkpoint import Checkpoint, save_checkpoint

    tok = build_tokenizer("abcdefghijklmnopq")
    model = apply_lora(tiny_llama(), rank=4, alpha=8)
    randomize_adapters(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ckpt = save_checkpoint(tmp_path, 1, Checkpoint(model, tok, opt, {"step": 1}, {}))
    ids = torch.tensor([[2, 5, 7, 9, 11]])
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        merged, _ = load_policy(ckpt / "model")
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        peft_model = PeftModel.from_pretrained(tiny_llama(), str(ckpt / "adapter")).eval()
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(tiny_llama()(input_ids=ids).logits, want, atol=1e-3)  # the adapters matter


def test_weights_that_do_not_match_the_config_are_an_error(tmp_path):
    """The old LoRA checkpoint: peft key names under a plain config. load_policy must refuse it rather
    than initialise the adapted layers at random."""
    model = apply_lora(tiny_llama(), rank=4, alpha=8)
    model.save_pretrained(tmp_path, safe_serialization=True)  # what save_checkpoint wrote before
    build_tokenizer("abc").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"do not match config\.json.*missing keys: model.*down_proj\.weight"):
        load_policy(tmp_path)


def test_resume_rejects_an_adapter_of_another_shape(tmp_path):
    from cispo.training.checkpoint import Checkpoint, load_checkpoint, save_checkpoint

    model = apply_lora(tiny_llama(), rank=4, alpha=8)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ckpt = save_checkpoint(tmp_path, 1, Checkpoint(model, build_tokenizer("abc"), opt, {"step": 1}, {}))
    other = apply_lora(tiny_llama(), rank=4, alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="adapter does not match"):
        load_checkpoint(ckpt, other, torch.optim.AdamW([p for p in other.parameters() if p.requires_grad]))


def test_a_lora_adapter_names_its_base_model(tmp_path):
    """adapter_config.json names the base model (was null), so peft's auto class loads base + adapter alone."""
    peft = pytest.importorskip("peft")
    from cispo.models.loading import load_policy
    from cispo.models.lora import apply_lora, lora_parameters, save_adapter, split_lora_state
    from cispo.models.packaged import save_tiny_smollm2

    base = save_tiny_smollm2(tmp_path / "base")
    model, _ = load_policy(base)
    model = apply_lora(model, rank=2, alpha=4)
    generator = torch.Generator().manual_seed(0)
    for _, p in lora_parameters(model):  # trained adapters: B is no longer zero
        p.data = 0.3 * torch.randn(p.shape, generator=generator)
    _, adapter = split_lora_state(model.state_dict(), model)
    save_adapter(model, adapter, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["task_type"]) == (str(base), "CAUSAL_LM")
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
