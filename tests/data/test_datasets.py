"""cispo.data.datasets: prompt sets from JSONL / Parquet / datasets folders, and their errors."""

from __future__ import annotations

import json
import logging

import pytest

from cispo.data.datasets import DataError, LoadReport, load_prompts, load_prompts_with_report


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


GSM = [
    {"question": "Natalia sold 48 clips. How many?", "answer": "She sold 48/2 = 24.\n#### 72", "id": 1},
    {"question": "What is 2+2?", "answer": 4, "id": 2},
]

DAPO = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Solve x+1=2."}],
        "reward_model": {"ground_truth": "1", "style": "rule"},
        "extra_info": {"index": "a1"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                   {"role": "user", "content": "What is 1/2 + 1/2?"}],
        "reward_model": {"ground_truth": "1", "style": "rule"},
        "extra_info": {"index": "a2"},
    },
]


# --------------------------------------------------------------------------- formats


def test_jsonl_gsm8k_style(tmp_path):
    p = write_jsonl(tmp_path / "gsm.jsonl", [GSM[0], "", "   ", GSM[1]])  # blank lines ignored
    samples = load_prompts(p, prompt_field="question")
    assert samples == [
        {"prompt": GSM[0]["question"], "answer": GSM[0]["answer"]},
        {"prompt": "What is 2+2?", "answer": "4"},  # numbers become strings
    ]


def test_json_extension_lines_and_array(tmp_path):
    p = write_jsonl(tmp_path / "a.json", [{"prompt": "p1", "answer": "1"}, {"prompt": "p2", "answer": "2"}])
    assert [s["prompt"] for s in load_prompts(p)] == ["p1", "p2"]
    q = tmp_path / "b.json"
    q.write_text(json.dumps([{"prompt": "p1", "answer": "1"}, {"prompt": "", "answer": "2"}]))
    with pytest.raises(DataError, match=r"b\.json: row 1: field 'prompt': empty prompt"):
        load_prompts(q)


def test_extra_fields_list_all_and_limit(tmp_path):
    p = write_jsonl(tmp_path / "gsm.jsonl", GSM)
    assert load_prompts(p, prompt_field="question", extra_fields=["id"])[1] == {
        "prompt": "What is 2+2?", "answer": "4", "id": 2}
    assert load_prompts(p, prompt_field="question", extra_fields="all")[0]["id"] == 1
    assert "question" not in load_prompts(p, prompt_field="question", extra_fields="all")[0]
    assert len(load_prompts(p, prompt_field="question", limit=1)) == 1
    with pytest.raises(ValueError, match="clashes"):
        load_prompts(p, prompt_field="question", extra_fields=["meta.answer"])


def test_answer_field_none(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "write a poem"}])
    assert load_prompts(p, answer_field=None) == [{"prompt": "write a poem"}]


def test_nested_fields_and_chat_messages(tmp_path):
    p = write_jsonl(tmp_path / "dapo.jsonl", DAPO)
    samples = load_prompts(p, answer_field="reward_model.ground_truth",
                           extra_fields=["extra_info.index", "data_source"])
    assert samples[0]["prompt"] == "Solve x+1=2."
    assert samples[0]["messages"] == DAPO[0]["prompt"]
    assert samples[0]["answer"] == "1"
    assert samples[0]["index"] == "a1" and samples[0]["data_source"] == "math_dapo"
    assert samples[1]["prompt"] == "What is 1/2 + 1/2?"  # the last user message
    # a list index in a path
    assert load_prompts(p, prompt_field="prompt.0.content", answer_field=None)[0]["prompt"] == "Be brief."


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed")
    import pyarrow.parquet as pq

    p = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(DAPO), p)
    samples = load_prompts(p, answer_field="reward_model.ground_truth", extra_fields=["data_source"])
    assert [s["prompt"] for s in samples] == ["Solve x+1=2.", "What is 1/2 + 1/2?"]
    assert samples[0]["messages"][1] == {"role": "user", "content": "Solve x+1=2."}
    assert samples[1] == {**samples[1], "answer": "1", "data_source": "math_dapo"}

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"query": "a", "answer": "1"}, {"query": "  ", "answer": "2"}]), bad)
    with pytest.raises(DataError, match=r"bad\.parquet: row 1: field 'query': empty prompt"):
        load_prompts(bad, prompt_field="query")
    with pytest.raises(DataError,
                       match=r"bad\.parquet: row 0: field 'prompt': missing prompt field \(did you mean 'query'\?\)"):
        load_prompts(bad)

    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"junk\.parquet: cannot read Parquet file"):
        load_prompts(junk)


