"""The RL loop end to end on a tiny random Llama: reproducibility, resume, every preset,
and the pieces (dynamic sampling, overlong penalty, batching, log-probs)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from cispo.data.prompts import PromptStream, fill_groups
from cispo.data.rewards import overlong_penalty, shaped_reward
from cispo.foundations.experience import Completion, collate
from cispo.models.policy import policy_logprobs
from cispo.objective.loss import PRESETS
from cispo.records.tracking import read_metrics
from cispo.training.runner import train
from tests.conftest import small_config, strip_perf


def final_weights(run_dir):
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    return load_file(ckpts[-1] / "model" / "model.safetensors")


def test_smoke_run_is_bit_identical(tiny_model, dense_task, tmp_path):
    a = train(small_config(tiny_model, tmp_path / "a"))
    b = train(small_config(tiny_model, tmp_path / "b"))
    rows_a = strip_perf(read_metrics(a.run_dir / "metrics.jsonl"))
    rows_b = strip_perf(read_metrics(b.run_dir / "metrics.jsonl"))
    assert [r["step"] for r in rows_a] == [0, 1, 2, 3]
    assert rows_a == rows_b
    wa, wb = final_weights(a.run_dir), final_weights(b.run_dir)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the run learned something: weights moved, updates happened, metrics are sane
    assert rows_a[-1]["optim/updates"] == 12
    assert rows_a[1]["rollout/logp_corr"] > 0.999  # same model, fp32 head: sampler == trainer
    assert (a.run_dir / "curves.png").stat().st_size > 0
    assert (a.run_dir / "config.yaml").exists() and json.loads((a.run_dir / "meta.json").read_text())["seed"] == 0
    assert "eval/accuracy" in a.summary


def test_resume_equals_uninterrupted(tiny_model, dense_task, tmp_path):
    full = train(small_config(tiny_model, tmp_path / "full", "steps=4"))
    # the same run "killed" after its step-2 checkpoint, then resumed
    train(small_config(tiny_model, tmp_path / "cut", "steps=2"))
    resumed = train(small_config(tiny_model, tmp_path / "cut", "steps=4"), resume=True)
    rows_full = strip_perf(read_metrics(full.run_dir / "metrics.jsonl"))
    rows_res = strip_perf(read_metrics(resumed.run_dir / "metrics.jsonl"))
    assert rows_full == rows_res
    wf, wr = final_weights(full.run_dir), final_weights(resumed.run_dir)
    assert all(torch.equal(wf[k], wr[k]) for k in wf)


def test_existing_run_folder_is_not_clobbered(tiny_model, dense_task, tmp_path):
    train(small_config(tiny_model, tmp_path, "steps=1"))
    with pytest.raises(FileExistsError, match="--resume"):
        train(small_config(tiny_model, tmp_path, "steps=1"))


@pytest.mark.parametrize("objective", sorted(set(PRESETS) - {"cispo"}))
def test_every_objective_trains(tiny_model, dense_task, tmp_path, objective):
    result = train(small_config(tiny_model, tmp_path, f"objective={objective}", "steps=1", "eval.every=0"))
    row = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    assert row["optim/updates"] == 4 and row["optim/skipped"] == 0
    assert torch.isfinite(torch.tensor(row["objective/loss"]))


# ---------------------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------------------


def test_overlong_penalty_formula():
    # L_max = 20, L_cache = 4: free up to 16, then linear to -1 at 20, -1 beyond
    assert [overlong_penalty(n, 20, 4) for n in (1, 16, 17, 18, 20, 21)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError):
        overlong_penalty(5, 20, 0)


def test_shaped_reward_scope():
    """``all`` (DAPO): every response pays for length; ``paid``: only those the verifier pays, so a
    group of unpaid answers of different lengths keeps equal rewards (no advantage, dropped)."""
    lengths = (10, 18, 20)  # free, -0.5, -1 at L_max = 20, L_cache = 4
    assert [shaped_reward(1.0, n, 20, 4) for n in lengths] == [1.0, 0.5, 0.0]
    assert [shaped_reward(0.0, n, 20, 4) for n in lengths] == [0.0, -0.5, -1.0]
    assert [shaped_reward(1.0, n, 20, 4, "paid") for n in lengths] == [1.0, 0.5, 0.0]
    assert [shaped_reward(0.0, n, 20, 4, "paid") for n in lengths] == [0.0, 0.0, 0.0]
    assert shaped_reward(0.25, 18, 20, 4, "paid") == -0.25  # a partly paid answer (graded rewards) pays too
    assert [shaped_reward(r, 20, 20, None, scope) for r in (0.0, 1.0) for scope in ("all", "paid")] == [0, 0, 1, 1]


def test_sample_groups_applies_the_overlong_scope():
    """The trainer's sampling step passes ``rollout.overlong_scope`` through: an unpaid group of a
    random tiny model's answers (most run to the limit) gets penalties under ``all``, none under ``paid``."""
    from cispo.rollout import SamplingConfig
    from cispo.training.sampling import Scoring, sample_groups

    policy = _ragged_setup(torch.float32)[0]
    sampling = SamplingConfig(max_new_tokens=8)
    rewards = {}
    for scope in ("all", "paid"):
        scoring = Scoring(lambda *a, **k: 0.0, overlong_buffer=8, overlong_scope=scope)
        groups = sample_groups(policy, [{"prompt": "12+34="}], 8, sampling, scoring, torch.Generator().manual_seed(0))
        rewards[scope] = [c.reward for c in groups[0]]
        assert all(c.task_reward == 0.0 for c in groups[0])
    assert min(rewards["all"]) < 0 and rewards["paid"] == [0.0] * 8


