"""A torn or non-UTF-8 ``samples.jsonl`` does not block ``--resume``: it is cut to
the checkpoint's step, the bad lines named, and the resumed run's samples equal the uninterrupted
run's (a real disk-full during an append left such a file)."""

import shutil

import pytest

from cispo.records.samples import SampleFile, parse_step_lines
from tests.training.test_resume_faults import damaged, original, resume  # noqa: F401  (shared fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def sample_lines(run_dir):
    return (run_dir / "samples.jsonl").read_bytes().splitlines()


@pytest.mark.parametrize("tail", [b'{"step": 3, "completion": "1+1', b'{"step": 3, "completion": "\xff\xfe\x80"}'],
                         ids=["torn", "not-utf8"])
def test_a_damaged_samples_file_is_cut_and_the_run_resumes(tiny_model, dense_task, original, damaged, tail):
    """Killed (or out of disk) while appending step 3's samples, after the checkpoint of step 2."""
    before = sample_lines(original[0])
    assert before, "the original run saved no samples: nothing is tested"
    shutil.rmtree(damaged / "checkpoints" / "step_000004")
    kept = [line for line in before if int(line.split(b'"step": ')[1].split(b",")[0]) <= 2]
    (damaged / "samples.jsonl").write_bytes(b"".join(line + b"\n" for line in kept) + tail)
    with pytest.warns(RuntimeWarning, match=r"samples.jsonl: dropped 1 unreadable line\(s\) on resume"):
        resume(tiny_model, damaged)
    assert sample_lines(damaged) == before


def test_truncate_names_each_bad_line_and_keeps_the_committed_records(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_bytes(b'{"step": 1, "c": "\xc3\xa9"}\n{"step": 2, "c": "\xff"}\n{"step": 3}\n{"step": 4, "c"')
    with pytest.warns(RuntimeWarning, match=r"line 2: UnicodeDecodeError.*line 4: JSONDecodeError"):
        SampleFile(path, max_mb=10).truncate_after(2)
    assert parse_step_lines(path)[0] == [{"step": 1, "c": "é"}]
    assert not list(tmp_path.glob(".*tmp"))
