"""One process per run folder, and the run folder's other faults said in one sentence (a name too long, an
out_dir that is a file or read-only).

A ``--resume`` started while the run was going once wrote a second trajectory into its
``metrics.jsonl``; an ``--overwrite`` deleted the running run's folder while both kept writing."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import cispo.records.runfolder as runfolder
from cispo.cli import main
from cispo.records.runfolder import lock_path, run_lock
from tests.records.test_runfolder import files, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")

HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from cispo.records.runfolder import run_lock
    with run_lock(Path(sys.argv[1])):
        print("locked", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def finished_run(tiny_model, dense_task, tmp_path):
    """A one-step run folder, its files and their contents."""
    assert main(["train", *tiny_args(tiny_model, tmp_path / "runs"), "run_name=r"]) == 0
    run = tmp_path / "runs" / "r"
    return run, {p: (run / p).read_bytes() for p in files(run) if (run / p).is_file()}


@pytest.fixture
def holder(finished_run):
    """Another process holding the run folder's lock, as a running ``cispo train`` does."""
    run, _ = finished_run
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout.readline().strip() == "locked"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("flag", [[], ["--resume"], ["--overwrite"]])
def test_a_second_process_on_a_run_folder_in_use_is_refused_and_changes_nothing(
        tiny_model, dense_task, tmp_path, capsys, finished_run, holder, flag):
    run, before = finished_run
    capsys.readouterr()
    args = tiny_args(tiny_model, tmp_path / "runs", "run_name=r", "steps=2")
    assert main(["train", *args, *flag]) == 2
    err = capsys.readouterr().err
    assert f"is in use by another cispo process (pid {holder.pid}" in err and "Traceback" not in err, err
    assert {p: (run / p).read_bytes() for p in files(run) if (run / p).is_file()} == before  # nothing touched


def test_the_lock_is_held_for_the_run_and_released_after(tiny_model, dense_task, tmp_path, monkeypatch):
    seen = []
    real = runfolder.prepare_run_dir

    def probe(cfg, resume, overwrite):  # inside the run: a second taker is refused
        with pytest.raises(runfolder.RunFolderInUse):
            with run_lock(runfolder.run_dir_of(cfg)):
                pass
        seen.append(json.loads(lock_path(runfolder.run_dir_of(cfg)).read_text())["pid"])
        return real(cfg, resume, overwrite)

    import cispo.training.run
    monkeypatch.setattr(cispo.training.run, "prepare_run_dir", probe)
    assert main(["train", *tiny_args(tiny_model, tmp_path / "runs"), "run_name=r"]) == 0
    assert seen == [os.getpid()]
    with run_lock(tmp_path / "runs" / "r"):  # released when the run ended
        pass


def test_a_lock_released_by_a_finished_process_is_not_said_taken_over(tmp_path, capsys):
    """A run that ended (normally or by an error it handled) leaves its lock file empty: the next run on the folder
    says nothing about taking it over (was: "took over the lock … left by pid N (no longer running)" after a
    normal end, as if that run had died). A holder that died still is said (below)."""
    folder = tmp_path / "runs" / "r"
    child = subprocess.run([sys.executable, "-c", f"from cispo.records.runfolder import run_lock\n"
                            f"with run_lock(__import__('pathlib').Path({str(folder)!r})):\n    pass"], check=True)
    assert child.returncode == 0 and lock_path(folder).read_text() == ""
    with run_lock(folder):
        assert json.loads(lock_path(folder).read_text())["pid"] == os.getpid()
    assert "took over" not in capsys.readouterr().err


