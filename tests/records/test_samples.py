"""Saved completions (cispo.records.samples: samples.jsonl, the sinks' tables) and pass@k / maj@k."""

import json

import pytest
import torch

from cispo.foundations.experience import Completion, Experience
from cispo.objective.loss import policy_loss, preset
from cispo.records.samples import SAMPLE_FIELDS, SampleFile, add_token_counts, markdown_table, start_token_counts
from cispo.records.tracking import make_sinks, read_metrics
from cispo.training.evaluation import group_accuracies
from cispo.training.runner import train
from tests.conftest import small_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _completion(text, task_reward):
    return Completion({"prompt": "1+1="}, [1], torch.tensor([3, 4]), torch.zeros(2), "eos", text, task_reward,
                      task_reward)


def test_pass_and_maj_at_k_by_hand():
    groups = [
        # answers 2, 2, 3: majority "2" is right (1.0); pass: 1.0
        [_completion("=2", 1.0), _completion("=2", 1.0), _completion("=3", 0.0)],
        # answers 5, 3, 3: majority "3" is wrong; pass: 1.0 (one right)
        [_completion("=5", 1.0), _completion("=3", 0.0), _completion("=3", 0.0)],
        # no answer at all: maj 0; pass 0
        [_completion("x", 0.0), _completion("y", 0.0), _completion("z", 0.0)],
        # a tie 7 / 8: the answer seen first (7, right) wins
        [_completion("=7", 1.0), _completion("=8", 0.0), _completion("??", 0.0)],
    ]
    answer = lambda text: text[1:] if text.startswith("=") else None  # noqa: E731
    assert group_accuracies(groups, answer) == {"pass": 3 / 4, "maj": 2 / 4}
    # default answer: the stripped completion, so every text is an answer
    assert group_accuracies(groups[2:3]) == {"pass": 0.0, "maj": 0.0}


def _count(exp, rows, logp_new, obj):
    """``add_token_counts`` with the flags of the objective's call on the micro-batch ``rows``."""
    sub = exp.select(rows)
    _, stats = policy_loss(logp_new, sub.logp_old, sub.advantages, sub.response_mask, obj)
    add_token_counts(exp, rows, stats)


