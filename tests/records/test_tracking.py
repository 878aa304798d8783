"""Metric sinks: JSONL, TensorBoard, W&B (offline) and MLflow (SQLite in tmp_path); no network.

The backend tests are skipped when the backend is not installed (``pip install 'cispo[tensorboard,wandb,mlflow]'``)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from cispo.records.tracking import (
                                    SINK_KINDS,
                                    JsonlSink,
                                    MultiSink,
                                    TensorBoardSink,
                                    check_sink_kinds,
                                    make_sinks,
                                    mlflow_key,
                                    read_metrics,
                                    scalar_metrics,
                                    )

pytestmark = pytest.mark.filterwarnings("ignore:.*noload.*:DeprecationWarning")  # mlflow's SQLAlchemy use

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# A short run: namespaced names, a missing value (None), NaN (e.g. no fork token sampled).
STEPS = {
    0: {"eval/accuracy": 0.25, "eval/accuracy_mean_at_4": 0.25, "eval/fork_rate": None},
    1: {"rollout/reward_mean": 0.5, "objective/frac_capped": 0.125, "rollout/fork_rate": float("nan")},
    2: {"rollout/reward_mean": 0.75, "objective/frac_capped": 0.0625, "rollout/fork_rate": 0.5, "optim/updates": 32},
    3: {"rollout/reward_mean": 1.0, "objective/frac_capped": 0.0, "rollout/fork_rate": 0.25, "eval/accuracy": 0.5},
}


def expected_series(steps=STEPS) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for step, metrics in steps.items():
        for key, value in metrics.items():
            if value is not None and math.isfinite(value):
                out.setdefault(key, []).append((step, float(value)))
    return out


def log_all(sink, steps=STEPS) -> None:
    for step, metrics in steps.items():
        sink.log(step, metrics)


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in {
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
        "WANDB_DIR": str(tmp_path / "wandb_default"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """One SQLite store for the module: creating its tables takes seconds."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


# ---------------------------------------------------------------------------------------
# Backend-free parts
# ---------------------------------------------------------------------------------------


def test_scalar_metrics_skips_missing_values():
    got = scalar_metrics({"a/x": 1, "a/y": None, "a/z": float("nan"), "a/w": float("inf"), "a/b": True,
                          "a/s": "text", "a/f": 0.5})
    assert got == {"a/x": 1.0, "a/b": 1.0, "a/f": 0.5}
    assert all(type(v) is float for v in got.values())


def test_jsonl_sink_writes_null_and_truncates(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    log_all(sink)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["eval/fork_rate"] is None and rows[1]["rollout/fork_rate"] is None
    sink.truncate_after(1)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]


def test_read_metrics_reads_metrics_jsonl_gz_when_only_it_is_there(tmp_path):
    """The research data under studies/results/ is committed as ``metrics.jsonl.gz`` (a tenth of the size): a path
    naming ``metrics.jsonl`` reads it, and so does the ``.gz`` path itself; the plain file wins."""
    from cispo.foundations.jsonl import compress, has_jsonl, jsonl_path, main

    sink = JsonlSink(tmp_path / "metrics.jsonl")
    log_all(sink)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert main([str(tmp_path / "metrics.jsonl")]) == 0
    gz = tmp_path / "metrics.jsonl.gz"
    assert not (tmp_path / "metrics.jsonl").exists() and gz.read_bytes()[4:8] == b"\0\0\0\0"  # mtime 0
    assert jsonl_path(tmp_path / "metrics.jsonl") == gz and has_jsonl(tmp_path / "metrics.jsonl")
    assert read_metrics(tmp_path / "metrics.jsonl") == rows == read_metrics(gz)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 9}) + "\n")  # a plain file beside it is read
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 9}]
    again = tmp_path / "again" / "metrics.jsonl"
    again.parent.mkdir()
    again.write_text((tmp_path / "metrics.jsonl").read_text())
    assert compress(again).read_bytes() == compress(tmp_path / "metrics.jsonl").read_bytes()  # same bytes, same file
    assert read_metrics(tmp_path / "missing.jsonl") == [] and not has_jsonl(tmp_path / "missing.jsonl")
    assert main([str(gz)]) == 2  # only .jsonl files are compressed


