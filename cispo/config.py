"""Nested dataclass configs: YAML files, ``key=value`` overrides, help text, clear errors.

A config is a (frozen or plain) dataclass whose fields may be other dataclasses (sections).
Each field is documented by the string literal right below it (an attribute docstring)::

    @dataclass
    class OptimConfig:
        \"\"\"The optimizer.\"\"\"
        lr: float = 1e-4
        \"\"\"Peak learning rate.\"\"\"

Supported field types: ``int``, ``float`` (ints accepted), ``bool``, ``str``, ``X | None``,
``Literal[...]``, ``tuple[X, ...]`` and fixed-size tuples, ``list[X]``, ``dict[K, V]``,
``Any``, ``Enum`` and ``Path`` subclasses, and nested dataclasses.

* ``from_dict`` / ``load_yaml`` build a config from plain data; missing keys take their
  defaults, unknown keys and wrong types raise ``ConfigError`` naming the source (file and
  line for YAML), the dotted key and, for a typo, the closest known key.
* ``apply_overrides`` sets fields from ``key=value`` strings; ``key`` is a dotted path
  (``optim.lr``) or a field name found in exactly one place (``lr``); ``value`` is YAML.
* ``to_dict`` / ``save_yaml`` write a config back; ``save_yaml`` output loads to an equal config.
* ``field_docs`` / ``format_help`` expose the attribute docstrings.

A ``ValueError`` raised by a dataclass's ``__post_init__`` (its own validation) comes out
as a ``ConfigError`` prefixed with the file or override that caused it.

YAML numbers: PyYAML follows YAML 1.1, where ``1e-4`` (no dot) is a *string*. Files and
override values here are read with a loader that also resolves ``1e-4``/``3E5`` as floats,
and a ``float`` (``int``) field also accepts a string that ``float()`` (``int()``) parses.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import functools
import inspect
import pathlib
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, TypeVar

import yaml

__all__ = [
    "AlgoConfig",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "OptimConfig",
    "RolloutConfig",
    "TrainConfig",
    "ConfigError",
    "apply_overrides",
    "field_docs",
    "format_help",
    "from_dict",
    "load_yaml",
    "save_yaml",
    "to_dict",
]

T = TypeVar("T")
KeyPath = tuple  # a key path: str for mapping keys / field names, int for list indices

_UNION_ORIGINS = (typing.Union, types.UnionType)
_NONE_WORDS = ("none", "null", "~")  # override values meaning None (YAML alone misses "None")


class ConfigError(ValueError):
    """A config could not be read, parsed or validated; the message says where and why."""


# ---------------------------------------------------------------------------------------
# YAML flavour: PyYAML's safe loader/dumper, plus floats written without a dot (1e-4).
# ---------------------------------------------------------------------------------------

_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` / ``1E5`` / ``1.5e3`` as floats (YAML 1.2 style)."""


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings ``_Loader`` would read as floats (e.g. ``'1e-4'``)."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789."))


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    """Strings with line breaks double-quoted (``"a\\nb"``), on one line; others as PyYAML does."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style='"' if "\n" in text else None)


_Dumper.add_representer(str, _represent_str)


def _yaml_problem(exc: yaml.YAMLError) -> tuple[int | None, str]:
    """(1-based line or None, readable description) of a PyYAML error."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    text = f"{problem} ({context})" if context else problem
    if mark is None:
        return None, text
    return mark.line + 1, f"{text} (column {mark.column + 1})"


def _key_lines(node: yaml.Node, source: str) -> dict[KeyPath, int]:
    """Line (1-based) of every mapping key and sequence item under ``node``, by key path.

    Duplicate keys in one mapping (PyYAML silently keeps the last) raise ``ConfigError``;
    keys merged in with ``<<`` may be overridden and get their anchor's lines.
    """
    lines: dict[KeyPath, int] = {}

    def walk(n: yaml.Node, path: KeyPath, active: frozenset[int], merged: bool) -> None:
        if id(n) in active:  # a recursive alias
            return
        active = active | {id(n)}
        if isinstance(n, yaml.MappingNode):
            merges = []
            for k, v in n.value:
                if k.tag == "tag:yaml.org,2002:merge":
                    merges += v.value if isinstance(v, yaml.SequenceNode) else [v]
                    continue
                key = str(k.value) if isinstance(k, yaml.ScalarNode) else repr(k.value)
                here, line = path + (key,), k.start_mark.line + 1
                if merged:
                    lines.setdefault(here, line)
                elif here in lines:
                    first = lines[here]
                    raise ConfigError(f"{source}:{line}: {_dotted(here)}: duplicate key (first set on line {first})")
                else:
                    lines[here] = line
                walk(v, here, active, merged)
            for m in merges:  # after the explicit keys, which win
                walk(m, path, active, True)
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                lines.setdefault(path + (i,), item.start_mark.line + 1)
                walk(item, path + (i,), active, merged)

    walk(node, (), frozenset(), False)
    return lines


def _parse_yaml(text: str, source: str) -> tuple[Any, dict[KeyPath, int]]:
    """(data, key lines) of one YAML document; syntax errors become ``ConfigError``."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        lines = _key_lines(node, source)  # before construction: merge keys rewrite the node
        return loader.construct_document(node), lines
    except yaml.YAMLError as exc:
        line, problem = _yaml_problem(exc)
        where = f"{source}:{line}" if line else source
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    finally:
        loader.dispose()


# ---------------------------------------------------------------------------------------
# Dataclass introspection
# ---------------------------------------------------------------------------------------


def _require_dataclass_type(cls: Any) -> None:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"expected a dataclass type, got {cls!r}")


def _require_dataclass_instance(cfg: Any) -> None:
    if isinstance(cfg, type) or not dataclasses.is_dataclass(cfg):
        raise TypeError(f"expected a dataclass instance, got {cfg!r}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a dataclass (annotations are strings under PEP 563)."""
    try:
        return typing.get_type_hints(cls)
    except Exception as exc:  # NameError for an unresolvable forward reference, mostly
        raise TypeError(f"cannot resolve the type annotations of {cls.__qualname__}: {exc}") from exc


