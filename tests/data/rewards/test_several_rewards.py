"""Several rewards, weighted, and a reward model as a reward; metric names that mean
what they say: ``accuracy`` only for a 0/1 verifier, each reward's mean and std, the extras a
reward reports (a verl dict's other keys, TRL's ``log_metric`` / ``log_extra``)."""

import functools
import json
import re

import pytest
import torch

from cispo.cli import main
from cispo.config.train import ConfigError, TrainConfig, apply_overrides
from cispo.data.prompts import load_source
from cispo.data.rewards import score_completions
from cispo.data.rewards.loading import (
    Reward,
    RewardSet,
    RewardSpecError,
    check_reward_fields,
    load_reward,
    load_rewards,
)
from cispo.data.rewards.pool import shutdown_pools
from cispo.data.tasks import arithmetic
from cispo.foundations.experience import Completion
from cispo.models.loading import build_tokenizer
from cispo.records.tracking import read_metrics
from cispo.training.evaluation import reward_named
from cispo.training.metrics import reward_metrics
from cispo.training.setup import absolute_paths

pytestmark = pytest.mark.usefixtures("one_thread")

REWARDS = '''
def length(prompt, completion, **sample):
    return float(len(completion))

def math_only(prompts, completions, task, **kwargs):          # TRL: None where it does not apply
    return [1.0 if task[0] == "math" else None]

def broken(prompt, completion, **sample):
    if "x" in completion:
        raise RuntimeError("checker down")
    return 0.5

def logs(prompts, completions, log_metric, log_extra, **kwargs):   # TRL's logging callbacks
    log_metric("chars", len(completions[0]))
    log_extra("has_b", ["b" in completions[0]])
    log_extra("note", ["a text column is no metric"])
    return [0.0]

def verl_dict(solution_str, ground_truth):
    return {"score": 1.0, "acc": ground_truth in solution_str, "pred": "a text"}

def digits(prompts, completions, **kwargs):                 # a dense reward, so random groups differ
    return [completions[0].count("1") - 0.5]

def digits_or_none(prompts, completions, **kwargs):         # abstains on about half the completions
    return [None if len(completions[0]) % 2 else completions[0].count("1") - 0.5]
'''


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "rw.py"
    path.write_text(REWARDS)
    yield path
    shutdown_pools()


# --------------------------------------------------------------------------- config


def test_a_list_of_rewards_and_its_weights_in_the_config(tmp_path, monkeypatch):
    base = ["data.path=x.jsonl", "model.path=m", "max_new_tokens=4"]
    cfg = apply_overrides(TrainConfig(), base + ["data.reward=[a.py:f, rm:rm_folder]", "data.reward_weights=[1, 0.5]"])
    assert cfg.data.reward == ["a.py:f", "rm:rm_folder"] and cfg.data.reward_weights == [1.0, 0.5]
    for extra, message in [(["data.reward=[a.py:f, b.py:g]", "data.reward_weights=[1]"],
                            "data.reward_weights has 1 weight(s) for 2 reward(s) in data.reward: give one weight"),
                           (["data.reward=a.py:f", "data.reward_weights=[1, 2]"], "has 2 weight(s) for 1 reward(s)"),
                           (["data.reward=[]"], "data.reward is an empty list"),
                           (["data.reward=[a.py:f, b.py:g]", "data.reward_weights=[.inf, 1]"],
                            "data.reward_weights must be finite")]:
        with pytest.raises(ConfigError, match=re.escape(message)) as info:
            apply_overrides(TrainConfig(), base + extra)
        assert "\n" not in str(info.value)
    # each file and reward-model folder of the list is made absolute in the run's config.yaml
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("def f(prompt, completion): return 0.0\n")
    (tmp_path / "rm_folder").mkdir()
    assert absolute_paths(cfg).data.reward == [f"{tmp_path / 'a.py'}:f", f"rm:{tmp_path / 'rm_folder'}"]


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("isolation", ["main", "process"])
def test_the_task_reward_is_the_weighted_sum_of_the_rewards_that_apply(rewards_file, isolation):
    specs = [f"{rewards_file}:{name}" for name in ("length", "math_only", "broken")]
    rewards = load_rewards(specs, [1.0, 2.0, 10.0], isolation, workers=1)
    assert isinstance(rewards, RewardSet) and rewards.names == ("length", "math_only", "broken")
    math, code = {"task": "math"}, {"task": "code"}
    scored = score_completions(rewards, [("p", "ab", math), ("p", "ab", code), ("p", "xy", code)], timeout_s=30)
    assert [s.value for s in scored] == [2 + 2 * 1.0 + 10 * 0.5, 2 + 10 * 0.5, 2.0]
    assert scored[0].error is None and scored[1].error is None  # None abstains: not an error
    assert scored[1].parts == {"length": 2.0, "math_only": None, "broken": 0.5}
    assert scored[2].parts["broken"] == 0.0 and scored[2].error.startswith("broken: RuntimeError: checker down")
    # every reward abstains: 0, and an error; two rewards of one name get unique names
    both = load_rewards([specs[1], specs[1]], None, isolation, workers=1)
    [none] = score_completions(both, [("p", "ab", code)], timeout_s=30)
    assert both.names == ("math_only", "math_only_2")
    assert none.value == 0.0 and "every reward returned None" in none.error
    # one reward of weight 1 is the reward itself, scored as it always was
    single = load_rewards(specs[1], [1.0], isolation, workers=1)
    assert isinstance(single, Reward)
    [alone] = score_completions(single, [("p", "ab", code)], timeout_s=30)
    assert alone.value == 0.0 and "returned NoneType" in alone.error and alone.parts == {"math_only": None}


