"""Stage G of the agents search (studies/results/agents/study_g.py): the registered measure T90, the gate's four
criteria and the queue as registered (every run pending, the compare config's runs)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "results" / "agents"


@pytest.fixture(scope="module")
def g():
    spec = importlib.util.spec_from_file_location("study_g", ROOT / "study_g.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_t90_interpolates_between_the_evaluations_around_the_crossing(g):
    # 0.6 at step 3, 1.0 at step 4: 0.9 is three quarters of the way, 3.75
    assert g.t90({0: 0.07, 1: 0.1, 2: 0.3, 3: 0.6, 4: 1.0, 5: 1.0}) == (pytest.approx(3.75), False)
    assert g.t90({0: 0.07, 1: 0.5, 2: 0.9}) == (pytest.approx(2.0), False)  # exactly 0.9 at step 2
    assert g.t90({0: 0.95, 1: 1.0}) == (0.0, False)
    # a dip after the crossing does not move it; never reaching 0.9 by step 10 is censored at 11
    assert g.t90({0: 0.1, 1: 0.92, 2: 0.5}) == (pytest.approx(0.8 / 0.82), False)  # (0.9 - 0.1) / (0.92 - 0.1)
    assert g.t90({s: 0.05 * s for s in range(11)}) == (11.0, True)
    assert g.t90({0: 0.1, 5: 0.5, 12: 1.0}) == (11.0, True)  # an evaluation past step 10 does not count


def _rows(rate0=0.07, with_call=0.97, without=0.47, above=(1, 2, 3, 0, 0), mass=(0.2, 0.1, 0.1, 0.0, 0.1),
          curve=(0.07, 0.1, 0.2, 0.4, 0.6, 0.95)):
    rows = [{"step": 0, "eval/tool_call_rate": rate0, "eval/accuracy_with_fork": with_call,
             "eval/accuracy_without_fork": without}]
    for s in range(1, 11):
        r = {"step": s, "eval/tool_call_rate": curve[min(s, len(curve) - 1)]}
        if s <= 5:
            r.update({"fork/calc/pos_above": above[s - 1], "objective/all_pos_mass_above": mass[s - 1]})
        rows.append(r)
    return rows


def test_the_gate_s_four_criteria(g):
    v = g.gate(_rows())
    assert v["passed"] and v["pos_above"] == (6, True) and v["pos_mass"] == (pytest.approx(0.1), True)
    assert v["t90"][0] == (pytest.approx(4 + 0.3 / 0.35), False)
    assert not g.gate(_rows(rate0=0.02))["passed"]  # the warm start's call too rare
    assert not g.gate(_rows(rate0=0.2))["passed"]  # nor common
    assert not g.gate(_rows(with_call=0.4))["passed"]  # the call must pay
    assert not g.gate(_rows(above=(1, 1, 1, 1, 0)))["passed"]  # 4 < 5
    assert not g.gate(_rows(mass=(0.1, 0.1, 0.1, 0.05, 0.1)))["passed"]  # 0.09 < 0.10
    assert not g.gate(_rows(curve=(0.07, 0.5, 0.95)))["passed"]  # T90 = 1.9 < 3.5: no room for a speed difference
    # stage F's DAPO run of seed 0 has the mechanism in the amount the thresholds are a third of
    f = g.gate(g.read_rows(ROOT / "stageF_dapo_s0"))
    assert f["call_rate"][1] and f["pos_above"] == (17, True) and f["pos_mass"][0] == pytest.approx(0.296, abs=1e-3)


def _pending(queue: dict) -> dict:
    return {"phases": [{**p, "runs": [{**r, "state": "pending"} for r in p["runs"]]} for p in queue["phases"]]}


def test_the_queue_is_the_registered_one(g):
    queue = json.loads(g.QUEUE.read_text())
    assert _pending(queue) == g.build_queue()  # the runs as registered; their states as the last `save` read them
    assert {r["state"] for p in queue["phases"] for r in p["runs"]} <= {"pending", "started", "done"}
    queue = _pending(queue)
    counts = {p["phase"]: len(p["runs"]) for p in queue["phases"]}
    assert counts == {"precheck": 1, "gate": 2, "primary": 48, "secondary": 16}
    assert all(r["state"] == "pending" for p in queue["phases"] for r in p["runs"])
    primary = next(p for p in queue["phases"] if p["phase"] == "primary")["runs"]
    assert {r["arm"] for r in primary} == {"dapo", "cispo_lowmask", "cispo"} and {r["lr"] for r in primary} == {1e-5}
    assert [r["seed"] for r in primary[:6]] == [0, 0, 0, 1, 1, 1]  # seed by seed: a stop leaves whole pairs
    assert {r["seed"] for r in next(p for p in queue["phases"] if p["phase"] == "gate")["runs"]} == {100, 101}
    # the registered stop: a failed gate gives no comparison command
    done = {"phases": [{**p, "runs": [{**r, "state": "done"} for r in p["runs"]]} if p["phase"] in ("precheck", "gate")
                       else p for p in queue["phases"]]}
    assert g.next_step(done, verdicts=[{"passed": True}, {"passed": False}]).startswith("the gate failed")
    assert g.next_step(done, verdicts=[{"passed": True}] * 2) == queue["phases"][2]["command"]


def test_the_cispo_arm_counts_would_drop_at_dapo_s_bound(g):
    from cispo.cli import _build_config
    from studies.compare import CompareConfig, run_configs

    runs = {r.arm: r.config.algo.objective.resolve() for r in run_configs(_build_config(CompareConfig, str(g.CONFIG),
                                                                                        ["seeds=[0]"]))}
    assert {a: (o.mask_rule, o.eps_low, o.eps_high, o.eps_high_is) for a, o in runs.items()} == {
        "dapo": ("ppo", 0.2, 0.28, None), "cispo_lowmask": ("ppo-low", 0.2, 0.28, 4.0),
        "cispo": ("none", 0.2, 0.28, 4.0)}


def test_the_precheck_reads_both_parts(g):
    ref = [1.67546, 0.74352, 0.42902]
    numbers = g.eval_numbers('noise {"x": 1}\n{\n  "eval/tool_call_rate": 0.07,\n  "eval/accuracy_with_fork": 0.9,\n'
                             '  "eval/accuracy_without_fork": 0.5\n}\ncispo eval: written')
    v = g.precheck([1.6759, 0.7431, 0.4290], ref, numbers)
    assert v["a"] == (pytest.approx(4.4e-4), True) and v["b"] == ((0.07, 0.9, 0.5), True)
    assert not g.precheck([1.6770, 0.7435, 0.4290], ref, numbers)["a"][1]  # 1.4e-3 > 1e-3
    assert not g.precheck([1.67546, 0.74352], ref, numbers)["a"][1]  # a step missing
    assert not g.precheck(ref, ref, {**numbers, "eval/tool_call_rate": 0.2})["b"][1]
    assert not g.precheck(ref, ref, {**numbers, "eval/accuracy_with_fork": 0.4})["b"][1]


def _t90s(p1: list[float], p2: list[float], dapo: float = 5.0) -> dict:
    """Synthetic T90s: dapo at `dapo`, the CISPO arms faster by the given per-seed gaps."""
    return {"dapo": {s: (dapo, False) for s in range(len(p1))},
            "cispo_lowmask": {s: (dapo - d, False) for s, d in enumerate(p1)},
            "cispo": {s: (dapo - d, False) for s, d in enumerate(p2)}}


def test_the_registered_verdicts(g):
    gaps = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.3, 0.7]
    v = g.decide(_t90s(gaps, gaps))
    assert v["verdict"] == "support" and v["tests"]["P1"]["mean"] == pytest.approx(1.0)
    assert v["tests"]["P1"]["p_holm"] <= 0.05 and v["tests"]["P1"]["rejects"]
    small = [0.1, -0.1, 0.05, -0.05, 0.0, 0.1, -0.1, 0.02]
    assert g.decide(_t90s(small, small))["verdict"] == "refuted here"
    assert g.decide(_t90s(small, small), gate_passed=False)["verdict"] == "not shown either way"
    assert g.decide(_t90s(small, gaps))["verdict"] == "not the paper's mechanism"
    # a sure but small gap (0.3 step: rejected, under the 0.5 registered for support) inside the equivalence margin
    tight = g.decide(_t90s([0.3, 0.35, 0.25, 0.3, 0.3, 0.28, 0.32, 0.3], small))
    assert tight["tests"]["P1"]["rejects"] and tight["verdict"] == "refuted here"
    noisy = [3.0, -2.0, 2.5, -1.5, 1.0, -2.5, 3.0, 0.0]  # mean 0.44: neither rejected nor equivalent
    assert g.decide(_t90s(noisy, noisy))["verdict"] == "not shown either way"
    # half the steps: dapo at 5, the best CISPO arm at 4 -> 4 - 2.5 > 0, not said; at 2 it is
    assert not g.decide(_t90s(gaps, small))["half_the_steps"]["said"]
    assert g.decide(_t90s([3.0] * 4 + [3.2] * 4, small))["half_the_steps"]["said"]
    # only seeds every primary arm has count; censored runs are counted
    runs = _t90s(gaps, gaps)
    runs["cispo"].pop(7)
    runs["dapo"][0] = (11.0, True)
    v = g.decide(runs)
    assert v["seeds"] == list(range(7)) and v["censored"] == {"dapo": 1, "cispo_lowmask": 0, "cispo": 0}
    assert g.decide({"dapo": {0: (5.0, False)}})["verdict"] == "too few paired seeds to test"


def test_hodges_lehmann_is_the_median_of_walsh_averages(g):
    assert g.hodges_lehmann([1.0, 2.0, 3.0]) == 2.0
    assert g.hodges_lehmann([-1.0, 0.5, 0.5]) == pytest.approx(0.125)  # Walsh: -1, -0.25, -0.25, 0.5, 0.5, 0.5


def test_kept_runs_count_as_done_and_feed_the_gate(g, tmp_path):
    queue = json.loads(g.QUEUE.read_text())
    gate_runs = next(p for p in queue["phases"] if p["phase"] == "gate")["runs"]
    assert all(g.kept(r["dir"]).is_dir() for r in gate_runs)  # the gate's two runs are in the repository
    moved = {"phases": [{**p, "runs": [{**r, "dir": str(tmp_path / Path(r["dir"]).parent.name / Path(r["dir"]).name)}
                                        for r in p["runs"]]} for p in queue["phases"]]}
    states = {p["phase"]: {r["state"] for r in p["runs"]} for p in g.refresh(moved)["phases"]}
    assert states["gate"] == {"done"} and states["primary"] <= {"done", "pending"}  # no folder on this machine
    assert all(g.gate(g.run_rows(r["dir"]))["passed"] for r in moved["phases"][1]["runs"])
    run = tmp_path / "study_g_gate" / "dapo__x__K4__seed7"
    run.mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "checkpoints").mkdir()
    out = g.keep(run)
    try:
        assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl.gz", "summary.json"]
        assert g.read_rows(out) == [{"step": 0}]
    finally:
        import shutil

        shutil.rmtree(out)
