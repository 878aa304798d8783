"""Prompt sets from files: JSONL, Parquet, or a Hugging Face ``datasets`` folder.

    >>> samples = load_prompts("gsm8k_train.jsonl", prompt_field="question", answer_field="answer")
    >>> samples[0]
    {'prompt': 'Natalia sold clips to ...', 'answer': '... #### 72'}
    >>> load_prompts("dapo-math-17k.parquet", answer_field="reward_model.ground_truth",
    ...              extra_fields=["data_source"])[0]
    {'prompt': 'Solve the following ...', 'messages': [{'role': 'user', 'content': '...'}],
     'answer': '34', 'data_source': 'math_dapo'}

Formats, by path: ``.jsonl`` / ``.ndjson`` / ``.json`` (one JSON object per line; blank lines
are ignored; a ``.json`` file whose first character is ``[`` is read as one JSON array),
``.parquet`` / ``.pq`` (needs ``pyarrow``), and a directory written by
``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (needs ``datasets``; ``split`` picks
the split of a DatasetDict, required when it has more than one). ``pip install "cispo[data]"``
installs both.

Any other folder is a folder of shards: every JSONL / Parquet file under it (recursively,
hidden ones skipped), read in sorted order with the readers above, so an error names the
shard file and its line / row. Shards named after a split the hub's way (a folder ``train/``,
or a file ``train-00000-of-00002.parquet`` / ``test.jsonl``) are grouped: ``split`` picks one
group, and is required when there are several. A path that does not exist but reads as a
hub id (``name`` or ``owner/name``) is loaded with ``datasets.load_dataset(path, name=name,
split=split)`` (``split`` required; ``name``: the subset); errors then name the hub id and the
0-based row.

Each sample is a dict with normalised names, so the trainer always finds ``prompt``:

* ``prompt`` (str): the prompt field's text. If the field holds a chat message list
  (``[{"role": "user", "content": "..."}, ...]``, as in DAPO-Math / verl parquet files), the
  list is kept under ``messages`` (what the chat template renders, whole: ``model.chat_template``)
  and ``prompt`` is the content of the last ``user`` message (the prompt without a template).
* ``answer`` (str): the answer field's value as a string (numbers are converted); absent when
  ``answer_field=None`` (for rewards that need no answer). The default field, ``answer``, may
  be missing from every row of a file (a data set whose reference is ``solution``, or verl's
  ``reward_model.ground_truth``): then no sample has ``answer``, and a reward that needs one is
  refused before training (`cispo.data.rewards.loading.check_reward_fields`). A file where only
  some rows lack it has bad rows (``on_error``). Any other answer field is required in every row.
* extra fields: ``extra_fields`` lists more fields to pass on to the reward, each under its
  last path component (``extra_info.index`` -> ``index``); ``"all"`` (what ``cispo train``
  passes by default, ``data.extra_fields``) passes every top-level column of the row under its
  own name but the prompt field's, as TRL passes a data set's columns: the answer column too
  (``solution`` with ``answer_field="solution"``: both ``solution`` and ``answer``); a column
  named ``prompt`` / ``answer`` / ``messages`` holds the normalised value, and one named
  ``completion`` is not passed (the reward's ``completion`` is the model's).

Field names may be nested paths: ``reward_model.ground_truth``, ``prompt.0.content`` (a list
index); a key that literally contains the dot wins.

Errors raise `DataError` (a ValueError) naming the file, the row (JSONL: ``line N``, 1-based
line number; Parquet / datasets / JSON array: ``row N``, 0-based index) and the field. With
``on_error="skip"`` bad rows are skipped instead; `load_prompts_with_report` returns a
`LoadReport` with the counts and the first messages (`load_prompts` logs a warning). A file
with no usable sample always raises.
"""

from __future__ import annotations

import json
import logging
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from cispo.foundations.jsonl import bounded_lines
from cispo.foundations.suggest import closest, did_you_mean, hint
from cispo.foundations.text import invalid_at

__all__ = ["load_prompts", "load_prompts_with_report", "read_rows", "DataError", "LoadReport", "looks_like_hub_id"]

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
RESERVED = ("prompt", "answer", "messages", "completion")
"""Sample keys that never hold a column of that name: the normalised ones, and the reward's own
``completion`` argument (a prompt-completion data set's ``completion`` column is not passed on)."""
DEFAULT_ANSWER_FIELD = "answer"
"""The answer field that may be missing from a whole file (the module docstring)."""
MAX_REPORTED_ERRORS = 5
_DATA_HINT = 'pip install "cispo[data]"'


