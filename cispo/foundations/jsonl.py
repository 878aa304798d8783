"""A run's JSONL files, plain or gzip-compressed: the one place that opens them.

Training writes ``metrics.jsonl`` and ``samples.jsonl`` plain (appended line by line). The
research data committed under ``studies/results/`` keeps the same files gzip-compressed
(``metrics.jsonl.gz``, ``samples.jsonl.gz``; level 9, no timestamp) so that a clone stays
small. A reader names the plain file; ``jsonl_path`` takes the compressed one when only it is
there, so ``read_metrics``, ``cispo plot``, ``python -m studies data``, ``compare`` and the doc tests
read either. Plain Python (gzip only).

A run's step files (``metrics.jsonl``, ``samples.jsonl``) are parsed in one place,
`parse_step_lines`: ``--resume`` (which cuts them), ``read_metrics`` and ``cispo plot`` read the
same rows, and a torn, NUL-filled, non-UTF-8 or too deeply nested line is listed, not parsed.

``python -m cispo.foundations.jsonl FILE.jsonl...`` compresses run files copied into
``studies/results/`` (`compress`: ``FILE.jsonl.gz`` written, checked, ``FILE.jsonl`` removed).
"""

from __future__ import annotations

import gzip
import json
import sys
import zlib
from pathlib import Path

GZ = ".gz"


def jsonl_path(path: str | Path) -> Path:
    """``path`` if it exists (or already names a ``.gz``); else ``<path>.gz`` if that exists;
    else ``path`` (missing)."""
    path = Path(path)
    if path.exists() or path.suffix == GZ:
        return path
    gz = path.with_name(path.name + GZ)
    return gz if gz.exists() else path


def has_jsonl(path: str | Path) -> bool:
    """Whether ``path`` or its ``.gz`` is a file (`jsonl_path`)."""
    return jsonl_path(path).is_file()


def bounded_lines(file, limit: int):
    """``(line number, raw line)`` of binary ``file``, each at most ``limit`` bytes read into memory; a longer
    line gives ``None`` (its bytes are read past in 1 MiB pieces, never kept: a 1 GB line costs 1 MiB)."""
    lineno = 0
    while raw := file.readline(limit + 1):
        lineno += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = file.readline(1 << 20)
            yield lineno, None
            continue
        yield lineno, raw


def read_jsonl_bytes(path: str | Path) -> bytes:
    """The bytes of ``path`` or, when only it exists, of ``<path>.gz`` decompressed
    (`jsonl_path`); ``FileNotFoundError`` when neither does, ``ValueError`` naming a ``.gz``
    that does not decompress (not gzip, cut short)."""
    path = jsonl_path(path)
    raw = path.read_bytes()
    if path.suffix != GZ:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; a cut stream an EOFError
        raise ValueError(f"{path}: not a readable gzip file ({e})") from None


def parse_step_lines(path: str | Path) -> tuple[list[dict], list[tuple[int, str]], int]:
    """(rows, [(line number, what is wrong)], number of the last non-blank line) of a JSONL
    file of step rows (``metrics.jsonl``, ``samples.jsonl``, or their ``.gz``: `read_jsonl_bytes`);
    a line that is not a JSON object with an integer ``step`` (torn, NUL-filled, not UTF-8,
    nested too deeply for the parser) is listed, not parsed."""
    rows, bad, last = [], [], 0
    for number, raw in enumerate(read_jsonl_bytes(path).split(b"\n"), start=1):
        if not raw.strip(b" \t\r"):
            continue
        last = number
        what = read_step_line(raw)
        if isinstance(what, str):
            bad.append((number, what))
        else:
            rows.append(what)
    return rows, bad, last


def read_step_line(raw: bytes) -> dict | str:
    """The row of one line of a step file, or what is wrong with it (`parse_step_lines`)."""
    if b"\0" in raw:
        return "NUL bytes (a write lost in a crash)"
    try:
        row = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"{type(e).__name__}: {e}"
    except RecursionError:
        return "JSON nested too deeply to read (hundreds of levels of [ or {)"
    if not isinstance(row, dict) or type(row.get("step")) is not int:  # a JSON true is no step
        return "not a JSON object with an integer 'step'"
    return row


def glob_jsonl(folder: str | Path, pattern: str) -> list[Path]:
    """The files below ``folder`` matching ``pattern`` (``Path.glob``'s: ``"*/metrics.jsonl"``,
    ``"**/metrics.jsonl"``) or its compressed form (``pattern + ".gz"``), sorted."""
    folder = Path(folder)
    return sorted({*folder.glob(pattern), *folder.glob(pattern + GZ)})


def write_jsonl_gz(path: str | Path, data: bytes) -> Path:
    """``data`` gzip-compressed into ``path`` (level 9, no file name, mtime 0): the same bytes
    give the same file on every machine."""
    path = Path(path)
    with open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=9, mtime=0) as z:
        z.write(data)
    return path


def compress(path: str | Path) -> Path:
    """``path`` replaced by ``<path>.gz`` (`write_jsonl_gz`), once the new file is checked to
    decompress to the same bytes. Returns the new file."""
    path = Path(path)
    data = path.read_bytes()
    gz = write_jsonl_gz(path.with_name(path.name + GZ), data)
    if gzip.decompress(gz.read_bytes()) != data:
        gz.unlink()
        raise OSError(f"{gz}: does not decompress to {path}'s bytes; {path} kept")
    path.unlink()
    return gz


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or any(not a.endswith(".jsonl") for a in args):
        print("usage: python -m cispo.foundations.jsonl FILE.jsonl...  (each replaced by FILE.jsonl.gz)",
              file=sys.stderr)
        return 2
    for a in args:
        before = Path(a).stat().st_size
        gz = compress(a)
        print(f"{gz}: {before / 1e6:.2f} MB -> {gz.stat().st_size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