@functools.lru_cache(maxsize=None)
def _init_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    """The fields a config file or override can set (``init=False`` fields excluded)."""
    return tuple(f for f in dataclasses.fields(cls) if f.init)


def _field_map(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in _init_fields(cls)}


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    """A field's default value (a fresh one for a ``default_factory``)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _non_none_args(tp: Any) -> list[Any]:
    return [a for a in typing.get_args(tp) if a is not type(None)]


def _dataclass_arm(tp: Any) -> type | None:
    """The dataclass of a section type: ``C`` for ``C`` or ``C | None``; else None."""
    if typing.get_origin(tp) in _UNION_ORIGINS:
        arms = _non_none_args(tp)
        tp = arms[0] if len(arms) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _dict_arm(tp: Any) -> tuple[Any, Any] | None:
    """(key type, value type) of ``dict[K, V]`` or ``dict[K, V] | None``; else None."""
    if typing.get_origin(tp) in _UNION_ORIGINS:
        arms = _non_none_args(tp)
        tp = arms[0] if len(arms) == 1 else None
    if tp is dict:
        return Any, Any
    if typing.get_origin(tp) is dict:
        args = typing.get_args(tp)
        return (args[0], args[1]) if len(args) == 2 else (Any, Any)
    return None


def _accepts(tp: Any, pred: Callable[[Any], bool]) -> bool:
    """Whether ``pred`` holds for ``tp`` or for one arm of it (a union)."""
    if typing.get_origin(tp) in _UNION_ORIGINS:
        return any(_accepts(a, pred) for a in typing.get_args(tp))
    return pred(tp)


def _accepts_none(tp: Any) -> bool:
    return _accepts(
        tp,
        lambda t: t is Any
        or t is type(None)
        or (typing.get_origin(t) is Literal and None in typing.get_args(t)),
    )


def _accepts_str(tp: Any) -> bool:
    return _accepts(
        tp,
        lambda t: t is str
        or (isinstance(t, type) and issubclass(t, pathlib.PurePath))
        or (typing.get_origin(t) is Literal and any(isinstance(a, str) for a in typing.get_args(t))),
    )


def _type_name(tp: Any) -> str:
    """Readable name of a type annotation: ``float | None``, ``tuple[float, float]``..."""
    if tp is type(None) or tp is None:
        return "None"
    if tp is Any:
        return "Any"
    if tp is Ellipsis:
        return "..."
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in _UNION_ORIGINS:
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin is not None:
        name = getattr(origin, "__name__", repr(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    return tp.__name__ if isinstance(tp, type) else repr(tp)


# ---------------------------------------------------------------------------------------
# Attribute docstrings
# ---------------------------------------------------------------------------------------


def _class_node(cls: type) -> ast.ClassDef | None:
    """The ``ast.ClassDef`` of a class's own source, or None when the source is unavailable."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    return None


@functools.lru_cache(maxsize=None)
def _own_field_docs(cls: type) -> Mapping[str, str]:
    """Attribute docstrings written in ``cls``'s own body (not its bases')."""
    node = _class_node(cls)
    if node is None:
        return types.MappingProxyType({})
    docs: dict[str, str] = {}
    body = node.body
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return types.MappingProxyType(docs)


@functools.lru_cache(maxsize=None)
def _field_docs_cached(cls: type) -> Mapping[str, str]:
    merged: dict[str, str] = {}
    for base in reversed(cls.__mro__):  # a subclass's docstring wins over its base's
        if dataclasses.is_dataclass(base):
            merged.update(_own_field_docs(base))
    return types.MappingProxyType({f.name: merged.get(f.name, "") for f in dataclasses.fields(cls)})


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass's fields, by field name ("" where there is none).

    Read from the class source (``inspect.getsource`` + ``ast``): the string literal statement
    right after each annotated assignment; base dataclasses' fields included. Cached per class.
    """
    _require_dataclass_type(cls)
    return dict(_field_docs_cached(cls))


@functools.lru_cache(maxsize=None)
def _class_doc(cls: type) -> str:
    """A class's own docstring, cleaned; "" when it has none (never the dataclass signature)."""
    node = _class_node(cls)
    if node is not None:
        return ast.get_docstring(node) or ""
    doc = cls.__dict__.get("__doc__") or ""
    auto = doc.startswith(f"{cls.__name__}(") and dataclasses.is_dataclass(cls)  # dataclass's fallback
    return "" if auto else inspect.cleandoc(doc)


# ---------------------------------------------------------------------------------------
# Error context
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ctx:
    """Where the data being checked came from: a source label, key lines, the root class."""

    source: str
    lines: Mapping[KeyPath, int]
    root: type


