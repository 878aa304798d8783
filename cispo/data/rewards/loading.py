"""Resolve a reward spec (config string) to a `Reward`: callable as ``(prompt, completion, **sample) -> float``.

    >>> load_reward("exact_match")                     # a built-in, by name
    >>> load_reward("my_pkg.rewards:score")            # module:function (module importable)
    >>> load_reward("rewards/my_reward.py:score")      # path/to/file.py:function

Built-ins (see `BUILTIN_REWARDS`): ``math`` (math-verify equivalence), ``exact_match``
(normalised string / number match), ``code`` (`cispo.data.rewards.code.code_reward`). The
attribute may be dotted (``module:Class.method``). Every failure raises `RewardSpecError`
(a ValueError) naming the spec and what is wrong, except a missing math-verify for ``math``
(ImportError with the pip command).

Three signatures are accepted unchanged, told apart by their parameter names (`convention_of`):

* cispo: ``fn(prompt, completion, **sample) -> float``; ``sample`` holds the data set's other
  fields (``answer``, ``messages``, the columns of ``data.extra_fields``: by default every one).
* TRL (``GRPOTrainer`` custom reward; a parameter named ``prompts``, ``completions`` or
  ``completion_ids``): called once per completion as ``fn(prompts=[prompt],
  completions=[completion], **{field: [value]}, trainer_state=None, log_extra=.., log_metric=..)``,
  its list of one float taken: every column by its own name, as TRL passes them (``solution``
  for ``def reward(prompts, completions, solution, **kwargs)``), and the answer also as
  ``answer``. For chat data (the sample has ``messages``) the prompt is the
  message list and the completion ``[{"role": "assistant", "content": text}]``, as TRL's
  conversational format. ``completion_ids`` is not available (such a function is refused);
  ``log_extra`` / ``log_metric`` are accepted and ignored.
* verl (``compute_score``; parameters ``solution_str`` and ``ground_truth``): called as
  ``fn(data_source=sample.get("data_source"), solution_str=completion, ground_truth=...,
  extra_info=sample.get("extra_info") or {})``, the ground truth being the sample's first of
  ``ground_truth``, ``reward_model.ground_truth`` (verl's parquet layout) and ``answer``
  (`VERL_GROUND_TRUTH`); a dict result gives its ``"score"``.

A function of any kind without ``**kwargs`` gets only the fields it names (a column it does not
name is not passed); a built-in gets only its `BUILTIN_FIELDS`. An async function is run to
completion (``asyncio.run``).

`check_reward_fields` checks before training that every sample has the fields the reward needs, and
no column that would meet an argument the reward already gets (`RESERVED_FIELDS`, `Reward.reserved`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cispo.data.rewards import cap_message, describe_error
from cispo.data.rewards.processes import trial_import
from cispo.foundations.suggest import did_you_mean

__all__ = ["load_reward", "Reward", "BUILTIN_REWARDS", "RewardSpecError", "ISOLATIONS", "convention_of",
           "check_reward_fields", "absolute_spec", "field_of"]

BUILTIN_REWARDS: dict[str, str] = {
    "math": "cispo.data.rewards.math:math_reward",
    "math_lenient": "cispo.data.rewards.math:math_reward_lenient",
    "exact_match": "cispo.data.rewards.exact:exact_match",
    "code": "cispo.data.rewards.code:code_reward",
}
"""Built-in reward names -> ``module:function``, imported only when asked for."""

BUILTIN_FIELDS: dict[str, tuple[str, ...]] = {"math": ("answer",), "math_lenient": ("answer",), "exact_match": ("answer",), "code": ("tests",)}
"""The sample fields each built-in reward needs."""

ISOLATIONS = ("auto", "process", "main")
"""``data.reward_isolation``: where a reward runs (see `load_reward`)."""

TRL_ARGS = ("prompts", "completions", "completion_ids", "completions_ids", "trainer_state", "log_extra",
            "log_metric", "environments")
"""Arguments TRL's GRPOTrainer passes besides the data set's columns."""

VERL_GROUND_TRUTH = ("ground_truth", "reward_model.ground_truth", "answer")
"""Where a verl ``compute_score`` finds its ``ground_truth`` in a sample, first found first."""


RESERVED_FIELDS = {"self": "its argument 'self' (the reward object's own)",
                   "completion": "its argument 'completion' (the model's text)"}
"""Sample fields no data column may fill, for any reward, each with the argument it would meet: a
method reward's ``self`` and a cispo-style function's ``completion`` are bound by every call, so a
column of that name made every call fail ("got multiple values for argument 'self'": issue 44; a
`Reward` itself now takes its arguments by position). The sample's ``prompt`` is its normalised
prompt, passed by position and never as a field."""


class RewardSpecError(ValueError):
    """A reward spec that names no usable callable."""


def _is_path(module: str) -> bool:
    return module.endswith(".py") or "/" in module or os.sep in module


IMPORT_ADVICE = ("a reward module must import without exiting: put a script's top-level code under "
                 "`if __name__ == \"__main__\":`")


def _tried(spec: str, what: str, module: str, path: str | None = None) -> None:
    """`trial_import` first, in a throw-away process: an exit, ``os._exit`` or crash at import
    becomes a `RewardSpecError` naming ``what`` (the file or module) instead of ending the trainer."""
    outcome = trial_import(module, path)
    if outcome is not None:
        raise RewardSpecError(f"reward {spec!r}: importing {what} {outcome} ({IMPORT_ADVICE})")


def _import_file(spec: str, path_str: str, trial: bool = True):
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
    if trial:
        _tried(spec, repr(str(resolved)), mod_name, str(resolved))
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[mod_name] = module  # registered first so dataclasses / pickling inside it work
    try:
        file_spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(mod_name, None)
        if isinstance(e, KeyboardInterrupt):  # the trial import came back: a real Ctrl-C
            raise
        if isinstance(e, SystemExit):
            raise RewardSpecError(f"reward {spec!r}: importing {str(resolved)!r} exited with sys.exit({e.code!r:.200}) "
                                  f"({IMPORT_ADVICE})") from None
        raise RewardSpecError(f"reward {spec!r}: importing {str(resolved)!r} failed: {describe_error(e)}") from e
    return module


def _import_module(spec: str, name: str, trial: bool = True):
    if trial and name not in sys.modules:
        _tried(spec, f"module {name!r}", name)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing == name or name.startswith(missing + "."):
            raise RewardSpecError(
                f"reward {spec!r}: no module named {missing!r} (is it installed, or on sys.path / "
                f"PYTHONPATH? For a file use 'path/to/file.py:function')"
            ) from e
        raise RewardSpecError(f"reward {spec!r}: importing module {name!r} failed: {describe_error(e)}") from e
    except ImportError as e:  # e.g. a missing optional dependency, with its own message
        raise RewardSpecError(f"reward {spec!r}: importing module {name!r} failed: {cap_message(str(e))}") from e
    except Exception as e:
        raise RewardSpecError(f"reward {spec!r}: importing module {name!r} failed: {describe_error(e)}") from e
    except SystemExit as e:
        raise RewardSpecError(f"reward {spec!r}: importing module {name!r} exited with sys.exit({e.code!r:.200}) "
                              f"({IMPORT_ADVICE})") from None


def absolute_spec(spec: str) -> str:
    """``spec`` with the file of a ``path/to/file.py:function`` made absolute where it exists (the
    reward's worker processes, and a later ``cispo eval`` / ``--resume`` from another folder,
    load it again); any other spec as given."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not _is_path(module_name) or not Path(module_name).expanduser().is_file():
        return spec
    return f"{Path(module_name).expanduser().resolve()}:{attr}"


