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
  ``log_metric(name, value)`` and ``log_extra(column, values)`` record their numbers, logged as
  ``rollout/reward_extra/<name>`` (`Reward.score`).
* verl (``compute_score``; parameters ``solution_str`` and ``ground_truth``): called as
  ``fn(data_source=sample.get("data_source"), solution_str=completion, ground_truth=...,
  extra_info=sample.get("extra_info") or {})``, the ground truth being the sample's first of
  ``ground_truth``, ``reward_model.ground_truth`` (verl's parquet layout) and ``answer``
  (`VERL_GROUND_TRUTH`); a dict result gives its ``"score"``, and its other keys that hold numbers
  are logged as ``rollout/reward_extra/<key>`` (`Reward.score`).

A reward returning None abstains (`cispo.data.rewards.Outcome`). ``rm:<folder>`` is a reward model
(`cispo.data.rewards.reward_model`). Several rewards, weighted (``data.reward=[a.py:f, b.py:g]``,
``data.reward_weights``): `load_rewards` gives a `RewardSet`, scored by
`cispo.data.rewards.score_completions` (the rule: `cispo.data.rewards.combine`).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cispo.data.rewards import RewardSpecError, cap_message, check_reward_value, describe_error
from cispo.data.rewards.processes import trial_import
from cispo.data.rewards.reward_model import REWARD_MODEL_PREFIX, RewardModel, load_reward_model
from cispo.foundations.suggest import did_you_mean
from cispo.foundations.text import valid_text

__all__ = ["load_reward", "load_rewards", "Reward", "RewardSet", "BUILTIN_REWARDS", "RewardSpecError", "ISOLATIONS",
           "convention_of", "check_reward_fields", "absolute_spec", "field_of", "members_of", "reward_names",
           "unique_names"]

BUILTIN_REWARDS: dict[str, str] = {
    "math": "cispo.data.rewards.math:math_reward",
    "math_lenient": "cispo.data.rewards.math:math_reward_lenient",
    "exact_match": "cispo.data.rewards.exact:exact_match",
    "code": "cispo.data.rewards.code:code_reward",
    "env": "cispo.data.rewards.exact:no_reward",
}
"""Built-in reward names -> ``module:function``, imported only when asked for."""

BUILTIN_FIELDS: dict[str, tuple[str, ...]] = {"math": ("answer",), "math_lenient": ("answer",),
                                              "exact_match": ("answer",), "code": ("tests",), "env": ()}
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
column of that name made every call fail ("got multiple values for argument 'self'"; a
`Reward` itself now takes its arguments by position). The sample's ``prompt`` is its normalised
prompt, passed by position and never as a field."""


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
    """``spec`` with the file of a ``path/to/file.py:function``, or the folder of an ``rm:<folder>``,
    made absolute where it exists (the reward's worker processes, and a later ``cispo eval`` /
    ``--resume`` from another folder, load it again); any other spec as given."""
    if spec.startswith(REWARD_MODEL_PREFIX):
        folder = Path(spec[len(REWARD_MODEL_PREFIX):].strip()).expanduser()
        return f"{REWARD_MODEL_PREFIX}{folder.resolve()}" if folder.is_dir() else spec
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
            raise RewardSpecError(f"reward {spec!r}: {where!r} has no attribute {part!r}"
                                  f"{did_you_mean(part, names, n=3)}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardSpecError(f"reward {spec!r}: {attr!r} in {module_name!r} is not callable "
                              f"(it is a {type(obj).__name__})")
    return obj


def load_reward(spec: str, isolation: str = "auto", workers: int | None = None, trial: bool = True) -> Reward:
    """The `Reward` named by ``spec``: a built-in name (`BUILTIN_REWARDS`), ``module:function``
    or ``path/to/file.py:function``, written with any signature of the module docstring; or, for
    ``rm:<folder>``, a `cispo.data.rewards.reward_model.RewardModel` (``isolation`` does not apply).

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
    if spec.startswith(REWARD_MODEL_PREFIX):  # in this process, batched: never in worker processes
        return load_reward_model(spec)
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


def number_or_none(value) -> float | None:
    """``value`` as a finite float when it is one (a bool, int, float, numpy scalar, 0-dim tensor),
    else None (a text, a list, NaN)."""
    try:
        return check_reward_value(value)
    except Exception:  # noqa: BLE001 - anything that is not a finite number
        return None


class Extras:
    """The numbers one reward call reports besides its reward, as ``(key, value)`` pairs: a verl
    dict's other keys (`add`), and TRL's ``log_metric(name, value)`` / ``log_extra(column, values)``
    (one value per completion in the batch: cispo's batch is the one completion). Values that are
    not finite numbers (a ``log_extra`` text column) are left out: a metric is a number."""

    def __init__(self) -> None:
        self.items: list[tuple[str, float]] = []

    def add(self, key, value) -> None:
        number = number_or_none(value)
        if number is not None:
            self.items.append((valid_text(str(key)), number))  # a metric's name: written to metrics.jsonl

    def log_metric(self, name, value) -> None:
        self.add(name, value)

    def log_extra(self, column, values) -> None:
        for value in values if isinstance(values, (list, tuple)) else [values]:
            self.add(column, value)


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


def _call_cispo(fn, prompt, completion, sample, extras: Extras):
    return _settle(fn(prompt, completion, **_accepted(fn, sample)))


def _call_trl(fn, prompt, completion, sample, extras: Extras):
    chat = "messages" in sample
    columns = {k: [v] for k, v in sample.items() if k not in TRL_ARGS}
    kwargs = dict(prompts=[sample["messages"] if chat else prompt],
                  completions=[[{"role": "assistant", "content": completion}] if chat else completion],
                  trainer_state=None, log_extra=extras.log_extra, log_metric=extras.log_metric, **columns)
    out = _settle(fn(**_accepted(fn, kwargs)))
    if not isinstance(out, (list, tuple)) or len(out) != 1:
        raise ValueError(f"TRL-style reward returned {type(out).__name__} ({out!r:.60}), not a list of one reward")
    return out[0]


def _call_verl(fn, prompt, completion, sample, extras: Extras):
    truth = next((v for name in VERL_GROUND_TRUTH if (v := field_of(sample, name)) is not None), None)
    kwargs = {"solution_str": completion, "ground_truth": truth, "data_source": sample.get("data_source"),
              "extra_info": dict(sample.get("extra_info") or {})}
    out = _settle(fn(**_accepted(fn, kwargs)))  # verl's per-data-set scorers (gsm8k) take no data_source
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"verl-style reward returned a dict without 'score' (keys: {sorted(out)})")
        for key, value in out.items():
            if key != "score":
                extras.add(key, value)
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
        return self.score(prompt, completion, **sample)[0]

    def score(self, prompt: str, completion: str, /, **sample) -> tuple[object, tuple[tuple[str, float], ...]]:
        """``(value, extras)``: what the function returned (its list's one value for TRL, a dict's
        ``"score"`` for verl; not yet checked: `cispo.data.rewards.reward_outcome` does) and the
        numbers it reported besides (`Extras`)."""
        if self.builtin:  # the fields it reads, and no column that would meet one of its options (mode=...)
            sample = {k: sample[k] for k in BUILTIN_FIELDS.get(self.spec, ()) if k in sample}
        extras = Extras()
        value = _CALLS[self.convention](self.fn, prompt, completion, sample, extras)
        return value, tuple(extras.items)

    @property
    def name(self) -> str:
        """The function's name (``rollout/rewards/<name>/...``), as TRL names a reward function:
        its ``__name__`` (a ``functools.partial``'s function's), else its class's; a built-in's is the
        name it is given by (``math``, ``math_lenient``: one function underneath)."""
        if self.builtin:
            return self.spec
        fn = self.fn
        while isinstance(fn, functools.partial):
            fn = fn.func
        return getattr(fn, "__name__", None) or type(fn).__name__

    @property
    def binary(self) -> bool:
        """Whether it is a 0/1 verifier, so that its mean is an accuracy (``rollout/accuracy``,
        ``eval/accuracy``): the built-in names are (`BUILTIN_REWARDS`: each pays 1.0 or 0.0); of a
        user's function cispo cannot know it."""
        return self.builtin

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