def _dotted(path: KeyPath) -> str:
    """``('optim', 'betas', 1)`` -> ``'optim.betas[1]'``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _error(ctx: _Ctx, path: KeyPath, msg: str) -> ConfigError:
    """``source[:line]: dotted.key: msg``, the line being that of the nearest known key."""
    where = ctx.source
    for n in range(len(path), 0, -1):
        if path[:n] in ctx.lines:
            where += f":{ctx.lines[path[:n]]}"
            break
    key = _dotted(path)
    return ConfigError(f"{where}: {key}: {msg}" if key else f"{where}: {msg}")


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _mismatch(ctx: _Ctx, path: KeyPath, tp: Any, value: Any) -> ConfigError:
    if typing.get_origin(tp) is Literal:
        choices = ", ".join(repr(a) for a in typing.get_args(tp))
        return _error(ctx, path, f"expected one of {choices}, got {_short_repr(value)}")
    return _error(ctx, path, f"expected {_type_name(tp)}, got {_short_repr(value)}")


@functools.lru_cache(maxsize=None)
def _all_keys(cls: type) -> tuple[tuple[str, ...], ...]:
    """Every settable key path of a config class: sections and leaves, depth first."""
    out: list[tuple[str, ...]] = []

    def walk(c: type, prefix: tuple[str, ...], stack: frozenset[type]) -> None:
        hints = _hints(c)
        for f in _init_fields(c):
            out.append(prefix + (f.name,))
            sub = _dataclass_arm(hints[f.name])
            if sub is not None and sub not in stack:
                walk(sub, prefix + (f.name,), stack | {sub})

    walk(cls, (), frozenset({cls}))
    return tuple(out)


def _closest(key: str, candidates: list[str]) -> str | None:
    """The candidate dotted key most like ``key`` (whole key or last part), if any is close."""
    parent, _, leaf = key.rpartition(".")
    best, best_score = None, 0.0
    for cand in candidates:
        c_parent, _, c_leaf = cand.rpartition(".")
        score = difflib.SequenceMatcher(None, leaf, c_leaf).ratio()
        if c_parent == parent:
            score += 0.01  # ties: prefer the same section
        else:  # across sections, whole keys too (within one, the shared prefix inflates it)
            score = max(score, difflib.SequenceMatcher(None, key, cand).ratio())
        if score > best_score:
            best, best_score = cand, score
    return best if best_score >= 0.6 else None


def _unknown_key_hint(root: type, key: str, section: type | None) -> str:
    """``did you mean 'optim.lr'?`` or, lacking a close key, the valid keys of ``section``."""
    guess = _closest(key, [".".join(p) for p in _all_keys(root)])
    if guess is not None:
        return f"did you mean {guess!r}?"
    if section is not None:
        return "valid keys here: " + ", ".join(f.name for f in _init_fields(section))
    return "see the config help for the valid keys"


def _unknown_key(ctx: _Ctx, path: KeyPath, section: type) -> ConfigError:
    key = _dotted(path)
    return _error(ctx, path, f"unknown key; {_unknown_key_hint(ctx.root, key, section)}")


def _construct(make: Callable[[], T], path: KeyPath, ctx: _Ctx) -> T:
    """Call a dataclass constructor (or ``replace``); its ``ValueError`` -> ``ConfigError``."""
    try:
        return make()
    except ValueError as exc:
        raise _error(ctx, path, str(exc)) from exc


# ---------------------------------------------------------------------------------------
# Plain data -> typed values
# ---------------------------------------------------------------------------------------


def _coerce_union(value: Any, tp: Any, path: KeyPath, ctx: _Ctx) -> Any:
    if value is None and type(None) in typing.get_args(tp):
        return None
    arms = _non_none_args(tp)
    if len(arms) == 1:  # X | None: X's own errors (they may point inside a section)
        return _coerce(value, arms[0], path, ctx, shown=tp)
    for arm in arms:  # an exact scalar match first: 'abc' stays a str in float | str
        if arm in (bool, int, float, str) and type(value) is arm:
            return value
    for arm in arms:
        try:
            return _coerce(value, arm, path, ctx)
        except ConfigError:
            continue
    raise _mismatch(ctx, path, tp, value)


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError


def _as_int(value: Any) -> int:
    """An int, an integral float (``1e3``) or a string of either; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            value = float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError


def _as_float(value: Any) -> float:
    """A float, an int or a string ``float()`` reads (``'1e-4'``); ValueError otherwise."""
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return float(value)
    raise ValueError


def _as_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ValueError


_SCALARS: dict[type, Callable[[Any], Any]] = {bool: _as_bool, int: _as_int, float: _as_float, str: _as_str}


def _as_enum(value: Any, tp: type[enum.Enum]) -> enum.Enum:
    """The member of ``tp`` with this value (or, for a string, this name); ValueError otherwise."""
    if isinstance(value, tp):
        return value
    for member in tp:
        if member.value == value and type(member.value) is type(value):
            return member
    if isinstance(value, str) and value in tp.__members__:
        return tp[value]
    raise ValueError


def _coerce_scalar(value: Any, tp: type, path: KeyPath, ctx: _Ctx, shown: Any) -> Any:
    """bool, int, float, str, Enum, Path and other plain classes."""
    try:
        if tp in _SCALARS:
            return _SCALARS[tp](value)
        if issubclass(tp, enum.Enum):
            return _as_enum(value, tp)
        if issubclass(tp, pathlib.PurePath) and isinstance(value, (str, pathlib.PurePath)):
            return tp(value)
        if isinstance(value, tp):
            return value
    except (ValueError, OverflowError):
        pass
    if issubclass(tp, enum.Enum):
        choices = ", ".join(repr(m.value) for m in tp)
        raise _error(ctx, path, f"expected one of {choices} ({tp.__name__}), got {_short_repr(value)}")
    raise _mismatch(ctx, path, shown, value)


