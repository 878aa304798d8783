"""Everything around the RL loop: set-up, run folder, resume, evaluation schedule,
checkpoints, progress bar, summary and plot. The algorithm itself is in ``trainer.py``."""

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
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from cispo.config.train import ConfigError, TrainConfig, to_dict
from cispo.data.prompts import PromptStream
from cispo.data.rewards import closing_reward_pools, start_reward_workers
from cispo.data.rewards.loading import check_reward_fields
from cispo.foundations.distributed import (DistInfo, any_rank, barrier, broadcast_parameters, gather_objects,
                                           init_distributed, rank_seed, shard_model)
from cispo.foundations.nan import is_nan
from cispo.foundations.threads import auto_threads
from cispo.models.compile import compile_wanted, train_body
from cispo.models.policy import Policy, loss_scaler
from cispo.records.runfolder import (SUMMARY, check_resume, prepare_run_dir, run_dir_of, run_lock, run_name,
                                     save_config, saved_config)
from cispo.records.samples import SampleFile, sample_records
from cispo.records.tracking import make_sinks, read_metrics
from cispo.rollout import TorchSampler
from cispo.training.checkpoint import (check_trainer_state, fsync_file, gather_full_state, load_latest_checkpoint,
                                       nonfinite_parameters, save_checkpoint)
from cispo.training.evaluation import evaluate, evaluate_sets
from cispo.training.metrics import reduce_over_ranks
from cispo.training.setup import (absolute_paths, default_max_new_tokens, fit_prompts, fork_matcher, fsdp_settings,
                                  make_objective, make_optimizer, sampling_config, vllm_settings)
from cispo.training.trainer import StepInterrupted, rl_step, tracked_fork

PROGRESS_KEYS = {  # metric -> short label on the progress bar
    "rollout/reward_mean": "reward",
    "rollout/fork_rate": "fork",
    "objective/frac_capped": "capped",
    "eval/accuracy": "eval_acc",
}


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    updates: int | None = None  # optimizer steps taken by this invocation (0: the weights never changed)