# ---------------------------------------------------------------------------------------
# Several rewards, weighted: data.reward=[a.py:f, b.py:g], data.reward_weights (TRL's reward_funcs /
# reward_weights); scored by cispo.data.rewards.score_completions
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardSet:
    """Several loaded rewards (`Reward` s, reward models), their weights and their metric names
    (`unique_names`); the task reward is their weighted sum (`cispo.data.rewards.combine`). Each member
    keeps its own home: a function its own worker pool, a built-in the main thread, a reward model the
    trainer's process (`cispo.data.rewards.submit_outcomes`)."""

    members: tuple
    weights: tuple[float, ...]
    names: tuple[str, ...]
    binary = False
    """A weighted sum is no 0/1 verdict: its mean is no accuracy."""

    def __call__(self, prompt: str, completion: str, /, **sample) -> float:
        """The task reward of one completion (`cispo.data.rewards.score_completions`)."""
        from cispo.data.rewards import score_completions

        return score_completions(self, [(prompt, completion, sample)])[0].value


def unique_names(names) -> tuple[str, ...]:
    """``names`` with each repeat made unique by a suffix: ``(reward, reward, f)`` -> ``(reward, reward_2, f)``."""
    out, seen = [], set()
    for name in names:
        unique, n = name, 1
        while unique in seen:
            n += 1
            unique = f"{name}_{n}"
        seen.add(unique)
        out.append(unique)
    return tuple(out)