def _coerce_sequence(value: Any, tp: Any, path: KeyPath, ctx: _Ctx, shown: Any) -> Any:
    """list[X], tuple[X, ...], tuple[X, Y], bare list / tuple."""
    if not isinstance(value, (list, tuple)):
        raise _mismatch(ctx, path, shown, value)
    origin = typing.get_origin(tp) or tp
    args = typing.get_args(tp)
    if origin is list:
        item = args[0] if args else Any
        return [_coerce(v, item, path + (i,), ctx) for i, v in enumerate(value)]
    if not args:
        return tuple(value)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(v, args[0], path + (i,), ctx) for i, v in enumerate(value))
    if len(value) != len(args):
        raise _error(
            ctx, path, f"expected {_type_name(shown)} ({len(args)} items), got {len(value)} items: {_short_repr(value)}"
        )
    return tuple(_coerce(v, a, path + (i,), ctx) for i, (v, a) in enumerate(zip(value, args)))


def _coerce_dict(value: Any, tp: Any, path: KeyPath, ctx: _Ctx, shown: Any) -> dict:
    if not isinstance(value, Mapping):
        raise _mismatch(ctx, path, shown, value)
    key_tp, val_tp = _dict_arm(tp) or (Any, Any)
    out = {}
    for k, v in value.items():
        sub = path + (str(k),)
        out[_coerce(k, key_tp, sub, ctx)] = _coerce(v, val_tp, sub, ctx)
    return out


def _coerce(value: Any, tp: Any, path: KeyPath, ctx: _Ctx, shown: Any = None) -> Any:
    """``value`` checked against / converted to annotation ``tp``; errors name ``path``.

    ``shown`` is the type named in a mismatch message (the whole ``X | None`` for its X).
    """
    shown = tp if shown is None else shown
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    if origin in _UNION_ORIGINS:
        return _coerce_union(value, tp, path, ctx)
    if origin is Literal:
        for choice in typing.get_args(tp):
            if value == choice and type(value) is type(choice):
                return choice
        raise _mismatch(ctx, path, shown, value)
    if tp is type(None) or tp is None:
        if value is None:
            return None
        raise _mismatch(ctx, path, shown, value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if value is None:  # an empty section in YAML ('optim:') means all defaults
            value = {}
        if not isinstance(value, Mapping):
            raise _error(ctx, path, f"expected a mapping for section {tp.__name__}, got {_short_repr(value)}")
        return _build(tp, value, path, ctx)
    if tp in (list, tuple) or origin in (list, tuple):
        return _coerce_sequence(value, tp, path, ctx, shown)
    if tp is dict or origin is dict:
        return _coerce_dict(value, tp, path, ctx, shown)
    if isinstance(tp, type):
        return _coerce_scalar(value, tp, path, ctx, shown)
    raise TypeError(f"{_dotted(path)}: unsupported config field type {_type_name(tp)}")


def _check_key(cls: type, key: Any, path: KeyPath, ctx: _Ctx) -> str:
    """``key`` if it names a settable field of ``cls``, else a ``ConfigError``."""
    if isinstance(key, str) and key in _field_map(cls):
        return key
    if isinstance(key, str) and any(f.name == key for f in dataclasses.fields(cls)):
        raise _error(ctx, path + (key,), "cannot be set (a derived field, init=False)")
    raise _unknown_key(ctx, path + (str(key),), cls)


def _build(cls: type[T], data: Mapping, path: KeyPath, ctx: _Ctx) -> T:
    """An instance of dataclass ``cls`` from a mapping; missing keys take their defaults."""
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        name = _check_key(cls, key, path, ctx)
        kwargs[name] = _coerce(value, hints[name], path + (name,), ctx)
    missing = [f.name for f in _init_fields(cls) if f.name not in kwargs and not _has_default(f)]
    if missing:
        raise _error(ctx, path, f"missing required key(s): {', '.join(missing)}")
    return _construct(lambda: cls(**kwargs), path, ctx)


def from_dict(cls: type[T], data: Mapping[str, Any] | None, source: str = "<dict>") -> T:
    """Build config ``cls`` from plain (nested) data, checking and converting each value.

    Missing keys take their defaults; ``None`` is an empty mapping. Unknown keys, wrong types
    and ``__post_init__`` ``ValueError`` s raise ``ConfigError`` messages starting with ``source``.
    """
    _require_dataclass_type(cls)
    ctx = _Ctx(source, {}, cls)
    return _coerce({} if data is None else data, cls, (), ctx)


# ---------------------------------------------------------------------------------------
# Typed values -> plain data, YAML files
# ---------------------------------------------------------------------------------------


def _plain_key(key: Any) -> Any:
    if isinstance(key, enum.Enum):
        return key.value
    return str(key) if isinstance(key, pathlib.PurePath) else key


def _plain(value: Any) -> Any:
    """Plain YAML-able data: dataclasses -> dicts, tuples -> lists, Enums -> values, Paths -> str."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in _init_fields(type(value))}
    if isinstance(value, Mapping):
        return {_plain_key(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as nested plain data: sections -> dicts, tuples -> lists (all new containers)."""
    _require_dataclass_instance(cfg)
    return _plain(cfg)


def load_yaml(cls: type[T], path: str | pathlib.Path) -> T:
    """Read config ``cls`` from a YAML file; an empty file gives the defaults.

    Errors are ``ConfigError`` s such as ``config.yaml:12: optim.lr: expected float, got 'abc'``.
    """
    _require_dataclass_type(cls)
    source = str(path)
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not a UTF-8 text file ({exc.reason})") from None
    data, lines = _parse_yaml(text, source)
    ctx = _Ctx(source, lines, cls)
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{source}:1: expected a mapping of config keys at top level, got {type(data).__name__}")
    return _coerce({} if data is None else data, cls, (), ctx)


def _dump_yaml(data: Any) -> list[str]:
    """YAML lines of one value (leaf collections in flow style, no document-end marker)."""
    text = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=None, allow_unicode=True, width=88)
    lines = text.splitlines()
    return lines[:-1] if lines and lines[-1] == "..." else lines


