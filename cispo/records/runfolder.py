"""The run folder ``out_dir/run_name``: what makes a folder a run, and the config a resumed run
continues with.

* ``run_name`` is a plain folder name: not absolute, no path separator, not ``.`` or ``..``.
* Every run folder cispo creates gets a marker file, ``.cispo-run`` (JSON: ``version``,
  ``created``). ``--overwrite`` deletes only a folder that has it and that lies directly in
  ``out_dir`` once symlinks are resolved; anything else is refused and nothing is deleted.
* One process per run folder (`run_lock`): the lock is keyed by the folder, so two names of one
  folder (a symlink to it, a symlinked ``out_dir``) meet the same lock; a lock file that is a
  symlink, a hard link or someone else's file is refused, never written through.
* A resumed run is the same run: the saved ``config.yaml`` is reloaded, and a value given
  with ``--resume`` must equal the saved one unless its key is in ``RESUME_SAFE_FIELDS``
  (``ConfigError`` naming each key with both values otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from cispo.config.train import ConfigError, TrainConfig, apply_overrides, from_dict, load_yaml, save_yaml, to_dict

MARKER = ".cispo-run"
SUMMARY = "summary.json"  # written by the trainer when a run ends: its presence marks the run finished
MARKER_VERSION = 1
MAX_RUN_NAME = 200  # bytes: a name of up to 255, less ".<name>.lock" and ".tmp-" prefixes

RESUME_SAFE_FIELDS = {
    "steps": "train for longer (or stop sooner)",
    "checkpoint_every": "when checkpoints are written",
    "keep_checkpoints": "how many are kept",
    "max_bad_steps": "when a diverging run stops",
    "threads": "CPU threads",
    "progress": "the progress bar",
    "trackers": "metric sinks besides metrics.jsonl",
    "out_dir": "where the run folder is (it may have been moved)",
    "run_name": "its name (it located the folder)",
    "model.device": "where it runs (bit-identical continuation needs the same device)",
    "eval.every": "when the held-out set is evaluated",
    "eval.num_samples": "samples per held-out prompt",
    "eval.temperature": "temperature of the held-out samples",
    "log_samples_every": "how often completions are saved to samples.jsonl",
    "max_samples_per_step": "how many are saved",
    "samples_max_chars": "where their texts are cut",
    "samples_max_mb": "the size bound of samples.jsonl",
}
"""Keys whose value may change when a run is resumed: none of them changes the training
trajectory (prompts, sampling, objective, optimizer). Everything else must equal the saved
``config.yaml``. ``data.num_eval_prompts`` is *not* here: with a data file it sets how many
of its rows are held out, hence the training prompts."""

RESOLVED_AT_START = {"rollout.max_new_tokens": None, "model.chat_template": "auto"}
"""Keys whose value here (``None``, ``auto``) is resolved when the run starts (``config.yaml`` has
the resolved value): on resume it matches whatever was saved, and the saved value is used
(`keep_resolved`): a run saved with ``model.chat_template: false`` (the default before ``auto``)
resumes with false."""


def run_name(cfg: TrainConfig, recipe: str | None = None) -> str:
    """``cfg.run_name``, or ``{objective}__{task or data file}__seed{seed}`` (``{recipe}__...`` for a run
    started with ``recipe=NAME``, whose name `cispo train` then sets as ``run_name``)."""
    data = Path(cfg.data.path).stem if cfg.data.path else cfg.data.task
    return cfg.run_name or f"{recipe or cfg.algo.objective.name}__{data}__seed{cfg.seed}"


def check_run_name(name: str) -> str:
    """``name`` if it is a plain folder name, else ``ConfigError``."""
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if not name or name in (".", "..") or any(s in name for s in separators) or "\0" in name:
        raise ConfigError(f"run_name={name!r}: must be a plain folder name (no '/', not '..', not absolute): "
                          f"the run folder is out_dir/run_name")
    if len(name.encode()) > MAX_RUN_NAME:
        raise ConfigError(f"run_name is {len(name.encode())} bytes long ({name[:40]!r}...); at most {MAX_RUN_NAME} "
                          f"(file systems allow 255 per name, and the run's lock and temporary files add to it)")
    return name


def run_dir_of(cfg: TrainConfig) -> Path:
    """``out_dir/run_name`` (the name checked)."""
    return Path(cfg.out_dir).expanduser() / check_run_name(run_name(cfg))


def is_run_folder(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


RUN_OWN_FILES = ("metrics.jsonl", "samples.jsonl", "config.yaml", SUMMARY, "meta.json", MARKER, "checkpoints")
"""Files (and the folder) a run writes into its run folder."""


def run_folder_of(path: Path) -> Path | None:
    """The run folder that ``path`` (symlinks resolved) lies in, else None: the nearest folder above
    it that is marked, or, from before the marker, holds ``config.yaml`` beside ``metrics.jsonl``;
    also the folder of a file named as a run's own (``metrics.jsonl``, ``config.yaml``, ...) beside
    ``metrics.jsonl``, ``summary.json`` or ``checkpoints/`` (an unmarked run, a copied one). For
    writers from outside a run (``cispo eval --samples``), which must not replace a run's files nor
    put theirs where ``--overwrite`` deletes them. (A lone ``config.yaml`` proves nothing: projects
    keep theirs in the folder they write to.)"""
    real = Path(path).expanduser().resolve()
    beside = [real.parent / n for n in ("metrics.jsonl", SUMMARY, "checkpoints") if n != real.name]
    if real.name in RUN_OWN_FILES and any(p.exists() for p in beside):
        return real.parent
    for folder in real.parents:
        if is_run_folder(folder) or ((folder / "config.yaml").is_file() and (folder / "metrics.jsonl").is_file()):
            return folder
    return None


def is_finished(run_dir: Path) -> bool:
    """Whether the run in `run_dir` ran to its end (the trainer writes `SUMMARY` last); a folder
    without it is still running or was stopped."""
    return (Path(run_dir) / SUMMARY).exists()


def write_marker(run_dir: Path) -> None:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (run_dir / MARKER).write_text(json.dumps({"version": MARKER_VERSION, "created": created}) + "\n")


class RunFolderInUse(FileExistsError):
    """Another process holds the run folder's lock."""


