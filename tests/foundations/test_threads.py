"""The thread-count rule of cispo.foundations.threads: how many intra-op threads a run
uses, from the machine, the user's setting and OMP_NUM_THREADS."""

import pytest

import cispo.foundations.threads as threads
from cispo.foundations.threads import auto_threads, pick_threads


@pytest.mark.parametrize("cpus, load, expected", [
    (2, 0.0, 2), (2, 0.99, 2),  # the other core is idle
    (2, 1.0, 1), (2, 3.5, 1),  # busy: a second thread would wait for a core
    (1, 0.0, 1),  # one core
    (16, 14.9, 2), (16, 15.0, 1), (16, 0.0, 2),  # never more than 2 (only 1 vs 2 is measured)
])
def test_rule(cpus, load, expected):
    assert pick_threads(None, cpus, load) == expected


def test_user_override_wins():
    assert pick_threads(1, 16, 0.0) == 1
    assert pick_threads(4, 2, 9.0) == 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_override(bad):
    with pytest.raises(ValueError, match="threads must be an int >= 1 or None"):
        pick_threads(bad, 2, 0.0)


def test_auto_reads_the_machine(monkeypatch):
    monkeypatch.setattr(threads, "cpu_count", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert auto_threads(None) == 2
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.7, 0.0, 0.0))
    assert auto_threads(None) == 1
    assert auto_threads(3) == 3
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: two processes share the two cores
    assert auto_threads(None) == 1


def test_omp_num_threads_counts_as_a_request(monkeypatch):
    monkeypatch.setattr(threads, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert auto_threads(None) == 1
    assert auto_threads(2) == 2  # the config's value wins over the environment
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset-like values: the rule
    assert auto_threads(None) == 2


def test_a_resumed_run_keeps_its_recorded_thread_count(tmp_path):
    from cispo.training.run import run_threads

    assert run_threads(None, tmp_path) is None  # no meta.json: picked by load, as at a first start
    (tmp_path / "meta.json").write_text('{"torch_threads": 2}')
    assert run_threads(None, tmp_path) == 2  # not today's load: float sums may depend on the count
    assert run_threads(1, tmp_path) == 1  # the user's explicit count still wins
