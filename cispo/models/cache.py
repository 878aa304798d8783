"""The model cache: folders of models made on this machine (the built-in tasks' pretrained base models,
packaged models converted once), under ``$CISPO_CACHE``, else ``$XDG_CACHE_HOME/cispo``, else
``~/.cache/cispo``, that verify themselves.

A folder is written into a temporary sibling (its owner's host and pid in the name, a ``flock`` held),
sealed (every file's SHA-256 in ``SHA256SUMS``, then its size in ``cispo-cache.json``, written last) and
renamed into place. On load (`cached_model`) every recorded file must be there with its size, every
``.safetensors`` header must read, and every file must match its hash (once per process); a damaged
folder is discarded and made again. A dead writer's temporary folder is removed at the next write.
``SHA256SUMS`` is also the format of the shipped copies' checksums (`verify_checksums`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from cispo.config.engine import ConfigError

CHECKSUMS = "SHA256SUMS"
"""``sha256sum``-format file (``<hex>  <name>`` per line) beside the shipped files."""
CACHE_RECORD = "cispo-cache.json"
"""Written last into a cache folder, before it is renamed into place: ``{"version": 1, "bytes": {file:
size}}`` for the same files as its ``SHA256SUMS``. A folder without it is either from before records were
kept (`_is_complete`: checked, then recorded once) or not cispo's."""
STALE_HOURS = 24
"""A temporary folder whose owner cannot be asked (another machine's, or an older cispo's without
its owner in the name) is removed once untouched for this long."""


class ChecksumError(RuntimeError):
    """A shipped model file is missing or differs from its recorded SHA-256."""


class ModelCacheError(ConfigError):
    """A model cache folder cannot be used, repaired or written; the message names the path and what
    to do (one line from the CLI, exit status 2)."""


def cache_root(cache_dir=None) -> Path:
    """``cache_dir`` or ``$CISPO_CACHE`` or ``$XDG_CACHE_HOME/cispo`` or ``~/.cache/cispo``."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("CISPO_CACHE"):
        return Path(os.environ["CISPO_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "cispo"


def _is_complete(path: Path) -> bool:
    """Whether ``path`` holds a model the way cispo cached it before records were kept (config,
    tokenizer, weights)."""
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file() and any(
        path.glob("*.safetensors"))


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_checksums(folder) -> dict[str, str]:
    """``{file name: sha256 hex}`` from ``folder/SHA256SUMS``."""
    path = Path(folder) / CHECKSUMS
    out = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise ChecksumError(f"{path}, line {i}: expected '<sha256>  <file name>', got {line!r}")
        out[name] = digest
    return out


def write_checksums(folder, names) -> None:
    """``folder/SHA256SUMS`` for ``names`` (paths relative to ``folder``), in ``sha256sum`` format
    (``sha256sum -c SHA256SUMS`` checks it by hand); written whole or not at all."""
    folder = Path(folder)
    _write_atomic(folder / CHECKSUMS, "".join(f"{file_sha256(folder / n)}  {n}\n" for n in names))


def _write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text``: written to a dot-file beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def verify_checksums(folder) -> None:
    """Raise `ChecksumError` unless every file of ``SHA256SUMS`` exists with that digest."""
    folder = Path(folder)
    recorded = read_checksums(folder)
    if "model.safetensors" not in recorded:
        raise ChecksumError(f"{folder / CHECKSUMS}: no entry for model.safetensors")
    for name, digest in recorded.items():
        if not (folder / name).is_file():
            raise ChecksumError(f"{folder / name}: missing (listed in {CHECKSUMS})")
        actual = file_sha256(folder / name)
        if actual != digest:
            raise ChecksumError(f"{folder / name}: SHA-256 {actual} differs from the recorded {digest} "
                                f"({folder / CHECKSUMS}); reinstall cispo or run `cispo pretrain` to rebuild")


# --------------------------------------------------------------------------- cache records
#
# A model is written into the cache through a temporary folder beside its place (`staging_folder`),
# checked (finite weights), recorded (`seal_cache_folder`: SHA256SUMS, then cispo-cache.json with the
# sizes) and renamed into place (`install_cache_folder`). Every load checks it against those records
# (`cached_model`); what is damaged is removed and made again, what cispo did not write is named and
# left alone.


def _recorded_files(folder: Path) -> list[str]:
    """Every file under ``folder`` except its records and dot-files (which no loader reads, and which
    NFS and editors leave), as sorted relative paths."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            rel = Path(root, name).relative_to(folder).as_posix()
            if not name.startswith(".") and rel not in (CHECKSUMS, CACHE_RECORD):
                out.append(rel)
    return sorted(out)


