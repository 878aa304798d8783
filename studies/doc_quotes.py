"""The values a doc quotes from the study report, between markers: the check that they equal
the report's output (``python -m studies report --check-doc``) and the rewrite that makes them so
(``--update-doc``). Text in, text out; the report's outputs are a plain name -> text dict."""

from __future__ import annotations

import re

MARKER = re.compile(r"<!-- study:(?P<name>\S+) -->(?P<body>.*?)<!-- /study:(?P=name) -->", re.S)
"""A quoted table or number in a doc, e.g.
``<!-- study:ratio/main/chain/K16 -->0.52 [0.41, 0.66]<!-- /study:ratio/main/chain/K16 -->``;
a table sits on its own lines between the two markers."""


def check_doc(text: str, outputs: dict[str, str], where: str = "doc") -> list[str]:
    """Every quoted block of `text` that differs from the report's output (or names no output),
    as ``where:line: name: ...``; [] when all agree. A doc with no marker has nothing to check."""
    problems = []
    for m in MARKER.finditer(text):
        line, name = text.count("\n", 0, m.start()) + 1, m["name"]
        if name not in outputs:
            problems.append(f"{where}:{line}: {name}: not an output of the report")
        elif m["body"].strip() != outputs[name].strip():
            problems.append(f"{where}:{line}: {name}: the doc says {m['body'].strip()[:200]!r}, the data give "
                            f"{outputs[name].strip()[:200]!r}")
    return problems


def update_doc(text: str, outputs: dict[str, str]) -> str:
    """`text` with every quoted block replaced by the report's output (unknown names kept)."""
    def fill(m: re.Match) -> str:
        if m["name"] not in outputs:
            return m[0]
        body = outputs[m["name"]].strip()
        body = f"\n{body}\n" if "\n" in body or m["body"].startswith("\n") else body
        return f"<!-- study:{m['name']} -->{body}<!-- /study:{m['name']} -->"

    return MARKER.sub(fill, text)