def resolve_device(name: str) -> torch.device:
    """``model.device`` as a torch device; one that does not exist here is a ``ConfigError``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"model.device={name!r}: not a device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device={name!r}: CUDA is not available on this machine (use cpu or auto)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"model.device={name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def all_skipped(metrics: dict, cfg: TrainConfig, policy: Policy) -> bool:
    """Every update of the step had a non-finite gradient. Under float16 loss scaling an
    overflow while the scale S is still large is the scaler finding its level (S halves and
    the update is skipped), so such a step counts only once S has fallen below 1."""
    if metrics.get("optim/skipped", 0) < cfg.algo.updates_per_batch:
        return False
    return policy.grad_scaler is None or policy.grad_scaler.get_scale() < 1.0


def model_folder(cfg: TrainConfig, task):
    """The folder the policy loads from: ``model.path``, else the task's model (``Task.model``), else the
    task's built-in base model; a ``builtin:<name>`` packaged model is converted on first use
    (``cispo.models.packaged``)."""
    from cispo.models.builtin import ensure_builtin_model
    from cispo.models.packaged import is_packaged, resolve_model_path
    from cispo.training.checkpoint import check_model_folder

    path = cfg.model.path or (task.model if task is not None else None)
    if path and not is_packaged(path):
        check_model_folder(path)
    return resolve_model_path(path) if path else ensure_builtin_model(task.name, progress=cfg.progress)


def check_model(cfg: TrainConfig) -> None:
    """Before any data or weights are loaded: ``model.path`` and ``model.ref_path`` name a model
    (``cispo.training.checkpoint.check_model_folder``; a ``builtin:<name>`` is checked when it is converted),
    and with ``model.chat_template`` the tokenizer has a chat template. ``ConfigError`` otherwise."""
    from cispo.models.packaged import is_packaged, resolve_model_path
    from cispo.training.checkpoint import check_model_folder

    for path in (cfg.model.path, cfg.model.ref_path):
        if path and not is_packaged(path):
            check_model_folder(path)
    if cfg.model.chat_template and cfg.model.path:
        from cispo.models.loading import check_chat_template

        check_chat_template(resolve_model_path(cfg.model.path))


def load_policy_for(cfg: TrainConfig, task, device: torch.device, load_device: torch.device | None = None,
                    dist_info: DistInfo = DistInfo()) -> Policy:
    """The policy for ``device``; its weights are loaded onto ``load_device`` (default: ``device``),
    e.g. the CPU for a model that FSDP then shards onto the GPUs. ``dist_info``: this torchrun rank
    (a vLLM engine is then placed on it, with its own seed)."""
    from cispo.models.loading import load_policy, precision, saved_dtype

    path = model_folder(cfg, task)
    param_dtype, autocast = precision(cfg.model.dtype, saved_dtype(path), cfg.model.master_weights)
    if not cfg.model.master_weights and (param_dtype or saved_dtype(path)) in (torch.bfloat16, torch.float16):
        print(f"cispo: warning: model.master_weights=false: parameters and AdamW state in "
              f"{param_dtype or saved_dtype(path)}; updates smaller than a weight's rounding step are lost "
              f"(at lr 1e-6 most of them)", file=sys.stderr)
    model, tokenizer = load_policy(path, dtype=param_dtype, device=load_device or device, dropout=cfg.model.dropout)
    if all(p.dtype in (torch.float32, torch.float64) for p in model.parameters()):
        check_head(model, path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer of {path} has no EOS token: responses could never end")
    if tokenizer.pad_token_id is None:  # common for base models: pad with EOS (masked out anyway)
        print(f"cispo: tokenizer of {path} has no pad token; using its EOS token for padding", file=sys.stderr)
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.model.gradient_checkpointing:  # transformers >= 5.2x names it activation checkpointing (the old name warns)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    if cfg.model.lora_rank:
        from cispo.models.lora import apply_lora

        model = apply_lora(model, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha,
                           dropout=cfg.model.lora_dropout, target_modules=cfg.model.lora_target_modules)
    if cfg.rollout.engine == "vllm":
        from cispo.rollout import VLLMSampler

        sampler = VLLMSampler(str(path), tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id,
                              **vllm_settings(cfg, dist_info, device))
    else:
        sampler = TorchSampler(model, tokenizer.eos_token_id, tokenizer.pad_token_id, autocast=autocast,
                               fp32_head=cfg.model.fp32_lm_head, decode=cfg.rollout.decode,
                               compile_step=compile_wanted(cfg.model.compile, device, cfg.steps, cfg.model.fsdp))
    return Policy(model, tokenizer, sampler, device, chat_template=cfg.model.chat_template or (task is not None and task.chat),
                  system_prompt=cfg.data.system_prompt, autocast=autocast,
                  train_body=train_body(cfg.model, model, device, tokenizer.pad_token_id, cfg.steps),
                  grad_scaler=loss_scaler(autocast, device))


def load_reference(cfg: TrainConfig, task, device: torch.device, tokenizer) -> torch.nn.Module:
    """The frozen reference policy pi_ref of the KL penalty: ``model.ref_path``, else the initial
    policy (``model.path`` or the built-in model, read again, so a resumed run keeps the same
    reference). Loaded like the policy (same parameter dtype; the policy's autocast applies to
    its forward), in eval mode with ``requires_grad`` off. ValueError when ``model.ref_path``'s
    tokenizer differs from the policy's ``tokenizer`` (its log-probs would be of other tokens)."""
    from cispo.models.loading import load_policy, precision, saved_dtype
    from cispo.models.packaged import resolve_model_path

    policy_path = model_folder(cfg, task)
    param_dtype, _ = precision(cfg.model.dtype, saved_dtype(policy_path), cfg.model.master_weights)
    path = resolve_model_path(cfg.model.ref_path) or policy_path
    model, ref_tokenizer = load_policy(path, dtype=param_dtype or saved_dtype(policy_path), device=device,
                                       dropout=False)
    if ref_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"model.ref_path={path}: its tokenizer differs from the policy's ({policy_path}); "
                         "the reference model must share the policy's vocabulary")
    if all(p.dtype in (torch.float32, torch.float64) for p in model.parameters()):
        check_head(model, path)
    model.eval()
    model.requires_grad_(False)
    return model


