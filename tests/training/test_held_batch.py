"""A checkpoint's batch sampled ahead (``rollout.async_steps=1``), damaged: checked against the model, the prompt
stream and its own shapes before anything is restored, so ``--resume`` names the file and the field and goes on
from the previous checkpoint (whose own held batch makes the resumed run the uninterrupted one again) — never an
``IndexError`` in the embedding, a torch function named as a dtype, or a NaN log-prob trained on."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from cispo.records.tracking import read_metrics
from cispo.training.checkpoint import CheckpointError
from cispo.training.held_batch import HeldBatchError, HeldBatchLimits, check_held_batch
from cispo.training.runner import train
from tests.conftest import small_config, strip_perf, train_dense

pytestmark = pytest.mark.usefixtures("one_thread")

ASYNC = ("rollout.async_steps=1", "algo.logp_old=rollout")


def run_config(model, out, *extra):
    return small_config(model, out, *ASYNC, "run_name=r", "steps=2", "checkpoint_every=1", "keep_checkpoints=2",
                        "eval.every=0", *extra)


@pytest.fixture(scope="module")
def original(tiny_model, tmp_path_factory, one_thread):
    """A 2-step async run with checkpoints at steps 1 and 2 (each holding the batch sampled for the next step)."""
    out = tmp_path_factory.mktemp("original")
    result = train_dense(run_config(tiny_model, out))
    return result.run_dir, read_metrics(result.run_dir / "metrics.jsonl")


def first(state):
    """The first completion of the held batch's first group (the one the next step trains on)."""
    return state["prefetched"]["groups"][0][0]


def set_in(*keys, value):
    def damage(state):
        target = state
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value
    return damage


DAMAGE = {  # how the newest checkpoint's trainer_state.json is damaged -> what the warning says
    "response id past the vocabulary": (lambda s: first(s)["response_ids"]["data"].__setitem__(0, 10**6),
                                        "response_ids holds token id 1000000, outside the model's vocabulary"),
    "prompt id negative": (lambda s: first(s)["prompt_ids"].__setitem__(0, -1), "prompt_ids holds token id -1"),
    "prompt index past the stream": (lambda s: first(s).__setitem__("sample", 10**6),
                                     "sample is 1000000, not the index of a prompt in the stream"),
    "dtype naming a torch function": (lambda s: first(s)["response_ids"].__setitem__("dtype", "ones"),
                                      "response_ids names dtype 'ones'"),
    "log-probs one short": (lambda s: first(s)["logp_rollout"]["data"].pop(),
                            "logp_rollout has 1 log-prob(s) fewer than"),
    "unknown field": (lambda s: first(s).__setitem__("bogus", 1), "has unknown field(s) bogus"),
    "NaN log-prob": (lambda s: first(s)["logp_rollout"]["data"].__setitem__(0, math.nan),
                     "logp_rollout holds a NaN or an infinity"),
    "log-prob past float32": (lambda s: first(s)["logp_rollout"]["data"].__setitem__(0, -1e300),
                              "logp_rollout holds a NaN or an infinity"),
    "NaN reward": (lambda s: first(s).__setitem__("reward", math.nan), "reward is nan, not a finite number"),
    "report not counts": (set_in("prefetched", "report", "rounds", value="1"), "prefetched.report is"),
    "held batch removed": (lambda s: s.pop("prefetched"),
                           "written with rollout.async_steps=1 but holds no batch sampled ahead"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_held_batch_falls_back_to_the_previous_checkpoint(tiny_model, dense_task, original, tmp_path, capsys,
                                                                   case):
    damage, says = DAMAGE[case]
    run_dir = tmp_path / "r"
    shutil.copytree(original[0], run_dir)
    bad_file = run_dir / "checkpoints" / "step_000002" / "trainer_state.json"
    state = json.loads(bad_file.read_text())
    damage(state)
    bad_file.write_text(json.dumps(state))
    capsys.readouterr()
    train(run_config(tiny_model, tmp_path), resume=True)  # from step 1 and the batch it held: step 2 again
    err = capsys.readouterr().err
    assert f"skipping checkpoint step_000002: checkpoint file {bad_file}" in err and says in err, err
    assert "resumed" in err and "from step_000001" in err
    assert strip_perf(read_metrics(run_dir / "metrics.jsonl")) == strip_perf(original[1])  # as if never stopped
    a = load_file(original[0] / "checkpoints" / "step_000002" / "model" / "model.safetensors")
    b = load_file(run_dir / "checkpoints" / "step_000002" / "model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_no_intact_checkpoint_with_a_damaged_held_batch_is_refused_in_one_line(tiny_model, dense_task, original,
                                                                              tmp_path):
    run_dir = tmp_path / "r"
    shutil.copytree(original[0], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000001")
    bad_file = run_dir / "checkpoints" / "step_000002" / "trainer_state.json"
    state = json.loads(bad_file.read_text())
    first(state)["response_ids"]["dtype"] = "ones"
    bad_file.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=rf"no intact checkpoint .*{bad_file}.*names dtype 'ones'"):
        train(run_config(tiny_model, tmp_path), resume=True)


def test_the_check_passes_a_held_batch_and_names_the_first_wrong_field():
    limits = HeldBatchLimits(vocab_size=20, num_samples=4)
    ok = {"sample": 3, "prompt_ids": [1, 2], "response_ids": {"data": [3, 19], "dtype": "int64"},
          "logp_rollout": {"data": [-0.5, -1.0], "dtype": "float32"}, "finish_reason": "eos", "text": "x",
          "env_mask": {"data": [False, True], "dtype": "bool"}}
    held = {"groups": [[ok]], "sampled": [[ok]], "report": {"rounds": 1, "groups_sampled": 1, "groups_kept": 1},
            "errors": []}
    check_held_batch(held, limits)
    for field, value, says in [("env_mask", {"data": [0, 2], "dtype": "int64"}, "is not one 0 / 1"),
                               ("response_ids", {"data": [3.0, 4.0], "dtype": "float32"}, "names dtype 'float32'"),
                               ("finish_reason", None, "is None, not text")]:
        bad = {**held, "sampled": [[{**ok, field: value}]]}
        with pytest.raises(HeldBatchError, match=rf"prefetched\.sampled\[0\]\[0\]\.{field} {says}"):
            check_held_batch(bad, limits)
