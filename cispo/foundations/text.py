"""Text that is valid Unicode. A Python ``str`` may hold lone surrogates (U+D800..U+DFFF: ``"\\ud800"``,
from a JSON escape, ``os.fsdecode`` of bytes, a hostile tool or exception message); UTF-8 cannot encode
them, so a tokenizer raises on such text and a UTF-8 file refuses it. Text that comes from code the run
does not control (a tool's output, a reward's error message) is made valid where it enters (`valid_text`);
a record is made valid where it is written (`valid_json_line`). Plain Python."""

from __future__ import annotations

import json
import re

REPLACEMENT = "\ufffd"
"""What each lone surrogate becomes: U+FFFD, Unicode's replacement character."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def plain_str(text: str) -> str:
    """``text`` (a ``str`` or an instance of a subclass) as a builtin ``str``, copied by ``str.__str__`` itself:
    no method of a subclass runs (its ``__str__``, ``__len__``, ``__reduce__`` when pickled)."""
    return str.__str__(text)


def valid_text(text: str) -> str:
    """``text`` with each lone surrogate (not encodable as UTF-8) replaced by `REPLACEMENT`; ``text``
    itself when it has none."""
    return _SURROGATE.sub(REPLACEMENT, text)


def invalid_at(text: str) -> int | None:
    """The index of the first lone surrogate in ``text`` (where `valid_text` would change it); None
    when ``text`` is valid Unicode."""
    found = _SURROGATE.search(text)
    return None if found is None else found.start()


def valid_json_line(record, **dumps_kwargs) -> str:
    """``record`` as one line of JSON (``json.dumps(record, ensure_ascii=False, **dumps_kwargs)``) that
    UTF-8 can encode: a lone surrogate in any of its strings (keys too) is written as `REPLACEMENT`."""
    return valid_text(json.dumps(record, ensure_ascii=False, **dumps_kwargs))
