"""Model paths, ``cispo eval --samples`` and a run's saved paths: a wrong model
path is one line naming it and what belongs there; ``cispo eval`` saves what it scored and prints
JSON that any parser reads; a run trained with relative paths is evaluated and resumed from
another folder."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

from cispo.cli import main
from cispo.config.train import ConfigError
from cispo.training.checkpoint import check_model_folder

pytestmark = pytest.mark.usefixtures("one_thread")

REWARD = "def score(prompt, completion, answer, **sample):\n    return completion.count('1') / max(len(completion), 1)\n"  # noqa: E501
RUN = ["model.device=cpu", "progress=false", "steps=2", "prompts_per_step=2", "group_size=2", "updates_per_batch=1",
       "max_new_tokens=6", "num_eval_prompts=2", "eval.num_samples=2", "eval.every=0", "checkpoint_every=1",
       "dynamic_sampling=false", "data.reward_isolation=main", "data.fork_tokens=[Wait]"]


def reject(constant: str):
    raise ValueError(f"not JSON: {constant}")


@pytest.fixture(scope="module")
def relative_run(tiny_model, tmp_path_factory):
    """A run trained from folder A with relative paths: data.path, data.reward's file, model.path."""
    a = tmp_path_factory.mktemp("a")
    (a / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                             for i in range(12)))
    (a / "rewards.py").write_text(REWARD)
    shutil.copytree(tiny_model, a / "model")
    here = os.getcwd()
    os.chdir(a)
    try:
        assert main(["train", "data.path=prompts.jsonl", "data.reward=rewards.py:score", "model.path=model",
                     "out_dir=runs", "run_name=r", *RUN]) == 0
    finally:
        os.chdir(here)
    return a


# --------------------------------------------------------------------------- model paths