def _yaml_field(name: str, value: Any, pad: str) -> list[str]:
    """``name: value`` (or ``name:`` and the value's lines below it) at indentation ``pad``."""
    key = _dump_yaml(name)[0]
    try:
        lines = _dump_yaml(_plain(value))
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot write field {name!r} as YAML: {exc}") from exc
    if len(lines) == 1:
        return [f"{pad}{key}: {lines[0]}"]
    return [f"{pad}{key}:"] + [f"{pad}  {line}".rstrip() for line in lines]


def _yaml_lines(cfg: Any, indent: int) -> list[str]:
    """YAML lines of a config section, each field preceded by its docstring as comments."""
    pad = " " * indent
    docs = field_docs(type(cfg))
    out: list[str] = []
    for f in _init_fields(type(cfg)):
        value = getattr(cfg, f.name)
        is_section = dataclasses.is_dataclass(value) and not isinstance(value, type)
        if is_section and indent == 0 and out:
            out.append("")
        out += [f"{pad}# {line}".rstrip() for line in docs[f.name].splitlines()]
        if is_section and _init_fields(type(value)):
            out.append(f"{pad}{_dump_yaml(f.name)[0]}:")
            out += _yaml_lines(value, indent + 2)
        else:
            out += _yaml_field(f.name, value, pad)
    return out


def save_yaml(cfg: Any, path: str | pathlib.Path) -> None:
    """Write a config to a YAML file (every field, defaults included) that ``load_yaml`` reads back.

    Field docstrings become comments; a header comment names the config class.
    Parent directories are created.
    """
    _require_dataclass_instance(cfg)
    name = type(cfg).__qualname__
    header = [
        f"# {name}: the resolved configuration, written by cispo.config.save_yaml.",
        "# Every field is listed, defaults included; read it back with cispo.config.load_yaml.",
    ]
    doc = _class_doc(type(cfg))
    if doc:
        header.append("# " + doc.splitlines()[0])
    text = "\n".join(header + [""] + _yaml_lines(cfg, 0)) + "\n"
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------------------------------
# key=value overrides
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _names_index(cls: type) -> Mapping[str, tuple[tuple[str, ...], ...]]:
    """Field name -> every key path ending in it (the leaf aliases of ``apply_overrides``)."""
    index: dict[str, list[tuple[str, ...]]] = {}
    for key in _all_keys(cls):
        index.setdefault(key[-1], []).append(key)
    return types.MappingProxyType({k: tuple(v) for k, v in index.items()})


def _resolve_key(cls: type, key: str, ctx: _Ctx) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(field path, dict-entry path) that an override key names; see ``apply_overrides``."""
    parts = tuple(p.strip() for p in key.split("."))
    if not all(parts):
        raise ConfigError(f"{ctx.source}: malformed key {key!r}")
    if parts[0] not in _field_map(cls):  # not top-level (which wins): a unique field name?
        matches = _names_index(cls).get(parts[0], ())
        if len(matches) > 1:
            listed = ", ".join(".".join(m) for m in matches)
            raise ConfigError(
                f"{ctx.source}: ambiguous key {parts[0]!r}: it could be {listed}; use the full dotted key"
            )
        if not matches:
            raise ConfigError(f"{ctx.source}: unknown key {key!r}; {_unknown_key_hint(cls, key, cls)}")
        parts = matches[0][:-1] + parts
    path: list[str] = []
    owner, section = cls, cls  # section: the dataclass the next part must be a field of
    for i, part in enumerate(parts):
        if section is None:  # path[-1] is not a section: a dict field takes the rest as entry
            tp = _hints(owner)[path[-1]]
            if _dict_arm(tp) is not None:
                return tuple(path), parts[i:]
            full = ".".join(parts)
            raise ConfigError(
                f"{ctx.source}: unknown key {full!r} ({'.'.join(path)} has type {_type_name(tp)}, "
                f"not a section); {_unknown_key_hint(cls, full, None)}"
            )
        if part not in _field_map(section):
            full = ".".join(path + [part])
            raise ConfigError(f"{ctx.source}: unknown key {full!r}; {_unknown_key_hint(cls, full, section)}")
        path.append(part)
        owner, section = section, _dataclass_arm(_hints(section)[part])
    return tuple(path), ()


def _parse_value(text: str, path: KeyPath, ctx: _Ctx) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        _, problem = _yaml_problem(exc)
        raise _error(ctx, path, f"cannot parse {text!r} as a YAML value: {problem}") from None


def _coerce_override(text: str, tp: Any, path: KeyPath, ctx: _Ctx) -> Any:
    """The typed value of an override's right-hand side: YAML, else the raw text for a str."""
    if text.lower() in _NONE_WORDS and _accepts_none(tp):
        return None
    value = _parse_value(text, path, ctx)
    try:
        return _coerce(value, tp, path, ctx)
    except ConfigError:
        if isinstance(value, str) or not _accepts_str(tp):
            raise
        return _coerce(text, tp, path, ctx)  # name=2024, name=yes: the text itself


def _merge(obj: Any, data: Mapping, path: KeyPath, ctx: _Ctx) -> Any:
    """``obj`` with the fields in ``data`` set (sub-sections merged, not reset to defaults)."""
    cls = type(obj)
    hints = _hints(cls)
    changes = {}
    for key, value in data.items():
        name = _check_key(cls, key, path, ctx)
        current = getattr(obj, name)
        if _dataclass_arm(hints[name]) is not None and current is not None and isinstance(value, Mapping):
            changes[name] = _merge(current, value, path + (name,), ctx)
        else:
            changes[name] = _coerce(value, hints[name], path + (name,), ctx)
    return _construct(lambda: dataclasses.replace(obj, **changes), path, ctx)


