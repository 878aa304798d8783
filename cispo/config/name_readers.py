"""What the rows of cispo's table of TRL's and verl's names are made of (`OtherName`) and the small functions
that read their values as cispo's (`cispo.config.trl_names`, `cispo.config.verl_names`; the lookups are in
`cispo.config.foreign_names`). Plain data, no cispo import."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OtherName:
    """TRL's or verl's name of a setting (a row of `OTHER_NAMES`): read as cispo's key where it means
    the same (``read``), else refused with cispo's key and how the two differ (``what``)."""

    source: str
    """``TRL`` (a field of trl 1.16's ``GRPOConfig``) or ``verl`` (a key of verl 0.9.1's ``ppo_trainer.yaml``)."""
    keys: tuple[str, ...]
    """cispo's key(s) of the setting; () where cispo has none."""
    what: str
    """Read: how the values map where they are not simply the same ("" where they are). Refused: how
    cispo's setting differs (the error says it)."""
    read: Callable[[Any], Any] | None = None
    """The value as cispo's (``keys[0]``), or ``ValueError`` saying why a value has no exact cispo
    equivalent. None: the name is refused whatever its value."""
    example: tuple[Any, Any] = ()
    """Read: a value as written for TRL or verl, and the value cispo's key then has."""

    @property
    def as_is(self) -> bool:
        """Read with its value unchanged (the same setting, the same values)."""
        return self.read is same


def same(value: Any) -> Any:
    """The value unchanged: the name means exactly cispo's key."""
    return value


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` of the same type (YAML's ``true`` is not ``1``)."""
    return type(a) is type(b) and a == b


def by_table(table: dict, refused: dict | None = None) -> Callable[[Any], Any]:
    """A ``read``: each value of ``table`` to cispo's; any other refused (``refused[value]``: why)."""
    def read(value: Any) -> Any:
        for theirs, ours in table.items():
            if same_value(value, theirs):
                return ours
        why = next((w for v, w in (refused or {}).items() if same_value(value, v)), None)
        raise ValueError(why or "no cispo value equals it")
    return read


def at_least(least: int, why: str) -> Callable[[Any], Any]:
    """A ``read`` of a count >= ``least`` (the same in both); anything else refused with ``why``."""
    def read(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value >= least:
            return value
        raise ValueError(why)
    return read


def positive(why: str) -> Callable[[Any], Any]:
    """A ``read`` of a number > 0 (the same in both); anything else refused with ``why``."""
    def read(value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return value
        raise ValueError(why)
    return read


def none_as(off: Any) -> Callable[[Any], Any]:
    """A ``read`` of a setting whose null means off: null as cispo's ``off``, any other value as it is."""
    return lambda value: off if value is None else value


def verl_top_k(value: Any) -> Any:
    """verl's ``top_k`` as cispo's: -1 (verl's off) is 0 (cispo's off), a k >= 0 the same."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= -1:
        return max(value, 0)
    raise ValueError("expected -1 (off) or a count of tokens >= 0")


def one_file(value: Any) -> Any:
    """verl's data files (a path or a list of paths) as cispo's one path."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str):
        return value
    raise ValueError("cispo reads one path: put several files in a folder and give the folder")


def trl_report_to(value: Any) -> Any:
    """TRL's ``report_to`` as cispo's ``trackers`` (which checks the sink names itself)."""
    if same_value(value, "all"):
        raise ValueError("TRL's all (every installed integration) is not read: name the sinks")
    return [] if value is None or same_value(value, "none") else value  # none: read as null on the command line


def verl_k1_bounds(spec: Any) -> tuple[float, float]:
    """verl's ``rollout_rs_threshold`` of a k1 rejection (``"L_U"``, or one number U meaning ``"1/U_U"``) as
    cispo's bounds ``(rollout_is_lower, rollout_is_upper)`` of rho = pi_old / pi_rollout: verl keeps a token
    where log L <= k1 <= log U with k1 = -log rho, i.e. 1/U <= rho <= 1/L (its bounds are on pi_rollout / pi_old,
    cispo's on pi_old / pi_rollout: reciprocals)."""
    text = str(spec)
    lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (1.0 / float(text), float(text))
    if not 0 < lower <= upper:
        raise ValueError(f"verl's k1 threshold must be 0 < L <= U, got {spec!r}")
    return 1.0 / upper, 1.0 / lower


def verl_rollout_is_threshold(value: Any) -> Any:
    """verl's ``rollout_is_threshold`` as cispo's ``rollout_is_upper``: a number C (or its text) is TIS's
    upper bound; ``"L_U"`` (IcePop, the weight zeroed outside [L, U]) needs three keys: refused, translated."""
    if isinstance(value, str) and "_" in value:
        lower, upper = value.split("_", 1)
        raise ValueError(f"verl's \"L_U\" (IcePop: the weight rho inside [L, U], 0 outside) is "
                         f"algo.rollout_is_mode=mask algo.rollout_is_lower={lower} algo.rollout_is_upper={upper}")
    try:
        upper = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else math.nan
    except ValueError:
        upper = math.nan
    if not 0 < upper < math.inf:
        raise ValueError("expected a number > 0 or \"L_U\"")
    return upper


def verl_logger(value: Any) -> Any:
    """verl's ``trainer.logger`` as cispo's ``trackers``: ``console`` dropped, ``file`` is ``jsonl``."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list):
        raise ValueError("expected a logger name or a list of them")
    return [{"file": "jsonl"}.get(n, n) for n in names if n != "console"]


def verl_lora_targets(value: Any) -> Any:
    """verl's ``target_modules`` as cispo's ``lora_target_modules``: ``all-linear`` is None (every
    linear layer but lm_head, as PEFT's all-linear)."""
    return None if same_value(value, "all-linear") else [value] if isinstance(value, str) else value


PROMPTS_NOT_CUT = ("cispo never cuts a prompt: one whose tokens and rollout.max_new_tokens do not fit the model's "
                   "context is left out")

OBJ = "algo.objective."
"""The objective's section: the prefix of cispo's keys for what TRL and verl name at their top level."""