def test_a_stale_lock_file_is_taken_over(tiny_model, dense_task, tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = lock_path(tmp_path / "runs" / "r")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": "2026-01-01T00:00:00Z"}))
    assert main(["train", *tiny_args(tiny_model, tmp_path / "runs"), "run_name=r"]) == 0
    assert f"took over the lock of {tmp_path / 'runs' / 'r'} left by pid {dead.pid}" in capsys.readouterr().err


def test_a_run_name_too_long_for_the_file_system_is_one_sentence(tiny_model, dense_task, tmp_path, capsys):
    assert main(["train", *tiny_args(tiny_model, tmp_path / "runs"), "run_name=" + "x" * 300]) == 2
    err = capsys.readouterr().err
    assert "run_name is 300 bytes long" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_out_dir_that_is_a_file_is_one_sentence(tiny_model, dense_task, tmp_path, capsys):
    (tmp_path / "runs").write_text("not a folder")
    assert main(["train", *tiny_args(tiny_model, tmp_path / "runs"), "run_name=r"]) == 2
    err = capsys.readouterr().err
    assert f"out_dir {tmp_path / 'runs'} is a file, not a folder" in err and "Traceback" not in err
    assert (tmp_path / "runs").read_text() == "not a folder"


def test_a_read_only_out_dir_is_one_sentence(tiny_model, dense_task, tmp_path, capsys, monkeypatch):
    """(As root, permissions do not stop writes: the read-only file system is simulated at os.open.)"""
    (tmp_path / "runs").mkdir()
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "runs")) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(runfolder.os, "open", read_only)
    assert main(["train", *tiny_args(tiny_model, tmp_path / "runs"), "run_name=r"]) == 2
    err = capsys.readouterr().err
    assert "cannot create the run's lock file" in err and "Read-only file system" in err and "Traceback" not in err
    assert list((tmp_path / "runs").iterdir()) == []


@pytest.mark.slow
def test_an_overwrite_while_a_real_training_runs_is_refused(tiny_model, dense_task, tmp_path):
    """End to end: ``cispo train --overwrite`` on the folder of a ``cispo train`` that is running.
    Slow (two interpreter starts and a running training, ~12 CPU-s): the default run pins the same
    refusal with ``test_a_second_process_on_a_run_folder_in_use_is_refused_and_changes_nothing``
    (the lock held by another process, ``--overwrite`` refused with exit 2, nothing touched) and
    ``test_the_lock_is_held_for_the_run_and_released_after`` (a training holds that lock)."""
    args = tiny_args(tiny_model, tmp_path / "runs", "run_name=r", "steps=500")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "cispo", "train", *args], env=env, stderr=subprocess.DEVNULL)
    try:
        metrics = tmp_path / "runs" / "r" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        marker = (tmp_path / "runs" / "r" / runfolder.MARKER).read_text()
        second = subprocess.run([sys.executable, "-m", "cispo", "train", *args, "--overwrite"], env=env,
                                capture_output=True, text=True, timeout=300)
        assert first.poll() is None, "the first run ended before the second was refused"
        assert second.returncode == 2 and f"in use by another cispo process (pid {first.pid}" in second.stderr, \
            second.stderr
        assert (tmp_path / "runs" / "r" / runfolder.MARKER).read_text() == marker  # the folder was not replaced
    finally:
        first.kill()
        first.wait()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")]
    assert steps == list(range(len(steps))) and len(steps) >= 2  # one trajectory, in order