def _set_entry(current: Any, tp: Any, entry: tuple[str, ...], text: str, path: KeyPath, ctx: _Ctx) -> dict:
    """A copy of dict field value ``current`` with ``entry`` (a key path into it) set."""
    _, val_tp = _dict_arm(tp) or (Any, Any)
    value = _coerce_override(text, val_tp if len(entry) == 1 else Any, path + entry, ctx)
    top = dict(current) if current is not None else {}
    d = top
    for i, k in enumerate(entry[:-1]):
        sub = d.get(k)
        if sub is None:
            sub = {}
        elif not isinstance(sub, Mapping):
            raise _error(ctx, path + entry[: i + 1], f"is a {type(sub).__name__}, not a mapping")
        d[k] = sub = dict(sub)
        d = sub
    d[entry[-1]] = value
    return _coerce(top, tp, path, ctx)


def _set_field(obj: Any, rel: tuple[str, ...], entry: tuple[str, ...], text: str, path: KeyPath, ctx: _Ctx) -> Any:
    """A copy of section ``obj`` (at ``path``) with the field at relative path ``rel`` set."""
    name, here = rel[0], path + (rel[0],)
    tp = _hints(type(obj))[name]
    current = getattr(obj, name)
    if len(rel) > 1:
        if current is None:  # an unset optional section: start from its defaults
            current = _build(_dataclass_arm(tp), {}, here, ctx)
        new = _set_field(current, rel[1:], entry, text, here, ctx)
    elif entry:
        new = _set_entry(current, tp, entry, text, here, ctx)
    elif _dataclass_arm(tp) is not None and current is not None and text.lower() not in _NONE_WORDS:
        value = _parse_value(text, here, ctx)
        is_map = isinstance(value, Mapping)
        new = _merge(current, value, here, ctx) if is_map else _coerce(value, tp, here, ctx)
    else:
        new = _coerce_override(text, tp, here, ctx)
    return _construct(lambda: dataclasses.replace(obj, **{name: new}), path, ctx)


def apply_overrides(cfg: T, overrides: list[str] | tuple[str, ...]) -> T:
    """A copy of ``cfg`` with ``key=value`` overrides applied in order (``cfg`` is not mutated).

    * ``key``: a dotted path (``optim.lr``) or a field name that occurs in exactly one place
      (``lr`` for ``optim.lr``); a top-level field wins over nested ones of the same name, and
      an ambiguous name is an error listing the candidates. Past a ``dict`` field the rest of
      the key is a path into the dict (``objective_overrides.eps_high_is=2.0`` sets one entry).
    * ``value``: YAML (``3e-4``, ``true``, ``[0.9, 0.99]``, ``{a: 1}``), checked like
      ``from_dict``; ``None``/``null`` for an optional field; a ``str`` field takes the raw text
      when YAML reads something else (``name=2024``). A mapping for a section sets just those
      fields; a mapping for a dict field replaces the dict.

    Sections that no override touches are shared with ``cfg``, not copied.
    """
    _require_dataclass_instance(cfg)
    cls = type(cfg)
    for item in overrides:
        source = f"override {item!r}"
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"{source}: expected key=value (e.g. optim.lr=3e-4)")
        key, text = (s.strip() for s in item.split("=", 1))
        ctx = _Ctx(source, {}, cls)
        rel, entry = _resolve_key(cls, key, ctx)
        cfg = _set_field(cfg, rel, entry, text, (), ctx)
    return cfg


# ---------------------------------------------------------------------------------------
# Help text
# ---------------------------------------------------------------------------------------


def _indent_doc(doc: str, pad: str) -> list[str]:
    return [f"{pad}{line}".rstrip() for line in doc.splitlines()]


def _help_section(cls: type, prefix: tuple[str, ...], title: str, out: list[str]) -> None:
    """Help lines of one section (its leaves), then of its sub-sections, depth first."""
    out.append(title)
    hints, docs = _hints(cls), field_docs(cls)
    subsections = []
    for f in _init_fields(cls):
        tp, key = hints[f.name], ".".join(prefix + (f.name,))
        sub = _dataclass_arm(tp)
        if sub is not None:
            subsections.append((f, sub))
            continue
        default = f"= {_default(f)!r}" if _has_default(f) else "(required)"
        out.append(f"  {key}: {_type_name(tp)} {default}")
        out += _indent_doc(docs[f.name], "      ")
    for f, sub in subsections:
        key = ".".join(prefix + (f.name,))
        optional = " | None" if _accepts_none(hints[f.name]) else ""
        default = " = None" if _has_default(f) and _default(f) is None else ""
        section_doc = _class_doc(sub)
        head = f"{key} ({sub.__name__}{optional}{default})"
        out.append("")
        lines = [head + (f": {section_doc.splitlines()[0]}" if section_doc else "")]
        lines += _indent_doc("\n".join(section_doc.splitlines()[1:]).strip(), "  ")
        field_doc = docs[f.name]
        if field_doc and field_doc != section_doc:
            lines += _indent_doc(field_doc, "  ")
        _help_section(sub, prefix + (f.name,), "\n".join(lines), out)


def format_help(cls: type) -> str:
    """Every field of config ``cls`` (dotted key, type, default, docstring), section by section.

    Plain text for an argparse epilog (use ``RawDescriptionHelpFormatter``).
    """
    _require_dataclass_type(cls)
    doc = _class_doc(cls)
    out = [
        "Config fields. Override any with KEY=VALUE: KEY is a dotted path (section.field) or a",
        "field name that occurs in one place only; VALUE is YAML (3e-4, true, null, [1, 2], {a: 1}).",
        "",
    ]
    _help_section(cls, (), f"{cls.__name__}" + (f": {doc.splitlines()[0]}" if doc else ""), out)
    return "\n".join(out).rstrip() + "\n"


