"""Sampling beside training, one step off policy (``rollout.async_steps=1``; docs/async.md):
the settings refused where the staleness would go unseen; the behaviour policy samples with the weights it was
given when its thread started; a batch is trained on one step after it was sampled; the held batch survives a
checkpoint exactly, so a resumed run equals an uninterrupted one."""

import json
import threading

import pytest
import torch

from cispo.config.train import ConfigError, TrainConfig, apply_overrides
from cispo.data.prompts import FillReport, PromptStream
from cispo.foundations.experience import Completion
from cispo.records.tracking import read_metrics
from cispo.rollout import Sampler
from cispo.training.prefetch import Prefetch, load_rollout, rollout_state
from cispo.training.runner import train
from cispo.training.sampling import StepRollout
from tests.conftest import small_config, strip_perf
from tests.training.test_runner import final_weights

ASYNC = ("rollout.async_steps=1", "algo.logp_old=rollout")
VLLM_ASYNC = ("rollout.async_steps=1", "rollout.engine=vllm", "algo.tis_cap=2")  # vLLM's anchor: recompute + c


# --------------------------------------------------------------------------- settings


def test_async_needs_an_anchor_that_sees_the_staleness():
    with pytest.raises(ConfigError, match="rollout.async_steps.*algo.logp_old=rollout"):
        apply_overrides(TrainConfig(), ["rollout.async_steps=1"])
    for ok in (ASYNC, ("rollout.async_steps=1", "algo.tis_cap=2"),
               ("rollout.async_steps=1", "algo.rollout_is=token", "algo.rollout_is_upper=2")):
        assert apply_overrides(TrainConfig(), list(ok)).rollout.async_steps == 1
    assert apply_overrides(TrainConfig(), [*VLLM_ASYNC]).rollout.async_steps == 1
    with pytest.raises(ConfigError, match="rollout.vllm_sleep=false"):  # it samples while the trainer updates
        apply_overrides(TrainConfig(), [*VLLM_ASYNC, "rollout.vllm_sleep=true"])
    with pytest.raises(ConfigError, match="rollout.async_steps"):
        apply_overrides(TrainConfig(), ["rollout.async_steps=2", "algo.logp_old=rollout"])


# --------------------------------------------------------------------------- the behaviour policy


class _Sampler(Sampler):
    """A stand-in torch sampler: ``for_model`` is all `Prefetch` asks of it."""

    def __init__(self, model):
        self.model = model

    def for_model(self, model):
        return _Sampler(model)


def test_the_behaviour_copy_samples_with_the_weights_given_at_its_start():
    """The trainer's weights are copied before the thread starts: an update the trainer makes meanwhile
    does not reach the batch being sampled."""
    from cispo.models.policy import Policy

    model = torch.nn.Linear(3, 2)
    policy = Policy(model, None, _Sampler(model), torch.device("cpu"))
    prefetch = Prefetch(policy)
    started, release, seen = threading.Event(), threading.Event(), {}

    def sample(behaviour):
        started.set()
        release.wait(10)
        seen["weight"] = behaviour.model.weight.detach().clone()
        assert behaviour.sampler.model is behaviour.model and behaviour.model is not model
        return "batch"

    before = model.weight.detach().clone()
    pending = prefetch.start(policy, sample)
    started.wait(10)
    with torch.no_grad():
        model.weight.add_(1.0)  # the trainer's update, while the sampler runs
    release.set()
    prefetch.join(pending)
    assert prefetch.take() == "batch" and prefetch.held is None
    assert torch.equal(seen["weight"], before)
    assert not any(p.requires_grad for p in prefetch.behaviour.model.parameters())
    prefetch.close()