def _resolve(spec: str, target: str, trial: bool = True) -> Callable[..., float]:
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardSpecError(f"reward {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    module = (_import_file(spec, module_name, trial) if _is_path(module_name) else
              _import_module(spec, module_name, trial))
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


def load_reward(spec: str, isolation: str = "auto", workers: int | None = None, trial: bool = True) -> "Reward":
    """The `Reward` named by ``spec``: a built-in name (`BUILTIN_REWARDS`), ``module:function``
    or ``path/to/file.py:function``, written with any signature of the module docstring.

    ``trial``: a user module not yet imported is imported first in a throw-away process
    (`cispo.data.rewards.processes.trial_import`), so that ``sys.exit``, ``os._exit``,
    ``KeyboardInterrupt`` or a crash at its import is a `RewardSpecError` naming it, not the
    end of this process (a script ending in ``sys.exit(main())`` without a main guard).

    ``isolation`` (``data.reward_isolation``): ``process`` runs its calls in ``workers`` worker
    processes (default min(8, CPUs); `cispo.data.rewards.pool`), ``main`` in the trainer's main
    thread, ``auto`` (default) ``main`` for the built-in names, ``process`` for the rest.

    Built-in ``math`` fails here (ImportError with the pip command), not at the first reward,
    if math-verify is missing."""
    if isolation not in ISOLATIONS:
        raise RewardSpecError(f"data.reward_isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise RewardSpecError(f"data.reward_workers must be a positive int or None, got {workers!r}")
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    builtin = spec in BUILTIN_REWARDS
    if builtin:
        module_name = BUILTIN_REWARDS[spec].partition(":")[0]
        if importlib.util.find_spec(module_name) is None:
            raise RewardSpecError(f"built-in reward {spec!r} is not available in this install "
                                  f"(module {module_name!r} is missing)")
        fn = _resolve(spec, BUILTIN_REWARDS[spec], trial=False)  # trusted
        if spec in ("math", "math_lenient"):
            from cispo.data.rewards.math import require_math_verify

            require_math_verify()  # ImportError with the pip command
    elif ":" not in spec:
        raise RewardSpecError(
            f"unknown reward {spec!r}{did_you_mean(spec, BUILTIN_REWARDS, n=3)}; built-in rewards: "
            f"{', '.join(sorted(BUILTIN_REWARDS))}; or give 'module:function' / 'path/to/file.py:function'"
        )
    else:
        fn = _resolve(spec, spec, trial)
        spec = absolute_spec(spec)  # the worker processes may run elsewhere: an absolute path
    convention = convention_of(fn)
    if convention == "trl" and _required_args(fn, ()) & {"completion_ids", "completions_ids"}:
        raise RewardSpecError(f"reward {spec!r} (TRL signature) needs completion_ids: token ids are not passed "
                              f"to rewards in cispo; score the completion text instead")
    return Reward(spec=spec, fn=fn, convention=convention, builtin=builtin,
                  isolated=isolation == "process" or (isolation == "auto" and not builtin),
                  workers=workers or min(8, os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------
# One signature for the trainer: cispo's, TRL's, verl's
# ---------------------------------------------------------------------------------------


def convention_of(fn: Callable) -> str:
    """``"verl"`` (parameters ``solution_str`` and ``ground_truth``), ``"trl"`` (a parameter
    ``prompts``, ``completions`` or ``completion_ids``) or ``"cispo"`` (anything else)."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return "cispo"
    if {"solution_str", "ground_truth"} <= names:
        return "verl"
    if names & {"prompts", "completions", "completion_ids", "completions_ids"}:
        return "trl"
    return "cispo"


def _required_args(fn: Callable, skip_positional: tuple) -> set[str]:
    """Names of ``fn``'s parameters that have no default, but the first ``len(skip_positional)``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params[len(skip_positional):] if p.kind in kinds and p.default is inspect.Parameter.empty}


def _positional_names(fn: Callable) -> tuple[str, ...]:
    """The names of ``fn``'s first two parameters where a keyword of that name would meet them (not
    positional-only ones), which a cispo-style call fills by position with the prompt and the completion."""
    try:
        params = list(inspect.signature(fn).parameters.values())[:2]
    except (TypeError, ValueError):
        return ()
    return tuple(p.name if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else "" for p in params)


def _settle(value):
    return asyncio.run(value) if inspect.isawaitable(value) else value


def _ignore(*args, **kwargs) -> None:
    """TRL's ``log_extra`` / ``log_metric``: accepted, not recorded."""


def _keywords(fn: Callable) -> frozenset[str] | None:
    """The keyword arguments ``fn`` accepts by name, or None when it takes any (``**kwargs``, or
    no signature to read)."""
    try:
        return _cached_keywords(fn)
    except TypeError:  # an unhashable callable object
        return _cached_keywords.__wrapped__(fn)


@functools.lru_cache(maxsize=64)
def _cached_keywords(fn: Callable) -> frozenset[str] | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in kinds)


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """The entries of ``kwargs`` that ``fn`` accepts (all of them with ``**kwargs``)."""
    names = _keywords(fn)
    return kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}


def field_of(sample: dict, name: str):
    """``sample[name]``, or for a dotted ``name`` not a key itself the value at that path through
    nested dicts (``reward_model.ground_truth``); None when absent."""
    if name in sample:
        return sample[name]
    value = sample
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _call_cispo(fn, prompt, completion, sample):
    return _settle(fn(prompt, completion, **_accepted(fn, sample)))


def _call_trl(fn, prompt, completion, sample):
    chat = "messages" in sample
    columns = {k: [v] for k, v in sample.items() if k not in TRL_ARGS}
    kwargs = dict(prompts=[sample["messages"] if chat else prompt],
                  completions=[[{"role": "assistant", "content": completion}] if chat else completion],
                  trainer_state=None, log_extra=_ignore, log_metric=_ignore, **columns)
    out = _settle(fn(**_accepted(fn, kwargs)))
    if not isinstance(out, (list, tuple)) or len(out) != 1:
        raise ValueError(f"TRL-style reward returned {type(out).__name__} ({out!r:.60}), not a list of one reward")
    return out[0]


def _call_verl(fn, prompt, completion, sample):
    truth = next((v for name in VERL_GROUND_TRUTH if (v := field_of(sample, name)) is not None), None)
    kwargs = {"solution_str": completion, "ground_truth": truth, "data_source": sample.get("data_source"),
              "extra_info": dict(sample.get("extra_info") or {})}
    out = _settle(fn(**_accepted(fn, kwargs)))  # verl's per-data-set scorers (gsm8k) take no data_source
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"verl-style reward returned a dict without 'score' (keys: {sorted(out)})")
        return out["score"]
    return out


