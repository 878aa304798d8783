"""The config engine: YAML files, ``key=value`` overrides, help text and errors that name the
key, for any tree of plain dataclasses (the run's own are in `cispo.config.train`).

The configs are plain dataclasses; pydantic checks and converts plain data into them (types,
``Literal`` choices, unknown keys, and each class's ``__post_init__`` checks). OmegaConf, which
verl and Hydra use, was the first choice; version 2.3 rejects ``Literal`` fields and turns
tuples into lists. The YAML files and ``key=value`` overrides are the same with either.
PyYAML reads ``1e-4`` (no dot) as a string; here it is a float, as in YAML 1.2.
pydantic is imported where a config is read or checked, not at import: the config dataclasses
themselves (``TrainConfig()``, ``dataclasses.replace``) work without it, as on a bare CUDA image
(``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import pathlib
import re
import types
import typing
from typing import Any, Callable, Literal, TypeVar

import yaml

from cispo.foundations.suggest import did_you_mean, other_name_hint

__all__ = ["ConfigError", "apply_overrides", "field_docs", "format_help", "from_dict", "load_yaml", "rename_key",
           "save_yaml", "to_dict"]
T = TypeVar("T")
KeyPath = tuple  # field names (str) and list indices (int), as in pydantic's error locations


class ConfigError(ValueError):
    """A config could not be read, parsed or validated; the message says where and why."""


class _Loader(yaml.SafeLoader): ...  # reads 1e-4 as a float


class _Dumper(yaml.SafeDumper): ...  # quotes the string '1e-4'


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(\d[\d_]*(\.[\d_]*)?|\.\d[\d_]*)[eE][-+]?\d+$"), list("-+0123456789."))


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
    """``dotted.key: what is wrong`` for one pydantic error (a typo gets a suggestion)."""
    loc, fields = tuple(err["loc"]), _fields(cls)
    key, tp, got = _dotted(loc), fields.get(loc), err.get("input")
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
        return f"{key}: expected one of {', '.join(map(repr, choices))}, got {got!r}{did_you_mean(got, choices)}"
    return f"{key}: expected {_type_name(tp)}, got {got!r}" if tp else f"{key}: {err['msg']}, got {got!r}"


_RENAMED: dict[type, dict[KeyPath, tuple[KeyPath, Callable[[Any], Any]]]] = {}


def rename_key(cls: type, old: str, new: str, convert: Callable[[Any], Any] = lambda value: value) -> None:
    """Read dotted key ``old`` of config ``cls`` as ``new`` (its value through ``convert``), so that
    files written before a key was renamed (a run folder's ``config.yaml``) still load; ``old`` with
    a value (not None) next to a value of ``new`` is an error."""
    _RENAMED.setdefault(cls, {})[tuple(old.split("."))] = (tuple(new.split(".")), convert)


def _renamed(cls: type, data: Any, where: Callable[[KeyPath], str]) -> Any:
    """``data`` (a copy, when a renamed key of ``cls`` is in it: `rename_key`) with them under their new names."""
    renamed = _RENAMED.get(cls, {})
    if renamed and isinstance(data, dict):
        data = copy.deepcopy(data)
    for old, (new, convert) in renamed.items():
        parent = functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, old[:-1], data)
        if not isinstance(parent, dict) or old[-1] not in parent:
            continue
        value = parent.pop(old[-1])
        target = functools.reduce(lambda d, k: d.setdefault(k, {}), new[:-1], data)
        if value is not None and target.get(new[-1]) is not None:
            raise ConfigError(f"{where(old)}: {_dotted(old)} is the old name of {_dotted(new)}: give only "
                              f"{_dotted(new)}")
        if value is not None:
            target[new[-1]] = convert(value)
    return data


def _build(cls: type[T], data: Any, where: Callable[[KeyPath], str]) -> T:
    """``cls`` from plain data; each problem is a line ``where(key path): key: what``."""
    data = _renamed(cls, data, where)
    for key, tp in _fields(cls).items():  # pydantic reads true as 1 where a number is due: refused
        value = functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, key, data)
        if isinstance(value, bool) and {int, float} & {tp, *typing.get_args(tp)} and bool not in typing.get_args(tp):
            raise ConfigError(f"{where(key)}: {_dotted(key)}: expected {_type_name(tp)}, got {value!r}")
    import pydantic

    try:
        return _adapter(cls).validate_python({} if data is None else data)
    except pydantic.ValidationError as exc:
        problems = dict.fromkeys(f"{where(tuple(e['loc']))}: {_problem(cls, e)}" for e in exc.errors())
        raise ConfigError("\n".join(problems)) from None


def from_dict(cls: type[T], data: dict[str, Any] | None, source: str = "<dict>") -> T:
    """Config ``cls`` from plain nested data; ``None`` or a missing key: the defaults. Wrong
    types, unknown keys and failed checks raise ``ConfigError`` s starting with ``source``."""
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


def load_yaml(cls: type[T], path: str | pathlib.Path) -> T:
    """Config ``cls`` from a YAML file (empty: the defaults). Errors name the file, line and
    key: ``run.yaml:12: optim.lr: expected float, got 'abc'``."""
    _fields(cls)
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
        node, data = yaml.compose(text, Loader=_Loader), yaml.load(text, Loader=_Loader)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file: {getattr(exc, 'strerror', None) or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigError(f"{path}{f':{mark.line + 1}' if mark else ''}: invalid YAML: "
                          f"{getattr(exc, 'problem', None) or exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}:1: expected a mapping of config keys at top level, got {type(data).__name__}")
    sections = {k for k, v in (data or {}).items() if v is None and dataclasses.is_dataclass(_fields(cls).get((k,)))}
    data = {**(data or {}), **dict.fromkeys(sections, {})}  # 'optim:' with nothing below: its defaults
    return _build(cls, data, lambda loc: f"{path}{_line(node, loc)}")


def to_dict(cfg: Any) -> Any:
    """A config as nested plain data: sections -> dicts, tuples -> lists (all new containers)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return [to_dict(v) for v in cfg] if isinstance(cfg, (list, tuple)) else cfg


def save_yaml(cfg: Any, path: str | pathlib.Path) -> None:
    """Every field of a config (defaults included) as a YAML file that ``load_yaml`` reads
    back to an equal config. Parent folders are created."""
    text = yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=88)
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f"# {type(cfg).__name__}: {_class_doc(type(cfg))} Written by cispo.config.save_yaml; "
                      f"every field, defaults included.\n{text}", encoding="utf-8")


