"""Tests for cispo.models.loading and cispo.models.pretrain: tokenizer, save/load, seeded pretraining, cache."""

import json
from pathlib import Path

import pytest
import torch

import cispo.models.loading as models
from cispo.data.tasks import get_task
from cispo.models.builtin import builtin_model_path, ensure_builtin_model
from cispo.models.loading import build_model, build_tokenizer, load_policy, save_policy
from cispo.models.pretrain import PretrainConfig, measure_base_model, pretrain, sample_completions

TINY = dict(model_size="tiny", steps=10, batch_size=16, corpus_size=200, warmup_steps=3)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(get_task("addition").alphabet)


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_is_character_level_and_round_trips(tok):
    task = get_task("addition")
    assert tok.pad_token_id == 0 and tok.convert_ids_to_tokens(0) == "<pad>"
    assert tok.eos_token_id == 1
    assert len(tok) == 3 + len(task.alphabet)
    texts = [s["prompt"] for s in task.train_samples(0, 20)]
    texts += ["6207W1+6+0=07,2+9+0=11,8+3+1=12,4+1+1=06=6217", task.alphabet]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text)                         # one id per character, nothing added
        assert ids == [tok.convert_tokens_to_ids(c) for c in text]
        assert tok.decode(ids) == text
    assert len(set(tok(task.alphabet)["input_ids"])) == len(task.alphabet)
    assert tok("12<eos>")["input_ids"][-1] == tok.eos_token_id  # special tokens are single ids
    assert tok.decode(tok("12<eos>")["input_ids"], skip_special_tokens=True) == "12"


def test_unknown_characters_map_to_unk(tok):
    assert tok("1x2")["input_ids"][1] == tok.unk_token_id


def test_build_model_is_seeded(tok):
    a, b, c = build_model(tok, "tiny", seed=0), build_model(tok, "tiny", seed=0), build_model(tok, "tiny", seed=1)
    for (n, p), q, _r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
    assert any(not torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters()))


def test_model_sizes(tok):
    assert 300_000 < models.num_parameters(build_model(tok)) < 400_000             # default
    assert 800_000 < models.num_parameters(build_model(tok, "large")) < 1_000_000


# --------------------------------------------------------------------------- save / load