_CALLS = {"cispo": _call_cispo, "trl": _call_trl, "verl": _call_verl}


@dataclass(frozen=True)
class Reward:
    """A loaded reward, callable as cispo's ``(prompt, completion, **sample) -> float`` whatever
    signature it was written with (`convention`)."""

    spec: str
    """The spec it was loaded from (a file's path made absolute): worker processes load it again."""
    fn: Callable = field(repr=False)
    """The function as written."""
    convention: str = "cispo"
    """``cispo``, ``trl`` or ``verl`` (`convention_of`)."""
    builtin: bool = False
    isolated: bool = True
    """Run in worker processes (`cispo.data.rewards.pool`) rather than the trainer's main thread."""
    workers: int = 1
    """Worker processes when ``isolated``."""

    def __call__(self, prompt: str, completion: str, /, **sample) -> float:
        if self.builtin:  # the fields it reads, and no column that would meet one of its options (mode=...)
            sample = {k: sample[k] for k in BUILTIN_FIELDS.get(self.spec, ()) if k in sample}
        return _CALLS[self.convention](self.fn, prompt, completion, sample)

    @property
    def needs(self) -> list[tuple[str, ...]]:
        """The sample fields the reward needs, each as a tuple of names any one of which will do."""
        if self.builtin:
            return [(name,) for name in BUILTIN_FIELDS.get(self.spec, ())]
        if self.convention == "verl":
            return [VERL_GROUND_TRUTH]
        if self.convention == "trl":
            return [(name,) for name in sorted(_required_args(self.fn, ()) - set(TRL_ARGS))]
        return [(name,) for name in sorted(_required_args(self.fn, ("prompt", "completion")))]

    @property
    def reserved(self) -> dict[str, str]:
        """Sample fields that may not come from a data column, each with the argument it would meet:
        `RESERVED_FIELDS`, and for a cispo-style function the names of its first two parameters (``def
        score(question, response, **kw)``: a column ``question`` would meet the prompt)."""
        out = dict(RESERVED_FIELDS)
        if not self.builtin and self.convention == "cispo":
            for name, what in zip(_positional_names(self.fn), ("the prompt", "the completion")):
                if name and name != "prompt":
                    out.setdefault(name, f"its parameter {name!r}, which receives {what}")
        return out