class RunFolderUnwritable(FileExistsError):
    """The run folder or its out_dir cannot be written, or its lock file is not one cispo may rewrite."""


LOCK_START = b'{"pid": '
"""How every lock file cispo writes begins (``json.dumps`` of its holder)."""


def lock_path(run_dir: Path) -> Path:
    """The lock file of ``run_dir`` by its name: beside it in ``out_dir`` (``.<run_name>.lock``), so that it
    outlives an ``--overwrite`` that deletes and re-creates the folder."""
    return Path(run_dir).parent / f".{Path(run_dir).name}.lock"


def lock_paths(run_dir: Path) -> list[Path]:
    """The lock files a run on ``run_dir`` holds: its name's and, when ``run_dir`` is a symlink
    (``runs/alias -> runs/victim``), the one of the folder it resolves to (``runs/.victim.lock``), so
    that every name of one folder meets one lock. (A symlinked ``out_dir`` already leads to the same
    file; a plain folder has one lock, where it always was.)"""
    run_dir = Path(run_dir)
    try:
        real = lock_path(run_dir.resolve())
    except (OSError, RuntimeError):  # a symlink loop: the name's lock is taken, and the run fails at its mkdir
        return [lock_path(run_dir)]
    if real == lock_path(run_dir.parent.resolve() / run_dir.name) or not real.parent.is_dir():
        return [lock_path(run_dir)]  # a dangling link: no folders are made for it (the run fails at its mkdir)
    return [lock_path(run_dir), real]


