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

This module itself holds only the version and `lazy_exports`, which lets ``cispo.objective``,
``cispo.config``, ``cispo.data`` and ``cispo.models`` re-export their modules' names on first use.
"""

from __future__ import annotations

import importlib

__all__ = ["__version__", "lazy_exports"]

__version__ = "0.1.0"


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