def _sources(task, data_cfg, named_sets: dict | None):
    """``(role, data file, its extra_fields, samples)`` for each set a run scores with ``task.reward``."""
    yield "training", data_cfg.path, data_cfg.extra_fields, task.train_samples(data_cfg.seed, data_cfg.num_train_prompts)
    yield ("held-out", data_cfg.eval_path or data_cfg.path, data_cfg.extra_fields,
           task.eval_samples(data_cfg.seed, data_cfg.num_eval_prompts))
    for name, samples in (named_sets or {}).items():
        set_cfg = data_cfg.eval_sets.get(name)
        yield (f"evaluation set {name!r}", getattr(set_cfg, "path", name),
               getattr(set_cfg, "extra_fields", data_cfg.extra_fields), samples)


def _missing_field(needs: list[tuple[str, ...]], spec: str, sample: dict, extra_fields) -> str | None:
    """What is wrong when ``sample`` lacks a field the reward ``spec`` needs (`Reward.needs`), or None."""
    for names in needs:
        if not any(field_of(sample, name) is not None for name in names):
            have = ", ".join(sorted(sample)) or "none"
            want = " or ".join(repr(n) for n in names)
            hint = ("set data.answer_field to the field holding it" if "answer" in names else
                    f"the data set has no such column{did_you_mean(names[0], sample)}"
                    if extra_fields == "all" else
                    f"add it with data.extra_fields=[{names[0]}], or data.extra_fields=all")
            return f"has no field {want}, which reward {spec!r} needs ({hint}); the sample's fields: {have}"
    return None


