"""Resume after damage: a torn or NUL-filled metrics line, a corrupt newest checkpoint
(truncated safetensors, bad JSON, a missing file, a truncated optimizer state), non-finite
weights. Each resume either ends with exactly the uninterrupted run or stops with a message
that names the file."""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cispo.cli import main
from cispo.records.tracking import JsonlSink, read_metrics
from cispo.training.checkpoint import CheckpointError, load_checkpoint
from cispo.training.runner import train
from tests.conftest import small_config, strip_perf, train_dense

pytestmark = pytest.mark.usefixtures("one_thread")


def run_config(model, out, *extra):
    return small_config(model, out, "run_name=r", "steps=4", "checkpoint_every=2", "keep_checkpoints=2", *extra)


@pytest.fixture(scope="module")
def original(tiny_model, tmp_path_factory, one_thread):
    """A 4-step run with checkpoints at steps 2 and 4, and its metrics."""
    out = tmp_path_factory.mktemp("original")
    result = train_dense(run_config(tiny_model, out))
    return result.run_dir, strip_perf(read_metrics(result.run_dir / "metrics.jsonl"))


@pytest.fixture
def damaged(original, tmp_path):
    """A copy of the original run folder to damage."""
    run_dir = tmp_path / "r"
    shutil.copytree(original[0], run_dir)
    return run_dir


def resume(model, run_dir):
    return train(run_config(model, run_dir.parent), resume=True)


# ---------------------------------------------------------------------------------------
# metrics.jsonl
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", [b'{"step": 3, "rollout/rew', b"\0" * 300], ids=["torn", "nul"])
def test_torn_metrics_line_is_dropped_on_resume(tiny_model, dense_task, original, damaged, tail):
    """Killed while writing step 3's row, after the checkpoint of step 2."""
    shutil.rmtree(damaged / "checkpoints" / "step_000004")
    lines = (damaged / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (damaged / "metrics.jsonl").write_bytes(b"".join(lines[:3]) + tail)
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl: dropped 1 unreadable line\(s\) on resume \(line 4"):
        resume(tiny_model, damaged)
    assert strip_perf(read_metrics(damaged / "metrics.jsonl")) == original[1]


def test_truncate_keeps_the_committed_rows_and_drops_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = "".join(json.dumps({"step": s, "x": s / 3}) + "\n" for s in range(5))
    path.write_bytes(good.encode() + b"\0\0\0\n" + b'{"step": 5, "x"')
    with pytest.warns(RuntimeWarning, match=r"line 6: NUL bytes.*line 7: JSONDecodeError"):
        JsonlSink(path).truncate_after(3)
    assert read_metrics(path) == [{"step": s, "x": s / 3} for s in range(4)]
    with pytest.warns(RuntimeWarning, match=r"rows of steps \[4, 5\] are missing"):
        JsonlSink(path).truncate_after(5)  # the checkpoint says 5 steps were committed: say what is lost
    assert not list(tmp_path.glob(".*tmp"))  # replaced atomically, no temporary left


def test_read_metrics_skips_a_torn_last_line_and_names_a_bad_inner_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "a')
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"step": 1, "a\n{"step": 2}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: unreadable metrics row"):
        read_metrics(path)


# ---------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def poison(path):
    weights = load_file(path)
    name = sorted(weights)[1]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, path)
    return name


def edit_state(**changes):
    """Set (or, with None, delete) keys of a trainer_state.json."""
    def damage(path):
        state = json.loads(path.read_text())
        for k, v in changes.items():
            state.pop(k) if v is None else state.__setitem__(k, v)
        path.write_text(json.dumps(state))
    return damage


def edit_tensors(edit):
    """Rewrite a safetensors file with ``edit(tensors)``."""
    def damage(path):
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path)
    return damage


def drop_one_parameter(path):
    state = torch.load(path, weights_only=True)
    state["param_groups"][0]["params"].pop()
    state["state"].pop(max(state["state"]))
    torch.save(state, path)


def grow_embedding(tensors):
    name = next(k for k in tensors if "embed" in k)
    tensors[name] = torch.cat([tensors[name], tensors[name][:1]])


