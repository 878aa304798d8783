"""Set-up of a training run's parts from its configuration: the objective, the optimizer,
the sampling settings, the prompts that fit the context and the fork strings to track.

``cispo.training.runner`` builds a run from these; ``cispo.training.trainer`` is the loop that uses them.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cispo.foundations.distributed import DistInfo, rank_seed
from cispo.foundations.forks import ForkTokens
from cispo.models.policy import Policy
from cispo.objective.loss import ObjectiveConfig
from cispo.rollout import SamplingConfig

if TYPE_CHECKING:
    from cispo.config.train import AlgoConfig, OptimConfig, RolloutConfig, TrainConfig


def fit_prompts(policy: Policy, samples: list[dict], max_new_tokens: int, what: str) -> list[dict]:
    """The samples whose prompt plus ``max_new_tokens`` fits the model's context; the others
    are dropped with a note (an error when none is left)."""
    context = getattr(policy.model.config, "max_position_embeddings", None)
    if not context or not samples:
        return samples
    fits = [n + max_new_tokens <= context for n in policy.prompt_lengths(samples)]
    kept = [s for s, ok in zip(samples, fits) if ok]
    if len(kept) < len(samples):
        first = fits.index(False)
        msg = (f"{len(samples) - len(kept)} of {len(samples)} {what} prompts are longer than the context "
               f"({context} tokens) minus max_new_tokens={max_new_tokens} (first: #{first})")
        if not kept:
            from cispo.config.train import ConfigError

            raise ConfigError(msg + "; nothing left to train on: raise the model's context or lower "
                              "rollout.max_new_tokens")
        print(f"cispo: skipping {msg}", file=sys.stderr)
    return kept


def make_objective(algo: AlgoConfig, max_new_tokens: int | None) -> ObjectiveConfig:
    """The objective of ``algo.objective``: its preset with the fields it sets; under Dr. GRPO's
    ``seq-mean-token-sum-norm`` with no constant set, ``max_new_tokens`` as the constant."""
    obj = algo.objective.resolve()
    if obj.aggregation == "seq-mean-token-sum-norm" and obj.token_sum_norm is None:
        # a constant normaliser keeps micro-batching exact: the longest possible response
        obj = replace(obj, token_sum_norm=float(max_new_tokens))
    return obj


def make_optimizer(model, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, at the peak learning rate (each update sets its own, `lr_at`)."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )


def vllm_settings(cfg: TrainConfig, dist_info: DistInfo, device: torch.device) -> dict:
    """``VLLMSampler``'s keyword arguments for a run: every ``rollout.vllm_*`` setting, the FP32 head
    (``model.fp32_lm_head``), this rank's seed and, under torchrun, its placement (the external
    launcher); ``cispo.rollout.vllm_engine.engine_kwargs`` turns them into ``vllm.LLM``'s."""
    from cispo.rollout.vllm_engine import RankPlacement

    r = cfg.rollout
    placement = RankPlacement(dist_info.rank, dist_info.local_rank, dist_info.world_size) if dist_info.enabled else None
    return dict(
        gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        dtype=r.vllm_dtype if r.vllm_dtype != "auto" else (cfg.model.dtype or "auto"),
        enable_sleep_mode=r.vllm_sleep, sleep_level=r.vllm_sleep_level, seed=rank_seed(cfg.seed, dist_info),
        fp32_head=cfg.model.fp32_lm_head, placement=placement, device=device,
        max_model_len=r.vllm_max_model_len, max_num_seqs=r.vllm_max_num_seqs,
        max_num_batched_tokens=r.vllm_max_num_batched_tokens, enforce_eager=r.vllm_enforce_eager,
        **r.vllm_kwargs,
    )


def fsdp_settings(cfg: TrainConfig, autocast: torch.dtype | None) -> dict:
    """``cispo.foundations.distributed.shard_model``'s precision and offload arguments for a run: the decoder layers
    gather in the policy's compute dtype ``autocast`` (bf16 over FP32 master weights) and reduce in FP32;
    ``model.fsdp_offload`` keeps the shards in CPU memory."""
    return dict(param_dtype=autocast, offload=cfg.model.fsdp_offload)


def fork_matcher(tokenizer, task) -> ForkTokens | None:
    """The token spellings of the task's fork strings (``task.fork_tokens``, `cispo.foundations.forks.ForkTokens`):
    None when it tracks none. A string that no token sequence spells is dropped with a note."""
    if not task.fork_tokens:
        return None
    forks = ForkTokens.from_tokenizer(tokenizer, task.fork_tokens)
    for name in forks.missing():
        print(f"cispo: no token sequence of the vocabulary spells the fork string {name!r}; its fork/ metrics "
              "stay 0", file=sys.stderr)
    return forks


