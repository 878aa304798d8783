"""A training run around the RL loop, in the order it happens (``train``):

1. set up (`cispo.training.run.set_up`): the process (threads, seed, device, torchrun rank), the data
   and rewards (checked before any weights load), the run folder, the policy and the trainer, the prompt
   streams, generators and metric sinks;
2. resume (``resume_or_start``): the newest intact checkpoint, or a fresh start's run info and
   step-0 evaluation;
3. the step loop (``step_loop``): one RL step (`cispo.training.rl_step.RLStep`), its checks,
   held-out evaluation every ``eval.every`` steps, its metrics, a checkpoint every
   ``checkpoint_every`` steps; a stop signal checkpoints and exits;
4. finish (``finish``): summary, curves, a warning when no update was made.

The updates themselves are `cispo.training.trainer.Trainer`'s."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from cispo.config.train import TrainConfig
from cispo.data.rewards import closing_reward_pools
from cispo.foundations.distributed import any_rank, barrier, gather_objects
from cispo.models.policy import Policy
from cispo.records.runfolder import SUMMARY, run_dir_of, run_lock, run_name
from cispo.records.samples import sample_records
from cispo.records.tracking import read_metrics
from cispo.training.checkpoint import Expected, check_trainer_state, load_latest_checkpoint, nonfinite_parameters
from cispo.training.evaluation import answers_per_prompt
from cispo.training.held_batch import HeldBatchLimits
from cispo.training.metrics import reduce_over_ranks
from cispo.training.progress import evaluation_count, evaluation_done_line, evaluation_plan, say, step_progress
from cispo.training.rl_step import StepInterrupted
from cispo.training.run import Run, record_sampler_info, set_up, write_run_info


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    updates: int | None = None  # optimizer steps taken by this invocation (0: the weights never changed)


def bad_step_count(count: int, metrics: dict, policy: Policy) -> int:
    """The run of consecutive bad steps after this one: +1 when the step tried updates and every one had a
    non-finite gradient, 0 when one was applied, unchanged when it tried none (every group dropped). The step's
    own updates are counted, not ``algo.updates_per_batch``: empty mini-batches and ``fixed_size``'s short
    batches make fewer. Under float16 loss scaling an overflow while the scale S is still large is the scaler
    finding its level (S halves and the update is skipped), so such a step counts only once S has fallen below 1."""
    if metrics.get("optim/step_updates", 0) > 0:
        return 0
    if not metrics.get("optim/skipped"):
        return count
    return count + 1 if policy.grad_scaler is None or policy.grad_scaler.get_scale() < 1.0 else 0


def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False) -> RunResult:
    """Run (or resume) the training run described by ``cfg`` (under ``torchrun``: one rank). The
    run folder is locked for the whole run (rank 0 holds it): a second process on the same folder
    is refused before it changes anything (``RunFolderInUse``)."""
    run_dir = run_dir_of(cfg)  # run_name checked before any work
    main = int(os.environ.get("RANK", "0")) == 0
    with run_lock(run_dir) if main else contextlib.nullcontext(), closing_reward_pools():  # started in set-up
        return _train(cfg, resume, overwrite)


def _train(cfg: TrainConfig, resume: bool, overwrite: bool) -> RunResult:
    """``train``'s body, with the run folder locked: set up, resume (or evaluate step 0), the step
    loop with its evaluation and checkpoint schedule, finish."""
    run = set_up(cfg, resume, overwrite)
    try:
        start = resume_or_start(run, resume)
        first_update_count = run.trainer.update_count
        try:
            last = step_loop(run, start)
        finally:
            if run.prefetch is not None:  # its thread is idle between steps: nothing is lost
                run.prefetch.close()
        return finish(run, start, run.trainer.update_count - first_update_count, last)
    finally:  # an agent's endpoint, the tools' workers: nothing outlives the run in this process
        if run.policy.environment is not None:
            run.policy.environment.close()


# --------------------------------------------------------------------------- resume


def held_batch_limits(run: Run) -> HeldBatchLimits | None:
    """What a checkpoint's batch sampled ahead must fit to be trained on (``rollout.async_steps=1``): the
    model's vocabulary (its embedding rows) and the prompt stream; None without a batch sampled ahead."""
    if run.prefetch is None:
        return None
    return HeldBatchLimits(run.policy.model.get_input_embeddings().num_embeddings, len(run.stream.samples))