def test_the_held_batch_round_trips_through_json_exactly():
    samples = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "4"}]
    stream = PromptStream(samples, seed=0)
    taken = stream.take(2)
    logp = torch.tensor([-0.1234567, -2.5e-8, -17.0], dtype=torch.float32)
    c1 = Completion(taken[0], [5, 6], torch.tensor([1, 2, 3]), logp, "eos", "3", 1.0, 0.9, None,
                    {"r": 1.0, "s": None}, (("acc", 1.0),))
    c2 = Completion(taken[1], [7], torch.tensor([4, 9, 9]), logp * 3, "length", "x", 0.0, -0.5, "boom", {}, (),
                    torch.tensor([0.0, 1.0, 0.0]), {"segments": [{"role": "policy", "text": "x"}]})
    rollout = StepRollout([[c1, c2]], FillReport(2, 3, 1), ["boom"], [[c1, c2], [c2]])
    back = load_rollout(json.loads(json.dumps(rollout_state(rollout, stream))), stream)
    assert back.report == rollout.report and back.errors == rollout.errors
    for a, b in zip([*rollout.groups[0], *rollout.sampled[1]], [*back.groups[0], *back.sampled[1]], strict=True):
        assert a.sample is b.sample  # the stream's own row
        for name in ("response_ids", "logp_rollout", "env_mask"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or (torch.equal(x, y) and x.dtype == y.dtype), name
        for name in ("prompt_ids", "finish_reason", "text", "task_reward", "reward", "reward_error", "reward_parts",
                     "reward_extras", "episode"):
            assert getattr(a, name) == getattr(b, name), name


# --------------------------------------------------------------------------- runs


def test_a_run_trains_each_batch_one_step_after_sampling_it(tiny_model, dense_task, tmp_path):
    """Staleness 0 at the first step (it samples its own batch), 1 after; with the behaviour policy's log-probs
    as pi_old, the first update sees the update in between: the trainer's log pi_old (step n's start) differs
    from the sampler's (step n-1's start), where one step of the synchronous run differs by rounding only."""
    sync = train(small_config(tiny_model, tmp_path / "sync", "algo.logp_old=rollout", "eval.every=0"))
    off = train(small_config(tiny_model, tmp_path / "async", *ASYNC, "eval.every=0"))
    rows, rows_sync = read_metrics(off.run_dir / "metrics.jsonl"), read_metrics(sync.run_dir / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0, 1.0]
    assert all(r["optim/step_updates"] == 4 and r["perf/sample_wait_s"] >= 0 for r in steps)
    stale_gap = [r["rollout/logp_abs_diff"] for r in steps[1:]]
    sync_gap = [r["rollout/logp_abs_diff"] for r in rows_sync if r["step"] > 0]
    assert min(stale_gap) > 100 * max(sync_gap) and max(sync_gap) < 1e-5
    assert steps[0]["rollout/logp_abs_diff"] < 1e-5  # step 1: sampled by the trainer's own weights


def test_resume_equals_uninterrupted_with_a_batch_held(tiny_model, dense_task, tmp_path):
    """The checkpoint of step 2 holds the batch sampled for step 3 (and the stream past it): a run cut there
    and resumed trains on the same batches as one never stopped, to the last bit."""
    full = train(small_config(tiny_model, tmp_path / "full", *ASYNC, "steps=4"))
    train(small_config(tiny_model, tmp_path / "cut", *ASYNC, "steps=2"))
    state = json.loads(next((tmp_path / "cut").rglob("step_000002/trainer_state.json")).read_text())
    assert len(state["prefetched"]["groups"]) >= 1
    resumed = train(small_config(tiny_model, tmp_path / "cut", *ASYNC, "steps=4"), resume=True)
    assert strip_perf(read_metrics(full.run_dir / "metrics.jsonl")) == \
        strip_perf(read_metrics(resumed.run_dir / "metrics.jsonl"))
    wf, wr = final_weights(full.run_dir), final_weights(resumed.run_dir)
    assert all(torch.equal(wf[k], wr[k]) for k in wf)


def test_a_batch_sampled_ahead_whose_rewards_a_stop_failed_is_not_kept(tiny_model, monkeypatch, tmp_path):
    """A SIGTERM that fails a reward call of the batch being sampled ahead: the step in flight finishes and
    is checkpointed, but not with that batch (the stream goes back before it); the resumed run samples it again
    and never trains on a reward the stop failed."""
    import dataclasses
    import os
    import signal

    import cispo.data.tasks
    from tests.conftest import digit_reward

    base = cispo.data.tasks.get_task("addition")
    state = {"calls": 0, "armed": True}

    def reward(prompt, completion, **sample):
        state["calls"] += 1
        if state["armed"] and state["calls"] > 24 + 16 + 4:  # the step-0 evaluation, step 1's batch, then ahead
            state["armed"] = False
            os.kill(os.getpid(), signal.SIGTERM)
            raise RuntimeError("the verifier was killed by SIGTERM")
        return digit_reward(prompt, completion)

    monkeypatch.setattr(cispo.data.tasks, "get_task", lambda name="addition": dataclasses.replace(base, reward=reward))
    cfg = small_config(tiny_model, tmp_path / "run", *ASYNC, "eval.every=0", "checkpoint_every=0")
    with pytest.raises(KeyboardInterrupt, match=r"stopped by SIGTERM after step 1; checkpoint saved"):
        train(cfg)
    saved = json.loads(next((tmp_path / "run").rglob("step_000001/trainer_state.json")).read_text())
    assert saved["prefetched"] is None and saved["async_steps"] == 1  # none kept, said so: not a lost one
    resumed = train(cfg, resume=True)
    rows = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r.get("rollout/reward_errors", 0) == 0 for r in rows)
    assert [r["rollout/staleness"] for r in rows[1:]] == [0.0, 0.0, 1.0]  # step 2 sampled anew after the resume