def test_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets library is not installed")
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(3)]
    single = tmp_path / "single"
    datasets.Dataset.from_list(rows).save_to_disk(str(single))
    assert load_prompts(single, prompt_field="question")[2] == {"prompt": "q2", "answer": "2"}
    with pytest.raises(DataError, match="single Dataset"):
        load_prompts(single, prompt_field="question", split="train")

    multi = tmp_path / "multi"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(multi))
    assert len(load_prompts(multi, prompt_field="question", split="test")) == 1
    with pytest.raises(DataError, match="pass split"):
        load_prompts(multi, prompt_field="question")
    with pytest.raises(DataError, match=r"no split 'tran' \(did you mean 'train'\?\)"):
        load_prompts(multi, prompt_field="question", split="tran")
    with pytest.raises(DataError,
                       match=r"multi: row 0: field 'prompt': missing prompt field \(did you mean 'question'"):
        load_prompts(multi, split="train")

    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(DataError, match="not a datasets folder"):
        load_prompts(plain)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "row, kwargs, message",
    [
        ('{"prompt": "x", "answer": ', {}, r"line 2: invalid JSON"),
        ("[1, 2]", {}, r"line 2: expected a JSON object .*got list"),
        ({"promt": "x", "answer": "1"}, {}, r"line 2: field 'prompt': missing prompt field \(did you mean 'promt'\?\)"),
        ({"Prompt": "x", "answer": "1"}, {},
         r"line 2: field 'prompt': missing prompt field \(did you mean 'Prompt'\?\)"),
        ({"prompt": "x", "reward_model": {"ground_truth": "1"}}, {},
         r"line 2: field 'answer': missing answer field \(did you mean 'reward_model.ground_truth'\?\)"),
        ({"prompt": 3, "answer": "1"}, {},
         r"line 2: field 'prompt': prompt must be a string or a chat message list.*got int"),
        ({"prompt": "   ", "answer": "1"}, {}, r"line 2: field 'prompt': empty prompt"),
        ({"prompt": "x"}, {}, r"line 2: field 'answer': missing answer field"),
        ({"prompt": "x", "answer": None}, {}, r"line 2: field 'answer': answer is null"),
        ({"prompt": "x", "answer": [1]}, {}, r"line 2: field 'answer': answer must be a string or a number, got list"),
        ({"prompt": "x", "answer": " "}, {}, r"line 2: field 'answer': empty answer"),
        ({"prompt": [{"role": "system", "content": "s"}], "answer": "1"}, {},
         r"line 2: field 'prompt': .*no 'user' message"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, {}, r"line 2: field 'prompt': message 0 is not a"),
        ({"prompt": [{"role": "user", "content": " "}], "answer": "1"}, {}, r"line 2: field 'prompt': empty prompt"),
        ({"prompt": "x", "rm": {"ground_truth": "1"}}, {"answer_field": "rm.groundtruth"},
         r"line 2: field 'rm.groundtruth': missing answer field \(did you mean 'rm.ground_truth'\?\)"),
        ({"prompt": "x", "answer": "1"}, {"extra_fields": ["idx"]}, r"line 2: field 'idx': missing extra field"),
    ],
)
def test_row_errors_name_file_line_and_field(tmp_path, row, kwargs, message):
    first = {"prompt": "ok", "answer": "1", "rm": {"groundtruth": "1"}, "idx": 0}
    p = write_jsonl(tmp_path / "data.jsonl", [first, row])
    with pytest.raises(DataError, match=r"data\.jsonl: " + message) as info:
        load_prompts(p, **kwargs)
    assert info.value.location == "line 2"
    assert str(p) in str(info.value)


