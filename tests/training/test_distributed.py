"""Data parallelism on CPU with gloo: 2 ranks == 1 process on the same batch."""

import json
import math
import multiprocessing
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cispo.config.train import TrainConfig, apply_overrides
from cispo.data.tasks import arithmetic
from cispo.foundations.distributed import DistInfo, any_rank
from cispo.foundations.experience import Completion, collate
from cispo.models.loading import build_model, build_tokenizer
from cispo.models.policy import Policy
from cispo.objective.loss import preset
from cispo.rollout import TorchSampler
from cispo.training.setup import make_optimizer
from cispo.training.trainer import Trainer

B = 8  # 4 groups of 2, split 2 + 2 groups over the ranks


def make_setup(objective, split_cost="128"):
    torch.manual_seed(0)
    tok = build_tokenizer(arithmetic.ALPHABET)
    model = build_model(tok, size="tiny", seed=0)
    cfg = apply_overrides(TrainConfig(), [f"objective={objective}", "updates_per_batch=1", "micro_batch_size=3",
                                          "lr=1e-2", "warmup_updates=0", "optim.grad_clip=0", "group_size=2",
                                          f"micro_batch_split_cost={split_cost}"])
    policy = Policy(model, tok, TorchSampler(model, tok.eos_token_id, tok.pad_token_id), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    comps = []
    for i in range(B):
        n_p, n_r = 3 + i % 4, 2 + (5 * i) % 7
        comps.append(Completion({"prompt": ""}, torch.randint(3, len(tok), (n_p,), generator=g).tolist(),
                                torch.randint(3, len(tok), (n_r,), generator=g), torch.zeros(n_r), "eos", ""))
    exp = collate(comps, torch.randn(B, generator=g), tok.pad_token_id)
    # logp_old off-policy enough that masks and caps bite
    logp_old = trainer(policy, cfg).compute_logp_old(exp)
    exp.logp_old = (logp_old + 0.5 * torch.randn(exp.response_mask.shape, generator=g)) * exp.response_mask
    return policy, cfg, exp


def trainer(policy, cfg, optimizer=None, info=DistInfo(), objective=None):
    """A `Trainer` of ``policy`` under ``cfg`` with the mini-batch order seeded 0 (and this rank's ``info``)."""
    objective = objective or cfg.algo.objective.resolve()
    return Trainer(policy, optimizer, objective, cfg, torch.Generator().manual_seed(0), info)


def run_update(policy, cfg, exp, info):
    """One update with plain SGD and no gradient clipping: the parameters move by lr * gradient, so a
    gradient summed where it should be averaged (or normalised per rank instead of over the whole
    batch) changes the result. AdamW's first step (eps 1e-15) is ~lr * sign(g) and a clipped norm
    is scale-free, so either would hide a factor of 2."""
    optimizer = torch.optim.SGD([p for p in policy.model.parameters() if p.requires_grad], lr=cfg.optim.lr)
    trainer(policy, cfg, optimizer, info).update(exp)
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


def _worker(rank, world, port, objective, out_path, split_cost):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    policy, cfg, exp = make_setup(objective, split_cost)
    rows = torch.arange(B).reshape(world, -1)[rank]  # whole groups per rank
    params = run_update(policy, cfg, exp.select(rows), DistInfo(rank, world, 0))
    if rank == 0:
        torch.save(params, out_path)
    dist.barrier()  # neither rank tears gloo down while its peer still talks (a SIGABRT seen once under load)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "transformers.models.llama.modeling_llama",
           "cispo.training.trainer", "cispo.training.setup", "cispo.rollout", "cispo.foundations.distributed"]
"""What every rank imports. A spawned rank starts a fresh interpreter and imports them itself (~6 CPU-s
each, 2 ranks per test); a rank forked from the forkserver gets them already imported, and the server
imports them once for the whole module. The server runs no torch op before it forks (so no thread pool
is copied into a rank, which is why a plain fork of the pytest process is not used)."""