DAMAGE = {  # file to damage -> (how, what the warning says)
    "no update_count": ("trainer_state.json", edit_state(update_count=None), "lacks update_count"),
    "no streams": ("trainer_state.json", edit_state(streams=None), "streams is 'None'"),
    "step as a string": ("trainer_state.json", edit_state(step="4"), "step is '4', but the folder is step_000004"),
    "another step": ("trainer_state.json", edit_state(step=7), "step is 7, but the folder is step_000004"),
    "generator missing": ("rng.safetensors", edit_tensors(lambda t: t.pop("generator/sample/0")),
                          "lacks generator/sample/0"),
    "float generator": ("rng.safetensors", edit_tensors(lambda t: t.update({"generator/shuffle/0": t[
        "generator/shuffle/0"].float()})), "generator/shuffle/0 is torch.float32"),
    "mis-shaped embedding": ("model/model.safetensors", edit_tensors(grow_embedding), "the model's is"),
    "one parameter fewer": ("optimizer.pt", drop_one_parameter, "parameters per group"),
    "truncated safetensors": ("model/model.safetensors", truncate, "model weights"),
    "bad json": ("trainer_state.json", lambda p: p.write_text('{"step": 4, "upd'), "trainer state"),
    "missing file": ("rng.safetensors", lambda p: p.unlink(), "is missing"),
    "truncated optimizer": ("optimizer.pt", truncate, "optimizer state"),
    "non-finite weight": ("model/model.safetensors", poison, "non-finite value"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(tiny_model, dense_task, original,
                                                                          damaged, capsys, case):
    name, damage, says = DAMAGE[case]
    bad_file = damaged / "checkpoints" / "step_000004" / name
    damage(bad_file)
    resume(tiny_model, damaged)  # from step 2: steps 3 and 4 again
    err = capsys.readouterr().err
    assert f"skipping checkpoint step_000004: checkpoint file {bad_file}" in err and says in err
    assert "resumed" in err and "from step_000002" in err
    assert strip_perf(read_metrics(damaged / "metrics.jsonl")) == original[1]
    a = load_file(original[0] / "checkpoints" / "step_000004" / "model" / "model.safetensors")
    b = load_file(damaged / "checkpoints" / "step_000004" / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # rewritten, intact, the same weights


def test_no_intact_checkpoint_is_a_clear_error(tiny_model, dense_task, damaged, capsys):
    truncate(damaged / "checkpoints" / "step_000004" / "model" / "model.safetensors")
    (damaged / "checkpoints" / "step_000002" / "trainer_state.json").write_text("")
    before = (damaged / "metrics.jsonl").read_bytes()
    overrides = [f"out_dir={damaged.parent}", "run_name=r", f"model.path={tiny_model}"]
    assert main(["train", "--resume", *overrides]) == 1
    err = capsys.readouterr().err
    assert "no intact checkpoint in" in err and "Traceback" not in err
    assert str(damaged / "checkpoints" / "step_000002" / "trainer_state.json") in err
    assert str(damaged / "checkpoints" / "step_000004" / "model" / "model.safetensors") in err
    assert (damaged / "metrics.jsonl").read_bytes() == before  # nothing touched


def test_non_finite_weights_are_refused_at_load_and_nothing_changes(tiny_model, original, tmp_path):
    from cispo.models.loading import load_policy

    ckpt = tmp_path / "step_000004"
    shutil.copytree(original[0] / "checkpoints" / "step_000004", ckpt)
    tensor = poison(ckpt / "model" / "model.safetensors")
    model, _ = load_policy(tiny_model)
    optimizer = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{ckpt / 'model' / 'model.safetensors'}: weight '{tensor}' has 1 "
                                              r"non-finite value"):
        load_checkpoint(ckpt, model, optimizer)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not optimizer.state
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean checkpoint loads without a word
        load_checkpoint(original[0] / "checkpoints" / "step_000004", model, optimizer)


def test_a_full_disk_during_a_checkpoint_is_one_sentence_and_loses_nothing(tiny_model, dense_task, monkeypatch,
                                                                            tmp_path, capsys):
    """torch.save on a full disk raises a torch-internal error that never mentions the disk
    (before: that traceback, and a half-written .tmp folder left behind)."""
    import cispo.training.checkpoint
    from cispo.cli import main

    real, calls = torch.save, {"n": 0}

    def full_disk(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint
            Path(path).write_bytes(b"PK\x03\x04")
            raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing "
                               "file data/3: file write failed")
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(cispo.training.checkpoint.torch, "save", full_disk)
    overrides = [f"model.path={tiny_model}", f"out_dir={tmp_path}", "run_name=r", "model.device=cpu", "progress=false",
                 "steps=4", "prompts_per_step=4", "group_size=4", "updates_per_batch=4", "max_new_tokens=10",
                 "num_train_prompts=64", "num_eval_prompts=8", "eval.num_samples=2", "eval.every=0",
                 "checkpoint_every=2", "lr=1e-3", "warmup_updates=2"]
    assert main(["train", *overrides]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("cispo train: error: writing checkpoint step_000004 into ") and "PytorchStreamWriter" \
        in err[-1] and "MB free on its disk" in err[-1] and "Traceback" not in "\n".join(err)
    ckpts = tmp_path / "r" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002"]  # no half-written folder left
    monkeypatch.setattr(cispo.training.checkpoint.torch, "save", real)
    assert main(["train", "--resume", *overrides]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_a_full_disk_mid_run_is_one_line_and_the_run_resumes(tiny_model, tmp_path, monkeypatch, capsys):
    """A write that finds no space (ENOSPC) in the middle of a run: one line naming the file and saying how to go
    on, exit status 1, no traceback (was: an OSError traceback); the half-written row is torn and --resume cuts it
    and continues from the newest checkpoint."""
    import errno

    from cispo.cli import main
    from cispo.records.tracking import JsonlSink, read_metrics
    from tests.conftest import run_args

    real = JsonlSink.log

    def full_at_step_2(self, step, metrics):
        if step == 2:
            with open(self.path, "a") as f:
                f.write('{"step": 2, "rollout/rew')  # the disk filled up mid-line
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real(self, step, metrics)

    monkeypatch.setattr(JsonlSink, "log", full_at_step_2)
    args = ["train", *run_args(tiny_model, tmp_path, "checkpoint_every=1", "progress=false")]
    assert main(args) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("cispo train: error")]
    assert "Traceback" not in err and len(errors) == 1
    assert "No space left on device writing" in errors[0] and "metrics.jsonl" in errors[0] and "--resume" in errors[0]
    monkeypatch.setattr(JsonlSink, "log", real)
    assert main(["train", "--resume", *run_args(tiny_model, tmp_path, "checkpoint_every=1", "progress=false")]) == 0
    run = next(p for p in tmp_path.iterdir() if (p / "metrics.jsonl").exists())
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2]