class DataError(ValueError):
    """A prompt file, or one of its rows, that cannot be loaded. ``path``, ``location``
    (``"line 3"`` / ``"row 2"`` / None) and ``field`` (or None) say where."""

    def __init__(self, path: str | Path, reason: str, location: str | None = None, field: str | None = None):
        self.path, self.reason, self.location, self.field = str(path), reason, location, field
        parts = [self.path] + ([location] if location else []) + ([f"field {field!r}"] if field else [])
        super().__init__(": ".join(parts) + ": " + reason)


@dataclass
class LoadReport:
    """What `load_prompts_with_report` read."""

    path: str
    rows: int = 0
    """Rows read (blank JSONL lines not counted)."""
    loaded: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    """The first `MAX_REPORTED_ERRORS` error messages of skipped rows."""

    def __str__(self) -> str:
        s = f"{self.path}: {self.loaded} samples loaded from {self.rows} rows, {self.skipped} skipped"
        if self.errors:
            more = f" (+{self.skipped - len(self.errors)} more)" if self.skipped > len(self.errors) else ""
            s += "; first errors:\n  " + "\n  ".join(self.errors) + more
        return s


class _RowError(Exception):
    def __init__(self, field: str | None, reason: str):
        self.field, self.reason = field, reason


_MISSING = object()


def _lookup(row: dict, path: str) -> tuple[Any, str, list[str]]:
    """``(value or _MISSING, the path prefix where it failed, the keys available there)``."""
    if path in row:
        return row[path], "", []
    obj: Any = row
    done: list[str] = []
    for part in path.split("."):
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and part.lstrip("-").isdigit() and -len(obj) <= int(part) < len(obj):
            obj = obj[int(part)]
        else:
            prefix = ".".join(done)
            keys = [str(k) for k in obj] if isinstance(obj, dict) else []
            if isinstance(obj, list):
                keys = [str(i) for i in range(len(obj))]
            return _MISSING, prefix, keys
        done.append(part)
    return obj, "", []


def _get(row: dict, path: str, what: str) -> Any:
    value, prefix, keys = _lookup(row, path)
    if value is not _MISSING:
        return value
    if prefix:
        where = f" ({prefix!r} has keys: {', '.join(keys[:20]) or 'none'})"
    else:
        top = [str(k) for k in row]
        where = f" (row has fields: {', '.join(top[:20])}{', ...' if len(top) > 20 else ''})"
    suggestion = _suggest_field(row, path, what)
    raise _RowError(path, f"missing {what} field{hint([suggestion] if suggestion else [])}{where}")


_ALIASES = {
    "prompt": ("prompt", "question", "problem", "query", "instruction", "input", "messages", "text"),
    "answer": ("answer", "ground_truth", "solution", "final_answer", "target", "label", "output"),
}


def _suggest_field(row: dict, path: str, what: str) -> str | None:
    """The closest field path of the row (top level and one level down): a case-insensitive
    match, else difflib's closest, else a usual name for a prompt / answer field."""
    paths = [str(k) for k in row]
    paths += [f"{k}.{sub}" for k, v in row.items() if isinstance(v, dict) for sub in v]
    lower = {p.lower(): p for p in paths}
    if path.lower() in lower:
        return lower[path.lower()]
    close = closest(path, paths)
    if close:
        return close[0]
    for alias in _ALIASES.get(what, ()):
        for p in paths:
            if p.rsplit(".", 1)[-1].lower() == alias:
                return p
    return None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_text(field_name: str, text: str, what: str = "text") -> str:
    """``text``, or a `_RowError` where it is not valid Unicode: a lone surrogate (``"\\ud800"`` in the
    JSON), which no tokenizer encodes and no UTF-8 file holds, would end the run far from this row."""
    at = invalid_at(text)
    if at is None:
        return text
    raise _RowError(field_name, f"{what} is not valid Unicode: a lone surrogate U+{ord(text[at]):04X} at "
                                f"character {at} (a \\u escape of half a UTF-16 pair?)")


