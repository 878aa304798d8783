"""One RL step around the trainer: sample (or take the batch sampled one step ahead), train, push the
weights to a separate engine, and the step's metrics.

    rollout (`StepSampler.sample`; ``rollout.async_steps=1``: the batch `Prefetch` holds, the next one
    sampled in its thread meanwhile) -> a stop signal with failed reward calls gives the step up ->
    `Trainer.step` (advantages, log pi_old, K updates) -> join the sampler thread -> push the weights
    (vLLM) -> ``samples.jsonl`` -> the rollout's metrics (over every response sampled, kept or dropped: also
    in a step without an update) and the trainer's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from cispo.foundations.distributed import any_rank
from cispo.training.metrics import batch_metrics, reports_accuracy, rollout_metrics, tracked_fork
from cispo.training.prefetch import Prefetch
from cispo.training.sampling import StepRollout, StepSampler
from cispo.training.trainer import Trainer


class StepInterrupted(Exception):
    """A stop signal came while the step's rewards were scored and some reward calls failed
    (perhaps because of it: a scheduler signals every process of a job): the step was given up
    before any update, so that it is not committed with those calls scored 0."""


class RLStep:
    """Runs RL steps: ``trainer`` updates on what ``sampler`` draws; ``prefetch`` (``rollout.async_steps=1``,
    `cispo.training.prefetch`) trains on the batch it holds (sampled during the last step; the first step
    samples its own) while its thread samples the next one, joined before a step returns."""

    def __init__(self, trainer: Trainer, sampler: StepSampler, prefetch: Prefetch | None = None) -> None:
        self.trainer, self.sampler, self.prefetch = trainer, sampler, prefetch

    def __call__(self, on_samples: Callable | None = None, stop_requested: Callable[[], bool] | None = None) -> dict:
        """One step; returns its metrics (this rank's). Under data parallelism this rank's share is
        ``prompts_per_step / world_size`` groups. ``on_samples(groups, exp)``, if given, is called after the
        updates with this rank's batch (``exp.extras`` then holds the per-row counts of
        ``cispo.records.samples``); when this rank kept no group, with every group it sampled (all dropped) and
        ``exp=None``. ``stop_requested()``, if given, says whether a stop signal has come: true once the rewards
        are scored, with a failed call on any rank, raises `StepInterrupted` before the updates (the weights,
        the optimizer and the update count unchanged; the prompt stream and the generators advanced)."""
        t0 = time.perf_counter()
        rollout, stale = self.rollout()
        self.give_up_if_stopped(rollout, stale, stop_requested)
        if rollout.errors:
            print(f"cispo: {len(rollout.errors)} reward call(s) failed and scored 0 (first: {rollout.errors[0]})",
                  file=sys.stderr)
        prefetch = self.prefetch
        pending = None if prefetch is None else prefetch.start(
            self.trainer.policy, self.sampler.sample, self.sampler.stream, self.sampler.generator)
        t1 = time.perf_counter()
        try:
            exp, trained = self.trainer.step(rollout.groups)
        finally:
            if pending is not None:  # the next batch, held for the next step
                prefetch.join(pending)
        t2 = time.perf_counter()
        metrics = self.rollout_metrics(rollout)  # with or without an update: when a user most needs them
        if exp is None:  # every group uninformative, every round: nothing to learn
            if on_samples is not None:  # what was sampled and dropped
                on_samples(rollout.sampled, None)
            return {**metrics, **trained, "perf/step_s": t2 - t0, **self.async_metrics(stale)}
        policy = self.trainer.policy
        policy.sampler.update_weights(policy.model)  # a separate inference engine samples the next batch
        t3 = time.perf_counter()
        if on_samples is not None and rollout.groups:
            on_samples(rollout.groups, exp)
        elif on_samples is not None:  # this rank kept no group: the ones it dropped
            on_samples(rollout.sampled, None)
        if rollout.groups:
            metrics.update(batch_metrics(exp))
        metrics.update(trained)
        metrics.update({
            "perf/sample_s": t1 - t0,
            "perf/weight_sync_s": t3 - t2,  # the push to a separate engine (vLLM; its wake-up included); ~0 for torch
            "perf/step_s": t3 - t0,
            **self.async_metrics(stale),
        })
        return metrics

    def rollout(self) -> tuple[StepRollout, bool]:
        """The step's batch and whether it was sampled a step ahead (by the previous weights)."""
        if self.prefetch is not None and self.prefetch.held is not None:
            return self.prefetch.take(), True
        return self.sampler.sample(self.trainer.policy), False

    def give_up_if_stopped(self, rollout: StepRollout, stale: bool, stop_requested) -> None:
        """`StepInterrupted` when a stop signal is pending and a reward call failed on any rank; a batch
        sampled ahead is held again, so the checkpoint of the step before keeps it."""
        if stop_requested is None:
            return
        if any_rank(bool(rollout.errors) and stop_requested(), self.sampler.dist_info):
            if stale:
                self.prefetch.held = rollout
            raise StepInterrupted(f"{len(rollout.errors)} of its reward calls failed while the signal was pending"
                                  + (f" (first: {rollout.errors[0]})" if rollout.errors else " on another rank"))

    def rollout_metrics(self, rollout: StepRollout) -> dict:
        """Every sampled response's rewards, lengths and episodes, kept or dropped (`rollout_metrics`; present in
        a step without an update too), the reward errors, and the prompts retired so far
        (``data.retire_pass_rate``)."""
        task, cfg = self.sampler.task, self.sampler.cfg
        sampled = [c for group in (rollout.sampled or rollout.groups) for c in group]
        metrics = rollout_metrics(sampled, rollout.report, tracked_fork(task), reports_accuracy(task)) \
            if sampled else {"rollout/rounds": float(rollout.report.rounds),
                             "rollout/groups_kept": float(rollout.report.groups_kept)}
        metrics["rollout/reward_errors"] = float(len(rollout.errors))
        if cfg.data.retire_pass_rate is not None:  # ScaleRL's No-Positive-Resampling, cumulative
            metrics["rollout/prompts_retired"] = float(len(self.sampler.stream.retired))
        return metrics

    def async_metrics(self, stale: bool) -> dict:
        """``rollout.async_steps=1``: the batch's staleness (updates between the weights that sampled it and
        those that train on it: 1, or 0 at the first step), the trainer's wait for the next batch
        (``perf/sample_wait_s``: 0 when sampling hid behind the updates) and the sampler thread's time."""
        if self.prefetch is None:
            return {}
        return {"rollout/staleness": float(stale), "perf/sample_wait_s": self.prefetch.wait_s,
                "perf/behaviour_sample_s": self.prefetch.sample_s}
