"""The controlled comparison: the analysis on hand-made curves, and (slow) a tiny real one."""

import json
import math
from dataclasses import replace

import pytest

from cispo.config.train import ConfigError
from studies.compare import CompareConfig, SweepConfig, compare, run_configs, sweep, tune, tuning_configs
from studies.stats import mean_band, steps_to_target
from studies.tables import analyse, format_sweep, format_table, sweep_gaps


def rows(accs, every=2):
    """metrics rows with eval/accuracy at steps 0, every, 2*every, ..."""
    return [{"step": i * every, "eval/accuracy": a, "eval/fork_rate": 0.1} for i, a in enumerate(accs)]


def test_mean_band_and_steps_to_target():
    m, s, h = mean_band([1.0, 2.0, 3.0])
    assert (m, s) == (2.0, 1.0) and h == pytest.approx(4.302653 / math.sqrt(3))  # t_{0.975, 2}
    assert mean_band([5.0]) == (5.0, 0.0, 0.0)
    curve = {0: 0.1, 2: 0.3, 4: 0.5, 6: 0.45}
    assert steps_to_target(curve, 0.5) == 4
    assert steps_to_target(curve, 0.3) == 2
    assert steps_to_target(curve, 0.05) == 2  # step 0 never counts
    assert steps_to_target(curve, 0.9) is None


def test_analyse_hand_made_comparison():
    runs = {
        "dapo": [rows([0.1, 0.3, 0.5, 0.6]), rows([0.1, 0.2, 0.4, 0.6])],  # final 0.6, 0.6 -> target 0.6
        "cispo": [rows([0.1, 0.6, 0.7, 0.7]), rows([0.1, 0.4, 0.6, 0.7])],  # reaches 0.6 at steps 2 and 4
        "grpo": [rows([0.1, 0.2, 0.3, 0.3]), rows([0.1, 0.2, 0.3, 0.4])],  # never
    }
    t = analyse(runs, "dapo")
    assert t["target"] == pytest.approx(0.6)
    assert t["arms"]["cispo"]["steps_to_target"][0] == 3.0
    assert t["arms"]["cispo"]["reached_target"] == "2/2"
    assert t["arms"]["dapo"]["steps_to_target"][0] == 6.0
    assert t["arms"]["grpo"]["steps_to_target"] is None and t["arms"]["grpo"]["reached_target"] == "0/2"
    assert t["arms"]["grpo"]["final_accuracy"][0] == pytest.approx(0.35)
    assert t["arms"]["cispo"]["steps_to_90"][0] == 3.0  # 0.54: steps 2 and 4
    assert t["arms"]["grpo"]["steps_to_90"] is None and t["arms"]["grpo"]["reached_90"] == "0/2"
    assert t["arms"]["grpo"]["mean_accuracy"][0] == pytest.approx((0.8 / 3 + 0.9 / 3) / 2)
    text = format_table(t)
    assert "| cispo | n/a | 2 |" in text and "0/2" in text
    gaps = sweep_gaps({4: runs}, "dapo")
    assert gaps[4]["dapo"]["final_accuracy_gap"][0] == pytest.approx(0.1)
    assert gaps[4]["dapo"]["steps_to_target_gap"][0] == pytest.approx(-3.0)  # (2 - 6 + 4 - 6) / 2
    assert gaps[4]["dapo"]["mean_accuracy_gap"][0] == pytest.approx((0.6 / 3 + 0.5 / 3) / 2)
    # grpo never reaches: censored at its last step + one interval = 8
    assert gaps[4]["grpo"]["steps_to_target_gap"][0] == pytest.approx(3.0 - 8.0)
    assert "| 4 |" in format_sweep(gaps)


def _write_metrics(run, accs):
    run.dir.mkdir(parents=True)
    (run.dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(accs)))


