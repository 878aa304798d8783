"""The config engine: YAML files, ``key=value`` overrides, help text and errors that name the
key, for any tree of plain dataclasses (the run's own are in `cispo.config.train`).

The configs are plain dataclasses; pydantic checks and converts plain data into them (types,
``Literal`` choices, unknown keys, and each class's ``__post_init__`` checks). OmegaConf, which
verl and Hydra use, was the first choice; version 2.3 rejects ``Literal`` fields and turns
tuples into lists. The YAML files and ``key=value`` overrides are the same with either.
Hostile or careless input is one line, fast (docs/reliability.md, "Config"): the YAML text is read
by `cispo.config.yaml_input` (size, depth, alias, duplicate-key and integer limits); an error
message shows a value through `short_repr` and at most `MAX_PROBLEMS` problems.
pydantic is imported where a config is read or checked, not at import: the config dataclasses
themselves (``TrainConfig()``, ``dataclasses.replace``) work without it, as on a bare CUDA image
(``benchmarks/gpu/gpu_check.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import pathlib
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import yaml

from cispo.config.foreign_names import OTHER_SECTIONS, OtherName, describe, lookup, other_name_hint, read_line
from cispo.config.yaml_input import (
    MAX_ALIAS_NODES,
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    MAX_INT_CHARS,
    ConfigError,
    ConfigLoader,
    RefusedYAML,
    parse_yaml,
    read_config_text,
    short_repr,
    yaml_problem,
)
from cispo.foundations.suggest import did_you_mean

__all__ = ["ConfigError", "MAX_ALIAS_NODES", "MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_INT_CHARS", "MAX_PROBLEMS",
           "apply_overrides", "field_docs", "from_dict", "load_yaml", "note_values",
           "rename_key", "section_shorthand", "short_repr", "to_dict"]
T = TypeVar("T")
KeyPath = tuple  # field names (str) and list indices (int), as in pydantic's error locations


MAX_PROBLEMS = 20
"""An error message lists at most this many problems, then how many more there are."""
MAX_LINE_CHARS = 1000
"""An error line longer than this (a long key, or a check's message that quotes a long value) is
cut, with its length said."""


def _clip(line: str) -> str:
    """``line`` cut to `MAX_LINE_CHARS`, saying its length when it was cut."""
    return line if len(line) <= MAX_LINE_CHARS else f"{line[:MAX_LINE_CHARS]}… ({len(line):,} characters)"


@functools.cache
def _fields(cls: type) -> dict[KeyPath, Any]:
    """The type of every field of dataclass ``cls`` and of its sections, by key path."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"expected a dataclass type, got {cls!r}")
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        out[(f.name,)] = tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update({(f.name, *key): t for key, t in _fields(tp).items()})
    return out


@functools.cache
def _adapter(cls: type):
    """pydantic's validator of config ``cls`` (a ``pydantic.TypeAdapter``): unknown keys are errors;
    docstrings are read."""
    import pydantic

    types_ = list(_fields(cls).values())
    types_ += [a for t in types_ for a in typing.get_args(t)]  # dict[str, Section] values
    for c in [cls] + [t for t in types_ if dataclasses.is_dataclass(t)]:
        if "__pydantic_config__" not in vars(c):  # how pydantic reads a plain dataclass
            c.__pydantic_config__ = pydantic.ConfigDict(
                extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True)
    return pydantic.TypeAdapter(cls)


def _dotted(path: KeyPath) -> str:
    """``('optim', 'betas', 1)`` -> ``'optim.betas[1]'``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _type_name(tp: Any) -> str:
    """``float``, ``int | None``, ``Literal['torch', 'vllm']``, ``tuple[float, float]``..."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(map(_type_name, typing.get_args(tp)))
    if tp is type(None):
        return "None"
    return tp.__name__ if isinstance(tp, type) and not typing.get_args(tp) else str(tp).replace("typing.", "")


def _accepts_str(tp: Any) -> bool:
    """``str``, ``str | None``, ``Literal['a', 'b']``..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    return tp is str or (origin is Literal and any(isinstance(a, str) for a in args)) or (
        origin in (typing.Union, types.UnionType) and any(map(_accepts_str, args)))


def _problem(cls: type, err: dict) -> str:
    """``dotted.key: what is wrong`` for one pydantic error (a typo gets a suggestion; the value
    given is shown by `short_repr`, and only a short word or key is compared with the choices)."""
    loc, fields = tuple(err["loc"]), _fields(cls)
    if loc not in fields and typing.get_origin(fields.get(loc[:-1])) in (typing.Union, types.UnionType):
        # one branch of a union field (pydantic tags it 'bool', "literal['auto']"): one line for the field
        return f"{_dotted(loc[:-1])}: expected {_type_name(fields[loc[:-1]])}, got {short_repr(err.get('input'))}"
    key, tp, got = _dotted(loc), fields.get(loc), err.get("input")
    if len(key) > 200:  # a 1 MB key: no suggestion can help, and comparing it would be slow
        what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        return f"{short_repr(key)}: {what}"
    if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        same_leaf = [_dotted(k) for k in fields if k[-1] == loc[-1]]  # 'lr' where 'optim.lr' belongs
        hint = (did_you_mean(key, same_leaf, len(same_leaf), 0) if same_leaf else "") or other_name_hint(
            str(loc[-1]), map(_dotted, fields)) or did_you_mean(  # TRL's 'beta', verl's 'kl_loss_coef'
            key, map(_dotted, fields)) or did_you_mean(loc[-1], {k[-1] for k in fields})  # a short name
        return f"{key}: unknown key{hint}"
    if err["type"] == "value_error":  # a __post_init__ check; its message names the key
        return f"{key + ': ' if key else ''}{err['ctx']['error']}"
    if err["type"] == "literal_error" and tp is not None:  # Literal[...] or Literal[...] | None
        choices = [c for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) is Literal for c in typing.get_args(a)]
        note = _VALUE_NOTES.get(cls, {}).get(key, {}).get(got) if isinstance(got, str) else None
        hint = f" ({note})" if note else did_you_mean(got, choices) if isinstance(got, str) and len(got) <= 200 else ""
        return f"{key}: expected one of {', '.join(map(repr, choices))}, got {short_repr(got)}{hint}"
    expected = f"expected {_type_name(tp)}" if tp else err["msg"]
    return f"{key}: {expected}, got {short_repr(got)}"


_RENAMED: dict[type, dict[KeyPath, tuple[KeyPath, Callable[[Any], Any]]]] = {}
_VALUE_NOTES: dict[type, dict[str, dict[str, str]]] = {}
_SHORTHANDS: dict[type, dict[KeyPath, str]] = {}


def note_values(cls: type, key: str, notes: dict[str, str]) -> None:
    """Answer a value of ``Literal`` field ``key`` (dotted) of config ``cls`` that is one of ``notes``
    with its note instead of the nearest choice: a name that means something else than its nearest
    spelling (``algo.objective.name=dr_grpo`` is a recipe, not ``grpo``)."""
    _VALUE_NOTES.setdefault(cls, {}).setdefault(key, {}).update(notes)


def section_shorthand(cls: type, section: str, field: str) -> None:
    """A plain value (not a mapping) given for ``section`` (dotted) of config ``cls`` sets its field
    ``field``: ``algo.objective=ppo`` is ``algo.objective.name=ppo``, in a file or an override."""
    _SHORTHANDS.setdefault(cls, {})[tuple(section.split("."))] = field


def rename_key(cls: type, old: str, new: str, convert: Callable[[Any], Any] = lambda value: value) -> None:
    """Read dotted key ``old`` of config ``cls`` as ``new`` (its value through ``convert``), so that
    files written before a key was renamed (a run folder's ``config.yaml``) still load; ``old`` with
    a value (not None) next to a value of ``new`` is an error. A mapping renamed onto a section
    (``algo.objective_overrides`` -> ``algo.objective``) sets those fields of it; a field given under
    both names is the error. An override may use the old key too (``objective_overrides.kl_coef=0.1``)."""
    _RENAMED.setdefault(cls, {})[tuple(old.split("."))] = (tuple(new.split(".")), convert)


def _shorthands(cls: type, data: Any) -> Any:
    """``data`` (a copy, where a section of ``cls`` is given as a plain value: `section_shorthand`) with
    each such value under the section's field."""
    found = [(section, field) for section, field in _SHORTHANDS.get(cls, {}).items()
             if not isinstance(_get(data, section, {}), dict)]
    if found:
        data = copy.deepcopy(data)
    for section, field in found:
        parent = _get(data, section[:-1], None)
        parent[section[-1]] = {field: parent[section[-1]]}
    return data


def _get(data: Any, path: KeyPath, missing: Any) -> Any:
    """The value at ``path`` of nested mappings ``data``; ``missing`` where there is none."""
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return missing
        data = data[part]
    return data


def _renamed(cls: type, data: Any, where: Callable[[KeyPath], str]) -> Any:
    """``data`` (a copy, when a renamed key of ``cls`` is in it: `rename_key`) with them under their new
    names, after `_shorthands`."""
    data = _shorthands(cls, data)
    renamed = _RENAMED.get(cls, {})
    if renamed and isinstance(data, dict):
        data = copy.deepcopy(data)
    for old, (new, convert) in renamed.items():
        parent = functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, old[:-1], data)
        if not isinstance(parent, dict) or old[-1] not in parent:
            continue
        value = parent.pop(old[-1])
        target = functools.reduce(lambda d, k: d.setdefault(k, {}), new[:-1], data)
        if value is not None and isinstance(target.get(new[-1]), dict) and isinstance(value, dict):
            both = sorted(set(value) & set(target[new[-1]]), key=str)
            if both:
                raise ConfigError(f"{where(old)}: {_dotted(old)} is the old name of {_dotted(new)}, and "
                                  f"{', '.join(_dotted(new + (k,)) for k in both)} is given under both: give only "
                                  f"{_dotted(new + (both[0],))}")
            target[new[-1]].update(convert(value))
            continue
        if value is not None and target.get(new[-1]) is not None:
            raise ConfigError(f"{where(old)}: {_dotted(old)} is the old name of {_dotted(new)}: give only "
                              f"{_dotted(new)}")
        if value is not None:
            target[new[-1]] = convert(value)
    return data


def _override_path(cls: type, path: KeyPath) -> KeyPath:
    """The key path that override key ``path`` sets: below a renamed mapping's old key
    (``algo.objective_overrides.kl_coef``), the same key below its new one (`rename_key`)."""
    for old, (new, _) in _RENAMED.get(cls, {}).items():
        if path[:len(old)] == old and dataclasses.is_dataclass(_fields(cls).get(new)):
            return new + path[len(old):]
    return path


# ------------------------------------------------------------ TRL's and verl's names (OTHER_NAMES)


class _NotRead(Exception):
    """TRL's or verl's name that is refused, or a value of one that has no exact cispo value; the
    message is the problem (``key: what``), without its source."""


_ANNOUNCED: set[str] = set()
"""The lines `_announce` has printed in this process."""


def _announce(line: str) -> None:
    """``line`` on stderr, once per process: a config read twice (a file, then overrides) says it once."""
    if line not in _ANNOUNCED:
        _ANNOUNCED.add(line)
        print(line, file=sys.stderr)


@functools.cache
def _own_leaves(cls: type) -> frozenset[str]:
    """The last parts of every key of config ``cls`` (``lr``, ``temperature``, ...)."""
    return frozenset(str(k[-1]) for k in _fields(cls))


def _cispo_key(cls: type, key: str) -> KeyPath | None:
    """The key path of dotted cispo ``key`` in config ``cls``: a field, or a key below a dict field
    (``algo.objective_overrides.kl_coef``); None where ``cls`` has neither."""
    fields, path = _fields(cls), tuple(key.split("."))
    if path in fields or any(typing.get_origin(fields.get(path[:n])) is dict for n in range(1, len(path))):
        return path
    return None


def _other_name(cls: type, path: KeyPath) -> tuple[str, OtherName] | None:
    """(name, row) of `OTHER_NAMES` that unknown key ``path`` of config ``cls`` is (`lookup`), where
    ``cls`` has every cispo key of the row; None otherwise."""
    if not all(isinstance(p, str) for p in path):
        return None
    found = lookup(path, _own_leaves(cls))
    return found if found and all(_cispo_key(cls, k) for k in found[1].keys) else None


def _read_other(cls: type, path: KeyPath, value: Any, other: OtherName) -> tuple[KeyPath, Any]:
    """(cispo's key path, its value) for TRL's or verl's name ``other``, given as ``path`` = ``value``,
    announced on stderr (`_announce`); `_NotRead` where the name or the value is refused."""
    typed = _dotted(path)
    if other.read is None:
        raise _NotRead(f"{typed}: unknown key{describe(typed, other, other.keys)}")
    try:
        read = other.read(value)
    except ValueError as exc:
        raise _NotRead(f"{typed}: {short_repr(value)} is not read: {exc} ({typed!r} in {other.source} is read as "
                       f"{other.keys[0]}{': ' + other.what if other.what else ''})") from None
    _announce(read_line(typed, other, value, read))
    return _cispo_key(cls, other.keys[0]), read


def _unknown_leaves(cls: type, data: dict) -> list[KeyPath]:
    """Key paths of the unknown keys of ``data`` (config ``cls``'s plain data): of each leaf below an
    unknown key (``actor_rollout_ref.rollout.n``), not of the mappings above it; not below a dict field."""
    fields, out, stack = _fields(cls), [], [((), iter(data.items()))]
    while stack:  # depth first, in the order given (a file's problems in the order of its lines)
        prefix, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        key, value = item
        path = prefix + (key,)
        known = path in fields
        if known and not (dataclasses.is_dataclass(fields[path]) and isinstance(value, dict)):
            continue
        if isinstance(value, dict) and value and len(path) < MAX_DEPTH:
            stack.append((path, iter(value.items())))
        elif not known:
            out.append(path)
    return out


def _pop(data: dict, path: KeyPath) -> Any:
    """Remove ``path`` from nested ``data`` (and the mappings it leaves empty); its value."""
    parents = [data]
    for part in path[:-1]:
        parents.append(parents[-1][part])
    value = parents[-1].pop(path[-1])
    for parent, part in zip(reversed(parents[:-1]), reversed(path[:-1])):
        if parent[part]:
            break
        del parent[part]
    return value


def _read_other_names(cls: type, data: Any, where: Callable[[KeyPath], str]) -> tuple[Any, list[str]]:
    """``data`` with the unknown keys that are TRL's or verl's names (`OTHER_NAMES`) read as cispo's
    (`_read_other`: a line on stderr says so), and the problem lines of those refused; a copy where
    any is found. An unknown key below a verl section cispo has not (``trainer.foo``) is a problem
    line too, so that no other hint ('trackers') answers it; other unknown keys stay for pydantic.
    TRL's or verl's name of a key given as well is an error: only one may be given."""
    if not isinstance(data, dict):
        return data, []
    top = {k[0] for k in _fields(cls)}
    found = [(path, _other_name(cls, path)) for path in _unknown_leaves(cls, data)]
    found = [(path, match) for path, match in found if match or (path[0] in OTHER_SECTIONS - top and len(path) > 1)]
    if not found:
        return data, []
    data, problems = copy.deepcopy(data), []
    for path, match in found:
        value = _pop(data, path)
        if match is None:
            problems.append(f"{where(path)}: {_dotted(path)}: unknown key (below verl's {path[0]}: cispo reads none "
                            "of that name; docs/integrations.md lists the verl names it reads)")
            continue
        try:
            target, read = _read_other(cls, path, value, match[1])
        except _NotRead as exc:
            problems.append(f"{where(path)}: {exc}")
            continue
        node = data
        for part in target[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            if target[-1] in node:
                problems.append(f"{where(path)}: {_dotted(path)}: {match[1].source}'s name of {_dotted(target)}, "
                                f"which is given too: give only {_dotted(target)}")
            else:
                node[target[-1]] = read
            continue
        problems.append(f"{where(path)}: {_dotted(path)}: {_dotted(target)} is not a section here")
    return data, problems


def _build(cls: type[T], data: Any, where: Callable[[KeyPath], str]) -> T:
    """``cls`` from plain data; each problem is a line ``where(key path): key: what``. TRL's and
    verl's names are read first (`_read_other_names`); their problems come first."""
    data = _renamed(cls, data, where)
    data, refused = _read_other_names(cls, data, where)
    data = _none_as_null(cls, data)
    for key, tp in _fields(cls).items():  # pydantic reads true as 1 where a number is due: refused
        value = functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, key, data)
        if _bool_for_number(tp, value):
            raise ConfigError(f"{where(key)}: {_dotted(key)}: expected {_type_name(tp)}, got {short_repr(value)}")
    import pydantic

    try:
        built = _adapter(cls).validate_python({} if data is None else data)
    except pydantic.ValidationError as exc:
        raise ConfigError(_problem_lines(cls, exc.errors(include_url=False), where, refused)) from None
    if refused:
        raise ConfigError(_problem_lines(cls, [], where, refused))
    return built


def _takes_none(tp: Any) -> bool:
    """Whether type ``tp`` takes None and not the text ``none`` itself (no ``Literal['none', ...]``)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) not in (typing.Union, types.UnionType) or type(None) not in args:
        return False
    return not any(typing.get_origin(a) is Literal and any(str(v).lower() == "none" for v in typing.get_args(a))
                   for a in args)


def _none_as_null(cls: type, data: Any) -> Any:
    """``data`` with the text ``none`` (any case: Python's ``None``) read as null at every field of ``cls`` that
    takes null, in a file and on the command line alike (a copy where any is found); elsewhere it stays text
    (TRL's ``scale_rewards: none``, read by its row of `OTHER_NAMES`, is the value ``none``)."""
    if not isinstance(data, dict):
        return data
    hits = [key for key, tp in _fields(cls).items() if _takes_none(tp) and isinstance(
        v := functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, key, data), str)
        and v.lower() == "none"]
    if not hits:
        return data
    data = copy.deepcopy(data)
    for key in hits:
        functools.reduce(lambda d, k: d[k], key[:-1], data)[key[-1]] = None
    return data


def _numeric(tp: Any) -> bool:
    """Whether type ``tp`` takes numbers and not booleans: int, float, a Literal of numbers (``Literal[0, 1]``),
    or a union of them with None or other types."""
    args = typing.get_args(tp)
    if tp in (int, float):
        return True
    if typing.get_origin(tp) is typing.Literal:
        return bool(args) and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
    return bool(args) and bool not in args and any(_numeric(a) for a in args if a is not type(None))


def _bool_for_number(tp: Any, value: Any) -> bool:
    """A boolean given where a number is due (``true`` for ``Literal[0, 1]``), also inside a list of numbers
    (``reward_weights=[true, false]``): pydantic would read it as 1 or 0."""
    if isinstance(value, bool):
        return _numeric(tp)
    if not isinstance(value, (list, tuple)):
        return False
    lists = [a for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) in (list, tuple)]
    return any(isinstance(v, bool) for v in value) and any(_numeric(typing.get_args(a)[0]) for a in lists
                                                          if typing.get_args(a))


def _problem_lines(cls: type, errors: list[dict], where: Callable[[KeyPath], str], first: list[str] = ()) -> str:
    """One line ``where(key path): key: what`` per distinct pydantic error, each cut to
    `MAX_LINE_CHARS`; at most `MAX_PROBLEMS` of them (a list of 100,000 wrong values, or a file of
    100,000 unknown keys, is not 100,000 lines: nor the minutes that suggesting a key for each takes),
    then how many more there are (at most 50 times as many errors are read: repeats of a line). Lines
    ``first`` (already ``where: key: what``) come before pydantic's."""
    lines: dict[str, None] = {}
    problems = [*first, *errors]
    for i, err in enumerate(problems):
        if len(lines) == MAX_PROBLEMS or i == 50 * MAX_PROBLEMS:
            lines[f"… and {len(problems) - i:,} more problems"] = None
            break
        lines[_clip(err if isinstance(err, str) else f"{where(tuple(err['loc']))}: {_problem(cls, err)}")] = None
    return "\n".join(lines)


def from_dict(cls: type[T], data: dict[str, Any] | None, source: str = "<dict>",
              overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Config ``cls`` from plain nested data; ``None`` or a missing key: the defaults; ``overrides`` (``key=value``)
    on top, checked as one configuration with it (`load_yaml`). Wrong types, unknown keys and failed checks
    raise ``ConfigError`` s starting with ``source`` (or the override that set the key)."""
    if overrides:
        data = _shorthands(cls, copy.deepcopy(data or {}))
        return _build(cls, *_set_overrides(cls, data, overrides, lambda loc: source))
    return _build(cls, data, lambda loc: source)


def _line(node: yaml.Node | None, loc: KeyPath) -> str:
    """``:N``, the 1-based line of key path ``loc`` (of its deepest key found) in a YAML node."""
    line = ""
    for part in loc:
        items = node.value if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) else []
        hits = [(k, v) for k, v in items if k.value == part] if isinstance(node, yaml.MappingNode) else (
            [(items[part], items[part])] if isinstance(part, int) and part < len(items) else [])
        if not hits:
            break
        line, node = f":{hits[-1][0].start_mark.line + 1}", hits[-1][1]
    return line


def load_yaml(cls: type[T], path: str | pathlib.Path, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Config ``cls`` from a YAML file (empty: the defaults) with the command line's ``key=value`` ``overrides``
    on top (`apply_overrides`), checked once as one configuration: a file that needs a key the command line
    gives is not refused on its own. Errors name the file, line and key (``run.yaml:12: optim.lr: expected
    float, got 'abc'``) or the override; a file that is not a regular file or too large (`read_config_text`),
    and YAML that `ConfigLoader` refuses, are one line each."""
    _fields(cls)
    text = read_config_text(path)
    try:
        node, data = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}{yaml_problem(exc)}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}:1: expected a mapping of config keys at top level, got {type(data).__name__}")
    sections = {k for k, v in (data or {}).items() if v is None and dataclasses.is_dataclass(_fields(cls).get((k,)))}
    data = {**(data or {}), **dict.fromkeys(sections, {})}  # 'optim:' with nothing below: its defaults
    in_file = lambda loc: f"{path}{_line(node, loc)}"  # noqa: E731
    if overrides:  # onto the file's keys (a section given by its shorthand value first made a mapping)
        data, where = _set_overrides(cls, _shorthands(cls, data), overrides, in_file)
        return _build(cls, data, where)
    return _build(cls, data, in_file)