def test_save_load_round_trip_gives_identical_logits(tok, tmp_path):
    model = build_model(tok, "tiny", seed=3).eval()
    save_policy(model, tok, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    model2, tok2 = load_policy(tmp_path / "m")
    ids = torch.tensor([tok("4821+1396=6207W1+6")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)
    assert tok2("4821+1396=")["input_ids"] == tok("4821+1396=")["input_ids"]
    assert tok2.decode(tok2("12W=")["input_ids"]) == "12W="
    assert (tok2.pad_token_id, tok2.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    m3, _ = load_policy(tmp_path / "m", dtype="float64")
    assert next(m3.parameters()).dtype == torch.float64


# --------------------------------------------------------------------------- pretraining


def test_corpus_encoding_matches_the_tokenizer(tok):
    from cispo.models.pretrain import _encode

    corpus = get_task("addition").corpus(0, 300, derivation_fraction=0.5)
    ids, labels = _encode(corpus, tok.get_vocab(), tok.eos_token_id, tok.pad_token_id)   # [N, T]
    for i, ex in enumerate(corpus):
        full = tok(ex.prompt + ex.completion)["input_ids"] + [tok.eos_token_id]
        n = len(full) - 1
        assert ids[i, :n].tolist() == full[:-1]
        # position t predicts token t+1, only where the corpus puts loss
        want = [-100] * (len(ex.prompt) - 1)
        want += [full[len(ex.prompt) + j] if m else -100 for j, m in enumerate(ex.loss_mask)]
        assert labels[i, :n].tolist() == want
        assert (labels[i, n:] == -100).all()


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_pretraining_is_bit_identical_for_the_same_seed(tmp_path, one_thread):
    cfg = PretrainConfig(seed=5, **TINY)
    m1, _ = pretrain(cfg, tmp_path / "a", progress=False)
    m2, _ = pretrain(cfg, tmp_path / "b", progress=False)
    m3, _ = pretrain(PretrainConfig(seed=6, **TINY), tmp_path / "c", progress=False)
    s1, s2, s3 = _state(m1), _state(m2), _state(m3)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert any(not torch.equal(s1[k], s3[k]) for k in s1)
    log = json.loads((tmp_path / "a" / "pretrain_log.json").read_text())
    assert len(log["loss"]) == TINY["steps"] and log["loss"][-1] < log["loss"][0]
    assert json.loads((tmp_path / "a" / "pretrain_config.json").read_text())["seed"] == 5


def test_sampler_and_measure_on_a_tiny_model(tok, one_thread):
    task = get_task("addition")
    model = build_model(tok, "tiny", seed=0).eval()
    prompts = [s["prompt"] for s in task.eval_samples(0, 8)]
    a = sample_completions(model, tok, prompts, 12, temperature=1.0, seed=1)
    assert a == sample_completions(model, tok, prompts, 12, temperature=1.0, seed=1)
    assert all(len(tok(c)["input_ids"]) <= 12 and "<eos>" not in c for c in a)
    g = sample_completions(model, tok, prompts, 12, temperature=0.0)
    # greedy equals argmax of a plain forward pass, token by token
    ids = torch.tensor([tok(prompts[0])["input_ids"]])
    text = ""
    with torch.no_grad():
        for _ in range(12):
            nxt = int(model(ids).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            text += tok.decode([nxt])
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    assert g[0] == text
    r = measure_base_model(model, tok, task, n=16, seed=0)
    assert r.n == 16 and 0.0 <= r.fork_rate <= 1.0 and 0.0 <= r.accuracy <= 1.0


# --------------------------------------------------------------------------- cache


def test_cache_path_follows_env_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("CISPO_CACHE", str(tmp_path / "c"))
    p = builtin_model_path("addition")
    assert p.parent == tmp_path / "c" / "models" and p.name.startswith("addition-")
    assert builtin_model_path("addition") == p
    assert builtin_model_path("addition", cfg=PretrainConfig(seed=1)) != p
    assert builtin_model_path("addition", cache_dir=tmp_path / "x").parent == tmp_path / "x" / "models"
    monkeypatch.delenv("CISPO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert builtin_model_path("addition").parent == tmp_path / "xdg" / "cispo" / "models"


def test_ensure_builds_once_then_reuses(tmp_path, monkeypatch, one_thread):
    import cispo.models.pretrain

    monkeypatch.setenv("CISPO_CACHE", str(tmp_path))
    cfg = PretrainConfig(**TINY)
    calls = []
    real = cispo.models.pretrain.pretrain

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(cispo.models.pretrain, "pretrain", counting)
    path = ensure_builtin_model("addition", cfg=cfg, progress=False)
    assert path == builtin_model_path("addition", cfg=cfg) and len(calls) == 1
    assert ensure_builtin_model("addition", cfg=cfg, progress=False) == path and len(calls) == 1
    assert [p.name for p in path.parent.iterdir()] == [path.name]     # no temp folder left
    model, tok = load_policy(path)
    assert tok("1+2=")["input_ids"] == build_tokenizer(get_task().alphabet)("1+2=")["input_ids"]


def test_interrupted_pretraining_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    import cispo.models.pretrain

    monkeypatch.setenv("CISPO_CACHE", str(tmp_path))
    cfg = PretrainConfig(**TINY)

    def killed(cfg, out_dir, progress=True):
        Path(out_dir, "config.json").write_text("{}")                  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(cispo.models.pretrain, "pretrain", killed)
    with pytest.raises(KeyboardInterrupt):
        ensure_builtin_model("addition", cfg=cfg, progress=False)
    assert list((tmp_path / "models").iterdir()) == []
