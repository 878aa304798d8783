"""A training run around the RL loop, in the order it happens (``train``):

1. set up (``set_up``): the process (threads, seed, device, torchrun rank), the data and rewards
   (checked before any weights load), the run folder, the policy (``run_policy``) and optimizer,
   the prompt streams, generators and metric sinks;
2. resume (``resume_or_start``): the newest intact checkpoint, or a fresh start's run info and
   step-0 evaluation;
3. the step loop (``step_loop``): one RL step (``cispo.training.trainer.rl_step``), its checks,
   held-out evaluation every ``eval.every`` steps, its metrics, a checkpoint every
   ``checkpoint_every`` steps; a stop signal checkpoints and exits;
4. finish (``finish``): summary, curves, a warning when no update was made.

The algorithm itself is in ``cispo.training.trainer``."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

from cispo.config.train import TrainConfig, to_dict
from cispo.data.prompts import PromptStream
from cispo.data.rewards import closing_reward_pools, start_reward_workers
from cispo.data.rewards.loading import check_reward_fields, members_of
from cispo.foundations.distributed import (DistInfo, any_rank, barrier, broadcast_parameters, gather_objects,
                                           init_distributed, rank_seed, shard_model)
from cispo.foundations.threads import auto_threads
from cispo.models.policy import Policy
from cispo.objective.presets import ObjectiveConfig
from cispo.records.runfolder import (SUMMARY, check_resume, keep_resolved, prepare_run_dir, run_dir_of, run_lock,
                                     run_name, save_config, saved_config)
from cispo.records.samples import SampleFile, sample_records
from cispo.records.tracking import check_sinks, make_sinks, read_metrics
from cispo.rollout import SamplingConfig
from cispo.training.checkpoint import (check_trainer_state, fsync_file, gather_full_state, load_latest_checkpoint,
                                       nonfinite_parameters, save_checkpoint)
from cispo.training.evaluation import answers_per_prompt, evaluate, evaluate_sets
from cispo.training.metrics import reduce_over_ranks, reports_accuracy
from cispo.training.run_policy import (check_model, load_policy_for, load_reference, model_folder, resolve_chat_template,
                                       resolve_device)
from cispo.training.progress import (evaluation_count, evaluation_done_line, evaluation_plan, evaluation_progress,
                                     interactive, model_line, reward_workers_line, say, step_progress)
from cispo.training.setup import (absolute_paths, default_max_new_tokens, eval_defaults, fit_prompts, fork_matcher,
                                  fsdp_settings, make_objective, make_optimizer, sampling_config)
from cispo.training.prefetch import Prefetch, load_rollout, rollout_state, set_up_prefetch
from cispo.training.trainer import StepInterrupted, rl_step, tracked_fork


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    updates: int | None = None  # optimizer steps taken by this invocation (0: the weights never changed)


def all_skipped(metrics: dict, cfg: TrainConfig, policy: Policy) -> bool:
    """Every update of the step had a non-finite gradient. Under float16 loss scaling an
    overflow while the scale S is still large is the scaler finding its level (S halves and
    the update is skipped), so such a step counts only once S has fallen below 1."""
    if metrics.get("optim/skipped", 0) < cfg.algo.updates_per_batch:
        return False
    return policy.grad_scaler is None or policy.grad_scaler.get_scale() < 1.0


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_run_info(run_dir: Path, cfg: TrainConfig, sampling, obj, sampler_info: dict | None = None) -> None:
    save_config(cfg, run_dir)
    info = {
        "seed": cfg.seed,
        "git_commit": git_commit(),
        "command": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "sampling": sampling.__dict__,
        "objective": obj.__dict__,
        "sampler": sampler_info or {},  # e.g. vLLM's version, whether its head is FP32, how weights are pushed
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (run_dir / "meta.json").write_text(json.dumps(info, indent=1, default=str))


def record_sampler_info(run_dir: Path, info: dict) -> None:
    """Put the sampler's facts (``Sampler.info``) into ``meta.json`` again after the first step, when they
    include what only a weight push shows (vLLM: which path pushed the weights)."""
    path = run_dir / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    meta["sampler"] = info
    path.write_text(json.dumps(meta, indent=1, default=str))


def run_threads(requested: int | None, run_dir: Path) -> int | None:
    """A resumed run's thread count: the user's, else the one its first start recorded in
    ``meta.json`` (float sums may depend on it; `cispo.foundations.threads` would pick by today's load)."""
    if requested is not None:
        return requested
    try:
        recorded = json.loads((run_dir / "meta.json").read_text()).get("torch_threads")
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, int) and recorded >= 1 else None


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
    start = resume_or_start(run, resume)
    first_update_count = run.update_count
    try:
        last = step_loop(run, start)
    finally:
        if run.prefetch is not None:  # its thread is idle between steps: nothing is lost
            run.prefetch.close()
    return finish(run, start, run.update_count - first_update_count, last)


