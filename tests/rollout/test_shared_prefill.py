"""Shared prefill: each distinct prompt of a batch is prefilled once and its G rows share its logits
and KV cache. The tokens and log-probs are those of one prefill row per batch row (the reference,
``share_prefill=False``) for the same generator state, in both decode loops; the prefill runs U rows."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cispo.rollout import SamplingConfig, TorchSampler  # noqa: E402
from cispo.rollout.torch_sampler import shared_rows  # noqa: E402

EOS, PAD = 1, 0
DISTINCT = [[2, 3, 4], [5], [6, 7, 8, 9, 10, 11, 12]]
GROUPED = [p for p in DISTINCT for _ in range(4)]  # G = 4 rows per prompt, as sample_groups lays them out

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=20, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                  pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_shared_rows_maps_each_row_to_its_prompts_first_row():
    first, copies = shared_rows([[1, 2], [3], [1, 2], [3], [4]])
    assert first.tolist() == [0, 1, 4] and copies.tolist() == [0, 1, 0, 1, 2]
    assert shared_rows([[1], [2]]) == (None, None)  # nothing shared: the plain prefill


@pytest.mark.parametrize("make, decode", [(llama, "static"), (llama, "hf"), (gpt2, "auto")])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.0, 1.0), (0.8, 0.9)])
def test_shared_prefill_gives_the_tokens_and_logps_of_one_row_each(make, decode, temperature, top_p):
    model = make()
    cfg = SamplingConfig(max_new_tokens=12, temperature=temperature, top_p=top_p)
    out = {}
    for share in (True, False):
        sampler = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD, decode=decode, share_prefill=share)
        out[share] = sampler.generate(GROUPED, cfg, torch.Generator().manual_seed(3))
    assert torch.equal(out[True].response_ids, out[False].response_ids)
    assert torch.equal(out[True].response_mask, out[False].response_mask)
    assert out[True].finish_reason == out[False].finish_reason
    torch.testing.assert_close(out[True].logp_rollout, out[False].logp_rollout, atol=1e-5, rtol=0)
    if temperature > 0:  # a group's rows are not copies of each other: each draws its own tokens
        assert not all(torch.equal(out[True].response_ids[0], out[True].response_ids[i]) for i in range(1, 4))


@pytest.mark.parametrize("share, rows", [(True, len(DISTINCT)), (False, len(GROUPED))])
def test_the_prefill_runs_each_distinct_prompt_once(monkeypatch, share, rows):
    model = llama()
    sampler = TorchSampler(model, eos_token_id=EOS, pad_token_id=PAD, decode="static", share_prefill=share)
    seen = []
    forward = model.forward

    def counting(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    sampler.generate(GROUPED, SamplingConfig(max_new_tokens=4), torch.Generator().manual_seed(0))
    assert seen[0] == (rows, max(len(p) for p in DISTINCT))  # the prefill: U rows (or B), the whole prompt
