"""Crash-safe checkpoints: written to a temporary folder, fsynced, then renamed into place.

A checkpoint folder ``step_000040/`` holds the policy (``model/``: safetensors +
tokenizer, the standard Hugging Face layout), the optimizer state (``optimizer.pt``, loaded
with ``weights_only=True``), random-generator states (``rng.safetensors``) and the rest of
the trainer's state as JSON (``step``: the rows of ``metrics.jsonl`` up to this step are
committed — fsynced before the checkpoint is written —, ``update_count``, the prompt streams).
Nothing is unpickled on load. A LoRA model's ``model/`` holds the merged weights (a plain
checkpoint for ``cispo eval`` or vLLM) and ``adapter/`` the adapters in peft's own format
(``PeftModel.from_pretrained``); resuming reads ``adapter/``.

Loading checks every file before anything is applied: a checkpoint that cannot be read
(truncated safetensors, bad JSON, a missing file, missing or unexpected weights) or that holds
a non-finite weight or optimizer tensor raises ``CheckpointError`` naming the file and what is
wrong; ``load_latest_checkpoint`` then reports it and falls back to the previous one.

A model sharded with FSDP2 (``cispo.distributed.shard_model``) is checkpointed in the same
format: every rank takes part in ``gather_full_state`` (full weights and optimizer state,
on rank 0's CPU), rank 0 writes them, and ``load_checkpoint`` gives every rank its shards back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from cispo.lora import has_lora

_NAME = re.compile(r"^step_(\d{6,})$")
_STATE_KEYS = ("step",)  # the rest of the state is the caller's


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the file and what is wrong."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoint folders of a run (``step_N``; a half-written ``.tmp-*`` is not one),
    oldest first. Whether each is intact is checked when it is loaded."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to disk (no-op if it does not exist)."""
    try:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    except FileNotFoundError:
        pass


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(Path(root) / name)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    state: dict,
    tensors: dict[str, torch.Tensor],
    keep: int = 2,
    full_state: tuple[dict, dict] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and keep the newest ``keep`` of them.
    ``full_state``: (model, optimizer) state dicts from ``gather_full_state`` (a sharded model);
    None: those of ``model`` and ``optimizer``."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model_state, optimizer_state = full_state or (None, optimizer.state_dict())
    if has_lora(model):  # model/: merged plain weights; adapter/: peft's own adapter format (for resume)
        from cispo.lora import save_adapter, split_lora_state

        model_state, adapter = split_lora_state(model_state if model_state is not None else model.state_dict(), model)
        save_adapter(model, adapter, tmp / "adapter")
    model.save_pretrained(tmp / "model", safe_serialization=True, state_dict=model_state)
    tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp / "rng.safetensors")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _param_names(model, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in ``optimizer.state_dict()``'s id order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather_full_state(model, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict) of a sharded model, gathered in full on rank 0's
    CPU, the optimizer's in ``optimizer.state_dict()``'s format (parameters by index). Every
    rank must call it; ranks other than 0 get empty dicts."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    if not optim_state:
        return model_state, {}
    index = {name: i for i, name in enumerate(_param_names(model, optimizer))}
    return model_state, {
        "state": {index[name]: v for name, v in optim_state["state"].items()},
        "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in optim_state["param_groups"]],
    }


def _load_sharded(model, optimizer, weights: dict, optim_state: dict) -> None:
    """Every rank: full state dicts (the optimizer's in ``optimizer.state_dict()`` format) into
    the local shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    names = _param_names(model, optimizer)
    optim_state = {
        "state": {names[i]: v for i, v in optim_state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim_state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=True))


def _read(path: Path, what: str, read):
    """``read(path)``, any failure (missing, truncated, unparsable) as a ``CheckpointError``."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing ({what})")
    try:
        return read(path)
    except Exception as e:  # noqa: BLE001 - whatever the reader raises, the file is unusable
        raise CheckpointError(f"checkpoint file {path} cannot be read ({what}): {type(e).__name__}: {e}") from e


