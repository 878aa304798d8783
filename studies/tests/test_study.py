"""The study's raw-data file and its regeneration: synthetic run folders -> CSV -> every table,
checked against numbers worked out by hand; and the check that studies/results.md quotes them."""

import gzip
import json
import math
import statistics
from pathlib import Path

import pytest

from cispo.config.train import TrainConfig, apply_overrides, save_yaml
from studies.cli import main
from studies.stats import fieller_ratio, paired_t
from studies.study_data import COLUMNS, collect, read_csv
from studies.study_report import (
    MARKER,
    Settings,
    check_doc,
    comparisons,
    group_eval_runs,
    load_study,
    report,
    update_doc,
)

ROOT = Path(__file__).resolve().parents[2]  # the repository root

# held-out accuracy at steps 0, 2, 4, 6, 8 per (arm, seed); final = mean of the last two
CURVES = {
    ("dapo", 0): [0.0, 0.2, 0.4, 0.6, 0.8], ("dapo", 1): [0.0, 0.2, 0.4, 0.65, 0.68],
    ("dapo", 2): [0.0, 0.1, 0.3, 0.6, 0.9],
    ("cispo", 0): [0.0, 0.5, 0.8, 0.8, 0.8], ("cispo", 1): [0.0, 0.8, 0.8, 0.9, 0.9],
    ("cispo", 2): [0.0, 0.4, 0.6, 0.8, 0.85],
    ("grpo", 0): [0.0, 0.6, 0.2, 0.1, 0.1],  # collapsed: below 0.3 after its peak, to the end
    ("grpo", 1): [0.0, 0.05, 0.05, 0.05, 0.05],  # never learned (peak 0.05 < 0.1)
    ("grpo", 2): [0.0, 0.3, 0.5, 0.6, 0.7],
}
TUNING = {1e-4: [0.0, 0.2, 0.4, 0.5, 0.5], 3e-4: [0.0, 0.5, 0.6, 0.6, 0.7]}  # dapo, seed 100: means 0.4 and 0.6
# a two-K sweep: at K = 1 CISPO = DAPO; at K = 4 CISPO is 0.1 (seed 0) and 0.2 (seed 1) higher at every step > 0
SWEEP = {
    ("dapo", 1, 0): [0.0, 0.2, 0.3, 0.4, 0.5], ("dapo", 1, 1): [0.0, 0.1, 0.2, 0.3, 0.4],
    ("cispo", 1, 0): [0.0, 0.2, 0.3, 0.4, 0.5], ("cispo", 1, 1): [0.0, 0.1, 0.2, 0.3, 0.4],
    ("dapo", 4, 0): [0.0, 0.3, 0.4, 0.5, 0.6], ("dapo", 4, 1): [0.0, 0.2, 0.3, 0.4, 0.5],
    ("cispo", 4, 0): [0.0, 0.4, 0.5, 0.6, 0.7], ("cispo", 4, 1): [0.0, 0.4, 0.5, 0.6, 0.7],
}