HEAD_TOLERANCE = 1e-3  # nats; float32 rounding gives ~1e-6


def check_head(model, path) -> None:
    """ValueError unless the trainer's chunked head reproduces ``model``'s own distribution
    (``cispo.models.policy.head_mismatch``): a model that post-processes its logits in a way
    ``cispo.objective.logprobs.logit_transform`` does not know is refused rather than trained on the
    wrong log-probs. One short forward at load; run on float32 weights."""
    from cispo.models.policy import head_mismatch

    err = head_mismatch(model)
    if not err <= HEAD_TOLERANCE:
        raise ValueError(f"{path}: the trainer's log-probs of {type(model).__name__} differ from the model's own "
                         f"by up to {err:.3g} nats: it post-processes its logits in a way "
                         "cispo.objective.logprobs.logit_transform does not know; please report it")


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
    """``train``'s body, with the run folder locked."""
    from transformers.utils import logging as hf_logging

    from cispo.data.prompts import load_eval_sets, load_source

    hf_logging.disable_progress_bar()  # our own bar is the one to watch
    run_dir = run_dir_of(cfg)  # run_name checked before any work
    cfg = absolute_paths(cfg)  # config.yaml then works from any folder (cispo eval, --resume)
    saved = saved_config(run_dir) if resume else None
    if saved is not None:  # a resumed run is the same run (a config saved with relative paths: as read from here)
        check_resume(absolute_paths(saved), cfg, run_dir)
    torch.set_num_threads(auto_threads(cfg.threads if saved is None else run_threads(cfg.threads, run_dir)))
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.model.device)
    dist_info = init_distributed(device.type)
    if dist_info.enabled and device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
        torch.cuda.set_device(device)
    if cfg.rollout.prompts_per_step % dist_info.world_size:
        raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                         f"number of processes ({dist_info.world_size})")
    main = dist_info.is_main
    check_model(cfg)  # before the (possibly long) data loading
    task = load_source(cfg.data, cfg.rollout.max_new_tokens)
    named_sets = load_eval_sets(cfg.data)  # data.eval_sets, also before any model is loaded
    check_reward_fields(task, cfg.data)  # before any model is loaded or sampled from
    start_reward_workers(task.reward)  # they start while the model loads, not in the first step
    sampling = sampling_config(cfg.rollout, default_max_new_tokens(task))
    cfg = replace(cfg, rollout=replace(cfg.rollout, max_new_tokens=sampling.max_new_tokens))
    obj = make_objective(cfg.algo, cfg.rollout.max_new_tokens)
    run_dir = prepare_run_dir(cfg, resume, overwrite) if main else run_dir
    if main:
        model_folder(cfg, task)  # the built-in model, or a packaged one converted: once, before the other ranks
    barrier(dist_info)
    sharded = cfg.model.fsdp and dist_info.enabled
    policy = load_policy_for(cfg, task, device, torch.device("cpu") if sharded else None, dist_info)
    broadcast_parameters(policy.model, dist_info)
    if obj.kl_coef > 0:  # every rank holds the whole reference (config refuses FSDP with it)
        policy.ref_model = load_reference(cfg, task, device, policy.tokenizer)
    if sharded:  # FSDP2: every rank keeps 1/N of the weights, gradients and optimizer state
        shard_model(policy.model, dist_info, device, **fsdp_settings(cfg, policy.autocast))
        policy.sampler.lock_step(lambda done: not any_rank(not done, dist_info))
    optimizer = make_optimizer(policy.model, cfg.optim)  # after sharding: it holds the shards
    # each rank samples whole groups from its own shard of the prompts, with its own seeds
    train_samples = fit_prompts(policy, task.train_samples(cfg.data.seed, cfg.data.num_train_prompts),
                                sampling.max_new_tokens, "training")
    stream = PromptStream(train_samples[dist_info.rank :: dist_info.world_size], seed=cfg.seed)
    eval_samples = fit_prompts(policy, task.eval_samples(cfg.data.seed, cfg.data.num_eval_prompts),
                               sampling.max_new_tokens, "held-out")
    eval_sets = {name: fit_prompts(policy, samples, sampling.max_new_tokens, f"eval set {name!r}")
                 for name, samples in named_sets.items()}
    seed = rank_seed(cfg.seed, dist_info)
    generators = {
        "sample": torch.Generator(device=device).manual_seed(seed),
        "shuffle": torch.Generator().manual_seed(seed + 1),
    }
    forks = fork_matcher(policy.tokenizer, task)
    sink = make_sinks(cfg.trackers, run_dir, run_name(cfg), to_dict(cfg)) if main else None
    sample_file = SampleFile(run_dir / "samples.jsonl", cfg.samples_max_mb) if main else None

    def evaluate_now(step: int) -> dict:  # sharded weights: every rank runs the model with rank 0
        out = evaluate(policy, eval_samples, task.reward, tracked_fork(task), cfg.eval, sampling.max_new_tokens,
                       seed=cfg.seed + step, answer_fn=task.extract_answer,
                       reward_timeout_s=cfg.data.reward_timeout_s) if main or sharded else {}
        if main or sharded:  # data.eval_sets: eval/<name>/...
            out.update(evaluate_sets(policy, eval_sets, task.reward, tracked_fork(task), cfg.eval,
                                     sampling.max_new_tokens, seed=cfg.seed + step, answer_fn=task.extract_answer,
                                     reward_timeout_s=cfg.data.reward_timeout_s))
        barrier(dist_info)
        return out

    start, update_count, saved_step = 0, 0, None
    check = partial(check_trainer_state, rank=dist_info.rank, world_size=dist_info.world_size,
                    stream_state=stream.state_dict(), generator_states={n: g.get_state() for n, g in generators.items()})
    found = load_latest_checkpoint(run_dir, policy.model, optimizer, report=None if main else _quiet,
                                   check=check) if resume else None
    if found is not None:  # the newest intact one; newer broken ones were reported and skipped
        ckpt, state, tensors = found
        start, update_count, saved_step = state["step"], state["update_count"], state["step"]
        if policy.grad_scaler is not None and "grad_scaler" in state:
            policy.grad_scaler.load_state_dict(state["grad_scaler"])
        policy.sampler.update_weights(policy.model)  # a separate inference engine (vLLM) takes them
        stream.load_state_dict(state["streams"][dist_info.rank])
        for name, gen in generators.items():
            gen.set_state(tensors[f"generator/{name}/{dist_info.rank}"])
        if main:
            sink.truncate_after(start)
            save_config(cfg, run_dir)  # with the safe keys that changed (steps, ...)
            sample_file.truncate_after(start)
            print(f"cispo: resumed {run_dir} from {ckpt.name}", file=sys.stderr)
    else:
        if resume and main:
            print(f"cispo: no checkpoint in {run_dir}; starting from step 0", file=sys.stderr)
        if main:
            sink.truncate_after(-1)
            sample_file.truncate_after(-1)
            write_run_info(run_dir, cfg, sampling, obj, policy.sampler.info())
        row = evaluate_now(0)
        if main:
            sink.log(0, row)

    def checkpoint(step: int) -> None:
        nonlocal saved_step
        saved_step = step
        streams = gather_objects(stream.state_dict(), dist_info)
        gens = gather_objects({n: g.get_state().cpu() for n, g in generators.items()}, dist_info)
        full_state = gather_full_state(policy.model, optimizer) if sharded else None  # on rank 0's CPU
        if main:
            fsync_file(run_dir / "metrics.jsonl")  # its rows up to `step` are committed by this checkpoint
            state = {"step": step, "update_count": update_count, "streams": streams,
                     "world_size": dist_info.world_size}
            if policy.grad_scaler is not None:  # float16's loss scale, so a resume continues with it
                state["grad_scaler"] = policy.grad_scaler.state_dict()
            tensors = {f"generator/{n}/{r}": t for r, g in enumerate(gens) for n, t in g.items()}
            save_checkpoint(run_dir, step, policy.model, policy.tokenizer, optimizer, state, tensors,
                            keep=cfg.keep_checkpoints, full_state=full_state)
        barrier(dist_info)

    templated = policy.tokenizer.decode if policy.chat_template else None  # samples.jsonl shows the templated prompt
    stop = StopRequest()
    bar = _progress(cfg, start) if main else None
    first_update_count = update_count
    bad_steps = 0
    with stop.installed(), (sink if sink is not None else contextlib.nullcontext()):
        for step in range(start + 1, cfg.steps + 1):
            before = stream.state_dict(), {n: g.get_state() for n, g in generators.items()}
            try:
                metrics, update_count = rl_step(policy, optimizer, stream, task, cfg, obj, sampling, generators,
                                                update_count, forks, dist_info,
                                                on_samples=samples_logger(cfg, step, task, sample_file, sink,
                                                                          templated),
                                                stop_requested=lambda: stop.requested)
            except StepInterrupted as e:  # not committed: the last complete step is checkpointed instead
                stream.load_state_dict(before[0])
                for name, gen in generators.items():
                    gen.set_state(before[1][name])
                if saved_step != step - 1:
                    checkpoint(step - 1)
                if bar is not None:
                    bar.close()
                raise KeyboardInterrupt(f"stopped by {stop.signal_name} during step {step}, which is not saved: "
                                        f"{e}; checkpoint of step {step - 1} saved, continue with --resume") from None
            bad_weights = nonfinite_parameters(policy.model)
            if any_rank(bool(bad_weights), dist_info):  # never logged, never checkpointed
                if bar is not None:
                    bar.close()
                raise FloatingPointError(nonfinite_weights_message(step, bad_weights, saved_step, run_dir))
            metrics = metrics_over_ranks(metrics, dist_info)
            bad_steps = bad_steps + 1 if all_skipped(metrics, cfg, policy) else 0
            if step == cfg.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                metrics.update(evaluate_now(step))
            if main:
                sink.log(step, metrics)
                if step == start + 1 and policy.sampler.info():
                    record_sampler_info(run_dir, policy.sampler.info())
            if bad_steps >= cfg.max_bad_steps:
                checkpoint(step)  # every update of these steps was skipped: the weights are the last good ones
                raise FloatingPointError(
                    f"{bad_steps} consecutive steps had only non-finite gradients (step {step}); "
                    f"the last good weights are checkpointed in {run_dir / 'checkpoints'}. Lower optim.lr or "
                    f"check the reward / data.")
            if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stop.requested:
                checkpoint(step)
            _advance(bar, metrics)
            if main and bar is None and metrics.get("optim/step_updates") == 0:
                print(f"cispo: step {step}: no update ({no_update_reason(metrics)})", file=sys.stderr)
            if stop.requested:
                if bar is not None:
                    bar.close()
                raise KeyboardInterrupt(f"stopped by {stop.signal_name} after step {step}; checkpoint saved, "
                                        f"continue with --resume")
    if bar is not None:
        bar.close()
    summary = {}
    if main:
        summary = summarize(read_metrics(run_dir / "metrics.jsonl"))
        (run_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
        _plot(run_dir, cfg)
    barrier(dist_info)
    updates = update_count - first_update_count
    if main and updates == 0 and cfg.steps > start:
        print(f"cispo: WARNING: {cfg.steps - start} step(s) ran but not one optimizer update was made: the weights "
              f"are unchanged ({no_update_reason(metrics)} at the last step). See rollout/groups_kept and "
              f"optim/skipped in {run_dir / 'metrics.jsonl'}.", file=sys.stderr)
    return RunResult(run_dir, summary, updates if cfg.steps > start else None)


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
    evals = [r for r in rows if "eval/accuracy" in r]
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


def _progress(cfg: TrainConfig, start: int):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start, desc="cispo train", unit="step", dynamic_ncols=True)


def _advance(bar, metrics: dict) -> None:
    if bar is None:
        return
    shown = {label: f"{metrics[k]:.3f}" for k, label in PROGRESS_KEYS.items()
             if k in metrics and not is_nan(metrics[k])}
    if metrics.get("optim/step_updates") == 0:
        shown["updates"] = "0 (no update this step)"
    bar.set_postfix(shown, refresh=False)
    bar.update(1)


def _plot(run_dir: Path, cfg: TrainConfig) -> None:
    try:
        from cispo.foundations.plotting import plot_run
    except ImportError:  # matplotlib is optional
        return
    plot_run(read_metrics(run_dir / "metrics.jsonl"), run_dir / "curves.png", title=run_name(cfg))