def _chat_prompt(messages: list, field_name: str) -> tuple[str, list[dict]]:
    if not messages:
        raise _RowError(field_name, "empty chat message list")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            got = f"keys {sorted(m)}" if isinstance(m, dict) else _type_name(m)
            raise _RowError(field_name, f"message {j} is not a {{'role': str, 'content': str}} dict (got {got})")
        _check_text(field_name, m["role"], f"message {j}'s role")
        _check_text(field_name, m["content"], f"message {j}'s content")
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        roles = sorted({m["role"] for m in messages})
        raise _RowError(field_name, f"chat message list has no 'user' message (roles: {', '.join(roles)})")
    text = users[-1]["content"]
    if not text.strip():
        raise _RowError(field_name, "empty prompt (the last user message is blank)")
    return text, [dict(m) for m in messages]


@dataclass(frozen=True)
class _Spec:
    prompt_field: str
    answer_field: str | None
    extras: tuple[tuple[str, str], ...]  # (output key, path)
    all_extras: bool


def _make_spec(prompt_field: str, answer_field: str | None, extra_fields) -> _Spec:
    if not isinstance(prompt_field, str) or not prompt_field:
        raise ValueError(f"prompt_field must be a non-empty string, got {prompt_field!r}")
    if answer_field is not None and (not isinstance(answer_field, str) or not answer_field):
        raise ValueError(f"answer_field must be a non-empty string or None, got {answer_field!r}")
    if extra_fields is None or extra_fields == "all":
        return _Spec(prompt_field, answer_field, (), extra_fields == "all")
    if isinstance(extra_fields, str) or not isinstance(extra_fields, Sequence):
        raise ValueError(f"extra_fields must be None, 'all' or a list of field names, got {extra_fields!r}")
    extras, seen = [], {}
    for path in extra_fields:
        if not isinstance(path, str) or not path:
            raise ValueError(f"extra_fields entries must be non-empty strings, got {path!r}")
        key = path.rsplit(".", 1)[-1]
        if key in RESERVED:
            raise ValueError(f"extra field {path!r} would be passed as {key!r}, which clashes with the "
                             f"sample keys {RESERVED} (the normalised fields and the reward's completion)")
        if key in seen:
            raise ValueError(f"extra fields {seen[key]!r} and {path!r} would both be passed as {key!r}")
        seen[key] = path
        extras.append((key, path))
    return _Spec(prompt_field, answer_field, tuple(extras), False)


def _convert(row: Any, spec: _Spec) -> dict:
    if not isinstance(row, dict):
        raise _RowError(None, f"expected a JSON object (a dict of fields), got {_type_name(row)}")
    raw_prompt = _get(row, spec.prompt_field, "prompt")
    sample: dict[str, Any] = {}
    if isinstance(raw_prompt, str):
        if not raw_prompt.strip():
            raise _RowError(spec.prompt_field, "empty prompt")
        sample["prompt"] = _check_text(spec.prompt_field, raw_prompt, "the prompt")
    elif isinstance(raw_prompt, list):
        sample["prompt"], sample["messages"] = _chat_prompt(raw_prompt, spec.prompt_field)
    else:
        raise _RowError(spec.prompt_field, f"prompt must be a string or a chat message list "
                                           f"[{{'role': ..., 'content': ...}}], got {_type_name(raw_prompt)}")
    if spec.answer_field is not None and (spec.answer_field != DEFAULT_ANSWER_FIELD
                                          or _lookup(row, spec.answer_field)[0] is not _MISSING):
        raw_answer = _get(row, spec.answer_field, "answer")
        if raw_answer is None:
            raise _RowError(spec.answer_field, "answer is null")
        if isinstance(raw_answer, (list, dict, bytes)) or not isinstance(raw_answer, (str, int, float, Decimal)):
            raise _RowError(spec.answer_field, f"answer must be a string or a number, got {_type_name(raw_answer)}")
        answer = str(raw_answer)
        if not answer.strip():
            raise _RowError(spec.answer_field, "empty answer")
        sample["answer"] = _check_text(spec.answer_field, answer, "the answer")
    if spec.all_extras:
        for key, value in row.items():
            if key != spec.prompt_field and key not in RESERVED:
                sample[key] = value
    for key, path in spec.extras:
        sample[key] = _get(row, path, "extra")
    return sample


# --------------------------------------------------------------------------- readers
# Each yields (location, row); a row that cannot even be decoded is a _RowError instance.