def sampling_config(rollout: RolloutConfig, default_max_new_tokens: int) -> SamplingConfig:
    """The training rollout's sampling: ``rollout.max_new_tokens`` (else the default), and the
    repetition early stop at 3/4 of it unless ``rollout.repetition_stop_tokens`` is set (0: off)."""
    max_new = rollout.max_new_tokens or default_max_new_tokens
    rep = rollout.repetition_stop_tokens
    if rep is None:
        rep = max(1, (3 * max_new) // 4)
    return SamplingConfig(
        max_new_tokens=max_new,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        min_p=rollout.min_p,
        repetition_penalty=rollout.repetition_penalty,
        repetition_stop_tokens=rep or None,
        repetition_stop_prob=rollout.repetition_stop_prob,
    )


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with each relative path that names an existing file or folder here made absolute:
    ``model.path``, ``model.ref_path``, ``data.path``, ``data.eval_path``, every
    ``data.eval_sets.<name>.path``, the file of each ``data.reward`` ``file.py:function`` (the
    folder of an ``rm:<folder>``; `cispo.data.rewards.loading.absolute_spec`) and of ``data.agent``. A
    run's ``config.yaml`` is saved from it, so ``cispo eval`` and ``--resume`` work from any folder. Hub ids,
    ``builtin:<name>`` and paths that exist nowhere here are kept as given (their errors come where they are
    loaded)."""
    from cispo.data.rewards.loading import absolute_spec
    from cispo.models.packaged import is_packaged

    def local(path: str | None) -> str | None:
        if path is None or is_packaged(path) or not Path(path).expanduser().exists():
            return path
        return os.path.abspath(Path(path).expanduser())

    d = cfg.data
    data = replace(d, path=local(d.path), eval_path=local(d.eval_path),
                   reward=[absolute_spec(r) for r in d.reward] if isinstance(d.reward, list) else
                   d.reward and absolute_spec(d.reward), agent=d.agent and absolute_spec(d.agent),
                   eval_sets={name: replace(s, path=local(s.path)) for name, s in d.eval_sets.items()})
    model = replace(cfg.model, path=local(cfg.model.path), ref_path=local(cfg.model.ref_path))
    return replace(cfg, data=data, model=model)


def eval_defaults(cfg: TrainConfig, saved: TrainConfig | None = None) -> TrainConfig:
    """``cfg`` with the held-out evaluation's unset sizes filled in, so ``config.yaml`` records what the run
    does: ``data.num_eval_prompts`` and ``eval.num_samples`` where None, from ``saved`` (the config a resumed
    run started with), else from the built-in task (``Task.num_eval_prompts``, ``Task.eval_num_samples``:
    a real model's task evaluates fewer prompts, greedy only), else a prompt file's (200, 4). Values the
    user set are kept."""
    from cispo.config.data import FILE_EVAL_PROMPTS
    from cispo.training.evaluation import DEFAULT_NUM_SAMPLES, sample_count

    prompts, samples = cfg.data.num_eval_prompts, cfg.eval.num_samples
    if saved is not None:
        prompts = saved.data.num_eval_prompts if prompts is None else prompts
        samples = saved.eval.num_samples if samples is None else samples
    task_prompts, task_samples = FILE_EVAL_PROMPTS, DEFAULT_NUM_SAMPLES
    if cfg.data.path is None:
        from cispo.data.tasks import get_task

        task = get_task(cfg.data.task)
        task_prompts, task_samples = task.num_eval_prompts, task.eval_num_samples
    prompts = task_prompts if prompts is None else prompts
    samples = sample_count(replace(cfg.eval, num_samples=samples), task_samples)
    return replace(cfg, data=replace(cfg.data, num_eval_prompts=prompts), eval=replace(cfg.eval, num_samples=samples))


def default_max_new_tokens(task) -> int:
    """The response budget when ``rollout.max_new_tokens`` is unset: 1.25 x the task's own."""
    return math.ceil(1.25 * task.max_new_tokens)


def available_memory() -> int | None:
    """Bytes of memory free for this process now (the OS's available pages), or None where it cannot tell."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_prompt_memory(task, data_cfg, available: int | None = None) -> None:
    """A built-in task builds ``data.num_train_prompts`` samples in memory: `ConfigError` when that would take more
    than half of the memory free now (estimated from 256 of them: the dicts and their strings), naming the
    setting and both sizes, before it is built (10^7 prompts of a task abort a machine of 8 GB). Prompt files
    are already read whole, so they are not checked here."""
    available = available_memory() if available is None else available
    n = data_cfg.num_train_prompts
    if data_cfg.path is not None or available is None or n <= 256:
        return
    probe = task.train_samples(data_cfg.seed, 256)
    per = sum(sys.getsizeof(s) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in s.items()) for s in probe)
    need = per / len(probe) * n * 1.2  # + the list and the stream's index of them
    if need > available / 2:
        from cispo.config.train import ConfigError

        raise ConfigError(f"data.num_train_prompts={n:,}: the built-in task would build them in memory, about "
                          f"{need / 2**30:.1f} GiB, more than half of the {available / 2**30:.1f} GiB free now; lower "
                          "it (a run samples prompts_per_step of them per step, and the stream repeats them in new "
                          "orders)")