# ---------------------------------------------------------------------------------------
# The lock file is never written through (a symlink planted in its place), and one folder has one lock
# whatever name reaches it
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def holding(path):
    """Another process holding ``run_lock(path)``, as a running ``cispo train`` on ``path`` does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "hard link", "fifo", "another file"])
def test_a_lock_file_cispo_did_not_write_is_refused_never_written_through(tiny_model, dense_task, tmp_path, capsys,
                                                                          kind):
    """Was: the lock was opened without ``O_NOFOLLOW`` and truncated, so ``.r.lock -> precious.txt``
    replaced precious.txt with the lock's JSON (a dangling link created its target; a hard link or a
    user's file of that name was overwritten; a FIFO was a traceback)."""
    precious = tmp_path / "precious.txt"
    precious.write_text("years of work\n")
    (tmp_path / "runs").mkdir()
    lock = lock_path(tmp_path / "runs" / "r")
    if kind == "symlink":
        lock.symlink_to(precious)
    elif kind == "dangling symlink":
        lock.symlink_to(tmp_path / "created.txt")
    elif kind == "hard link":
        os.link(precious, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.write_text("notes that happen to have this name\n")
    assert main(["train", *tiny_args(tiny_model, tmp_path / "runs"), "run_name=r"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cispo train: error: run lock {lock} ") and err.count("\n") == 1, err
    assert "nothing was changed" in err and "Traceback" not in err
    assert precious.read_text() == "years of work\n" and not (tmp_path / "created.txt").exists()
    assert kind != "another file" or lock.read_text() == "notes that happen to have this name\n"
    assert not (tmp_path / "runs" / "r").exists()  # refused before the run folder was made


@pytest.mark.parametrize("held, out_dir, name", [("r", "runs", "alias"), ("alias", "runs", "r"), ("r", "linked", "r")],
                         ids=["resume-the-alias-of-a-running-run", "resume-a-run-running-under-its-alias",
                              "resume-through-a-symlinked-out_dir"])
def test_a_run_folder_in_use_is_refused_under_any_of_its_names(tiny_model, dense_task, tmp_path, capsys,
                                                               finished_run, held, out_dir, name):
    """Was: the lock was keyed by the name, so with ``runs/alias -> runs/r`` a ``--resume
    run_name=alias`` while ``r`` trained (or the other way round) was not refused, and both appended
    to one ``metrics.jsonl``. (A symlinked ``out_dir`` already met the same lock file.)"""
    run, before = finished_run
    (tmp_path / "runs" / "alias").symlink_to(run)
    (tmp_path / "linked").symlink_to(tmp_path / "runs")
    capsys.readouterr()
    with holding(tmp_path / "runs" / held) as proc:
        args = tiny_args(tiny_model, tmp_path / out_dir, f"run_name={name}", "steps=2")
        assert main(["train", *args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"is in use by another cispo process (pid {proc.pid} " in err and "Traceback" not in err, err
    assert {p: (run / p).read_bytes() for p in files(run) if (run / p).is_file()} == before  # nothing touched


def test_the_folder_itself_is_locked_for_a_path_that_resolves_elsewhere(finished_run, tmp_path, monkeypatch):
    """A second path to the folder whose lock file is another one (a bind mount; simulated by giving
    this process other lock files) still meets the lock on the folder's device and inode."""
    run, _ = finished_run
    with holding(run):
        monkeypatch.setattr(runfolder, "lock_paths", lambda run_dir: [tmp_path / ".elsewhere.lock"])
        with pytest.raises(runfolder.RunFolderInUse, match="reached it by another path"):
            with run_lock(run):
                pass
    with run_lock(run):  # released with its holder
        pass


def test_an_old_run_folder_resumes_and_a_plain_run_keeps_its_one_lock_file(tiny_model, dense_task, tmp_path,
                                                                           finished_run):
    """A run folder from before (its lock beside it, as ever) resumes; no lock file is added."""
    run, _ = finished_run
    before = sorted(p.name for p in run.parent.iterdir())
    assert before == [".r.lock", "r"]
    assert main(["train", *tiny_args(tiny_model, tmp_path / "runs", "run_name=r", "steps=2"), "--resume"]) == 0
    assert sorted(p.name for p in run.parent.iterdir()) == before
    assert lock_path(run).read_text() == ""  # the run released it: no holder left in it


def test_a_recipe_run_after_the_default_run_has_a_folder_of_its_own(tiny_model, dense_task, tmp_path, capsys):
    """Issue 59 (newcomer's path): the README's `cispo train recipe=scalerl` right after the set-up run wanted the
    same folder, runs/cispo__addition__seed0, and was refused after a "took over the lock" line about a run that
    had ended normally. A recipe names the default run folder; the finished run's lock is not 'taken over'."""
    args = tiny_args(tiny_model, tmp_path / "runs")
    assert main(["train", *args]) == 0
    assert main(["train", *args, "recipe=scalerl"]) == 0
    err = capsys.readouterr().err
    assert "took over" not in err and "already" not in err
    assert (tmp_path / "runs" / "cispo__addition__seed0" / "metrics.jsonl").is_file()
    saved = (tmp_path / "runs" / "scalerl__addition__seed0" / "config.yaml").read_text()
    assert "run_name: scalerl__addition__seed0" in saved and "eps_high_is: 4.0" in saved
    assert main(["train", *args, "recipe=scalerl", "run_name=mine"]) == 0  # a name given is kept
    assert (tmp_path / "runs" / "mine" / "metrics.jsonl").is_file()
    assert main(["train", "--resume", *args, "recipe=scalerl", "steps=3"]) == 0  # --resume finds the recipe's folder