MAX_LINE_BYTES = 32 << 20
"""The longest JSONL line read (32 MiB): a longer one is a bad row, read past without being kept."""
NESTED_TOO_DEEPLY = "JSON nested too deeply to read (hundreds of levels of [ or {): not a prompt row"


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in bounded_lines(f, MAX_LINE_BYTES):
            loc = f"line {lineno}"
            if raw is None:
                yield loc, _RowError(None, f"a line longer than {MAX_LINE_BYTES >> 20} MiB: no prompt row needs one")
                continue
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield loc, _RowError(None, f"not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            try:
                yield loc, json.loads(text)
            except json.JSONDecodeError as e:
                yield loc, _RowError(None, f"invalid JSON: {e.msg} (column {e.colno})")
            except RecursionError:
                yield loc, _RowError(None, NESTED_TOO_DEEPLY)


def _read_json_array(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise DataError(path, f"invalid JSON: {e.msg} (column {e.colno})", location=f"line {e.lineno}") from e
    except UnicodeDecodeError as e:
        raise DataError(path, f"not valid UTF-8 ({e.reason} at byte {e.start})") from e
    except RecursionError:
        raise DataError(path, NESTED_TOO_DEEPLY) from None
    if not isinstance(rows, list):
        raise DataError(path, f"expected a JSON array of objects or JSON lines, got a {_type_name(rows)}")
    for i, row in enumerate(rows):
        yield f"row {i}", row


def _columns(spec: _Spec, names: list[str]) -> list[str] | None:
    """The top-level columns the spec needs, or None (all) if some are not plain columns."""
    if spec.all_extras:
        return None
    cols = []
    for p in [spec.prompt_field, spec.answer_field, *(p for _, p in spec.extras)]:
        if p is None:
            continue
        col = p if p in names else p.split(".", 1)[0]
        if col not in names:
            return None  # let the row check name the missing field
        if col not in cols:
            cols.append(col)
    return cols


def _read_parquet(path: Path, spec: _Spec) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: {_DATA_HINT}") from e
    i = 0
    try:
        pf = pq.ParquetFile(path)
        cols = _columns(spec, pf.schema_arrow.names)
        for batch in pf.iter_batches(batch_size=1024, columns=cols):
            for row in batch.to_pylist():
                yield f"row {i}", row
                i += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(path, f"cannot read Parquet file: {e}", location=f"row {i}" if i else None) from e


def _read_datasets_dir(path: Path, spec: _Spec, split: str | None) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"reading {path} needs the datasets library: {_DATA_HINT}") from e
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(path, f"cannot load the datasets folder: {type(e).__name__}: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if split is None:
            if len(splits) != 1:
                raise DataError(path, f"holds splits {', '.join(splits)}: pass split=...")
            split = splits[0]
        if split not in ds:
            raise DataError(path, f"no split {split!r}{did_you_mean(split, splits)}; splits: {', '.join(splits)}")
        ds = ds[split]
    elif split is not None:
        raise DataError(path, f"split={split!r} given, but the folder holds a single Dataset (no splits)")
    yield from _dataset_rows(ds, spec)


DATASETS_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


def _shard_split(rel: Path) -> str | None:
    """The split a shard's relative path names, by the hub's layout: a folder named after the
    split (``train/part-0.jsonl``) or a file name ``<split>-...`` / ``<split>_...`` / ``<split>.ext``."""
    for part in rel.parent.parts:
        if part in KNOWN_SPLITS:
            return part
    stem = rel.name.split(".", 1)[0]
    for sep in ("-", "_"):
        head = stem.split(sep, 1)[0]
        if head in KNOWN_SPLITS:
            return head
    return None


KNOWN_SPLITS = ("train", "test", "validation", "valid", "dev", "eval")


def shard_files(path: Path, split: str | None) -> list[Path]:
    """The JSONL / Parquet shards under folder ``path`` (recursively, sorted by relative path),
    those of ``split`` only when given. Shards named after more than one split need ``split``."""
    shards = sorted((f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in JSONL_SUFFIXES + PARQUET_SUFFIXES
                     and not any(p.startswith(".") for p in f.relative_to(path).parts)),
                    key=lambda f: f.relative_to(path).as_posix())
    if not shards:
        raise DataError(path, "a directory with no shards (no "
                              f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} files) and not a datasets folder "
                              f"(none of {', '.join(DATASETS_MARKERS)} found)")
    by_split: dict[str | None, list[Path]] = {}
    for f in shards:
        by_split.setdefault(_shard_split(f.relative_to(path)), []).append(f)
    named = [s for s in by_split if s is not None]
    if split is None:
        if len(named) > 1:
            raise DataError(path, f"holds shards of splits {', '.join(sorted(named))}: pass split=... (data.split)")
        return shards
    if split not in by_split:
        raise DataError(path, f"no shards of split {split!r}{did_you_mean(split, named)}; "
                              f"splits: {', '.join(sorted(named)) or 'none (no shard is named after a split)'}")
    return by_split[split]


