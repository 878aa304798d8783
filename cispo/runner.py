"""Everything around the RL loop: set-up, run folder, resume, evaluation schedule,
checkpoints, progress bar, summary and plot. The algorithm itself is in ``trainer.py``."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cispo.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from cispo.config import TrainConfig, save_yaml
from cispo.data import PromptStream
from cispo.rollout import TorchSampler
from cispo.tracking import JsonlSink, read_metrics
from cispo.trainer import (
    Policy,
    default_max_new_tokens,
    evaluate,
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


def load_policy_for(cfg: TrainConfig, task, device: torch.device) -> Policy:
    from cispo.models import ensure_builtin_model, load_policy

    path = cfg.model.path or ensure_builtin_model(task.name, progress=cfg.progress)
    model, tokenizer = load_policy(path, dtype=cfg.model.dtype, device=device)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer of {path} has no EOS token: responses could never end")
    if tokenizer.pad_token_id is None:  # common for base models: pad with EOS (masked out anyway)
        print(f"cispo: tokenizer of {path} has no pad token; using its EOS token for padding", file=sys.stderr)
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
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
    """Run (or resume) the training run described by ``cfg``."""
    from transformers.utils import logging as hf_logging

    from cispo.data import load_source

    hf_logging.disable_progress_bar()  # our own bar is the one to watch
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.model.device)
    task = load_source(cfg.data, cfg.rollout.max_new_tokens)
    sampling = sampling_config(cfg, default_max_new_tokens(task))
    cfg = replace(cfg, rollout=replace(cfg.rollout, max_new_tokens=sampling.max_new_tokens))
    obj = make_objective(cfg)
    run_dir = prepare_run_dir(cfg, resume, overwrite)
    policy = load_policy_for(cfg, task, device)
    optimizer = make_optimizer(policy.model, cfg)
    stream = PromptStream(task.train_samples(cfg.data.seed, cfg.data.num_train_prompts), seed=cfg.seed)
    eval_samples = task.eval_samples(cfg.data.seed, cfg.data.num_eval_prompts)
    generators = {
        "sample": torch.Generator(device=device).manual_seed(cfg.seed),
        "shuffle": torch.Generator().manual_seed(cfg.seed + 1),
    }
    fork_id = fork_token_id(policy.tokenizer, task)
    sink = JsonlSink(run_dir / "metrics.jsonl")

    start, update_count = 0, 0
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        state, tensors = load_checkpoint(ckpt, policy.model, optimizer)
        start, update_count = state["step"], state["update_count"]
        stream.load_state_dict(state["stream"])
        for name, gen in generators.items():
            gen.set_state(tensors[f"generator/{name}"])
        sink.truncate_after(start)
        print(f"cispo: resumed {run_dir} from {ckpt.name}", file=sys.stderr)
    else:
        if resume:
            print(f"cispo: no checkpoint in {run_dir}; starting from step 0", file=sys.stderr)
        sink.truncate_after(-1)
        write_run_info(run_dir, cfg, sampling, obj)
        sink.log(0, evaluate(policy, eval_samples, task.reward, task.used_fork, cfg, sampling.max_new_tokens,
                             seed=cfg.seed))

    def checkpoint(step: int) -> None:
        state = {"step": step, "update_count": update_count, "stream": stream.state_dict()}
        tensors = {f"generator/{n}": g.get_state() for n, g in generators.items()}
        save_checkpoint(run_dir, step, policy.model, policy.tokenizer, optimizer, state, tensors,
                        keep=cfg.keep_checkpoints)

    bar = _progress(cfg, start)
    for step in range(start + 1, cfg.steps + 1):
        metrics, update_count = rl_step(policy, optimizer, stream, task, cfg, obj, sampling, generators,
                                        update_count, fork_id)
        if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            metrics.update(evaluate(policy, eval_samples, task.reward, task.used_fork, cfg,
                                    sampling.max_new_tokens, seed=cfg.seed + step))
        sink.log(step, metrics)
        if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
            checkpoint(step)
        _advance(bar, metrics)
    if bar is not None:
        bar.close()
    summary = summarize(read_metrics(run_dir / "metrics.jsonl"))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    _plot(run_dir, cfg)
    return RunResult(run_dir, summary)


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