def _write_run(folder: Path, accs: list[float], meta: dict | None, wall_s: float | None = None,
               finished: bool = True) -> None:
    folder.mkdir(parents=True)
    if finished:
        (folder / "summary.json").write_text("{}")
    rows = []
    for step in range(9):
        r = {"step": step}
        if step % 2 == 0:
            r.update({"eval/accuracy": accs[step // 2], "eval/accuracy_greedy": accs[step // 2] / 2})
        if step > 0:
            r.update({"rollout/response_length": 10.0 + step, "rollout/fork_tokens_per_response": step % 2,
                      "objective/frac_capped": 0.01, "perf/step_s": 20.0})
        rows.append(r)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "meta.json").write_text(json.dumps({"git_commit": "0123456789abcdef0123", "seed": 0}))
    if meta is not None:
        (folder / "study.json").write_text(json.dumps({**meta, "wall_s": wall_s, "base_model": "builtin:feedc0ffee12"}))


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The run folders of a small study, its CSV and the report's outputs."""
    root = tmp_path_factory.mktemp("study")
    base = {"part": "main", "task": "chain", "K": 16, "prompts_per_step": 16, "group_size": 8, "warmup_updates": 16,
            "steps": 8, "eval_k": 4}
    for (arm, seed), accs in CURVES.items():
        _write_run(root / "main" / f"{arm}__chain__K16__seed{seed}", accs,
                   {**base, "role": "eval", "arm": arm, "spec": arm, "objective": arm, "seed": seed, "lr": 1e-4},
                   3600.0)
    for lr, accs in TUNING.items():
        _write_run(root / "main" / f"tune_lr{lr:g}__dapo__chain__K16__seed100", accs,
                   {**base, "role": "tune", "arm": "dapo", "spec": "dapo", "objective": "dapo", "seed": 100, "lr": lr},
                   1800.0)
    for (arm, k, seed), accs in SWEEP.items():
        _write_run(root / "ksweep" / f"{arm}__chain__K{k}__seed{seed}", accs,
                   {**base, "part": "ksweep", "K": k, "role": "eval", "arm": arm, "spec": arm, "objective": arm,
                    "seed": seed, "lr": 1e-4}, 360.0)
    plain = root / "extra" / "cispo__addition__seed0"  # a `cispo train` folder: config.yaml, no study.json
    _write_run(plain, [0.1, 0.2, 0.3, 0.4, 0.5], None)
    from cispo.training.setup import eval_defaults  # as `cispo train` saves it: the task's evaluation sizes filled in

    overrides = ["seed=0", "updates_per_batch=4", "algo.objective.eps_high_is=2"]
    save_yaml(eval_defaults(apply_overrides(TrainConfig(), overrides)), plain / "config.yaml")
    # a run still going (no summary.json): its half curve must not enter the data
    _write_run(root / "main" / "cispo__chain__K16__seed3", [0.0, 0.9, 0.9, 0.9, 0.9],
               {**base, "role": "eval", "arm": "cispo", "spec": "cispo", "objective": "cispo", "seed": 3, "lr": 1e-4},
               finished=False)
    csv_path, n_runs, n_rows, unfinished = collect([root], root / "study.csv.gz")
    assert unfinished == [root / "main" / "cispo__chain__K16__seed3"]
    return root, csv_path, n_runs, n_rows, report(csv_path, root / "report")


def test_the_csv_holds_every_run_and_step_and_is_reproducible(study):
    root, csv_path, n_runs, n_rows, _ = study
    assert (n_runs, n_rows) == (20, 20 * 9)
    rows = read_csv(csv_path)
    assert list(rows[0]) == COLUMNS and len(rows) == n_rows
    cispo1 = [r for r in rows if r["run"] == "cispo__chain__K16__seed1"]
    assert [r["eval/accuracy"] for r in cispo1] == ["0", "", "0.8", "", "0.8", "", "0.9", "", "0.9"]
    assert cispo1[3]["rollout/response_length"] == "13" and cispo1[0]["rollout/response_length"] == ""
    assert {(r["arm"], r["K"], r["seed"], r["lr"], r["wall_s"], r["role"], r["commit"], r["base_model"])
            for r in cispo1} == {("cispo", "16", "1", "0.0001", "3600", "eval", "0123456789ab", "builtin:feedc0ffee12")}
    plain = [r for r in rows if r["part"] == "extra"]
    assert ({(r["arm"], r["K"], r["role"], r["wall_s"], r["eval_k"]) for r in plain}
            == {("cispo(eps_high_is=2.0)", "4", "eval", "", "4")})
    again, _, _, _ = collect([root], root / "again.csv.gz")
    assert again.read_bytes() == csv_path.read_bytes()  # no timestamp in the gzip stream
    assert gzip.decompress(csv_path.read_bytes()).decode().splitlines()[0] == ",".join(COLUMNS)


def test_the_csv_is_the_same_from_compressed_run_files(study, tmp_path):
    """Run folders whose ``metrics.jsonl`` is ``metrics.jsonl.gz`` (the research data as committed)
    give the same CSV, byte for byte; the unfinished run is still left out."""
    import shutil

    from cispo.foundations.jsonl import compress

    root, csv_path, n_runs, n_rows, _ = study
    copy = shutil.copytree(root, tmp_path / "study", ignore=shutil.ignore_patterns("*.csv.gz", "report"))
    for m in sorted(copy.rglob("metrics.jsonl")):
        compress(m)
    assert not list(copy.rglob("metrics.jsonl"))
    again, runs, rows, unfinished = collect([copy], tmp_path / "again.csv.gz")
    assert (runs, rows) == (n_runs, n_rows) and unfinished == [copy / "main" / "cispo__chain__K16__seed3"]
    assert again.read_bytes() == csv_path.read_bytes()


def test_the_committed_run_files_are_compressed():
    """A fresh clone stays small: no plain JSONL file over 100 KB under studies/results/
    (`python -m cispo.foundations.jsonl FILE.jsonl...` compresses one in place)."""
    big = [str(f.relative_to(ROOT)) for f in (ROOT / "studies" / "results").rglob("*.jsonl")
           if f.stat().st_size > 100_000]
    assert not big, f"compress these with `python -m cispo.foundations.jsonl`: {big}"


def _pm(values, p=3):
    """mean ± t_{.975, n-1} s / sqrt(n), from the standard library (not the code under test)."""
    half = {2: 4.302653, 1: 12.706205}[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return f"{statistics.mean(values):.{p}f} ± {half:.{p}f}"


def test_summary_by_hand(study):
    *_, out = study
    summary = out["summary/main"]
    # finals (mean of the last two evaluations): cispo 0.8, 0.9, 0.825; dapo 0.7, 0.665, 0.75 -> target 0.705;
    # steps to it: cispo 4, 2, 6; dapo 8, never (censored at 8 + 2 = 10), 8; greedy = half the sampled accuracy;
    # steps to 90% of own final: cispo 4, 6, 6; response length over steps 4..8 = 16; W per response 0.4
    assert (f"| chain | 16 | cispo | 0.0001 | 3 | {_pm([0.8, 0.9, 0.825])} | {_pm([0.4, 0.45, 0.4125])} "
            f"| {_pm([0.725, 0.85, 0.6625])} | {_pm([4, 2, 6], 1)} | 3/3 | {_pm([4, 6, 6], 1)} | 16.0 ± 0.0 "
            "| 0.40 ± 0.00 | 0/3 |") in summary
    assert f"| chain | 16 | dapo | 0.0001 | 3 | {_pm([0.7, 0.665, 0.75])} |" in summary
    assert f"| {_pm([8, 10, 8], 1)} | 2/3 | {_pm([8, 6, 8], 1)} |" in summary
    assert "| chain | 16 | cispo | n/a | 0.010 ± 0.000 | n/a |" in out["mechanism/main"]  # frac_capped 0.01 each step


def test_the_main_family_is_all_pairs_by_three_measures_with_holm(study):
    *_, csv_path, _, _, out = study
    rows = comparisons(group_eval_runs(load_study(csv_path)), "main", Settings())
    assert {(r["a"], r["b"]) for r in rows} == {("cispo", "dapo"), ("cispo", "grpo"), ("dapo", "grpo")}
    assert {r["measure"] for r in rows} == {"final_accuracy", "mean_accuracy", "steps_to_90"}
    assert len(rows) == 9 and {r["family"] for r in rows} == {9}
    mean_acc = next(r for r in rows if (r["a"], r["b"], r["measure"]) == ("cispo", "dapo", "mean_accuracy"))
    # per seed: 0.725 − 0.5, 0.85 − 0.4825, 0.6625 − 0.475
    assert mean_acc["t"].mean == pytest.approx((0.225 + 0.3675 + 0.1875) / 3)
    ps = sorted(r["t"].p for r in rows)
    assert min(r["holm_p"] for r in rows) == pytest.approx(min(1, 9 * ps[0]))
    t = mean_acc["t"]
    assert (f"| chain | 16 | mean accuracy | cispo − dapo | 3 | {t.mean:+.3f} | [{t.lo:+.3f}, {t.hi:+.3f}] "
            f"| {t.p:.3g} | {mean_acc['holm_p']:.3g} | 9 |") in out["comparisons/main"]


def test_the_ksweep_family_and_the_slope_on_log2_k(study):
    *_, csv_path, _, _, out = study
    rows = comparisons(group_eval_runs(load_study(csv_path)), "ksweep", Settings())
    assert {(r["K"], r["a"], r["b"], r["measure"]) for r in rows} == {
        (k, "cispo", "dapo", m) for k in (1, 4) for m in ("final_accuracy", "steps_to_target")}
    assert {r["family"] for r in rows} == {4}
    # mean-accuracy gap: K = 1: 0, 0; K = 4: 0.1, 0.2 -> slopes on log2 K (0 -> 2): 0.05, 0.1
    half = 12.706205 * statistics.stdev([0.05, 0.1]) / math.sqrt(2)
    assert out["slope/ksweep/chain/dapo"] == f"+0.0750 [{0.075 - half:+.4f}, {0.075 + half:+.4f}]"
    assert "| chain | cispo − dapo | 2 | +0.0750 |" in out["slope/ksweep"] and out["slope/ksweep"].count("| no |") == 1


def test_q1_rule_collapse_tuning_and_compute(study):
    root, *_, out = study
    # steps to target 0.705: cispo 4, 2, 6; dapo 8, 10 (censored), 8: d = T_c − 0.5 T_d = 0, −3, 2
    r, lo, hi = fieller_ratio([4.0, 2.0, 6.0], [8.0, 10.0, 8.0])
    assert r == pytest.approx(12 / 26)
    assert out["ratio/main/chain/K16/dapo"] == f"{r:.2f} [{lo:.2f}, {hi:.2f}]"
    assert out["target/main/chain/K16"] == "0.705"
    d = paired_t([0.0, -3.0, 2.0])
    assert d.mean == pytest.approx(-1 / 3) and d.lo < 0 < d.hi and out["q1/main/chain/K16/dapo"] == "unclear"
    assert (f"| chain | 16 | dapo | 0.705 | 3 | 4.0 (0) | 8.7 (1) | 0.46 | [{lo:+.2f}, {hi:+.2f}] | -0.3 "
            f"| [{d.lo:+.1f}, {d.hi:+.1f}] | unclear |") in out["q1/main"]
    assert out["q1/main"].splitlines()[2].split(" | ")[2] == "dapo"  # the primary row first
    # grpo: 1 collapsed of the 2 that learned; Wilson(1, 2) = 0.5 ± 1.96·sqrt(0.125 + z²/16) / (1 + z²/2)
    assert "| chain | 16 | grpo | 0.0001 | 2 | 1 | 0.50 | [0.09, 0.91] | 1 |" in out["collapse/main"]
    assert "| chain | 16 | cispo | 0.0001 | 3 | 0 | 0.00 | [0.00, 0.56] | 0 |" in out["collapse/main"]
    assert "| chain | 16 | dapo | 0.400 | 0.600 | 0.0003 | yes |" in out["tuning/main"]
    # 9 eval runs x 1 h + 2 tuning runs x 0.5 h; ksweep 8 x 0.1 h; the plain run: 8 steps x 20 s, unmeasured
    assert "| main | 9 | 2 | 9.00 | 1.00 | 10.00 | 0 |" in out["compute"]
    assert "| ksweep | 8 | 0 | 0.80 | 0.00 | 0.80 | 0 |" in out["compute"]
    assert "| extra | 1 | 0 | 0.04 | 0.00 | 0.04 | 1 |" in out["compute"]
    assert out["hours/total"] == f"{10.8 + 160 / 3600:.2f}"
    for name in ("summary_main.md", "q1_main.md", "collapse_main.md", "compute.md", "numbers.json", "curves_main.png",
                 "gaps_ksweep.png", "slope_ksweep.md"):
        assert (root / "report" / name).stat().st_size > 0


def test_doc_check_finds_a_wrong_quote_and_update_fixes_it(study):
    *_, out = study
    doc = ("# Results\n\nCISPO needs <!-- study:ratio/main/chain/K16/dapo -->0.99 [0.1, 2]"
           "<!-- /study:ratio/main/chain/K16/dapo --> of DAPO's steps.\n\n"
           "<!-- study:summary/main -->\n| old |\n<!-- /study:summary/main -->\n")
    problems = check_doc(doc, out, "results.md")
    assert len(problems) == 2 and problems[0].startswith("results.md:3: ratio/main/chain/K16/dapo: the doc says '0.99")
    fixed = update_doc(doc, out)
    assert check_doc(fixed, out) == [] and out["summary/main"] in fixed and out["ratio/main/chain/K16/dapo"] in fixed
    wrong = fixed.replace("| 0/3 |", "| 1/3 |", 1)  # one collapse count in the summary table
    assert wrong != fixed
    assert [p.split(": ")[1] for p in check_doc(wrong, out)] == ["summary/main"]
    assert check_doc("<!-- study:nope -->1<!-- /study:nope -->", out) == ["doc:1: nope: not an output of the report"]


def test_cli_study_data_and_report_check_doc(study, tmp_path, capsys):
    root, *_ = study
    assert main(["data", str(root / "main"), "-o", str(tmp_path / "s.csv")]) == 0
    got = capsys.readouterr()
    assert "11 runs, 99 rows" in got.out and "left out" in got.err and "cispo__chain__K16__seed3" in got.err
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- study:hours/main -->0<!-- /study:hours/main -->\n")
    assert main(["report", str(tmp_path / "s.csv"), "-o", str(tmp_path / "rep"), "--check-doc", str(doc)]) == 1
    assert main(["report", str(tmp_path / "s.csv"), "-o", str(tmp_path / "rep"), "--update-doc", str(doc),
                 "--check-doc", str(doc)]) == 0
    assert doc.read_text() == "<!-- study:hours/main -->10.00<!-- /study:hours/main -->\n"
    assert main(["data", str(tmp_path / "missing")]) == 2
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    assert main(["report", str(tmp_path / "bad.csv")]) == 2
    assert "not a study data file: missing column(s) part" in capsys.readouterr().err


def test_docs_results_quotes_equal_the_study_data():
    """Every table and number studies/results.md and the README quote between <!-- study:NAME -->
    markers is what `python -m studies report studies/results/study.csv.gz studies/results/v3/chain.csv.gz`
    prints (the original study and study v3's part on `chain`, side by side)."""
    doc = (ROOT / "studies" / "results.md").read_text()
    if not MARKER.search(doc):
        pytest.skip("studies/results.md quotes no study table yet (no <!-- study:NAME --> markers): the study "
                    "has not been run; the mechanism is exercised on synthetic data above")
    data = [ROOT / "studies" / "results" / "study.csv.gz", ROOT / "studies" / "results" / "v3" / "chain.csv.gz"]
    assert all(d.exists() for d in data), "studies/results.md quotes study values but a data file is missing"
    out = report(data)
    assert check_doc(doc, out, "studies/results.md") == []
    readme = (ROOT / "README.md").read_text()
    assert MARKER.search(readme), "the README's study summary quotes its numbers between markers"
    assert check_doc(readme, out, "README.md") == []


def test_paired_t_matches_scipy():
    from scipy import stats

    d = [0.3, -0.1, 0.25, 0.4, 0.05]
    res = stats.ttest_1samp(d, 0.0)
    ci = res.confidence_interval(0.95)
    t = paired_t(d)
    assert t.p == pytest.approx(res.pvalue) and (t.lo, t.hi) == pytest.approx((ci.low, ci.high))
    assert not math.isnan(t.half)


@pytest.mark.slow
def test_one_command_sweep_then_data_then_report(tiny_model, dense_task, tmp_path, capsys):
    """`python -m studies sweep` with arms, per-K tuning and the fairness options on a tiny model; then the
    raw data and the tables from it."""
    out = tmp_path / "ksweep"
    assert main(["sweep", "arms=[dapo,cispo_seqmean]", "ks=[1,2]", "seeds=[0,1]", "tune_seeds=[100]",
                 "tune_lrs=[1e-4,1e-3]", "tune_per_k=true", "minibatch_prompts=2", "warmup_fraction=0.5", "workers=1",
                 f"out_dir={out}", f"model.path={tiny_model}", "model.device=cpu", "steps=2", "group_size=4",
                 "max_new_tokens=8", "num_train_prompts=32", "num_eval_prompts=4", "eval.num_samples=1", "eval.every=1",
                 "checkpoint_every=1"]) == 0
    tuning = json.loads((out / "tuning.json").read_text())
    chosen = tuning["chosen"]
    assert set(chosen) == {"dapo@1", "dapo@2", "cispo_seqmean@1", "cispo_seqmean@2"}
    # the grid has two rates, so each choice is at an edge and one more rate is tried past it
    assert len(tuning["scores"]) == 2 * 2 * 3
    csv_path, n_runs, _, _ = collect([out], tmp_path / "s.csv.gz")
    assert n_runs == 2 * 3 * 2 + 2 * 2 * 2  # tuning: arms x (2 rates + 1 past the edge) x K; eval: arms x seeds x K
    for r in read_csv(csv_path):
        k = int(r["K"])
        assert int(r["prompts_per_step"]) == 2 * k and int(r["warmup_updates"]) == math.ceil(0.5 * 2 * k)
        assert float(r["wall_s"]) > 0 and r["part"] == "ksweep" and r["base_model"] == str(tiny_model)
        if r["role"] == "eval":
            assert float(r["lr"]) == pytest.approx(chosen[f"{r['arm']}@{k}"])
            assert r["spec"] == ("cispo(aggregation=seq-mean-token-mean)" if r["arm"] == "cispo_seqmean" else "dapo")
    tables = report(csv_path, tmp_path / "rep", Settings(contrast="cispo_seqmean"))
    assert "| ksweep | 8 | 12 |" in tables["compute"]
    assert {ln.split(" | ")[1] for ln in tables["tuning/ksweep"].splitlines()[2:6]} == {"1", "2"}
    assert "| chain |" not in tables["summary/ksweep"] and "| addition | 2 | dapo |" in tables["summary/ksweep"]
    assert (tmp_path / "rep" / "gaps_ksweep.png").exists()


def eval_run(part, arm, seed, accs, task="chain", k=16, lr="3e-05", every=2):
    """A study run of the CSV with held-out accuracies `accs` every `every` steps from step 0."""
    from studies.study_report import RunData

    meta = {"part": part, "role": "eval", "task": task, "K": str(k), "arm": arm, "seed": str(seed), "lr": lr,
            "run": f"{arm}__{task}__K{k}__seed{seed}"}
    return RunData(meta, {every * i: {"eval/accuracy": a} for i, a in enumerate(accs)})


def test_an_ablation_part_without_cispo_pairs_with_the_main_parts_cispo():
    from studies.study_report import borrow_arms, collapse_table, summary_table

    run = eval_run

    runs = [run("main", "cispo", s, [0.0, 0.4, 0.6 + 0.1 * s]) for s in (0, 1, 2)]
    runs += [run("main", "dapo", s, [0.0, 0.5, 0.7]) for s in (0, 1, 2)]
    runs += [run("ablation", "ppo", s, [0.0, 0.2, 0.3 + 0.05 * s]) for s in (0, 1, 2)]
    st = Settings()
    groups = borrow_arms(group_eval_runs(runs), st)
    assert set(groups[("ablation", "chain", 16)]) == {"ppo", "cispo"}  # dapo is not lent, only the contrast
    assert groups[("ablation", "chain", 16)]["cispo"] == groups[("main", "chain", 16)]["cispo"]
    rows = comparisons(groups, "ablation", st)
    final = next(r for r in rows if r["measure"] == "final_accuracy")
    # finals (mean of the last 2 evaluations): ppo 0.25, 0.275, 0.3; cispo 0.5, 0.55, 0.6 -> −0.25, −0.275, −0.3
    assert (final["a"], final["b"], final["t"].n) == ("ppo", "cispo", 3)
    assert final["t"].mean == pytest.approx(-0.275) and {r["family"] for r in rows} == {2}
    assert "| chain | 16 | cispo (main part's runs) | 3e-05 | 3 |" in summary_table(groups, "ablation", st)
    assert "| chain | 16 | cispo (main part's runs) |" in collapse_table(groups, "ablation", st)
    assert "| chain | 16 | cispo | 3e-05 | 3 |" in summary_table(groups, "main", st)
    # a part with its own CISPO runs keeps them; without `lend` nothing is lent
    alone = borrow_arms(group_eval_runs(runs), Settings(lend={}))
    assert set(alone[("ablation", "chain", 16)]) == {"ppo"} and comparisons(alone, "ablation", st) == []


def test_the_k32_ablations_use_the_ablation_family_and_their_own_cispo():
    from studies.study_report import borrow_arms

    def run(part, arm, seed, accs):
        return eval_run(part, arm, seed, accs, task="addition", k=32, lr="1e-04")

    runs = [run("ablation_k32", "cispo", s, [0.0, 0.4, 0.6 + 0.1 * s]) for s in (0, 1, 2)]
    runs += [run("ablation_k32", arm, s, [0.0, 0.3, 0.5 + 0.05 * s]) for arm in ("cispo_seqmean", "cispo_cap1")
             for s in (0, 1, 2)]
    runs += [run("main", "cispo", s, [0.0, 0.0, 0.0]) for s in (0, 1, 2)]  # other K: never lent
    groups = borrow_arms(group_eval_runs(runs), Settings())
    rows = comparisons(groups, "ablation_k32", Settings())
    # each arm − CISPO, final and mean accuracy, one Holm family of 2 arms × 2 measures
    assert {(r["a"], r["b"], r["measure"]) for r in rows} == {
        (a, "cispo", m) for a in ("cispo_seqmean", "cispo_cap1") for m in ("final_accuracy", "mean_accuracy")}
    assert {r["family"] for r in rows} == {4}
    final = next(r for r in rows if (r["a"], r["measure"]) == ("cispo_cap1", "final_accuracy"))
    # finals (mean of the last 2): arm 0.4, 0.425, 0.45; cispo 0.5, 0.55, 0.6
    assert final["t"].mean == pytest.approx(-0.125)


def test_the_exploratory_part_borrows_dapo_not_cispo():
    """`explore_lr1e4` (session 9 amendment): its own CISPO and PPO, part 1's DAPO lent at the same
    (task, K), so the target and the "≤ 50% of the steps" rule exist there too."""
    from studies.study_report import borrow_arms, q1_rows, summary_table

    def run(part, arm, seed, accs):
        return eval_run(part, arm, seed, accs, lr="0.0001", every=5)

    runs = [run("main", "dapo", s, [0.0, 0.5, 0.75, 0.75]) for s in (0, 1, 2)]
    runs += [run("main", "cispo", s, [0.0, 0.0, 0.0, 0.0]) for s in (0, 1, 2)]
    runs += [run("explore_lr1e4", "cispo", s, [0.0, 0.8, 0.8, 0.8]) for s in (0, 1, 2)]
    runs += [run("explore_lr1e4", "ppo", s, [0.0, 0.2, 0.5, 0.6]) for s in (0, 1, 2)]
    groups = borrow_arms(group_eval_runs(runs), Settings())
    arms = groups[("explore_lr1e4", "chain", 16)]
    assert set(arms) == {"cispo", "ppo", "dapo"}
    assert {r.meta["part"] for r in arms["cispo"].values()} == {"explore_lr1e4"}  # its own CISPO kept
    assert "| chain | 16 | dapo (main part's runs) | 0.0001 | 3 |" in summary_table(groups, "explore_lr1e4", Settings())
    (vs_dapo, *_), = [[r for r in q1_rows(groups, "explore_lr1e4", Settings()) if r["base"] == "dapo"]]
    # target: DAPO's final 0.75; CISPO reaches it at step 5, DAPO at 10: d = 5 − 0.5·10 = 0 per seed
    assert vs_dapo["target"] == pytest.approx(0.75) and [c for c, _ in vs_dapo["c"]] == [5, 5, 5]
    assert vs_dapo["rule"].mean == pytest.approx(0.0)


def test_the_v3_mechanism_gate_applies_the_protocols_criteria():
    """Persistence (the paper's case in >= 15 of steps 11-40) and size (mean positive-fork mass
    share above the bound >= 0.10 and >= 1.5x the other tokens'), both required."""
    from studies.mechanism_gate import gate

    def rows(late_hits, fork_share, other_share):
        return [{"step": 0}] + [{"step": s, "objective/fork_pos_lowp_above": float(s <= 4 or 11 <= s < 11 + late_hits),
                                 "objective/fork_pos_mass_above": fork_share if s % 2 else float("nan"),
                                 "objective/other_pos_mass_above": other_share} for s in range(1, 41)]

    passed = gate(rows(15, 0.2, 0.1))
    assert passed["mechanism_acts"] and passed["complete"] and passed["late_steps_with_paper_case"] == 15
    assert passed["paper_case_count_by_phase"] == {"1-10": 4.0, "11-20": 10.0, "21-40": 5.0}
    assert not gate(rows(14, 0.2, 0.1))["mechanism_acts"]  # chain's pattern: only early
    assert not gate(rows(30, 0.09, 0.01))["mechanism_acts"]  # too small
    assert not gate(rows(30, 0.2, 0.15))["mechanism_acts"]  # no larger than for the other tokens


def test_the_committed_v3_gate_verdicts_recompute_from_their_data():
    """Each studies/results/v3/gate/RUN.gate.json is the gate script's output on RUN/metrics.jsonl
    (committed as RUN/metrics.jsonl.gz)."""
    from cispo.foundations.jsonl import has_jsonl
    from cispo.records.tracking import read_metrics
    from studies.mechanism_gate import gate

    verdicts = sorted((ROOT / "studies" / "results" / "v3" / "gate").glob("*.gate.json"))
    assert len(verdicts) >= 3
    for path in verdicts:
        run = path.parent / path.name.removesuffix(".gate.json")
        assert has_jsonl(run / "metrics.jsonl"), run  # read_metrics of a missing file is [], not an error
        assert json.loads(path.read_text()) == gate(read_metrics(run / "metrics.jsonl")), path.name
