"""Everything around the RL loop: set-up, run folder, resume, evaluation schedule,
checkpoints, progress bar, summary and plot. The algorithm itself is in ``trainer.py``."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cispo.checkpoint import gather_full_state, latest_checkpoint, load_checkpoint, save_checkpoint
from cispo.config import TrainConfig, save_yaml, to_dict
from cispo.data import PromptStream
from cispo.distributed import any_rank, barrier, broadcast_parameters, gather_objects, init_distributed, shard_model
from cispo.rollout import TorchSampler
from cispo.tracking import make_sinks, read_metrics
from cispo.trainer import (
    Policy,
    default_max_new_tokens,
    evaluate,
    fit_prompts,
    fork_token_id,
    make_objective,
    make_optimizer,
    rl_step,
    sampling_config,
)

PROGRESS_KEYS = {  # metric -> short label on the progress bar
    "rollout/reward_mean": "reward",
    "rollout/fork_rate": "fork",
    "objective/frac_capped": "capped",
    "eval/accuracy": "eval_acc",
}


@dataclass
class RunResult:
    run_dir: Path
    summary: dict


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def run_name(cfg: TrainConfig) -> str:
    data = Path(cfg.data.path).stem if cfg.data.path else cfg.data.task
    return cfg.run_name or f"{cfg.algo.objective}__{data}__seed{cfg.seed}"


def load_policy_for(cfg: TrainConfig, task, device: torch.device, load_device: torch.device | None = None) -> Policy:
    """The policy for ``device``; its weights are loaded onto ``load_device`` (default: ``device``),
    e.g. the CPU for a model that FSDP then shards onto the GPUs."""
    from cispo.builtin_model import ensure_builtin_model
    from cispo.models import load_policy

    path = cfg.model.path or ensure_builtin_model(task.name, progress=cfg.progress)
    model, tokenizer = load_policy(path, dtype=cfg.model.dtype, device=load_device or device)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer of {path} has no EOS token: responses could never end")
    if tokenizer.pad_token_id is None:  # common for base models: pad with EOS (masked out anyway)
        print(f"cispo: tokenizer of {path} has no pad token; using its EOS token for padding", file=sys.stderr)
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.model.lora_rank:
        from cispo.lora import apply_lora

        model = apply_lora(model, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha,
                           dropout=cfg.model.lora_dropout, target_modules=cfg.model.lora_target_modules)
    if cfg.rollout.engine == "vllm":
        from cispo.rollout import VLLMSampler

        sampler = VLLMSampler(str(path), tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id,
                              gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
                              enable_sleep_mode=cfg.rollout.vllm_sleep, seed=cfg.seed)
    else:
        sampler = TorchSampler(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return Policy(model, tokenizer, sampler, device, chat_template=cfg.model.chat_template)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_run_info(run_dir: Path, cfg: TrainConfig, sampling, obj) -> None:
    save_yaml(cfg, run_dir / "config.yaml")
    info = {
        "seed": cfg.seed,
        "git_commit": git_commit(),
        "command": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "sampling": sampling.__dict__,
        "objective": obj.__dict__,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (run_dir / "meta.json").write_text(json.dumps(info, indent=1, default=str))


def prepare_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> Path:
    run_dir = Path(cfg.out_dir).expanduser() / run_name(cfg)
    if run_dir.exists() and not resume:
        if not overwrite and any(run_dir.iterdir()):
            raise FileExistsError(
                f"run folder {run_dir} already exists; pass --resume to continue it, --overwrite to start over, "
                f"or set run_name=... / out_dir=..."
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False) -> RunResult:
    """Run (or resume) the training run described by ``cfg`` (under ``torchrun``: one rank)."""
    from transformers.utils import logging as hf_logging

    from cispo.data import load_source

    hf_logging.disable_progress_bar()  # our own bar is the one to watch
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.model.device)
    dist_info = init_distributed(device.type)
    if dist_info.enabled and device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
        torch.cuda.set_device(device)
    if cfg.rollout.prompts_per_step % dist_info.world_size:
        raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                         f"number of processes ({dist_info.world_size})")
    main = dist_info.is_main
    task = load_source(cfg.data, cfg.rollout.max_new_tokens)
    sampling = sampling_config(cfg, default_max_new_tokens(task))
    cfg = replace(cfg, rollout=replace(cfg.rollout, max_new_tokens=sampling.max_new_tokens))
    obj = make_objective(cfg)
    run_dir = prepare_run_dir(cfg, resume, overwrite) if main else Path(cfg.out_dir).expanduser() / run_name(cfg)
    if main and cfg.model.path is None:
        from cispo.builtin_model import ensure_builtin_model

        ensure_builtin_model(task.name, progress=cfg.progress)  # once, before the other ranks load it
    barrier(dist_info)
    sharded = cfg.model.fsdp and dist_info.enabled
    policy = load_policy_for(cfg, task, device, torch.device("cpu") if sharded else None)
    broadcast_parameters(policy.model, dist_info)
    if sharded:  # FSDP2: every rank keeps 1/N of the weights, gradients and optimizer state
        shard_model(policy.model, dist_info, device)
        policy.sampler.all_ranks_done = lambda done: not any_rank(not done, dist_info)
    optimizer = make_optimizer(policy.model, cfg)  # after sharding: it holds the shards
    # each rank samples whole groups from its own shard of the prompts, with its own seeds
    train_samples = fit_prompts(policy, task.train_samples(cfg.data.seed, cfg.data.num_train_prompts),
                                sampling.max_new_tokens, "training")
    stream = PromptStream(train_samples[dist_info.rank :: dist_info.world_size], seed=cfg.seed)
    eval_samples = fit_prompts(policy, task.eval_samples(cfg.data.seed, cfg.data.num_eval_prompts),
                               sampling.max_new_tokens, "held-out")
    rank_seed = cfg.seed + 1000 * dist_info.rank
    generators = {
        "sample": torch.Generator(device=device).manual_seed(rank_seed),
        "shuffle": torch.Generator().manual_seed(rank_seed + 1),
    }
    fork_id = fork_token_id(policy.tokenizer, task)
    sink = make_sinks(cfg.trackers, run_dir, run_name(cfg), to_dict(cfg)) if main else None

    def evaluate_now(step: int) -> dict:  # sharded weights: every rank runs the model with rank 0
        out = evaluate(policy, eval_samples, task.reward, task.used_fork, cfg, sampling.max_new_tokens,
                       seed=cfg.seed + step) if main or sharded else {}
        barrier(dist_info)
        return out

    start, update_count = 0, 0
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        state, tensors = load_checkpoint(ckpt, policy.model, optimizer)
        if state.get("world_size", 1) != dist_info.world_size:
            raise ValueError(f"checkpoint {ckpt} was written by {state.get('world_size', 1)} processes; "
                             f"resume it with the same number (now {dist_info.world_size})")
        start, update_count = state["step"], state["update_count"]
        sync_sampler(policy)
        stream.load_state_dict(state["streams"][dist_info.rank])
        for name, gen in generators.items():
            gen.set_state(tensors[f"generator/{name}/{dist_info.rank}"])
        if main:
            sink.truncate_after(start)
            print(f"cispo: resumed {run_dir} from {ckpt.name}", file=sys.stderr)
    else:
        if resume and main:
            print(f"cispo: no checkpoint in {run_dir}; starting from step 0", file=sys.stderr)
        if main:
            sink.truncate_after(-1)
            write_run_info(run_dir, cfg, sampling, obj)
        row = evaluate_now(0)
        if main:
            sink.log(0, row)

    def checkpoint(step: int) -> None:
        streams = gather_objects(stream.state_dict(), dist_info)
        gens = gather_objects({n: g.get_state().cpu() for n, g in generators.items()}, dist_info)
        full_state = gather_full_state(policy.model, optimizer) if sharded else None  # on rank 0's CPU
        if main:
            state = {"step": step, "update_count": update_count, "streams": streams,
                     "world_size": dist_info.world_size}
            tensors = {f"generator/{n}/{r}": t for r, g in enumerate(gens) for n, t in g.items()}
            save_checkpoint(run_dir, step, policy.model, policy.tokenizer, optimizer, state, tensors,
                            keep=cfg.keep_checkpoints, full_state=full_state)
        barrier(dist_info)

    stop = StopRequest()
    bar = _progress(cfg, start) if main else None
    bad_steps = 0
    with stop.installed(), (sink if sink is not None else contextlib.nullcontext()):
        for step in range(start + 1, cfg.steps + 1):
            metrics, update_count = rl_step(policy, optimizer, stream, task, cfg, obj, sampling, generators,
                                            update_count, fork_id, dist_info)
            metrics = mean_over_ranks(metrics, dist_info)
            bad_steps = bad_steps + 1 if metrics.get("optim/skipped", 0) >= cfg.algo.updates_per_batch else 0
            if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                metrics.update(evaluate_now(step))
            if main:
                sink.log(step, metrics)
            if bad_steps >= cfg.max_bad_steps:
                checkpoint(step)  # every update of these steps was skipped: the weights are the last good ones
                raise FloatingPointError(
                    f"{bad_steps} consecutive steps had only non-finite gradients (step {step}); "
                    f"the last good weights are checkpointed in {run_dir / 'checkpoints'}. Lower optim.lr or "
                    f"check the reward / data.")
            if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stop.requested:
                checkpoint(step)
            _advance(bar, metrics)
            if stop.requested:
                if bar is not None:
                    bar.close()
                raise KeyboardInterrupt(f"stopped by {stop.signal_name} after step {step}; checkpoint saved, "
                                        f"continue with --resume")
    if bar is not None:
        bar.close()
    summary = {}
    if main:
        summary = summarize(read_metrics(run_dir / "metrics.jsonl"))
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        _plot(run_dir, cfg)
    barrier(dist_info)
    return RunResult(run_dir, summary)


def sync_sampler(policy) -> None:
    """Push the trainer's weights to a separate inference engine (vLLM); no-op for torch."""
    if hasattr(policy.sampler, "update_weights"):
        policy.sampler.update_weights(policy.model)


