"""The model caches: the packaged model's (``builtin:smollm2-135m``, converted from its
GGUF file) and the built-in tasks' pretrained base models. Every file's size and SHA-256 are recorded when
a model is written; a load checks them and makes a damaged model again; the cache folder's problems are
one line before the minutes of conversion; the temporary folders of a dead conversion are removed.

The 4-7 minute conversion and the pretraining are stood in for by a tiny model saved at once."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import cispo.models.cache as model_cache
import cispo.models.packaged as packaged
import cispo.models.pretrain
from cispo.data.tasks import get_task
from cispo.models.builtin import builtin_model_path, ensure_builtin_model
from cispo.models.cache import (
    CACHE_RECORD,
    CHECKSUMS,
    ModelCacheError,
    cache_problem,
    file_sha256,
    read_checksums,
    verify_checksums,
)
from cispo.models.loading import build_model, build_tokenizer, save_policy
from cispo.models.pretrain import PretrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "smollm2-135m"
CFG = PretrainConfig(model_size="tiny", seed=7)  # not the shipped config: the cache is used


def tiny(seed=0):
    """A tiny model and its tokenizer (what the stand-ins save)."""
    tok = build_tokenizer(get_task("addition").alphabet)
    return build_model(tok, "tiny", seed=seed), tok


class Cache:
    """One of the two caches with its long step stood in for; ``calls`` counts conversions."""

    def __init__(self, kind, monkeypatch, tmp_path, poison=False):
        self.kind, self.calls, self.poison = kind, [], poison
        monkeypatch.setenv("CISPO_CACHE", str(tmp_path / "cache"))
        if kind == "packaged":
            fake = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
            fake.parent.mkdir()
            fake.write_bytes(b"a stand-in for the GGUF file")
            monkeypatch.setattr(packaged, "source_file", lambda name: fake)
            monkeypatch.setitem(packaged.PACKAGED, NAME,
                                dataclasses.replace(packaged.PACKAGED[NAME], sha256=file_sha256(fake)))
            monkeypatch.setattr(packaged, "read_gguf", self._read_gguf)
        else:
            monkeypatch.setattr(cispo.models.pretrain, "pretrain", self._pretrain)

    def _model(self):
        self.calls.append(1)
        model, tok = tiny(seed=len(self.calls))
        if self.poison:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        return model, tok

    def _read_gguf(self, source):
        return self._model()

    def _pretrain(self, cfg, out_dir, progress=True):
        model, tok = self._model()
        save_policy(model, tok, out_dir)
        Path(out_dir, "pretrain_config.json").write_text(json.dumps(dataclasses.asdict(cfg.resolved())))
        return model, tok

    @property
    def folder(self) -> Path:
        return packaged.cached_folder(NAME) if self.kind == "packaged" else builtin_model_path("addition", cfg=CFG)

    def ensure(self) -> Path:
        if self.kind == "packaged":
            return packaged.ensure_packaged(NAME)
        return ensure_builtin_model("addition", cfg=CFG, progress=False)


@pytest.fixture(params=["packaged", "builtin"])
def cache(request, monkeypatch, tmp_path):
    return Cache(request.param, monkeypatch, tmp_path)


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --------------------------------------------------------------------------- records


def test_a_model_is_cached_with_every_file_size_and_sha256(cache):
    """``SHA256SUMS`` (sha256sum's format, as the shipped models have) and ``cispo-cache.json`` (sizes)
    list every file of the cached folder; nothing else is left beside it."""
    folder = cache.ensure()
    assert folder == cache.folder and cache.calls == [1]
    files = sorted(p.name for p in folder.iterdir() if p.name not in (CHECKSUMS, CACHE_RECORD))
    assert "model.safetensors" in files and "config.json" in files
    assert sorted(read_checksums(folder)) == files
    verify_checksums(folder)
    sizes = json.loads((folder / CACHE_RECORD).read_text())["bytes"]
    assert sizes == {n: (folder / n).stat().st_size for n in files}
    assert entries(folder.parent) == [folder.name]
    assert cache.ensure() == folder and cache.calls == [1]


def _truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _nan(folder):
    """A NaN written into the weights: the same size, a header that reads."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name].view(-1)[0] = float("nan")
    size = path.stat().st_size
    save_file(tensors, path, metadata={"format": "pt"})
    assert path.stat().st_size == size


def _flip(folder):
    path = folder / "tokenizer.json"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated weights": (_truncate, "model.safetensors is"),
    "missing weights": (lambda f: (f / "model.safetensors").unlink(), "model.safetensors is missing"),
    "weights emptied (power cut)": (lambda f: (f / "model.safetensors").write_bytes(b""),
                                    "model.safetensors is 0 bytes"),
    "NaN in the weights": (_nan, "model.safetensors differs from its SHA-256 in"),
    "one bit of the tokenizer": (_flip, "tokenizer.json differs from its SHA-256 in"),
    "records deleted, weights truncated": (lambda f: ((f / CACHE_RECORD).unlink(), _truncate(f)),
                                           "model.safetensors cannot be read"),
    # a damaged record is named, not the files it describes
    "the size record garbled": (lambda f: (f / CACHE_RECORD).write_text("{not json"),
                                f"its record {CACHE_RECORD} cannot be read (JSONDecodeError"),
    "the checksums garbled": (lambda f: (f / CHECKSUMS).write_bytes(b"\xff\xfe garbage"),
                              f"its record {CHECKSUMS} cannot be read"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cached_model_is_made_again_with_one_line(cache, damage, capsys):
    """Before: the damaged folder was loaded on its marker alone (a safetensors traceback, or NaN
    weights that ``check_head`` called a bug to report)."""
    folder = cache.ensure()
    spoil, reason = DAMAGE[damage]
    spoil(folder)
    capsys.readouterr()
    assert cache.ensure() == folder and cache.calls == [1, 1]
    said = [line for line in capsys.readouterr().err.splitlines() if ": damaged (" in line]
    assert len(said) == 1 and said[0].startswith(f"cispo: {folder}: damaged ({reason}"), said
    assert said[0].endswith("converting it again (a few minutes)" if cache.kind == "packaged" else "pretraining it "
                                                                                                   "again")
    assert cache_problem(folder) is None and entries(folder.parent) == [folder.name]


def test_a_folder_is_hashed_once_per_process(monkeypatch, tmp_path):
    """The full SHA-256 check costs ~0.5 s for SmolLM2-135M's 538 MB; a second load of the unchanged
    folder in the same process costs a stat per file."""
    cache = Cache("packaged", monkeypatch, tmp_path)
    cache.ensure()
    hashed, real = [], model_cache.file_sha256
    monkeypatch.setattr(model_cache, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    cache.ensure()
    assert "model.safetensors" in hashed
    n = len(hashed)
    cache.ensure()
    assert len(hashed) == n


def test_a_folder_cached_before_records_were_kept_is_checked_and_recorded_once(cache, capsys):
    folder = cache.ensure()
    sums = (folder / CHECKSUMS).read_text()
    (folder / CHECKSUMS).unlink()
    (folder / CACHE_RECORD).unlink()
    assert cache.ensure() == folder and cache.calls == [1]
    assert (folder / CHECKSUMS).read_text() == sums and (folder / CACHE_RECORD).is_file()
    assert ": damaged (" not in capsys.readouterr().err


def test_nan_in_a_folder_cached_before_records_were_kept_is_made_again(cache, capsys):
    folder = cache.ensure()
    (folder / CHECKSUMS).unlink()
    (folder / CACHE_RECORD).unlink()
    _nan(folder)
    assert cache.ensure() == folder and cache.calls == [1, 1]
    assert "NaN or infinite values" in capsys.readouterr().err and cache_problem(folder) is None


def test_a_model_with_nan_weights_is_never_cached(kind_and_poison):
    cache = kind_and_poison
    with pytest.raises(ModelCacheError, match=r"1 weight tensor\(s\) hold NaN or infinite values .*nothing was cached"):
        cache.ensure()
    assert entries(cache.folder.parent) == []


@pytest.fixture(params=["packaged", "builtin"])
def kind_and_poison(request, monkeypatch, tmp_path):
    return Cache(request.param, monkeypatch, tmp_path, poison=True)


def test_a_stray_file_in_a_cached_folder_is_named_and_left(cache):
    """A file the records do not list (a ``chat_template.jinja`` would change the model's template)."""
    folder = cache.ensure()
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(ModelCacheError, match="chat_template.jinja: a file cispo did not write"):
        cache.ensure()
    assert (folder / "chat_template.jinja").is_file() and cache.calls == [1]


def test_a_damaged_folder_that_cannot_be_removed_is_one_line_naming_it(cache, monkeypatch, capsys):
    folder = cache.ensure()
    _truncate(folder)

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(model_cache.tempfile, "mkdtemp", read_only)
    with pytest.raises(ModelCacheError, match=rf"^{folder}: cannot be removed \(Read-only file system\)"):
        cache.ensure()
    assert f"{folder}: damaged (model.safetensors is" in capsys.readouterr().err and cache.calls == [1]


# --------------------------------------------------------------------------- the cache folder, before the conversion


def _cache_is_a_file(tmp):
    (tmp / "cache").write_text("x")
    return tmp / "cache", "a file, where the model cache"


def _cache_is_a_loop(tmp):
    (tmp / "cache").symlink_to(tmp / "cache")
    return tmp / "cache", "a symlink that leads nowhere"


def _models_is_a_file(tmp):
    (tmp / "cache").mkdir()
    (tmp / "cache" / "models").write_text("x")
    return tmp / "cache" / "models", "a file, where the model cache"


def _read_only(tmp, monkeypatch):
    def refused(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(model_cache.tempfile, "mkdtemp", refused)
    return tmp / "cache" / "models", "cannot write into the model cache (Read-only file system)"


ROOTS = {"CISPO_CACHE is a file": _cache_is_a_file, "CISPO_CACHE is a symlink loop": _cache_is_a_loop,
         "its models folder is a file": _models_is_a_file, "read-only": _read_only}


@pytest.mark.parametrize("case", ROOTS)
def test_a_cache_that_cannot_be_written_is_one_line_before_the_conversion(cache, case, tmp_path, monkeypatch):
    """Before: each a traceback after the 4-7 minute conversion (or the pretraining)."""
    make = ROOTS[case]
    path, words = make(tmp_path, monkeypatch) if case == "read-only" else make(tmp_path)
    with pytest.raises(ModelCacheError) as e:
        cache.ensure()
    msg = str(e.value)
    assert msg.startswith(f"{path}: {words}") or msg.startswith(f"{path.parent}: {words}"), msg
    assert "set CISPO_CACHE to a writable folder" in msg and "\n" not in msg
    assert cache.calls == []


def _a_file(folder):
    folder.write_text("not a model")


def _a_loop(folder):
    folder.symlink_to(folder)


def _a_folder_of_someone_else(folder):
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")


IN_THE_WAY = {"a file": (_a_file, "a file"), "a symlink loop": (_a_loop, "a symlink that leads nowhere"),
              "a folder with a stray file": (_a_folder_of_someone_else, "a folder without cispo-cache.json")}


@pytest.mark.parametrize("case", IN_THE_WAY)
def test_what_cispo_did_not_write_where_the_model_goes_is_named_and_left(cache, case):
    """Before: a traceback (``NotADirectoryError``, ``OSError: Directory not empty``) after the conversion."""
    make, words = IN_THE_WAY[case]
    cache.folder.parent.mkdir(parents=True)
    make(cache.folder)
    with pytest.raises(ModelCacheError, match=rf"^{cache.folder}: {words}.*move it away, or set CISPO_CACHE"):
        cache.ensure()
    assert cache.calls == [] and os.path.lexists(cache.folder)
    assert case != "a folder with a stray file" or (cache.folder / "notes.txt").read_text() == "mine"


def test_the_cli_says_it_in_one_line(monkeypatch, tmp_path, capsys):
    from cispo.cli import main

    Cache("packaged", monkeypatch, tmp_path)
    (tmp_path / "cache").write_text("x")
    assert main(["train", "data.task=wordmath", f"out_dir={tmp_path / 'runs'}", "steps=1", "progress=false",
                 "model.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'cache'}: a file, where the model cache" in err and "Traceback" not in err


# --------------------------------------------------------------------------- temporary folders of dead conversions


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_temporary_folders_of_dead_conversions_are_removed_at_the_next(cache):
    """This machine's: its owner is not running and its flock is free. Anyone else's (another machine,
    an older cispo that did not name the owner): once untouched for 24 hours."""
    models = cache.folder.parent
    models.mkdir(parents=True)
    stem, host, old = f".{cache.folder.name}", model_cache._host(), time.time() - 25 * 3600
    made = {
        f"{stem}.tmp-{host}-{_dead_pid()}-abcdefgh": False,  # dead here: removed
        f"{stem}.tmp-{host}-{os.getpid()}-abcdefgh": True,  # a live process's: kept
        f"{stem}.tmp-otherhost-12-abcdefgh": True,  # another machine's, recent: kept
        f"{stem}.tmp-otherhost-13-abcdefg2": False,  # ... 25 hours old: removed
        f"{stem}-abcdefgh": True,  # an older cispo's, recent: kept
        f"{stem}-abcdefg2": False,  # ... 25 hours old: removed
        f".other-model.tmp-{host}-{_dead_pid()}-abcdefgh": True,  # another model's: not looked at
    }
    for name in made:
        (models / name).mkdir()
        (models / name / "model.safetensors").write_bytes(b"half")
    for name in (f"{stem}.tmp-otherhost-13-abcdefg2", f"{stem}-abcdefg2"):
        os.utime(models / name, (old, old))
    cache.ensure()
    assert entries(models) == sorted([cache.folder.name] + [n for n, kept in made.items() if kept])


def test_a_held_temporary_folder_is_kept(cache):
    """A conversion of this machine whose pid the name gives wrongly (another pid namespace) but that
    holds the folder's flock: kept."""
    models = cache.folder.parent
    models.mkdir(parents=True)
    held = models / f".{cache.folder.name}.tmp-{model_cache._host()}-{_dead_pid()}-abcdefgh"
    held.mkdir()
    fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        cache.ensure()
        assert held.is_dir()
    finally:
        os.close(fd)


KILLED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from cispo.models.builtin import staging_folder
    with staging_folder(Path(sys.argv[1])) as tmp:
        (tmp / "model.safetensors").write_bytes(b"half written")
        print(tmp, flush=True)
        time.sleep(600)
""")


def test_a_conversion_killed_by_sigkill_leaves_a_folder_the_next_one_removes(monkeypatch, tmp_path):
    cache = Cache("packaged", monkeypatch, tmp_path)
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(cache.folder)], stdout=subprocess.PIPE, text=True)
    tmp = Path(child.stdout.readline().strip())
    assert tmp.parent == cache.folder.parent and (tmp / "model.safetensors").is_file()
    assert model_cache.remove_dead_temps(cache.folder) == []  # alive: kept
    child.kill()
    child.wait()
    child.stdout.close()
    assert tmp.is_dir()
    cache.ensure()
    assert entries(cache.folder.parent) == [cache.folder.name]
