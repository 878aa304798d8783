"""The run folder knows it is one (``--overwrite`` deletes nothing else), and ``--resume`` continues
the same run (its saved config; only the documented safe keys may change)."""

import json

import pytest

from cispo.cli import main
from cispo.config.train import ConfigError, apply_overrides, save_yaml
from cispo.records.runfolder import MARKER, RESUME_SAFE_FIELDS, check_resume, resume_config, saved_config
from cispo.records.tracking import read_metrics
from cispo.training.runner import train
from tests.conftest import small_config, strip_perf

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_args(model, out, *extra):
    """CLI overrides of a tiny run (the ones of ``small_config``)."""
    return [f"model.path={model}", f"out_dir={out}", "model.device=cpu", "progress=false", "steps=1",
            "prompts_per_step=4", "group_size=4", "updates_per_batch=4", "max_new_tokens=10",
            "num_train_prompts=64", "num_eval_prompts=8", "eval.num_samples=2", "eval.every=0", *extra]


def user_folder(path):
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    (path / "data").mkdir()
    (path / "data" / "x.csv").write_text("1,2\n")
    return sorted(p.relative_to(path) for p in path.rglob("*"))


def files(path):
    return sorted(p.relative_to(path) for p in path.rglob("*"))


# ---------------------------------------------------------------------------------------
# --overwrite
# ---------------------------------------------------------------------------------------


def test_overwrite_leaves_a_folder_that_is_not_a_run_untouched(tiny_model, dense_task, tmp_path):
    before = user_folder(tmp_path / "runs" / "r")
    with pytest.raises(FileExistsError, match=rf"not a cispo run folder \(no {MARKER}"):
        train(small_config(tiny_model, tmp_path / "runs", "run_name=r"), overwrite=True)
    assert files(tmp_path / "runs" / "r") == before