# =======================================================================================
# The run's configuration: one dataclass per concern, a docstring per field.
# =======================================================================================


@dataclass
class ModelConfig:
    """The policy."""

    path: str | None = None
    """Local Hugging Face causal-LM folder. None: the built-in base model of the task
    (pretrained on first use and cached in ~/.cache/cispo)."""
    fp32_lm_head: bool = True
    """Compute the LM head (logits, log-probs) in FP32: MiniMax-M1's fix for the train /
    rollout probability mismatch."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:1``, … or ``auto`` (CUDA when available)."""
    dtype: str | None = None
    """Parameter dtype: ``float32``, ``bfloat16``, ``float16``. None: as saved."""
    chat_template: bool = False
    """Wrap each prompt (or its ``messages``) in the tokenizer's chat template."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    lora_rank: int = 0
    """LoRA rank (``pip install "cispo[lora]"``): train rank-r adapters on every linear layer
    but lm_head. 0: full fine-tuning."""
    lora_alpha: float = 16.0
    """LoRA scale: the adapters' output is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_target_modules: list[str] | None = None
    """Module names to adapt. None: all linear layers but lm_head."""
    fsdp: bool = False
    """Under ``torchrun`` with several processes: shard the parameters, gradients and
    optimizer state across them with FSDP2 (one unit per decoder layer, plus the rest), for
    a model that does not fit one device with its gradients and Adam state. Off: every
    process holds the whole model. Ignored in a single process; not with rollout.engine=vllm."""
    dropout: bool = False
    """Keep the model's dropout in the RL passes (logp_old and the updates). Off (default, as
    TRL and verl do): every dropout probability is set to 0 at load, so pi_old and the updated
    policy are the deterministic distribution the sampler draws from."""
    master_weights: bool = True
    """With a low-precision ``dtype`` (bfloat16, float16; or one saved in the checkpoint):
    keep FP32 parameters, gradients and AdamW state and compute under torch.autocast in that
    dtype (mixed precision). False: the parameters themselves are low precision (less memory;
    small updates are rounded away — a warning says so)."""


@dataclass
class DataConfig:
    """The prompts and their reward."""

    task: str = "addition"
    """Built-in task name (see ``cispo.tasks.list_tasks()``)."""
    seed: int = 0
    """Seed of the train / held-out prompt sets: fixed, so runs of any seed share prompts."""
    num_train_prompts: int = 20000
    """Size of the training prompt set drawn from the task's train split."""
    num_eval_prompts: int = 200
    """Held-out prompts used by the periodic evaluation."""
    path: str | None = None
    """Prompt file instead of the built-in task: JSONL, Parquet or a ``datasets`` folder."""
    eval_path: str | None = None
    """Held-out prompt file. None: a seeded slice of ``path`` (at most 1/5 of it)."""
    prompt_field: str = "prompt"
    """Field holding the prompt (text or chat messages); dotted paths allowed."""
    answer_field: str | None = "answer"
    """Field holding the reference answer, passed to the reward as ``answer``."""
    extra_fields: list[str] | None = None
    """More fields passed to the reward as keyword arguments."""
    split: str | None = None
    """Split of a ``datasets`` DatasetDict folder."""
    on_error: str = "raise"
    """Malformed rows: ``raise`` (the first one, naming file, line and field) or ``skip``."""
    reward: str | None = None
    """Reward for ``path`` data: ``math``, ``exact_match``, ``code`` or ``module:function``."""
    fork_token: str | None = None
    """For ``path`` data: a string whose use is tracked as the fork rate (e.g. ``Wait``)."""
    reward_timeout_s: float | None = 60.0
    """Per-call reward timeout; a reward that hangs, raises or returns a non-number scores 0
    and is counted in ``rollout/reward_errors``. None: no timeout (called in the main thread)."""
    reward_isolation: str = "auto"
    """Where ``reward`` runs: ``process`` (worker processes that a hang, exit or crash cannot
    take down; ``reward_timeout_s`` kills a call), ``main`` (the trainer's main thread; trusted,
    no timeout), ``auto``: ``main`` for the built-in names, ``process`` for ``module:function``
    and ``file.py:function``."""
    reward_workers: int | None = None
    """Worker processes of a ``process`` reward. None: min(8, CPU count)."""


