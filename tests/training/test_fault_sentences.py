"""Faults that once ended in a library's traceback and now end in one sentence, nothing lost: a tokenizer
larger than the model, deeply nested JSON, a deleted metrics.jsonl."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from cispo.cli import main
from cispo.data.datasets import DataError, load_prompts
from cispo.records.tracking import JsonlSink, read_metrics
from tests.conftest import strip_perf
from tests.records.test_runfolder import tiny_args
from tests.training.test_resume_faults import damaged, original, resume  # noqa: F401  (shared fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_tokenizer_larger_than_the_model_is_one_sentence(tiny_model, dense_task, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.add_tokens([f"<extra_{i}>" for i in range(40)])  # ids past the embedding's rows
    tok.save_pretrained(str(model))
    assert main(["train", *tiny_args(model, tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer has {len(tok)} tokens but the model's embedding only" in err, err
    assert "Traceback" not in err and "IndexError" not in err
    assert main(["eval", "--model", str(model), "num_eval_prompts=2", "eval.num_samples=1"]) == 2
    assert "the tokenizer has" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_deeply_nested_json_names_the_file_and_line(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    deep = "[" * 100_000 + "]" * 100_000
    if suffix == ".jsonl":
        path.write_text('{"prompt": "fine", "answer": "1"}\n{"prompt": ' + deep + ', "answer": "2"}\n')
        where = r"line 2"
    else:
        path.write_text("[" + deep + "]")
        where = ""
    with pytest.raises(DataError, match=rf"data{suffix}.*{where}.*nested too deeply"):
        load_prompts(path)


def test_a_deleted_metrics_file_is_said_on_resume(tiny_model, dense_task, original, damaged):
    (damaged / "metrics.jsonl").unlink()
    shutil.rmtree(damaged / "checkpoints" / "step_000004")
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl is missing: the rows of steps 0-2, which the checkpoint"):
        resume(tiny_model, damaged)
    assert [r["step"] for r in read_metrics(damaged / "metrics.jsonl")] == [3, 4]
    assert strip_perf(read_metrics(damaged / "metrics.jsonl")) == original[1][3:]


def test_truncating_a_missing_file_before_any_step_is_silent(tmp_path, recwarn):
    JsonlSink(tmp_path / "metrics.jsonl").truncate_after(-1)  # a fresh run: nothing was committed
    assert not recwarn.list