def test_dynamic_sampling_refills_until_full():
    stream = PromptStream([{"prompt": str(i)} for i in range(100)], seed=0)
    calls = []

    def generate(samples):  # prompts with an even number are "informative"
        calls.append(len(samples))
        return [int(s["prompt"]) for s in samples]

    kept, report = fill_groups(stream.take, generate, lambda g: g % 2 == 0, num_groups=8, max_rounds=10)
    assert len(kept) == 8 and all(g % 2 == 0 for g in kept)
    assert report.rounds == len(calls) >= 2 and report.groups_sampled == sum(calls)
    assert calls[0] == 8 and all(c <= 8 for c in calls)
    # the cap: one round only -> fewer groups
    kept, report = fill_groups(stream.take, generate, lambda g: g % 2 == 0, num_groups=8, max_rounds=1)
    assert report.rounds == 1 and len(kept) == report.groups_kept < 8
    # nothing informative: empty after the cap
    kept, report = fill_groups(stream.take, generate, lambda g: False, num_groups=4, max_rounds=3)
    assert kept == [] and report.rounds == 3
    # filtering off: one round, everything kept
    kept, report = fill_groups(stream.take, generate, lambda g: False, num_groups=4, max_rounds=3, filter_groups=False)
    assert len(kept) == 4 and report.rounds == 1


def test_prompt_stream_is_seeded_and_resumable():
    samples = [{"prompt": str(i)} for i in range(7)]
    a = PromptStream(samples, seed=3)
    first = a.take(10)  # crosses an epoch boundary
    assert sorted(s["prompt"] for s in first[:7]) == sorted(s["prompt"] for s in samples)
    state = a.state_dict()
    rest = a.take(9)
    b = PromptStream(samples, seed=3)
    b.load_state_dict(state)
    assert b.take(9) == rest
    assert PromptStream(samples, seed=3).take(10) == first
    assert PromptStream(samples, seed=4).take(10) != first


def test_policy_logprobs_match_full_forward_with_ragged_padding(tiny_model):
    from cispo.models.loading import load_policy

    model, tok = load_policy(tiny_model)
    g = torch.Generator().manual_seed(0)
    comps = []
    for n_p, n_r in ((3, 5), (7, 2), (5, 6)):
        prompt = torch.randint(3, len(tok), (n_p,), generator=g).tolist()
        resp = torch.randint(3, len(tok), (n_r,), generator=g)
        comps.append(Completion({"prompt": ""}, prompt, resp, torch.zeros(n_r), "eos", ""))
    exp = collate(comps, torch.zeros(3), tok.pad_token_id)
    for temperature in (1.0, 0.7):
        with torch.no_grad():
            lp = policy_logprobs(model, exp, temperature=temperature)
        for i, c in enumerate(comps):
            ids = torch.tensor(c.prompt_ids + c.response_ids.tolist())[None]
            with torch.no_grad():
                logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1] / temperature
            ref = torch.log_softmax(logits.double(), -1).gather(-1, c.response_ids[:, None])[:, 0]
            assert torch.allclose(lp[i, : c.length].double(), ref, atol=1e-5)
            assert (lp[i, c.length :] * exp.response_mask[i, c.length :] == 0).all()
        # a row selected alone gives the same log-probs (trimmed padding does not matter)
        with torch.no_grad():
            alone = policy_logprobs(model, exp.select(torch.tensor([1])), temperature=temperature)
        assert torch.allclose(alone[0, :2], lp[1, :2], atol=1e-5)


