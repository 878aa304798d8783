"""Data parallelism on CPU with gloo: 2 ranks == 1 process on the same batch."""

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cispo.config import TrainConfig, apply_overrides
from cispo.distributed import DistInfo
from cispo.experience import Completion, collate
from cispo.models import build_model, build_tokenizer
from cispo.objective import preset
from cispo.rollout import TorchSampler
from cispo.tasks import arithmetic
from cispo.trainer import Policy, compute_logp_old, make_optimizer, update_policy

B = 8  # 4 groups of 2, split 2 + 2 groups over the ranks


def make_setup(objective):
    torch.manual_seed(0)
    tok = build_tokenizer(arithmetic.ALPHABET)
    model = build_model(tok, size="tiny", seed=0)
    cfg = apply_overrides(TrainConfig(), [f"objective={objective}", "updates_per_batch=1", "micro_batch_size=3",
                                          "lr=1e-2", "warmup_updates=0", "group_size=2"])
    policy = Policy(model, tok, TorchSampler(model, tok.eos_token_id, tok.pad_token_id), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    comps = []
    for i in range(B):
        n_p, n_r = 3 + i % 4, 2 + (5 * i) % 7
        comps.append(Completion({"prompt": ""}, torch.randint(3, len(tok), (n_p,), generator=g).tolist(),
                                torch.randint(3, len(tok), (n_r,), generator=g), torch.zeros(n_r), "eos", ""))
    exp = collate(comps, torch.randn(B, generator=g), tok.pad_token_id)
    # logp_old off-policy enough that masks and caps bite
    exp.logp_old = (compute_logp_old(policy, exp, cfg) + 0.5 * torch.randn(exp.response_mask.shape, generator=g)) \
        * exp.response_mask
    return policy, cfg, exp


def run_update(policy, cfg, exp, info):
    optimizer = make_optimizer(policy.model, cfg)
    update_policy(policy, optimizer, exp, preset(cfg.algo.objective), cfg, torch.Generator().manual_seed(0), 0, None,
                  info)
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


def _worker(rank, world, port, objective, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    policy, cfg, exp = make_setup(objective)
    rows = torch.arange(B).reshape(world, -1)[rank]  # whole groups per rank
    params = run_update(policy, cfg, exp.select(rows), DistInfo(rank, world, 0))
    if rank == 0:
        torch.save(params, out_path)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("objective", ["cispo", "grpo"])
def test_two_gloo_ranks_equal_one_process(objective, tmp_path):
    out = tmp_path / "params.pt"
    mp.spawn(_worker, args=(2, free_port(), objective, str(out)), nprocs=2, join=True)
    two = torch.load(out, weights_only=True)
    torch.set_num_threads(1)
    policy, cfg, exp = make_setup(objective)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    one = run_update(policy, cfg, exp, DistInfo())
    assert any(not torch.equal(one[k], before[k]) for k in one)  # the step did something
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-6, rtol=1e-5), k


def test_torchrun_cli_two_ranks(tmp_path):
    """`torchrun --nproc_per_node 2 -m cispo train` end to end (a random tiny model)."""
    from cispo.models import save_policy

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
    from cispo.tracking import read_metrics

    rows = read_metrics(tmp_path / "ddp" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["optim/updates"] == 4
    import json

    state = json.loads((tmp_path / "ddp" / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and len(state["streams"]) == 2