def _holder(fd: int) -> dict:
    """The holder a lock file names (``{}`` when it names none)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _refuse_unsafe_lock(path: Path, st: os.stat_result) -> None:
    """``RunFolderUnwritable`` unless ``st`` is a regular file with one name: cispo rewrites its lock
    file, which through a symlink would overwrite the file it points to, through a hard link the
    other name's content, and on a FIFO or device would write into whatever reads it."""
    if stat.S_ISLNK(st.st_mode):
        raise RunFolderUnwritable(f"run lock {path} is a symbolic link (to {os.readlink(path)}): cispo rewrites its "
                                  f"lock file and would overwrite what the link points to; nothing was changed. "
                                  f"Remove the link")
    if not stat.S_ISREG(st.st_mode):
        raise RunFolderUnwritable(f"run lock {path} is not a regular file (mode {stat.filemode(st.st_mode)}); nothing "
                                  f"was changed. Remove it, or choose another run_name")
    if st.st_nlink != 1:
        raise RunFolderUnwritable(f"run lock {path} has {st.st_nlink} names (hard links): rewriting it would change "
                                  f"the other files too; nothing was changed. Remove it, or choose another run_name")


def _open_lock(path: Path) -> int:
    """A descriptor on the lock file ``path``, created if missing (never through a symlink:
    ``O_NOFOLLOW``). ``RunFolderUnwritable``: its folder is a file or cannot be written, or the file
    is not one cispo may rewrite (`_refuse_unsafe_lock`)."""
    if path.parent.exists() and not path.parent.is_dir():
        raise RunFolderUnwritable(f"out_dir {path.parent} is a file, not a folder; choose another out_dir")
    try:
        st = os.lstat(path)
    except OSError:
        st = None  # not there (or out_dir unreachable: the open below says so)
    if st is not None:
        _refuse_unsafe_lock(path, st)  # before opening: opening a device or FIFO can act on it
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink put there since the check fails (ELOOP) instead of being written through;
        # O_NONBLOCK: a FIFO put there does not wait for a reader
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            _refuse_unsafe_lock(path, os.lstat(path))
        why = os.strerror(exc.errno) if exc.errno else exc
        raise RunFolderUnwritable(f"out_dir {path.parent}: cannot create the run's lock file {path.name} "
                                  f"({why}); choose a writable out_dir") from None
    try:
        _refuse_unsafe_lock(path, os.fstat(fd))
    except RunFolderUnwritable:
        os.close(fd)
        raise
    return fd


def _take_lock(path: Path, run_dir: Path) -> int:
    """The descriptor of ``path``, exclusively locked (``flock``). ``RunFolderInUse`` naming the holder
    when another process has it; ``RunFolderUnwritable`` when the file holds something other than a
    cispo lock (a user's file of that name, which rewriting it would destroy)."""
    fd = _open_lock(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _holder(fd)
            raise RunFolderInUse(f"run folder {run_dir} is in use by another cispo process (pid {who.get('pid', '?')} "
                                 f"on {who.get('host', '?')}, since {who.get('started', '?')}); nothing was changed. "
                                 f"Wait for it to end, stop it, or choose another run_name") from None
        size = os.fstat(fd).st_size
        if size and (size > 4096 or os.pread(fd, len(LOCK_START), 0) != LOCK_START):
            raise RunFolderUnwritable(f"run lock {path} holds something other than a cispo lock (it begins "
                                      f"{os.pread(fd, 40, 0)!r}); cispo would overwrite it; nothing was changed. "
                                      f"Move it away, or choose another run_name")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_folder(run_dir: Path) -> int | None:
    """A descriptor on the run folder itself, ``flock``-ed: a lock keyed by the folder's device and
    inode, which a second path to it meets even where it does not resolve to the same place (a bind
    mount). None when the folder does not exist yet (its name locks cover it) or its file system
    has no ``flock`` on folders. ``RunFolderInUse`` when another process holds it."""
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None  # not there yet, or not a folder (prepare_run_dir says so)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunFolderInUse(f"run folder {run_dir} is in use by another cispo process, which reached it by another "
                             f"path (its lock file is not {lock_path(run_dir)}: a bind mount?); nothing was changed. "
                             f"Wait for it to end, stop it, or choose another run_name") from None
    except OSError:
        os.close(fd)
        return None
    return fd