def mean_over_ranks(metrics: dict, info) -> dict:
    """Each metric averaged over the ranks that report it (ranks hold different groups)."""
    if not info.enabled:
        return metrics
    everyone = gather_objects(metrics, info)
    keys = sorted({k for m in everyone for k in m})
    out = {}
    for k in keys:
        values = [m[k] for m in everyone if m.get(k) is not None and not _isnan(m[k])]
        out[k] = sum(values) / len(values) if values else float("nan")
    return out


def _isnan(x) -> bool:
    return isinstance(x, float) and x != x


class StopRequest:
    """SIGINT / SIGTERM ask the loop to checkpoint after the current step and exit;
    a second signal exits at once."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        print(f"\ncispo: {self.signal_name} received; saving a checkpoint after this step "
              f"(send it again to exit at once)", file=sys.stderr)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def summarize(rows: list[dict]) -> dict:
    """Held-out metrics before (step 0) and after (last evaluation)."""
    evals = [r for r in rows if "eval/accuracy" in r]
    if not evals:
        return {}
    first, last = evals[0], evals[-1]
    keys = [k for k in first if k.startswith("eval/")]
    return {"steps": last["step"], **{k: {"before": first.get(k), "after": last.get(k)} for k in keys}}


def format_summary(summary: dict) -> str:
    lines = [f"after {summary.get('steps', 0)} steps (held-out, before -> after):"]
    for k, v in summary.items():
        if isinstance(v, dict):
            b, a = v["before"], v["after"]
            fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
            lines.append(f"  {k:32s} {fmt(b)} -> {fmt(a)}")
    return "\n".join(lines)


def _progress(cfg: TrainConfig, start: int):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start, desc="cispo train", unit="step", dynamic_ncols=True)


def _advance(bar, metrics: dict) -> None:
    if bar is None:
        return
    shown = {label: f"{metrics[k]:.3f}" for k, label in PROGRESS_KEYS.items() if k in metrics}
    bar.set_postfix(shown, refresh=False)
    bar.update(1)


def _plot(run_dir: Path, cfg: TrainConfig) -> None:
    try:
        from cispo.plotting import plot_run
    except ImportError:  # matplotlib is optional
        return
    plot_run(read_metrics(run_dir / "metrics.jsonl"), run_dir / "curves.png", title=run_name(cfg))
