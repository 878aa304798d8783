"""docs/real-models.md's "One GPU node" recipe, examples/qwen7b-dapo-math-8gpu-vllm.yaml (vLLM colocated, sleep
level 2, FP32 head on both sides, FSDP2 mixed precision): each of its GPU settings reaches its destination.

vLLM's place is taken by the stand-in engine of ``tests/fake_vllm.py`` (it accepts only vLLM 0.33.0's
``LLM`` arguments); the run is on a CPU with gloo. Not run on a GPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from cispo.config.train import TrainConfig, load_yaml
from cispo.data.tasks import arithmetic
from cispo.foundations.distributed import DistInfo
from cispo.models.loading import build_model, build_tokenizer, precision
from cispo.training.setup import fsdp_settings, vllm_settings
from tests import fake_vllm

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "qwen7b-dapo-math-8gpu-vllm.yaml"
TESTS = Path(__file__).resolve().parents[1]

CHECKED = {  # every GPU-path setting of the recipe -> the test below that follows it to its destination
    "model.device": "the engine's device under torchrun (test_distributed) and the run below",
    "model.dtype": "vllm.LLM(dtype=) and FSDP2's param_dtype",
    "model.fp32_lm_head": "vllm.LLM(hf_overrides={'head_dtype': 'float32'}) and the trainer's policy_logprobs",
    "model.fsdp": "the torchrun run below shards the model",
    "model.fsdp_offload": "fsdp_settings(offload=)",
    "model.gradient_checkpointing": "the policy load_policy_for builds",
    "rollout.engine": "the engine built in the run below",
    "rollout.vllm_gpu_memory_utilization": "vllm.LLM(gpu_memory_utilization=)",
    "rollout.vllm_sleep": "vllm.LLM(enable_sleep_mode=) and the trainer's sleep calls",
    "rollout.vllm_sleep_level": "LLM.sleep(level=) of the trainer's sleep calls",
    "rollout.vllm_max_model_len": "vllm.LLM(max_model_len=)",
    "rollout.vllm_max_num_batched_tokens": "vllm.LLM(max_num_batched_tokens=)",
}


def recipe_text() -> str:
    return RECIPE.read_text()


def recipe(tmp_path) -> TrainConfig:
    return load_yaml(TrainConfig, RECIPE)


def _keys(tree: dict, prefix: str = "") -> set[str]:
    return {k for key, v in tree.items()
            for k in (_keys(v, f"{prefix}{key}.") if isinstance(v, dict) else {f"{prefix}{key}"})}


def test_every_gpu_setting_of_the_recipe_is_followed():
    keys = _keys(yaml.safe_load(recipe_text()))
    gpu = {k for k in keys if k.startswith("model.") and k != "model.path" or k.startswith("rollout.vllm_")
           or k == "rollout.engine"}
    assert gpu == set(CHECKED), sorted(gpu ^ set(CHECKED))


def test_recipe_settings_reach_each_ranks_engine_and_fsdp(tmp_path, tiny_model, monkeypatch):
    from cispo.rollout import VLLMSampler

    cfg = recipe(tmp_path)
    fake_vllm.install(monkeypatch)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING"):  # the sampler sets them:
        monkeypatch.setenv(name, "0")  # restored after the test (a WORLD_SIZE left behind breaks later runs)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: fake_vllm.DEVICE_LOG.append(("trainer", str(d))))
    for rank in (0, 3):  # two of the 8 ranks of `torchrun --nproc_per_node 8`
        sampler = VLLMSampler(tiny_model, eos_token_id=1, pad_token_id=0,
                              **vllm_settings(cfg, DistInfo(rank, 8, rank), torch.device("cuda", rank)))
        kw = sampler.llm.kwargs
        assert kw["dtype"] == "bfloat16" and kw["hf_overrides"] == {"head_dtype": "float32"}
        assert (kw["gpu_memory_utilization"], kw["max_model_len"], kw["max_num_batched_tokens"]) == (0.3, 2048, 4096)
        assert kw["enable_sleep_mode"] is True and kw["distributed_executor_backend"] == "external_launcher"
        assert kw["seed"] == 1000 * rank and sampler.llm.device == f"cuda:{rank}"
        sampler.sleep()  # as the trainer calls it
        assert sampler.llm.calls[-1] == ("sleep", 2)
    # the policy load_policy_for builds from the recipe (on a CPU): FP32 master weights under bf16 autocast,
    # gradient checkpointing, the engine as its sampler
    from cispo.training.run_policy import load_policy_for

    cpu = recipe_with(tmp_path, f"model.path={tiny_model}", "model.device=cpu", "data.path=null", "data.reward=null")
    policy = load_policy_for(cpu, None, torch.device("cpu"))
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in policy.model.modules())
    assert policy.autocast == torch.bfloat16
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    assert isinstance(policy.sampler, VLLMSampler) and policy.sampler.llm.kwargs["dtype"] == "bfloat16"
    _, autocast = precision(cfg.model.dtype, None, cfg.model.master_weights)
    assert autocast == torch.bfloat16
    assert fsdp_settings(cfg, autocast) == {"param_dtype": torch.bfloat16, "offload": False}
    assert fsdp_settings(recipe_with(tmp_path, "model.fsdp_offload=true"), autocast)["offload"] is True


def recipe_with(tmp_path, *overrides) -> TrainConfig:
    from cispo.config.train import apply_overrides

    return apply_overrides(recipe(tmp_path), list(overrides))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CPU_SIZES = ("model.device=cpu", "data.path=null", "data.reward=null", "data.answer_field=answer", "steps=2",
             "rollout.max_new_tokens=6", "rollout.prompts_per_step=4", "rollout.group_size=2",
             "algo.updates_per_batch=2", "algo.micro_batch_size=2", "data.num_train_prompts=32",
             "data.num_eval_prompts=4", "eval.num_samples=1", "eval.every=0", "checkpoint_every=0",
             "progress=false", "threads=1", "rollout.dynamic_sampling=false")
"""What the CPU run changes in the recipe: the device, the data (the built-in task, whose groups a random
tiny model rarely makes informative: dynamic sampling off) and the sizes."""


def test_the_recipe_runs_under_torchrun_with_a_stand_in_engine(tmp_path, tiny_model):
    """`torchrun --nproc_per_node 2 -m cispo train --config examples/qwen7b-dapo-math-8gpu-vllm.yaml` (CPU sizes):
    FSDP2 over bf16 autocast, one engine per rank, sleep level 2 every step, the weights pushed through
    reload_weights."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(fake_vllm.SITECUSTOMIZE)
    log = tmp_path / "engine.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAKE_VLLM_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(TESTS), str(REPO)])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "cispo", "train", "--config", str(RECIPE), f"model.path={tiny_model}",
           f"out_dir={tmp_path}", "run_name=node", *CPU_SIZES]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    for rank in ("0", "1"):
        mine = [r["call"] for r in rows if r["rank"] == rank]
        built = mine[0]
        kw = built["built"]
        assert kw["dtype"] == "bfloat16" and built["hf_overrides"] == {"head_dtype": "float32"}
        assert kw["distributed_executor_backend"] == "external_launcher" and kw["seed"] == 1000 * int(rank)
        assert (kw["gpu_memory_utilization"], kw["max_model_len"], kw["max_num_batched_tokens"]) == (0.3, 2048, 4096)
        assert built["env"]["LOCAL_RANK"] == rank and built["process_group"] == [int(rank), 2]
        steps = [mine[i:] for i, c in enumerate(mine) if c == ["sleep", 2]]
        assert len(steps) == 2  # once per step, at level 2
        for after in steps:  # then: wake the weights, push them through reload_weights, reset the prefix cache
            assert after[1:4] == [["wake_up", ["weights"]], ["reload_weights", "iterator"], "reset_prefix_cache"]
        assert ["reload_weights", "disk"] not in mine
    from cispo.records.tracking import read_metrics

    metrics = read_metrics(tmp_path / "node" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2] and all(r["perf/weight_sync_s"] >= 0 for r in metrics[1:])
    meta = json.loads((tmp_path / "node" / "meta.json").read_text())["sampler"]
    assert meta["fp32_head_in_engine"] and meta["weight_push"] == "reload_weights" and meta["sleep_level"] == 2
    assert meta["vllm_version"] == "0.33.0"


