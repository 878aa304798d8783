"""ScaleRL's No-Positive-Resampling (``data.retire_pass_rate``): a prompt whose group's
pass rate reaches the rate is not sampled again; the retired set survives a checkpoint; once every
prompt is retired the stream hands them all out again; a run logs the count."""

import json

import pytest

from cispo.config.train import ConfigError, TrainConfig, apply_overrides
from cispo.data.prompts import PromptStream
from cispo.foundations.experience import Completion
from cispo.training.runner import train
from cispo.training.sampling import retire_solved
from tests.conftest import small_config

pytestmark = pytest.mark.usefixtures("one_thread")


def samples(n):
    return [{"prompt": f"p{i}"} for i in range(n)]


def group(sample, rewards):
    return [Completion(sample, [1], None, None, "eos", "", task_reward=r) for r in rewards]


def test_a_solved_prompt_is_not_taken_again():
    stream = PromptStream(samples(6), seed=0)
    first = stream.take(3)
    retire_solved(stream, [group(first[0], [1, 1, 1, 0.0]), group(first[1], [1, 0, 0, 0.0])], 0.75)
    assert stream.retired == {stream.samples.index(first[0])}
    taken = [s["prompt"] for s in stream.take(60)]
    assert first[0]["prompt"] not in taken and first[1]["prompt"] in taken
    retire_solved(stream, [group(first[1], [1, 0, 0, 0.0])], None)  # off: nothing retired
    assert len(stream.retired) == 1


def test_the_retired_set_survives_a_checkpoint():
    a = PromptStream(samples(5), seed=3)
    a.retire(a.take(1)[0])
    b = PromptStream(samples(5), seed=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.retired == a.retired and [s["prompt"] for s in b.take(8)] == [s["prompt"] for s in a.take(8)]
    old = {k: v for k, v in a.state_dict().items() if k != "retired"}  # a checkpoint from before retirement
    b.load_state_dict(old)
    assert b.retired == set()


def test_every_prompt_retired_hands_them_out_again(capsys):
    stream = PromptStream(samples(3), seed=0)
    for s in stream.samples:
        stream.retire(s)
    assert len(stream.take(3)) == 3 and not stream.retired
    assert "all 3 training prompts retired" in capsys.readouterr().err
    for _ in range(5):  # with few prompts it comes again and again: said once, counted every time
        for s in stream.samples:
            stream.retire(s)
        stream.take(3)
    assert capsys.readouterr().err == "" and stream.all_retired == 6


def test_the_rate_is_checked():
    with pytest.raises(ConfigError, match="data.retire_pass_rate"):
        apply_overrides(TrainConfig(), ["data.retire_pass_rate=1.5"])


def test_a_run_logs_the_retired_count(tiny_model, tmp_path, dense_task):
    cfg = small_config(tiny_model, tmp_path, "eval.every=0", "checkpoint_every=0", "data.retire_pass_rate=0.05")
    run = train(cfg)
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    counts = [r["rollout/prompts_retired"] for r in rows if "rollout/prompts_retired" in r]
    assert len(counts) == 3 and counts == sorted(counts) and counts[-1] > 0