@dataclass
class Run:
    """What a run holds from its set-up to its end (one per process under torchrun). ``update_count``:
    optimizer steps so far; ``saved_step``: the newest checkpoint's step (None: none yet)."""

    cfg: TrainConfig
    run_dir: Path
    dist_info: DistInfo
    task: object
    sampling: SamplingConfig
    obj: ObjectiveConfig
    policy: Policy
    optimizer: torch.optim.Optimizer
    stream: PromptStream
    eval_samples: list[dict]
    eval_sets: dict[str, list[dict]]
    generators: dict[str, torch.Generator]
    forks: object
    sink: object | None  # the metric sinks (rank 0 only)
    sample_file: SampleFile | None  # samples.jsonl (rank 0 only)
    update_count: int = 0
    saved_step: int | None = None
    last_eval: dict = field(default_factory=dict)  # the newest held-out metrics (this invocation's)
    prefetch: Prefetch | None = None  # rollout.async_steps=1: the behaviour policy and the batch it holds

    @property
    def main(self) -> bool:
        return self.dist_info.is_main

    @property
    def sharded(self) -> bool:
        return self.cfg.model.fsdp and self.dist_info.enabled

    def generator_states(self) -> dict[str, torch.Tensor]:
        return {n: g.get_state() for n, g in self.generators.items()}

    @property
    def eval_prompts(self) -> int:
        """Prompts of one held-out evaluation: the held-out set's and every named set's."""
        return len(self.eval_samples) + sum(map(len, self.eval_sets.values()))

    def evaluate(self, step: int) -> dict:
        """Held-out evaluation at ``step`` (``eval/...``; ``data.eval_sets``: ``eval/<name>/...``). Sharded
        weights: every rank runs the model with rank 0, which alone gets the metrics. At a terminal it has
        a progress bar of its own; elsewhere step 0's says it started (`evaluation_progress`)."""
        cfg, out = self.cfg, {}
        if self.main or self.sharded:
            common = dict(seed=cfg.seed + step, answer_fn=self.task.extract_answer,
                          reward_timeout_s=cfg.data.reward_timeout_s, accuracy=reports_accuracy(self.task))
            fork = tracked_fork(self.task)
            with self._eval_progress(step) as tick:
                out = evaluate(self.policy, self.eval_samples, self.task.reward, fork, cfg.eval,
                               self.sampling.max_new_tokens, on_progress=tick, **common)
                out.update(evaluate_sets(self.policy, self.eval_sets, self.task.reward, fork, cfg.eval,
                                         self.sampling.max_new_tokens, on_progress=tick, **common))
        barrier(self.dist_info)
        self.last_eval = out
        return out

    def _eval_progress(self, step: int):
        """`evaluation_progress` for the evaluation at ``step`` on the main rank (a bar at a terminal; a line at
        step 0 elsewhere), or a context that says nothing."""
        prompts, bar = self.eval_prompts, interactive(self.cfg.progress)
        if not (self.main and prompts and (bar or step == 0)):
            return contextlib.nullcontext(None)
        return evaluation_progress(prompts, answers_per_prompt(self.cfg.eval), f"step-{step} evaluation", bar)

    def checkpoint(self, step: int) -> None:
        """Save the weights, optimizer, every rank's prompt stream and generators, and the counters
        at ``step`` (rank 0 writes; a sharded model is gathered onto its CPU first)."""
        self.saved_step = step
        streams = gather_objects(self.stream.state_dict(), self.dist_info)
        gens = gather_objects({n: g.cpu() for n, g in self.generator_states().items()}, self.dist_info)
        full_state = gather_full_state(self.policy.model, self.optimizer) if self.sharded else None  # rank 0's CPU
        if self.main:
            fsync_file(self.run_dir / "metrics.jsonl")  # its rows up to `step` are committed by this checkpoint
            state = {"step": step, "update_count": self.update_count, "streams": streams,
                     "world_size": self.dist_info.world_size}
            if self.prefetch is not None and self.prefetch.held is not None:  # sampled for the next step
                state["prefetched"] = rollout_state(self.prefetch.held, self.stream)
            if self.policy.grad_scaler is not None:  # float16's loss scale, so a resume continues with it
                state["grad_scaler"] = self.policy.grad_scaler.state_dict()
            tensors = {f"generator/{n}/{r}": t for r, g in enumerate(gens) for n, t in g.items()}
            save_checkpoint(self.run_dir, step, self.policy.model, self.policy.tokenizer, self.optimizer, state,
                            tensors, keep=self.cfg.keep_checkpoints, full_state=full_state)
        barrier(self.dist_info)