@pytest.mark.parametrize("row, field, what", [
    ('{"prompt": "What is \\ud800 2+2?", "answer": "4"}', "prompt", "the prompt"),
    ('{"prompt": [{"role": "user", "content": "ok"}, {"role": "user", "content": "x\\udfff"}], "answer": "1"}',
     "prompt", "message 1's content"),
    ('{"prompt": "x", "answer": "\\udc80"}', "answer", "the answer"),
])
def test_text_that_is_not_valid_unicode_is_refused_naming_file_line_and_field(tmp_path, row, field, what):
    """Was: a prompt holding a lone surrogate (a JSON ``\\ud800`` escape: half a UTF-16 pair) loaded, then
    ended the run in the tokenizer with a traceback naming no file or line. Now it is refused at load, in
    one line naming the file, the line and the field; with on_error="skip" the row is skipped."""
    p = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(DataError) as info:
        load_prompts(p)
    message = str(info.value)
    assert message.startswith(f"{p}: line 2: field {field!r}: {what} is not valid Unicode: a lone surrogate U+")
    assert "\n" not in message and info.value.location == "line 2"
    message.encode("utf-8")  # printable: the refusal itself holds no surrogate
    samples, report = load_prompts_with_report(p, on_error="skip")
    assert samples == [{"prompt": "ok", "answer": "1"}] and report.skipped == 1


def test_line_numbers_count_blank_lines(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, "", "", "{oops"])
    with pytest.raises(DataError, match=r"d\.jsonl: line 4: invalid JSON"):
        load_prompts(p)


def test_file_errors(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "a.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"a\.csv: unknown file type '\.csv'"):
        load_prompts(tmp_path / "a.csv")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no rows"):
        load_prompts(tmp_path / "empty.jsonl")
    p = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(DataError, match="only applies to a datasets folder"):
        load_prompts(p, split="train")
    with pytest.raises(ValueError, match="on_error"):
        load_prompts(p, on_error="ignore")


def test_skip_mode_counts_and_reports(tmp_path, caplog):
    rows = [{"prompt": "a", "answer": "1"}, "{bad", {"prompt": "", "answer": "2"}, {"prompt": "b", "answer": "3"}, [1]]
    p = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(DataError, match="line 2: invalid JSON"):
        load_prompts(p)
    samples, report = load_prompts_with_report(p, on_error="skip")
    assert [s["prompt"] for s in samples] == ["a", "b"]
    assert isinstance(report, LoadReport)
    assert (report.rows, report.loaded, report.skipped) == (5, 2, 3)
    assert len(report.errors) == 3 and "line 3: field 'prompt': empty prompt" in report.errors[1]
    assert "2 samples loaded from 5 rows, 3 skipped" in str(report)
    with caplog.at_level(logging.WARNING, logger="cispo.data.datasets"):
        assert len(load_prompts(p, on_error="skip")) == 2
    assert "3 skipped" in caplog.text

    all_bad = write_jsonl(tmp_path / "bad.jsonl", ["{", "[]"])
    with pytest.raises(DataError, match="no usable samples: all 2 rows were skipped"):
        load_prompts(all_bad, on_error="skip")


def test_a_data_file_that_is_no_regular_file_is_refused_unread(tmp_path):
    """A ``.jsonl`` that is a symlink to /dev/zero was read until memory ran out (a FIFO would block): refused
    before reading, naming the file."""
    import os

    link = tmp_path / "prompts.jsonl"
    link.symlink_to(os.devnull)  # a character device, looked at only
    with pytest.raises(DataError, match=r"prompts\.jsonl: not a regular file"):
        load_prompts(link)
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=r"pipe\.jsonl: not a regular file"):
        load_prompts(fifo)


def test_a_jsonl_line_longer_than_the_cap_is_a_bad_row_read_past(tmp_path, monkeypatch):
    """A line over `MAX_LINE_BYTES` is a bad row named by its line (was: read whole into memory, a 1 GB line an
    allocator abort); the rows after it are read, and with on_error=skip it is skipped."""
    import cispo.data.datasets as datasets

    monkeypatch.setattr(datasets, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n' + json.dumps({"prompt": "x" * 5000, "answer": "2"}) + "\n"
                    + '{"prompt": "c", "answer": "3"}\n')
    with pytest.raises(DataError, match=r"line 2.*longer than 0 MiB"):
        load_prompts(path)
    assert [s["prompt"] for s in load_prompts(path, on_error="skip")] == ["a", "c"]