def spawn_two_ranks(fn, *args):
    """``mp.spawn(fn, args=(2, port, *args), nprocs=2)``, the ranks forked from a forkserver (PRELOAD)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # no effect once the server runs: it already has them
    mp.start_processes(fn, args=(2, free_port(), *args), nprocs=2, join=True, start_method="forkserver")


# split cost 0: a cut wherever the length changes, so each rank runs several length-sorted
# micro-batches of its own rows
@pytest.mark.parametrize(("objective", "split_cost"), [("cispo", "128"), ("grpo", "0")])
def test_two_gloo_ranks_equal_one_process(objective, split_cost, tmp_path):
    out = tmp_path / "params.pt"
    spawn_two_ranks(_worker, objective, str(out), split_cost)
    two = torch.load(out, weights_only=True)
    torch.set_num_threads(1)
    policy, cfg, exp = make_setup(objective, split_cost)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    one = run_update(policy, cfg, exp, DistInfo())
    assert any(not torch.equal(one[k], before[k]) for k in one)  # the step did something
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-6, rtol=1e-5), k


def test_torchrun_cli_two_ranks(tmp_path):
    """`torchrun --nproc_per_node 2 -m cispo train` end to end (a random tiny model)."""
    from cispo.models.loading import save_policy

    tok = build_tokenizer(arithmetic.ALPHABET)
    save_policy(build_model(tok, size="tiny", seed=0), tok, tmp_path / "model")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "cispo", "train", f"model.path={tmp_path / 'model'}", "model.device=cpu", f"out_dir={tmp_path}",
           "run_name=ddp", "steps=2", "prompts_per_step=4", "group_size=2", "updates_per_batch=2",
           "max_new_tokens=6", "num_eval_prompts=4", "eval.num_samples=1", "dynamic_sampling=false",
           "progress=false", "threads=1", "num_train_prompts=32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from cispo.records.tracking import read_metrics

    rows = read_metrics(tmp_path / "ddp" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["optim/updates"] == 4
    # counts are summed over the ranks: 2 groups each, 4 in the step (a mean would say 2)
    assert [r["rollout/groups_sampled"] for r in rows[1:]] == [4.0, 4.0]
    assert [r["rollout/groups_kept"] for r in rows[1:]] == [4.0, 4.0]
    state = json.loads((tmp_path / "ddp" / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and len(state["streams"]) == 2


# ---------------------------------------------------------------------------------------
# FSDP2 (model.fsdp): sharded weights, gradients and optimizer state
# ---------------------------------------------------------------------------------------

UNEVEN = ([0, 1, 2, 3, 4, 5], [6, 7])  # whole groups; micro_batch_size=3: more micro-batches on rank 0


def _fsdp_worker(rank, world, port, out_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from cispo.foundations.distributed import is_sharded, shard_model
    from cispo.rollout import SamplingConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    info = DistInfo(rank, world, 0)
    policy, cfg, exp = make_setup("cispo")
    mine = exp.select(torch.tensor(UNEVEN[rank]))
    # references from the whole model on this rank, before sharding
    prompts = [[3 + rank, 4, 5][: 1 + rank], [6, 7], [8]][: 3 - rank]  # different rows and lengths per rank
    # rank 0's rows all stop after 2 tokens; rank 1's run to 8: rank 0 must keep stepping with it
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0, repetition_stop_tokens=2 if rank == 0 else None,
                            repetition_stop_prob=0.01)
    want_gen = policy.sampler.generate(prompts, greedy)
    want_logp = trainer(policy, cfg).compute_logp_old(mine)
    want_entropy = mine.extras["entropy"].clone()

    shard_model(policy.model, info, torch.device("cpu"))
    assert is_sharded(policy.model)
    policy.sampler.lock_step(lambda done: not any_rank(not done, info))
    got_gen = policy.sampler.generate(prompts, greedy)
    n = want_gen.response_ids.shape[1]
    assert n == (2 if rank == 0 else 8) and got_gen.response_ids.shape[1] == 8  # until every rank is done
    assert torch.equal(got_gen.response_ids[:, :n], want_gen.response_ids)
    assert not got_gen.response_mask[:, n:].any()
    assert torch.allclose(got_gen.logp_rollout[:, :n], want_gen.logp_rollout, atol=1e-5)
    got_logp = trainer(policy, cfg, info=info).compute_logp_old(mine)  # uneven micro-batch counts: idle passes
    assert torch.allclose(got_logp, want_logp, atol=1e-5)
    assert torch.allclose(mine.extras["entropy"], want_entropy, atol=1e-5)

    optimizer = make_optimizer(policy.model, cfg.optim)
    rank_trainer = trainer(policy, cfg, optimizer, info)
    stats, updates = rank_trainer.update(mine), rank_trainer.update_count
    params = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"params": params, "grad_norm": stats[0]["grad_norm"], "updates": updates}, out_path)
    dist.barrier()  # neither rank tears gloo down while its peer still talks (a SIGABRT seen once under load)
    dist.destroy_process_group()


def test_fsdp_two_gloo_ranks_equal_one_process(tmp_path):
    """FSDP2 over 2 gloo ranks with uneven rows (so idle forward/backward passes) == 1 process
    on the union: greedy samples, logp_old, and the parameters after one optimizer step."""
    out = tmp_path / "params.pt"
    spawn_two_ranks(_fsdp_worker, str(out))
    two = torch.load(out, weights_only=True)
    torch.set_num_threads(1)
    policy, cfg, exp = make_setup("cispo")
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    optimizer = make_optimizer(policy.model, cfg.optim)
    one_trainer = trainer(policy, cfg, optimizer, DistInfo())
    stats, updates = one_trainer.update(exp), one_trainer.update_count
    one = policy.model.state_dict()
    assert any(not torch.equal(one[k], before[k]) for k in one)
    assert two["updates"] == updates == 1
    assert two["grad_norm"] == pytest.approx(stats[0]["grad_norm"], rel=1e-5)  # summed, not averaged
    assert set(two["params"]) == set(one)
    for k in one:
        assert torch.allclose(one[k], two["params"][k], atol=1e-6, rtol=1e-5), k


def test_fill_groups_keeps_generating_while_another_rank_does():
    """Sharded weights: a rank with its groups idles through the other ranks' extra rounds."""
    from cispo.data.prompts import fill_groups

    others = iter([True, True, True, False])  # another rank generates 3 rounds
    generated, idled = [], []
    groups, report = fill_groups(lambda n: list(range(n)), lambda s: generated.append(s) or [[1, 2]] * len(s),
                                 lambda g: True, 2, max_rounds=3,
                                 any_rank=lambda want: next(others) or want, idle=lambda: idled.append(1))
    assert len(generated) == 1 and len(idled) == 2 and report.rounds == 1 and len(groups) == 2


