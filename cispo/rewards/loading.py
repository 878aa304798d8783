"""Resolve a reward spec (config string) to a callable ``(prompt, completion, **sample) -> float``.

    >>> load_reward("exact_match")                     # a built-in, by name
    >>> load_reward("my_pkg.rewards:score")            # module:function (module importable)
    >>> load_reward("rewards/my_reward.py:score")      # path/to/file.py:function

Built-ins (see `BUILTIN_REWARDS`): ``math`` (math-verify equivalence), ``exact_match``
(normalised string / number match), ``code`` (`cispo.rewards.code.code_reward`). The
attribute may be dotted (``module:Class.method``). Every failure raises `RewardSpecError`
(a ValueError) naming the spec and what is wrong, except a missing math-verify for ``math``
(ImportError with the pip command).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

from cispo.suggest import did_you_mean

__all__ = ["load_reward", "BUILTIN_REWARDS", "RewardSpecError"]

BUILTIN_REWARDS: dict[str, str] = {
    "math": "cispo.rewards.math:math_reward",
    "exact_match": "cispo.rewards.exact:exact_match",
    "code": "cispo.rewards.code:code_reward",
}
"""Built-in reward names -> ``module:function``, imported only when asked for."""


class RewardSpecError(ValueError):
    """A reward spec that names no usable callable."""


def _is_path(module: str) -> bool:
    return module.endswith(".py") or "/" in module or os.sep in module


def _import_file(spec: str, path_str: str):
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise RewardSpecError(f"reward {spec!r}: no such file {str(path)!r} (resolved to {str(path.resolve())!r})")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    mod_name = f"cispo_reward_{resolved.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    file_spec = importlib.util.spec_from_file_location(mod_name, resolved)
    if file_spec is None or file_spec.loader is None:
        raise RewardSpecError(f"reward {spec!r}: cannot import {str(resolved)!r} as a Python module")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[mod_name] = module  # registered first so dataclasses / pickling inside it work
    try:
        file_spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(mod_name, None)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise RewardSpecError(f"reward {spec!r}: importing {str(resolved)!r} failed: {type(e).__name__}: {e}") from e
    return module


def _import_module(spec: str, name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing == name or name.startswith(missing + "."):
            raise RewardSpecError(
                f"reward {spec!r}: no module named {missing!r} (is it installed, or on sys.path / "
                f"PYTHONPATH? For a file use 'path/to/file.py:function')"
            ) from e
        raise RewardSpecError(f"reward {spec!r}: importing module {name!r} failed: {type(e).__name__}: {e}") from e
    except ImportError as e:  # e.g. a missing optional dependency, with its own message
        raise RewardSpecError(f"reward {spec!r}: importing module {name!r} failed: {e}") from e
    except Exception as e:
        raise RewardSpecError(f"reward {spec!r}: importing module {name!r} failed: {type(e).__name__}: {e}") from e


def _resolve(spec: str, target: str) -> Callable[..., float]:
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardSpecError(f"reward {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    module = _import_file(spec, module_name) if _is_path(module_name) else _import_module(spec, module_name)
    obj = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = module_name if i == 0 else f"{module_name}:{'.'.join(attr.split('.')[:i])}"
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise RewardSpecError(f"reward {spec!r}: {where!r} has no attribute {part!r}{did_you_mean(part, names, n=3)}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardSpecError(f"reward {spec!r}: {attr!r} in {module_name!r} is not callable (it is a {type(obj).__name__})")
    return obj


def load_reward(spec: str) -> Callable[..., float]:
    """The reward callable named by ``spec``: a built-in name (`BUILTIN_REWARDS`),
    ``module:function`` or ``path/to/file.py:function``.

    Built-in ``math`` fails here (ImportError with the pip command), not at the first reward,
    if math-verify is missing."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        module_name = BUILTIN_REWARDS[spec].partition(":")[0]
        if importlib.util.find_spec(module_name) is None:
            raise RewardSpecError(f"built-in reward {spec!r} is not available in this install "
                                  f"(module {module_name!r} is missing)")
        fn = _resolve(spec, BUILTIN_REWARDS[spec])
        if spec == "math":
            from cispo.rewards.math import require_math_verify

            require_math_verify()  # ImportError with the pip command
        return fn
    if ":" not in spec:
        raise RewardSpecError(
            f"unknown reward {spec!r}{did_you_mean(spec, BUILTIN_REWARDS, n=3)}; built-in rewards: "
            f"{', '.join(sorted(BUILTIN_REWARDS))}; or give 'module:function' / 'path/to/file.py:function'"
        )
    return _resolve(spec, spec)