def constant(value, prompt, completion, **sample):
    return value


@pytest.mark.parametrize("rewards, weights", [([1e308, 1e308], [1.0, 1.0]), ([1e308], [1e10]),
                                               ([1e308, -1e308], [2.0, 2.0])])
def test_a_weighted_sum_that_overflows_is_a_reward_error_scored_0(rewards, weights):
    """Was: finite rewards whose weighted sum overflows (1e308 + 1e308 = inf, 1e10 * 1e308 = inf,
    2e308 - 2e308 = nan) gave a reward of inf (or nan) with no error. Now it scores 0 with an error
    saying why, as a reward that returned inf does; each reward's own value stays in its part."""
    members = tuple(functools.partial(constant, v) for v in rewards)
    names = tuple(f"r{i}" for i in range(len(rewards)))
    [scored] = score_completions(RewardSet(members, tuple(weights), names), [("p", "c", {})])
    assert scored.value == 0.0
    assert scored.error is not None and "weighted sum of the rewards is" in scored.error and "scored 0" in scored.error
    assert scored.parts == dict(zip(names, rewards))
    [fine] = score_completions(RewardSet(members, (1e-10,) * len(rewards), names), [("p", "c", {})])
    assert fine.error is None and fine.value == pytest.approx(sum(1e-10 * r for r in rewards))


@pytest.mark.parametrize("isolation", ["main", "process"])
def test_trl_logging_and_a_verl_dicts_other_keys_are_the_calls_extras(rewards_file, isolation):
    trl = load_reward(f"{rewards_file}:logs", isolation, workers=1)
    verl = load_reward(f"{rewards_file}:verl_dict", isolation, workers=1)
    [t] = score_completions(trl, [("p", "abc", {})], timeout_s=30)
    assert t.extras == (("chars", 3.0), ("has_b", 1.0))  # the text column is left out
    [v] = score_completions(verl, [("p", "so 72", {"answer": "72"})], timeout_s=30)
    assert v.value == 1.0 and v.extras == (("acc", 1.0),)


def test_each_rewards_fields_are_checked_before_training(rewards_file, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(10)))
    cfg = apply_overrides(TrainConfig(), [f"data.path={data}", "model.path=m", "max_new_tokens=4",
                                          f"data.reward=[exact_match, {rewards_file}:math_only]"])
    with pytest.raises(RewardSpecError, match=r"training sample 0 has no field 'task', which reward .*math_only"):
        check_reward_fields(load_source(cfg.data, 4), cfg.data)


# --------------------------------------------------------------------------- metric names


def _completion(reward, parts, extras=()):
    return Completion({}, [1], torch.ones(2), torch.zeros(2), "eos", "", reward, reward, None, parts, extras)


