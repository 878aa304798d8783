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
(truncated safetensors, bad JSON, a missing file, missing or unexpected weights), that holds
a non-finite weight or optimizer tensor, that does not fit the model and optimizer (a weight or
an Adam moment of another shape, another number of parameters), whose ``step`` is not its
folder's, or whose trainer state the trainer cannot restore (`check_trainer_state`: counts,
prompt streams, generator states, the batch sampled ahead by ``rollout.async_steps=1``) raises
``CheckpointError`` naming the file and what is wrong; ``load_latest_checkpoint`` then reports it
and falls back to the previous one.

A model sharded with FSDP2 (``cispo.foundations.distributed.shard_model``) is checkpointed in the same
format: every rank takes part in ``gather_full_state`` (full weights and optimizer state,
on rank 0's CPU), rank 0 writes them, and ``load_checkpoint`` gives every rank its shards back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cispo.models.lora import has_lora
from cispo.training.held_batch import HeldBatchError, HeldBatchLimits, check_held_batch

_NAME = re.compile(r"^step_(\d{6,})$")
_STATE_KEYS = ("step",)  # the rest of the state is the caller's


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the file and what is wrong."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (most often a full disk); the message says the free space."""


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


MODEL_EXPECTED = "a Hugging Face model folder (config.json, weights, tokenizer), builtin:<name> or a hub id org/name"


def check_model_folder(path) -> None:
    """``ConfigError`` (one line naming ``path`` and what was expected there) unless ``path`` is a
    local folder with a ``config.json``, or names no local file or folder and reads as a hub id
    (``cispo.data.datasets.looks_like_hub_id``; ``from_pretrained`` then fetches it). A run folder, its
    ``checkpoints/`` or a ``step_N`` folder is answered with the model folder to use: the newest
    checkpoint's ``model/``. A ``.safetensors`` file whose header does not read (a truncated copy) is a
    ``ConfigError`` too."""
    from cispo.config.train import ConfigError
    from cispo.data.datasets import looks_like_hub_id

    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        from cispo.models.cache import safetensors_problem

        problem = safetensors_problem(folder, sorted(p.name for p in folder.glob("*.safetensors")))
        if problem:  # e.g. a copy cut short: one line here, not safetensors' error from inside from_pretrained
            raise ConfigError(f"{path}: {problem}; the model folder is damaged (copy it again)")
        return
    if not folder.exists():
        if looks_like_hub_id(str(path)):
            return
        raise ConfigError(f"{path}: no such file or folder; expected {MODEL_EXPECTED}")
    if not folder.is_dir():
        raise ConfigError(f"{path}: a file, not a model folder; expected {MODEL_EXPECTED}")
    if (folder / "model" / "config.json").is_file():  # a checkpoint's step_N folder
        raise ConfigError(f"{path}: a checkpoint folder; its model is {folder / 'model'}")
    run = folder.parent if folder.name == "checkpoints" else folder
    if checkpoint_dir(run).is_dir():
        found = list_checkpoints(run)
        if not found:
            raise ConfigError(f"{path}: a run's checkpoints folder holds no checkpoint yet; expected {MODEL_EXPECTED}")
        what = "a run folder" if run is folder else "a run's checkpoints folder"
        raise ConfigError(f"{path}: {what}, not a model; the newest checkpoint's model is {found[-1] / 'model'}")
    raise ConfigError(f"{path}: a folder without config.json; expected {MODEL_EXPECTED}")


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


@dataclass
class Checkpoint:
    """What a checkpoint holds: the policy's ``model`` and ``tokenizer``, the ``optimizer``, the trainer's
    ``state`` (JSON data) and the generators' states (``tensors``). ``full_state``: (model, optimizer) state
    dicts from ``gather_full_state`` (a sharded model); None: those of ``model`` and ``optimizer``."""

    model: object
    tokenizer: object
    optimizer: torch.optim.Optimizer
    state: dict
    tensors: dict[str, torch.Tensor]
    full_state: tuple[dict, dict] | None = None


def save_checkpoint(run_dir: Path, step: int, content: Checkpoint, keep: int = 2) -> Path:
    """Write checkpoint ``step`` (``content``) atomically and keep the newest ``keep`` of them."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write(tmp, content)
        _fsync_tree(tmp)
    except Exception as e:  # noqa: BLE001 - a full disk surfaces as whatever the writer raises
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"writing checkpoint {final.name} into {root} failed ({type(e).__name__}: "
                                   f"{str(e)[:300]}); {_free_space(root)}. Nothing of it was kept and the earlier "
                                   f"checkpoints are untouched: free space (or move the run folder) and continue "
                                   f"with --resume") from e
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


def _write(tmp: Path, content: Checkpoint) -> None:
    """A checkpoint's files into the folder ``tmp`` (module docstring)."""
    model, tokenizer, state, tensors = content.model, content.tokenizer, content.state, content.tensors
    model_state, optimizer_state = content.full_state or (None, content.optimizer.state_dict())
    if has_lora(model):  # model/: merged plain weights; adapter/: peft's own adapter format (for resume)
        from cispo.models.lora import save_adapter, split_lora_state

        model_state, adapter = split_lora_state(model_state if model_state is not None else model.state_dict(), model)
        save_adapter(model, adapter, tmp / "adapter")
    model.save_pretrained(tmp / "model", safe_serialization=True, state_dict=model_state)
    tokenizer.save_pretrained(tmp / "model")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp / "rng.safetensors")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, sort_keys=True))


