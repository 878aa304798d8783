"""The batch sampled ahead (``rollout.async_steps=1``) as a checkpoint holds it, and its check before a resume.

A checkpoint's ``trainer_state.json`` keeps the batch the sampler thread drew for the next step under
``prefetched`` (`cispo.training.prefetch.rollout_state`): each completion's fields as JSON, its tensors as
``{"data": list, "dtype": name}`` and its prompt as an index into the prompt stream. Loading trusts none of it:
`check_held_batch` reads every field against the model (token ids inside the vocabulary), the stream (prompt
indices inside it) and itself (known fields, dtypes from `DTYPES`, one log-prob per response token, finite
numbers), so a damaged held batch is a damaged checkpoint — named, and the previous one used — never an
``IndexError`` inside the embedding or a NaN trained on.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from cispo.data.prompts import FillReport
from cispo.foundations.experience import Completion

TENSORS = ("response_ids", "logp_rollout", "env_mask")
"""A completion's tensor fields (stored as ``{"data": list, "dtype": name}``; None stays None)."""

DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "float64": torch.float64,
          "float16": torch.float16, "bfloat16": torch.bfloat16, "bool": torch.bool}
"""The dtypes a held batch may name: a name is looked up here, never with ``getattr(torch, name)`` (which would
reach any torch function: ``"ones"``)."""

