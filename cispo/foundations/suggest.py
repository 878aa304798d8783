"""The "did you mean" hint of every error message that names an unknown word (the closest known
words by difflib's similarity). TRL's and verl's names of cispo's settings, config knowledge, are in
`cispo.config.foreign_names`."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: object, choices: Iterable[object], n: int = 1, cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` naming the ``n`` choices closest to ``word`` (difflib's
    similarity ratio >= ``cutoff``), or ``""`` when none is that close."""
    return hint(closest(word, choices, n, cutoff))


def closest(word: object, choices: Iterable[object], n: int = 1, cutoff: float = 0.6) -> list[str]:
    """Up to ``n`` choices closest to ``word``, best first (difflib's similarity ratio >= ``cutoff``)."""
    return difflib.get_close_matches(str(word), [str(c) for c in choices], n=n, cutoff=cutoff)


def hint(suggestions: list[str]) -> str:
    """`` (did you mean 'x'?)`` for ``suggestions`` found some other way; ``""`` for none."""
    return f" (did you mean {' or '.join(repr(c) for c in suggestions)}?)" if suggestions else ""