def _free_space(folder: Path) -> str:
    """``"N MB free on its disk"`` (what a failed write most often means), or why that is unknown."""
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:.0f} MB free on its disk"
    except OSError as e:
        return f"its disk's free space is unknown ({e.strerror})"


def _param_names(model, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in ``optimizer.state_dict()``'s id order."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather_full_state(model, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict) of a sharded model, gathered in full on rank 0's
    CPU, the optimizer's in ``optimizer.state_dict()``'s format (parameters by index). Every
    rank must call it; ranks other than 0 get empty dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

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
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

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


def nonfinite_parameters(model) -> list[str]:
    """Names of ``model``'s parameters holding a NaN or an infinity (this rank's shards of a
    sharded model): such weights are never checkpointed."""
    from cispo.foundations.distributed import local_tensor

    return [name for name, p in model.named_parameters() if not torch.isfinite(local_tensor(p.detach())).all()]


def _check_finite(tensors: dict, where: Path, what: str) -> None:
    for name, t in tensors.items():
        if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"checkpoint file {where}: {what} {name!r} has {bad} non-finite value(s) "
                                  f"(NaN / inf); refusing to load it")


def read_checkpoint(path: Path, device: str = "cpu") -> tuple[dict, dict, dict, dict[str, torch.Tensor], dict]:
    """(trainer state, model weights on ``device``, optimizer state dict, generator states, the
    file of each weight) of checkpoint ``path``, every file read and checked (parsable,
    complete, finite; ``step`` the folder's) before anything is returned; ``CheckpointError``
    naming the file otherwise."""
    path = Path(path)
    state_file = path / "trainer_state.json"
    state = _read(state_file, "trainer state", lambda p: json.loads(p.read_text()))
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {state_file} holds {type(state).__name__}, not an object")
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint file {state_file} lacks {', '.join(missing)}")
    named = _NAME.match(path.name)
    if not _is_count(state["step"]) or (named and state["step"] != int(named.group(1))):
        raise CheckpointError(f"checkpoint file {state_file}: step is {state['step']!r}, but the folder is "
                              f"{path.name}")
    tensors = _read(path / "rng.safetensors", "generator states", load_file)
    shards = sorted((path / "model").glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"checkpoint {path}: no model weights (model/*.safetensors) found")
    weights, origin = {}, {}
    for f in shards:
        part = _read(f, "model weights", lambda p: load_file(p, device=device))
        _check_finite(part, f, "weight")
        weights.update(part)
        origin.update(dict.fromkeys(part, f))
    optim_file = path / "optimizer.pt"
    optim_state = _read(optim_file, "optimizer state",
                        lambda p: torch.load(p, weights_only=True, map_location="cpu"))
    if not isinstance(optim_state, dict) or "state" not in optim_state:
        raise CheckpointError(f"checkpoint file {optim_file} is not an optimizer state dict")
    entries = optim_state["state"]
    if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
        raise CheckpointError(f"checkpoint file {optim_file} is not an optimizer state dict")
    for index, entry in optim_state["state"].items():
        _check_finite({f"state[{index}].{k}": v for k, v in entry.items()}, optim_file, "optimizer tensor")
    return state, weights, optim_state, tensors, origin


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Expected:
    """What a checkpoint must match to be restored by this process: its ``rank`` of ``world_size``, its
    prompt stream's state now (``stream_state``: the same prompts and seed), its generators'
    (``generator_states``: the shapes) and, with ``rollout.async_steps=1``, what the batch sampled ahead must
    fit (``held_batch``: the vocabulary and the stream; None: a held batch is not trained on, not checked)."""

    rank: int
    world_size: int
    stream_state: dict
    generator_states: dict[str, torch.Tensor]
    held_batch: HeldBatchLimits | None = None


