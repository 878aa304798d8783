"""How much held-out evaluation a run does and what it reports: each task declares its own evaluation sizes
(a 135M real model's evaluation must not dwarf its training), settings the user gave are kept, a resumed run keeps
its sizes, pass@k is refused beyond the samples drawn, and pass@k is reported at each k of a list."""

from __future__ import annotations

import json

import pytest
import yaml

from cispo.cli import main
from cispo.config.train import ConfigError, TrainConfig, apply_overrides
from cispo.data.tasks import get_task, list_tasks
from cispo.records.tracking import read_metrics
from cispo.training import progress
from cispo.training.evaluation import group_accuracies, pass_at
from cispo.training.setup import eval_defaults

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_real_model_task_declares_its_own_held_out_defaults():
    """wordmath's model is a 135M one: the example's 100 greedy prompts; guess_number's held-out set is its 15 secrets,
    8 sampled games each; the toy tasks keep 200 x (greedy + 4)."""
    for name in ("wordmath", "wordmath_working", "wordmath_calc", "wordmath_calc_example", "wordmath_large",
                 "wordmath_calc_large"):
        assert (get_task(name).num_eval_prompts, get_task(name).eval_num_samples) == (100, 0)
    assert (get_task("guess_number").num_eval_prompts, get_task("guess_number").eval_num_samples) == (15, 8)
    for name in set(list_tasks()) - {"wordmath", "wordmath_working", "wordmath_calc", "wordmath_calc_example", "wordmath_large",  # noqa: E501
                                    "wordmath_calc_large", "guess_number"}:
        assert (get_task(name).num_eval_prompts, get_task(name).eval_num_samples) == (200, 4), name


@pytest.mark.parametrize("overrides, expected", [
    ([], (200, 4)),                                                          # the toy task: as before
    (["data.task=wordmath"], (100, 0)),                                      # the task's own
    (["data.task=wordmath", "num_eval_prompts=200", "eval.num_samples=4"], (200, 4)),  # set: kept
    (["data.task=wordmath", "eval.num_samples=2"], (100, 2)),
    (["data.task=wordmath", "eval.pass_at_k=[1,4]"], (100, 4)),              # enough samples for the largest k
    (["data.task=chain", "num_eval_prompts=0"], (0, 4)),
    (["data.path=p.jsonl", "model.path=m", "data.reward=exact_match", "max_new_tokens=8"], (200, 4)),  # a file's
])
def test_unset_evaluation_sizes_are_the_tasks_and_set_ones_are_kept(overrides, expected):
    cfg = apply_overrides(TrainConfig(), overrides)
    resolved = eval_defaults(cfg)
    assert (resolved.data.num_eval_prompts, resolved.eval.num_samples) == expected
    assert TrainConfig().data.num_eval_prompts is None and TrainConfig().eval.num_samples is None


def test_a_resumed_run_keeps_the_sizes_it_started_with():
    saved = apply_overrides(TrainConfig(), ["data.task=wordmath", "num_eval_prompts=200", "eval.num_samples=4"])
    cfg = eval_defaults(apply_overrides(TrainConfig(), ["data.task=wordmath"]), saved)
    assert (cfg.data.num_eval_prompts, cfg.eval.num_samples) == (200, 4)


def test_a_pass_at_k_beyond_the_samples_drawn_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"eval.pass_at_k asks for k = 16, more than the eval.num_samples=4"):
        apply_overrides(TrainConfig(), ["eval.num_samples=4", "eval.pass_at_k=[1,16]"])
    with pytest.raises(ConfigError, match=r"eval.pass_at_k must hold numbers >= 1"):
        apply_overrides(TrainConfig(), ["eval.pass_at_k=[0]"])


def test_a_wordmath_run_evaluates_the_tasks_100_greedy_prompts(tmp_path):
    """`cispo train data.task=wordmath` with the evaluation left at its defaults: 100 prompts, greedy only
    (was: 200 x (greedy + 4 samples), 22 min of CPU before the first step on the real model)."""
    from cispo.models.packaged import save_tiny_smollm2

    model = save_tiny_smollm2(tmp_path / "tiny")
    assert main(["train", f"model.path={model}", f"out_dir={tmp_path}", "run_name=r", "data.task=wordmath",
                 "model.device=cpu", "progress=false", "steps=1", "prompts_per_step=2", "group_size=2",
                 "updates_per_batch=1", "max_new_tokens=4", "num_train_prompts=8", "eval.every=0",
                 "dynamic_sampling=false", "threads=1"]) == 0
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert (saved["data"]["num_eval_prompts"], saved["eval"]["num_samples"]) == (100, 0)  # what the run did
    first = read_metrics(tmp_path / "r" / "metrics.jsonl")[0]
    assert "eval/accuracy_greedy" in first and not any("_at_" in k for k in first)


