"""TRL's and verl's names of cispo's settings (`OTHER_NAMES`): read as cispo's keys where they mean the
same, answered with cispo's key and the difference where they do not. `cispo.config.engine` reads an
unknown key through them (`lookup`, `describe`, `read_line`); docs/integrations.md shows the table
(tests/test_config.py checks that the two agree). Plain data, no cispo import."""

from __future__ import annotations

import reprlib
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from cispo.config.name_readers import OtherName, same_value
from cispo.config.trl_names import TRL_NAMES
from cispo.config.verl_names import VERL_NAMES

__all__ = ["OTHER_NAMES", "OTHER_SECTIONS", "OtherName", "describe", "lookup", "other_name_hint", "read_line"]

OTHER_NAMES: dict[str, OtherName] = {**TRL_NAMES, **VERL_NAMES}
"""TRL's and verl's names of cispo's settings (TRL: ``GRPOConfig``'s fields; verl: its dotted keys,
also found by their last parts, ``rollout.n`` or ``n``: `lookup`). `cispo train` reads an unknown key
that is one of them as cispo's key where ``read`` is set (a line on stderr says so), and refuses it
with cispo's key and the difference otherwise (`cispo.config.engine`); elsewhere an unknown name
gets the same words as its hint (`other_name_hint`). docs/integrations.md shows this table
(tests/test_config.py checks that the two agree)."""

_TOO_GENERIC = frozenset({"enable", "name", "path"})
"""Last parts of verl keys that say too little alone (``enable=true``): found only with their section."""

OTHER_SECTIONS = frozenset(name.split(".")[0] for name in OTHER_NAMES if "." in name)
"""The top-level sections of verl's names (``actor_rollout_ref``, ``trainer``, ...)."""


def _suffixes() -> dict[tuple[str, ...], list[str]]:
    """Every name of `OTHER_NAMES` by each of its trailing parts (``('rollout', 'n')``, ``('n',)``)."""
    out: dict[tuple[str, ...], list[str]] = {}
    for name in OTHER_NAMES:
        parts = tuple(name.split("."))
        for i in range(len(parts)):
            out.setdefault(parts[i:], []).append(name)
    return out


_BY_SUFFIX = _suffixes()


def lookup(path: Sequence[str], own: Collection[str] = ()) -> tuple[str, OtherName] | None:
    """The name of `OTHER_NAMES` that key ``path`` (its parts, as typed) is, with its row: the name
    itself; else the one name that ends with ``path`` (``rollout.n``), a single part only where it
    is none of ``own`` (the config's own field names: ``lr`` is cispo's) and says enough alone; None
    where none, or several, match."""
    path = tuple(map(str, path))
    name = ".".join(path)
    if name in OTHER_NAMES:
        return name, OTHER_NAMES[name]
    if len(path) == 1 and (path[0] in own or path[0] in _TOO_GENERIC):
        return None
    found = _BY_SUFFIX.get(path, [])
    return (found[0], OTHER_NAMES[found[0]]) if len(found) == 1 else None


def describe(name: str, other: OtherName, shown: Sequence[str] | None = None) -> str:
    """`` (did you mean 'k'? 'beta' in TRL: what)``: ``name`` as typed, its row ``other`` and cispo's
    key(s) as this config names them (``shown``; default ``other.keys``); where cispo has none,
    `` ('top_k' in TRL: no cispo setting; what)``."""
    shown = other.keys if shown is None else shown
    what = other.what or "the same setting"
    if not shown:
        return f" ({name!r} in {other.source}: no cispo setting; {what})"
    return f" (did you mean {' and '.join(map(repr, shown))}? {name!r} in {other.source}: {what})"


def other_name_hint(name: str, keys: Iterable[str]) -> str:
    """`describe` for ``name`` when it is one of `OTHER_NAMES` (`lookup`) and its cispo keys are
    among ``keys``: the key itself, a key below a dict field in ``keys`` (``rollout.vllm_kwargs``),
    or one given relative to its section (``kl_coef`` among ObjectiveConfig's fields); ``""`` otherwise."""
    match = lookup((name,))
    if match is None:
        return ""
    other = match[1]
    keys = set(map(str, keys))
    found = [next((k for k in sorted(keys, key=len, reverse=True)
                   if t == k or t.startswith(k + ".") or t.endswith("." + k)), None) for t in other.keys]
    if None in found:
        return ""
    return describe(name, other, [t if t.startswith(k + ".") else k for t, k in zip(other.keys, found)])


def read_line(typed: str, other: OtherName, before: Any, after: Any) -> str:
    """The line that says ``typed`` (a name of `OTHER_NAMES`, as given) is read as cispo's key:
    ``cispo: reading TRL's learning_rate as optim.lr``, with the values where they differ
    (``loss_type=dapo as algo.objective=ppo``)."""
    def shown(value: Any) -> str:
        if isinstance(value, bool) or value is None:
            return {True: "true", False: "false", None: "null"}[value]
        return value if isinstance(value, str) else reprlib.repr(value)

    if same_value(before, after):
        return f"cispo: reading {other.source}'s {typed} as {other.keys[0]}"
    return f"cispo: reading {other.source}'s {typed}={shown(before)} as {other.keys[0]}={shown(after)}"