# --------------------------------------------------------------------------- the vLLM engine as the behaviour policy


@pytest.fixture
def engine_log(monkeypatch):
    """The stand-in vLLM (`fake_vllm`) installed, its sampler's calls logged: ("generate" | "push", the thread,
    the number of generate calls in flight at that moment)."""
    from cispo.rollout.vllm_sampler import VLLMSampler
    from tests import fake_vllm

    fake_vllm.install(monkeypatch)
    log, lock, in_flight = [], threading.Lock(), [0]
    generate, push = VLLMSampler.generate, VLLMSampler.update_weights

    def logged_generate(self, *args, **kwargs):
        with lock:
            in_flight[0] += 1
            log.append(("generate", threading.current_thread().name, in_flight[0]))
        try:
            return generate(self, *args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    def logged_push(self, model, *args, **kwargs):
        with lock:
            log.append(("push", threading.current_thread().name, in_flight[0]))
        return push(self, model, *args, **kwargs)

    monkeypatch.setattr(VLLMSampler, "generate", logged_generate)
    monkeypatch.setattr(VLLMSampler, "update_weights", logged_push)
    return log


def test_a_vllm_engine_samples_the_next_batch_with_the_weights_pushed_before_the_step(tiny_model, dense_task,
                                                                                     engine_log, tmp_path):
    """With ``rollout.engine=vllm`` the engine is the behaviour policy (no copy): after step 1 every batch is
    sampled in the sampler thread while the trainer updates, the trainer's push comes only after that thread
    is joined (never during a generate), and the batch trained on is one update old — the recomputed
    log pi_old (the step's start) is then farther from the engine's log-probs than in the synchronous run,
    where they differ by rounding only."""
    sync = train(small_config(tiny_model, tmp_path / "sync", "rollout.engine=vllm", "algo.tis_cap=2",
                              "eval.every=0"))
    engine_log.clear()
    off = train(small_config(tiny_model, tmp_path / "async", *VLLM_ASYNC, "eval.every=0"))
    rows = [r for r in read_metrics(off.run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["optim/step_updates"] == 4 for r in rows)
    pushes = [e for e in engine_log if e[0] == "push"]
    assert len(pushes) == 3 and all(in_flight == 0 for _, _, in_flight in pushes)  # after the join, every step
    ahead = [thread for kind, thread, _ in engine_log if kind == "generate" and thread.startswith("cispo-sampler")]
    assert len(ahead) >= 3  # the batches of steps 2 and 3, and the one held at the end (refills: more calls)
    stale_gap = [r["rollout/logp_abs_diff"] for r in rows[1:]]
    sync_gap = [r["rollout/logp_abs_diff"] for r in read_metrics(sync.run_dir / "metrics.jsonl") if r["step"] > 0]
    assert min(stale_gap) > 100 * max(sync_gap) and max(sync_gap) < 1e-5
    assert rows[0]["rollout/logp_abs_diff"] < 1e-5  # step 1: sampled by the weights it starts from


def test_resume_equals_uninterrupted_on_a_vllm_engine(tiny_model, dense_task, engine_log, tmp_path):
    """The resumed run pushes the checkpoint's weights to the engine before its first step, as the
    uninterrupted run pushed them at the end of that step: the same batches, to the last bit."""
    full = train(small_config(tiny_model, tmp_path / "full", *VLLM_ASYNC, "steps=4"))
    train(small_config(tiny_model, tmp_path / "cut", *VLLM_ASYNC, "steps=2"))
    resumed = train(small_config(tiny_model, tmp_path / "cut", *VLLM_ASYNC, "steps=4"), resume=True)
    assert strip_perf(read_metrics(full.run_dir / "metrics.jsonl")) == \
        strip_perf(read_metrics(resumed.run_dir / "metrics.jsonl"))
    wf, wr = final_weights(full.run_dir), final_weights(resumed.run_dir)
    assert all(torch.equal(wf[k], wr[k]) for k in wf)