def check_trainer_state(path: Path, state: dict, tensors: dict[str, torch.Tensor], expected: Expected) -> None:
    """``CheckpointError`` naming the file unless checkpoint ``path``'s trainer state (``state``,
    from ``trainer_state.json``) and generator states (``tensors``, from ``rng.safetensors``) are
    what `cispo.training.run.Run` writes and can restore for ``expected.rank`` of ``expected.world_size``:
    ``update_count`` a count, ``streams`` one prompt-stream state per rank, this rank's for the same prompts
    and seed as ``expected.stream_state``, and a ``generator/<name>/<rank>`` byte tensor shaped as each of
    ``expected.generator_states``, and the batch sampled ahead fit to train on (`check_held`). ``ValueError``
    (not a damaged checkpoint: no older one would do) when it was written by another number of processes."""
    rank, world_size = expected.rank, expected.world_size
    stream_state, generator_states = expected.stream_state, expected.generator_states
    state_file, rng_file = path / "trainer_state.json", path / "rng.safetensors"
    if state.get("world_size", 1) != world_size:
        raise ValueError(f"checkpoint {path} was written by {state.get('world_size', 1)} processes; "
                         f"resume it with the same number (now {world_size})")
    if not _is_count(state.get("update_count")):
        raise CheckpointError(f"checkpoint file {state_file}: update_count is "
                              f"{state['update_count']!r}, not a count" if "update_count" in state else
                              f"checkpoint file {state_file} lacks update_count")
    streams = state.get("streams")
    if not isinstance(streams, list) or len(streams) != world_size or not isinstance(streams[rank], dict):
        raise CheckpointError(f"checkpoint file {state_file}: streams is {str(streams)[:80]!r}, not one prompt-stream "
                              f"state per process ({world_size})")
    stream = streams[rank]
    wrong = [k for k in stream_state if k != "retired" and (not _is_count(stream.get(k)) or
             (k in ("seed", "num_samples") and stream[k] != stream_state[k]))]
    retired = stream.get("retired", [])  # absent in checkpoints from before data.retire_pass_rate
    if not isinstance(retired, list) or not all(_is_count(i) and i < stream_state["num_samples"] for i in retired):
        wrong.append("retired")
    if wrong:
        has = ", ".join(f"{k}={stream.get(k)!r}" for k in wrong)
        want = ", ".join(f"{k}={stream_state[k]!r}" for k in wrong)
        raise CheckpointError(f"checkpoint file {state_file}: streams[{rank}] has {has}; this run's prompt stream has "
                              f"{want}")
    for name, current in generator_states.items():
        key = f"generator/{name}/{rank}"
        saved = tensors.get(key)
        if saved is None:
            raise CheckpointError(f"checkpoint file {rng_file} lacks {key}")
        if saved.dtype != current.dtype or saved.shape != current.shape:
            raise CheckpointError(f"checkpoint file {rng_file}: {key} is {saved.dtype} {tuple(saved.shape)}, a "
                                  f"generator state is {current.dtype} {tuple(current.shape)}")
    if expected.held_batch is not None:
        check_held(state_file, state, expected.held_batch)