def to_dict(cfg: Any) -> Any:
    """A config as nested plain data: sections -> dicts, tuples -> lists (all new containers)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return [to_dict(v) for v in cfg] if isinstance(cfg, (list, tuple)) else cfg


def _accepts_container(tp: Any) -> bool:
    """``list[str]``, ``dict[str, Any]``, ``tuple[float, float]``, ``list[str] | Literal['all'] | None``..."""
    origin = typing.get_origin(tp)
    return origin in (list, dict, tuple) or (
        origin in (typing.Union, types.UnionType) and any(map(_accepts_container, typing.get_args(tp))))


def _override_value(text: str, tp: Any, source: str) -> Any:
    """YAML (``3e-4``, ``true``, ``[1, 2]``, ``{a: 1}``, ``null``), read as a file's value is (``none`` is the
    text ``none``, as in a file: `_none_as_null` reads it as null where a field takes null, for both); the text
    itself for a string field that YAML reads as something else (``run_name=2024``), but a list
    or mapping for a field that also takes one (``extra_fields=[a, b]`` where ``all`` would do).
    YAML that `ConfigLoader` refuses (an alias bomb, a 5000-digit integer, ...) is a `ConfigError` saying
    why, unless the field takes the text itself."""
    try:
        value = yaml.load(text, Loader=ConfigLoader)
    except yaml.YAMLError as exc:
        if not _accepts_str(tp):
            why = exc.problem if isinstance(exc, RefusedYAML) else (
                f"cannot parse {short_repr(text)} as a YAML value: {getattr(exc, 'problem', None) or exc}")
            raise ConfigError(f"{source}: {why}") from None
        value = text
    if value is None or (isinstance(value, (list, dict)) and _accepts_container(tp)):  # null, ~: None
        return value
    return text if not isinstance(value, str) and _accepts_str(tp) else value


def apply_overrides(cfg: T, overrides: list[str] | tuple[str, ...]) -> T:
    """A copy of ``cfg`` with ``key=value`` overrides set in order, then checked once as a
    whole (so no order of ``prompts_per_step=2 updates_per_batch=4`` trips a check).

    ``key``: a dotted path (``optim.lr``) or a field name found in one place only (``lr``; a
    top-level field wins); an ambiguous name is an error naming the candidates. Past a dict
    field the rest is a key into it (``rollout.vllm_kwargs.seed=1``). A mapping for a section sets just
    those fields; a plain value sets its shorthand field (``algo.objective=ppo``:
    `section_shorthand`). ``cfg`` is not changed. An override longer than
    `MAX_CONFIG_BYTES` or with a key of more than `MAX_DEPTH` parts is refused; errors show an
    override by `short_repr`."""
    if not overrides:
        return cfg
    data, where = _set_overrides(type(cfg), to_dict(cfg), overrides, None)
    return _build(type(cfg), data, where)


def _set_overrides(cls: type, data: dict, overrides, elsewhere: Callable[[KeyPath], str] | None):
    """``data`` (plain config data, changed in place) with ``overrides`` set (`apply_overrides`), and the
    locator of each problem's source: the override that set its key, else ``elsewhere(key path)`` (a file's
    line), else all the overrides. -> (data, where)"""
    fields, sources, by_other_name = _fields(cls), {}, set()
    for item in overrides:
        source = f"override {short_repr(item)}"
        key, sep, text = item.partition("=") if isinstance(item, str) else ("", "", "")
        path = tuple(p.strip() for p in key.split("."))
        if not sep or not all(path):
            raise ConfigError(f"{source}: expected key=value (e.g. optim.lr=3e-4)")
        if len(item) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{source}: longer than {MAX_CONFIG_BYTES >> 20} MiB; no setting takes one")
        if len(path) > MAX_DEPTH:
            raise ConfigError(f"{source}: a key of {len(path):,} parts; no setting is nested more than "
                              f"{MAX_DEPTH} deep")
        if path[:1] not in fields and _other_name(cls, path) is None:  # TRL's or verl's name: read as in a file
            found = [k for k in fields if k[-1] == path[0]] or [k for k in _RENAMED.get(cls, {}) if k[-1] == path[0]]
            if len(found) > 1:
                raise ConfigError(f"{source}: ambiguous key {path[0]!r}: it could be "
                                  f"{', '.join(map(_dotted, found))}; use the full dotted key")
            path = found[0] + path[1:] if found else path  # an unknown key: pydantic names it
        other = _other_name(cls, path) if _cispo_key(cls, _dotted(path)) is None else None
        foreign = bool(other and other[1].read)
        if foreign:  # TRL's or verl's name of a key: read as that key, in its place among the overrides
            tp = fields.get(_cispo_key(cls, other[1].keys[0])) if other[1].as_is else None  # else: TRL's / verl's value
            try:
                path, value = _read_other(cls, path, _override_value(text.strip(), tp, source), other[1])
            except _NotRead as exc:
                raise ConfigError(f"{source}: {exc}") from None
        else:  # a refused name stays unknown: _build's _read_other_names says why
            value = _override_value(text.strip(), fields.get(path), source)
        path = _override_path(cls, path)
        if path in _SHORTHANDS.get(cls, {}) and not isinstance(value, dict):
            path += (_SHORTHANDS[cls][path],)
        node = data
        for i, part in enumerate(path[:-1]):
            node = node[part] if isinstance(node.get(part), dict) else node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: {_dotted(path[:i + 1])} is not a section")
        if dataclasses.is_dataclass(fields.get(path)) and isinstance(value, dict):
            value = {**(node.get(path[-1]) or {}), **value}
        if path in sources and (foreign or path in by_other_name):  # learning_rate=... optim.lr=...: which one?
            raise ConfigError(f"{source}: sets {_dotted(path)}, which {sources[path]} sets too (one of them by TRL's "
                              "or verl's name): give it once")
        if foreign:
            by_other_name.add(path)
        node[path[-1]], sources[path] = value, source
    every = source if len(overrides) == 1 else "overrides " + ", ".join(map(short_repr, overrides))

    def where(loc: KeyPath) -> str:
        own = next((sources[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in sources), None)
        return own or (elsewhere(loc) if elsewhere is not None else every)

    return data, where


def _class_doc(cls: type) -> str:
    """The first line of a class's own docstring ("" for dataclasses' generated one)."""
    doc = (cls.__dict__.get("__doc__") or "").strip()
    return "" if not doc or doc.startswith(f"{cls.__name__}(") else doc.splitlines()[0]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring below each field of dataclass ``cls`` ("" where none), by field name."""
    docs = dict.fromkeys((f.name for f in dataclasses.fields(cls)), "")
    for c in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)] if _fields(cls) else []):
        properties = _adapter(c).json_schema()["properties"]
        docs.update({k: v["description"] for k, v in properties.items() if "description" in v})
    return docs