def _accepts_container(tp: Any) -> bool:
    """``list[str]``, ``dict[str, Any]``, ``tuple[float, float]``, ``list[str] | Literal['all'] | None``..."""
    origin = typing.get_origin(tp)
    return origin in (list, dict, tuple) or (
        origin in (typing.Union, types.UnionType) and any(map(_accepts_container, typing.get_args(tp))))


def _override_value(text: str, tp: Any, source: str) -> Any:
    """YAML (``3e-4``, ``true``, ``[1, 2]``, ``{a: 1}``); ``None``/``null``: None; the text
    itself for a string field that YAML reads as something else (``run_name=2024``), but a list
    or mapping for a field that also takes one (``extra_fields=[a, b]`` where ``all`` would do)."""
    if text.lower() in ("none", "null", "~"):
        return None
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        if not _accepts_str(tp):
            raise ConfigError(f"{source}: cannot parse {text!r} as a YAML value: {getattr(exc, 'problem', exc)}")
        value = text
    if isinstance(value, (list, dict)) and _accepts_container(tp):
        return value
    return text if not isinstance(value, str) and _accepts_str(tp) else value


def apply_overrides(cfg: T, overrides: list[str] | tuple[str, ...]) -> T:
    """A copy of ``cfg`` with ``key=value`` overrides set in order, then checked once as a
    whole (so no order of ``prompts_per_step=2 updates_per_batch=4`` trips a check).

    ``key``: a dotted path (``optim.lr``) or a field name found in one place only (``lr``; a
    top-level field wins); an ambiguous name is an error naming the candidates. Past a dict
    field the rest is a key into it (``objective_overrides.eps_high_is=2``). A mapping for a
    section sets just those fields. ``cfg`` is not changed."""
    if not overrides:
        return cfg
    cls, data, sources = type(cfg), to_dict(cfg), {}
    fields = _fields(cls)
    for item in overrides:
        source = f"override {item!r}"
        key, sep, text = item.partition("=") if isinstance(item, str) else ("", "", "")
        path = tuple(p.strip() for p in key.split("."))
        if not sep or not all(path):
            raise ConfigError(f"{source}: expected key=value (e.g. optim.lr=3e-4)")
        if path[:1] not in fields:
            found = [k for k in fields if k[-1] == path[0]]
            if len(found) > 1:
                raise ConfigError(f"{source}: ambiguous key {path[0]!r}: it could be "
                                  f"{', '.join(map(_dotted, found))}; use the full dotted key")
            path = found[0] + path[1:] if found else path  # an unknown key: pydantic names it
        value, node = _override_value(text.strip(), fields.get(path), source), data
        for i, part in enumerate(path[:-1]):
            node = node[part] if isinstance(node.get(part), dict) else node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: {_dotted(path[:i + 1])} is not a section")
        if dataclasses.is_dataclass(fields.get(path)) and isinstance(value, dict):
            value = {**node[path[-1]], **value}
        node[path[-1]], sources[path] = value, source
    every = source if len(overrides) == 1 else "overrides " + ", ".join(map(repr, overrides))
    return _build(cls, data, lambda loc: next(
        (sources[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in sources), every))


def _class_doc(cls: type) -> str:
    """The first line of a class's own docstring ("" for dataclasses' generated one)."""
    doc = (cls.__dict__.get("__doc__") or "").strip()
    return "" if not doc or doc.startswith(f"{cls.__name__}(") else doc.splitlines()[0]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring below each field of dataclass ``cls`` ("" where none), by field name."""
    docs = dict.fromkeys((f.name for f in dataclasses.fields(cls)), "")
    for c in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)] if _fields(cls) else []):
        docs.update({k: v["description"] for k, v in _adapter(c).json_schema()["properties"].items() if "description" in v})
    return docs


def format_help(cls: type) -> str:
    """Every field of config ``cls``: dotted key, type, default and docstring, by section."""
    fields, out = _fields(cls), [
        "Config fields. Override any with KEY=VALUE: KEY is a dotted path (section.field) or a",
        "field name that occurs in one place only; VALUE is YAML (3e-4, true, null, [1, 2], {a: 1}).", ""]

    def section(c: type, prefix: KeyPath, title: str) -> None:
        out.append(title)
        subs, docs = [], field_docs(c)
        for f in dataclasses.fields(c):
            key = prefix + (f.name,)
            if dataclasses.is_dataclass(fields[key]):
                subs.append(key)
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(f"  {_dotted(key)}: {_type_name(fields[key])} = {default!r}")
            out.extend(f"      {line}".rstrip() for line in docs[f.name].splitlines())
        for key in subs:
            sub = fields[key]
            section(sub, key, f"\n{_dotted(key)} ({sub.__name__}): {_class_doc(sub)}")

    section(cls, (), f"{cls.__name__}: {_class_doc(cls)}")
    return "\n".join(out).rstrip() + "\n"
