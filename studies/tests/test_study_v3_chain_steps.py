"""The rest of part 3's report (study v3, `part=v3_chain`; protocol amendment of 2026-12-03, 07:39 UTC),
written before any part-3 result was read: steps to target per seed and the declared pairs' paired
steps-to-target differences outside the Holm family; the ≤ 50% table's note (descriptive, not (d));
the mechanism check's level per arm. Synthetic runs, by hand; and one committed gate run through
the CSV."""

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest

from cispo.records.tracking import read_metrics
from studies.mechanism_gate import gate
from studies.study_data import collect
from studies.study_report import (
    RunData,
    Settings,
    group_eval_runs,
    mechanism_level,
    q1_rows,
    q1_table,
    report,
    steps_outputs,
)
from studies.study_tables import mechanism_level_table, paired_steps

ROOT = Path(__file__).resolve().parents[2]  # the repository root
T3 = 3.182446  # t_{0.975, 3}, from a printed table (4 seeds)
T1 = 12.706205  # t_{0.975, 1} (2 runs)

# held-out accuracy at steps 0, 5, 10, 15, 20 (a run that never reaches the target is censored at 25)
CURVES = {
    "dapo": [[0, .2, .6, .6, .6], [0, .2, .4, .5, .5], [0, .1, .3, .6, .6], [0, .3, .4, .5, .5]],
    "cispo": [[0, .6, .6, .6, .6], [0, .02, .04, .02, .02], [0, .3, .6, .6, .6], [0, .2, .3, .5, .5]],
    "cispo_lowmask": [[0, .3, .6, .6, .6], [0, .6, .6, .6, .6], [0, .2, .4, .6, .6], [0, .2, .5, .6, .7]],
    "cispo_highmask": [[0, .2, .4, .5, .5], [0, .3, .4, .6, .6], [0, .6, .6, .6, .6], [0, .4, .4, .4, .4]],
}
# DAPO's finals (mean of the last 2): 0.6, 0.5, 0.6, 0.5 -> target 0.55. Steps to it, seeds 0-3 (* censored at 25):
STEPS = {"dapo": [10, "25*", 15, "25*"], "cispo": [5, "25*", 10, "25*"], "cispo_lowmask": [10, 5, 15, 15],
         "cispo_highmask": ["25*", 15, 5, "25*"]}
# the declared pairs' differences by seed (first − second), censored (first / second / both)
DIFFS = {("cispo_lowmask", "cispo"): ([10 - 5, 5 - 25, 15 - 10, 15 - 25], (0, 2, 0)),  # 5, −20, 5, −10
         ("cispo_highmask", "cispo"): ([25 - 5, 15 - 25, 5 - 10, 25 - 25], (2, 2, 1)),  # 20, −10, −5, 0
         ("cispo_lowmask", "dapo"): ([10 - 10, 5 - 25, 15 - 15, 15 - 25], (0, 2, 0))}  # 0, −20, 0, −10


def _run(part, arm, seed, accs, extra=None):
    meta = {"part": part, "role": "eval", "task": "chain", "K": "16", "arm": arm, "seed": str(seed), "lr": "0.0001",
            "run": f"{arm}__chain__K16__seed{seed}"}
    return RunData(meta, {5 * i: {"eval/accuracy": a, **(extra or {})} for i, a in enumerate(accs)})


def _groups(part="v3_chain"):
    return group_eval_runs([_run(part, arm, s, c) for arm, cs in CURVES.items() for s, c in enumerate(cs)])


def test_steps_to_target_per_seed_and_paired_by_hand():
    out = steps_outputs(_groups(), "v3_chain", Settings())
    per_seed = out["steps/v3_chain"]
    for arm, steps in STEPS.items():
        reached = sum(isinstance(s, int) for s in steps)
        assert f"| chain | 16 | 0.550 | {arm} | " + " | ".join(map(str, steps)) + f" | {reached}/4 |" in per_seed
    assert per_seed.index("| dapo |") < per_seed.index("| cispo |")  # the reference first
    assert "mean of its last 2 evaluations" in per_seed
    # by hand: mean d, s_d, half = t_3 · s_d / 2
    # cispo_lowmask − cispo: mean −5, deviations 10, −15, 10, −5 -> s² = 450 / 3 = 150,
    # half = 3.182446 · 12.247 / 2 = 19.49, so [−24.5, +14.5]
    # cispo_highmask − cispo: mean 1.25, s² = 518.75 / 3; cispo_lowmask − dapo: mean −7.5, s² = 275 / 3
    table = out["steps_paired/v3_chain"]
    for (a, b), (d, cens) in DIFFS.items():
        mean, half = sum(d) / 4, T3 * statistics.stdev(d) / 2
        row = (f"| chain | 16 | {a} − {b} | 4 | {mean:+.1f} | [{mean - half:+.1f}, {mean + half:+.1f}] "
               f"| {cens[0]} / {cens[1]} / {cens[2]} |")
        assert row in table
        assert (out[f"steps_paired/v3_chain/chain/K16/{a}-{b}"]
                == f"{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]")
    assert "| chain | 16 | cispo_lowmask − cispo | 4 | -5.0 | [-24.5, +14.5] | 0 / 2 / 0 |" in table
    assert statistics.variance(DIFFS[("cispo_lowmask", "cispo")][0]) == 150
    assert "outside the Holm family" in table and "| p |" not in table  # intervals only, no test
    assert table.count("| chain | 16 |") == 3  # the declared pairs only (not every pair of the 4 arms)


