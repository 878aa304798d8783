"""Study v4's gate (studies/results/protocol.md, amendment of 2026-12-04): v3's criteria re-based
on every response token."""

import math
from pathlib import Path

from cispo.records.tracking import read_metrics
from studies.mechanism_gate import gate_all_tokens, paper_case_all_tokens

GATE = Path(__file__).resolve().parents[1] / "results" / "v3" / "gate"


def rows(case: dict, share: dict) -> list[dict]:
    return [{"step": 0}] + [{"step": s, "objective/all_pos_lowp_above": case.get(s, 0.0),
                             "objective/all_pos_mass_above": share.get(s, math.nan)} for s in range(1, 41)]


def test_both_criteria_must_hold():
    late = {s: 1.0 for s in range(11, 26)}  # 15 of steps 11-40: exactly the threshold
    assert gate_all_tokens(rows(late, {1: 0.10}))["mechanism_acts"]
    fewer = dict(list(late.items())[:14])
    assert not gate_all_tokens(rows(fewer, {1: 0.10}))["persistence"]
    small = gate_all_tokens(rows(late, {1: 0.05, 2: 0.14, 3: math.nan}))  # NaN steps (no positive token) left out
    assert small["all_pos_mass_above_mean"] == 0.095 and not small["size"] and small["persistence"]
    early_only = gate_all_tokens(rows({s: 5.0 for s in range(1, 11)}, {1: 0.5}))
    assert early_only["late_steps_with_paper_case"] == 0 and early_only["paper_case_count_by_phase"]["1-10"] == 50.0


def test_a_v3_run_is_counted_from_its_per_string_counts():
    """Runs logged before the all-token metric: the strings and `other` partition the tokens."""
    assert paper_case_all_tokens({"fork/w/pos_lowp_above": 2.0, "fork/other/pos_lowp_above": 3.0}) == 5.0
    assert paper_case_all_tokens({"objective/all_pos_lowp_above": 4.0, "fork/w/pos_lowp_above": 9.0}) == 4.0
    assert paper_case_all_tokens({"objective/loss": 1.0}) is None


def test_the_issue_figures_recompute_from_the_v3_gate_runs():
    """Issue 46: on chain_hidden_sharp (DAPO, seed 100) the paper's case on every token occurs in 20 of
    steps 11-40 (16 of 30 at K = 32); those runs predate the mass metric, so (ii) is undefined there."""
    k16 = gate_all_tokens(read_metrics(GATE / "chain_hidden_sharp_dapo_s100" / "metrics.jsonl"))
    k32 = gate_all_tokens(read_metrics(GATE / "chain_hidden_sharp_k32_dapo_s100" / "metrics.jsonl"))
    assert k16["complete"] and k16["late_steps_with_paper_case"] == 20 and k16["persistence"]
    assert k32["late_steps_with_paper_case"] == 16 and math.isnan(k16["all_pos_mass_above_mean"])


V4_GATE = Path(__file__).resolve().parents[1] / "results" / "v4" / "gate"


def test_the_committed_v4_gate_verdicts_recompute_from_their_data():
    """studies/results.md, "Study v4": seed 101 fails persistence (9 of steps 11-40), seed 102 passes (17)."""
    import json

    for seed, late, passes in ((101, 9, False), (102, 17, True)):
        name = f"chain_hidden_sharp_dapo_s{seed}"
        assert (V4_GATE / name / "metrics.jsonl.gz").is_file()
        verdict = gate_all_tokens(read_metrics(V4_GATE / name / "metrics.jsonl"))
        committed = json.loads((V4_GATE / f"{name}.gate.json").read_text())
        assert verdict == committed and verdict["complete"]
        assert verdict["late_steps_with_paper_case"] == late and verdict["mechanism_acts"] is passes
        assert verdict["size"]  # (ii) holds on both seeds