def test_the_evaluations_cost_is_said_when_it_dominates():
    assert progress.evaluation_count(60, 10) == 7  # 0, 10, ..., 60
    assert progress.evaluation_count(19, 7) == 4  # 0, 7, 14, 19
    assert progress.evaluation_count(1, 10) == 2 and progress.evaluation_count(5, 0) == 2
    assert progress.evaluation_count(60, 10, start=40) == 2  # a resumed run: 50, 60
    # the case that needs the warning: the real model, one step, 200 held-out prompts x (greedy + 4 samples)
    heavy = apply_overrides(TrainConfig(), ["data.task=wordmath", "steps=1"])
    line = progress.evaluation_plan(heavy, 200, 5, 80)
    assert line.startswith("held-out evaluation will take most of this run: 2 evaluations of 200 prompts x "
                           "(greedy + 4 sampled) = 2,000 answers of up to 80 tokens, against 256 sampled for training")
    assert "data.num_eval_prompts, eval.num_samples and eval.every" in line
    assert progress.evaluation_plan(heavy, 100, 1, 80) is None  # the task's defaults: 200 answers against 256
    assert progress.evaluation_plan(TrainConfig(), 200, 5, 20) is None  # the toy default: 7,000 against 15,360
    done = progress.evaluation_done_line(0, 95.0, {"eval/accuracy": 0.04}, 3)
    assert done == ("step-0 evaluation: done in 1 min 35 s (eval/accuracy 0.040); 3 more in this run, "
                    "about 4 min 45 s in all")


def test_pass_at_k_at_several_k():
    # 0/1 rewards: the unbiased estimator 1 - C(n-c, k) / C(n, k); at k = n the best of all
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0]
    assert pass_at(rewards, 1) == pytest.approx(2 / 5)
    assert pass_at(rewards, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at(rewards, 5) == 1.0 and pass_at([0.2, 0.7, 0.5], 3) == 0.7
    assert pass_at([0.2, 0.7, 0.5], 2) == pytest.approx((0.5 + 0.7 + 0.7) / 3)  # a graded reward: the expected best
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at(rewards, 6)

    class C:  # a Completion's fields that group_accuracies reads
        def __init__(self, r, text):
            self.task_reward, self.text, self.answer_text = r, text, text

    group = [C(0.0, "3"), C(1.0, "4"), C(1.0, "4"), C(0.0, "3")]
    assert group_accuracies([group], k=1) == {"pass": 0.5, "maj": 0.0}  # maj@1: the first answer
    assert group_accuracies([group]) == {"pass": 1.0, "maj": 0.0}  # a tie: the answer seen first


def test_cispo_eval_reports_pass_at_each_k_of_a_list(tiny_model, capsys):
    assert main(["eval", "--model", str(tiny_model), "num_eval_prompts=4", "eval.pass_at_k=[1,2,4]",
                 "max_new_tokens=6", "model.device=cpu", "progress=false"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert {f"eval/accuracy_pass_at_{k}" for k in (1, 2, 4)} <= set(metrics)  # 4 samples: the largest k
    assert metrics["eval/accuracy_pass_at_1"] == pytest.approx(metrics["eval/accuracy_mean_at_4"])
    pass_at = [metrics[f"eval/accuracy_pass_at_{k}"] for k in (1, 2, 4)]
    assert pass_at == sorted(pass_at)


@pytest.mark.parametrize("given, expected", [([], None), (["threads=1"], 1)])
def test_cispo_eval_picks_its_threads_by_cispo_trains_rule(tiny_model, monkeypatch, capsys, given, expected):
    """Issue 59: one thread rule for every command. `cispo eval` ran at torch's default (every core, slow under
    load); it now asks `auto_threads` as `cispo train` and `cispo sft` do, with its ``threads=``."""
    import torch

    import cispo.foundations.threads as threads

    asked = []
    monkeypatch.setattr(threads, "auto_threads", lambda requested: asked.append(requested) or 1)
    before = torch.get_num_threads()
    try:
        assert main(["eval", "--model", str(tiny_model), "num_eval_prompts=2", "eval.num_samples=1",
                     "max_new_tokens=4", "model.device=cpu", "progress=false", *given]) == 0
        assert asked == [expected] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
