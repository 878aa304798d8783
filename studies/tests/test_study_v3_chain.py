"""The report of part 3 of study v3 (`part=v3_chain`; protocol amendment of 2026-12-03, 07:39 UTC):
one declared Holm family of 3 pairs × final and mean accuracy (6 tests), and Wilson intervals for
both the never-learned and the collapsed counts. Synthetic runs, 4 arms × 8 seeds, by hand."""

import pytest

from studies.stats import paired_t, wilson
from studies.study_report import (
    RunData,
    Settings,
    collapse_counts,
    collapse_table,
    comparisons,
    comparisons_table,
    group_eval_runs,
    holm_of_declared,
    load_study,
    report,
)
from studies.study_tables import comparison_values, count_values, drop_steps, drop_table

# Per arm and seed (m, f): the held-out curve is [0, m, f, f] at steps 0, 5, 10, 15, so
# final (mean of the last 2) = f and mean over training (steps > 0) = (m + 2f) / 3.
CURVES = {
    # seed 3 never learns: peak 0.04 < 0.1
    "cispo": [(0.30, 0.50)] * 3 + [(0.02, 0.04)] + [(0.30, 0.50)] * 4,
    "dapo": [(0.30, 0.50), (0.32, 0.52), (0.28, 0.54), (0.30, 0.50), (0.30, 0.48), (0.32, 0.54), (0.30, 0.52),
             (0.36, 0.50)],
    "cispo_lowmask": [(0.40, 0.56), (0.36, 0.60), (0.30, 0.58), (0.34, 0.54), (0.38, 0.62), (0.32, 0.56),
                      (0.40, 0.60), (0.34, 0.58)],
    # seed 4 collapses: peak 0.60 at step 5, then 0.20 < 0.30 to the end
    "cispo_highmask": [(0.30, 0.48), (0.28, 0.50), (0.34, 0.52), (0.30, 0.46), (0.60, 0.20), (0.26, 0.50),
                       (0.32, 0.48), (0.30, 0.52)],
}

# The paired differences by seed, worked out by hand from CURVES (mean: (Δm + 2Δf) / 3).
DIFFS = {
    ("cispo_lowmask", "cispo", "final_accuracy"): [0.06, 0.10, 0.08, 0.50, 0.12, 0.06, 0.10, 0.08],
    ("cispo_lowmask", "cispo", "mean_accuracy"): [0.22 / 3, 0.26 / 3, 0.16 / 3, 1.32 / 3, 0.32 / 3, 0.14 / 3, 0.30 / 3,
                                                  0.20 / 3],
    ("cispo_highmask", "cispo", "final_accuracy"): [-0.02, 0.0, 0.02, 0.42, -0.30, 0.0, -0.02, 0.02],
    ("cispo_highmask", "cispo", "mean_accuracy"): [-0.04 / 3, -0.02 / 3, 0.08 / 3, 1.12 / 3, -0.30 / 3, -0.04 / 3,
                                                   -0.02 / 3, 0.04 / 3],
    ("cispo_lowmask", "dapo", "final_accuracy"): [0.06, 0.08, 0.04, 0.04, 0.14, 0.02, 0.08, 0.08],
    ("cispo_lowmask", "dapo", "mean_accuracy"): [0.22 / 3, 0.20 / 3, 0.10 / 3, 0.12 / 3, 0.36 / 3, 0.04 / 3, 0.26 / 3,
                                                 0.14 / 3],
}


def _groups(arms=tuple(CURVES)):
    runs = []
    for arm in arms:
        for seed, (m, f) in enumerate(CURVES[arm]):
            meta = {"part": "v3_chain", "role": "eval", "task": "chain", "K": "16", "arm": arm, "seed": str(seed),
                    "lr": "0.0001", "run": f"{arm}__chain__K16__seed{seed}"}
            runs.append(RunData(meta, {5 * i: {"eval/accuracy": a} for i, a in enumerate([0.0, m, f, f])}))
    return group_eval_runs(runs)


