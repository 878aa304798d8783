"""Metric sinks. ``metrics.jsonl`` is always written: one JSON object per line, with
``step`` and the namespaced metrics of ``docs/metrics.md``. TensorBoard, Weights & Biases
and MLflow can be added beside it (``make_sinks``); each is an optional extra
(``pip install 'cispo[tensorboard]'``, ``'cispo[wandb]'``, ``'cispo[mlflow]'``).

Every sink has ``log(step, metrics)``, ``log_samples(step, records)``, ``truncate_after(step)``
and ``close()``. ``log_samples`` shows saved completions (``cispo.records.samples``; the run's
``samples.jsonl`` holds them all) as a table: TensorBoard text, a W&B table, an MLflow artifact.

* Names: the same in every sink (``rollout/reward_mean``, ``objective/frac_capped``, ...).
  The only place a name may be rewritten is ``mlflow_key`` (MLflow accepts letters, digits,
  ``_ - . / space``, so the names of ``docs/metrics.md`` pass through unchanged).
* Missing values: ``metrics.jsonl`` writes ``null`` for ``None``, NaN and +-inf; the other
  sinks skip those entries (no NaN points in the charts).
* Resume (``truncate_after(step)``, called by the runner with the checkpoint's step): the
  JSONL file drops the rows after ``step`` and any torn or NUL-filled line (a crash mid-write,
  a power loss), with a warning naming the file and line; TensorBoard's next event file starts with a
  purge marker, so the reader hides the old events after ``step`` and shows the re-logged
  ones; W&B and MLflow cannot delete points: they continue the same run (the id is kept in
  ``<run>/tracking.json``), W&B ignores (with a warning) steps at or below the last one it
  already has, MLflow keeps both values of a step logged twice. ``metrics.jsonl`` is the
  reference.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import posixpath
import re
import time
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cispo.config.train import SINK_KINDS, ConfigError, check_sink_kinds  # noqa: F401 - SINK_KINDS: make_sinks' names
from cispo.foundations.jsonl import jsonl_path, parse_step_lines

# cispo.records.samples (it imports torch) is imported where it is used: cispo.config.train imports this module
# to check sink names, and a config is checked without loading torch.

IDS_FILE = "tracking.json"  # per run folder: the W&B / MLflow run ids, for resumes


def json_safe(value):
    """``value`` with every float NaN / +-inf replaced by None, through dicts, lists and tuples:
    JSON has no NaN (``json.dumps`` would write ``NaN``, which ``jq`` and ``JSON.parse`` reject)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """The entries of ``metrics`` that are finite numbers, as floats. ``None``, NaN and +-inf
    (``null`` in metrics.jsonl) are left out, and so is anything that is not a number."""
    out = {}
    for key, value in metrics.items():
        if value is None or isinstance(value, (str, bytes)):
            continue
        try:
            number = float(value)  # int, bool, numpy scalars, 0-d tensors
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out[key] = number
    return out