def test_unknown_kind_is_a_value_error_with_a_suggestion(tmp_path):
    with pytest.raises(ValueError, match=r"unknown tracking sink 'tensorbord' \(did you mean 'tensorboard'\?\)"):
        make_sinks(["tensorbord"], tmp_path / "run", "run")
    with pytest.raises(ValueError, match="known: jsonl, tensorboard, wandb, mlflow"):
        make_sinks(["comet"], tmp_path / "run", "run")
    assert not (tmp_path / "run").exists()  # checked before anything is created


def test_jsonl_is_always_first_and_kinds_are_deduplicated():
    assert check_sink_kinds([]) == ["jsonl"]
    assert check_sink_kinds(["mlflow", "jsonl", "mlflow", "wandb"]) == ["jsonl", "mlflow", "wandb"]
    assert set(SINK_KINDS) == {"jsonl", "tensorboard", "wandb", "mlflow"}


@pytest.mark.parametrize(
    "kind, modules, extra",
    [
        ("tensorboard", ["torch.utils.tensorboard", "tensorboard"], "tensorboard"),
        ("wandb", ["wandb"], "wandb"),
        ("mlflow", ["mlflow"], "mlflow"),
    ],
)
def test_missing_package_names_the_pip_extra(tmp_path, monkeypatch, kind, modules, extra):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=re.escape(f"pip install 'cispo[{extra}]'")):
        make_sinks([kind], tmp_path / "run", "run", {})


def test_only_mlflow_key_rewrites_names_and_documented_names_pass_unchanged():
    names = set(re.findall(r"`((?:rollout|objective|optim|eval|perf)/[\w{}]+)`", DOCS.read_text()))
    names = {n.replace("{k}", "4") for n in names}
    assert len(names) > 30
    for name in names:
        assert mlflow_key(name) == name
    assert mlflow_key("eval/pass@4") == "eval/pass_4"
    assert mlflow_key("a//b/") == "a/b"
    assert mlflow_key("/a/./b/../c") == "a/b/c"
    assert mlflow_key("x" * 300) == "x" * 250


