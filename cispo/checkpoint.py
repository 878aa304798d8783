"""Crash-safe checkpoints: written to a temporary folder, fsynced, then renamed into place.

A checkpoint folder ``step_000040/`` holds the policy (``model/``: safetensors +
tokenizer, the standard Hugging Face layout), the optimizer state (``optimizer.pt``, loaded
with ``weights_only=True``), random-generator states (``rng.safetensors``) and the rest of
the trainer's state as JSON. Nothing is unpickled on load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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
) -> Path:
    """Write checkpoint ``step`` atomically and keep the newest ``keep`` of them."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
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


def load_checkpoint(path: Path, model, optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, torch.Tensor]]:
    """Restore model weights and optimizer state in place; return (state, tensors)."""
    path = Path(path)
    weights = {}
    for f in sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(f, device=str(next(model.parameters()).device)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if isinstance(getattr(model, "_tied_weights_keys", None), dict):
        tied = set(model._tied_weights_keys)
    if unexpected or any(k not in tied for k in missing):
        raise ValueError(f"checkpoint {path}: missing weights {missing}, unexpected {unexpected}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
    state = json.loads((path / "trainer_state.json").read_text())
    tensors = load_file(path / "rng.safetensors")
    return state, tensors
