"""Crash-safe checkpoints: written to a temporary folder, fsynced, then renamed into place.

A checkpoint folder ``step_000040/`` holds the policy (``model/``: safetensors +
tokenizer, the standard Hugging Face layout), the optimizer state (``optimizer.pt``, loaded
with ``weights_only=True``), random-generator states (``rng.safetensors``) and the rest of
the trainer's state as JSON. Nothing is unpickled on load. A LoRA model's ``model/`` holds
the merged weights (a plain checkpoint for ``cispo eval`` or vLLM) and ``adapter/`` the
adapters in peft's own format (``PeftModel.from_pretrained``); resuming reads ``adapter/``.

A model sharded with FSDP2 (``cispo.distributed.shard_model``) is checkpointed in the same
format: every rank takes part in ``gather_full_state`` (full weights and optimizer state,
on rank 0's CPU), rank 0 writes them, and ``load_checkpoint`` gives every rank its shards back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cispo.lora import has_lora

_NAME = re.compile(r"^step_(\d{6,})$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
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


def load_checkpoint(path: Path, model, optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, torch.Tensor]]:
    """Restore model weights and optimizer state in place (the local shards of a sharded model:
    every rank must call it); return (state, tensors)."""
    from cispo.distributed import is_sharded

    path = Path(path)
    sharded = is_sharded(model)
    device = "cpu" if sharded else str(next(model.parameters()).device)
    if has_lora(model):  # the base weights are the (frozen) ones just loaded; the adapters come from adapter/
        from cispo.lora import load_adapter_state

        weights = load_adapter_state(path / "adapter", model, device=device)
    else:
        weights = {}
        for f in sorted((path / "model").glob("*.safetensors")):
            weights.update(load_file(f, device=device))
        expected = set(model.state_dict())
        missing = [k for k in expected if k not in weights]
        unexpected = [k for k in weights if k not in expected]
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        if isinstance(getattr(model, "_tied_weights_keys", None), dict):
            tied = set(model._tied_weights_keys)
        if unexpected or any(k not in tied for k in missing):
            raise ValueError(f"checkpoint {path}: missing weights {missing}, unexpected {unexpected}")
    optim_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    if sharded:
        _load_sharded(model, optimizer, weights, optim_state)
    else:
        model.load_state_dict(weights, strict=False)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        optimizer.load_state_dict(optim_state)
    state = json.loads((path / "trainer_state.json").read_text())
    tensors = load_file(path / "rng.safetensors")
    return state, tensors