def test_tune_picks_each_arms_best_lr_by_area_under_curve(tmp_path, monkeypatch):
    import studies.compare as cmp

    cfg = CompareConfig(arms=["grpo", "cispo_cap2"], learning_rates={"dapo": 1e-5}, tune_lrs=[1e-4, 3e-4],
                        tune_seeds=[100, 101], tune_extend=False, tune_tie=0.0, out_dir=str(tmp_path))
    runs = tuning_configs(cfg)
    assert set(runs) == {(a, lr, s) for a in ("grpo", "cispo_cap2") for lr in (1e-4, 3e-4) for s in (100, 101)}
    assert all(r.role == "tune" and r.config.run_name.startswith("tune_lr") for r in runs.values())
    assert runs[("cispo_cap2", 1e-4, 101)].config.run_name == "tune_lr0.0001__cispo_cap2__addition__K16__seed101"
    assert runs[("cispo_cap2", 1e-4, 101)].config.algo.objective.overrides() == {"eps_high_is": 2.0}
    # grpo: 3e-4 ends higher but 1e-4 has the larger area; cispo_cap2: 3e-4 better on the mean of
    # its two seeds though seed 101 alone prefers 1e-4
    accs = {("grpo", 1e-4): [0.0, 0.6, 0.7, 0.7], ("grpo", 3e-4): [0.0, 0.1, 0.2, 0.8],
            ("cispo_cap2", 1e-4): [0.0, 0.2, 0.3, 0.4], ("cispo_cap2", 3e-4): [0.9, 0.5, 0.6, 0.7]}
    for (arm, lr, seed), r in runs.items():
        _write_metrics(r, accs[(arm, lr)] if seed == 100 or arm == "grpo" else
                       {1e-4: [0.0, 0.5, 0.5, 0.5], 3e-4: [0.0, 0.4, 0.4, 0.4]}[lr])
    monkeypatch.setattr(cmp, "run_all", lambda configs, workers: None)
    tuned = tune(cfg)
    assert tuned.learning_rates == {"dapo": 1e-5, "grpo@16": 1e-4, "cispo_cap2@16": 3e-4}
    table = (tmp_path / "tuning.md").read_text()
    # (0.2+0.3+0.4)/3 = 0.3 and 0.5 -> 0.4;  (0.5+0.6+0.7)/3 = 0.6 and 0.4 -> 0.5
    assert "| grpo | 16 | 0.667 | 0.367 | 0.0001 | yes |" in table
    assert "| cispo_cap2 | 16 | 0.400 | 0.500 | 0.0003 | yes |" in table
    assert json.loads((tmp_path / "tuning.json").read_text())["chosen"]["grpo@16"] == 1e-4
    assert tuning_configs(CompareConfig(quick=True)) == {} and tuning_configs(CompareConfig(tune_lrs=[])) == {}
    # the eval runs use the tuned rate, times lr_scale
    lrs = {r.arm: r.config.optim.lr for r in run_configs(replace(tuned, lr_scale=3.0))}
    assert lrs == {"grpo": pytest.approx(3e-4), "cispo_cap2": pytest.approx(9e-4)}
    # another comparison reuses the chosen rates; an explicit rate wins
    other = CompareConfig(arms=["grpo", "cispo_cap2"], tuning_from=str(tmp_path), learning_rates={"grpo": 5e-5},
                          out_dir=str(tmp_path / "other"))
    assert tuning_configs(tune(other)) == {}
    assert {r.arm: r.config.optim.lr for r in run_configs(tune(other))} == {"grpo": 5e-5, "cispo_cap2": 3e-4}
    # at a K it has no rate for, the arms are tuned here
    at4 = replace(other, learning_rates={}, train=["updates_per_batch=4"])
    assert {a for a, _, _ in tuning_configs(cmp.with_tuning_from(at4))} == {"grpo", "cispo_cap2"}
    with pytest.raises(ConfigError, match="cannot read the chosen rates"):
        cmp.with_tuning_from(replace(at4, tuning_from=str(tmp_path / "nowhere")))


def test_tuning_per_k_extends_an_edge_choice_once(tmp_path, monkeypatch):
    import studies.compare as cmp

    cfg = SweepConfig(arms=["dapo"], ks=[1, 4], tune_per_k=True, tune_lrs=[1e-5, 1e-4, 1e-3], seeds=[0],
                      out_dir=str(tmp_path))
    peak = {1: 1e-3, 4: 1e-4}  # best rate of the grid per K: at K = 1 the edge
    for k in (1, 4):
        for (_arm, lr, _seed), r in tuning_configs(cfg, k).items():
            assert r.config.algo.updates_per_batch == k and r.config.run_name.endswith(f"__K{k}__seed100")
            _write_metrics(r, [0.0] + [0.9 if lr == peak[k] else 0.3] * 3)
    [(key, beyond)] = tuning_configs(cfg, 1, [3.16e-3], ["dapo"]).items()  # 1e-3 × √10, 3 digits
    assert beyond.config.run_name == "tune_lr0.00316__dapo__addition__K1__seed100"
    _write_metrics(beyond, [0.0, 0.95, 0.95, 0.95])  # better still: chosen, and again at the edge
    trained = []
    monkeypatch.setattr(cmp, "run_all", lambda runs, workers: trained.extend(r.config.run_name for r in runs))
    tuned = tune(cfg, [1, 4])
    assert trained[3] == beyond.config.run_name and len(trained) == 3 + 1 + 3  # K=1 grid, its extension, K=4 grid
    assert tuned.learning_rates == {"dapo@1": 3.16e-3, "dapo@4": 1e-4}
    table = (tmp_path / "tuning.md").read_text()
    assert "| dapo | 1 | 0.300 | 0.300 | 0.900 | 0.950 | 0.00316 | yes |" in table
    assert "| dapo | 4 | 0.300 | 0.900 | 0.300 | n/a | 0.0001 | no |" in table
    assert [r.config.optim.lr for r in run_configs(tuned, 1) + run_configs(tuned, 4)] == [3.16e-3, 1e-4]


def test_pick_lr_breaks_near_ties_towards_the_smaller_rate():
    from studies.stats import pick_lr

    assert pick_lr({1e-5: 0.5, 3e-5: 0.503, 1e-4: 0.51}, tie=0.005) == 1e-4  # 0.007 apart: no tie
    assert pick_lr({1e-5: 0.5, 3e-5: 0.507, 1e-4: 0.51}, tie=0.005) == 3e-5  # 0.003 apart: tie, smaller wins
    assert pick_lr({1e-5: 0.51, 3e-5: 0.51}) == 1e-5
    assert pick_lr({1e-5: float("nan"), 3e-5: 0.2}) == 3e-5 and pick_lr({1e-5: float("nan")}) == 1e-5