def test_paired_steps_keeps_only_shared_seeds_and_counts_censoring():
    a = {0: (10.0, True), 1: (25.0, False), 2: (15.0, True), 5: (5.0, True)}
    b = {0: (25.0, False), 1: (25.0, False), 2: (5.0, True)}
    d = paired_steps(a, b)  # seeds 0, 1, 2: d = −15, 0, 10
    assert d["seeds"] == [0, 1, 2] and d["t"].mean == pytest.approx(-5 / 3)
    assert (d["censored_a"], d["censored_b"], d["censored_both"]) == (1, 2, 1)
    assert paired_steps({0: (5.0, True)}, {0: (5.0, True)}) is None  # one shared seed: no interval


def test_steps_tables_only_for_a_family_that_declares_them():
    assert steps_outputs(_groups("main"), "main", Settings()) == {}
    assert steps_outputs(_groups("ablation"), "ablation", Settings()) == {}


def test_the_q1_table_of_v3_chain_is_labelled_descriptive_not_d():
    rows = q1_rows(_groups(), "v3_chain", Settings())
    vs_dapo = next(r for r in rows if r["base"] == "dapo")
    # cispo against dapo: d = T_cispo − 0.5·T_dapo = 5 − 5, 25 − 12.5, 10 − 7.5, 25 − 12.5 = 0, 12.5, 2.5, 12.5
    assert vs_dapo["rule"].mean == pytest.approx(27.5 / 4)
    st = Settings()
    table = q1_table(rows, st, st.q1_notes["v3_chain"])
    assert "descriptive only" in table and "not an answer to (d)" in table and "stays gated" in table
    assert "the primary, uncorrected test" not in table
    assert "the primary, uncorrected test" in q1_table(rows, st)  # other parts keep the original wording
    assert "v3_chain" not in Settings(q1_notes={}).q1_notes


def _gate_rows(late_hits, fork_share, other_share):
    """Steps 1-40: the paper's case at steps 11 .. 10 + late_hits; the mass shares as given (None: no positive W)."""
    return [{"step": s, "objective/fork_pos_lowp_above": float(11 <= s < 11 + late_hits),
             "objective/fork_pos_mass_above": fork_share, "objective/other_pos_mass_above": other_share}
            for s in range(1, 41)]


def test_mechanism_level_per_arm_by_hand():
    gates = [gate(_gate_rows(3, 0.2, 0.1)), gate(_gate_rows(5, None, 0.3))]
    assert [g["late_steps_with_paper_case"] for g in gates] == [3, 5]
    assert math.isnan(gates[1]["fork_pos_mass_above_mean"])
    table = mechanism_level_table([("chain", 16, {"cispo": gates})])
    # steps 11-40: [3, 5] -> 4 ± 12.706 · 1.414 / 1.414 = 12.7; fork share: one run, 0.2;
    # other: [0.1, 0.3] -> 0.2 ± 1.271
    assert f"| chain | 16 | cispo | 2 | 4.0 ± {T1:.1f} | 0.200 ± 0.000 | 0.200 ± {T1 * 0.1:.3f} | 1 |" in table
    assert "Descriptive only" in table


def test_mechanism_level_from_the_report_groups_skips_runs_without_the_log():
    runs = [_run("v3_chain", "cispo", s, [0.0, 0.5]) for s in (0, 1)]
    assert mechanism_level(group_eval_runs(runs), "v3_chain") is None  # the original study's runs: no table
    for r, late in zip(runs, (3, 5)):
        r.steps.update({row["step"]: {k: v for k, v in row.items() if k != "step" and v is not None}
                        for row in _gate_rows(late, 0.2, 0.1)})
    runs.append(_run("v3_chain", "cispo", 2, [0.0, 0.5]))  # no mechanism log: left out, not counted as 0
    assert "| chain | 16 | cispo | 2 | 4.0 ± " in mechanism_level(group_eval_runs(runs), "v3_chain")


def test_a_committed_gate_run_through_the_csv_gives_the_gate_figures(tmp_path):
    """The CSV now carries the mechanism check: the table's per-arm level of one gate run equals
    `mechanism_gate.gate` on its metrics.jsonl (to the CSV's 6 significant digits)."""
    src = ROOT / "studies" / "results" / "v3" / "gate" / "dapo_s100"
    run = tmp_path / "runs" / "v3_chain" / "dapo__chain__K16__seed0"
    shutil.copytree(src, run)
    (run / "study.json").write_text(json.dumps({"part": "v3_chain", "role": "eval", "arm": "dapo", "task": "chain",
                                                "K": 16, "seed": 0, "lr": 1e-4}))
    csv_path, n_runs, _, _ = collect([tmp_path / "runs"], tmp_path / "v3.csv.gz")
    assert n_runs == 1
    g = gate(read_metrics(src / "metrics.jsonl"))
    out = report(csv_path, tmp_path / "report")
    row = next(line for line in out["mechanism_check/v3_chain"].splitlines() if "| dapo |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "1" and cells[4] == f"{g['late_steps_with_paper_case']:.1f} ± 0.0"
    assert cells[5] == f"{g['fork_pos_mass_above_mean']:.3f} ± 0.000"
    assert cells[6] == f"{g['other_pos_mass_above_mean']:.3f} ± 0.000"
    assert (g["late_steps_with_paper_case"], round(g["fork_pos_mass_above_mean"], 3)) == (5, 0.125)  # queue.md's 0.1
    assert (tmp_path / "report" / "mechanism_check_v3_chain.md").exists()
    assert "steps/v3_chain" in out and "steps_paired/v3_chain" not in out  # one arm: no pair to difference