def test_a_failing_optional_sink_warns_once_and_is_switched_off(tmp_path):
    class Broken:
        calls = 0

        def log(self, step, metrics):
            Broken.calls += 1
            raise OSError("disk full")

        def truncate_after(self, step):
            pass

        def close(self):
            pass

    sink = MultiSink([JsonlSink(tmp_path / "metrics.jsonl"), Broken()])
    with pytest.warns(RuntimeWarning, match="Broken.log failed.*disk full"):
        sink.log(0, {"a/x": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sink.log(1, {"a/x": 2.0})
    sink.close()
    assert Broken.calls == 1
    assert [r["a/x"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 2.0]


# ---------------------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------------------


def read_tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_reads_back_the_same_names_and_values(tmp_path):
    pytest.importorskip("tensorboard")
    sinks = make_sinks(["tensorboard"], tmp_path / "run", "run", {})
    log_all(sinks)
    sinks.close()
    got = read_tensorboard(tmp_path / "run" / "tensorboard")
    want = expected_series()
    assert set(got) == set(want)  # None / NaN entries are skipped, not logged as NaN
    for name, series in want.items():
        assert [s for s, _ in got[name]] == [s for s, _ in series]
        assert [v for _, v in got[name]] == pytest.approx([v for _, v in series])  # float32 in the file


def test_tensorboard_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    first = TensorBoardSink(tmp_path)
    for step in range(6):  # the run got to step 5, its last checkpoint was step 2
        first.log(step, {"rollout/reward_mean": float(step)})
    first.close()
    resumed = TensorBoardSink(tmp_path)
    resumed.truncate_after(2)
    resumed.log(3, {"rollout/reward_mean": 30.0})
    resumed.close()
    assert read_tensorboard(tmp_path)["rollout/reward_mean"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]


# ---------------------------------------------------------------------------------------
# Weights & Biases (offline)
# ---------------------------------------------------------------------------------------


def read_wandb_history(run_file: Path) -> list[dict] | None:
    """History rows of an offline run's ``.wandb`` log, through ``wandb leet inspect --json``
    (wandb >= 0.2x); None where this wandb has no such command."""
    code = "import sys; from wandb.cli.cli import cli; sys.exit(cli())"
    out = subprocess.run([sys.executable, "-c", code, "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return None
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [r["history"]["item"] for r in rows if r.get("type") == "history"]


def test_wandb_offline_writes_the_run_and_keeps_its_id_on_resume(tmp_path, offline_wandb):
    run_dir = tmp_path / "run"
    sinks = make_sinks(["wandb"], run_dir, "my-run", {"algo": {"objective": "cispo"}, "steps": 3})
    log_all(sinks)
    sinks.close()
    run_id = json.loads((run_dir / "tracking.json").read_text())["wandb_run_id"]
    files = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0

    history = read_wandb_history(files[0])
    if history is not None:
        got: dict[str, list[tuple[int, float]]] = {}
        for item in history:
            for key, value in item.items():
                if not key.startswith("_"):
                    got.setdefault(key, []).append((item["_step"], value))
        want = expected_series()
        assert set(got) == set(want)
        for name, series in want.items():
            assert got[name] == [(s, pytest.approx(v)) for s, v in series]

    # resume: same folder, same W&B id, logging steps again does not fail
    resumed = make_sinks(["wandb"], run_dir, "my-run", {"algo": {"objective": "cispo"}, "steps": 5})
    resumed.truncate_after(1)
    resumed.log(2, {"rollout/reward_mean": 0.9})
    resumed.close()
    assert json.loads((run_dir / "tracking.json").read_text())["wandb_run_id"] == run_id
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))) >= 1


# ---------------------------------------------------------------------------------------
# MLflow (SQLite store in tmp)
# ---------------------------------------------------------------------------------------


def test_mlflow_metrics_read_back_and_resume_continues_the_run(tmp_path, monkeypatch, mlflow_uri):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    config = {"algo": {"objective": {"name": "cispo", "eps_high_is": 2.0}}, "steps": 3}
    sinks = make_sinks(["mlflow"], run_dir, "my-run", config, mlflow_experiment="cispo-tests",
                       mlflow_tracking_uri=mlflow_uri)
    log_all(sinks)
    sinks.close()
    run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"]

    client = MlflowClient(tracking_uri=mlflow_uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "my-run" and run.info.status == "FINISHED"
    assert run.data.params == {"algo.objective.name": "cispo", "algo.objective.eps_high_is": "2.0", "steps": "3"}
    assert set(run.data.metrics) == set(expected_series())  # the same names as every sink
    for name, series in expected_series().items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert got == series

    # resume: the same run continues; params are immutable (steps stays "3"), a step logged
    # again gets a second point; an exception marks the run FAILED
    with pytest.raises(KeyboardInterrupt):
        with make_sinks(["mlflow"], run_dir, "my-run", dict(config, steps=5), mlflow_experiment="cispo-tests",
                        mlflow_tracking_uri=mlflow_uri) as resumed:
            resumed.truncate_after(2)
            resumed.log(3, {"rollout/reward_mean": 2.0})
            raise KeyboardInterrupt
    assert json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"] == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.params["steps"] == "3"
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "rollout/reward_mean")) == [
        (1, 0.5), (2, 0.75), (3, 1.0), (3, 2.0)]


def test_all_sinks_together_log_the_same_names(tmp_path, monkeypatch, offline_wandb, mlflow_uri):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    run_dir = tmp_path / "run"
    sinks = make_sinks(["mlflow", "tensorboard", "wandb"], run_dir, "all", {"seed": 0})
    assert [type(s).__name__ for s in sinks.sinks] == ["JsonlSink", "MLflowSink", "TensorBoardSink", "WandbSink"]
    log_all(sinks)
    sinks.close()
    names = set(expected_series())
    assert set(read_tensorboard(run_dir / "tensorboard")) == names
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"]
    assert set(MlflowClient(tracking_uri=mlflow_uri).get_run(run_id).data.metrics) == names
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert {k for r in rows for k in r if k != "step"} == {k for m in STEPS.values() for k in m}