def _write_holder(fd: int, run_dir: Path, said: set) -> None:
    """This process as the holder of the lock file ``fd`` (taken); a holder that died is said (once:
    ``said`` has the pids already named)."""
    before = _holder(fd)
    if before.get("pid") and before.get("host") == socket.gethostname() and not _alive(before["pid"]) \
            and before["pid"] not in said:
        said.add(before["pid"])
        print(f"cispo: took over the lock of {run_dir} left by pid {before['pid']} (no longer running)",
              file=sys.stderr)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n").encode(), 0)


@contextlib.contextmanager
def run_lock(run_dir: Path):
    """Hold an exclusive lock on ``run_dir`` for the block: a second process (a start, ``--resume``
    or ``--overwrite``) is refused before it touches anything, with ``RunFolderInUse`` naming the
    holder's pid. The lock is keyed by the folder, not by the name it is reached by: ``flock`` on
    every file of ``lock_paths`` (the name's, and the resolved folder's when the name is a symlink)
    and on the folder itself once it exists (`_lock_folder`). All are taken before any is written.
    The kernel drops the locks when their holder dies, so a lock file left by a dead process is
    simply taken over (and said). Not for network file systems whose ``flock`` is local to one
    machine."""
    fds: list[int] = []
    written: list[int] = []
    try:
        for path in lock_paths(run_dir):
            fds.append(_take_lock(path, run_dir))
        files = list(fds)
        folder = _lock_folder(run_dir)
        if folder is not None:
            fds.append(folder)
        said: set = set()
        for fd in files:  # only now that every lock is held: a refused process rewrites none
            _write_holder(fd, run_dir, said)
            written.append(fd)
        yield
    finally:
        for fd in written:  # released, not abandoned: the next holder has no dead process to say it took over from
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        for fd in fds:
            os.close(fd)  # releases the lock; the file stays (deleting it would race a waiting process)


def _check_deletable(out_dir: Path, run_dir: Path) -> None:
    """``FileExistsError`` unless ``run_dir`` is a marked run folder directly in ``out_dir``."""
    real = run_dir.resolve()
    if run_dir.is_symlink() or real.parent != out_dir.resolve():
        raise FileExistsError(f"--overwrite: refusing to delete {run_dir}: it resolves to {real}, which is not "
                              f"a folder directly in out_dir ({out_dir.resolve()}); nothing was deleted")
    if not is_run_folder(run_dir):
        raise FileExistsError(f"--overwrite: refusing to delete {run_dir}: it is not a cispo run folder (no "
                              f"{MARKER} file, which cispo writes into every run folder it creates); nothing was "
                              f"deleted. Choose another run_name / out_dir, or delete it yourself")


def prepare_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> Path:
    """Create (or, resuming, reuse) the run folder of ``cfg`` and make sure it is marked.

    An existing folder that holds more than the marker (a run that stopped before writing anything,
    e.g. at a model path that did not load, leaves only that: it is reused) is refused unless
    ``resume`` (it must be a run folder: marked, or with a ``config.yaml`` from before the marker
    existed) or ``overwrite`` (it is deleted if ``_check_deletable`` allows)."""
    return prepare_run_folder(Path(cfg.out_dir).expanduser(), run_dir_of(cfg), resume, overwrite)


def prepare_run_folder(out_dir: Path, run_dir: Path, resume: bool, overwrite: bool) -> Path:
    """`prepare_run_dir` for the folder ``run_dir`` in ``out_dir``, whatever its command (``cispo sft``'s too)."""
    if run_dir.is_dir() and any(p.name != MARKER for p in run_dir.iterdir()):
        if resume:
            if not is_run_folder(run_dir) and not (run_dir / "config.yaml").is_file():
                raise FileExistsError(f"--resume: {run_dir} is not a cispo run folder (no {MARKER}, no config.yaml); "
                                      f"choose another run_name / out_dir")
        elif not overwrite:
            raise FileExistsError(
                f"run folder {run_dir} already exists; pass --resume to continue it, --overwrite to start over, "
                f"or set run_name=... / out_dir=..."
            )
        else:
            _check_deletable(out_dir, run_dir)
            shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not is_run_folder(run_dir):
        write_marker(run_dir)
    return run_dir