def nonfinite_tensors(named) -> list[str]:
    """The names of the floating-point tensors of ``named`` (pairs of name and tensor, such as
    ``model.named_parameters()``) that hold a NaN or an infinity. `torch.aminmax` propagates NaN, so two
    numbers per tensor say it (~0.2 s for SmolLM2-135M's 538 MB, ~20x faster than ``isfinite().all()``)."""
    bad = []
    for name, t in named:
        t = t.detach()
        if t.is_floating_point() and t.numel() and not torch.isfinite(torch.stack(torch.aminmax(t))).all():
            bad.append(name)
    return bad


def _safetensors_tensors(folder: Path, names):
    """``(name, tensor)`` for every tensor of the ``.safetensors`` files among ``names``, one at a time."""
    from safetensors import safe_open

    for name in names:
        if name.endswith(".safetensors"):
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield key, f.get_tensor(key)


def safetensors_problem(folder: Path, names) -> str | None:
    """Why a ``.safetensors`` file among ``names`` cannot be read, or None. ``safetensors.safe_open`` reads
    the header and checks that the file holds exactly the bytes it lists (so a truncated file fails)."""
    from safetensors import SafetensorError, safe_open

    for name in names:
        if name.endswith(".safetensors"):
            try:
                with safe_open(str(folder / name), framework="pt") as f:
                    f.keys()
            except (OSError, SafetensorError) as e:
                return f"{name} cannot be read: {e}"
    return None


def seal_cache_folder(folder) -> None:
    """Record every file of ``folder`` (a model about to be renamed into the cache, or one cached before
    records were kept): its SHA-256 in ``SHA256SUMS``, then its size in ``cispo-cache.json``, last."""
    folder = Path(folder)
    names = _recorded_files(folder)
    write_checksums(folder, names)
    sizes = {name: (folder / name).stat().st_size for name in names}
    _write_atomic(folder / CACHE_RECORD, json.dumps({"version": 1, "bytes": sizes}, indent=1) + "\n")


_VERIFIED: dict[str, tuple] = {}
"""Cache folders whose every file matched its SHA-256 in this process, with the files' ``stat`` then:
a later load of an unchanged folder costs a ``stat`` per file."""


def _stat_key(folder: Path, names) -> tuple:
    """Size, times and inode of ``names`` and the records: any write to a file changes them."""
    out = []
    for name in (*names, CHECKSUMS, CACHE_RECORD):
        st = os.stat(folder / name)
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(out)