def resume_or_start(run: Run, resume: bool) -> int:
    """The step the loop continues after: the newest intact checkpoint's (its weights, optimizer,
    streams, generators and counters restored; the sinks and samples.jsonl cut back to it), else 0,
    after a fresh start's run info and its step-0 evaluation."""
    found = None
    if resume:
        expected = Expected(run.dist_info.rank, run.dist_info.world_size, run.stream.state_dict(),
                            run.generator_states(), held_batch_limits(run))
        check = partial(check_trainer_state, expected=expected)
        found = load_latest_checkpoint(run.run_dir, run.policy.model, run.trainer.optimizer,
                                       report=None if run.main else _quiet, check=check)
    if found is not None:  # the newest intact one; newer broken ones were reported and skipped
        return run.restore(*found)
    if run.main:
        if resume:
            print(f"cispo: no checkpoint in {run.run_dir}; starting from step 0", file=sys.stderr)
        run.sink.truncate_after(-1)
        run.sample_file.truncate_after(-1)
        write_run_info(run.run_dir, run.cfg, run.sampling, run.trainer.objective, run.policy.sampler.info())
        plan = evaluation_plan(run.cfg, run.eval_prompts, answers_per_prompt(run.cfg.eval), run.sampling.max_new_tokens)
        if plan:
            say(plan)
    began = time.monotonic()
    row = run.evaluate(0)
    if run.main:
        if row:
            remaining = evaluation_count(run.cfg.steps, run.cfg.eval.every) - 1
            say(evaluation_done_line(0, time.monotonic() - began, row, remaining))
        run.sink.log(0, row)
    return 0


# --------------------------------------------------------------------------- the step loop


def step_loop(run: Run, start: int) -> dict:
    """Steps ``start + 1 .. cfg.steps``: each one RL step (`RLStep`), then its checks, held-out
    evaluation when due, its metrics logged, a checkpoint when due. A stop signal checkpoints and
    raises KeyboardInterrupt; weights gone non-finite, or ``max_bad_steps`` steps of only skipped
    updates, raise FloatingPointError. Returns the last step's metrics."""
    cfg, stop = run.cfg, StopRequest()
    progress = step_progress(cfg.progress, cfg.steps, start) if run.main else None
    if progress is not None:
        progress.keep(run.last_eval)  # step 0's held-out numbers, shown until the next evaluation
    templated = run.policy.tokenizer.decode if run.policy.chat_template else None  # samples.jsonl: templated prompts
    bad_steps, metrics = 0, {}
    with stop.installed(), (run.sink if run.sink is not None else contextlib.nullcontext()), _closing(progress):
        for step in range(start + 1, cfg.steps + 1):
            metrics = one_step(run, step, stop, templated)
            bad_steps = bad_step_count(bad_steps, metrics, run.policy)
            if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                metrics.update(run.evaluate(step))
            if run.main:
                run.sink.log(step, metrics)
                if step == start + 1 and run.policy.sampler.info():
                    record_sampler_info(run.run_dir, run.policy.sampler.info())
            if bad_steps >= cfg.max_bad_steps:
                run.checkpoint(step)  # every update of these steps was skipped: the weights are the last good ones
                raise FloatingPointError(
                    f"{bad_steps} consecutive steps had only non-finite gradients (step {step}); "
                    f"the last good weights are checkpointed in {run.run_dir / 'checkpoints'}. Lower optim.lr or "
                    f"check the reward / data.")
            if stop.requested and run.prefetch is not None:  # a batch sampled ahead, failed by the stop: not kept
                run.prefetch.drop_failed(run.stream, run.generators["sample"])
            if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stop.requested:
                run.checkpoint(step)
            if progress is not None:  # a bar, or a line per step (no terminal, progress=false)
                progress.advance(step, metrics, no_update_reason(metrics) if metrics.get("optim/step_updates") == 0
                                 else None)
            if stop.requested:
                raise KeyboardInterrupt(f"stopped by {stop.signal_name} after step {step}; checkpoint saved, "
                                        f"continue with --resume")
    return metrics


def one_step(run: Run, step: int, stop: StopRequest, templated) -> dict:
    """RL step ``step`` and its metrics over all ranks. A stop signal during the step puts the stream
    and generators back and checkpoints the step before (KeyboardInterrupt); non-finite weights after
    it are neither logged nor checkpointed (FloatingPointError)."""
    before = run.stream.state_dict(), run.generator_states()
    try:
        metrics = run.rl_step(on_samples=samples_logger(run, step, templated),
                              stop_requested=lambda: stop.requested)
    except StepInterrupted as e:  # not committed: the last complete step is checkpointed instead
        run.stream.load_state_dict(before[0])
        for name, gen in run.generators.items():
            gen.set_state(before[1][name])
        if run.saved_step != step - 1:
            run.checkpoint(step - 1)
        raise KeyboardInterrupt(f"stopped by {stop.signal_name} during step {step}, which is not saved: "
                                f"{e}; checkpoint of step {step - 1} saved, continue with --resume") from None
    bad_weights = nonfinite_parameters(run.policy.model)
    if any_rank(bool(bad_weights), run.dist_info):  # never logged, never checkpointed
        raise FloatingPointError(nonfinite_weights_message(step, bad_weights, run.saved_step, run.run_dir))
    return metrics_over_ranks(metrics, run.dist_info)


# --------------------------------------------------------------------------- finish