def test_ablation_arms_take_cispos_rate(tmp_path, monkeypatch):
    import studies.compare as cmp

    cfg = CompareConfig(arms=["cispo", "cispo_seqmean", "cispo_cap2"], tune_lrs=[1e-4, 3e-4], tune_extend=False,
                        lr_from={"cispo_seqmean": "cispo", "cispo_cap2": "cispo"}, seeds=[0], out_dir=str(tmp_path))
    runs = tuning_configs(cfg)
    assert {a for a, _, _ in runs} == {"cispo"}
    for (_, lr, _), r in runs.items():
        _write_metrics(r, [0.0, 0.5, 0.6] if lr == 3e-4 else [0.0, 0.2, 0.3])
    monkeypatch.setattr(cmp, "run_all", lambda runs, workers: None)
    assert {r.arm: r.config.optim.lr for r in run_configs(tune(cfg))} == {
        "cispo": 3e-4, "cispo_seqmean": 3e-4, "cispo_cap2": 3e-4}
    with pytest.raises(ConfigError, match="lr_from: cispo_seqmean takes the rate of cispo at K = 16, which has none"):
        run_configs(CompareConfig(arms=["cispo_seqmean"], lr_from={"cispo_seqmean": "cispo"}))
    with pytest.raises(ValueError, match="lr_from has a cycle"):
        CompareConfig(arms=["cispo", "dapo"], lr_from={"cispo": "dapo", "dapo": "cispo"})
    with pytest.raises(ValueError, match="lr_from names arms that are not compared"):
        CompareConfig(arms=["cispo"], lr_from={"ppo": "cispo"})


@pytest.mark.slow
def test_tiny_comparison_writes_table_and_plots(tiny_model, dense_task, tmp_path):
    train = [f"model.path={tiny_model}", "model.device=cpu", "steps=2", "prompts_per_step=4", "group_size=4",
             "updates_per_batch=2", "max_new_tokens=8", "num_train_prompts=32", "num_eval_prompts=4",
             "eval.num_samples=1", "eval.every=1", "checkpoint_every=1"]
    cfg = CompareConfig(seeds=[0, 1], workers=1, out_dir=str(tmp_path), train=train, tune_lrs=[1e-4, 3e-4])
    table = compare(cfg)
    assert set(table["arms"]) == {"grpo", "dapo", "cispo"}
    assert set(table["learning_rates"].values()) <= {3.16e-5, 1e-4, 3e-4, 9.49e-4}  # the grid, or one past an edge
    for name in ("table.md", "table.json", "comparison.png", "tuning.md"):
        assert (tmp_path / name).stat().st_size > 0
    study = json.loads((tmp_path / "cispo__addition__K2__seed1" / "study.json").read_text())
    assert study["arm"] == "cispo" and study["role"] == "eval" and study["wall_s"] > 0
    # resuming a finished comparison trains nothing and gives the same table; a finished run
    # without study.json (an older comparison's) gets one, with no wall time
    (tmp_path / "cispo__addition__K2__seed1" / "study.json").unlink()
    again = compare(cfg)
    assert again["arms"] == table["arms"]
    study = json.loads((tmp_path / "cispo__addition__K2__seed1" / "study.json").read_text())
    assert study["arm"] == "cispo" and study["wall_s"] is None
    gaps = sweep(SweepConfig(seeds=[0], ks=[1, 2], workers=1, out_dir=str(tmp_path / "sweep"), train=train))
    assert set(gaps) == {1, 2} and (tmp_path / "sweep" / "sweep.png").exists()


def test_a_comparison_on_a_given_model_builds_no_builtin_model(tmp_path, monkeypatch):
    """``model.path`` set (a folder, ``builtin:smollm2-135m``): the runs start from it, and no built-in base
    model is built for the task first (wordmath_working has none: building one raised before any run)."""
    import cispo.models.builtin as builtin
    import studies.compare as cmp

    cfg = CompareConfig(arms=["cispo"], tune_lrs=[], tune_seeds=[], seeds=[0], out_dir=str(tmp_path),
                        train=["model.path=builtin:smollm2-135m", "data.task=wordmath_working"])
    trained = []
    monkeypatch.setattr(builtin, "ensure_builtin_model", lambda *a, **k: pytest.fail("built a base model"))
    monkeypatch.setattr(cmp, "_run_one", lambda run: trained.append(run.config.model.path) or "done")
    cmp.run_all(run_configs(cfg), workers=1)
    assert trained == ["builtin:smollm2-135m"]
    cfg = replace(cfg, train=["data.task=addition"])  # no model given: the task's built-in one, built once first
    built = []
    monkeypatch.setattr(builtin, "ensure_builtin_model", lambda task, **k: built.append(task))
    cmp.run_all(run_configs(cfg), workers=1)
    assert built == ["addition"]