def cache_problem(folder) -> str | None:
    """Why the cache folder ``folder`` (one with ``cispo-cache.json``) cannot be trusted, or None. Each
    recorded file must be there, a plain file of its recorded size; every ``.safetensors`` header must
    read; and every file must match its recorded SHA-256 — hashed once per process (538 MB: ~0.5 s),
    then trusted while the files' size, times and inode stay the same."""
    folder = Path(folder)
    try:  # each record read on its own, so a damaged one is named (not the files it describes)
        sizes = json.loads((folder / CACHE_RECORD).read_text())["bytes"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its record {CACHE_RECORD} cannot be read ({type(e).__name__}: {e})"
    try:
        sums = read_checksums(folder)
    except (OSError, ValueError, ChecksumError) as e:
        return f"its record {CHECKSUMS} cannot be read ({type(e).__name__}: {e})"
    if not isinstance(sizes, dict) or set(sizes) != set(sums):
        return f"{CACHE_RECORD} and {CHECKSUMS} do not list the same files"
    for name in sorted(sizes):
        try:
            st = os.lstat(folder / name)
        except OSError as e:
            return f"{name} is missing" if e.errno == errno.ENOENT else f"{name} cannot be read ({e.strerror})"
        if not stat.S_ISREG(st.st_mode):  # a symlink, folder or device
            return f"{name} is not a plain file"
        if st.st_size != sizes[name]:
            return f"{name} is {st.st_size} bytes, {sizes[name]} in {CACHE_RECORD} (the file or its record changed)"
    problem = safetensors_problem(folder, sorted(sizes))
    if problem:
        return problem
    try:
        key = _stat_key(folder, sorted(sizes))
        if _VERIFIED.get(str(folder)) == key:
            return None
        for name, digest in sums.items():
            if file_sha256(folder / name) != digest:
                return f"{name} differs from its SHA-256 in {CHECKSUMS} (the file or its record changed)"
    except OSError as e:  # removed meanwhile (another process found it damaged), unreadable
        return f"{Path(e.filename or folder).name} cannot be read ({e.strerror})"
    _VERIFIED[str(folder)] = key
    return None


def legacy_problem(folder) -> str | None:
    """Why a cache folder from before records were kept (no ``cispo-cache.json``) cannot be used, or
    None: ``config.json`` must read as JSON, every ``.safetensors`` header must read and every weight be
    finite (what can be checked without records: ~0.2 s for 538 MB)."""
    folder = Path(folder)
    names = _recorded_files(folder)
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"config.json cannot be read ({e})"
    problem = safetensors_problem(folder, names)
    if problem:
        return problem
    bad = nonfinite_tensors(_safetensors_tensors(folder, names))
    return f"{len(bad)} weight tensor(s) hold NaN or infinite values (first: {bad[0]})" if bad else None


def _stray_files(folder: Path) -> list[str]:
    """Files in a recorded cache folder that its records do not list (dot-files aside)."""
    try:
        recorded = set(json.loads((folder / CACHE_RECORD).read_text())["bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return []  # unreadable records: `cache_problem` says so
    return [name for name in _recorded_files(folder) if name not in recorded]


def _foreign(folder: Path) -> str | None:
    """What is at ``folder`` when it is not a cache folder cispo wrote (or nothing, or an empty folder),
    else None."""
    if not os.path.lexists(folder):
        return None
    if not folder.is_dir():
        return "a symlink that leads nowhere (a loop or a missing target)" if folder.is_symlink() else "a file"
    if (folder / CACHE_RECORD).is_file() or _is_complete(folder) or not any(folder.iterdir()):
        return None
    return f"a folder without {CACHE_RECORD} (not written by cispo)"


def _refuse_foreign(folder: Path) -> None:
    """`ModelCacheError` naming what is at ``folder`` if cispo did not write it: never deleted."""
    what = _foreign(folder)
    if what:
        raise ModelCacheError(f"{folder}: {what} is where cispo caches this model, and cispo removes only "
                              "what it wrote: move it away, or set CISPO_CACHE to another folder")


def cached_model(folder, redo: str) -> bool:
    """Whether ``folder`` holds an intact cached model to load (`cache_problem`; `legacy_problem` for one
    cached before records were kept, whose records are then written once, where the cache is writable).
    A damaged one is removed, with one line on stderr ("<folder>: damaged (why); <redo>"), and False
    returned, as when there is none. `ModelCacheError` naming the path for what cispo did not write: at
    ``folder``, or as a file in it that its records do not list (such as a ``chat_template.jinja``,
    which would change how the model loads); and for a damaged folder that cannot be removed."""
    folder = Path(folder)
    if not os.path.lexists(folder):
        return False
    _refuse_foreign(folder)
    if not any(folder.iterdir()):
        return False
    if (folder / CACHE_RECORD).is_file():
        stray = _stray_files(folder)
        if stray:
            raise ModelCacheError(f"{folder / stray[0]}: a file cispo did not write is in the cached model's "
                                  "folder, where it could change how the model loads: move it away")
        problem = cache_problem(folder)
    else:
        problem = legacy_problem(folder)
        if problem is None:
            try:
                seal_cache_folder(folder)
            except OSError:
                pass  # a read-only cache: checked the same way at every load
    if problem is None:
        return True
    print(f"cispo: {folder}: damaged ({problem}); {redo}", file=sys.stderr)
    discard_cache_folder(folder)
    return False


def discard_cache_folder(folder: Path) -> None:
    """Move ``folder`` aside (to a temporary name beside it, so that no process loads it half deleted)
    and delete it. `ModelCacheError` naming it when it cannot be."""
    if folder.is_symlink():
        raise ModelCacheError(f"{folder}: a symlink to {os.readlink(folder)}, which cispo does not remove: "
                              "repair or remove it, or set CISPO_CACHE to another folder")
    try:
        trash = Path(tempfile.mkdtemp(prefix=_temp_prefix(folder), dir=folder.parent))
    except OSError as e:
        raise ModelCacheError(f"{folder}: cannot be removed ({e.strerror}): remove it by hand, or set "
                              "CISPO_CACHE to a writable folder") from None
    try:
        os.replace(folder, trash)
    except OSError as e:
        os.rmdir(trash)
        if e.errno == errno.ENOENT:
            return  # another process removed it meanwhile
        raise ModelCacheError(f"{folder}: cannot be removed ({e.strerror}): remove it by hand, or set "
                              "CISPO_CACHE to a writable folder") from None
    shutil.rmtree(trash, ignore_errors=True)


# --------------------------------------------------------------------------- writing into the cache

_OWNED = re.compile(r"\.tmp-(?P<host>[^-]+)-(?P<pid>\d+)-[a-z0-9_]{8}")
"""The name of a temporary folder after ``.<model folder name>``: its machine and process."""
_UNOWNED = re.compile(r"(\.tmp)?-[a-z0-9_]{8}")
"""The same, as cispo named them before their owner was recorded."""


def _host() -> str:
    """This machine's name, as it stands in a temporary folder's name."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def _temp_prefix(folder: Path) -> str:
    """``.<name>.tmp-<host>-<pid>-``: a temporary folder beside ``folder`` names its owner."""
    return f".{folder.name}.tmp-{_host()}-{os.getpid()}-"


def _lock_free(path: Path) -> bool | None:
    """Whether no process holds ``path``'s ``flock`` (None: the file system cannot tell)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)


def _running(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (in this pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def remove_dead_temps(folder) -> list[Path]:
    """Remove the temporary folders beside ``folder`` that conversions into it left when they died
    (``kill -9``, a power cut); return them. One of this machine is dead when the process its name
    gives is not running and its ``flock`` is free (its writer holds the lock while it lives; the kernel
    drops it when the writer dies, so a reused pid or a process in another pid namespace cannot fool
    it). One whose owner cannot be asked (another machine's, an older cispo's without its owner in the
    name, a file system without ``flock``) is removed once untouched for `STALE_HOURS`."""
    folder = Path(folder)
    stem, removed = f".{folder.name}", []
    try:
        entries = [p for p in folder.parent.iterdir() if p.name.startswith(stem)]
    except OSError:
        return removed
    for path in entries:
        rest = path.name[len(stem):]
        owned = _OWNED.fullmatch(rest)
        if not (owned or _UNOWNED.fullmatch(rest)) or path.is_symlink() or not path.is_dir():
            continue
        if owned and owned["host"] == _host():
            if _running(int(owned["pid"])):
                continue
            free = _lock_free(path)
            if free is False:
                continue
        else:
            free = None
        if free is None:
            try:
                if time.time() - path.stat().st_mtime < STALE_HOURS * 3600:
                    continue
            except OSError:
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _make_cache_dir(models: Path) -> None:
    """``models`` (``<cache>/models``) made if need be. `ModelCacheError` naming the first path on the
    way that is not a folder (a file, a symlink loop), or saying why it cannot be made."""
    try:
        models.mkdir(parents=True, exist_ok=True)
        return
    except OSError as e:
        error = e
    for path in (*reversed(models.parents), models):
        if os.path.lexists(path) and not path.is_dir():
            what = "a symlink that leads nowhere (a loop or a missing target)" if path.is_symlink() else "a file"
            raise ModelCacheError(f"{path}: {what}, where the model cache {models} needs a folder; "
                                  "set CISPO_CACHE to a writable folder")
    raise ModelCacheError(f"cannot make the model cache {models} ({error.strerror or error}); "
                          "set CISPO_CACHE to a writable folder")


@contextmanager
def staging_folder(folder):
    """A new temporary folder beside ``folder`` to write a model into, held (``flock``) while the block
    runs and removed after it unless renamed into place. Before any long work: the cache folder must be a
    folder cispo can write into and nothing that cispo did not write may be at ``folder``
    (`ModelCacheError` naming the path and what to do), and the temporary folders of dead conversions
    beside it are removed (`remove_dead_temps`)."""
    folder = Path(folder)
    _make_cache_dir(folder.parent)
    _refuse_foreign(folder)
    remove_dead_temps(folder)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(folder), dir=folder.parent))
    except OSError as e:
        raise ModelCacheError(f"{folder.parent}: cannot write into the model cache ({e.strerror}); "
                              "set CISPO_CACHE to a writable folder") from None
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # no flock here: removed after STALE_HOURS if this process dies
        yield tmp
    finally:
        os.close(fd)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def install_cache_folder(tmp, folder, what: str, replace: bool = False) -> None:
    """Check the model written into ``tmp`` (every weight finite: `ModelCacheError` naming ``what``
    otherwise, and nothing is cached), record its files (`seal_cache_folder`) and rename it to
    ``folder``. With ``replace`` the folder there is removed first; otherwise a folder another process
    cached meanwhile is kept and this one dropped."""
    tmp, folder = Path(tmp), Path(folder)
    bad = nonfinite_tensors(_safetensors_tensors(tmp, _recorded_files(tmp)))
    if bad:
        raise ModelCacheError(f"{what}: {len(bad)} weight tensor(s) hold NaN or infinite values (first: "
                              f"{bad[0]}); nothing was cached in {folder}")
    seal_cache_folder(tmp)
    if replace and os.path.lexists(folder):
        _refuse_foreign(folder)
        discard_cache_folder(folder)
    try:
        os.replace(tmp, folder)
    except OSError as e:
        if (folder / CACHE_RECORD).is_file() or _is_complete(folder):
            return  # another process cached it meanwhile: keep theirs
        raise ModelCacheError(f"cannot move the new model into {folder} ({e.strerror}); move away what is "
                              "there, or set CISPO_CACHE to another folder") from None
