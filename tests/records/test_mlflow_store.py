"""An MLflow tracking URI that is a local file store (which MLflow refuses) is one line naming the way out,
said before the model loads rather than after minutes of loading."""

from __future__ import annotations

import pytest

import cispo.training.run_policy
from cispo.cli import main
from cispo.config.train import ConfigError
from cispo.records.tracking import check_sinks, mlflow_store_problem
from tests.conftest import run_args

pytestmark = pytest.mark.usefixtures("one_thread")


def test_an_mlflow_file_store_is_one_line_before_the_model_loads(tiny_model, tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    for uri in ("./mlruns", "file:///tmp/mlruns", "/tmp/mlruns"):
        assert "is a file store, which MLflow refuses" in mlflow_store_problem(uri, False)
        with pytest.raises(ConfigError, match="MLFLOW_ALLOW_FILE_STORE=true"):
            check_sinks(["mlflow"], {"MLFLOW_TRACKING_URI": uri})
    for env in ({}, {"MLFLOW_TRACKING_URI": "sqlite:///m.db"}, {"MLFLOW_TRACKING_URI": "http://host:5000"},
                {"MLFLOW_TRACKING_URI": "./mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"}):
        check_sinks(["mlflow"], env)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    monkeypatch.setattr(cispo.training.run_policy, "load_policy_for", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["train", *run_args(tiny_model, tmp_path), "trackers=mlflow", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cispo train: error: trackers: mlflow: the tracking store ")