def test_the_v3_chain_family_is_the_declared_six_tests_with_holm_by_hand():
    rows = comparisons(_groups(), "v3_chain", Settings())
    got = {(r["a"], r["b"], r["measure"]): r for r in rows}
    assert set(got) == set(DIFFS) and {r["family"] for r in rows} == {6}
    for key, d in DIFFS.items():
        assert got[key]["t"].mean == pytest.approx(sum(d) / 8) and got[key]["t"].n == 8
    p = {key: paired_t(d).p for key, d in DIFFS.items()}
    # Holm by hand: the order of the raw p-values, then p_(j) · (6 − j + 1), made monotone, capped at 1
    ld_f, ld_m = ("cispo_lowmask", "dapo", "final_accuracy"), ("cispo_lowmask", "dapo", "mean_accuracy")
    lc_m, lc_f = ("cispo_lowmask", "cispo", "mean_accuracy"), ("cispo_lowmask", "cispo", "final_accuracy")
    hc_m, hc_f = ("cispo_highmask", "cispo", "mean_accuracy"), ("cispo_highmask", "cispo", "final_accuracy")
    order = [ld_f, ld_m, lc_m, lc_f, hc_m, hc_f]
    assert sorted(p, key=p.get) == order
    expected = {ld_f: 6 * p[ld_f]}
    expected[ld_m] = max(expected[ld_f], 5 * p[ld_m])
    expected[lc_m] = max(expected[ld_m], 4 * p[lc_m])
    expected[lc_f] = max(expected[lc_m], 3 * p[lc_f])
    expected[hc_m] = max(expected[lc_f], min(1.0, 2 * p[hc_m]))
    expected[hc_f] = max(expected[hc_m], min(1.0, 1 * p[hc_f]))
    # the monotone step binds twice here: 5·p(ld, mean) < 6·p(ld, final), 3·p(lc, final) < 4·p(lc, mean)
    assert 5 * p[ld_m] < 6 * p[ld_f] and 3 * p[lc_f] < 4 * p[lc_m] and expected[hc_f] == 1.0
    for key in order:
        assert got[key]["holm_p"] == pytest.approx(expected[key], rel=1e-12)
    # only cispo_lowmask − dapo survives Holm at 5% (raw p of cispo_lowmask − cispo ≈ 0.03 does not)
    assert [k for k in order if got[k]["holm_p"] <= 0.05] == [ld_f, ld_m] and p[lc_m] < 0.05
    table = comparisons_table(rows, Settings().families["v3_chain"])
    assert table.count("| 6 | yes |") == 2 and table.count("| 6 | no |") == 4
    assert "not as an answer to (b)" in table


def test_a_declared_family_keeps_its_size_when_an_arm_is_missing():
    """Without cispo_highmask's runs 4 tests run; Holm still counts 6 (the missing two as p = 1),
    so the four keep the adjusted p-values of the full family (theirs are the 4 smallest)."""
    full = {(r["a"], r["b"], r["measure"]): r["holm_p"] for r in comparisons(_groups(), "v3_chain", Settings())}
    rows = comparisons(_groups(("cispo", "dapo", "cispo_lowmask")), "v3_chain", Settings())
    assert len(rows) == 4 and {r["family"] for r in rows} == {6}
    for r in rows:
        assert r["holm_p"] == pytest.approx(full[(r["a"], r["b"], r["measure"])], rel=1e-12)
    assert holm_of_declared([0.01, 0.04], 4) == pytest.approx([0.04, 0.12])  # 4·0.01, max(0.04, 3·0.04)
    assert holm_of_declared([0.01, 0.04], None) == pytest.approx([0.02, 0.04])  # the plain Holm of m = 2


def test_wilson_intervals_of_the_never_learned_and_collapsed_counts():
    # Wilson(0, n) = [0, z² / (n + z²)]: 3.8416 / 11.8416 = 0.3244 (the amendment's [0.00, 0.32])
    assert wilson(0, 8) == pytest.approx((0.0, 1.959964 ** 2 / (8 + 1.959964 ** 2)), abs=1e-6)
    assert wilson(0, 8)[1] == pytest.approx(0.3244, abs=1e-4)
    # the amendment's quoted intervals for 6 and 5 of 8
    assert [round(v, 2) for v in wilson(6, 8)] == [0.41, 0.93] and [round(v, 2) for v in wilson(5, 8)] == [0.31, 0.86]
    table = collapse_table(_groups(), "v3_chain", Settings())
    # Wilson(1, 8): (0.125 + z²/16 ± z·sqrt(0.125·0.875/8 + z²/256)) / (1 + z²/8) = [0.022, 0.471]
    lo, hi = wilson(1, 8)
    assert (round(lo, 3), round(hi, 3)) == (0.022, 0.471)
    lo7, hi7 = wilson(0, 7)
    assert f"| chain | 16 | cispo | 0.0001 | 7 | 0 | 0.00 | [{lo7:.2f}, {hi7:.2f}] | 1 | [0.02, 0.47] |" in table
    assert "| chain | 16 | cispo_lowmask | 0.0001 | 8 | 0 | 0.00 | [0.00, 0.32] | 0 | [0.00, 0.32] |" in table
    assert "| chain | 16 | cispo_highmask | 0.0001 | 8 | 1 | 0.12 | [0.02, 0.47] | 0 | [0.00, 0.32] |" in table