def _check_finite(tensors: dict, where: Path, what: str) -> None:
    for name, t in tensors.items():
        if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"checkpoint file {where}: {what} {name!r} has {bad} non-finite value(s) "
                                  f"(NaN / inf); refusing to load it")


def read_checkpoint(path: Path, device: str = "cpu") -> tuple[dict, dict, dict, dict[str, torch.Tensor]]:
    """(trainer state, model weights on ``device``, optimizer state dict, generator states) of
    checkpoint ``path``, every file read and checked (parsable, complete, finite) before
    anything is returned; ``CheckpointError`` naming the file otherwise."""
    path = Path(path)
    state_file = path / "trainer_state.json"
    state = _read(state_file, "trainer state", lambda p: json.loads(p.read_text()))
    missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"checkpoint file {state_file} lacks {', '.join(missing)}")
    tensors = _read(path / "rng.safetensors", "generator states", load_file)
    shards = sorted((path / "model").glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"checkpoint {path}: no model weights (model/*.safetensors) found")
    weights = {}
    for f in shards:
        part = _read(f, "model weights", lambda p: load_file(p, device=device))
        _check_finite(part, f, "weight")
        weights.update(part)
    optim_file = path / "optimizer.pt"
    optim_state = _read(optim_file, "optimizer state",
                        lambda p: torch.load(p, weights_only=True, map_location="cpu"))
    if not isinstance(optim_state, dict) or "state" not in optim_state:
        raise CheckpointError(f"checkpoint file {optim_file} is not an optimizer state dict")
    for index, entry in optim_state["state"].items():
        _check_finite({f"state[{index}].{k}": v for k, v in entry.items()}, optim_file, "optimizer tensor")
    return state, weights, optim_state, tensors


def load_checkpoint(path: Path, model, optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, torch.Tensor]]:
    """Restore model weights and optimizer state in place (the local shards of a sharded model:
    every rank must call it); return (state, tensors). ``CheckpointError`` (naming the file)
    for a checkpoint that is unreadable, incomplete or not finite; then nothing was changed."""
    from cispo.distributed import is_sharded

    path = Path(path)
    sharded = is_sharded(model)
    device = "cpu" if sharded else str(next(model.parameters()).device)
    state, weights, optim_state, tensors = read_checkpoint(path, device)
    if has_lora(model):  # the base weights are the (frozen) ones just loaded; the adapters come from adapter/
        from cispo.lora import load_adapter_state

        try:
            weights = load_adapter_state(path / "adapter", model, device=device)
        except (OSError, ValueError) as e:
            raise CheckpointError(str(e)) from e
        _check_finite(weights, path / "adapter", "adapter weight")
    else:
        expected = set(model.state_dict())
        missing = [k for k in expected if k not in weights]
        unexpected = [k for k in weights if k not in expected]
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        if isinstance(getattr(model, "_tied_weights_keys", None), dict):
            tied = set(model._tied_weights_keys)
        if unexpected or any(k not in tied for k in missing):
            raise CheckpointError(f"checkpoint {path / 'model'}: missing weights {missing}, unexpected {unexpected}")
    if sharded:
        _load_sharded(model, optimizer, weights, optim_state)
    else:
        model.load_state_dict(weights, strict=False)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        optimizer.load_state_dict(optim_state)
    return state, tensors


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def load_latest_checkpoint(run_dir: Path, model, optimizer: torch.optim.Optimizer,
                           report: Callable[[str], None] | None = None) -> tuple[Path, dict, dict] | None:
    """Load the newest intact checkpoint of ``run_dir``: (its folder, state, tensors), or None
    if the run has none. Each newer one that is not intact is reported (``report``: the file
    and what is wrong; None: to stderr) and skipped; ``CheckpointError`` listing them all
    if none is intact."""
    problems = []
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            state, tensors = load_checkpoint(ckpt, model, optimizer)
        except CheckpointError as e:
            problems.append(str(e))
            (report or _stderr)(f"cispo: warning: skipping checkpoint {ckpt.name}: {e}")
            continue
        return ckpt, state, tensors
    if problems:
        raise CheckpointError(f"no intact checkpoint in {checkpoint_dir(run_dir)}: " + "; ".join(problems))
    return None