def _ragged_setup(dtype=torch.float64, rows=24):
    """A tiny policy and a batch with ragged prompts / responses (a few long ones)."""
    from cispo.config.train import TrainConfig, apply_overrides
    from cispo.data.tasks import arithmetic
    from cispo.models.loading import build_model, build_tokenizer
    from cispo.models.policy import Policy
    from cispo.rollout import TorchSampler

    tok = build_tokenizer(arithmetic.ALPHABET)
    model = build_model(tok, size="tiny", seed=0).to(dtype)
    policy = Policy(model, tok, TorchSampler(model, tok.eos_token_id, tok.pad_token_id), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    comps = []
    for i in range(rows):
        n_p, n_r = 3 + i % 5, (2 + (5 * i) % 7) if i % 6 else 25 + i % 4  # mostly short, every 6th long
        comps.append(Completion({"prompt": ""}, torch.randint(3, len(tok), (n_p,), generator=g).tolist(),
                                torch.randint(3, len(tok), (n_r,), generator=g), torch.zeros(n_r), "eos", ""))
    exp = collate(comps, torch.randn(rows, generator=g), tok.pad_token_id)
    # logp_old off-policy enough that the IS-weight caps and PPO masks bite
    exp.logp_old = (-2.0 + 0.5 * torch.randn(exp.response_mask.shape, generator=g)) * exp.response_mask
    return policy, exp, lambda *o: apply_overrides(TrainConfig(), ["updates_per_batch=2", "lr=1e-2",
                                                                   "warmup_updates=0", *o])


def _positions(exp, parts) -> int:
    """Decoder positions the calls over ``parts`` compute (each trimmed by Experience.select)."""
    return sum(s.input_ids.shape[0] * (s.input_ids.shape[1] - 1) for s in (exp.select(r) for r in parts))


@pytest.mark.parametrize("objective", ["cispo", "grpo"])
@pytest.mark.parametrize("micro", [None, 5])
def test_length_sorted_micro_batches_give_the_same_update(objective, micro):
    from cispo.objective.loss import preset
    from cispo.training.batching import micro_batches
    from cispo.training.setup import make_optimizer
    from cispo.training.trainer import Trainer

    torch.manual_seed(0)
    params, positions, stats = {}, {}, {}
    for split in ("none", "0", "128"):
        policy, exp, config = _ragged_setup()
        cfg = config(f"objective={objective}", f"micro_batch_size={micro}", f"micro_batch_split_cost={split}")
        order = torch.randperm(len(exp), generator=torch.Generator().manual_seed(3))  # the trainer's shuffle
        calls = [m for rows in order.tensor_split(cfg.algo.updates_per_batch)
                 for m in micro_batches(exp, rows, cfg.algo)]
        assert sorted(torch.cat(calls).tolist()) == list(range(len(exp)))  # every row once
        assert all(len(m) <= (micro or len(exp)) for m in calls)
        positions[split] = _positions(exp, calls)
        trainer = Trainer(policy, make_optimizer(policy.model, cfg.optim), preset(objective), cfg,
                          torch.Generator().manual_seed(3))
        stats[split] = trainer.update(exp)
        params[split] = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    before = _ragged_setup()[0].model.state_dict()
    assert any(not torch.equal(params["none"][k], before[k]) for k in before)  # the update did something
    for split in ("0", "128"):
        for k in params["none"]:
            assert torch.allclose(params[split][k], params["none"][k], rtol=1e-9, atol=1e-12), (split, k)
        for a, b in zip(stats[split], stats["none"], strict=True):  # the stats are float32
            assert a.keys() == b.keys()
            assert all(math.isclose(a[x], b[x], rel_tol=1e-5, abs_tol=1e-7)
                       or (math.isnan(a[x]) and math.isnan(b[x]))
                       for x in a), (a, b)
    # less padding: fewer decoder positions computed than unsorted random micro-batches
    assert positions["0"] <= positions["128"] < positions["none"]


def test_length_micro_batches_cut_where_it_pays():
    from cispo.training.batching import length_micro_batches

    _, exp, _ = _ragged_setup(torch.float32, rows=48)
    rows = torch.randperm(len(exp), generator=torch.Generator().manual_seed(0))
    unsorted = _positions(exp, [rows])
    free = length_micro_batches(exp, rows, None, 0.0)  # calls cost nothing: one part per distinct width
    assert len(free) > 2 and _positions(exp, free) < unsorted / 2
    lengths = exp.response_mask.sum(-1)
    flat = torch.cat(free)
    assert (lengths[flat].diff() >= 0).all()  # sorted by response length
    assert len(length_micro_batches(exp, rows, None, 1e9)) == 1  # calls cost too much: one call
    capped = length_micro_batches(exp, rows, 4, 1e9)
    assert [len(m) for m in capped] == [4] * 12  # at most max_rows rows, as few calls as that allows
    mid = length_micro_batches(exp, rows, None, 128.0)
    assert len(free) >= len(mid) >= 2 and _positions(exp, mid) + 128 * len(mid) < unsorted + 128
    # the cuts minimise positions + cost x calls: no other one or two cuts where the response
    # length changes do better
    for cost in (0.0, 16.0, 128.0, 512.0):
        parts = length_micro_batches(exp, rows, None, cost)
        flat = torch.cat(parts)
        got = _positions(exp, parts) + cost * len(parts)
        steps = (lengths[flat].diff() != 0).nonzero().flatten().add(1).tolist() + [len(flat)]
        for a in steps:
            for b in [x for x in steps if x > a]:
                alt = [flat[:a], flat[a:b]] + ([flat[b:]] if b < len(flat) else [])
                assert got <= _positions(exp, alt) + cost * len(alt)
    assert length_micro_batches(exp, rows[:0], None, 0.0) == []


def test_length_micro_batches_bound_their_cut_points(monkeypatch):
    import cispo.training.batching

    _, exp, _ = _ragged_setup(torch.float32, rows=48)
    rows = torch.randperm(len(exp), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(cispo.training.batching, "MAX_CUT_POINTS", 3)  # fewer than the distinct lengths
    parts = cispo.training.batching.length_micro_batches(exp, rows, None, 0.0)
    assert 1 < len(parts) <= 3 and sorted(torch.cat(parts).tolist()) == list(range(len(exp)))
    parts = cispo.training.batching.length_micro_batches(exp, rows, 5, 0.0)
    assert max(len(m) for m in parts) <= 5 and sorted(torch.cat(parts).tolist()) == list(range(len(exp)))


def test_truncated_is_and_lora_options_train(tiny_model, dense_task, tmp_path):
    pytest.importorskip("peft")
    result = train(small_config(tiny_model, tmp_path, "steps=1", "eval.every=0", "algo.tis_cap=2.0",
                                "model.lora_rank=4"))
    row = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    assert row["optim/updates"] == 4 and row["optim/skipped"] == 0
    merged = final_weights(result.run_dir)
    ckpt = sorted((result.run_dir / "checkpoints").iterdir())[-1]
    adapter = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    base = load_file(tiny_model / "model.safetensors")
    assert adapter and all("lora_" in k for k in adapter), "adapters are saved with the checkpoint"
    assert any(adapter[k].abs().sum() > 0 for k in adapter if "lora_B" in k)  # the adapters moved
    # model/ is the merged model under the base names: adapted layers differ from the base, the rest not
    assert merged.keys() == base.keys()
    assert any(not torch.equal(merged[k], base[k]) for k in base if "proj" in k)
    assert all(torch.equal(merged[k], base[k]) for k in base if "proj" not in k)


def test_run_logs_to_tensorboard(tiny_model, dense_task, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(small_config(tiny_model, tmp_path, "steps=2", "trackers=[tensorboard]"))
    events = EventAccumulator(str(result.run_dir / "tensorboard"))
    events.Reload()
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    for key in ("rollout/reward_mean", "objective/frac_capped", "eval/accuracy"):
        logged = {e.step: e.value for e in events.Scalars(key)}
        expected = {r["step"]: r[key] for r in rows if r.get(key) is not None}
        assert logged.keys() == expected.keys()
        assert all(abs(logged[s] - expected[s]) < 1e-6 for s in expected)
