"""``cispo sft``: supervised fine-tuning on chat data, the warm start before RL (as ReTool's cold start).

    cispo sft --config examples/calculator_sft.yaml      # the calculator's worked answers -> runs/calculator/sft
    cispo train --config examples/calculator_rl.yaml     # RL from runs/calculator/sft/final

The loss is the mean cross-entropy over T, the assistant's own tokens of a step's conversations
(`cispo.training.sft_data` says which tokens those are; tool, user and system turns are context):

    L = - (1 / |T|) sum_{t in T} log pi(y_t | y_<t)

AdamW (``optim``), ``batch_size`` conversations per optimizer step in a seeded order (epoch e shuffles the
order epoch e - 1 left with ``random.Random(f"{seed}/{e}")``), ``epochs`` passes. A step cut into micro-batches
(``micro_batch_size``) sums their losses, each normalised by the whole step's |T|: the gradient is the unsplit
step's. With the defaults this is, step for step, the study's ``studies/results/agents/warm_start.py``.

The run folder ``out_dir/run_name`` is ``cispo train``'s kind (`cispo.records.runfolder`: the marker, one
process at a time by its lock, ``--overwrite`` and ``--resume`` as there): ``config.yaml``, ``meta.json``,
``metrics.jsonl`` (a row per optimizer step: `METRICS`), ``checkpoints/step_N`` (`cispo.training.checkpoint`'s
format: ``model/`` with LoRA merged, ``adapter/``, the optimizer, torch's generator), ``summary.json`` once
finished, and ``final/``: the fine-tuned model (hard links to the last checkpoint's ``model/``), which ``cispo
train model.path=RUN/final`` starts from. A stop signal checkpoints after the current step; ``--resume``
continues from the newest intact checkpoint with the same conversations in the same order, so the weights
equal an uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cispo.config.engine import ConfigError, to_dict
from cispo.config.sft import SFTConfig
from cispo.foundations.threads import auto_threads
from cispo.records.runfolder import (
    SUMMARY,
    check_run_name,
    prepare_run_folder,
    resume_changes,
    run_lock,
    save_config,
)
from cispo.records.tracking import make_sinks, read_metrics
from cispo.training.checkpoint import Checkpoint, CheckpointError, fsync_file, load_latest_checkpoint, save_checkpoint
from cispo.training.gradients import lr_at
from cispo.training.run import git_commit
from cispo.training.runner import StopRequest
from cispo.training.sft_data import IGNORE, Example, batch_tensors, load_examples, template_marks_assistant

METRICS = {
    "sft/loss": "mean cross-entropy over the step's trained tokens (nats)",
    "sft/tokens": "trained tokens of the step (|T|)",
    "sft/epoch": "passes made over the conversations, as a fraction",
    "optim/lr": "learning rate of the step",
    "optim/grad_norm": "global gradient norm before clipping",
    "optim/updates": "optimizer steps so far",
    "perf/step_s": "seconds of the step",
    "perf/tokens_per_s": "tokens (context included) through the forward and backward per second",
}
"""The row ``metrics.jsonl`` gets for each optimizer step (step 0's: ``sft/conversations``, ``sft/trained_tokens``,
the data's size)."""
RESUME_SAFE = ("checkpoint_every", "keep_checkpoints", "threads", "progress", "trackers", "out_dir", "run_name",
               "model.device")
"""The keys a resumed fine-tune may change (`cispo.records.runfolder.RESUME_SAFE_FIELDS` that it has)."""


@dataclass
class SFTRun:
    """What a fine-tune holds from its set-up to its end."""

    cfg: SFTConfig
    run_dir: Path
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    examples: list[Example]
    device: torch.device
    autocast: torch.dtype | None
    sink: object
    update_count: int = 0

    @property
    def steps_per_epoch(self) -> int:
        return -(-len(self.examples) // self.cfg.batch_size)

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.cfg.epochs

    def batch(self, step: int) -> list[Example]:
        """The conversations of optimizer step ``step`` (1-based): its epoch's seeded order, cut into
        ``batch_size`` pieces."""
        epoch, index = divmod(step - 1, self.steps_per_epoch)
        order = list(range(len(self.examples)))
        for e in range(epoch + 1):  # each epoch shuffles the order the epoch before left
            random.Random(f"{self.cfg.seed}/{e}").shuffle(order)
        size = self.cfg.batch_size
        return [self.examples[i] for i in order[index * size:(index + 1) * size]]


@dataclass
class SFTResult:
    run_dir: Path
    final: Path
    summary: dict


# --------------------------------------------------------------------------- the run folder and its config


def sft_run_name(cfg: SFTConfig) -> str:
    """``run_name``, or ``sft__{task or data file}__seed{seed}``."""
    data = Path(cfg.data.path).stem if cfg.data.path else cfg.data.task
    return cfg.run_name or f"sft__{data}__seed{cfg.seed}"


def sft_run_dir(cfg: SFTConfig) -> Path:
    """``out_dir/run_name`` (the name checked)."""
    return Path(cfg.out_dir).expanduser() / check_run_name(sft_run_name(cfg))


def absolute_paths(cfg: SFTConfig) -> SFTConfig:
    """``cfg`` with ``model.path`` and ``data.path`` made absolute where they name something here, so that the
    run's ``config.yaml`` (and ``--resume``) works from any folder."""
    def local(path: str | None) -> str | None:
        if path is None or path.startswith("builtin:") or not Path(path).expanduser().exists():
            return path
        return os.path.abspath(Path(path).expanduser())

    return replace(cfg, model=replace(cfg.model, path=local(cfg.model.path)),
                   data=replace(cfg.data, path=local(cfg.data.path)))


def resume_sft_config(config_file: str | None, overrides: list[str]) -> SFTConfig:
    """The config of ``cispo sft --resume [--config FILE] key=value ...``: the run's saved ``config.yaml`` with the
    overrides on top (with ``--config``: FILE's config), where it differs from the saved one only in `RESUME_SAFE`
    keys; `ConfigError` naming each other key that differs. A run without ``config.yaml`` yet: the config given."""
    from cispo.config.engine import apply_overrides, load_yaml

    given = load_yaml(SFTConfig, config_file, overrides) if config_file else apply_overrides(SFTConfig(), overrides)
    path = sft_run_dir(given) / "config.yaml"
    if not path.is_file():
        return given
    saved = load_yaml(SFTConfig, path)
    cfg = absolute_paths(given) if config_file else replace(apply_overrides(saved, overrides),
                                                            out_dir=given.out_dir, run_name=sft_run_name(given))
    changed = [(k, a, b) for k, a, b in resume_changes(saved, cfg)
               if not any(k == s or k.startswith(s + ".") for s in RESUME_SAFE)]
    if changed:
        listed = "; ".join(f"{k}: saved {a!r}, given {b!r}" for k, a, b in changed)
        raise ConfigError(f"--resume {path.parent}: a resumed fine-tune keeps its config ({path}), but {listed}. "
                          f"Only these may change: {', '.join(RESUME_SAFE)}")
    return cfg


# --------------------------------------------------------------------------- set-up


def load_model(cfg: SFTConfig, device: torch.device):
    """``(model, tokenizer, autocast dtype or None)``: ``model.path`` (else the task's model) on ``device``,
    in train mode, with LoRA adapters where ``model.lora_rank``; the tokenizer must have a chat template."""
    from cispo.data.tasks import get_task
    from cispo.models.loading import load_policy, precision, saved_dtype
    from cispo.models.packaged import is_packaged, resolve_model_path
    from cispo.training.checkpoint import check_model_folder

    path = cfg.model.path or get_task(cfg.data.task).model
    if not is_packaged(path):
        check_model_folder(path)
    folder = resolve_model_path(path)
    param_dtype, autocast = precision(cfg.model.dtype, saved_dtype(folder))
    model, tokenizer = load_policy(folder, dtype=param_dtype, device=device, dropout=cfg.model.dropout)
    if not tokenizer.chat_template:
        raise ConfigError(f"model.path={path}: its tokenizer has no chat template, which cispo sft renders every "
                          "conversation with: use an instruct model, or add a chat_template to tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.model.gradient_checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    if cfg.model.lora_rank:
        from cispo.models.lora import apply_lora

        model = apply_lora(model, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha,
                           dropout=cfg.model.lora_dropout, target_modules=cfg.model.lora_target_modules)
    model.train()
    return model, tokenizer, autocast


def set_up(cfg: SFTConfig, resume: bool, overwrite: bool) -> SFTRun:
    """Threads and seed, the model, the conversations encoded (all checked before the run folder is touched),
    the run folder, the optimizer and the metric sinks."""
    from transformers.utils import logging as hf_logging

    from cispo.training.run_policy import resolve_device
    from cispo.training.setup import make_optimizer

    hf_logging.disable_progress_bar()  # a line per step is the progress to watch
    cfg = absolute_paths(cfg)
    torch.set_num_threads(auto_threads(cfg.threads))
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.model.device)
    model, tokenizer, autocast = load_model(cfg, device)
    examples = load_examples(cfg.data, tokenizer, cfg.max_length)
    run_dir = prepare_run_folder(Path(cfg.out_dir).expanduser(), sft_run_dir(cfg), resume, overwrite)
    optimizer = make_optimizer(model, cfg.optim)
    sink = make_sinks(cfg.trackers, run_dir, sft_run_name(cfg), to_dict(cfg))
    return SFTRun(cfg, run_dir, model, tokenizer, optimizer, examples, device, autocast, sink)


def fingerprint(examples: list[Example]) -> str:
    """SHA-256 of the encoded conversations, in order: a checkpoint resumes only onto the same ones."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(json.dumps([e.ids, e.labels]).encode())
    return digest.hexdigest()


def write_meta(run: SFTRun) -> None:
    """``config.yaml`` and ``meta.json`` (seed, commit, command, versions, the data's size and fingerprint, how
    the assistant's tokens were found)."""
    save_config(run.cfg, run.run_dir)
    how = ("parts" if run.cfg.data.path is None else
           "template" if template_marks_assistant(run.tokenizer) else "prefixes")
    info = {"seed": run.cfg.seed, "git_commit": git_commit(), "command": sys.argv,
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "conversations": len(run.examples), "trained_tokens": sum(e.trained for e in run.examples),
            "data_sha256": fingerprint(run.examples), "assistant_tokens": how, "steps": run.steps,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    (run.run_dir / "meta.json").write_text(json.dumps(info, indent=1, default=str))


# --------------------------------------------------------------------------- one step


def step_loss(model, batch: dict[str, torch.Tensor], num_tokens: int) -> torch.Tensor:
    """The batch's summed cross-entropy over its trained tokens (label at t predicted from t - 1) / ``num_tokens``,
    the whole step's |T|."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, T, V]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                                             ignore_index=IGNORE, reduction="sum") / num_tokens


def train_step(run: SFTRun, step: int) -> dict:
    """Optimizer step ``step``: its conversations' loss, summed over micro-batches, then AdamW (the gradient
    clipped to ``optim.grad_clip``; a non-finite gradient is not applied, ``FloatingPointError``)."""
    began, cfg = time.monotonic(), run.cfg
    examples = run.batch(step)
    num_tokens = sum(e.trained - (e.labels[0] != IGNORE) for e in examples)  # the first token predicts nothing
    size = cfg.micro_batch_size or len(examples)
    pad = run.tokenizer.pad_token_id
    loss_sum = 0.0
    for start in range(0, len(examples), size):
        batch = {k: v.to(run.device) for k, v in batch_tensors(examples[start:start + size], pad).items()}
        with torch.autocast(run.device.type, run.autocast) if run.autocast else contextlib.nullcontext():
            loss = step_loss(run.model, batch, num_tokens)
        loss.backward()
        loss_sum += loss.item()
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"the gradient of step {step} is not finite (loss {loss_sum}); the newest "
                                 f"checkpoint holds the last good weights: lower optim.lr or set optim.grad_clip")
    lr = lr_at(run.update_count, cfg.optim, run.steps)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.update_count += 1
    seconds = time.monotonic() - began
    return {"sft/loss": loss_sum, "sft/tokens": num_tokens, "sft/epoch": step / run.steps_per_epoch, "optim/lr": lr,
            "optim/grad_norm": float(grad_norm), "optim/updates": run.update_count, "perf/step_s": seconds,
            "perf/tokens_per_s": sum(len(e.ids) for e in examples) / max(seconds, 1e-9)}


# --------------------------------------------------------------------------- checkpoints


def checkpoint(run: SFTRun, step: int) -> Path:
    """Checkpoint ``step``: the weights, the optimizer, torch's generator and the counters
    (``metrics.jsonl``'s rows up to ``step`` committed first)."""
    fsync_file(run.run_dir / "metrics.jsonl")
    state = {"step": step, "update_count": run.update_count, "conversations": len(run.examples),
             "data_sha256": fingerprint(run.examples)}
    content = Checkpoint(run.model, run.tokenizer, run.optimizer, state, {"generator/torch/0": torch.get_rng_state()})
    return save_checkpoint(run.run_dir, step, content, keep=run.cfg.keep_checkpoints)


def resume(run: SFTRun) -> int:
    """The step the run goes on after: the newest intact checkpoint's (its weights, optimizer, generator and
    counters restored, ``metrics.jsonl`` cut back to it), else 0. A checkpoint of other conversations (another
    data file's content, another template) is a `ConfigError`: no older one would do."""
    expected = fingerprint(run.examples)

    def check(path: Path, state: dict, tensors: dict) -> None:
        if state.get("data_sha256") != expected:
            raise ConfigError(f"--resume: checkpoint {path} was trained on other conversations than this run encodes "
                              f"({state.get('conversations')} then, {len(run.examples)} now, or other tokens): "
                              "resume with the same data and model, or start a new run")
        if not isinstance(state.get("update_count"), int) or "generator/torch/0" not in tensors:
            raise CheckpointError(f"checkpoint {path}: not a cispo sft checkpoint (no update_count or generator)")

    found = load_latest_checkpoint(run.run_dir, run.model, run.optimizer, check=check)
    if found is None:
        print(f"cispo sft: no checkpoint in {run.run_dir}; starting from step 0", file=sys.stderr)
        return 0
    path, state, tensors = found
    run.update_count = state["update_count"]
    torch.set_rng_state(tensors["generator/torch/0"])
    run.sink.truncate_after(state["step"])
    print(f"cispo sft: resumed {run.run_dir} from {path.name}", file=sys.stderr)
    return state["step"]


def write_final(run_dir: Path, model_dir: Path) -> Path:
    """``run_dir/final``: the files of ``model_dir`` (the last checkpoint's ``model/``) as hard links (copies
    across file systems), put in place by a rename."""
    final, tmp = run_dir / "final", run_dir / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in model_dir.iterdir():
        try:
            os.link(f, tmp / f.name)
        except OSError:
            shutil.copy2(f, tmp / f.name)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


# --------------------------------------------------------------------------- the run


def sft(cfg: SFTConfig, resume_run: bool = False, overwrite: bool = False) -> SFTResult:
    """Run (or resume) the fine-tune ``cfg`` with its run folder locked; its result (``final/``, the summary)."""
    with run_lock(sft_run_dir(cfg)):
        run = set_up(cfg, resume_run, overwrite)
        start = resume(run) if resume_run else 0
        if start == 0:
            run.sink.truncate_after(-1)
            write_meta(run)
            run.sink.log(0, {"sft/conversations": len(run.examples),
                             "sft/trained_tokens": sum(e.trained for e in run.examples)})
        say(f"{len(run.examples)} conversations, {sum(e.trained for e in run.examples):,} trained tokens; "
            f"{run.steps} steps ({cfg.epochs} epoch(s) of {run.steps_per_epoch}) from step {start + 1}")
        last = step_loop(run, start)
        return finish(run, last)


def say(line: str) -> None:
    """``cispo sft: <line>`` on stderr, flushed."""
    print(f"cispo sft: {line}", file=sys.stderr, flush=True)


def step_loop(run: SFTRun, start: int) -> Path:
    """Steps ``start + 1 .. run.steps``, each logged, checkpointed when due (and at the end, and on a stop
    signal: then KeyboardInterrupt); the last checkpoint's folder."""
    cfg, stop, began = run.cfg, StopRequest(), time.monotonic()
    last = None
    with stop.installed(), run.sink:
        for step in range(start + 1, run.steps + 1):
            metrics = train_step(run, step)
            run.sink.log(step, metrics)
            if step == run.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stop.requested:
                last = checkpoint(run, step)
            if cfg.progress:
                say(f"step {step}/{run.steps} epoch {metrics['sft/epoch']:.2f} loss {metrics['sft/loss']:.4f} "
                    f"({time.monotonic() - began:.0f} s)")
            if stop.requested:
                raise KeyboardInterrupt(f"stopped by {stop.signal_name} after step {step}; checkpoint saved, "
                                        "continue with --resume")
    if last is None:  # a finished run resumed: its last checkpoint is the end
        from cispo.training.checkpoint import list_checkpoints

        last = list_checkpoints(run.run_dir)[-1]
    return last


def finish(run: SFTRun, last: Path) -> SFTResult:
    """``final/`` from the last checkpoint, and ``summary.json`` (the loss of the first and last steps)."""
    final = write_final(run.run_dir, last / "model")
    rows = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if r.get("sft/loss") is not None]
    summary = {"steps": run.steps, "final": str(final),
               "sft/loss": {"first": rows[0]["sft/loss"], "last": rows[-1]["sft/loss"]} if rows else None}
    (run.run_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    return SFTResult(run.run_dir, final, summary)