def finish(run: Run, start: int, updates: int, last: dict) -> RunResult:
    """The summary (held-out before -> after) and curves of a finished run; a warning when steps ran
    but not one update changed the weights."""
    cfg, summary = run.cfg, {}
    if run.main:
        summary = summarize(read_metrics(run.run_dir / "metrics.jsonl"))
        (run.run_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
        _plot(run.run_dir, cfg)
    barrier(run.dist_info)
    if run.main and updates == 0 and cfg.steps > start:
        print(f"cispo: WARNING: {cfg.steps - start} step(s) ran but not one optimizer update was made: the weights "
              f"are unchanged ({no_update_reason(last)} at the last step). See rollout/groups_kept and "
              f"optim/skipped in {run.run_dir / 'metrics.jsonl'}.", file=sys.stderr)
    return RunResult(run.run_dir, summary, updates if cfg.steps > start else None)


def nonfinite_weights_message(step: int, names: list[str], saved_step: int | None, run_dir: Path) -> str:
    """What to say when the weights turned NaN / inf during ``step`` (``names``: this rank's
    non-finite parameters; ``saved_step``: the newest checkpoint's step, None if none)."""
    which = f" ({names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") + ")" if names else ""
    kept = (f"the newest checkpoint (step {saved_step}, {run_dir / 'checkpoints' / f'step_{saved_step:06d}'}) holds "
            f"finite weights" if saved_step is not None else "no checkpoint had been saved yet")
    return (f"the weights became non-finite (NaN / inf) during step {step}{which}; that step is neither logged nor "
            f"saved, and {kept}. --resume would repeat the same steps: start a new run (another run_name) with a "
            f"lower optim.lr or a grad_clip")


def no_update_reason(metrics: dict) -> str:
    """Why a step made no optimizer update, from its metrics."""
    if metrics.get("rollout/groups_kept") == 0:
        return "every sampled group had equal rewards, so no advantage was non-zero (dynamic sampling dropped them)"
    if metrics.get("optim/skipped"):
        return "every update had a non-finite gradient and was skipped"
    return "no mini-batch had a response token"


def _quiet(message: str) -> None:
    """A checkpoint warning on a rank other than the main one: the main rank prints it."""


def samples_logger(run: Run, step: int, decode=None):
    """`RLStep`'s ``on_samples`` for ``step``: save the step's samples to ``samples.jsonl`` and
    the sinks' tables (rank 0, every ``log_samples_every`` steps); None when not due. ``decode``:
    records each prompt as templated (``sample_records``)."""
    cfg, sample_file = run.cfg, run.sample_file
    if sample_file is None or not cfg.log_samples_every or step % cfg.log_samples_every:
        return None

    def on_samples(groups, exp) -> None:
        records = sample_records(step, groups, exp, run.task.fork_tokens, cfg.max_samples_per_step,
                                 cfg.samples_max_chars, decode)
        if sample_file.append(records):
            run.sink.log_samples(step, records)

    return on_samples


def metrics_over_ranks(metrics: dict, info) -> dict:
    """The step's metrics over all ranks (ranks hold different groups): `reduce_over_ranks`."""
    if not info.enabled:
        return metrics
    return reduce_over_ranks(gather_objects(metrics, info))


class StopRequest:
    """SIGINT / SIGTERM ask the loop to checkpoint after the current step and exit;
    a second signal exits at once."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        print(f"\ncispo: {self.signal_name} received; saving a checkpoint after this step "
              f"(send it again to exit at once)", file=sys.stderr)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def summarize(rows: list[dict]) -> dict:
    """Held-out metrics before (step 0) and after (last evaluation)."""
    evals = [r for r in rows if "eval/accuracy" in r or "eval/reward_mean" in r]
    if not evals:
        return {}
    first, last = evals[0], evals[-1]
    keys = [k for k in first if k.startswith("eval/")]
    return {"steps": last["step"], **{k: {"before": first.get(k), "after": last.get(k)} for k in keys}}


def format_summary(summary: dict) -> str:
    """The held-out metrics before -> after, one per line; one line saying so when nothing was
    evaluated (``num_eval_prompts=0``)."""
    rows = [(k, v["before"], v["after"]) for k, v in summary.items() if isinstance(v, dict)]
    if not rows:
        return "no held-out evaluation (num_eval_prompts=0): no before -> after to show"
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [f"after {summary.get('steps', 0)} steps (held-out, before -> after):"]
    return "\n".join(lines + [f"  {k:32s} {fmt(b)} -> {fmt(a)}" for k, b, a in rows])


@contextlib.contextmanager
def _closing(progress):
    """Close the progress bar however the loop ends (a clean end, a stop, an error)."""
    try:
        yield progress
    finally:
        if progress is not None:
            progress.close()


def _plot(run_dir: Path, cfg: TrainConfig) -> None:
    try:
        from cispo.foundations.plotting import plot_run
    except ImportError:  # matplotlib is optional
        return
    plot_run(read_metrics(run_dir / "metrics.jsonl"), run_dir / "curves.png", title=run_name(cfg))
