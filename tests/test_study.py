"""The study's raw-data file and its regeneration: synthetic run folders -> CSV -> every table,
checked against numbers worked out by hand; and the check that docs/results.md quotes them."""

import gzip
import json
import math
from pathlib import Path

import pytest

from cispo.cli import main
from cispo.config import TrainConfig, apply_overrides, save_yaml
from cispo.experiments.stats import fieller_ratio, paired_t
from cispo.experiments.study_data import COLUMNS, collect, read_csv
from cispo.experiments.study_report import MARKER, check_doc, comparisons, group_eval_runs, load_study, report, update_doc

ROOT = Path(__file__).resolve().parents[1]

# held-out accuracy at steps 0, 2, 4, 6, 8 per (arm, seed)
CURVES = {
    ("dapo", 0): [0.0, 0.2, 0.4, 0.6, 0.8], ("dapo", 1): [0.0, 0.2, 0.4, 0.6, 0.7], ("dapo", 2): [0.0, 0.1, 0.3, 0.6, 0.9],
    ("cispo", 0): [0.0, 0.5, 0.8, 0.8, 0.8], ("cispo", 1): [0.0, 0.8, 0.8, 0.9, 0.9], ("cispo", 2): [0.0, 0.4, 0.6, 0.8, 0.85],
    ("grpo", 0): [0.0, 0.6, 0.2, 0.1, 0.1],  # collapsed: below 0.3 after its peak, to the end
    ("grpo", 1): [0.0, 0.05, 0.05, 0.05, 0.05],  # never learned (peak 0.05 <= 0.1)
    ("grpo", 2): [0.0, 0.3, 0.5, 0.6, 0.7],
}
TUNING = {1e-4: [0.0, 0.2, 0.4, 0.5, 0.5], 3e-4: [0.0, 0.5, 0.6, 0.6, 0.7]}  # dapo, seed 100: means 0.4 and 0.6


