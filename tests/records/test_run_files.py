"""A run's own files under faults that are not a kill: a metrics.jsonl that
is a folder on --resume, and another writer appending to metrics.jsonl while the run logs."""

import json
import warnings

import pytest

from cispo.cli import main
from cispo.records.tracking import JsonlSink, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = ["model.device=cpu", "progress=false", "prompts_per_step=2", "group_size=2", "updates_per_batch=1",
       "num_train_prompts=8", "num_eval_prompts=2", "eval.every=0", "threads=1", "checkpoint_every=1",
       "run_name=r"]


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl"])
def test_a_run_file_that_is_a_folder_is_one_line_on_resume(tiny_model, tmp_path, capsys, name):
    args = [*RUN, f"model.path={tiny_model}", f"out_dir={tmp_path}"]
    main(["train", *args, "steps=1"])
    (tmp_path / "r" / name).unlink()
    (tmp_path / "r" / name).mkdir()
    capsys.readouterr()
    code = main(["train", "--resume", *args, "steps=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert err.splitlines()[-1].endswith("is not a file (a folder or a device?): this run folder is damaged; move it "
                                         "aside to resume the run, or start a new run")


def test_another_writer_is_noticed_once_and_its_rows_are_kept(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say while only the sink writes
        sink.log(0, {"a": 1.0})
        sink.log(1, {"a": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:  # e.g. a reward that appends to its own run's file
        f.write(json.dumps({"step": 7, "a": 9.0}) + "\n")
    with pytest.warns(RuntimeWarning, match=r"changed by another writer after step 1 \(\+\d+ bytes"):
        sink.log(2, {"a": 3.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        sink.log(3, {"a": 4.0})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 7, 2, 3]


def test_a_resumed_sink_watches_from_its_rewritten_file(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in range(3):
        sink.log(step, {"a": float(step)})
    resumed = JsonlSink(tmp_path / "metrics.jsonl")
    resumed.truncate_after(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.log(2, {"a": 5.0})
        resumed.log(3, {"a": 6.0})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