def test_the_trainer_side_of_the_fp32_head(tmp_path, monkeypatch):
    """model.fp32_lm_head reaches the trainer's log-prob passes too (policy_logprobs' fp32_head)."""
    import cispo.training.trainer as tr

    cfg = recipe(tmp_path)

    class Seen(Exception):
        pass

    def spy(model, exp, temperature, fp32_head, *args, **kwargs):
        raise Seen(fp32_head)

    monkeypatch.setattr(tr, "policy_logprobs", spy)
    with pytest.raises(Seen) as got:
        trainer = tr.Trainer(_policy(), None, cfg.algo.objective.resolve(), cfg, torch.Generator())
        trainer.compute_logp_old(_experience())
    assert got.value.args == (True,)


def _policy():
    from cispo.models.policy import Policy
    from cispo.rollout import TorchSampler

    tok = build_tokenizer(arithmetic.ALPHABET)
    model = build_model(tok, size="tiny", seed=0)
    return Policy(model, tok, TorchSampler(model, tok.eos_token_id, tok.pad_token_id), torch.device("cpu"))


def _experience():
    from cispo.foundations.experience import Completion, collate

    comps = [Completion({"prompt": ""}, [3, 4, 5], torch.tensor([6, 7]), torch.zeros(2), "eos", "") for _ in range(2)]
    return collate(comps, torch.zeros(2), 0)
