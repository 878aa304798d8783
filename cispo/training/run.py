"""A training run's state and its set-up (`set_up`): the process (threads, seed, device, torchrun rank), the
data and rewards (checked before any weights load), the run folder, the policy and optimizer, the trainer
with its probes, the prompt streams, the generators and the metric sinks; the run's held-out evaluation and
its checkpoints (`Run`). ``cispo.training.runner`` runs it."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from cispo.config.train import TrainConfig, to_dict
from cispo.data.prompts import PromptStream
from cispo.data.rewards import start_reward_workers
from cispo.data.rewards.loading import check_reward_fields, members_of
from cispo.foundations.distributed import (
    DistInfo,
    any_rank,
    barrier,
    broadcast_parameters,
    gather_objects,
    init_distributed,
    rank_seed,
    shard_model,
)
from cispo.foundations.forks import ForkTokens
from cispo.foundations.threads import auto_threads
from cispo.models.policy import Policy
from cispo.objective.presets import ObjectiveConfig
from cispo.records.runfolder import (
    check_resume,
    keep_resolved,
    prepare_run_dir,
    run_dir_of,
    run_name,
    save_config,
    saved_config,
)
from cispo.records.samples import SampleFile
from cispo.records.tracking import check_sinks, make_sinks
from cispo.rollout import SamplingConfig
from cispo.training.checkpoint import Checkpoint, fsync_file, gather_full_state, save_checkpoint
from cispo.training.evaluation import Evaluation, answers_per_prompt, evaluate, evaluate_sets
from cispo.training.prefetch import Prefetch, load_rollout, rollout_state, set_up_prefetch
from cispo.training.probes import ForkDiagnostics, TokenCounts
from cispo.training.progress import evaluation_progress, interactive, model_line, reward_workers_line, say
from cispo.training.rl_step import RLStep
from cispo.training.run_policy import (
    check_chat_template,
    check_model,
    check_run_tools,
    load_policy_for,
    load_reference,
    model_folder,
    resolve_chat_template,
    resolve_device,
)
from cispo.training.sampling import StepSampler
from cispo.training.setup import (
    absolute_paths,
    check_prompt_memory,
    default_max_new_tokens,
    eval_defaults,
    fit_prompts,
    fork_matcher,
    fsdp_settings,
    make_objective,
    make_optimizer,
    sampling_config,
)
from cispo.training.trainer import Trainer


@dataclass
class Run:
    """What a run holds from its set-up to its end (one per process under torchrun); ``saved_step``: the
    newest checkpoint's step (None: none yet)."""

    cfg: TrainConfig
    run_dir: Path
    dist_info: DistInfo
    task: object
    sampling: SamplingConfig
    policy: Policy
    trainer: Trainer  # the updates: optimizer, objective, update count, probes
    rl_step: RLStep  # one RL step: sampling (and sampling ahead), the trainer, the push
    eval_samples: list[dict]
    eval_sets: dict[str, list[dict]]
    generators: dict[str, torch.Generator]  # "sample" (the sampler's draws), "shuffle" (the mini-batches')
    sink: object | None  # the metric sinks (rank 0 only)
    sample_file: SampleFile | None  # samples.jsonl (rank 0 only)
    saved_step: int | None = None
    last_eval: dict = field(default_factory=dict)  # the newest held-out metrics (this invocation's)

    @property
    def stream(self) -> PromptStream:
        """This rank's prompt stream."""
        return self.rl_step.sampler.stream

    @property
    def prefetch(self) -> Prefetch | None:
        """``rollout.async_steps=1``: the behaviour policy and the batch it holds; else None."""
        return self.rl_step.prefetch

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
            with self._eval_progress(step) as tick:
                settings = Evaluation.of_task(self.task, cfg, self.sampling.max_new_tokens, seed=cfg.seed + step,
                                              on_progress=tick)
                out = evaluate(self.policy, self.eval_samples, settings)
                out.update(evaluate_sets(self.policy, self.eval_sets, settings))
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
        # a sharded model's full state, gathered on rank 0's CPU
        full_state = gather_full_state(self.policy.model, self.trainer.optimizer) if self.sharded else None
        if self.main:
            fsync_file(self.run_dir / "metrics.jsonl")  # its rows up to `step` are committed by this checkpoint
            state = {"step": step, **self.trainer.state_dict(), "streams": streams,
                     "world_size": self.dist_info.world_size}
            if self.prefetch is not None:  # the batch sampled for the next step; None: it samples anew (stream rewound)
                state["async_steps"] = 1  # so a resume tells a held batch removed from one never held
                held = self.prefetch.held
                state["prefetched"] = None if held is None else rollout_state(held, self.stream)
            tensors = {f"generator/{n}/{r}": t for r, g in enumerate(gens) for n, t in g.items()}
            content = Checkpoint(self.policy.model, self.policy.tokenizer, self.trainer.optimizer, state, tensors,
                                 full_state)
            save_checkpoint(self.run_dir, step, content, keep=self.cfg.keep_checkpoints)
        barrier(self.dist_info)

    def restore(self, ckpt: Path, state: dict, tensors: dict) -> int:
        """Continue from checkpoint ``ckpt`` (its trainer ``state`` and generator ``tensors``; the weights
        and optimizer are loaded already). Returns its step."""
        rank = self.dist_info.rank
        self.trainer.load_state_dict(state)  # update_count, float16's loss scale
        self.saved_step = state["step"]
        self.policy.sampler.update_weights(self.policy.model)  # a separate inference engine (vLLM) takes them
        self.stream.load_state_dict(state["streams"][rank])
        held = state.get("prefetched")  # checked with the checkpoint (`check_trainer_state`)
        if held is not None and self.prefetch is not None:  # the batch sampled for the step after it
            self.prefetch.held = load_rollout(held, self.stream)
        elif held is not None and self.main:
            print("cispo: the checkpoint holds a batch sampled ahead (rollout.async_steps=1); with async_steps=0 it "
                  "is not trained on and the run samples anew", file=sys.stderr)
        for name, gen in self.generators.items():
            gen.set_state(tensors[f"generator/{name}/{rank}"])
        if self.main:
            self.sink.truncate_after(state["step"])
            save_config(self.cfg, self.run_dir)  # with the safe keys that changed (steps, ...)
            self.sample_file.truncate_after(state["step"])
            print(f"cispo: resumed {self.run_dir} from {ckpt.name}", file=sys.stderr)
        return state["step"]


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
    samples = task.train_samples(cfg.data.seed, cfg.data.num_train_prompts)
    check_chat_template(policy, samples[0] if samples else None)  # a template that fails: one line, before any step
    # each rank samples whole groups from its own shard of the prompts, with its own seeds
    train_samples = fit_prompts(policy, samples,
                                sampling.max_new_tokens, "training")
    stream = PromptStream(train_samples[dist_info.rank :: dist_info.world_size], seed=cfg.seed)
    eval_samples = fit_prompts(policy, task.eval_samples(cfg.data.seed, cfg.data.num_eval_prompts),
                               sampling.max_new_tokens, "held-out")
    eval_sets = {name: fit_prompts(policy, samples, sampling.max_new_tokens, f"eval set {name!r}")
                 for name, samples in named_sets.items()}
    seed = rank_seed(cfg.seed, dist_info)
    main = dist_info.is_main
    generators = {"sample": torch.Generator(device=device).manual_seed(seed),
                  "shuffle": torch.Generator().manual_seed(seed + 1)}
    sample_file = SampleFile(run_dir / "samples.jsonl", cfg.samples_max_mb) if main else None
    trainer = Trainer(policy, optimizer, obj, cfg, generators["shuffle"], dist_info)
    register_probes(trainer, fork_matcher(policy.tokenizer, task), counts=sample_file is not None)
    sampler = StepSampler(stream, task, cfg, sampling, generators["sample"], dist_info)
    rl_step = RLStep(trainer, sampler, set_up_prefetch(cfg, policy, device, dist_info))
    return Run(cfg, run_dir, dist_info, task, sampling, policy, trainer, rl_step, eval_samples, eval_sets, generators,
               sink=make_sinks(cfg.trackers, run_dir, run_name(cfg), to_dict(cfg)) if main else None,
               sample_file=sample_file)


def register_probes(trainer: Trainer, forks: ForkTokens | None, counts: bool) -> None:
    """The step's measurements beside the objective (`cispo.training.probes`): the tracked fork strings'
    diagnostics where the task has fork strings, each row's token counts where ``samples.jsonl`` is written
    (``counts``)."""
    if forks is not None:
        trainer.add_probe(ForkDiagnostics(forks, trainer.objective))
    if counts:
        trainer.add_probe(TokenCounts())


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
    check_prompt_memory(task, cfg.data)  # 10^7 prompts of a built-in task: said, not an allocator abort
    named_sets = load_eval_sets(cfg.data)  # data.eval_sets, also before any model is loaded
    cfg = resolve_chat_template(cfg, task, named_sets)  # model.chat_template=auto: by the prompts read
    check_reward_fields(task, cfg.data, named_sets)  # before any model is loaded or sampled from
    check_run_tools(cfg)  # data.tools: a spec that names no usable tool, said before any weights load
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


# --------------------------------------------------------------------------- run info


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
