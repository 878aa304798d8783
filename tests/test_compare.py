"""The controlled comparison: the analysis on hand-made curves, and (slow) a tiny real one."""

import math

import pytest

from cispo.experiments.compare import (
    CompareConfig,
    SweepConfig,
    analyse,
    compare,
    format_sweep,
    format_table,
    mean_band,
    steps_to_target,
    sweep,
    sweep_gaps,
    tune,
    tuning_configs,
)
from conftest import small_config  # noqa: F401  (fixtures: tiny_model, dense_task)


def rows(accs, every=2):
    """metrics rows with eval/accuracy at steps 0, every, 2*every, ..."""
    return [{"step": i * every, "eval/accuracy": a, "eval/fork_rate": 0.1} for i, a in enumerate(accs)]


def test_mean_band_and_steps_to_target():
    m, s, h = mean_band([1.0, 2.0, 3.0])
    assert (m, s) == (2.0, 1.0) and h == pytest.approx(4.303 / math.sqrt(3))
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
    assert t["algorithms"]["cispo"]["steps_to_target"][0] == 3.0
    assert t["algorithms"]["cispo"]["reached_target"] == "2/2"
    assert t["algorithms"]["dapo"]["steps_to_target"][0] == 6.0
    assert t["algorithms"]["grpo"]["steps_to_target"] is None and t["algorithms"]["grpo"]["reached_target"] == "0/2"
    assert t["algorithms"]["grpo"]["final_accuracy"][0] == pytest.approx(0.35)
    assert t["algorithms"]["cispo"]["steps_to_90"][0] == 3.0  # 0.54: steps 2 and 4
    assert t["algorithms"]["grpo"]["steps_to_90"] is None and t["algorithms"]["grpo"]["reached_90"] == "0/2"
    assert t["algorithms"]["grpo"]["mean_accuracy"][0] == pytest.approx((0.8 / 3 + 0.9 / 3) / 2)
    text = format_table(t)
    assert "| cispo | n/a | 2 |" in text and "0/2" in text
    gaps = sweep_gaps({4: runs}, "dapo")
    assert gaps[4]["dapo"]["final_accuracy_gap"][0] == pytest.approx(0.1)
    assert gaps[4]["dapo"]["steps_to_target_gap"][0] == pytest.approx(-3.0)  # (2 - 6 + 4 - 6) / 2
    assert gaps[4]["dapo"]["mean_accuracy_gap"][0] == pytest.approx((0.6 / 3 + 0.5 / 3) / 2)
    # grpo never reaches: censored at its last step + one interval = 8
    assert gaps[4]["grpo"]["steps_to_target_gap"][0] == pytest.approx(3.0 - 8.0)
    assert "| 4 |" in format_sweep(gaps)


def test_tune_picks_each_algorithms_best_lr_by_area_under_curve(tmp_path, monkeypatch):
    import json

    import cispo.experiments.compare as cmp

    cfg = CompareConfig(algorithms=["grpo", "cispo"], learning_rates={"dapo": 1e-5}, tune_lrs=[1e-4, 3e-4],
                        out_dir=str(tmp_path))
    runs = tuning_configs(cfg)
    assert set(runs) == {("grpo", 1e-4), ("grpo", 3e-4), ("cispo", 1e-4), ("cispo", 3e-4)}
    assert all(c.seed == cfg.tune_seed and c.run_name.startswith("tune_lr") for c in runs.values())
    # grpo: 3e-4 ends higher but 1e-4 has the larger area; cispo: 3e-4 better throughout
    accs = {("grpo", 1e-4): [0.0, 0.6, 0.7, 0.7], ("grpo", 3e-4): [0.0, 0.1, 0.2, 0.8],
            ("cispo", 1e-4): [0.0, 0.2, 0.3, 0.4], ("cispo", 3e-4): [0.9, 0.5, 0.6, 0.7]}
    for key, c in runs.items():
        d = tmp_path / c.run_name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(accs[key])))
    monkeypatch.setattr(cmp, "run_all", lambda configs, workers: None)
    tuned = tune(cfg)
    assert tuned.learning_rates == {"dapo": 1e-5, "grpo": 1e-4, "cispo": 3e-4}
    assert "| grpo | 0.667 | 0.367 | 0.0001 |" in (tmp_path / "tuning.md").read_text()
    assert tuning_configs(CompareConfig(quick=True)) == {} and tuning_configs(CompareConfig(tune_lrs=[])) == {}


@pytest.mark.slow
def test_tiny_comparison_writes_table_and_plots(tiny_model, dense_task, tmp_path):
    train = [f"model.path={tiny_model}", "model.device=cpu", "steps=2", "prompts_per_step=4", "group_size=4",
             "updates_per_batch=2", "max_new_tokens=8", "num_train_prompts=32", "num_eval_prompts=4",
             "eval.num_samples=1", "eval.every=1", "checkpoint_every=1"]
    cfg = CompareConfig(seeds=[0, 1], workers=1, out_dir=str(tmp_path), train=train, tune_lrs=[1e-4, 3e-4])
    table = compare(cfg)
    assert set(table["algorithms"]) == {"grpo", "dapo", "cispo"}
    assert set(table["learning_rates"].values()) <= {1e-4, 3e-4}
    for name in ("table.md", "table.json", "comparison.png", "tuning.md"):
        assert (tmp_path / name).stat().st_size > 0
    # resuming a finished comparison trains nothing and gives the same table
    again = compare(cfg)
    assert again["algorithms"] == table["algorithms"]
    gaps = sweep(SweepConfig(seeds=[0], ks=[1, 2], workers=1, out_dir=str(tmp_path / "sweep"), train=train))
    assert set(gaps) == {1, 2} and (tmp_path / "sweep" / "sweep.png").exists()
