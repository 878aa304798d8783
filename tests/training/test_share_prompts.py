"""algo.share_prompts and algo.minibatch_order in the trainer: a run with each prompt
run once per call learns what the plain run learns (metrics and weights to float rounding); ``by_group``
deals whole groups into the mini-batches; the micro-batch cut counts a shared prompt once."""

import json
import math

import pytest
import torch

from cispo.config.algo import AlgoConfig
from cispo.foundations.experience import Completion, collate
from cispo.training.batching import length_micro_batches, minibatches, row_order
from cispo.training.runner import train
from tests.conftest import small_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(tiny_model, out, name, *extra):
    cfg = small_config(tiny_model, out, f"run_name={name}", "model.compile=off", "eval.every=0",
                       "checkpoint_every=0", "micro_batch_size=null", *extra)
    result = train(cfg)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file

    last = sorted((result.run_dir / "checkpoints").iterdir())[-1]
    return rows, load_file(last / "model" / "model.safetensors")


@pytest.mark.parametrize("order", ["random", "by_group"])
def test_a_shared_run_learns_what_the_plain_run_learns(tiny_model, tmp_path, dense_task, order, monkeypatch):
    import cispo.models.policy as policy
    import cispo.models.shared_prefix as shared_prefix

    monkeypatch.setattr(shared_prefix, "MIN_SAVING", 0.0)  # the toy's prompts are short: share every call anyway
    shared_calls = []
    real = policy.shared_prefix_hidden
    monkeypatch.setattr(policy, "shared_prefix_hidden", lambda *a: shared_calls.append(1) or real(*a))
    off = _run(tiny_model, tmp_path, "off", f"algo.minibatch_order={order}", "algo.share_prompts=false")
    assert not shared_calls
    on = _run(tiny_model, tmp_path, "on", f"algo.minibatch_order={order}", "algo.share_prompts=true")
    assert len(shared_calls) >= 3 * 4  # every update of every step ran shared prompts (the built-in model is a Llama)
    assert len(on[0]) == len(off[0]) == 4  # the step-0 evaluation, then 3 steps
    compared = 0
    for a, b in zip(on[0], off[0]):
        assert a.keys() == b.keys()
        for key, v in b.items():
            if key.startswith(("perf/", "time/")) or not isinstance(v, float) or math.isnan(v):
                continue
            assert a[key] == pytest.approx(v, rel=1e-3, abs=1e-5), key
            compared += 1
    assert compared > 50
    for name, w in off[1].items():
        torch.testing.assert_close(on[1][name], w, atol=1e-4, rtol=1e-3, msg=name)


def test_by_group_deals_whole_groups():
    algo = AlgoConfig(minibatch_order="by_group", updates_per_batch=2)
    order = row_order(12, 3, algo, torch.Generator().manual_seed(0))  # 4 groups of G = 3
    assert sorted(order.tolist()) == list(range(12))
    for part in minibatches(order, algo, 12, 12):
        assert len(part) == 6 and sorted({int(r) // 3 for r in part}) == sorted({int(r) // 3 for r in part})
        assert all(sum(int(r) // 3 == g for r in part) in (0, 3) for g in range(4))  # a group is all in or all out
    assert not torch.equal(row_order(12, 3, AlgoConfig(), torch.Generator().manual_seed(0)).reshape(4, 3) // 3,
                           torch.arange(4)[:, None].expand(4, 3))  # random: rows of a group are spread


def test_the_micro_batch_cut_counts_a_shared_prompt_once():
    """One 40-token prompt, 4 responses of 2 and 4 of 10 tokens: the plain cut separates the lengths
    (saves padding), the shared cut keeps them together (a second call would run the prompt again)."""
    prompt = list(range(2, 42))
    rows = [Completion({}, prompt, torch.full((n,), 5), torch.zeros(n), "eos", "") for n in [2] * 4 + [10] * 4]
    exp = collate(rows, torch.zeros(8), 0)
    plain = length_micro_batches(exp, torch.arange(8), split_cost=0.0)
    shared = length_micro_batches(exp, torch.arange(8), split_cost=0.0, share=True)
    assert len(plain) == 2 and len(shared) == 1