def _reserved_column(reserved: dict[str, str], spec: str, sample: dict) -> str | None:
    """What is wrong when ``sample`` has a field named like an argument the reward ``spec`` already
    gets (`Reward.reserved`), or None."""
    for name, what in reserved.items():
        if name in sample:
            return (f"has a column {name!r}, which would meet {what} in every call of reward {spec!r}, "
                    f"failing each; rename the column, or pass only the columns the reward needs "
                    f"(data.extra_fields=[...])")
    return None


def check_reward_fields(task, data_cfg, named_sets: dict | None = None) -> None:
    """Raise `RewardSpecError` naming the data file, the sample and the field if a training or
    held-out sample of ``task`` (a prompt source: ``reward``, ``train_samples``,
    ``eval_samples``) — or of ``named_sets`` (``data.eval_sets``: name -> samples) — lacks a field its
    reward needs (`Reward.needs`), or has a column named like an argument the reward already gets
    (`Reward.reserved`: ``self``, ``completion``). Rewards that are not a `Reward` (the built-in
    tasks') are not checked. Called once, before sampling starts."""
    reward = task.reward
    if not isinstance(reward, Reward):
        return
    needs, reserved = reward.needs, reward.reserved
    for role, path, extra_fields, samples in _sources(task, data_cfg, named_sets):
        for i, sample in enumerate(samples):
            problem = (_reserved_column(reserved, reward.spec, sample)
                       or _missing_field(needs, reward.spec, sample, extra_fields))
            if problem:
                raise RewardSpecError(f"data file {path!r}: {role} sample {i} {problem}")