def test_each_reward_gets_its_mean_and_std_and_the_extras_their_mean():
    flat = [_completion(3.0, {"f": 1.0, "g": None}, (("chars", 2.0),)),
            _completion(1.0, {"f": 0.0, "g": 2.0}, (("chars", 4.0), ("chars", 6.0)))]
    assert reward_metrics(flat, "rollout/") == {
        "rollout/rewards/f/mean": 0.5, "rollout/rewards/f/std": 0.5,  # population std
        "rollout/rewards/g/mean": 2.0, "rollout/rewards/g/std": 0.0,  # the abstention left out
        "rollout/reward_extra/chars": 4.0}
    assert reward_metrics([_completion(1.0, {})], "eval/") == {}  # a built-in task's reward: no parts
    assert reward_named({"eval/accuracy": 0.5, "eval/accuracy_pass_at_4": 1.0, "eval/accuracy_greedy": 0.2,
                         "eval/reward_errors": 0.0}) == {
        "eval/reward_mean": 0.5, "eval/reward_pass_at_4": 1.0, "eval/reward_greedy": 0.2, "eval/reward_errors": 0.0}


def _train(tmp_path, model, reward, *extra):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+{i}=", "solution": str(2 * i)}) + "\n" for i in range(20)))
    run = f"r{len(list(tmp_path.glob('r*')))}"
    assert main(["train", f"data.path={data}", f"data.reward={reward}", "data.prompt_field=question",
                 "data.answer_field=solution", f"model.path={model}", f"out_dir={tmp_path}", f"run_name={run}",
                 "model.device=cpu", "progress=false", "steps=1", "prompts_per_step=2", "group_size=4",
                 "updates_per_batch=1", "max_new_tokens=6", "num_eval_prompts=4", "eval.num_samples=2",
                 "dynamic_sampling=false", "data.reward_workers=1", *extra]) == 0
    rows = read_metrics(tmp_path / run / "metrics.jsonl")
    return rows[0], rows[1], json.loads((tmp_path / run / "summary.json").read_text())


def test_a_run_with_several_rewards_logs_each_and_says_reward_not_accuracy(rewards_file, tiny_model, tmp_path):
    evaluation, step, summary = _train(tmp_path, tiny_model, f"[{rewards_file}:digits, {rewards_file}:logs, "
                                                             f"exact_match]",
                                       "data.reward_weights=[1, 1, 2]")
    for prefix, row in (("rollout/", step), ("eval/", evaluation)):
        for name in ("digits", "logs", "exact_match"):
            assert {f"{prefix}rewards/{name}/mean", f"{prefix}rewards/{name}/std"} <= set(row)
        assert row[f"{prefix}rewards/logs/mean"] == 0.0 and row[f"{prefix}reward_extra/has_b"] is not None
        assert 0 < row[f"{prefix}reward_extra/chars"] <= 6  # log_metric: each completion's length
    assert "rollout/accuracy" not in step and not [k for k in evaluation if "accuracy" in k]
    assert step["rollout/reward_std"] > 0 and step["rollout/reward_errors"] == 0
    assert {"eval/reward_mean", "eval/reward_greedy", "eval/reward_pass_at_2"} <= set(evaluation)
    assert summary["eval/reward_mean"]["before"] == evaluation["eval/reward_mean"]  # before -> after still shown


def test_a_run_where_every_reward_abstains_on_some_completions(rewards_file, tiny_model, tmp_path):
    """TRL's unscorable completions: no reward, advantage 0, left out of their group's mean (the scored ones'
    advantages sum to 0 in each kept group) and of the reward metrics; dynamic sampling runs through them."""
    _, step, _ = _train(tmp_path, tiny_model, f"{rewards_file}:digits_or_none", "dynamic_sampling=true",
                        "max_sampling_rounds=3")
    [run] = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("r")]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    unscored = [s for s in samples if s["reward_error"] and "NoneType" in s["reward_error"]]
    assert unscored and all(s["advantage"] == 0.0 for s in unscored)
    for g in {s["group"] for s in samples}:
        assert abs(sum(s["advantage"] for s in samples if s["group"] == g)) < 1e-5
    assert step["rollout/reward_mean"] == step["rollout/rewards/digits_or_none/mean"]  # both over the scored