@dataclass
class RolloutConfig:
    """Sampling the generation batch."""

    prompts_per_step: int = 32
    """P: prompts (groups) per generation batch."""
    group_size: int = 8
    """G: responses sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same one)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    max_new_tokens: int | None = None
    """Longest response, in tokens. None: the task's longest well-formed answer + 25%."""
    repetition_stop_tokens: int | None = None
    """Stop a response once this many consecutive tokens each had probability above
    ``repetition_stop_prob`` (MiniMax-M1: 3000 of 40k-80k). None: 3/4 of max_new_tokens.
    0: off."""
    repetition_stop_prob: float = 0.99
    """Probability threshold of the repetition early stop."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and sample more prompts (DAPO)."""
    max_sampling_rounds: int = 3
    """Cap on generation rounds per step with dynamic sampling; then train on what was kept."""
    overlong_buffer: int | None = None
    """DAPO's soft overlong penalty: the last ``overlong_buffer`` tokens before
    max_new_tokens are penalised linearly down to -1. None: off."""
    engine: str = "torch"
    """Sampler: ``torch`` (the built-in KV-cache sampler) or ``vllm`` (needs a CUDA GPU and
    ``pip install "cispo[vllm]"``; weights are pushed to it after every step)."""
    vllm_gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory vLLM may take (the trainer shares the GPU)."""
    vllm_sleep: bool = False
    """Put the vLLM engine to sleep during the updates (frees its memory; slower)."""


@dataclass
class AlgoConfig:
    """The objective and the schedule of off-policy updates."""

    objective: str = "cispo"
    """Objective preset: cispo, ppo, grpo, dapo, gspo, reinforce."""
    objective_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of ``ObjectiveConfig`` to override, e.g. ``objective_overrides.eps_high_is=2.0``."""
    advantage_estimator: str = "grpo"
    """Group-relative advantages: grpo, drgrpo, rloo."""
    updates_per_batch: int = 16
    """K: the generation batch is split into K mini-batches, one optimizer step each
    (MiniMax-M1: 16). With K = 1 every objective is identical (r = 1)."""
    epochs: int = 1
    """Passes over the generation batch (K optimizer steps each)."""
    micro_batch_size: int | None = None
    """Rows per forward/backward (gradient accumulation within a mini-batch). None: whole."""
    micro_batch_split_cost: float | None = 128.0
    """Length-sorted micro-batches: the rows of each mini-batch (and of the logp_old pass) are
    sorted by length and cut into micro-batches wherever a cut saves more padded decoder
    positions than this (the fixed cost of one more forward/backward, in positions), each of at
    most ``micro_batch_size`` rows and trimmed to its longest row. The mini-batches and the
    gradient are unchanged (up to float summation order). None: rows in random order, cut only
    by ``micro_batch_size``."""
    tis_cap: float | None = None
    """Truncated importance sampling for the rollout/trainer mismatch: each token's advantage
    is multiplied by min(pi_old / pi_rollout, tis_cap) (Yao et al. 2025 use 2). None: off."""


@dataclass
class OptimConfig:
    """AdamW, with MiniMax-M1's settings by default."""

    lr: float = 1e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2). MiniMax-M1: (0.9, 0.95); (0.9, 0.999) did not converge for them."""
    eps: float = 1e-15
    """AdamW epsilon. MiniMax-M1: 1e-15 (their gradients span 1e-18 .. 1e-5)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    warmup_updates: int = 16
    """Linear learning-rate warm-up over this many optimizer steps."""


@dataclass
class EvalConfig:
    """Periodic held-out evaluation."""

    every: int = 10
    """Evaluate every this many steps (and before the first and after the last). 0: only then."""
    num_samples: int = 4
    """k: samples per prompt for the mean accuracy (the analogue of avg@k)."""
    temperature: float = 1.0
    """Temperature of the k samples (greedy accuracy is also reported)."""


@dataclass
class TrainConfig:
    """A CISPO (or PPO / GRPO / DAPO / GSPO / REINFORCE) training run."""

    steps: int = 60
    """Generation batches (RL steps)."""
    seed: int = 0
    """Seeds sampling, shuffling and the prompt order."""
    out_dir: str = "runs"
    """Folder that holds the run folders."""
    run_name: str | None = None
    """Run folder name. None: ``{objective}__{task}__seed{seed}``."""
    checkpoint_every: int = 20
    """Save a checkpoint every this many steps (and at the end). 0: only at the end."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    threads: int | None = None
    """torch CPU threads (None: torch's default)."""
    progress: bool = True
    """Show a progress bar."""
    max_bad_steps: int = 3
    """Stop (with a checkpoint of the last good weights) after this many consecutive steps
    whose every update had a non-finite gradient."""
    trackers: list[str] = field(default_factory=list)
    """Metric sinks besides metrics.jsonl: ``tensorboard``, ``wandb``, ``mlflow``
    (``pip install 'cispo[wandb]'`` etc.). W&B and MLflow read their usual environment
    variables (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, ...); see docs/api.md."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        checks = [
            ("steps", self.steps >= 1, "must be >= 1"),
            ("max_bad_steps", self.max_bad_steps >= 1, "must be >= 1"),
            ("rollout.prompts_per_step", self.rollout.prompts_per_step >= 1, "must be >= 1"),
            ("rollout.group_size", self.rollout.group_size >= 2, "must be >= 2 (group-relative advantages)"),
            ("rollout.max_sampling_rounds", self.rollout.max_sampling_rounds >= 1, "must be >= 1"),
            ("algo.updates_per_batch", self.algo.updates_per_batch >= 1, "must be >= 1"),
            ("algo.epochs", self.algo.epochs >= 1, "must be >= 1"),
            ("optim.lr", self.optim.lr > 0, "must be > 0"),
            ("rollout.engine", self.rollout.engine in ("torch", "vllm"), "must be 'torch' or 'vllm'"),
            ("algo.tis_cap", self.algo.tis_cap is None or self.algo.tis_cap > 0, "must be > 0 or None"),
            ("model.lora_rank", self.model.lora_rank >= 0, "must be >= 0"),
            ("model.fsdp", not (self.model.fsdp and self.rollout.engine == "vllm"),
             "cannot be combined with rollout.engine=vllm (the engine needs the full weights)"),
            ("optim.grad_clip", self.optim.grad_clip >= 0, "must be >= 0"),
            ("eval.num_samples", self.eval.num_samples >= 1, "must be >= 1"),
            ("data.num_eval_prompts", self.data.num_eval_prompts >= 0, "must be >= 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}")
        from cispo.objective import preset
        from cispo.tracking import check_sink_kinds

        check_sink_kinds(self.trackers)  # unknown name -> ValueError with a suggestion
        preset(self.algo.objective, **self.algo.objective_overrides)  # unknown name / field / bad value