def test_token_counts_by_value():
    """Row 0 (A > 0): r = 2.0, 1.3, 1.0; row 1 (A < 0): r = 0.5, 0.9 (one padding token).
    cispo (cap 1 + 4 = 5 -> no cap; with eps_high_is=0.25 -> cap 1.25): capped 2.0, 1.3.
    PPO mask eps 0.2: drops A > 0 and r > 1.2 (2.0, 1.3); A < 0 and r < 0.8 (0.5)."""
    logp_old = torch.zeros(2, 3)
    logp_new = torch.log(torch.tensor([[2.0, 1.3, 1.0], [0.5, 0.9, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ids = torch.zeros(2, 4, dtype=torch.long)
    exp = Experience(ids, torch.ones_like(ids), mask, logp_old, torch.tensor([1.0, -1.0]), logp_old=logp_old)
    rows = torch.arange(2)
    _count(exp, rows, logp_new, preset("cispo"))
    assert "samples/capped_tokens" not in exp.extras  # counts only where asked for
    start_token_counts(exp)
    obj = preset("cispo", eps_high_is=0.25, eps_low_is=0.2)  # weight clip [0.8, 1.25]
    _count(exp, rows, logp_new, obj)
    assert exp.extras["samples/capped_tokens"].tolist() == [2, 1]  # 2.0, 1.3 | 0.5
    assert exp.extras["samples/ppo_dropped_tokens"].tolist() == [2, 1]  # 2.0, 1.3 | 0.5
    _count(exp, rows[1:], logp_new[1:, :2], obj)  # a second epoch of row 1
    assert exp.extras["samples/capped_tokens"].tolist() == [2, 2]


def test_sample_file_is_size_bounded_and_truncates_on_resume(tmp_path, capsys):
    f = SampleFile(tmp_path / "samples.jsonl", max_mb=0.001)  # 1000 bytes
    row = {"step": 1, "completion": "x" * 400}  # 432 bytes a line
    assert f.append([row]) and f.append([dict(row, step=2)])
    assert not f.append([dict(row, step=3)]) and not f.append([dict(row, step=4)])
    assert capsys.readouterr().err.count("reached samples_max_mb") == 1  # said once
    f.truncate_after(1)
    assert [json.loads(line)["step"] for line in f.path.read_text().splitlines()] == [1]
    assert "a \\| b" in markdown_table([{"prompt": "a | b", "reward": 0.5}], ("prompt", "reward"))


def test_a_record_with_text_that_is_not_valid_unicode_is_saved_replaced(tmp_path):
    """Was: a lone surrogate anywhere in a record (a tool call's JSON arguments ``{"a": "\\ud800"}`` the
    policy wrote, a reward's message) raised UnicodeEncodeError in the append and ended the run. Now each
    is written as U+FFFD; the rest of the record and the lines before it are kept."""
    f = SampleFile(tmp_path / "samples.jsonl", max_mb=1)
    record = {"step": 1, "reward_error": "x\udcff",
              "calls": [{"name": "add\ud800", "arguments": {"\ud801": ["\udc00"]}}]}
    assert f.append([{"step": 1, "completion": "fine"}, record])
    rows = [json.loads(line) for line in f.path.read_text(encoding="utf-8").splitlines()]
    assert rows == [{"step": 1, "completion": "fine"},
                    {"step": 1, "reward_error": "x\ufffd",
                     "calls": [{"name": "add\ufffd", "arguments": {"\ufffd": ["\ufffd"]}}]}]


def test_training_run_saves_samples_and_reports_pass_and_maj(tiny_model, dense_task, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(small_config(tiny_model, tmp_path, "steps=2", "max_samples_per_step=6", "samples_max_chars=5",
                                "trackers=[tensorboard]"))
    records = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] * 6 + [2] * 6
    for r in records:
        assert tuple(r) == SAMPLE_FIELDS
        assert r["fork_tokens"] == r["completion"].count("W") or r["completion"].endswith("…")
        assert len(r["completion"]) <= 6 and 0 <= r["capped_tokens"] <= r["length"]
        assert 0 <= r["ppo_dropped_tokens"] <= r["length"]
    first_group = [r for r in records if r["step"] == 1 and r["group"] == 0]
    assert len(first_group) == 4 and abs(sum(r["advantage"] for r in first_group)) < 1e-5  # group-relative A
    rewards = [r["reward"] for r in first_group]
    assert [r["advantage"] > 0 for r in first_group] == [x > sum(rewards) / 4 for x in rewards]

    events = EventAccumulator(str(result.run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "samples/text_summary" in events.Tags()["tensors"]

    rows = read_metrics(result.run_dir / "metrics.jsonl")
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    for r in evals:  # k = eval.num_samples = 2
        assert r["eval/accuracy_pass_at_2"] >= r["eval/accuracy_mean_at_2"] - 1e-9
        assert 0.0 <= r["eval/accuracy_maj_at_2"] <= 1.0


def test_samples_every_and_off(tiny_model, dense_task, tmp_path):
    result = train(small_config(tiny_model, tmp_path / "a", "steps=3", "log_samples_every=2", "eval.every=0"))
    steps = {json.loads(line)["step"] for line in (result.run_dir / "samples.jsonl").read_text().splitlines()}
    assert steps == {2}
    result = train(small_config(tiny_model, tmp_path / "b", "steps=1", "log_samples_every=0", "eval.every=0"))
    assert not (result.run_dir / "samples.jsonl").exists()


def test_mlflow_artifact_and_wandb_table(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                        "WANDB_DIR": str(tmp_path / "wd"), "WANDB_CONFIG_DIR": str(tmp_path / "wc"),
                        "WANDB_CACHE_DIR": str(tmp_path / "wcache"), "WANDB_DATA_DIR": str(tmp_path / "wdata")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    records = [dict.fromkeys(SAMPLE_FIELDS, 1) | {"completion": "=2", "reward_error": None}]
    sinks = make_sinks(["mlflow", "wandb"], tmp_path / "run", "r", {}, mlflow_tracking_uri=uri)
    sinks.log(3, {"rollout/reward_mean": 1.0})
    sinks.log_samples(3, records)
    sinks.close()
    assert not sinks.failed  # neither sink was switched off by an error
    run_id = json.loads((tmp_path / "run" / "tracking.json").read_text())["mlflow_run_id"]
    path = MlflowClient(tracking_uri=uri).download_artifacts(run_id, "samples/step_000003.jsonl", str(tmp_path))
    assert [json.loads(line) for line in open(path)] == records
    tables = list((tmp_path / "run" / "wandb").glob("offline-run-*/files/media/table/samples_3_*.table.json"))
    assert len(tables) == 1 and json.loads(tables[0].read_text())["columns"] == list(SAMPLE_FIELDS)


def test_greedy_only_evaluation(tiny_model, dense_task, tmp_path):
    """eval.num_samples=0 skips the sampled pass: eval/accuracy is the greedy accuracy, no mean@k."""
    result = train(small_config(tiny_model, tmp_path, "steps=1", "eval.num_samples=0", "eval.every=0"))
    evals = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    assert len(evals) == 2
    for r in evals:
        assert r["eval/accuracy"] == r["eval/accuracy_greedy"]
        assert not [k for k in r if "_at_" in k]
    with pytest.raises(ValueError, match="eval.num_samples"):
        small_config(tiny_model, tmp_path, "eval.num_samples=-1")


def test_evaluation_reports_the_share_cut_at_the_length_limit(monkeypatch):
    """eval/truncated = #(finish_reason == "length") / #answers, over the greedy answers (k = 0)."""
    import torch

    import cispo.training.evaluation as evaluation
    from cispo.config.train import EvalConfig
    from cispo.foundations.experience import Completion

    reasons = ["length", "eos", "length", "repetition"]

    def fake_groups(policy, samples, k, sampling, scoring, generator):
        return [[Completion(s, [1], torch.ones(3 + i), torch.zeros(3 + i), reasons[i], "x", task_reward=1.0)]
                for i, s in enumerate(samples)]

    monkeypatch.setattr(evaluation, "sample_groups", fake_groups)

    class Device:
        device = "cpu"

    out = evaluation.evaluate(Device(), [{}] * 4, evaluation.Evaluation(None, EvalConfig(num_samples=0), 8, seed=0))
    assert out["eval/truncated"] == 0.5
    assert out["eval/response_length"] == (3 + 4 + 5 + 6) / 4
