"""Reading YAML text safely: the config engine's input (`cispo.config.engine`) and its error type.

Hostile or careless input is one line, fast (docs/reliability.md, "Config"): a config file is read
only when it is a regular file of at most `MAX_CONFIG_BYTES`; the loader refuses duplicate keys,
nesting deeper than `MAX_DEPTH`, aliases that expand to more than `MAX_ALIAS_NODES` nodes (an alias
bomb) and integers longer than `MAX_INT_CHARS`; values in messages go through `short_repr`.
PyYAML reads ``1e-4`` (no dot) as a string; here it is a float, as in YAML 1.2.
"""

from __future__ import annotations

import os
import pathlib
import re
import reprlib
import stat
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config could not be read, parsed or validated; the message says where and why."""


MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read, 1 MiB: a run's config is a few KB (``config.yaml`` of a run with
every field: about 3 KB), and PyYAML reads about 0.5 MB/s, so a larger file (a 50 MB string, or
``/dev/zero``) is refused before it is parsed. A ``key=value`` override has the same limit."""
MAX_DEPTH = 100
"""The deepest nesting of YAML collections read: a config nests 4 levels (``data.eval_sets.NAME.
extra_fields``); deeper is refused before PyYAML's recursion, and pydantic's, run out of stack."""
MAX_ALIAS_NODES = 10_000
"""The most nodes YAML aliases (``*name``) may add to a document, counting each alias as the whole
subtree it names. An anchor and merge key (``<<: *common``) that share a few fields are far below it;
an alias bomb (10 aliases of 10 aliases of ... : 10^9 leaves from a few hundred bytes) is refused
as it is read, in milliseconds, before anything walks or prints the expanded value."""
MAX_INT_CHARS = 100
"""The longest integer literal read: no setting needs more than 20 digits (2**64), and Python
converts at most 4300 (a longer one is a ``ValueError``; a sexagesimal one, ``1:59:59:...``, is
quadratic)."""
class RefusedYAML(yaml.MarkedYAMLError):
    """YAML that parses but that the loader refuses (`ConfigLoader`); ``problem`` says why, ``problem_mark``
    where. A subclass of ``yaml.YAMLError``, so that every caller that handles bad YAML handles it."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem=problem, problem_mark=mark)


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, which also reads ``1e-4`` as a float (YAML 1.2) and refuses, as `RefusedYAML`
    at the line where it is found: a key given twice in one mapping (PyYAML would keep the last one
    silently), nesting deeper than `MAX_DEPTH`, aliases beyond `MAX_ALIAS_NODES` and an alias inside
    the node it names (a cycle; both would make every later walk of the value explode or never end),
    and an integer literal longer than `MAX_INT_CHARS` (Python refuses or takes quadratic time)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth, self._alias_nodes = 0, 0
        self._sizes: dict[int, int] = {}  # id(node) -> nodes in its expanded subtree, once it is composed

    def compose_node(self, parent: Any, index: Any) -> yaml.Node:
        """The next node, counted: refuses nesting past `MAX_DEPTH` and aliases past `MAX_ALIAS_NODES`."""
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            node = super().compose_node(parent, index)
            size = self._sizes.get(id(node))
            if size is None:
                raise RefusedYAML(f"alias *{short_repr(event.anchor)[1:-1]} is inside the node it names (a cycle)",
                               event.start_mark)
            self._alias_nodes += size
            if self._alias_nodes > MAX_ALIAS_NODES:
                raise RefusedYAML(f"YAML aliases expand to more than {MAX_ALIAS_NODES:,} nodes (an alias bomb?); "
                               "write the values out", event.start_mark)
            return node
        if self._depth >= MAX_DEPTH:
            raise RefusedYAML(f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        children = (node.value if isinstance(node, yaml.SequenceNode) else
                    [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
        self._sizes[id(node)] = 1 + sum(self._sizes.get(id(c), 1) for c in children)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """A mapping; refuses a key given twice (keys that a merge, ``<<: *common``, brings may be set again)."""
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else []:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                seen = first.setdefault(key, key_node) if isinstance(key, typing.Hashable) else key_node
                if seen is not key_node:
                    raise RefusedYAML(f"duplicate key {short_repr(key)} (first on line {seen.start_mark.line + 1}): "
                                   "give each key once", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """An integer; refuses a literal longer than `MAX_INT_CHARS` before converting it."""
        if len(node.value) > MAX_INT_CHARS:
            raise RefusedYAML(f"an integer of {len(node.value):,} characters: no setting takes one longer than "
                           f"{MAX_INT_CHARS}", node.start_mark)
        return super().construct_yaml_int(node)


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)


class ConfigDumper(yaml.SafeDumper): ...  # quotes the string '1e-4'


for _cls in (ConfigLoader, ConfigDumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(\d[\d_]*(\.[\d_]*)?|\.\d[\d_]*)[eE][-+]?\d+$"), list("-+0123456789."))


class _ShortRepr(reprlib.Repr):
    """reprlib's size-limited repr, which also shows an integer too long for ``repr`` by its size."""

    def repr_int(self, x: int, level: int) -> str:
        """``repr(x)``, its middle cut past ``maxlong``; an integer of more than ~4000 digits (``repr``
        raises ``ValueError`` past 4300) as ``<an integer of about N digits>``."""
        if x.bit_length() > 13_000:
            return f"<an integer of about {int(x.bit_length() * 0.30103):,} digits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 80
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = 6
_SHORT.maxlevel = 3


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)`` in at most about ``limit`` characters (reprlib: long strings and numbers cut in
    the middle, at most 6 items and 3 levels of a container shown): an error message shows what was
    given, never all of it (an alias bomb is 10^9 leaves; a 50 MB string is 50 MB)."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else f"{text[:limit - 1]}…"


_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISFIFO, "a FIFO or pipe"), (stat.S_ISSOCK, "a socket"))


def read_config_text(path: str | pathlib.Path) -> str:
    """The text of config file ``path``. Refuses, as a `ConfigError` naming the file: a path that
    cannot be opened; one that is not a regular file (``/dev/zero`` would be read forever, a FIFO
    blocks until someone writes: checked on the file opened non-blocking, before any read, so a
    ``<(...)`` process substitution is refused too); a file larger than `MAX_CONFIG_BYTES` (at most
    one byte more is read); bytes that are not UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    try:
        mode, raw = os.fstat(fd).st_mode, b""
        if stat.S_ISREG(mode):
            with open(fd, "rb", closefd=False) as file:
                raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a file")
        raise ConfigError(f"{path}: cannot read config file: {kind}, not a regular file; give a YAML file")
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: cannot read config file: larger than {MAX_CONFIG_BYTES >> 20} MiB (a config "
                          "is a few KB of YAML)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: cannot read config file: not UTF-8 (byte {exc.start}: {exc.reason})") from None


def parse_yaml(text: str) -> tuple[yaml.Node | None, Any]:
    """The node tree of YAML ``text`` (for the lines of errors) and its data, read once by `ConfigLoader`."""
    loader = ConfigLoader(text)
    try:
        node = loader.get_single_node()
        return node, None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def yaml_problem(exc: yaml.YAMLError) -> str:
    """``:LINE: what`` for a YAML error: ``invalid YAML: ...`` for a syntax error, the refusal itself
    for `RefusedYAML` (a duplicate key, an alias bomb, ...)."""
    mark = getattr(exc, "problem_mark", None)
    what = exc.problem if isinstance(exc, RefusedYAML) else f"invalid YAML: {getattr(exc, 'problem', None) or exc}"
    return f"{f':{mark.line + 1}' if mark else ''}: {what}"