def test_a_wrong_model_path_is_one_line_exit_2(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert main(["train", f"model.path={missing}", f"out_dir={tmp_path}", "steps=1", "progress=false"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{missing}: no such file or folder; expected a Hugging Face model folder" in err
    assert main(["eval", "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cispo eval: error: {missing}: no such file or folder" in err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty: a folder without config.json; expected a Hugging Face model"):
        check_model_folder(tmp_path / "empty")
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"w\.bin: a file, not a model folder"):
        check_model_folder(tmp_path / "w.bin")


def test_a_hub_id_still_goes_to_from_pretrained(monkeypatch):
    """``org/name`` that is no local path is left to transformers (which fetches it where a hub is
    reachable); its failure is one line naming the id."""
    import transformers

    import cispo.foundations.hub
    import cispo.models.loading

    check_model_folder("HuggingFaceTB/SmolLM2-135M-Instruct")  # no error: a hub id
    asked = []

    def offline(name, *args, **kwargs):
        asked.append((name, kwargs))
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection")

    monkeypatch.setattr(cispo.foundations.hub, "hub_unreachable", lambda: None)  # as where the hub's name resolves
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    with pytest.raises(ConfigError, match=r"^org/model: cannot load it as a model \(AutoConfig: We couldn't connect"):
        cispo.models.loading.load_policy("org/model")
    assert asked == [("org/model", {})]


def test_without_network_a_hub_id_is_read_from_the_cache_at_once(tiny_model, tmp_path):
    """The hub's host does not resolve (``HF_ENDPOINT`` on ``.invalid``, which never does): a hub id in the
    Hugging Face cache loads from it with ``local_files_only`` (before: ~26 s of retries per file first),
    one that is not there is one line saying so, as is a hub data set (datasets' cache only); and the run folder such a
    failure created is reused by
    the next try, not refused as "already exists"."""
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model, snapshot)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    (tmp_path / "rewards.py").write_text(REWARD)
    script = textwrap.dedent(f"""
        import sys, time
        from cispo.cli import main
        from cispo.foundations.hub import hub_unreachable
        from cispo.models.loading import load_policy
        assert hub_unreachable().startswith("no network: nothing.invalid does not resolve"), hub_unreachable()
        model, tok = load_policy("org/tiny")
        assert model.config.vocab_size == len(tok)
        started = time.perf_counter()
        args = {[*RUN, f"data.reward={tmp_path / 'rewards.py'}:score", f"out_dir={tmp_path / 'runs'}"]!r}
        assert main(["train", "model.path=org/missing", *args]) == 2
        print("failed in", time.perf_counter() - started, file=sys.stderr)
        assert main(["train", "model.path=org/tiny", *args]) == 0
        assert main(["train", "model.path=org/tiny", "data.path=org/nodata", "data.split=train", "--overwrite",
                     *args]) == 2
    """)
    env = {**os.environ, "HF_ENDPOINT": "https://nothing.invalid", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("cispo train: error: org/missing: not in the Hugging Face cache, and the hub cannot be reached "
            "(no network: nothing.invalid does not resolve") in proc.stderr
    assert ("org/nodata: no such file or directory, and datasets.load_dataset failed: ConnectionError: "
            "Couldn't reach 'org/nodata' on the Hub (OfflineModeIsEnabled) (the hub cannot be reached: no network: "
            "nothing.invalid does not resolve") in proc.stderr
    assert "Retrying" not in proc.stderr


def test_a_run_or_its_checkpoints_folder_names_the_newest_checkpoint(relative_run, capsys):
    run = relative_run / "runs" / "r"
    newest = run / "checkpoints" / "step_000002" / "model"
    assert main(["eval", "--model", str(run / "checkpoints")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"a run's checkpoints folder, not a model; the newest checkpoint's model is {newest}" in err
    with pytest.raises(ConfigError, match=f"a run folder, not a model; the newest checkpoint's model is {newest}"):
        check_model_folder(run)
    with pytest.raises(ConfigError, match=f"a checkpoint folder; its model is {newest}"):
        check_model_folder(newest.parent)


# --------------------------------------------------------------------------- cispo eval and resume from another folder


def test_eval_from_another_folder_saves_every_completion_and_prints_json(relative_run, tmp_path, monkeypatch, capsys):
    saved = yaml.safe_load((relative_run / "runs" / "r" / "config.yaml").read_text())
    assert saved["data"]["path"] == str(relative_run / "prompts.jsonl")
    assert saved["data"]["reward"] == f"{relative_run / 'rewards.py'}:score"
    assert saved["model"]["path"] == str(relative_run / "model")
    monkeypatch.chdir(tmp_path)  # another folder: the run's relative paths would not be found here
    model = relative_run / "runs" / "r" / "checkpoints" / "step_000002" / "model"
    capsys.readouterr()
    assert main(["eval", "--model", str(model), "--samples", "s.jsonl"]) == 0
    out = capsys.readouterr().out
    metrics = json.loads(out, parse_constant=reject)  # NaN (no completion used the fork word) is null
    assert metrics["eval/reward_with_fork"] is None and metrics["eval/fork_rate"] == 0.0  # a user's reward: no accuracy
    records = [json.loads(line, parse_constant=reject) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert len(records) == 2 * (1 + 2)  # 2 held-out prompts: 1 greedy + 2 sampled completions each
    assert {(r["mode"], r["sample_index"]) for r in records} == {("greedy", 0), ("sampled", 0), ("sampled", 1)}
    for r in records:
        assert r["set"] == "held_out" and r["prompt"].endswith("+1=") and isinstance(r["completion"], str)
        assert r["reward"] == r["completion"].count("1") / max(len(r["completion"]), 1)
        assert "parsed_answer" in r and r["reference_answer"] == str(int(r["prompt"].split("+")[0]) + 1)
    greedy = [r["reward"] for r in records if r["mode"] == "greedy"]
    assert metrics["eval/reward_greedy"] == pytest.approx(sum(greedy) / len(greedy))


def test_a_relative_path_run_resumes_from_another_folder(relative_run, tmp_path, monkeypatch):
    shutil.copytree(relative_run / "runs" / "r", tmp_path / "runs" / "r")  # the fixture's run stays as it is
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", f"out_dir={tmp_path / 'runs'}", "run_name=r", "steps=3", "progress=false"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


def test_pretrain_measure_prints_parseable_json(monkeypatch, tmp_path, capsys):
    import cispo.models.pretrain as pretrain

    class Report:
        def to_dict(self):
            return {"fork_rate": 0.0, "accuracy_with_fork": float("nan"), "per_digit": [float("inf"), 1.0]}

    monkeypatch.setattr(pretrain, "pretrain", lambda cfg, out: None)
    monkeypatch.setattr(pretrain, "measure_base_model", lambda *a, **k: Report())
    assert main(["pretrain", "--out", str(tmp_path / "m"), "--measure", "4"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{"):], parse_constant=reject)
    assert report == {"fork_rate": 0.0, "accuracy_with_fork": None, "per_digit": [None, 1.0]}


# --------------------------------------------------------------------------- --samples


def test_a_failed_eval_leaves_the_samples_file_as_it_was(relative_run, tmp_path, capsys):
    """Was: ``--samples FILE`` was opened for writing before the model loaded, so an eval that
    failed (here a truncated ``model.safetensors``) left FILE empty. Now the completions go to a
    temporary file beside it, renamed to FILE only when the eval succeeded."""
    run = tmp_path / "runs" / "r"
    shutil.copytree(relative_run / "runs" / "r", run)
    model = run / "checkpoints" / "step_000002" / "model"
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "s.jsonl"
    out.write_text('{"earlier": "completions"}\n')
    try:
        code = main(["eval", "--model", str(model), "--samples", str(out)])
    except Exception as e:  # how a truncated model fails is not this test's business
        code = repr(e)
    assert code != 0
    assert out.read_text() == '{"earlier": "completions"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "s.jsonl"]  # no temporary file left
    capsys.readouterr()
    good = relative_run / "runs" / "r" / "checkpoints" / "step_000002" / "model"
    assert main(["eval", "--model", str(good), "--samples", str(out)]) == 0  # the same file, replaced on success
    assert len(out.read_text().splitlines()) == 2 * (1 + 2) and sorted(p.name for p in tmp_path.iterdir()) == \
        ["runs", "s.jsonl"]


@pytest.mark.parametrize("where", ["metrics.jsonl", "eval.jsonl", "checkpoints/eval.jsonl", "link-to-metrics"])
def test_samples_into_a_run_folder_are_refused(relative_run, tmp_path, capsys, monkeypatch, where):
    """Was: ``--samples RUN/metrics.jsonl`` replaced the run's metrics without a word. A path in a
    run folder (through a symlink too) is one line, before the model loads; nothing changes."""
    run = tmp_path / "runs" / "r"
    shutil.copytree(relative_run / "runs" / "r", run)
    (tmp_path / "link-to-metrics").symlink_to(run / "metrics.jsonl")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    import cispo.training.run_policy

    monkeypatch.setattr(cispo.training.run_policy, "load_policy_for", lambda *a, **k: pytest.fail("model loaded"))
    path = tmp_path / where if where.startswith("link") else run / where
    model = run / "checkpoints" / "step_000002" / "model"
    assert main(["eval", "--model", str(model), "--samples", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"cispo eval: error: --samples {path}: ") and "Traceback" not in "".join(err), err
    assert ("the run's own metrics.jsonl in" if "metrics" in where else "inside the run folder") in err[-1]
    assert f"{run}; cispo eval writes no file into a run folder" in err[-1]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("kind", ["fifo", "link-to-device"])
def test_samples_onto_a_device_or_fifo_are_refused(tiny_model, tmp_path, capsys, monkeypatch, kind):
    """Was: ``--samples PATH`` wrote a temporary file and renamed it over PATH whatever was there:
    as root, ``--samples /dev/full`` replaced the system's device with a regular file. Anything there
    that is not a regular file (a FIFO; a symlink to a character device) is one line naming it and
    what it is, before the model loads; it is left as it was and no temporary file is written."""
    import stat

    import cispo.training.run_policy

    monkeypatch.setattr(cispo.training.run_policy, "load_policy_for", lambda *a, **k: pytest.fail("model loaded"))
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(os.devnull)  # only looked at: the refusal comes before anything is opened
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["eval", "--model", str(tiny_model), "--samples", str(path), "model.device=cpu",
                 "progress=false"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    what = "a FIFO" if kind == "fifo" else f"a character device ({os.path.realpath(os.devnull)})"
    assert err.startswith(f"cispo eval: error: --samples {path}: {what}, not a regular file;"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert stat.S_ISFIFO(path.lstat().st_mode) if kind == "fifo" else path.is_symlink()
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