def _read_shards(path: Path, spec: _Spec, split: str | None) -> Iterator[tuple[Path, str, Any]]:
    for shard in shard_files(path, split):
        for loc, row in _read_file(shard, spec):
            yield shard, loc, row


def looks_like_hub_id(text: str) -> bool:
    """``name`` or ``owner/name`` of hub-id characters (no path syntax such as ``./`` or ``~``),
    not ending in a data file's suffix (a missing ``train.jsonl`` is a missing file)."""
    return (re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", text) is not None
            and Path(text).suffix.lower() not in JSONL_SUFFIXES + PARQUET_SUFFIXES)


def _read_hub(hub_id: str, spec: _Spec, split: str | None, name: str | None) -> Iterator[tuple[str, Any]]:
    """Rows of hub data set ``hub_id`` (subset ``name``) via ``datasets.load_dataset``; ``split``
    is required, as a hub data set almost always has several."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"loading the hub data set {hub_id} needs the datasets library: {_DATA_HINT}") from e
    if split is None:
        raise DataError(hub_id, "no such file or directory; read as a datasets hub id, it needs a split "
                                "(data.split, e.g. train)")
    from cispo.foundations.hub import hub_unreachable, offline_datasets

    try:
        with offline_datasets(hub_id):
            ds = datasets.load_dataset(hub_id, name=name, split=split)
    except Exception as e:
        offline = hub_unreachable()
        raise DataError(hub_id, f"no such file or directory, and datasets.load_dataset failed: "
                                f"{type(e).__name__}: {e}" + (f" (the hub cannot be reached: {offline}; only "
                                                              f"datasets' cache was read)" if offline else "")) from e
    yield from _dataset_rows(ds, spec)


def _rows(path: Path, spec: _Spec, split: str | None, name: str | None = None) -> Iterator[tuple[Path | str, str, Any]]:
    """``(file or shard or hub id, location, row)`` of every row of ``path``."""
    if not path.exists():
        if looks_like_hub_id(str(path)):
            return ((str(path), loc, row) for loc, row in _read_hub(str(path), spec, split, name))
        raise DataError(path, "no such file or directory")
    if name is not None:
        raise DataError(path, f"name={name!r} (a hub data set's subset) does not apply to a local file or folder")
    if path.is_dir():
        if any((path / m).exists() for m in DATASETS_MARKERS):
            return ((path, loc, row) for loc, row in _read_datasets_dir(path, spec, split))
        return _read_shards(path, spec, split)
    if split is not None:
        raise DataError(path, f"split={split!r} only applies to a datasets folder (save_to_disk), a folder of shards "
                              "or a hub id")
    return ((path, loc, row) for loc, row in _read_file(path, spec))


def _read_file(path: Path, spec: _Spec) -> Iterator[tuple[str, Any]]:
    if not stat.S_ISREG(path.stat().st_mode):  # /dev/zero would be read until memory runs out; a FIFO blocks
        raise DataError(path, "not a regular file (a device, FIFO or socket, perhaps behind a symlink): give a data "
                              "file or folder")
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(path, spec)
    if suffix in JSONL_SUFFIXES:
        if suffix == ".json":
            with open(path, "rb") as f:
                head = f.read(4096).lstrip().lstrip(b"\xef\xbb\xbf").lstrip()
            if head.startswith(b"["):
                return _read_json_array(path)
        return _read_jsonl(path)
    raise DataError(path, f"unknown file type {path.suffix or '(no extension)'!r}: expected "
                          f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} or a datasets folder (save_to_disk)")


def load_prompts_with_report(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    extra_fields: Sequence[str] | Literal["all"] | None = None,
    split: str | None = None,
    limit: int | None = None,
    on_error: Literal["raise", "skip"] = "raise",
    name: str | None = None,
) -> tuple[list[dict], LoadReport]:
    """`load_prompts`, plus a `LoadReport` of the rows read and skipped."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    spec = _make_spec(prompt_field, answer_field, extra_fields)
    path = Path(path).expanduser()
    report = LoadReport(path=str(path))
    samples: list[dict] = []
    unanswered: list[tuple[int, Path | str, str, dict]] = []  # (sample index, where, location, row)

    def bad_row(where, loc, e: _RowError) -> None:
        err = DataError(where, e.reason, location=loc, field=e.field)
        if on_error == "raise":
            raise err from None
        report.skipped += 1
        if len(report.errors) < MAX_REPORTED_ERRORS:
            report.errors.append(str(err))

    for where, loc, row in _rows(path, spec, split, name):
        if limit is not None and len(samples) >= limit:
            break
        report.rows += 1
        try:
            if isinstance(row, _RowError):
                raise row
            sample = _convert(row, spec)
        except _RowError as e:
            bad_row(where, loc, e)
            continue
        if spec.answer_field is not None and "answer" not in sample:  # the default field, absent here
            unanswered.append((len(samples), where, loc, row))
        samples.append(sample)
    if unanswered and len(unanswered) < len(samples):  # other rows have an answer: these rows lack theirs
        for _, where, loc, row in unanswered:
            try:
                _get(row, spec.answer_field, "answer")
            except _RowError as e:
                bad_row(where, loc, _RowError(e.field, f"{e.reason}; other rows have one"))
        dropped = {i for i, *_ in unanswered}
        samples = [s for i, s in enumerate(samples) if i not in dropped]
    report.loaded = len(samples)
    if not samples:
        if report.rows == 0:
            raise DataError(path, "no rows (the file is empty)")
        raise DataError(path, f"no usable samples: all {report.rows} rows were skipped; first errors:\n  "
                              + "\n  ".join(report.errors))
    return samples, report