def _require(module: str, extra: str, what: str):
    """Import ``module`` or raise an ImportError that names the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"the {what} sink needs the {extra!r} package, which is not installed: "
            f"pip install 'cispo[{extra}]'  ({e})"
        ) from e


SINK_PACKAGES = {"tensorboard": ("tensorboard", "TensorBoard"), "wandb": ("wandb", "W&B"),
                 "mlflow": ("mlflow", "MLflow")}
"""sink -> (the package it needs, which is also its pip extra; its name)."""


def check_sinks(kinds: Iterable[str], env=None) -> None:
    """What would stop the sinks ``kinds`` at their creation, said before a run loads any weights, as one
    `ConfigError` line: a package that is not installed (the pip extra named), or an MLflow store that MLflow
    refuses (`mlflow_store_problem`). ``env``: the environment (default ``os.environ``)."""
    env = os.environ if env is None else env
    for kind in dict.fromkeys(kinds):
        if kind in SINK_PACKAGES and not _installed(SINK_PACKAGES[kind][0]):
            package, name = SINK_PACKAGES[kind]
            raise ConfigError(f"trackers: the {name} sink needs the {package!r} package, which is not installed: "
                              f"pip install 'cispo[{package}]'")
    if "mlflow" in kinds:
        problem = mlflow_store_problem(env.get("MLFLOW_TRACKING_URI"), _allows_file_store(env))
        if problem:
            raise ConfigError(problem)


def _installed(package: str) -> bool:
    """Whether ``package`` can be imported (found without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent package
        return False


def mlflow_store_problem(uri: str | None, allow_file_store: bool) -> str | None:
    """Why MLflow would refuse the tracking store ``uri`` (``MLFLOW_TRACKING_URI``), or None: a file store (a
    ``file:`` URI or a plain path), which MLflow 3 refuses, "in maintenance mode", unless
    ``allow_file_store`` (``MLFLOW_ALLOW_FILE_STORE=true``, or an MLflow from before the refusal). None
    (unset): cispo's own SQLite store, ``<out_dir>/mlflow.db``."""
    from urllib.parse import urlparse

    if not uri or allow_file_store:
        return None
    scheme = urlparse(uri).scheme
    if scheme not in ("", "file") and not (len(scheme) == 1 and os.name == "nt"):  # C:\... is a path on Windows
        return None
    return (f"trackers: mlflow: the tracking store {uri} (MLFLOW_TRACKING_URI) is a file store, which MLflow refuses "
            "(its filesystem backend is in maintenance mode): use a database, e.g. "
            "MLFLOW_TRACKING_URI=sqlite:///mlflow.db (or leave it unset: cispo keeps <out_dir>/mlflow.db), a server "
            "http(s)://..., or set MLFLOW_ALLOW_FILE_STORE=true")


def _allows_file_store(env) -> bool:
    """Whether MLflow accepts a file store here: ``MLFLOW_ALLOW_FILE_STORE`` is true (as MLflow reads it:
    ``true`` or ``1``), or the installed MLflow has no such switch (it predates the refusal)."""
    if str(env.get("MLFLOW_ALLOW_FILE_STORE", "")).strip().lower() in ("true", "1"):
        return True
    try:
        from mlflow import environment_variables
    except ImportError:  # not installed: check_sinks has said so
        return True
    return not hasattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE")


class JsonlSink:
    """Appends ``{"step": s, **metrics}`` lines to ``path``. Another writer (a reward that appends to its
    own run's file, say) is noticed: the file no longer ends where this sink's last row did, and a
    warning says so once (the rows stay: ``metrics.jsonl`` is never rewritten behind a user's back)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.end: int | None = None  # the file's size after this sink's last row (None: not written yet)
        self.warned = False

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **json_safe(metrics)}
        with open(self.path, "a") as f:
            if self.end is not None and f.tell() != self.end and not self.warned:
                self.warned = True
                warnings.warn(f"cispo: {self.path} was changed by another writer after step {self.last_step} "
                              f"({f.tell() - self.end:+d} bytes; a reward or another process writing to it?): "
                              "rows this run did not log may be in it", RuntimeWarning, stacklevel=2)
            f.write(json.dumps(row) + "\n")
            f.flush()
            self.end, self.last_step = f.tell(), step

    def log_samples(self, step: int, records: list[dict]) -> None:
        pass  # samples.jsonl is written by cispo.records.samples.SampleFile

    def truncate_after(self, step: int) -> None:
        """Keep the rows of steps <= ``step`` (the ones a checkpoint of ``step`` committed; a
        resumed run logs the others again); drop torn or NUL-filled lines with a warning
        naming them. The file is replaced atomically."""
        from cispo.records.samples import check_run_file, replace_atomically, rows_up_to  # deferred: it loads torch

        check_run_file(self.path)
        self.end = None  # rewritten below: the next row starts a fresh watch
        if not self.path.exists():
            if step >= 0:
                warnings.warn(f"cispo: {self.path} is missing: the rows of steps 0-{step}, which the checkpoint of "
                              f"step {step} committed, are lost; the run continues from step {step + 1} and the "
                              f"file holds only the steps from there", RuntimeWarning, stacklevel=2)
            return
        kept = rows_up_to(self.path, step)
        lost = sorted(set(range(step + 1)) - {r["step"] for r in kept})
        if lost:
            warnings.warn(f"cispo: {self.path}: the rows of steps {lost} are missing although the checkpoint "
                          f"of step {step} committed them", RuntimeWarning, stacklevel=2)
        replace_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars in TensorBoard event files under ``log_dir`` (``torch.utils.tensorboard``),
    flushed at every ``log``. ``tensorboard --logdir <out_dir>`` shows every run.

    ``truncate_after(step)`` (resume): the next event file starts with a purge marker at
    ``step + 1``; TensorBoard then hides the events of earlier files at steps > ``step``,
    so a step logged again shows its new value only."""

    def __init__(self, log_dir: str | Path) -> None:
        self._module = _require("torch.utils.tensorboard", "tensorboard", "TensorBoard")
        self.log_dir = Path(log_dir)
        self._purge_step: int | None = None
        self._writer = None  # opened on the first log, so that truncate_after can set the purge step

    def log(self, step: int, metrics: dict) -> None:
        values = scalar_metrics(metrics)
        if self._writer is None:
            self._writer = self._module.SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge_step)
            self._purge_step = None
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def log_samples(self, step: int, records: list[dict]) -> None:
        """A Markdown table under the text tag ``samples`` (TensorBoard's TEXT tab)."""
        from cispo.records.samples import markdown_table

        if self._writer is None:
            self.log(step, {})
        self._writer.add_text("samples", markdown_table(records), global_step=step)
        self._writer.flush()

    def truncate_after(self, step: int) -> None:
        self.close()  # a later log opens a new file that starts with the purge marker
        self._purge_step = max(step + 1, 0)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """A Weights & Biases run: ``wandb.init(project, name=run_name, config=config_dict, ...)``,
    then ``run.log(metrics, step=step)``.

    Args:
        project: W&B project (None: ``WANDB_PROJECT`` or W&B's default).
        run_name: display name of the run.
        config_dict: the run's configuration (nested dicts are fine).
        mode: ``"online"``, ``"offline"`` (sync later with ``wandb sync <dir>/wandb/offline-run-*``),
            ``"disabled"``, or None: W&B's own choice (``WANDB_MODE``, ``wandb offline``, else online).
        dir: folder under which W&B writes its ``wandb/`` files.
        run_id: a stable id; with ``resume="allow"`` a second sink with the same id continues
            the same W&B run (``make_sinks`` keeps it in the run folder).
        **init_kwargs: passed on to ``wandb.init`` (``entity``, ``group``, ``tags``, ``settings``, ...).

    The run is created with ``reinit="create_new"``: a W&B run the caller already has open is
    neither reused nor finished. W&B requires increasing steps: on a resumed run it ignores,
    with a warning, the steps it already has."""

    def __init__(
        self,
        project: str | None,
        run_name: str | None,
        config_dict: dict | None = None,
        mode: str | None = None,
        dir: str | Path | None = None,
        run_id: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        wandb = _require("wandb", "wandb", "W&B")
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        kwargs = dict(project=project, name=run_name, config=config_dict or {}, mode=mode, id=run_id,
                      reinit="create_new", dir=None if dir is None else str(dir))
        if run_id is not None:
            kwargs["resume"] = "allow"
        kwargs.update(init_kwargs)
        self.run = wandb.init(**kwargs)
        self.run_id = self.run.id

    def log(self, step: int, metrics: dict) -> None:
        values = scalar_metrics(metrics)
        if values:
            self.run.log(values, step=step)

    def log_samples(self, step: int, records: list[dict]) -> None:
        """A ``wandb.Table`` under the key ``samples`` (columns: ``cispo.records.samples.SAMPLE_FIELDS``)."""
        import wandb

        from cispo.records.samples import SAMPLE_FIELDS

        table = wandb.Table(columns=list(SAMPLE_FIELDS), data=[[r.get(f) for f in SAMPLE_FIELDS] for r in records])
        self.run.log({"samples": table}, step=step)

    def truncate_after(self, step: int) -> None:
        pass  # W&B cannot delete logged points; see the class docstring

    def close(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


_MLFLOW_BAD_CHARS = re.compile(r"[^\w\-. /]")  # MLflow's allowed set (colon too, except on Windows)
_MLFLOW_MAX_KEY = 250


def mlflow_key(name: str) -> str:
    """The MLflow metric / param key for ``name`` — the only place a name is rewritten.

    MLflow accepts letters, digits, ``_ - . / space`` (and ``:`` outside Windows), at most
    250 characters, and no name that ``posixpath.normpath`` changes (``a//b``, ``/a``,
    ``a/./b``, ``..``). Other characters become ``_``, empty / ``.`` / ``..`` segments are
    dropped. Every name of ``docs/metrics.md`` is returned unchanged."""
    key = _MLFLOW_BAD_CHARS.sub("_", str(name))
    parts = [p for p in key.split("/") if p not in ("", ".", "..")]
    key = "/".join(parts)[:_MLFLOW_MAX_KEY].rstrip("/") or "_"
    if posixpath.normpath(key) != key:  # e.g. a segment truncated to ".."
        key = key.replace(".", "_")
    return key


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


class MLflowSink:
    """An MLflow run, through ``MlflowClient`` (no global active run is touched).

    Args:
        experiment: experiment name (created if missing). None: ``MLFLOW_EXPERIMENT_NAME`` or ``"cispo"``.
        run_name: the run's name.
        config_dict: logged as params, flattened with dotted keys (``algo.objective``); values
            longer than MLflow's limit are truncated by MLflow.
        tracking_uri: ``sqlite:///path.db``, ``http(s)://server``, ... None: MLflow's own choice
            (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the working directory).
            MLflow 3 refuses a ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE=true``.
        run_id: continue this run if the tracking store has it (a resume); else a new run.

    Keys go through ``mlflow_key``. A resumed run keeps its first params (MLflow params are
    immutable: only keys it lacks are added) and gets a second point for a step logged again."""

    def __init__(
        self,
        experiment: str | None,
        run_name: str | None,
        config_dict: dict | None = None,
        tracking_uri: str | None = None,
        run_id: str | None = None,
    ) -> None:
        _require("mlflow", "mlflow", "MLflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._Metric = Metric
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = self.client.tracking_uri
        name = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "cispo"
        exp = self.client.get_experiment_by_name(name)
        self.experiment_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        run = self._existing_run(run_id)
        if run is None:
            run = self.client.create_run(self.experiment_id, run_name=run_name)
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        have = set(run.data.params)
        params = [Param(mlflow_key(k), str(v)) for k, v in _flatten(config_dict or {}).items()]
        params = [p for p in params if p.key not in have]
        for i in range(0, len(params), 100):  # MLflow's batch limit for params
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def _existing_run(self, run_id: str | None):
        if not run_id:
            return None
        try:
            run = self.client.get_run(run_id)
        except Exception:  # not in this tracking store (deleted, or another URI): start a new run
            return None
        if run.info.experiment_id != self.experiment_id or run.info.lifecycle_stage != "active":
            return None
        return run

    def log(self, step: int, metrics: dict) -> None:
        now = int(time.time() * 1000)
        batch = [self._Metric(mlflow_key(k), v, now, int(step)) for k, v in scalar_metrics(metrics).items()]
        for i in range(0, len(batch), 1000):  # MLflow's batch limit for metrics
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_samples(self, step: int, records: list[dict]) -> None:
        """The records as the run's artifact ``samples/step_<step>.jsonl``."""
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        self.client.log_text(self.run_id, text, f"samples/step_{int(step):06d}.jsonl")

    def truncate_after(self, step: int) -> None:
        pass  # MLflow cannot delete logged points; see the class docstring

    def close(self, status: str = "FINISHED") -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, status=status)
            self.client = None


class MultiSink:
    """Several sinks as one. The first is the primary one (``metrics.jsonl``): its errors
    propagate. An error of another sink (a tracking server down, a full disk) is reported
    once per sink as a ``RuntimeWarning`` and that sink is skipped from then on, so that
    optional tracking never stops a training run.

    Usable as a context manager: on an exception the W&B run gets exit code 1 and the MLflow
    run status ``FAILED``."""

    def __init__(self, sinks: Iterable) -> None:
        self.sinks = list(sinks)
        self.failed: dict[int, str] = {}  # index in sinks -> its first error

    def _each(self, action: str, *args) -> None:
        for i, sink in enumerate(self.sinks):
            name = type(sink).__name__
            if i in self.failed:
                continue
            if i == 0:
                getattr(sink, action)(*args)
                continue
            try:
                getattr(sink, action)(*args)
            except Exception as e:  # noqa: BLE001 - optional tracking must not end the run
                self.failed[i] = f"{type(e).__name__}: {e}"
                warnings.warn(f"cispo: {name}.{action} failed, this sink is off from now on "
                              f"(metrics.jsonl is unaffected): {self.failed[i]}", RuntimeWarning, stacklevel=3)

    def log(self, step: int, metrics: dict) -> None:
        self._each("log", step, metrics)

    def log_samples(self, step: int, records: list[dict]) -> None:
        self._each("log_samples", step, records)

    def truncate_after(self, step: int) -> None:
        self._each("truncate_after", step)

    def close(self, failed: bool = False) -> None:
        for sink in self.sinks:
            try:
                if failed and isinstance(sink, WandbSink):
                    sink.close(exit_code=1)
                elif failed and isinstance(sink, MLflowSink):
                    sink.close(status="FAILED")
                else:
                    sink.close()
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"cispo: closing {type(sink).__name__} failed: {e}", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> MultiSink:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)


def _load_ids(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _save_id(run_dir: Path, key: str, value: str) -> None:
    ids = _load_ids(run_dir)
    if ids.get(key) != value:
        ids[key] = value
        (run_dir / IDS_FILE).write_text(json.dumps(ids, indent=1) + "\n")


def make_sinks(
    kinds: Iterable[str],
    run_dir: str | Path,
    run_name: str | None,
    config_dict: dict | None = None,
    *,
    wandb_project: str | None = None,
    wandb_mode: str | None = None,
    mlflow_experiment: str | None = None,
    mlflow_tracking_uri: str | None = None,
) -> MultiSink:
    """The sinks named in ``kinds`` (a subset of ``SINK_KINDS``; ``"jsonl"`` is always
    added, first) for the run folder ``run_dir``:

    * ``jsonl``: ``<run_dir>/metrics.jsonl``;
    * ``tensorboard``: event files in ``<run_dir>/tensorboard/``;
    * ``wandb``: files in ``<run_dir>/wandb/``; project ``wandb_project`` or
      ``WANDB_PROJECT`` or ``"cispo"``; mode ``wandb_mode`` or W&B's own (``WANDB_MODE``);
    * ``mlflow``: experiment ``mlflow_experiment`` or ``MLFLOW_EXPERIMENT_NAME`` or
      ``"cispo"``; store ``mlflow_tracking_uri`` or ``MLFLOW_TRACKING_URI`` or an SQLite
      file ``<run_dir>/../mlflow.db`` shared by the runs of the same ``out_dir``
      (``mlflow ui --backend-store-uri sqlite:///<out_dir>/mlflow.db``).

    The W&B and MLflow run ids are kept in ``<run_dir>/tracking.json``: a resumed run
    (same folder) continues the same W&B / MLflow run; a fresh folder (``--overwrite``)
    starts new ones. Unknown kinds raise ValueError before anything is created; a missing
    package raises ImportError naming the pip extra."""
    kinds = check_sink_kinds(kinds)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ids = _load_ids(run_dir)
    sinks: list = []
    try:
        for kind in kinds:
            if kind == "jsonl":
                sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
            elif kind == "tensorboard":
                sinks.append(TensorBoardSink(run_dir / "tensorboard"))
            elif kind == "wandb":
                run_id = ids.get("wandb_run_id") or uuid.uuid4().hex[:16]
                project = wandb_project or os.environ.get("WANDB_PROJECT") or "cispo"
                sink = WandbSink(project, run_name, config_dict, mode=wandb_mode, dir=run_dir, run_id=run_id)
                _save_id(run_dir, "wandb_run_id", sink.run_id)
                sinks.append(sink)
            elif kind == "mlflow":
                uri = (mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                       or f"sqlite:///{run_dir.resolve().parent / 'mlflow.db'}")
                problem = mlflow_store_problem(uri, _allows_file_store(os.environ))
                if problem:  # one line now, not MLflow's traceback
                    raise ConfigError(problem)
                sink = MLflowSink(mlflow_experiment, run_name, config_dict, tracking_uri=uri,
                                  run_id=ids.get("mlflow_run_id"))
                _save_id(run_dir, "mlflow_run_id", sink.run_id)
                sinks.append(sink)
    except BaseException:
        MultiSink(sinks).close(failed=True)
        raise
    return MultiSink(sinks)


def read_metrics(path: Path) -> list[dict]:
    """All rows of a ``metrics.jsonl`` (missing values as None), or of its ``metrics.jsonl.gz``
    when only that is there (the committed research data, `cispo.foundations.jsonl`); [] when
    neither is. A torn last line (a run killed mid-write, or still writing) is left out; an
    unreadable line before it is a ``ValueError`` naming the file and line."""
    path = jsonl_path(path)
    if not path.exists():
        return []
    rows, bad, last = parse_step_lines(path)
    inner = [(n, what) for n, what in bad if n != last]
    if inner:
        n, what = inner[0]
        raise ValueError(f"{path}:{n}: unreadable metrics row: {what}")
    return rows