@pytest.mark.parametrize("name", ["../victim", "{victim}", "sub/../../victim", ".."])
def test_run_name_outside_out_dir_is_refused(tiny_model, dense_task, tmp_path, capsys, name):
    victim = tmp_path / "victim"
    before = user_folder(victim)
    name = name.format(victim=victim)
    assert main(["train", *tiny_args(tiny_model, tmp_path / "runs"), f"run_name={name}", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "must be a plain folder name" in err and "Traceback" not in err
    assert files(victim) == before


def test_overwrite_through_a_symlink_out_of_out_dir_is_refused(tiny_model, dense_task, tmp_path, capsys):
    victim = tmp_path / "victim"
    before = user_folder(victim)
    (victim / MARKER).write_text("{}")  # even a marked folder: it is not in out_dir
    before = files(victim)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r").symlink_to(victim)
    assert main(["train", *tiny_args(tiny_model, tmp_path / "runs"), "run_name=r", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "refusing to delete" in err and "not a folder directly in out_dir" in err
    assert files(victim) == before


def test_overwrite_replaces_a_real_run_folder(tiny_model, dense_task, tmp_path):
    first = train(small_config(tiny_model, tmp_path, "steps=1", "eval.every=0"))
    marker = json.loads((first.run_dir / MARKER).read_text())
    assert marker["version"] == 1 and marker["created"]
    (first.run_dir / "stale.txt").write_text("from the first run")
    again = train(small_config(tiny_model, tmp_path, "steps=1", "eval.every=0"), overwrite=True)
    assert again.run_dir == first.run_dir and not (again.run_dir / "stale.txt").exists()
    assert (again.run_dir / MARKER).is_file()
    assert [r["step"] for r in read_metrics(again.run_dir / "metrics.jsonl")] == [0, 1]


def test_resume_into_a_folder_that_is_not_a_run_is_refused(tiny_model, dense_task, tmp_path):
    before = user_folder(tmp_path / "runs" / "r")
    with pytest.raises(FileExistsError, match="is not a cispo run folder"):
        train(small_config(tiny_model, tmp_path / "runs", "run_name=r"), resume=True)
    assert files(tmp_path / "runs" / "r") == before


# ---------------------------------------------------------------------------------------
# --resume keeps the run's config
# ---------------------------------------------------------------------------------------


def test_resume_without_the_overrides_continues_the_same_run(tiny_model, dense_task, tmp_path):
    """``cispo train --resume run_name=X steps=N`` (the form --help shows) reloads the saved
    P, G, K, model, ...: the result is the uninterrupted run, bit for bit."""
    full = train(small_config(tiny_model, tmp_path / "full", "steps=4", "run_name=r"))
    train(small_config(tiny_model, tmp_path / "cut", "steps=2", "run_name=r"))
    assert main(["train", "--resume", f"out_dir={tmp_path / 'cut'}", "run_name=r", "steps=4"]) == 0
    rows_full = strip_perf(read_metrics(full.run_dir / "metrics.jsonl"))
    rows_res = strip_perf(read_metrics(tmp_path / "cut" / "r" / "metrics.jsonl"))
    assert rows_res == rows_full
    assert saved_config(tmp_path / "cut" / "r").steps == 4  # config.yaml follows the safe change


def saved_run(tmp_path, model):
    """A run folder with its config.yaml only (enough for the checks, which come first)."""
    cfg = small_config(model, tmp_path, "run_name=r")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / MARKER).write_text("{}")
    save_yaml(cfg, tmp_path / "r" / "config.yaml")
    return cfg


def test_resume_with_a_changed_field_names_it_with_both_values(tiny_model, tmp_path, capsys):
    saved_run(tmp_path, tiny_model)
    assert main(["train", "--resume", f"out_dir={tmp_path}", "run_name=r", "group_size=8", "lr=0.5",
                 "steps=9", "eval.every=1"]) == 2
    err = capsys.readouterr().err
    assert "rollout.group_size: saved 4, given 8" in err and "optim.lr: saved 0.001, given 0.5" in err
    assert "steps" not in err.split("Only these may change")[0]  # safe keys are not complained about
    assert "Traceback" not in err and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_resume_through_the_api_checks_the_config(tiny_model, tmp_path):
    cfg = saved_run(tmp_path, tiny_model)
    with pytest.raises(ConfigError, match=r"algo.updates_per_batch: saved 4, given 16"):
        train(apply_overrides(cfg, ["updates_per_batch=16"]), resume=True)
    check_resume(cfg, apply_overrides(cfg, [f"{k}={v}" for k, v in [("steps", 99), ("eval.every", 1),
                                                                       ("checkpoint_every", 0)]]), tmp_path)
    check_resume(apply_overrides(cfg, ["max_new_tokens=12"]), apply_overrides(cfg, ["max_new_tokens=null"]),
                 tmp_path)  # None is resolved when the run starts: it matches the saved value


def test_a_run_saved_with_chat_template_false_resumes_with_it():
    """config.yaml holds the resolved chat_template; a run saved with false (the default before auto)
    resumes with false when the given config says auto (the default now), and a real change is named."""
    from cispo.config.train import TrainConfig
    from cispo.records.runfolder import keep_resolved, resume_changes

    saved, given = apply_overrides(TrainConfig(), ["model.chat_template=false"]), TrainConfig()
    assert given.model.chat_template == "auto" and resume_changes(saved, given) == []
    assert keep_resolved(saved, given).model.chat_template is False
    assert resume_changes(saved, apply_overrides(given, ["model.chat_template=true"])) == [
        ("model.chat_template", False, True)]
    assert keep_resolved(saved, apply_overrides(given, ["max_new_tokens=7"])).rollout.max_new_tokens == 7


def test_resume_with_a_config_file_takes_only_the_keys_it_sets(tiny_model, tmp_path):
    saved_run(tmp_path, tiny_model)
    more = tmp_path / "more.yaml"
    more.write_text("steps: 9\nrollout:\n  group_size: 4\n")
    cfg = resume_config(str(more), [f"out_dir={tmp_path}", "run_name=r"])
    assert (cfg.steps, cfg.rollout.prompts_per_step, cfg.model.path) == (9, 4, str(tiny_model))
    other = tmp_path / "other.yaml"
    other.write_text("rollout:\n  group_size: 8\n")
    cfg = resume_config(str(other), [f"out_dir={tmp_path}", "run_name=r"])
    with pytest.raises(ConfigError, match="rollout.group_size: saved 4, given 8"):
        check_resume(saved_config(tmp_path / "r"), cfg, tmp_path / "r")


def test_safe_fields_are_config_keys():
    from cispo.config.train import TrainConfig, to_dict
    from cispo.records.runfolder import _leaves

    keys = _leaves(to_dict(TrainConfig()))
    assert all(any(k == f or k.startswith(f + ".") for k in keys) for f in RESUME_SAFE_FIELDS)