# --------------------------------------------------------------------------- set-up


def set_up(cfg: TrainConfig, resume: bool, overwrite: bool) -> Run:
    """Everything before the first step: the process (threads, seed, device, torchrun), the data and
    rewards (checked before any weights load), the run folder, the policy and its optimizer, the
    prompt streams, the generators and the sinks."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bar is the one to watch
    run_dir = run_dir_of(cfg)  # run_name checked before any work
    cfg = absolute_paths(cfg)  # config.yaml then works from any folder (cispo eval, --resume)
    saved = saved_config(run_dir) if resume else None
    cfg = eval_defaults(cfg, saved)  # data.num_eval_prompts / eval.num_samples: the task's where unset
    check_sinks(cfg.trackers)  # a missing package, a store MLflow refuses: said now, not after the model loads
    if saved is not None:  # a resumed run is the same run (a config saved with relative paths: as read from here)
        check_resume(absolute_paths(saved), cfg, run_dir)
        cfg = keep_resolved(saved, cfg)  # model.chat_template=auto: what the run resolved at its start
    torch.set_num_threads(auto_threads(cfg.threads if saved is None else run_threads(cfg.threads, run_dir)))
    torch.manual_seed(cfg.seed)
    device, dist_info = set_up_devices(cfg)
    cfg, task, named_sets, sampling, obj = set_up_data(cfg, dist_info.is_main)
    run_dir = prepare_run_dir(cfg, resume, overwrite) if dist_info.is_main else run_dir
    policy, optimizer = set_up_policy(cfg, task, obj, device, dist_info)
    # each rank samples whole groups from its own shard of the prompts, with its own seeds
    train_samples = fit_prompts(policy, task.train_samples(cfg.data.seed, cfg.data.num_train_prompts),
                                sampling.max_new_tokens, "training")
    stream = PromptStream(train_samples[dist_info.rank :: dist_info.world_size], seed=cfg.seed)
    eval_samples = fit_prompts(policy, task.eval_samples(cfg.data.seed, cfg.data.num_eval_prompts),
                               sampling.max_new_tokens, "held-out")
    eval_sets = {name: fit_prompts(policy, samples, sampling.max_new_tokens, f"eval set {name!r}")
                 for name, samples in named_sets.items()}
    seed = rank_seed(cfg.seed, dist_info)
    main = dist_info.is_main
    return Run(
        cfg, run_dir, dist_info, task, sampling, obj, policy, optimizer, stream=stream, eval_samples=eval_samples, eval_sets=eval_sets,
        generators={"sample": torch.Generator(device=device).manual_seed(seed),
                    "shuffle": torch.Generator().manual_seed(seed + 1)},
        forks=fork_matcher(policy.tokenizer, task),
        sink=make_sinks(cfg.trackers, run_dir, run_name(cfg), to_dict(cfg)) if main else None,
        sample_file=SampleFile(run_dir / "samples.jsonl", cfg.samples_max_mb) if main else None,
        prefetch=set_up_prefetch(cfg, policy, device, dist_info),
    )


def set_up_devices(cfg: TrainConfig) -> tuple[torch.device, DistInfo]:
    """``model.device`` and, under torchrun, this rank (its own CUDA device); the prompts of a step must
    split evenly over the ranks."""
    device = resolve_device(cfg.model.device)
    dist_info = init_distributed(device.type)
    if dist_info.enabled and device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
        torch.cuda.set_device(device)
    if cfg.rollout.prompts_per_step % dist_info.world_size:
        raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                         f"number of processes ({dist_info.world_size})")
    return device, dist_info


def set_up_data(cfg: TrainConfig, main: bool = True):
    """The task (prompts, reward), the named eval sets, the sampling settings and the objective, all
    checked before any model is loaded; the reward workers start here, while the model loads (the ``main``
    rank says so). Returns
    ``(cfg, task, named_sets, sampling, obj)``, ``cfg`` with ``rollout.max_new_tokens`` and
    ``model.chat_template`` resolved."""
    from cispo.data.prompts import load_eval_sets, load_source

    check_model(cfg)  # before the (possibly long) data loading
    task = load_source(cfg.data, cfg.rollout.max_new_tokens)
    named_sets = load_eval_sets(cfg.data)  # data.eval_sets, also before any model is loaded
    cfg = resolve_chat_template(cfg, task, named_sets)  # model.chat_template=auto: by the prompts read
    check_reward_fields(task, cfg.data, named_sets)  # before any model is loaded or sampled from
    workers = reward_workers_line(members_of(task.reward))
    if main and workers:
        say(workers)
    start_reward_workers(task.reward)  # they start while the model loads, not in the first step
    sampling = sampling_config(cfg.rollout, default_max_new_tokens(task))
    cfg = replace(cfg, rollout=replace(cfg.rollout, max_new_tokens=sampling.max_new_tokens))
    return cfg, task, named_sets, sampling, make_objective(cfg.algo, cfg.rollout.max_new_tokens)


def set_up_policy(cfg: TrainConfig, task, obj: ObjectiveConfig, device: torch.device, dist_info: DistInfo):
    """The policy on every rank (rank 0 converts or builds the model folder first), its reference model
    when the KL penalty is on, FSDP2 sharding, and the optimizer over what this rank holds."""
    began = time.monotonic()
    if dist_info.is_main:
        say(f"model: loading {cfg.model.path or task.model or f'the built-in {task.name} base model'} ...")
        model_folder(cfg, task)  # the built-in model, or a packaged one converted: once, before the other ranks
    barrier(dist_info)
    sharded = cfg.model.fsdp and dist_info.enabled
    policy = load_policy_for(cfg, task, device, torch.device("cpu") if sharded else None, dist_info)
    if dist_info.is_main:
        say(model_line(policy.model, time.monotonic() - began))
    broadcast_parameters(policy.model, dist_info)
    if obj.kl_coef > 0:  # every rank holds the whole reference (config refuses FSDP with it)
        policy.ref_model = load_reference(cfg, task, device, policy.tokenizer)
    if sharded:  # FSDP2: every rank keeps 1/N of the weights, gradients and optimizer state
        shard_model(policy.model, dist_info, device, **fsdp_settings(cfg, policy.autocast))
        policy.sampler.lock_step(lambda done: not any_rank(not done, dist_info))
    return policy, make_optimizer(policy.model, cfg.optim)  # after sharding: the optimizer holds the shards


# --------------------------------------------------------------------------- resume


def resume_or_start(run: Run, resume: bool) -> int:
    """The step the loop continues after: the newest intact checkpoint's (its weights, optimizer,
    streams, generators and counters restored; the sinks and samples.jsonl cut back to it), else 0,
    after a fresh start's run info and its step-0 evaluation."""
    found = None
    if resume:
        check = partial(check_trainer_state, rank=run.dist_info.rank, world_size=run.dist_info.world_size,
                        stream_state=run.stream.state_dict(), generator_states=run.generator_states())
        found = load_latest_checkpoint(run.run_dir, run.policy.model, run.optimizer,
                                       report=None if run.main else _quiet, check=check)
    if found is not None:  # the newest intact one; newer broken ones were reported and skipped
        return restore(run, *found)
    if run.main:
        if resume:
            print(f"cispo: no checkpoint in {run.run_dir}; starting from step 0", file=sys.stderr)
        run.sink.truncate_after(-1)
        run.sample_file.truncate_after(-1)
        write_run_info(run.run_dir, run.cfg, run.sampling, run.obj, run.policy.sampler.info())
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