# ---------------------------------------------------------------------------------------
# Resume: the saved config, and what may change
# ---------------------------------------------------------------------------------------


def saved_config(run_dir: Path) -> TrainConfig | None:
    """The run's ``config.yaml`` (None if it has none yet)."""
    path = Path(run_dir) / "config.yaml"
    return load_yaml(TrainConfig, path) if path.is_file() else None


def save_config(cfg: TrainConfig, run_dir: Path) -> None:
    """``config.yaml``, replaced atomically (a kill leaves the old or the new one)."""
    tmp = Path(run_dir) / ".config.yaml.tmp"
    save_yaml(cfg, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, Path(run_dir) / "config.yaml")


def _leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: data}


def _is_safe(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RESUME_SAFE_FIELDS)


def resume_changes(saved: TrainConfig, cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, new value) of each key that ``cfg`` changes although it is
    not in ``RESUME_SAFE_FIELDS``."""
    old, new = _leaves(to_dict(saved)), _leaves(to_dict(cfg))
    changes = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if a == b or _is_safe(key) or (key in RESOLVED_AT_START and b == RESOLVED_AT_START[key]):
            continue
        changes.append((key, a, b))
    return changes


def keep_resolved(saved: TrainConfig, cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with each key of ``RESOLVED_AT_START`` that it leaves unresolved set to ``saved``'s value."""
    for key, unresolved in RESOLVED_AT_START.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) == unresolved:
            value = getattr(getattr(saved, section), name)
            cfg = replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})
    return cfg


def check_resume(saved: TrainConfig, cfg: TrainConfig, run_dir: Path) -> None:
    """``ConfigError`` if ``cfg`` is not the run saved in ``run_dir`` (up to safe keys)."""
    changes = resume_changes(saved, cfg)
    if changes:
        listed = "; ".join(f"{k}: saved {a!r}, given {b!r}" for k, a, b in changes)
        raise ConfigError(f"--resume {run_dir}: a resumed run keeps its config "
                          f"({Path(run_dir) / 'config.yaml'}), but {listed}. Only these may change: "
                          f"{', '.join(RESUME_SAFE_FIELDS)}. Start a new run (another run_name) to change the "
                          f"others; if a file only moved, edit its path in config.yaml")


def _overlay(base: dict, raw: Any, given: dict) -> dict:
    """``base`` with each key that the YAML mapping ``raw`` sets taken from ``given``."""
    out = dict(base)
    for key, value in (raw or {}).items():
        if isinstance(value, dict) and isinstance(base.get(key), dict) and isinstance(given.get(key), dict):
            out[key] = _overlay(base[key], value, given[key])
        elif key in given:
            out[key] = given[key]
    return out


def resume_config(config_file: str | None, overrides: list[str]) -> TrainConfig:
    """The config of ``cispo train --resume [--config FILE] key=value ...``: the run's saved
    ``config.yaml`` with the keys that FILE sets and the overrides on top (``train`` then
    checks them against ``RESUME_SAFE_FIELDS``). A run folder without ``config.yaml`` (none yet):
    the config as given."""
    if config_file:  # the file and the command line as one configuration, checked once
        given = load_yaml(TrainConfig, config_file, overrides)
    else:
        given = apply_overrides(TrainConfig(), overrides)
    saved = saved_config(run_dir_of(given))
    if saved is None:
        return given
    if config_file:
        raw = yaml.safe_load(Path(config_file).read_text())
        cfg = from_dict(TrainConfig, _overlay(to_dict(saved), raw, to_dict(given)), source=str(config_file),
                        overrides=overrides)
    else:
        cfg = apply_overrides(saved, overrides)
    cfg = replace(cfg, out_dir=given.out_dir)  # where the folder was found
    return cfg if run_name(cfg) == run_name(given) else replace(cfg, run_name=run_name(given))
