"""RL passes on real checkpoints: dropout off by default, mixed precision with FP32 master
weights, and a loss scale for float16."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cispo.config.train import TrainConfig, apply_overrides  # noqa: E402
from cispo.foundations.experience import Completion, collate  # noqa: E402
from cispo.models.policy import policy_logprobs  # noqa: E402
from cispo.objective.loss import preset  # noqa: E402
from cispo.training.run_policy import load_policy_for  # noqa: E402
from cispo.training.setup import make_optimizer  # noqa: E402
from cispo.training.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

V, EOS, PAD = 48, 1, 0


def save(model, path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(V)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
                                  pad_token="t0", eos_token="t1")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """GPT-2 with its default dropout of 0.1 everywhere."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                                  pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS)
    assert cfg.resid_pdrop == cfg.attn_pdrop == cfg.embd_pdrop == 0.1
    return save(transformers.GPT2LMHeadModel(cfg), tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    return save(transformers.LlamaForCausalLM(cfg), tmp_path_factory.mktemp("llama"))


def policy(path, *overrides):
    cfg = apply_overrides(TrainConfig(), [f"model.path={path}", "model.device=cpu", "rollout.temperature=1.0",
                                          *overrides])
    return load_policy_for(cfg, None, torch.device("cpu")), cfg


def batch():
    g = torch.Generator().manual_seed(1)
    rows = [Completion({}, torch.randint(2, V, (n_p,), generator=g).tolist(), torch.randint(2, V, (n_r,), generator=g),
                       torch.zeros(n_r), "length", "") for n_p, n_r in ((3, 6), (5, 4), (2, 7), (4, 5))]
    return collate(rows, torch.tensor([1.0, -1.0, 0.5, -0.5]), PAD)


@pytest.mark.parametrize("keep_dropout", [False, True])
def test_dropout_is_off_in_the_rl_passes_unless_kept(gpt2_dir, keep_dropout):
    pol, cfg = policy(gpt2_dir, f"model.dropout={str(keep_dropout).lower()}")
    exp = batch()
    torch.manual_seed(0)
    logp_old = Trainer(pol, None, cfg.algo.objective.resolve(), cfg, torch.Generator()).compute_logp_old(exp)
    pol.model.train()  # an update's forward, weights unchanged
    with torch.no_grad(), pol.compute():
        logp_new = policy_logprobs(pol.model, exp, cfg.rollout.temperature) * exp.response_mask
    if keep_dropout:
        assert not torch.equal(logp_old, logp_new)  # the switch keeps GPT-2's 0.1 dropout
    else:
        assert torch.equal(logp_old, logp_new)
        pol.model.eval()  # and it is the eval-mode (sampler's) distribution
        with torch.no_grad():
            torch.testing.assert_close(policy_logprobs(pol.model, exp, 1.0) * exp.response_mask, logp_old)


def fraction_changed(path, *overrides, updates=4):
    """Fraction of weights that 4 AdamW steps at lr 1e-6 change."""
    pol, cfg = policy(path, "optim.lr=1e-6", "optim.warmup_updates=0", *overrides)
    opt = make_optimizer(pol.model, cfg.optim)
    before = [p.detach().clone() for p in pol.model.parameters()]
    exp = batch()
    pol.model.train()
    for _ in range(updates):
        with pol.compute():
            logp = policy_logprobs(pol.model, exp, 1.0)
        loss = -(logp * exp.advantages[:, None] * exp.response_mask).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(pol.model.parameters(), before))
    return pol, changed / sum(b.numel() for b in before)


def test_bfloat16_has_fp32_master_weights_that_small_updates_change(llama_dir):
    pol, frac = fraction_changed(llama_dir, "model.dtype=bfloat16")
    assert all(p.dtype == torch.float32 for p in pol.model.parameters())
    assert pol.autocast == torch.bfloat16 and pol.sampler.autocast == torch.bfloat16
    seen = []  # the forward's matmuls compute in bfloat16 (autocast; the residual stream stays fp32)
    hook = pol.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.no_grad(), pol.compute():
        pol.model(input_ids=torch.tensor([[2, 3, 4]]))
    hook.remove()
    assert seen == [torch.bfloat16]
    assert frac > 0.9, frac


def test_pure_bfloat16_only_on_request_and_loses_small_updates(llama_dir, capsys):
    pol, frac = fraction_changed(llama_dir, "model.dtype=bfloat16", "model.master_weights=false")
    assert "master_weights=false" in capsys.readouterr().err
    assert all(p.dtype == torch.bfloat16 for p in pol.model.parameters()) and pol.autocast is None
    assert frac < 0.1, frac  # the rounding step of bf16 weights swallows lr 1e-6 updates


