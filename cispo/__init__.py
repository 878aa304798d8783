"""cispo: CISPO (MiniMax-M1, arXiv 2506.13585, section 3) and its family as one RL objective.

The package is laid out in layers, one folder each, and a module imports only from its own
folder or the folders above it in this list (docs/api.md, "Layers"; ``tests/test_imports.py``)::

    foundations/   names, hints, batch types, threads, plots: no cispo import
    objective/     the maths: advantages, log-probs, presets, eq. 4-7, the fused head
    config/        the run's settings (pydantic-checked dataclasses, YAML, overrides)
    records/       what a run writes: metrics sinks, samples.jsonl, the run folder
    data/          tasks, prompt files, rewards and verifiers, the prompt stream
    models/        the policy, loading / saving, LoRA, the built-in and packaged models
    rollout/       samplers (torch, vLLM)
    training/      one RL step, evaluation, checkpoints, the run
    integrations/, cli   front ends

The project's own studies (comparisons, probes, their data) live outside the package, in the
repository's ``studies/``, and import it like any user.

Modules moved into these folders in December 2026 keep their old paths: ``import
cispo.trainer`` gives the module ``cispo.training.trainer`` itself (`MOVED`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

MOVED = {
    "cispo.suggest": "cispo.foundations.suggest",
    "cispo.distributed": "cispo.foundations.distributed",
    "cispo.versions": "cispo.foundations.versions",
    "cispo.threads": "cispo.foundations.threads",
    "cispo.plotting": "cispo.foundations.plotting",
    "cispo.nan": "cispo.foundations.nan",
    "cispo.experience": "cispo.foundations.experience",
    "cispo.forks": "cispo.foundations.forks",
    "cispo.hub": "cispo.foundations.hub",
    "cispo.advantages": "cispo.objective.advantages",
    "cispo.logprobs": "cispo.objective.logprobs",
    "cispo.presets": "cispo.objective.presets",
    "cispo.fused_head": "cispo.objective.fused_head",
    "cispo.config_engine": "cispo.config.engine",
    "cispo.samples": "cispo.records.samples",
    "cispo.tracking": "cispo.records.tracking",
    "cispo.runfolder": "cispo.records.runfolder",
    "cispo.tasks": "cispo.data.tasks",
    "cispo.rewards": "cispo.data.rewards",
    "cispo.datasets": "cispo.data.datasets",
    "cispo.policy": "cispo.models.policy",
    "cispo.lora": "cispo.models.lora",
    "cispo.pretrain_config": "cispo.models.pretrain_config",
    "cispo.pretrain": "cispo.models.pretrain",
    "cispo.builtin_model": "cispo.models.builtin",
    "cispo.packaged": "cispo.models.packaged",
    "cispo.compile": "cispo.models.compile",
    "cispo.batching": "cispo.training.batching",
    "cispo.metrics": "cispo.training.metrics",
    "cispo.checkpoint": "cispo.training.checkpoint",
    "cispo.trainer": "cispo.training.trainer",
    "cispo.evaluation": "cispo.training.evaluation",
    "cispo.setup": "cispo.training.setup",
    "cispo.runner": "cispo.training.runner",
}
"""Old module path -> where the module lives now. The old ``cispo.objective``, ``cispo.config``,
``cispo.data`` and ``cispo.models`` are the folders' own names: those packages re-export what
the old modules held (`lazy_exports`)."""


def moved_to(name: str) -> str | None:
    """The new dotted path of ``name`` when it (or a package above it) moved, else None:
    ``cispo.rewards.code`` -> ``cispo.data.rewards.code``."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _MovedModule(importlib.abc.Loader):
    """Imports the module at its new path and puts that very object under the old name (the
    import system returns what ``sys.modules`` holds), so both names share one module."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.new)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = moved_to(name) if name.startswith("cispo.") else None
        return importlib.util.spec_from_loader(name, _MovedModule(new)) if new else None


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())


def lazy_exports(package: str, faces: tuple[str, ...]):
    """A module ``__getattr__`` (PEP 562) for ``package``: a name it lacks is looked up in the
    modules ``faces``, imported on first use — so ``from cispo.objective import policy_loss``
    works while ``import cispo.objective.presets`` (plain data) loads no torch."""

    def __getattr__(name: str):
        if not name.startswith("__"):
            for face in faces:
                module = importlib.import_module(face)
                if hasattr(module, name):
                    return getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