def _write_run(folder: Path, accs: list[float], meta: dict | None, wall_s: float | None = None) -> None:
    folder.mkdir(parents=True)
    rows = []
    for step in range(9):
        r = {"step": step}
        if step % 2 == 0:
            r.update({"eval/accuracy": accs[step // 2], "eval/fork_rate": 0.5})
        if step > 0:
            r.update({"rollout/response_length": 10.0 + step, "objective/frac_capped": 0.01, "perf/step_s": 20.0})
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
                   {**base, "role": "eval", "arm": arm, "spec": arm, "objective": arm, "seed": seed, "lr": 1e-4}, 3600.0)
    for lr, accs in TUNING.items():
        _write_run(root / "main" / f"tune_lr{lr:g}__dapo__chain__K16__seed100", accs,
                   {**base, "role": "tune", "arm": "dapo", "spec": "dapo", "objective": "dapo", "seed": 100, "lr": lr}, 1800.0)
    plain = root / "extra" / "cispo__addition__seed0"  # a `cispo train` folder: config.yaml, no study.json
    _write_run(plain, [0.1, 0.2, 0.3, 0.4, 0.5], None)
    save_yaml(apply_overrides(TrainConfig(), ["seed=0", "updates_per_batch=4", "objective_overrides.eps_high_is=2"]),
              plain / "config.yaml")
    csv_path, n_runs, n_rows = collect([root], root / "study.csv.gz")
    return root, csv_path, n_runs, n_rows, report(csv_path, root / "report")


def test_the_csv_holds_every_run_and_step_and_is_reproducible(study):
    root, csv_path, n_runs, n_rows, _ = study
    assert (n_runs, n_rows) == (12, 12 * 9)
    rows = read_csv(csv_path)
    assert list(rows[0]) == COLUMNS and len(rows) == n_rows
    cispo1 = [r for r in rows if r["run"] == "cispo__chain__K16__seed1"]
    assert [r["eval/accuracy"] for r in cispo1] == ["0", "", "0.8", "", "0.8", "", "0.9", "", "0.9"]
    assert cispo1[3]["rollout/response_length"] == "13" and cispo1[0]["rollout/response_length"] == ""
    assert {(r["arm"], r["K"], r["seed"], r["lr"], r["wall_s"], r["role"], r["commit"], r["base_model"])
            for r in cispo1} == {("cispo", "16", "1", "0.0001", "3600", "eval", "0123456789ab", "builtin:feedc0ffee12")}
    plain = [r for r in rows if r["part"] == "extra"]
    assert {(r["arm"], r["K"], r["role"], r["wall_s"], r["eval_k"]) for r in plain} == {("cispo(eps_high_is=2)", "4", "eval", "", "4")}
    again, _, _ = collect([root], root / "again.csv.gz")
    assert again.read_bytes() == csv_path.read_bytes()  # no timestamp in the gzip stream
    assert gzip.decompress(csv_path.read_bytes()).decode().splitlines()[0] == ",".join(COLUMNS)


def test_summary_comparisons_and_holm_by_hand(study):
    *_, csv_path, _, _, out = study
    summary = out["summary/main"]
    # cispo finals 0.8, 0.9, 0.85: mean 0.85, std 0.05, half-width t_{.975,2} * 0.05 / sqrt 3 = 0.124;
    # target = dapo's mean final (0.8 + 0.7 + 0.9) / 3 = 0.8: cispo reaches it at 4, 2, 6 -> 4.0 ± 4.97
    assert "| chain | 16 | cispo | 0.0001 | 3 | 0.850 ± 0.124 |" in summary
    assert "| 4.0 ± 5.0 | 3/3 | 0/3 |" in summary
    # dapo: 8, never (censored at 8 + 2 = 10), 8
    assert "| chain | 16 | dapo | 0.0001 | 3 | 0.800 ± 0.248 |" in summary and "| 8.7 ± 2.9 | 2/3 |" in summary
    rows = comparisons(group_eval_runs(load_study(csv_path)), "main", "dapo", "cispo")
    mean_acc = {r["base"]: r for r in rows if r["measure"] == "mean_accuracy"}
    # cispo − dapo per seed: 0.725 − 0.5, 0.85 − 0.475, 0.6625 − 0.475
    assert mean_acc["dapo"]["t"].mean == pytest.approx((0.225 + 0.375 + 0.1875) / 3)
    p = sorted([mean_acc["dapo"]["t"].p, mean_acc["grpo"]["t"].p])
    holm_small = min(1, 2 * p[0])
    assert sorted(r["holm_p"] for r in mean_acc.values()) == pytest.approx([holm_small, max(holm_small, p[1])])
    t = mean_acc["dapo"]["t"]
    assert f"| chain | 16 | mean accuracy | cispo − dapo | 3 | {t.mean:+.3f} | [{t.lo:+.3f}, {t.hi:+.3f}] |" in out["comparisons/main"]
    assert "mean accuracy: 2" in out["comparisons/main"]  # the family's size is stated


def test_ratio_collapse_tuning_and_compute(study):
    root, *_, out = study
    # steps to target 0.8: cispo 4, 2, 6 (mean 4); dapo 8, 10 (censored), 8 (mean 26/3): R = 12/26
    r, lo, hi = fieller_ratio([4.0, 2.0, 6.0], [8.0, 10.0, 8.0])
    assert r == pytest.approx(12 / 26)
    assert out["ratio/main/chain/K16"] == f"{r:.2f} [{lo:.2f}, {hi:.2f}]"
    assert out["target/main/chain/K16"] == "0.800"
    verdict = "yes" if hi <= 0.5 else "no" if lo > 0.5 else "unclear"
    assert "| chain | 16 | 0.800 | 3 | 4.0 (3/3) | 8.7 (2/3) | 0.46 |" in out["ratio/main"]
    assert out["ratio/main"].splitlines()[2].endswith(f"| {verdict} |")
    # grpo: 1 collapsed of the 2 that learned; Wilson(1, 2) = 0.5 ± 1.96·sqrt(0.125 + z²/16) / (1 + z²/2)
    assert "| chain | 16 | grpo | 0.0001 | 2 | 1 | 0.50 | [0.09, 0.91] | 1 |" in out["collapse/main"]
    assert "| chain | 16 | cispo | 0.0001 | 3 | 0 | 0.00 | [0.00, 0.56] | 0 |" in out["collapse/main"]
    assert "| chain | 16 | dapo | 0.400 | 0.600 | 0.0003 | yes |" in out["tuning/main"]
    # 9 eval runs x 1 h + 2 tuning runs x 0.5 h; the plain run: 8 steps x 20 s (perf/step_s), unmeasured
    assert "| main | 9 | 2 | 9.00 | 1.00 | 10.00 | 0 |" in out["compute"]
    assert "| extra | 1 | 0 | 0.04 | 0.00 | 0.04 | 1 |" in out["compute"]
    assert out["hours/total"] == f"{10 + 160 / 3600:.2f}"
    for name in ("summary_main.md", "ratio_main.md", "collapse_main.md", "compute.md", "numbers.json", "curves_main.png"):
        assert (root / "report" / name).stat().st_size > 0


def test_doc_check_finds_a_wrong_quote_and_update_fixes_it(study):
    *_, out = study
    doc = ("# Results\n\nCISPO needs <!-- study:ratio/main/chain/K16 -->0.99 [0.1, 2]<!-- /study:ratio/main/chain/K16 --> "
           "of DAPO's steps.\n\n<!-- study:summary/main -->\n| old |\n<!-- /study:summary/main -->\n")
    problems = check_doc(doc, out, "results.md")
    assert len(problems) == 2 and problems[0].startswith("results.md:3: ratio/main/chain/K16: the doc says '0.99")
    fixed = update_doc(doc, out)
    assert check_doc(fixed, out) == [] and out["summary/main"] in fixed and out["ratio/main/chain/K16"] in fixed
    wrong = fixed.replace("0.850 ± 0.124", "0.851 ± 0.124")
    assert [p.split(": ")[1] for p in check_doc(wrong, out)] == ["summary/main"]
    assert check_doc("<!-- study:nope -->1<!-- /study:nope -->", out) == ["doc:1: nope: not an output of the report"]


def test_cli_study_data_and_report_check_doc(study, tmp_path, capsys):
    root, *_ = study
    assert main(["study-data", str(root / "main"), "-o", str(tmp_path / "s.csv")]) == 0
    assert "11 runs, 99 rows" in capsys.readouterr().out
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- study:hours/main -->0<!-- /study:hours/main -->\n")
    assert main(["study-report", str(tmp_path / "s.csv"), "-o", str(tmp_path / "rep"), "--check-doc", str(doc)]) == 1
    assert main(["study-report", str(tmp_path / "s.csv"), "-o", str(tmp_path / "rep"), "--update-doc", str(doc),
                 "--check-doc", str(doc)]) == 0
    assert doc.read_text() == "<!-- study:hours/main -->10.00<!-- /study:hours/main -->\n"
    assert main(["study-data", str(tmp_path / "missing")]) == 2
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    assert main(["study-report", str(tmp_path / "bad.csv")]) == 2
    assert "not a study data file: missing column(s) part" in capsys.readouterr().err


def test_docs_results_quotes_equal_the_study_data():
    """Every table and number docs/results.md quotes between <!-- study:NAME --> markers is what
    `cispo study-report docs/results/study.csv.gz` prints."""
    doc = (ROOT / "docs" / "results.md").read_text()
    if not MARKER.search(doc):
        pytest.skip("docs/results.md quotes no study table yet (no <!-- study:NAME --> markers): the study "
                    "(issue 14) has not been run; the mechanism is exercised on synthetic data above")
    data = ROOT / "docs" / "results" / "study.csv.gz"
    assert data.exists(), "docs/results.md quotes study values but docs/results/study.csv.gz is missing"
    assert check_doc(doc, report(data), "docs/results.md") == []


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
    """`cispo sweep` with arms, per-K tuning and the fairness options on a tiny model; then the
    raw data and the tables from it."""
    out = tmp_path / "ksweep"
    assert main(["sweep", "arms=[dapo,cispo_seqmean]", "ks=[1,2]", "seeds=[0,1]", "tune_seeds=[100]",
                 "tune_lrs=[1e-4,1e-3]", "tune_per_k=true", "minibatch_prompts=2", "warmup_fraction=0.5", "workers=1",
                 f"out_dir={out}", f"model.path={tiny_model}", "model.device=cpu", "steps=2", "group_size=4",
                 "max_new_tokens=8", "num_train_prompts=32", "num_eval_prompts=4", "eval.num_samples=1", "eval.every=1",
                 "checkpoint_every=1"]) == 0
    chosen = json.loads((out / "tuning.json").read_text())["chosen"]
    assert set(chosen) == {"dapo@1", "dapo@2", "cispo_seqmean@1", "cispo_seqmean@2"}
    csv_path, n_runs, _ = collect([out], tmp_path / "s.csv.gz")
    assert n_runs == 2 * 2 * 2 + 2 * 2 * 2  # tuning: arms x lrs x K; eval: arms x seeds x K
    for r in read_csv(csv_path):
        k = int(r["K"])
        assert int(r["prompts_per_step"]) == 2 * k and int(r["warmup_updates"]) == math.ceil(0.5 * 2 * k)
        assert float(r["wall_s"]) > 0 and r["part"] == "ksweep" and r["base_model"] == str(tiny_model)
        if r["role"] == "eval":
            assert float(r["lr"]) == pytest.approx(chosen[f"{r['arm']}@{k}"])
            assert r["spec"] == ("cispo(aggregation=seq-mean-token-mean)" if r["arm"] == "cispo_seqmean" else "dapo")
    tables = report(csv_path, tmp_path / "rep", contrast="cispo_seqmean")
    assert "| ksweep | 8 | 8 |" in tables["compute"]
    assert {ln.split(" | ")[1] for ln in tables["tuning/ksweep"].splitlines()[2:6]} == {"1", "2"}
    assert "cispo_seqmean − dapo" in tables["comparisons/ksweep"] and (tmp_path / "rep" / "gaps_ksweep.png").exists()
