"""Fork words matched by string (with or without a leading space), and no silent non-runs: a run that never
updates, or evaluates nothing, says so instead of reporting success."""

import dataclasses
import json
import math
import shutil

import pytest
import torch

import cispo.data.tasks
from cispo.cli import main
from cispo.config.train import TrainConfig, apply_overrides, save_yaml
from cispo.data.prompts import FileSource
from cispo.foundations.experience import Completion, collate
from cispo.records.tracking import read_metrics
from cispo.training.metrics import tracked_fork
from cispo.training.setup import fork_matcher

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A byte-level BPE (like Qwen's / Llama 3's) in which "Wait" and "ĠWait" are separate tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Wait, so 2 + 2. Wait no. Hmm Wait then Wait again; Wait."] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def task(*fork_tokens):
    return FileSource(name="t", train=(), eval=(), reward=lambda *a, **k: 0.0, fork_tokens=fork_tokens,
                      max_new_tokens=8)


def response_batch(tokenizer, text):
    resp = torch.tensor(tokenizer.encode(text))
    return collate([Completion({}, [0], resp, torch.zeros(len(resp)), "length", "")], torch.ones(1), 0)


def test_fork_word_matches_with_and_without_a_leading_space(bpe_tokenizer):
    vocab = bpe_tokenizer.get_vocab()
    assert "Wait" in vocab and "ĠWait" in vocab
    for word in ("Wait", " Wait"):
        forks = fork_matcher(bpe_tokenizer, task(word))
        assert {(vocab["Wait"],), (vocab["ĠWait"],)} <= forks.spellings("Wait")
    # a mid-sentence "ĠWait" is counted as a fork token by the PPO-drop diagnostic
    exp = response_batch(bpe_tokenizer, "Hmm Wait then Wait")
    assert int((forks.index(exp.response_ids, exp.response_mask) >= 0).sum()) == 2


def test_no_fork_word_means_null_fork_metrics(bpe_tokenizer):
    assert fork_matcher(bpe_tokenizer, task()) is None
    assert tracked_fork(task()) is None  # fork rates then come out null, not 0.0
    assert tracked_fork(task("Wait"))("so Wait") is True


def test_builtin_fork_token_is_unchanged(tiny_model):
    from cispo.models.loading import load_policy

    _, tok = load_policy(tiny_model)
    base = cispo.data.tasks.get_task("addition")
    assert fork_matcher(tok, base).sequences == ((0, (tok.convert_tokens_to_ids(base.fork_tokens[0]),)),)


def test_run_without_any_update_warns_and_fails(tiny_model, tmp_path, monkeypatch, capsys):
    """A constant reward: every group is uninformative, dynamic sampling drops all of them."""
    base = cispo.data.tasks.get_task("addition")
    monkeypatch.setattr(cispo.data.tasks, "get_task",
                        lambda name="addition": dataclasses.replace(base, reward=lambda *a, **k: 1.0))
    rc = main(["train", f"model.path={tiny_model}", f"out_dir={tmp_path}", "model.device=cpu", "progress=false",
               "steps=2", "prompts_per_step=2", "group_size=2", "updates_per_batch=2", "max_new_tokens=4",
               "max_sampling_rounds=1",
               "num_eval_prompts=2", "eval.num_samples=1", "eval.every=0", "run_name=flat"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "step 1: no update" in err and "not one optimizer update" in err
    rows = read_metrics(tmp_path / "flat" / "metrics.jsonl")
    assert [r.get("optim/step_updates") for r in rows if r["step"] > 0] == [0.0, 0.0]
    # ... and still logs what it sampled: the rewards, lengths and stops of the dropped groups
    for row in (r for r in rows if r["step"] > 0):
        assert row["rollout/reward_mean"] == 1.0 and row["rollout/reward_std"] == 0.0
        assert 1 <= row["rollout/response_length"] <= row["rollout/response_length_max"] <= 4
        assert row["rollout/groups_sampled"] == 2.0 and 0 <= row["rollout/truncated"] <= 1
    # the dropped groups are saved: that is when a user needs to see them
    samples = [json.loads(line) for line in (tmp_path / "flat" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [1, 1, 1, 1, 2, 2, 2, 2]  # 2 groups x G = 2 a step
    assert all(r["reward"] == 1.0 and r["advantage"] is None and r["capped_tokens"] is None for r in samples)
    assert f"run folder: {tmp_path / 'flat'}  (metrics.jsonl, samples.jsonl, config.yaml, curves.png, " \
           "checkpoints/)" in out


def test_progress_line_says_no_update():
    from cispo.training.progress import StepProgress

    class Bar:
        def set_postfix(self, shown, refresh):
            self.shown = shown

        def update(self, n):
            pass

    bar = Bar()
    StepProgress(bar, 1).advance(1, {"optim/step_updates": 0.0, "rollout/fork_rate": math.nan}, no_update="why")
    assert bar.shown["updates"].startswith("0") and "fork" not in bar.shown


def test_eval_of_a_run_checkpoint_reads_the_runs_config(tiny_model, tmp_path, monkeypatch, capsys):
    import cispo.data.prompts

    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "{a}+{a}=", "answer": "{2 * a}"}}\n' for a in range(10)))
    run = tmp_path / "run"
    cfg = apply_overrides(TrainConfig(), [f"data.path={data}", "data.reward=exact_match", "max_new_tokens=4",
                                          "num_eval_prompts=2", "eval.num_samples=1", "model.device=cpu",
                                          f"model.path={tiny_model}", "model.lora_rank=4"])
    run.mkdir()
    save_yaml(cfg, run / "config.yaml")
    shutil.copytree(tiny_model, run / "checkpoints" / "step_000001" / "model")
    seen = []
    real = cispo.data.prompts.load_source
    monkeypatch.setattr(cispo.data.prompts, "load_source", lambda d, m: seen.append(d) or real(d, m))
    assert main(["eval", "--model", str(run / "checkpoints" / "step_000001" / "model")]) == 0
    assert "using the run's config" in capsys.readouterr().err
    assert seen[0].path == str(data) and seen[0].reward == "exact_match"  # the run's data, not addition


def test_missing_chat_template_is_a_config_error_before_the_data(tiny_model, tmp_path, capsys):
    rc = main(["train", f"model.path={tiny_model}", "model.chat_template=true", "model.device=cpu",
               f"data.path={tmp_path / 'does-not-exist.jsonl'}", "data.reward=exact_match", "max_new_tokens=4",
               f"out_dir={tmp_path}", "progress=false"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "does-not-exist" not in err


def test_the_printed_summary_says_when_nothing_was_evaluated():
    from cispo.training.runner import format_summary

    text = format_summary({"steps": 3, "eval/accuracy": {"before": 0.25, "after": None}})
    assert text.splitlines() == ["after 3 steps (held-out, before -> after):",
                                 f"  {'eval/accuracy':32s} 0.250 -> n/a"]
    assert format_summary({}) == "no held-out evaluation (num_eval_prompts=0): no before -> after to show"