def restore(run: Run, ckpt: Path, state: dict, tensors: dict) -> int:
    """Continue from checkpoint ``ckpt`` (its trainer ``state`` and generator ``tensors``; the weights
    and optimizer are loaded already). Returns its step."""
    rank = run.dist_info.rank
    run.update_count, run.saved_step = state["update_count"], state["step"]
    if run.policy.grad_scaler is not None and "grad_scaler" in state:
        run.policy.grad_scaler.load_state_dict(state["grad_scaler"])
    run.policy.sampler.update_weights(run.policy.model)  # a separate inference engine (vLLM) takes them
    run.stream.load_state_dict(state["streams"][rank])
    if "prefetched" in state and run.prefetch is not None:  # the batch sampled for the step after it
        run.prefetch.held = load_rollout(state["prefetched"], run.stream)
    elif "prefetched" in state and run.main:
        print("cispo: the checkpoint holds a batch sampled ahead (rollout.async_steps=1); with async_steps=0 it "
              "is not trained on and the run samples anew", file=sys.stderr)
    for name, gen in run.generators.items():
        gen.set_state(tensors[f"generator/{name}/{rank}"])
    if run.main:
        run.sink.truncate_after(state["step"])
        save_config(run.cfg, run.run_dir)  # with the safe keys that changed (steps, ...)
        run.sample_file.truncate_after(state["step"])
        print(f"cispo: resumed {run.run_dir} from {ckpt.name}", file=sys.stderr)
    return state["step"]