def test_only_a_verifier_says_accuracy(rewards_file, tiny_model, tmp_path):
    _, step, _ = _train(tmp_path, tiny_model, f"{rewards_file}:digits")  # a shaped reward (-0.5 ...): no accuracy
    assert "rollout/accuracy" not in step and step["rollout/reward_mean"] == step["rollout/rewards/digits/mean"]
    evaluation, step, _ = _train(tmp_path, tiny_model, "exact_match")  # a built-in 0/1 verifier
    assert step["rollout/accuracy"] == step["rollout/rewards/exact_match/mean"]
    assert {"eval/accuracy", "eval/accuracy_greedy", "eval/rewards/exact_match/mean"} <= set(evaluation)


# --------------------------------------------------------------------------- a reward model


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A tiny random Llama sequence classifier with one label, and the tiny models' tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = build_tokenizer(arithmetic.ALPHABET)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=32, num_labels=1, pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("rm") / "tiny_rm"
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_reward_model_scores_prompt_and_completion_batched(reward_model, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = load_reward(f"rm:{reward_model}", isolation="process")
    assert not rm.isolated and rm.name == "tiny_rm"  # in this process, whatever the isolation
    calls = [("1+1=", "2", {}), ("12+30=", "42", {}), ("5=", "1" * 40, {})]
    model = AutoModelForSequenceClassification.from_pretrained(reward_model)
    tok = AutoTokenizer.from_pretrained(reward_model)
    with torch.no_grad():  # one row at a time: no padding
        alone = [float(model(**tok(p + c, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
                 for p, c, _ in calls]
    scored = score_completions(rm, calls)
    assert [s.value for s in scored] == pytest.approx(alone, abs=1e-5) and len(set(alone)) == 3
    assert all(s.error is None and s.parts == {"tiny_rm": s.value} for s in scored)
    both = load_rewards([f"rm:{reward_model}", "exact_match"], [2.0, 1.0])
    [s] = score_completions(both, [("1+1=", "2", {"answer": "2"})])
    assert s.value == pytest.approx(2 * alone[0] + 1.0, abs=1e-5)


def test_a_folder_that_is_no_reward_model_is_one_line(reward_model, tiny_model, tmp_path, capsys):
    with pytest.raises(RewardSpecError, match="holds no trained classification head"):
        load_reward(f"rm:{tiny_model}")  # a causal LM: its head would be random
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}="}) + "\n" for i in range(10)))
    assert main(["train", f"data.path={data}", f"model.path={tiny_model}", "max_new_tokens=4",
                 f"data.reward=rm:{tmp_path / 'no'}", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is no model folder (no config.json in it)" in err and "\n" not in err


def test_a_run_scored_by_a_reward_model(reward_model, tiny_model, tmp_path):
    evaluation, step, _ = _train(tmp_path, tiny_model, f"rm:{reward_model}")
    assert step["rollout/reward_errors"] == 0 and step["rollout/rewards/tiny_rm/std"] > 0
    assert "rollout/accuracy" not in step and "eval/rewards/tiny_rm/mean" in evaluation


def test_a_reward_model_reads_a_chat_row_through_its_chat_template():
    from pathlib import Path

    from transformers import AutoTokenizer

    from cispo.data.rewards.reward_model import RewardModel

    folder = Path(__file__).resolve().parents[3] / "cispo" / "data" / "tasks" / "base_models" / "smollm2-tokenizer"
    rm = RewardModel("rm:x", None, AutoTokenizer.from_pretrained(folder))  # SmolLM2's tokenizer has a chat template
    text = rm.text("2+2?", "4", {"messages": [{"role": "user", "content": "2+2?"}]})
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
    assert rm.text("2+2?", "4", {}) == "2+2?4"  # no messages: prompt + completion


def test_trls_name_of_the_rewards_points_to_data_reward():
    with pytest.raises(ConfigError,
                       match=r"reward_funcs: unknown key \(did you mean 'data.reward'\? 'reward_funcs' in TRL"):
        apply_overrides(TrainConfig(), ["reward_funcs=[a.py:f, b.py:g]"])
    cfg = apply_overrides(TrainConfig(), ["data.path=x.jsonl", "model.path=m", "max_new_tokens=4",
                                          "data.reward=[a.py:f, b.py:g]", "reward_weights=[1, 2]"])
    assert cfg.data.reward_weights == [1.0, 2.0]  # TRL's name of the weights is cispo's (data.reward_weights)
