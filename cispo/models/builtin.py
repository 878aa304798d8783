"""The built-in tasks' base models: shipped with the package, else cached, else pretrained.

Layering (no import circle): `cispo.models.loading` builds, saves and loads models;
`cispo.models.pretrain` trains and measures one (it imports `cispo.models.loading`); this module picks
the base model a run starts from (it imports both).

`ensure_builtin_model(task, cfg)` returns, in this order:

1. the **shipped** copy in ``cispo/data/tasks/base_models/<task>/`` when its recorded
   ``pretrain_config.json`` equals `cfg` (the default `PretrainConfig(task=task)`), after
   checking every file against the recorded ``SHA256SUMS``; so every machine starts RL from
   the same weights, with no pretraining step;
2. the **cached** copy ``<cache>/models/<task>-<hash of cfg>`` (``$CISPO_CACHE``, else
   ``$XDG_CACHE_HOME/cispo``, else ``~/.cache/cispo``), checked against the size and SHA-256 of
   every file recorded when it was written (`cached_model`; a damaged one is made again);
3. a freshly **pretrained** one, written into the cache.

The cache functions (`staging_folder`, `install_cache_folder`, `cached_model`) serve the packaged
models too (`cispo.models.packaged`).

``cispo pretrain`` always rebuilds (into the cache or ``--out``); `ship_model` records a
rebuilt folder's checksums so it can replace the shipped copy.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

import cispo.models.pretrain as pretraining
from cispo.models.cache import (
    CACHE_RECORD,
    cache_root,
    cached_model,
    install_cache_folder,
    staging_folder,
    verify_checksums,
    write_checksums,
)
from cispo.models.pretrain_config import PretrainConfig

SHIPPED_ROOT = Path(__file__).resolve().parents[1] / "data" / "tasks" / "base_models"
"""Package data: one folder per built-in task whose base model ships."""


# --------------------------------------------------------------------------- cache


def config_hash(cfg) -> str:
    """A short stable hash of a pretraining config, as resolved (None = the task's default)."""
    blob = json.dumps(asdict(cfg.resolved()), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _config_json(cfg: PretrainConfig) -> dict:
    """`cfg` resolved, as it reads back from ``pretrain_config.json`` (tuples become lists)."""
    return json.loads(json.dumps(asdict(cfg.resolved())))


def builtin_model_path(task: str = "addition", cache_dir=None, cfg=None) -> Path:
    """Where the cached base model for `task` and `cfg` lives (it may not exist yet).

    ``<cache>/models/<task>-<hash of the PretrainConfig>``; `cfg` defaults to
    ``PretrainConfig(task=task)``.
    """
    cfg = PretrainConfig(task=task) if cfg is None else cfg
    if cfg.task != task:
        raise ValueError(f"cfg.task={cfg.task!r} but task={task!r}")
    return cache_root(cache_dir) / "models" / f"{task}-{config_hash(cfg)}"


# --------------------------------------------------------------------------- shipped copies


def shipped_model_path(task: str, cfg: PretrainConfig | None = None) -> Path | None:
    """The shipped base model of `task` if one ships and was pretrained with `cfg`, else None."""
    cfg = PretrainConfig(task=task) if cfg is None else cfg
    folder = SHIPPED_ROOT / task
    saved = folder / "pretrain_config.json"
    if not saved.is_file() or json.loads(saved.read_text()) != _config_json(cfg):
        return None
    verify_checksums(folder)
    return folder


def ship_model(src, task: str, dest_root=SHIPPED_ROOT) -> Path:
    """Copy a pretrained folder (from `pretrain`) to ``dest_root/<task>`` and record its checksums.

    Copies the files a run loads (config, weights, tokenizer) and the pretraining record.
    """
    src, dest = Path(src), Path(dest_root) / task
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    names = sorted(p.name for p in src.iterdir()
                   if p.is_file() and p.suffix in (".json", ".safetensors") and p.name != CACHE_RECORD)
    for name in names:
        shutil.copyfile(src / name, dest / name)
    write_checksums(dest, names)
    return dest


# --------------------------------------------------------------------------- ensure


def ensure_builtin_model(task: str = "addition", cache_dir=None, cfg=None, progress: bool = True) -> Path:
    """Path to the base model for `task` and `cfg`: shipped, else cached, else pretrained now.

    Pretraining writes into a temporary folder next to the cache target and renames it
    into place, so an interrupted run never leaves a half-written model in the cache; when
    two processes race, the first rename wins and the other's copy is discarded. A cached copy
    is checked against the sizes and SHA-256 recorded when it was written (`cached_model`); a
    damaged one is pretrained again.
    """
    from cispo.data.tasks import get_task

    task = get_task(task).base_task or task  # an unknown name fails here, listing the known ones
    cfg = PretrainConfig(task=task) if cfg is None else cfg
    shipped = shipped_model_path(task, cfg)
    if shipped is not None:
        return shipped
    path = builtin_model_path(task, cache_dir, cfg)
    if cached_model(path, redo="pretraining it again"):
        return path
    return _pretrain_into(path, cfg, progress)


def rebuild_builtin_model(cfg: PretrainConfig, cache_dir=None, progress: bool = True) -> Path:
    """Pretrain `cfg` into the cache even when a shipped or cached copy exists (``cispo pretrain``)."""
    path = builtin_model_path(cfg.task, cache_dir, cfg)
    return _pretrain_into(path, cfg, progress, replace=True)


@contextlib.contextmanager
def one_thread():
    """Pretraining's thread rule (``cispo pretrain``, with or without ``--out``, and the cache's first build): one
    thread, as fast as two on an idle 2-core machine and ~4x faster when other work shares the cores
    (docs/builtin-task.md); the weights do not depend on it. The count before is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _pretrain_into(path: Path, cfg: PretrainConfig, progress: bool, replace: bool = False) -> Path:
    """Pretrain `cfg` into a temporary folder beside ``path`` and install it there (`staging_folder`,
    `install_cache_folder`): the cache's problems are found before the minutes of pretraining."""
    with staging_folder(path) as tmp:
        print(f"cispo: pretraining the built-in {cfg.task!r} base model (a few minutes on a CPU); "
              f"it will be cached in {path}", file=sys.stderr)
        with one_thread():
            pretraining.pretrain(cfg, tmp, progress=progress)  # looked up here, so tests can stub it
        install_cache_folder(tmp, path, f"the pretrained {cfg.task!r} model", replace=replace)
    return path


# --------------------------------------------------------------------------- CLI


def main(argv=None):
    """``python -m cispo.models.builtin [--seed S] [--out DIR] [--measure N] [--FIELD VALUE ...]``.

    Without ``--out`` it rebuilds the cached copy (never the shipped one).
    """
    p = argparse.ArgumentParser(description="Pretrain (and measure) the built-in base model.")
    for f in fields(PretrainConfig):
        if f.name == "betas":
            continue
        kind = int if f.name in ("steps", "batch_size") else float if f.default is None else type(f.default)
        p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    p.add_argument("--out", default=None, help="output folder (default: the model cache)")
    p.add_argument("--measure", type=int, default=0, help="held-out prompts to measure on (0: skip)")
    p.add_argument("--measure-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = PretrainConfig(**{f.name: getattr(args, f.name) for f in fields(PretrainConfig) if f.name != "betas"})
    if args.out is None:
        out = rebuild_builtin_model(cfg)
    else:
        out = Path(args.out)
        saved = out / "pretrain_config.json"
        if saved.is_file() and json.loads(saved.read_text()) == _config_json(cfg):
            print(f"{out} already holds this config's model; not retraining")
        else:
            pretraining.pretrain(cfg, out)
    print(f"model: {out}")
    log = json.loads((Path(out) / "pretrain_log.json").read_text())
    print(f"pretraining wall time: {log['wall_s']:.1f} s, {log['num_parameters']} parameters, "
          f"final loss {log['loss'][-1]:.4f}")
    if args.measure:
        t = time.perf_counter()
        if cfg.task.startswith("chain"):  # recurring rechecks: per-step statistics (measure_chain_model)
            report = pretraining.measure_chain_model(out, n=args.measure, seed=args.measure_seed, task_name=cfg.task)
        else:
            report = pretraining.measure_base_model(out, task=cfg.task, n=args.measure,
                                                    seed=args.measure_seed).to_dict()
        print(json.dumps(report, indent=2))
        print(f"measured in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