# --------------------------------------------------------------------------- the step loop


def step_loop(run: Run, start: int) -> dict:
    """Steps ``start + 1 .. cfg.steps``: each one RL step (``rl_step``), then its checks, held-out
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
            bad_steps = bad_steps + 1 if all_skipped(metrics, cfg, run.policy) else 0
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
        metrics, run.update_count = rl_step(
            run.policy, run.optimizer, run.stream, run.task, run.cfg, run.obj, run.sampling, run.generators,
            run.update_count, run.forks, run.dist_info,
            on_samples=samples_logger(run.cfg, step, run.task, run.sample_file, run.sink, templated),
            stop_requested=lambda: stop.requested, prefetch=run.prefetch)
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


def samples_logger(cfg: TrainConfig, step: int, task, sample_file: SampleFile | None, sink, decode=None):
    """``rl_step``'s ``on_samples`` for ``step``: save the step's samples to ``samples.jsonl`` and
    the sinks' tables (rank 0, every ``log_samples_every`` steps); None when not due. ``decode``:
    records each prompt as templated (``sample_records``)."""
    if sample_file is None or not cfg.log_samples_every or step % cfg.log_samples_every:
        return None

    def on_samples(groups, exp) -> None:
        records = sample_records(step, groups, exp, task.fork_tokens, cfg.max_samples_per_step,
                                 cfg.samples_max_chars, decode)
        if sample_file.append(records):
            sink.log_samples(step, records)

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
