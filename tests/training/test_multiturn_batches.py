"""Multi-turn batches: the environment's tokens are context, never trained on. The gradient of a
multi-turn batch equals that of the same policy tokens with the observations as frozen context (each
policy segment a row of its own whose prompt is everything before it); ``collate`` / ``select`` /
the micro-batches keep every real token and mask the environment's."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cispo.foundations.experience import Completion, collate  # noqa: E402
from cispo.models.policy import policy_logprobs  # noqa: E402
from cispo.objective.loss import policy_loss  # noqa: E402
from cispo.objective.presets import preset  # noqa: E402
from cispo.training.batching import length_micro_batches  # noqa: E402

PAD = 0
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=PAD, eos_token_id=1, bos_token_id=None)
    return transformers.LlamaForCausalLM(cfg).float()


def completion(prompt, segments):
    """segments: [(role, ids)]; the response is their concatenation, env_mask 1 on "env" ones."""
    ids = [t for _, seg in segments for t in seg]
    env = [float(role == "env") for role, seg in segments for _ in seg]
    return Completion({"prompt": ""}, prompt, torch.tensor(ids), torch.zeros(len(ids)), "eos", "",
                      env_mask=torch.tensor(env) if any(env) else None)


MULTI = [
    completion([2, 3, 4], [("policy", [5, 6]), ("env", [7, 8, 9]), ("policy", [10, 11]), ("env", [12]),
                           ("policy", [13, 1])]),
    completion([5], [("policy", [3, 4, 1])]),
]
# the same policy tokens, each segment a row whose prompt is all that came before it
SPLIT = [
    completion([2, 3, 4], [("policy", [5, 6])]),
    completion([2, 3, 4, 5, 6, 7, 8, 9], [("policy", [10, 11])]),
    completion([2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [("policy", [13, 1])]),
    completion([5], [("policy", [3, 4, 1])]),
]
SPLIT_ROW = [0, 0, 0, 1]  # the MULTI row each SPLIT row comes from


def test_collate_masks_the_environment_and_keeps_its_tokens():
    exp = collate(MULTI, torch.zeros(2), PAD)
    assert exp.response_mask[0].tolist() == [1, 1, 0, 0, 0, 1, 1, 0, 1, 1]
    assert exp.attention_mask[0, -10:].tolist() == [1] * 10  # the model sees every real token
    assert exp.response_spans.tolist() == [10, 3]
    assert MULTI[0].policy_length == 6 and MULTI[0].length == 10
    sub = exp.select(torch.tensor([0]))  # trimmed to the real tokens, not to the policy's count
    assert sub.response_ids[0].tolist() == MULTI[0].response_ids.tolist()
    sub = exp.select(torch.tensor([1]))
    assert sub.response_mask.shape[1] == 3
    parts = length_micro_batches(exp, torch.arange(2), max_rows=1)
    assert sorted(int(r) for p in parts for r in p) == [0, 1]


def loss_and_grads(model, completions, advantages, logp_old, num_tokens):
    exp = collate(completions, advantages, PAD)
    model.zero_grad()
    logp = policy_logprobs(model, exp, 1.0, True)  # [B, T]
    old = torch.zeros_like(logp)
    for i, values in enumerate(logp_old):
        old[i, exp.response_mask[i].bool()] = torch.tensor(values)
    loss, _ = policy_loss(logp, old, exp.advantages, exp.response_mask, preset("cispo"), num_tokens=num_tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_gradient_equals_the_policy_tokens_with_observations_as_frozen_context():
    model = tiny_llama()
    # logp_old off the current policy so that ratios differ from 1 and CISPO's cap binds on some tokens
    old_multi = [[-2.0, -3.5, -1.0, -4.0, -2.5, -0.1], [-3.0, -2.0, -5.0]]
    old_split = [old_multi[0][0:2], old_multi[0][2:4], old_multi[0][4:6], old_multi[1]]
    adv = torch.tensor([1.5, -0.7])
    loss_m, grads_m = loss_and_grads(model, MULTI, adv, old_multi, num_tokens=9)
    loss_s, grads_s = loss_and_grads(model, SPLIT, adv[SPLIT_ROW], old_split, num_tokens=9)
    torch.testing.assert_close(loss_m, loss_s, atol=1e-6, rtol=1e-5)
    for name in grads_m:
        torch.testing.assert_close(grads_m[name], grads_s[name], atol=1e-6, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in grads_m.values())