def test_the_quotable_values_are_the_tables_rows():
    """``diff/...`` is the comparisons table's row (mean, unadjusted CI, Holm p) and ``never/...`` /
    ``collapsed/...`` the collapse table's counts with their Wilson intervals, for a doc to quote."""
    rows = comparisons(_groups(), "v3_chain", Settings())
    values = comparison_values(rows, "v3_chain")
    t = paired_t(DIFFS[("cispo_lowmask", "dapo", "mean_accuracy")])  # mean 1.44 / 24 = 0.060, no rounding tie
    lo_dapo = next(r for r in rows if (r["a"], r["b"], r["measure"]) == ("cispo_lowmask", "dapo", "mean_accuracy"))
    assert values["diff/v3_chain/chain/K16/mean_accuracy/cispo_lowmask-dapo"] == \
        f"+0.060 [{t.lo:+.3f}, {t.hi:+.3f}], Holm p {lo_dapo['holm_p']:.2g}"
    assert len(values) == 6
    counts = count_values("v3_chain", collapse_counts(_groups(), "v3_chain", Settings()))
    assert counts["never/v3_chain/chain/K16/cispo"] == "1 of 8 [0.02, 0.47]"
    assert counts["collapsed/v3_chain/chain/K16/cispo"] == "0 of 7 [0.00, 0.35]"  # z²/(7 + z²) = 0.354
    assert counts["collapsed/v3_chain/chain/K16/cispo_highmask"] == "1 of 8 [0.02, 0.47]"
    assert counts["never/v3_chain/chain/K16/dapo"] == "0 of 8 [0.00, 0.32]"


def _csv(path, part, run, accs):
    cols = "part,role,arm,spec,objective,task,K,seed,lr,prompts_per_step,group_size,warmup_updates,steps,eval_k,run," \
           "wall_s,commit,base_model,step,eval/accuracy"
    lines = [f"{part},eval,cispo,cispo,cispo,chain,16,0,0.0001,16,8,16,10,4,{run},60,abc,builtin:x,{5 * i},{a}"
             for i, a in enumerate(accs)]
    path.write_text(cols + "\n" + "\n".join(lines) + "\n")


def test_two_data_files_are_parts_side_by_side_and_a_run_in_both_is_an_error(tmp_path):
    _csv(tmp_path / "a.csv", "main", "cispo__chain__K16__seed0", [0.0, 0.5, 0.6])
    _csv(tmp_path / "b.csv", "v3_chain", "cispo__chain__K16__seed0", [0.0, 0.2, 0.3])
    runs = load_study([tmp_path / "a.csv", tmp_path / "b.csv"])
    assert sorted(r.meta["part"] for r in runs) == ["main", "v3_chain"]
    out = report([tmp_path / "a.csv", tmp_path / "b.csv"])
    assert "summary/main" in out and "summary/v3_chain" in out
    assert out["hours/main"] == out["hours/v3_chain"]
    assert float(out["hours/total"]) == pytest.approx(2 * 60 / 3600, abs=0.01)
    _csv(tmp_path / "c.csv", "main", "cispo__chain__K16__seed0", [0.0, 0.1, 0.1])
    with pytest.raises(ValueError, match=r"c.csv:2: run cispo__chain__K16__seed0 of part main is also in .*a.csv"):
        load_study([tmp_path / "a.csv", tmp_path / "c.csv"])
    with pytest.raises(ValueError, match="a data file is given twice: .*a.csv"):
        load_study([tmp_path / "a.csv", tmp_path / "b.csv", tmp_path / "a.csv"])


def test_post_hoc_drops_by_hand():
    """A drop: below half the peak so far (once that peak is >= 0.1), recovered or not."""
    # peak so far 0.44 at step 10, 0.05 at 15 (< 0.22: drop), 0.23 at 20 (not), peak 0.5, 0.2 at 30 (< 0.25: drop)
    assert drop_steps({0: 0.0, 5: 0.05, 10: 0.44, 15: 0.05, 20: 0.23, 25: 0.5, 30: 0.2}, 0.1) == [15, 30]
    assert drop_steps({0: 0.0, 5: 0.08, 10: 0.03}, 0.1) == []  # the peak never reached the floor
    curve = {0: 0.0, 5: 0.05, 10: 0.44, 15: 0.05, 20: 0.23, 25: 0.5, 30: 0.2}
    table = drop_table([("chain", 16, "cispo", {0: {0: 0.0, 5: 0.5}, 1: curve}),
                        ("chain", 16, "dapo", {0: {0: 0.0}, 1: {0: 0.3}})], 0.1)
    lo, hi = wilson(1, 2)
    # seed 1: peak 0.5, lowest at a drop 0.05 (step 15), last 0.2; drops at 15 and 30
    assert f"| chain | 16 | cispo | 2 | 1 | [{lo:.2f}, {hi:.2f}] | 1: 0.500, 0.050 (15), 0.200; 15, 30 |" in table
    assert "| chain | 16 | dapo | 2 | 0 | [0.00, 0.66] | none |" in table and "**Post hoc**" in table