def test_float32_is_unchanged(llama_dir):
    pol, _ = policy(llama_dir)
    assert pol.autocast is None and all(p.dtype == torch.float32 for p in pol.model.parameters())


def tiny_loss_update(pol, cfg, exp, scale):
    """One `Trainer.update` step (K = 1) on `exp` with its advantages times `scale`; -> the
    weight change, the step's stats and the update count."""
    opt = torch.optim.SGD(pol.model.parameters(), lr=1.0)  # the step is the gradient itself
    trainer = Trainer(pol, opt, preset("cispo"), cfg, torch.Generator().manual_seed(0))
    exp.advantages = exp.advantages * scale
    exp.logp_old = trainer.compute_logp_old(exp)
    before = [p.detach().clone() for p in pol.model.parameters()]
    stats = trainer.update(exp)
    return [p.detach() - b for p, b in zip(pol.model.parameters(), before)], stats, trainer.update_count


def test_float16_scales_the_loss_so_small_gradients_survive(llama_dir):
    """SGD at lr 1: the update is the gradient. With advantages of 1e-4 the activation gradients
    fall below float16's range; the loss scaler keeps them, and the update then equals the
    float32 run's (within float16 rounding)."""
    opts = ("optim.lr=1.0", "optim.warmup_updates=0", "optim.grad_clip=0", "algo.updates_per_batch=1")
    ref, cfg32 = policy(llama_dir, *opts)
    d32, _, _ = tiny_loss_update(ref, cfg32, batch(), 1e-4)
    pol, cfg = policy(llama_dir, "model.dtype=float16", *opts)
    assert pol.autocast == torch.float16 and pol.grad_scaler is not None and pol.grad_scaler.get_scale() == 2.0 ** 16
    d16, stats, n = tiny_loss_update(pol, cfg, batch(), 1e-4)
    assert n == 1 and stats[0]["skipped"] == 0.0 and stats[0]["loss_scale"] == 2.0 ** 16
    def rel_err(d):  # ||d - d32|| / ||d32|| over all weights
        diff = sum(float((a - b).norm() ** 2) for a, b in zip(d, d32)) ** 0.5
        return diff / sum(float(b.norm() ** 2) for b in d32) ** 0.5

    assert rel_err(d16) < 0.01, rel_err(d16)
    # the same step unscaled: most of the gradient flushes to zero in float16
    pol2, _ = policy(llama_dir, "model.dtype=float16", *opts)
    pol2.grad_scaler = None
    d_raw, _, _ = tiny_loss_update(pol2, cfg, batch(), 1e-4)
    assert rel_err(d_raw) > 0.1, rel_err(d_raw)  # measured: 0.25 unscaled, 0.001 scaled


def test_bfloat16_and_float32_have_no_loss_scaler(llama_dir):
    assert policy(llama_dir, "model.dtype=bfloat16")[0].grad_scaler is None
    assert policy(llama_dir)[0].grad_scaler is None
    assert policy(llama_dir, "model.dtype=float16", "model.master_weights=false")[0].grad_scaler is None


def test_float16_resume_continues_with_the_saved_loss_scale(tiny_model, dense_task, tmp_path):
    import json
    import shutil

    from cispo.records.tracking import read_metrics
    from cispo.training.checkpoint import list_checkpoints
    from cispo.training.runner import train
    from tests.conftest import small_config

    def rows(run):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(run / "metrics.jsonl")]

    full = train(small_config(tiny_model, tmp_path / "full", "model.dtype=float16", "steps=3"))
    cut = train(small_config(tiny_model, tmp_path / "cut", "model.dtype=float16", "steps=2")).run_dir
    ckpt = list_checkpoints(cut)[-1]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["grad_scaler"]["scale"] == rows(cut)[-1]["optim/loss_scale"]
    shutil.copytree(tmp_path / "cut", tmp_path / "edited")
    resumed = train(small_config(tiny_model, tmp_path / "cut", "model.dtype=float16", "steps=3"), resume=True)
    assert rows(full.run_dir) == rows(resumed.run_dir) and "optim/loss_scale" in rows(full.run_dir)[-1]
    # the scale is read back from the checkpoint, not restarted at 2^16
    state["grad_scaler"]["scale"] = 1024.0
    (tmp_path / "edited" / ckpt.relative_to(tmp_path / "cut") / "trainer_state.json").write_text(json.dumps(state))
    again = train(small_config(tiny_model, tmp_path / "edited", "model.dtype=float16", "steps=3"), resume=True)
    assert rows(again.run_dir)[-1]["optim/loss_scale"] == 1024.0
