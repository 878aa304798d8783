"""A TRL or verl user's own reward and data set, unchanged: every column reaches
the reward by its own name, on a JSONL, a Parquet and a ``save_to_disk`` data set, with no field flag
but ``prompt_field``; a custom data set that lacks settings hears of all of them at once."""

import json

import pytest

import cispo.models.packaged as packaged
from cispo.cli import main
from cispo.config.train import ConfigError, TrainConfig, apply_overrides, load_yaml
from cispo.data.datasets import DataError, load_prompts, load_prompts_with_report
from cispo.data.prompts import load_source
from cispo.data.rewards.loading import RewardSpecError, check_reward_fields, load_reward
from cispo.records.tracking import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

# As a TRL user writes it: the data set's answer column is `solution`, passed by its own name.
TRL_REWARD = '''
def reward(prompts, completions, solution, **kwargs):
    return [1.0 if s in c else 0.0 for c, s in zip(completions, solution)]
'''
# verl's custom reward signature, every parameter required; the data in verl's parquet layout.
VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    assert data_source == "toy" and extra_info["split"] == "train", (data_source, extra_info)
    return {"score": 1.0 if str(ground_truth) in solution_str else 0.0}
'''
TRL_ROWS = [{"question": f"{i}+{i}=", "solution": str(2 * i), "level": i % 3} for i in range(10)]
VERL_ROWS = [{"data_source": "toy", "prompt": [{"role": "user", "content": f"{i}+{i}="}], "ability": "math",
              "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
              "extra_info": {"split": "train", "index": i}} for i in range(10)]
FORMATS = ("jsonl", "parquet", "save_to_disk")


def write_data(rows, fmt, folder):
    """``rows`` as a JSONL file, a Parquet file or a ``Dataset.save_to_disk`` folder."""
    if fmt == "jsonl":
        path = folder / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        path = folder / "data.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        datasets = pytest.importorskip("datasets")
        path = folder / "data_ds"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def reward_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "trl_reward.py").write_text(TRL_REWARD)
    (folder / "verl_reward.py").write_text(VERL_REWARD)
    return {"trl": f"{folder / 'trl_reward.py'}:reward", "verl": f"{folder / 'verl_reward.py'}:compute_score"}


CASES = {  # name: (rows, the reward, field flags)
    "trl": (TRL_ROWS, "trl", ["data.prompt_field=question"]),
    "trl_answer_field": (TRL_ROWS, "trl", ["data.prompt_field=question", "data.answer_field=solution"]),
    "verl": (VERL_ROWS, "verl", []),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_trl_and_verl_rewards_get_their_columns_on_every_format(case, fmt, reward_files, tmp_path):
    rows, reward, flags = CASES[case]
    path = write_data(rows, fmt, tmp_path)
    cfg = apply_overrides(TrainConfig(), [f"data.path={path}", f"data.reward={reward_files[reward]}",
                                          "max_new_tokens=8", "model.path=builtin:smollm2-135m",
                                          "num_eval_prompts=2", *flags])
    task = load_source(cfg.data, cfg.rollout.max_new_tokens)
    check_reward_fields(task, cfg.data)  # the pre-flight check finds every field the reward names
    for sample in task.train_samples(0, 100) + task.eval_samples(0, 100):
        truth = str(2 * int(sample["prompt"].split("+")[0]))
        fields = {k: v for k, v in sample.items() if k != "prompt"}
        assert task.reward(sample["prompt"], f"= {truth}", **fields) == 1.0
        assert task.reward(sample["prompt"], "= x", **fields) == 0.0


def test_a_trl_reward_trains_on_jsonl_in_worker_processes(reward_files, tiny_model, tmp_path):
    """A TRL user's case end to end: ``answer_field=solution`` and a reward naming ``solution``; every
    call of the run (in the reward's worker processes) gets it, so none fails."""
    path = write_data(TRL_ROWS * 2, "jsonl", tmp_path)
    assert main(["train", f"data.path={path}", f"data.reward={reward_files['trl']}", "data.prompt_field=question",
                 "data.answer_field=solution", f"model.path={tiny_model}", f"out_dir={tmp_path}", "run_name=r",
                 "model.device=cpu", "progress=false", "steps=1", "prompts_per_step=2", "group_size=2",
                 "updates_per_batch=1", "max_new_tokens=6", "num_eval_prompts=2", "eval.num_samples=1",
                 "dynamic_sampling=false", "data.reward_workers=1"]) == 0
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["rollout/reward_errors"] == 0 and rows[0]["eval/reward_errors"] == 0


def test_a_verl_data_set_trains_on_the_packaged_model(reward_files, monkeypatch, tmp_path):
    """A save_to_disk folder in verl's layout (chat prompt, reward_model.ground_truth, extra_info) on
    ``model.path=builtin:smollm2-135m``: its BPE tokenizer covers any text. The 135M weights are stood in
    for by a tiny model with the same tokenizer (`cispo.models.packaged.save_tiny_smollm2`)."""
    tiny = packaged.save_tiny_smollm2(tmp_path / "tiny_smollm")
    monkeypatch.setattr(packaged, "ensure_packaged", lambda name, *a, **k: tiny)
    path = write_data(VERL_ROWS, "save_to_disk", tmp_path)
    assert main(["train", f"data.path={path}", f"data.reward={reward_files['verl']}", "model.path=builtin:smollm2-135m",
                 "model.chat_template=true", f"out_dir={tmp_path}", "run_name=r", "model.device=cpu", "progress=false",
                 "steps=1", "prompts_per_step=2", "group_size=2", "updates_per_batch=1", "max_new_tokens=6",
                 "num_eval_prompts=2", "eval.num_samples=1", "dynamic_sampling=false",
                 "data.reward_isolation=main"]) == 0
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert rows[1]["rollout/reward_errors"] == 0 and rows[0]["eval/reward_errors"] == 0


def test_extra_fields_all_on_the_command_line_and_in_yaml(tmp_path):
    assert TrainConfig().data.extra_fields == "all"  # the default: every column, as TRL passes them
    cfg = apply_overrides(TrainConfig(), ["data.extra_fields=all", "data.eval_sets={a: {path: x.jsonl}}",
                                          "data.path=x.jsonl", "data.reward=math", "model.path=m", "max_new_tokens=8"])
    assert cfg.data.extra_fields == "all" and cfg.data.eval_sets["a"].extra_fields == "all"
    assert apply_overrides(cfg, ["data.extra_fields=null"]).data.extra_fields is None
    assert apply_overrides(cfg, ["data.extra_fields=[a, b]"]).data.extra_fields == ["a", "b"]
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model: {path: m}\nrollout: {max_new_tokens: 8}\ndata:\n  path: x.jsonl\n  reward: math\n"
                         "  extra_fields: all\n  eval_sets:\n    b: {path: y.jsonl, extra_fields: all}\n")
    loaded = load_yaml(TrainConfig, yaml_file)
    assert loaded.data.extra_fields == "all" and loaded.data.eval_sets["b"].extra_fields == "all"
    with pytest.raises(ConfigError, match="data.extra_fields"):
        apply_overrides(TrainConfig(), ["data.extra_fields=every"])


def test_every_column_by_its_own_name_and_the_answer_also_as_answer(tmp_path):
    path = write_data(TRL_ROWS[:2], "jsonl", tmp_path)
    assert load_prompts(path, prompt_field="question", answer_field="solution", extra_fields="all")[1] == {
        "prompt": "1+1=", "answer": "2", "solution": "2", "level": 1}
    assert load_prompts(path, prompt_field="question", extra_fields="all")[0] == {  # no `answer` column: none
        "prompt": "0+0=", "solution": "0", "level": 0}
    sft = write_data([{"prompt": "p", "completion": "c", "id": 3}], "jsonl", tmp_path)
    assert load_prompts(sft, extra_fields="all") == [{"prompt": "p", "id": 3}]  # the reward's completion is the model's


def test_the_default_answer_field_missing_from_some_rows_only_is_a_bad_row(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b"}\n{"prompt": "c", "answer": 3}\n')
    with pytest.raises(DataError, match=r"mixed\.jsonl: line 2: field 'answer': missing answer field.*other rows "
                                        r"have one"):
        load_prompts(path)
    samples, report = load_prompts_with_report(path, on_error="skip")
    assert [s["prompt"] for s in samples] == ["a", "c"] and report.skipped == 1 and report.loaded == 2
    with pytest.raises(DataError, match="line 1: field 'solution': missing answer field"):
        load_prompts(path, answer_field="solution")  # a field the user named is required in every row


def test_a_missing_column_is_named_before_training(reward_files, tmp_path):
    rows = [{"question": r["question"], "solutions": r["solution"]} for r in TRL_ROWS]
    path = write_data(rows, "jsonl", tmp_path)
    cfg = apply_overrides(TrainConfig(), [f"data.path={path}", f"data.reward={reward_files['trl']}",
                                          "data.prompt_field=question", "max_new_tokens=8", "model.path=m",
                                          "num_eval_prompts=2"])
    task = load_source(cfg.data, 8)
    with pytest.raises(RewardSpecError, match=r"training sample 0 has no field 'solution', which reward .* needs \(the "
                                              r"data set has no such column \(did you mean 'solutions'\?\)\)"):
        check_reward_fields(task, cfg.data)


def test_a_reward_gets_only_the_columns_its_signature_takes(tmp_path):
    strict = tmp_path / "strict.py"
    strict.write_text("def score(prompt, completion, answer):\n    return float(answer in completion)\n\n"
                      "def trl(prompts, completions, solution):\n    return [float(solution[0] in completions[0])]\n")
    cispo_style = load_reward(f"{strict}:score", isolation="main")
    assert cispo_style("p", "is 4", answer="4", level=2) == 1.0  # level: not passed
    trl_style = load_reward(f"{strict}:trl", isolation="main")
    assert trl_style("p", "is 4", solution="4", answer="4", level=2) == 1.0
    pytest.importorskip("math_verify")
    math = load_reward("math", isolation="main")  # a column named like one of its options does not reach it
    assert math("p", "Answer: 4", answer="4", mode="hard", timeout_seconds="x") == 1.0


def test_a_custom_data_set_hears_every_missing_setting_at_once(tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        apply_overrides(TrainConfig(), [f"data.path={tmp_path / 'x.jsonl'}"])
    message = str(e.value)
    assert "3 settings to fix" in message and "builtin:smollm2-135m" in message
    for key in ("model.path is required with data.path", "data.reward is required with data.path",
                "rollout.max_new_tokens is required with data.path"):
        assert key in message
    assert main(["train", f"data.path={tmp_path / 'x.jsonl'}", "data.reward=math"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "model.path" in err and "rollout.max_new_tokens" in err
    cfg = apply_overrides(TrainConfig(), [f"data.path={tmp_path / 'x.jsonl'}", "data.reward=math",
                                          "max_new_tokens=64", "model.path=builtin:smollm2-135m"])
    assert cfg.model.path == "builtin:smollm2-135m"  # the packaged model takes any data set