def _cli(tmp_path, run_name, *overrides, steps=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "cispo", "train", f"model.path={tmp_path / 'model'}", "model.device=cpu", f"out_dir={tmp_path}",
           f"run_name={run_name}", f"steps={steps}", "prompts_per_step=4", "group_size=2", "updates_per_batch=2",
           "max_new_tokens=6", "num_eval_prompts=4", "eval.num_samples=1", "progress=false", "threads=1",
           "num_train_prompts=32", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


FSDP_ARGS = ("model.fsdp=true", "checkpoint_every=1", "micro_batch_size=1", "dynamic_sampling=true")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """`torchrun --nproc_per_node 2 -m cispo train model.fsdp=true` for 2 steps (a random tiny
    model, a reward that varies with what it writes so that there is something to learn)."""
    from cispo.models.loading import save_policy

    root = tmp_path_factory.mktemp("fsdp")
    tok = build_tokenizer(arithmetic.ALPHABET)
    save_policy(build_model(tok, size="tiny", seed=0), tok, root / "model")
    (root / "reward.py").write_text("def score(prompt, completion, **sample):\n"
                                    "    return completion.count('1') / max(len(completion), 1)\n")
    rows = [{"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7)} for i in range(40)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = (*FSDP_ARGS, f"data.path={root / 'prompts.jsonl'}", f"data.reward={root / 'reward.py'}:score")
    proc = _cli(root, "fsdp", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, args


def test_torchrun_cli_fsdp(fsdp_run):
    """The run trains, and its checkpoints hold full weights and the optimizer state in the
    format of an unsharded run."""
    from cispo.models.loading import load_policy
    from cispo.records.tracking import read_metrics

    root, _ = fsdp_run
    rows = read_metrics(root / "fsdp" / "metrics.jsonl")
    # a fractional user reward: its held-out mean is eval/reward_mean, not an "accuracy" (only a 0/1 verifier has one)
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[2]
    assert rows[-1]["optim/updates"] == 4 and rows[-1]["optim/grad_norm"] > 0
    ckpt = root / "fsdp" / "checkpoints" / "step_000002"
    model, _ = load_policy(ckpt / "model")  # a plain Hugging Face folder
    assert json.loads((ckpt / "model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)  # optimizer.state_dict()'s format
    params = list(model.parameters())
    assert sorted(optim["state"]) == list(range(len(params))) == optim["param_groups"][0]["params"]
    assert all(optim["state"][i]["exp_avg"].shape == p.shape for i, p in enumerate(params))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["update_count"] == 4


@pytest.mark.slow
def test_torchrun_cli_fsdp_resume_repeats_the_run(fsdp_run, tmp_path):
    """Resuming from step 1's checkpoint redoes step 2 exactly (weights, optimizer state and
    every rank's prompt and generator state come back into the shards)."""
    import shutil

    from cispo.models.loading import load_policy
    from cispo.records.tracking import read_metrics

    root, args = fsdp_run
    shutil.copytree(root / "fsdp", tmp_path / "again")
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step_000002")
    proc = _cli(tmp_path, "again", *args, f"model.path={root / 'model'}", "--resume")  # the run's own model
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, _ = load_policy(root / "fsdp" / "checkpoints" / "step_000002" / "model")
    got, _ = load_policy(tmp_path / "again" / "checkpoints" / "step_000002" / "model")
    for (k, a), b in zip(want.state_dict().items(), got.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
    first = read_metrics(root / "fsdp" / "metrics.jsonl")[-1]
    again = read_metrics(tmp_path / "again" / "metrics.jsonl")[-1]
    assert again["step"] == 2 and again["objective/loss"] == pytest.approx(first["objective/loss"], rel=1e-5)


def test_reduce_over_ranks_sums_counts_and_averages_the_rest():
    from cispo.training.metrics import reduce_over_ranks

    nan = float("nan")
    out = reduce_over_ranks([
        {"rollout/reward_errors": 1.0, "rollout/groups_kept": 3.0, "rollout/response_length_max": 9.0,
         "rollout/accuracy": 0.5, "rollout/fork_rate": nan, "perf/tokens_per_s": 100.0},
        {"rollout/reward_errors": 2.0, "rollout/groups_kept": 1.0, "rollout/response_length_max": 4.0,
         "rollout/accuracy": 0.25, "rollout/fork_rate": 0.5, "perf/tokens_per_s": 50.0, "only/here": 7.0},
    ])
    assert out["rollout/reward_errors"] == 3.0 and out["rollout/groups_kept"] == 4.0
    assert out["perf/tokens_per_s"] == 150.0 and out["rollout/response_length_max"] == 9.0
    assert out["rollout/accuracy"] == 0.375 and out["rollout/fork_rate"] == 0.5 and out["only/here"] == 7.0
    undefined = reduce_over_ranks([{"rollout/fork_rate": nan, "rollout/reward_errors": nan}, {}])
    assert math.isnan(undefined["rollout/fork_rate"]) and math.isnan(undefined["rollout/reward_errors"])
    # per fork string: counts summed, shares averaged
    forks = reduce_over_ranks([{"fork/wait/count": 2.0, "fork/wait/pos_above_k2": 1.0, "fork/let_me_check/tokens_k1": 1.0,  # noqa: E501
                                "fork/wait/frac_ppo_dropped_k2": 0.5, "fork/wait/pos_mass_above": 0.2},
                               {"fork/wait/count": 3.0, "fork/wait/pos_above_k2": 2.0, "fork/let_me_check/tokens_k1": 4.0,  # noqa: E501
                                "fork/wait/frac_ppo_dropped_k2": 1.0, "fork/wait/pos_mass_above": 0.4}])
    assert forks["fork/wait/count"] == 5.0 and forks["fork/wait/pos_above_k2"] == 3.0
    assert forks["fork/let_me_check/tokens_k1"] == 5.0
    assert forks["fork/wait/frac_ppo_dropped_k2"] == 0.75 and forks["fork/wait/pos_mass_above"] == pytest.approx(0.3)


def test_close_distributed_leaves_the_process_group(tmp_path):
    from cispo.foundations.distributed import close_distributed

    close_distributed()  # no group: a no-op
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    assert dist.is_initialized()
    close_distributed()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'again'}", rank=0, world_size=1)
    close_distributed(synchronize=True)  # after a run that ended well: every rank waits, then leaves
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------
# FSDP2 mixed precision and CPU offload (model.dtype=bfloat16, model.fsdp_offload)
# ---------------------------------------------------------------------------------------


def _fsdp_precision_worker(rank, world, port, out_path):
    from torch.distributed import fsdp

    from cispo.foundations.distributed import shard_model
    from cispo.training.setup import fsdp_settings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    info = DistInfo(rank, world, 0)
    policy, _, exp = make_setup("cispo")
    cfg = apply_overrides(TrainConfig(), ["model.dtype=bfloat16", "model.fsdp=true", "model.fsdp_offload=true",
                                          "updates_per_batch=1", "micro_batch_size=3", "lr=1e-2", "warmup_updates=0",
                                          "group_size=2"])
    calls, seen = [], {}
    real = fsdp.fully_shard

    def recording(module, **kw):  # the exact arguments shard_model gives FSDP2
        mp_, off = kw["mp_policy"], kw["offload_policy"]
        calls.append((type(module).__name__, str(mp_.param_dtype), str(mp_.reduce_dtype), type(off).__name__))
        return real(module, **kw)

    fsdp.fully_shard = recording
    model = policy.model
    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, a: seen.setdefault("decoder_weight", str(m.weight.dtype)) and None)
    model.model.norm.register_forward_pre_hook(
        lambda m, a: seen.setdefault("root_weight", str(m.weight.dtype)) and None)
    try:
        shard_model(model, info, torch.device("cpu"), **fsdp_settings(cfg, torch.bfloat16))
    finally:
        fsdp.fully_shard = real
    policy.autocast = torch.bfloat16  # what load_policy_for gives model.dtype=bfloat16 (FP32 master weights)
    before = [p.full_tensor().clone() for p in model.parameters()]
    optimizer = make_optimizer(model, cfg.optim)
    grads, step = set(), optimizer.step

    def recorded_step(*a, **k):  # the gradients the AdamW step sees
        grads.update(str(p.grad.dtype) for p in model.parameters() if p.grad is not None)
        return step(*a, **k)

    optimizer.step = recorded_step
    mine = exp.select(torch.tensor(UNEVEN[rank]))
    stats = trainer(policy, cfg, optimizer, info, preset("cispo")).update(mine)
    params = list(model.parameters())
    out = {"calls": calls, "seen": seen, "shard_dtypes": sorted({str(p.dtype) for p in params}),
           "grad_dtypes": sorted(grads),
           "shard_devices": sorted({p.to_local().device.type for p in params}),
           "changed": any(not torch.equal(p.full_tensor(), b) for p, b in zip(params, before)),
           "grad_norm": stats[0]["grad_norm"]}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_mixed_precision_gathers_layers_in_bf16_over_fp32_shards(tmp_path):
    """model.dtype=bfloat16 with model.fsdp: the decoder layers get MixedPrecisionPolicy(bf16, reduce fp32)
    and gather bf16 weights; the root (embeddings, norm, head) stays FP32; shards, gradients and the
    AdamW step stay FP32; model.fsdp_offload=true adds CPUOffloadPolicy. One update on 2 gloo ranks."""
    out = tmp_path / "precision.json"
    spawn_two_ranks(_fsdp_precision_worker, str(out))
    got = json.loads(out.read_text())
    layers = [c for c in got["calls"] if c[0] == "LlamaDecoderLayer"]
    assert len(layers) == 2 and all(c[1:] == ["torch.bfloat16", "torch.float32", "CPUOffloadPolicy"] for c in layers)
    assert got["calls"][-1] == ["LlamaForCausalLM", "None", "None", "CPUOffloadPolicy"]  # the root: FP32
    assert got["seen"] == {"decoder_weight": "torch.bfloat16", "root_weight": "torch.float32"}
    assert got["shard_dtypes"] == got["grad_dtypes"] == ["torch.float32"] and got["shard_devices"] == ["cpu"]
    assert got["changed"] and math.isfinite(got["grad_norm"]) and got["grad_norm"] > 0


# ---------------------------------------------------------------------------------------
# vLLM under torchrun: one engine per rank (a stand-in engine, tests/fake_vllm.py)
# ---------------------------------------------------------------------------------------


def _vllm_worker(rank, world, port, model_dir, out_dir):
    from cispo.foundations.distributed import shard_model
    from cispo.rollout import VLLMSampler
    from cispo.training.setup import vllm_settings
    from tests import fake_vllm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    info = DistInfo(rank, world, rank)
    cfg = apply_overrides(TrainConfig(), ["rollout.engine=vllm", "seed=5", "rollout.vllm_sleep=true"])
    with pytest.MonkeyPatch.context() as patch:
        fake_vllm.install(patch)
        patch.setattr(torch.cuda, "set_device", lambda d: fake_vllm.DEVICE_LOG.append(("trainer", str(d))))
        sampler = VLLMSampler(model_dir, eos_token_id=1, pad_token_id=0,
                              **vllm_settings(cfg, info, torch.device("cuda", rank)))
        # FSDP2 + vLLM: each rank's engine takes the full weights, all-gathered one tensor at a time
        model = fake_vllm.load_hf(model_dir)
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.add_(0.01 * (i + 1))
        full = {k: v.clone() for k, v in model.state_dict().items()}
        shard_model(model, info, torch.device("cpu"), param_dtype=torch.bfloat16)
        pushed = sampler.update_weights(model)
        engine = sampler.llm.engine_model.hf.state_dict()
        out = {"kwargs": sampler.llm.kwargs, "env": sampler.llm.env, "engine_device": sampler.llm.device,
               "device_log": fake_vllm.DEVICE_LOG, "process_group": sampler.llm.process_group, "pushed": pushed,
               "same_weights": sorted(engine) == sorted(full) and all(torch.equal(engine[k], full[k]) for k in full)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f, default=str)
    dist.barrier()
    dist.destroy_process_group()


def test_vllm_engine_per_rank_under_two_gloo_ranks(tmp_path):
    """torchrun + rollout.engine=vllm: each rank builds its engine with the external launcher, its own
    seed and RANK / LOCAL_RANK / WORLD_SIZE (so vLLM puts it on cuda:LOCAL_RANK inside the trainer's
    process group, as TRL does), keeps its own device, and takes the full weights of an FSDP2 model."""
    from cispo.models.loading import save_policy

    tok = build_tokenizer(arithmetic.ALPHABET)
    save_policy(build_model(tok, size="tiny", seed=0), tok, tmp_path / "model")
    spawn_two_ranks(_vllm_worker, str(tmp_path / "model"), str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        kw = got["kwargs"]
        assert kw["distributed_executor_backend"] == "external_launcher" and kw["seed"] == 5 + 1000 * rank
        assert kw["enable_sleep_mode"] is True and kw["hf_overrides"] == {"head_dtype": "float32"}
        assert got["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                              "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        assert got["process_group"] == [rank, 2]  # built inside the trainer's process group
        assert got["engine_device"] == f"cuda:{rank}" and got["device_log"][-1] == ["trainer", f"cuda:{rank}"]
        assert got["same_weights"] and got["pushed"] > 0
