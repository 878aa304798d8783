"""What a run says while it starts and steps (cispo.training.progress): a line per start-up phase and per step
when there is no terminal (a batch job's log), the packaged model's slow first conversion and the reward workers
announced before they start, an evaluation's own progress bar at a terminal, and the held-out accuracy kept on
the step bar between evaluations."""

from __future__ import annotations

import io
import re
import time

import pytest

from cispo.cli import main
from cispo.training import progress
from tests.conftest import run_args

pytestmark = pytest.mark.usefixtures("one_thread")


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
    assert capsys.readouterr().err == (f"cispo: model: converting builtin:smollm2-135m from {source.name} into "
                                       f"{folder} "
                                       "(once: 4-7 minutes on a 2-core CPU; later runs load the converted folder)\n")
    packaged.ensure_packaged("smollm2-135m", cache_dir=tmp_path / "cache")  # converted: nothing to say
    assert capsys.readouterr().err == ""


def test_the_reward_workers_phase_is_said():
    class Member:
        def __init__(self, spec, isolated, workers):
            self.spec, self.isolated, self.workers = spec, isolated, workers

    # a reward in this process: nothing to wait for
    assert progress.reward_workers_line([Member("exact_match", False, 1)]) is None
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


def test_a_terminal_that_reports_0_columns_gets_plain_lines(monkeypatch):
    """Issue 59: a console that is a terminal but reports 0 columns got a tqdm bar drawn nowhere, so nothing at
    all was printed for minutes; it gets the plain lines of a log file."""
    class ZeroColumns(FakeTerminal):
        def fileno(self):
            return 2

    monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd: progress.os.terminal_size((0, 0)))
    assert not progress.interactive(True, ZeroColumns())
    monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd: progress.os.terminal_size((80, 24)))
    assert progress.interactive(True, ZeroColumns())


def test_an_agent_runs_bar_shows_the_tool_call_rate_beside_fork():
    class Bar:
        def set_postfix(self, shown, refresh):
            self.shown = dict(shown)

        def update(self, n):
            pass

    bar = Bar()
    progress.StepProgress(bar, 3).advance(1, {"rollout/fork_rate": 0.25, "rollout/tool_call_rate": 0.75})
    assert list(bar.shown) == ["fork", "tools"] and bar.shown["tools"] == "0.750"


def test_an_evaluations_bar_advances_while_its_answers_decode():
    """Issue 59: the bar of an evaluation sat at 0/100 while its one chunk of prompts decoded, then jumped to
    100/100; it now moves as the sampler stops rows (`Sampler.rows_done`), and still ends at every answer."""
    import torch

    from cispo.config.train import EvalConfig
    from cispo.data.tasks import arithmetic
    from cispo.models.loading import build_model, build_tokenizer
    from cispo.models.policy import Policy
    from cispo.rollout.torch_sampler import TorchSampler
    from cispo.training.evaluation import Evaluation, evaluate
    from tests.conftest import digit_reward

    tok = build_tokenizer(arithmetic.ALPHABET)
    model = build_model(tok, size="tiny", seed=0)
    policy = Policy(model, tok, TorchSampler(model, tok.eos_token_id, tok.pad_token_id), torch.device("cpu"))
    samples = [{"prompt": f"{a}+{a + 3}="} for a in range(10, 22)]  # 12 prompts: one chunk
    ticks = []
    evaluate(policy, samples, Evaluation(digit_reward, EvalConfig(num_samples=2), 12, seed=0, on_progress=ticks.append))
    assert sum(ticks) == 12 * 3  # greedy + 2 sampled, every answer once
    assert len(ticks) > 2 and min(ticks) >= 1  # more than one tick a mode: rows that stopped early were told
    assert policy.sampler.rows_done is None  # the hook is the evaluation's only while it samples