def check_held(state_file: Path, state: dict, limits: HeldBatchLimits) -> None:
    """``CheckpointError`` naming ``state_file`` and the field unless the batch a ``rollout.async_steps=1``
    checkpoint holds for the next step (``prefetched``; None: none was kept, the stream went back before it)
    fits this run (`cispo.training.held_batch.check_held_batch`), or when a checkpoint that says it was written
    with ``async_steps=1`` has lost it: the uninterrupted run trained on that batch, so a resume from here would
    differ from it (the previous checkpoint, with its own held batch, would not)."""
    if "prefetched" not in state:
        if state.get("async_steps") == 1:
            raise CheckpointError(f"checkpoint file {state_file} was written with rollout.async_steps=1 but holds no "
                                  "batch sampled ahead (prefetched): a run resumed from it would differ from the "
                                  "uninterrupted one")
        return
    if state["prefetched"] is not None:
        try:
            check_held_batch(state["prefetched"], limits)
        except HeldBatchError as e:
            raise CheckpointError(f"checkpoint file {state_file}: the batch sampled ahead is damaged: {e}") from e


def _check_fits(path: Path, model, optimizer: torch.optim.Optimizer, weights: dict, origin: dict,
                optim_state: dict) -> None:
    """``CheckpointError`` naming the file unless every weight has its parameter's shape and the
    optimizer state has this optimizer's groups and parameters, with each moment shaped as its
    parameter (global shapes for a sharded model): checked before anything is loaded."""
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    for name, tensor in weights.items():
        if name in shapes and tensor.shape != shapes[name]:
            raise CheckpointError(f"checkpoint file {origin[name]}: weight {name!r} has shape {tuple(tensor.shape)}, "
                                  f"the model's is {tuple(shapes[name])}")
    optim_file = path / "optimizer.pt"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = optim_state.get("param_groups")
    if (not isinstance(groups, list) or len(groups) != len(optimizer.param_groups)
            or [len(g.get("params", ())) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]):
        got = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else groups
        raise CheckpointError(f"checkpoint file {optim_file}: parameters per group {got}, this optimizer has "
                              f"{[len(g['params']) for g in optimizer.param_groups]}")
    for index, entry in optim_state["state"].items():
        if not (isinstance(index, int) and 0 <= index < len(params)):
            raise CheckpointError(f"checkpoint file {optim_file}: state of parameter {index!r}, which does not exist")
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != params[index].shape:
                raise CheckpointError(f"checkpoint file {optim_file}: state[{index}].{key} has shape "
                                      f"{tuple(value.shape)}, its parameter {tuple(params[index].shape)}")


def load_checkpoint(path: Path, model, optimizer: torch.optim.Optimizer,
                    check: Callable[[Path, dict, dict], None] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Restore model weights and optimizer state in place (the local shards of a sharded model:
    every rank must call it); return (state, tensors). ``CheckpointError`` (naming the file)
    for a checkpoint that is unreadable, incomplete, not finite, not shaped for ``model`` and
    ``optimizer``, or refused by ``check(path, state, tensors)`` (e.g. `check_trainer_state`);
    then nothing was changed."""
    from cispo.foundations.distributed import is_sharded

    path = Path(path)
    sharded = is_sharded(model)
    device = "cpu" if sharded else str(next(model.parameters()).device)
    state, weights, optim_state, tensors, origin = read_checkpoint(path, device)
    if check is not None:
        check(path, state, tensors)
    if has_lora(model):  # the base weights are the (frozen) ones just loaded; the adapters come from adapter/
        from cispo.models.lora import load_adapter_state

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
        _check_fits(path, model, optimizer, weights, origin, optim_state)
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
                           report: Callable[[str], None] | None = None,
                           check: Callable[[Path, dict, dict], None] | None = None) -> tuple[Path, dict, dict] | None:
    """Load the newest intact checkpoint of ``run_dir``: (its folder, state, tensors), or None
    if the run has none. Each newer one that is not intact (`load_checkpoint`, with ``check``)
    is reported (``report``: the file and what is wrong; None: to stderr) and skipped;
    ``CheckpointError`` listing them all if none is intact."""
    problems = []
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            state, tensors = load_checkpoint(ckpt, model, optimizer, check)
        except CheckpointError as e:
            problems.append(str(e))
            (report or _stderr)(f"cispo: warning: skipping checkpoint {ckpt.name}: {e}")
            continue
        return ckpt, state, tensors
    if problems:
        raise CheckpointError(f"no intact checkpoint in {checkpoint_dir(run_dir)}: " + "; ".join(problems))
    return None