_INTS = ("int64", "int32")
_FLOATS = ("float32", "float64", "float16", "bfloat16")
_FIELDS = {f.name for f in dataclasses.fields(Completion)}
_REQUIRED = {f.name for f in dataclasses.fields(Completion)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
_TEXT = {"finish_reason": False, "text": False, "reward_error": True}  # field -> may be None


class HeldBatchError(ValueError):
    """A held batch the run cannot train on; the message names the field (``prefetched.groups[0][1].…``)."""


@dataclasses.dataclass(frozen=True)
class HeldBatchLimits:
    """What the held batch must fit: the model's ``vocab_size`` (embedding rows) and the stream's ``num_samples``."""

    vocab_size: int
    num_samples: int


def check_held_batch(held, limits: HeldBatchLimits) -> None:
    """``HeldBatchError`` naming the first wrong field unless ``held`` (a checkpoint's ``prefetched``) is what
    `cispo.training.prefetch.load_rollout` can turn into a batch this run trains on: ``groups`` and ``sampled``
    lists of lists of completions (`check_completion`), ``report`` a `FillReport`'s counts, ``errors`` strings."""
    _need(isinstance(held, dict) and set(held) == {"groups", "sampled", "report", "errors"}, "prefetched",
          f"holds {_show(held if not isinstance(held, dict) else sorted(held))}, not groups, sampled, report, errors")
    for part in ("groups", "sampled"):
        _need(isinstance(held[part], list) and all(isinstance(g, list) for g in held[part]), f"prefetched.{part}",
              "is not a list of groups (lists)")
        for i, group in enumerate(held[part]):
            for j, completion in enumerate(group):
                check_completion(completion, limits, f"prefetched.{part}[{i}][{j}]")
    report, names = held["report"], [f.name for f in dataclasses.fields(FillReport)]
    _need(isinstance(report, dict) and sorted(report) == sorted(names) and all(_count(report[k]) for k in names),
          "prefetched.report", f"is {_show(report)}, not the counts {', '.join(names)}")
    _need(isinstance(held["errors"], list) and all(isinstance(e, str) for e in held["errors"]), "prefetched.errors",
          "is not a list of strings")


def check_completion(c, limits: HeldBatchLimits, where: str) -> None:
    """One completion of a held batch (`check_held_batch`): only `Completion`'s fields, its required ones there;
    ``sample`` an index into the stream; ``prompt_ids`` and ``response_ids`` token ids below the vocabulary size;
    ``logp_rollout`` (finite floats) and ``env_mask`` (0 / 1) one per response token; rewards finite numbers."""
    _need(isinstance(c, dict), where, f"is {_show(c)}, not a completion")
    unknown, missing = sorted(set(c) - _FIELDS), sorted(_REQUIRED - set(c))
    _need(not unknown, where, f"has unknown field(s) {', '.join(unknown)}")
    _need(not missing, where, f"lacks {', '.join(missing)}")
    _need(_count(c["sample"]) and c["sample"] < limits.num_samples, f"{where}.sample",
          f"is {_show(c['sample'])}, not the index of a prompt in the stream (0 to {limits.num_samples - 1})")
    _check_ids(c["prompt_ids"], limits.vocab_size, f"{where}.prompt_ids")
    response = _tensor(c["response_ids"], _INTS, f"{where}.response_ids")
    _check_ids(response, limits.vocab_size, f"{where}.response_ids")
    logp = _tensor(c["logp_rollout"], _FLOATS, f"{where}.logp_rollout")
    _need(len(logp) == len(response), f"{where}.logp_rollout",
          f"has {abs(len(response) - len(logp))} log-prob(s) {'fewer' if len(logp) < len(response) else 'more'} "
          f"than its {len(response)} response token(s)")
    _need(_finite_as(c["logp_rollout"]), f"{where}.logp_rollout", "holds a NaN or an infinity")
    if c.get("env_mask") is not None:
        mask = _tensor(c["env_mask"], (*_INTS, *_FLOATS, "bool"), f"{where}.env_mask")
        _need(len(mask) == len(response) and all(v in (0, 1) for v in mask), f"{where}.env_mask",
              f"is not one 0 / 1 per response token ({len(response)})")
    for name, may_be_none in _TEXT.items():
        value = c.get(name)
        _need(isinstance(value, str) or (value is None and may_be_none),
              f"{where}.{name}", f"is {_show(value)}, not text")
    for name in ("task_reward", "reward"):
        _need(_finite(c.get(name, 0.0)), f"{where}.{name}", f"is {_show(c.get(name))}, not a finite number")
    _check_reward_details(c, where)
    rows = c.get("continuations", [])
    _need(isinstance(rows, list), f"{where}.continuations", "is not a list of completions")
    for k, row in enumerate(rows):
        _need(not (isinstance(row, dict) and row.get("continuations")), f"{where}.continuations[{k}]",
              "has continuations of its own")
        check_completion(row, limits, f"{where}.continuations[{k}]")


def _check_reward_details(c: dict, where: str) -> None:
    """``reward_parts`` (name -> number or None), ``reward_extras`` ([key, number] pairs), ``episode`` (object)."""
    parts = c.get("reward_parts", {})
    _need(isinstance(parts, dict) and all(v is None or _number(v) for v in parts.values()), f"{where}.reward_parts",
          "is not an object of numbers")
    extras = c.get("reward_extras", [])
    _need(isinstance(extras, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                           and _number(p[1]) for p in extras), f"{where}.reward_extras",
          "is not a list of [key, number] pairs")
    _need(c.get("episode") is None or isinstance(c["episode"], dict), f"{where}.episode", "is not an object")


def _tensor(value, dtypes: tuple[str, ...], where: str) -> list:
    """The values of a stored tensor ``{"data": flat list, "dtype": one of dtypes}``."""
    _need(isinstance(value, dict) and set(value) == {"data", "dtype"}, where,
          f"is {_show(value)}, not a tensor's {{data, dtype}}")
    _need(value["dtype"] in dtypes, where, f"names dtype {_show(value['dtype'])}; expected one of {', '.join(dtypes)}")
    data, dtype = value["data"], value["dtype"]
    kind, fits = ("integers", _integer) if dtype in _INTS else ("booleans", _boolean) if dtype == "bool" else \
        ("numbers", _number)
    _need(isinstance(data, list) and all(fits(v) for v in data), where, f"data is not a flat list of {kind}")
    return data


def _finite_as(value: dict) -> bool:
    """Whether a stored float tensor's values are finite in its own dtype (1e300 is not, as float32)."""
    try:
        return bool(torch.isfinite(torch.tensor(value["data"], dtype=DTYPES[value["dtype"]])).all())
    except (OverflowError, RuntimeError):  # an integer too large for any float
        return False


def _check_ids(ids, vocab_size: int, where: str) -> None:
    _need(isinstance(ids, list) and all(_integer(t) for t in ids), where, "is not a list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    _need(not bad, where, f"holds token id {bad[0] if bad else None}, outside the model's vocabulary "
                          f"(0 to {vocab_size - 1})")


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise HeldBatchError(f"{where} {what}")


def _show(value) -> str:
    return repr(value)[:60]


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _boolean(value) -> bool:
    return isinstance(value, bool)


def _count(value) -> bool:
    return _integer(value) and value >= 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value) -> bool:
    return _number(value) and math.isfinite(value)