def load_rewards(spec, weights=None, isolation: str = "auto", workers: int | None = None):
    """``data.reward`` (one spec, or a list of them) and ``data.reward_weights`` (None: 1.0 each) as one
    reward: the `Reward` (or reward model) itself for one spec of weight 1.0, as it always was, else a
    `RewardSet`. Each spec is loaded by `load_reward`; an empty list, or a number of weights other than
    the specs', -> `RewardSpecError` (the config refuses both first: ``cispo.config.train``)."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs:
        raise RewardSpecError("data.reward: an empty list names no reward")
    if weights is not None and len(weights) != len(specs):
        raise RewardSpecError(f"data.reward_weights: {len(weights)} weight(s) for {len(specs)} reward(s) "
                              f"(data.reward): give one weight per reward")
    members = [load_reward(s, isolation, workers) for s in specs]
    weights = tuple(float(w) for w in weights) if weights is not None else (1.0,) * len(members)
    if len(members) == 1 and weights == (1.0,):
        return members[0]
    return RewardSet(tuple(members), weights, unique_names(m.name for m in members))


def members_of(reward_fn) -> tuple:
    """The rewards a task reward is made of: a `RewardSet`'s members, else the reward itself."""
    return reward_fn.members if isinstance(reward_fn, RewardSet) else (reward_fn,)


def reward_names(reward_fn) -> tuple[str, ...] | None:
    """The metric names of ``reward_fn``'s rewards (``rollout/rewards/<name>/...``): a `RewardSet`'s,
    one loaded reward's (`Reward.name`, a reward model's folder name); None for any other callable (a
    built-in task's reward: its mean is ``rollout/accuracy``)."""
    if isinstance(reward_fn, RewardSet):
        return reward_fn.names
    return (reward_fn.name,) if isinstance(reward_fn, (Reward, RewardModel)) else None


def _sources(task, data_cfg, named_sets: dict | None):
    """``(role, data file, its extra_fields, samples)`` for each set a run scores with ``task.reward``."""
    train = task.train_samples(data_cfg.seed, data_cfg.num_train_prompts)
    yield "training", data_cfg.path, data_cfg.extra_fields, train
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
    (`Reward.reserved`: ``self``, ``completion``); each of several rewards
    (`RewardSet`) so. Rewards that are not a `Reward` (the built-in
    tasks', a reward model) are not checked. Called once, before sampling starts."""
    for reward in members_of(task.reward):
        if isinstance(reward, Reward):
            _check_fields(reward, task, data_cfg, named_sets)


def _check_fields(reward: Reward, task, data_cfg, named_sets: dict | None) -> None:
    """`check_reward_fields` for one reward."""
    needs, reserved = reward.needs, reward.reserved
    for role, path, extra_fields, samples in _sources(task, data_cfg, named_sets):
        for i, sample in enumerate(samples):
            problem = (_reserved_column(reserved, reward.spec, sample)
                       or _missing_field(needs, reward.spec, sample, extra_fields))
            if problem:
                raise RewardSpecError(f"data file {path!r}: {role} sample {i} {problem}")