def load_prompts(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    extra_fields: Sequence[str] | Literal["all"] | None = None,
    split: str | None = None,
    limit: int | None = None,
    on_error: Literal["raise", "skip"] = "raise",
    name: str | None = None,
) -> list[dict]:
    """Samples ``{"prompt": str, "answer": str, **extra}`` from a JSONL / Parquet file or a
    ``datasets`` folder (see the module docstring).

    Args:
        path: the file or folder.
        prompt_field: field (or dotted path) holding the prompt text or chat message list.
        answer_field: field (or dotted path) holding the answer, required in every row (the
            default ``"answer"`` may be missing from all of them); None for rewards that need
            no answer (then samples have no ``answer``).
        extra_fields: None, a list of more fields to pass on to the reward, or ``"all"``
            (every column but the prompt's, under its own name).
        split: the split of a DatasetDict folder, of a shard folder, or of a hub data set.
        limit: keep at most this many samples (stops reading there).
        on_error: ``"raise"`` at the first bad row (`DataError`), or ``"skip"`` bad rows
            (logged as a warning; see `load_prompts_with_report` for the counts).
        name: the subset (configuration) of a hub data set.
    """
    samples, report = load_prompts_with_report(path, prompt_field, answer_field, extra_fields, split, limit, on_error,
                                               name)
    if report.skipped:
        logger.warning("%s", report)
    return samples


def read_rows(path: str | Path, split: str | None = None) -> Iterator[tuple[str, str, Any]]:
    """``(file, location, row)`` of every row of a JSONL / Parquet file, a ``datasets`` folder or a folder of
    shards, read as `load_prompts` reads them (``location``: ``line N`` / ``row N``), each row as it is (every
    column), for readers of other row formats (``cispo sft``'s chats). A line that cannot be decoded is a
    `DataError` naming the file and the line."""
    spec = _Spec("messages", None, (), True)
    for where, loc, row in _rows(Path(path).expanduser(), spec, split):
        if isinstance(row, _RowError):
            raise DataError(where, row.reason, location=loc, field=row.field)
        yield str(where), loc, row


def _dataset_rows(ds, spec):
    """``("row i", row dict)`` for each row of a `datasets.Dataset`, reading only the columns
    ``spec`` needs (all when it names none), 1,024 rows at a time."""
    cols = _columns(spec, list(ds.column_names))
    if cols is not None:
        ds = ds.select_columns(cols)
    i = 0
    for table in ds.with_format("arrow").iter(batch_size=1024):
        for row in table.to_pylist():
            yield f"row {i}", row
            i += 1
