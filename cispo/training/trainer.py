"""The RL loop: sample groups, score, filter, compute advantages, update K times.

One step (MiniMax-M1 section 3; DAPO for dynamic sampling and the overlong penalty):

    1. sample P prompts x G responses with the policy (``cispo.rollout``), score them;
       drop groups whose rewards are all equal and sample more (dynamic sampling);
    2. group-relative advantages (``cispo.objective.advantages``);
    3. log pi_old of every response token, recomputed once in train mode (``logp_old``;
       dropout is off unless ``model.dropout``, so this is the sampler's distribution); the
       rows of the first update come from that update's own forward, detached, where that is
       exact (``logp_old_from_update``); with ``algo.logp_old=rollout``, where the sampler is
       the same policy, the sampler's own log-probs instead, and no pass (``cispo.training.logp_old``);
       with a KL penalty (``kl_coef > 0``) also log pi_ref of the frozen reference model;
       the sampler's own log-probs are kept to measure the train / rollout mismatch and, with a
       rollout correction (``algo.tis_cap``, ``algo.rollout_is``), to weight each token's advantage;
    4. split the batch into K mini-batches (or, with ``algo.minibatch_policy=fixed_size``, into
       mini-batches of the configured size: fewer when the batch is short; ``cispo.training.batching``);
       for each, one optimizer step on the unified
       objective (``cispo.objective.loss``), normalised by the mini-batch's global token count,
       run as length-sorted micro-batches (``cispo.training.batching``);
    5. the step's metrics (``cispo.training.metrics``).

Around the loop: ``cispo.training.setup`` builds its parts from the config (objective, optimizer,
sampling settings); ``cispo.training.runner`` runs steps, held-out evaluation (``cispo.training.evaluation``)
and checkpoints.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import torch

from cispo.data.prompts import PromptStream
from cispo.foundations.distributed import DistInfo, all_reduce_sum, any_rank, is_sharded, max_over_ranks, sum_gradients
from cispo.foundations.experience import Completion, Experience, collate
from cispo.foundations.forks import ForkTokens
from cispo.models.policy import Policy, policy_fused_loss, policy_logprobs
from cispo.objective.advantages import batch_std, group_advantages
from cispo.objective.fused_head import token_objective
from cispo.objective.loss import ObjectiveConfig, ObjectiveStats, policy_loss
from cispo.records.samples import add_token_counts, start_token_counts
from cispo.rollout import rollout_is_weights
from cispo.training.batching import micro_batches, minibatches, row_order
from cispo.training.logp_old import (MEASURED, logp_old_from_update, measured_metrics, reference_logprobs,
                                     rollout_as_old, rollout_correction, start_measuring)
from cispo.training.metrics import (fork_metrics, fork_rollout_metrics, fork_sums, frac_ppo_dropped_fork,
                                    reports_accuracy, rollout_metrics, update_metrics)
from cispo.training.sampling import StepRollout, sample_step

if TYPE_CHECKING:
    from cispo.config.algo import OptimConfig
    from cispo.training.prefetch import Prefetch


# ---------------------------------------------------------------------------------------
# 1. Rollout and rewards: cispo.training.sampling. 2. Advantages
# ---------------------------------------------------------------------------------------


def build_experience(groups: list[list[Completion]], policy: Policy, group_size: int, estimator: str,
                     batch_scale: torch.Tensor | None = None) -> Experience:
    """Group-relative advantages (``estimator``: ``algo.advantage_estimator``; ``batch_scale``: ``batch-std``'s
    std of the whole batch, `advantage_scale`), then padded tensors on the policy's device, with each row's
    group mean response length in ``extras["group_mean_length"]`` (``prompt-mean-token-mean``)."""
    flat = [c for group in groups for c in group]
    rewards = torch.tensor([c.reward for c in flat])  # R_i   [B]
    advantages = group_advantages(rewards, group_size, estimator, batch_scale=batch_scale)  # A_i   [B]
    exp = collate(flat, advantages, policy.pad_id).to(policy.device)
    lengths = exp.response_mask.sum(-1).reshape(-1, group_size)  # |o_i|   [num_groups, G]
    exp.extras["group_mean_length"] = lengths.mean(-1).repeat_interleave(group_size)  # Lbar_g(i)   [B]
    return exp


def advantage_scale(groups: list[list[Completion]], policy: Policy, group_size: int, estimator: str,
                    dist_info: DistInfo) -> torch.Tensor | None:
    """Under data parallelism with ``batch-std`` advantages, std_batch over every rank's rows (each rank
    joins the sum, also one that kept no group); else None (`group_advantages` takes its own batch's)."""
    if estimator != "batch-std" or not dist_info.enabled:
        return None
    rewards = torch.tensor([c.reward for group in groups for c in group])  # R_k   [B]
    centred = group_advantages(rewards, group_size, "drgrpo").double() if groups else rewards.double()  # Ahat_k
    sums = torch.stack([centred.square().sum(), torch.tensor(float(len(rewards)), dtype=torch.float64)])
    sums = all_reduce_sum(sums.to(policy.device), dist_info).cpu()  # sum_k Ahat_k^2, N   over ranks
    return batch_std(sums[0], sums[1])


# ---------------------------------------------------------------------------------------
# 3. logp_old, 4. the K updates
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def compute_logp_old(policy: Policy, exp: Experience, cfg, dist_info: DistInfo = DistInfo(),
                     first_rows: torch.Tensor | None = None, from_update: bool = False,
                     from_rollout: bool = False) -> torch.Tensor:
    """log pi_old of every response token, in train mode, once per generation batch. Also
    stores the per-token entropy in ``exp.extras["entropy"]`` and, when the policy has a
    reference model, log pi_ref in ``exp.extras["logp_ref"]`` (same micro-batches).  -> [B, T]

    ``first_rows``: the rows of the first update's mini-batch, run as the micro-batches that
    update will use (``micro_batches``: a row's log-prob depends on its micro-batch's shape by
    float rounding), the other rows as micro-batches of their own. ``from_update``: leave
    those rows' log-probs and entropy at 0 for the first update to fill in from its own forward
    (``logp_old_from_update``: bitwise the same numbers); their pi_ref is still computed here.
    ``from_rollout``: log pi_old is the sampler's ``exp.logp_rollout`` (``algo.logp_old=rollout``,
    ``rollout_as_old``) and no row runs the policy here; its entropy and the trainer's own log pi_old
    are NaN until the first update measures its rows (``start_measuring``); pi_ref is still computed."""
    policy.model.train()
    T = exp.response_mask.shape[1]
    logp_old = torch.zeros_like(exp.logp_rollout)
    entropy = torch.zeros_like(exp.logp_rollout)
    logp_ref = torch.zeros_like(exp.logp_rollout) if policy.ref_model is not None else None
    all_rows = torch.arange(len(exp), device=exp.input_ids.device)
    if first_rows is None:
        first, rest = [], micro_batches(exp, all_rows, cfg.algo, policy.share_prompts)
    else:
        first = micro_batches(exp, first_rows, cfg.algo, policy.share_prompts)
        rest = micro_batches(exp, all_rows[~torch.isin(all_rows, first_rows)], cfg.algo, policy.share_prompts)
    policy_micros = [] if from_rollout else rest if from_update else first + rest
    for _ in range(idle_passes(len(policy_micros), policy, dist_info)):
        idle_pass(policy, cfg, backward=False)
    for rows in policy_micros:
        sub = exp.select(rows)
        with policy.compute():
            lp, ent = policy_logprobs(policy.model, sub, cfg.rollout.temperature, cfg.model.fp32_lm_head, True,
                                      body=policy.train_body, share_prompts=policy.share_prompts)
        t = lp.shape[1]
        logp_old[rows, :t] = lp.float()
        entropy[rows, :t] = ent.float()
    if logp_ref is not None:
        for rows in first + rest:
            sub = exp.select(rows)
            logp_ref[rows, :sub.response_mask.shape[1]] = reference_logprobs(policy, sub, cfg)
    exp.extras["entropy"] = entropy * exp.response_mask
    if from_rollout:
        start_measuring(exp)
    if logp_ref is not None:
        exp.extras["logp_ref"] = logp_ref[:, :T] * exp.response_mask
    return (exp.logp_rollout if from_rollout else logp_old)[:, :T] * exp.response_mask


def lr_at(update: int, optim: OptimConfig) -> float:
    """Linear warm-up to ``optim.lr`` over ``optim.warmup_updates`` optimizer steps, then flat."""
    warm = optim.warmup_updates
    return optim.lr * min(1.0, (update + 1) / warm) if warm > 0 else optim.lr


def update_policy(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    exp: Experience,
    obj: ObjectiveConfig,
    cfg,
    generator: torch.Generator,
    update_count: int,
    forks: ForkTokens | None,
    dist_info: DistInfo = DistInfo(),
    first_order: torch.Tensor | None = None,
    first_fill: str | None = None,
) -> tuple[list[dict], int]:
    """K optimizer steps (per epoch) on random mini-batches of ``exp``. Returns the per-step
    stats and the new optimizer-step count.

    ``first_order``: the first epoch's row order (drawn from ``generator`` by the caller, before
    the logp_old pass). ``first_fill``: what the first mini-batch's forward, on pi_old's weights, writes
    into ``exp`` (detached; ``micro_batch_loss``): ``"logp_old"``, its rows' logp_old and entropy
    (``compute_logp_old(..., from_update=True)`` left them out); ``"measure"``, their entropy and the
    trainer's log pi_old beside the sampler's (``extras["logp_trainer"]``; ``algo.logp_old=rollout``).

    Each mini-batch runs as micro-batches (``micro_batches``: by default its rows sorted by
    length and cut into length-homogeneous parts, each trimmed to its own longest row); the
    objective is normalised by the whole mini-batch's token / sequence counts, so the summed
    gradient is that of the mini-batch in one piece (up to float summation order).

    Under data parallelism each rank splits its own rows into K parts; the objective is
    normalised by the mini-batch's global counts and gradients are summed over ranks, so
    the update equals the single-process update on the union of the ranks' rows."""
    policy.model.train()
    device = exp.input_ids.device
    params = [p for p in policy.model.parameters() if p.requires_grad]
    stats, kept = [], kept_rows(exp, dist_info)
    for epoch in range(cfg.algo.epochs):
        order = first_order if epoch == 0 and first_order is not None else \
            row_order(len(exp), cfg.rollout.group_size, cfg.algo, generator).to(device)
        for k, rows in enumerate(minibatches(order, cfg.algo, full_rows(cfg), kept)):
            fill = first_fill if epoch == 0 and k == 0 else None
            mask = exp.response_mask[rows]  # [b, T]
            num_tokens = all_reduce_sum(mask.sum(), dist_info)  # sum_i |o_i|, whole mini-batch
            num_seqs = all_reduce_sum((mask.sum(-1) > 0).sum(), dist_info)
            if num_tokens == 0:  # an empty mini-batch on every rank
                continue
            optimizer.zero_grad(set_to_none=True)
            parts = accumulate_gradients(policy, exp, rows, obj, cfg, forks, dist_info, num_tokens, num_seqs, fill)
            sum_gradients(params, dist_info)
            grad_norm, finite, scale = optimizer_step(policy, optimizer, params, cfg.optim, update_count)
            update_count += int(finite)
            if parts:
                stats.append(merge_stats(parts, float(grad_norm), finite))
                if scale is not None:
                    stats[-1]["loss_scale"] = scale
    return stats, update_count


def accumulate_gradients(policy: Policy, exp: Experience, rows: torch.Tensor, obj: ObjectiveConfig, cfg,
                         forks: ForkTokens | None, dist_info: DistInfo, num_tokens, num_seqs,
                         fill: str | None = None) -> list:
    """One mini-batch's gradient, accumulated over its micro-batches (``micro_batches``), each loss
    normalised by the whole mini-batch's ``num_tokens`` / ``num_seqs``; ranks with fewer micro-batches
    run idle passes so every rank joins each collective. ``fill``: what this forward supplies for the rows
    (``update_policy``'s ``first_fill``). Returns each micro-batch's ``(stats, fork sums)``."""
    parts = []
    micros = micro_batches(exp, rows, cfg.algo, policy.share_prompts)
    for _ in range(idle_passes(len(micros), policy, dist_info)):
        idle_pass(policy, cfg, backward=True)
    for micro in micros:  # the same gradient whatever the split
        sub = exp.select(micro)
        loss, s = micro_batch_loss(policy, sub, obj, cfg, num_tokens, num_seqs, fill=fill)
        if fill is not None:  # the logp_old pass left these rows to this forward
            t = sub.response_mask.shape[1]
            if fill == "logp_old":
                exp.logp_old[micro, :t] = sub.logp_old
            else:
                exp.extras[MEASURED][micro, :t] = sub.extras[MEASURED]
            exp.extras["entropy"][micro, :t] = sub.extras["entropy"]
        policy.scaled(loss).backward()
        add_token_counts(exp, micro, s)  # per-row counts for samples.jsonl
        parts.append((s, None if forks is None else fork_sums(sub, s, len(forks.names), obj.eps_high,
                                                                  obj.eps_low)))
    return parts


def optimizer_step(policy: Policy, optimizer: torch.optim.Optimizer, params: list, optim: OptimConfig,
                   update_count: int) -> tuple[torch.Tensor, bool, float | None]:
    """Clip the accumulated gradient and take the AdamW step at update ``update_count``'s learning rate,
    unless its norm is not finite (the update is skipped). Under float16 loss scaling the gradients are
    unscaled first and the scale S then updated. Returns ``(grad_norm, finite, S before the step or None)``."""
    scaler, scale = policy.grad_scaler, None
    if scaler is not None:  # float16: the gradients of S * loss, back to those of the loss
        scale = scaler.get_scale()
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, optim.grad_clip or float("inf"))
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(update_count, optim)
        optimizer.step()
    if scaler is not None:
        scaler.update()  # S halves after an overflow (this update skipped), grows after a clean run
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, finite, scale


def micro_batch_loss(policy: Policy, sub: Experience, obj: ObjectiveConfig, cfg, num_tokens, num_seqs,
                     fill: str | None = None) -> tuple[torch.Tensor, ObjectiveStats]:
    """One micro-batch's share of the mini-batch objective (normalised by the mini-batch's
    global ``num_tokens`` / ``num_seqs``) and its statistics. The advantages carry the rollout
    correction's weight (``tis``, ``rollout_correction``) when there is one; ``logp_ref`` the KL term's
    pi_ref; ``group_mean_length`` each row's group mean length (``prompt-mean-token-mean``).

    ``algo.fused_head``: the LM head and the objective in one pass (``policy_fused_loss``,
    the gradient formed in the forward); the statistics are ``policy_loss``'s on its detached
    log-probs, so both paths log the same numbers.

    ``fill``: ``sub`` runs on the weights logp_old is taken at (the first update), and this forward,
    detached, gives what the separate pass would have: ``"logp_old"`` (``logp_old_from_update``) sets
    its ``logp_old`` (the ratio is then 1) and ``extras["entropy"]``; ``"measure"`` (``algo.logp_old=rollout``:
    logp_old is the sampler's) sets ``extras["logp_trainer"]`` and ``extras["entropy"]`` (under the fused
    head, which gives no entropy, the former only)."""
    T = sub.response_mask.shape[1]
    advantages = sub.advantages  # [b]
    if "tis" in sub.extras:  # c_it, the rollout correction's weight   [b, T]
        advantages = advantages[:, None] * sub.extras["tis"][:, :T]
    lbar = sub.extras.get("group_mean_length")  # Lbar_g(i)   [b]
    logp_ref = sub.extras.get("logp_ref")  # [b, T] log pi_ref, with a KL penalty
    if logp_ref is not None:
        logp_ref = logp_ref[:, :T]
    if not cfg.algo.fused_head:
        with policy.compute():
            out = policy_logprobs(policy.model, sub, cfg.rollout.temperature, cfg.model.fp32_lm_head,
                                  with_entropy=fill is not None, body=policy.train_body,
                                  share_prompts=policy.share_prompts)
        logp_new = out[0] if fill is not None else out  # [b, T]
        if fill is not None:  # as compute_logp_old stores them
            old = logp_new.detach().float() * sub.response_mask  # log pi_old   [b, T]
            if fill == "logp_old":
                sub.logp_old = old
            else:
                sub.extras[MEASURED] = old
            sub.extras["entropy"] = out[1].detach().float() * sub.response_mask
        args = (sub.logp_old, advantages, sub.response_mask)
        return policy_loss(logp_new, *args, obj, logp_ref=logp_ref, num_tokens=num_tokens, num_seqs=num_seqs,
                           group_mean_length=lbar)
    args = (sub.logp_old, advantages, sub.response_mask)
    objective = token_objective(obj, *args, num_tokens=num_tokens, num_seqs=num_seqs, logp_ref=logp_ref,
                                group_mean_length=lbar)
    with policy.compute():
        loss, logp_new = policy_fused_loss(policy.model, sub, objective, cfg.rollout.temperature,
                                           cfg.model.fp32_lm_head, body=policy.train_body,
                                           share_prompts=policy.share_prompts)
    if fill == "measure":
        sub.extras[MEASURED] = logp_new.detach().float() * sub.response_mask
    _, stats = policy_loss(logp_new, *args, obj, logp_ref=logp_ref, num_tokens=num_tokens, num_seqs=num_seqs,
                           group_mean_length=lbar)
    return loss, stats


def merge_stats(parts: list[tuple[ObjectiveStats, torch.Tensor | None]], grad_norm: float, finite: bool) -> dict:
    """One optimizer step's statistics: its micro-batches' ``ObjectiveStats`` merged
    (``ObjectiveStats.merge``), the fork tokens' PPO-drop fraction, the gradient norm; the
    summed ``fork_sums`` under ``"forks"`` (when fork strings are tracked)."""
    merged = ObjectiveStats.merge([s for s, _ in parts])
    sums = sum(f for _, f in parts) if parts and parts[0][1] is not None else None  # [S + 1, F]
    out = {
        "loss": merged.loss,
        "pg_loss": merged.pg_loss,
        "kl": merged.kl,
        **merged.to_dict(keys=ObjectiveStats.DIAGNOSTICS),
        "frac_ppo_dropped_fork": float("nan") if sums is None else frac_ppo_dropped_fork(sums),
        "grad_norm": grad_norm,
        "skipped": 0.0 if finite else 1.0,
    }
    if sums is not None:
        out["forks"] = sums
    return out


# ---------------------------------------------------------------------------------------
# One RL step
# ---------------------------------------------------------------------------------------


class StepInterrupted(Exception):
    """A stop signal came while the step's rewards were scored and some reward calls failed
    (perhaps because of it: a scheduler signals every process of a job): the step was given up
    before any update, so that it is not committed with those calls scored 0."""


def rl_step(policy, optimizer, stream: PromptStream, task, cfg, obj, sampling, generators, update_count, forks,
            dist_info: DistInfo = DistInfo(), on_samples=None, stop_requested=None, prefetch: Prefetch | None = None):
    """Steps 1-4 of the module docstring. Returns (metrics, new optimizer-step count).
    Under data parallelism this rank's share is ``prompts_per_step / world_size`` groups.
    ``on_samples(groups, exp)``, if given, is called after the updates with this rank's batch
    (``exp.extras`` then holds the per-row counts of ``cispo.records.samples``); when this rank kept no
    group, with every group it sampled (all dropped) and ``exp=None``. ``stop_requested()``,
    if given, says whether a stop signal has come: true once the rewards are scored, with a
    failed call on any rank, raises `StepInterrupted` before the updates (the weights, the
    optimizer and the update count unchanged; the prompt stream and the generators advanced).
    ``prefetch`` (``rollout.async_steps=1``, `cispo.training.prefetch`): train on the batch it holds (sampled
    during the last step; the first step samples its own) while its thread samples the next one, joined
    before this returns."""
    t0 = time.perf_counter()
    keep_all = on_samples is not None
    stale = prefetch is not None and prefetch.held is not None
    rollout = prefetch.take() if stale else sample_step(policy, stream, task, cfg, sampling, generators, dist_info,
                                                        keep_all)
    if stop_requested is not None and any_rank(bool(rollout.errors) and stop_requested(), dist_info):
        if stale:  # not trained on: held again, so the checkpoint of the step before keeps it
            prefetch.held = rollout
        raise StepInterrupted(f"{len(rollout.errors)} of its reward calls failed while the signal was pending"
                              + (f" (first: {rollout.errors[0]})" if rollout.errors else " on another rank"))
    if rollout.errors:
        print(f"cispo: {len(rollout.errors)} reward call(s) failed and scored 0 (first: {rollout.errors[0]})",
              file=sys.stderr)
    pending = None if prefetch is None else prefetch.start(
        policy, lambda behaviour: sample_step(behaviour, stream, task, cfg, sampling, generators, dist_info, keep_all),
        stream, generators["sample"])
    t1 = time.perf_counter()
    groups, exp, stats, updates_before = rollout.groups, None, [], update_count
    fill = correction = None
    try:
        if groups or dist_info.enabled:
            exp, first_order, fill, correction = prepare_experience(policy, groups, cfg, forks, generators, dist_info,
                                                                    count_tokens=keep_all)
            t2 = time.perf_counter()
            stats, update_count = update_policy(policy, optimizer, exp, obj, cfg, generators["shuffle"], update_count,
                                                forks, dist_info, first_order, first_fill=fill)
    finally:
        if pending is not None:  # the next batch, held for the next step
            prefetch.join(pending)
    t3 = time.perf_counter()
    if exp is None:  # every group uninformative, every round: nothing to learn
        if on_samples is not None:  # what was sampled and dropped: when a user most needs to see it
            on_samples(rollout.sampled, None)
        return {"rollout/groups_kept": 0.0, "rollout/rounds": float(rollout.report.rounds), "optim/step_updates": 0.0,
                "optim/updates": float(update_count), "perf/step_s": t3 - t0,
                "rollout/reward_errors": float(len(rollout.errors)), **async_metrics(prefetch, stale)}, update_count
    policy.sampler.update_weights(policy.model)  # a separate inference engine samples the next batch
    t4 = time.perf_counter()
    if on_samples is not None and groups:
        on_samples(groups, exp)
    elif on_samples is not None:  # this rank kept no group: the ones it dropped
        on_samples(rollout.sampled, None)
    metrics = step_metrics(rollout, exp, stats, task, forks)
    if fill == "measure" and groups:  # logp_old was the sampler's: the mismatch as the first update saw it
        metrics.update(measured_metrics(exp))
    if correction is not None and groups:
        metrics.update(correction.metrics(exp.response_mask))  # rollout/is_weight_mean, is_masked, is_truncated
    if cfg.data.retire_pass_rate is not None:  # ScaleRL's No-Positive-Resampling, cumulative
        metrics["rollout/prompts_retired"] = float(len(stream.retired))
    tokens = float(exp.response_mask.sum())
    metrics.update({
        "optim/lr": lr_at(update_count - 1, cfg.optim),
        "optim/updates": float(update_count),
        "optim/step_updates": float(update_count - updates_before),  # 0: this step changed nothing
        "perf/sample_s": t1 - t0,
        "perf/logp_old_s": t2 - t1,
        "perf/update_s": t3 - t2,
        "perf/weight_sync_s": t4 - t3,  # the push to a separate engine (vLLM; its wake-up included); ~0 for torch
        "perf/step_s": t4 - t0,
        "perf/tokens_per_s": tokens * (cfg.algo.epochs + (fill != "measure")) / max(t3 - t1, 1e-9),  # + the pass
        **async_metrics(prefetch, stale),
    })
    return metrics, update_count


def async_metrics(prefetch: Prefetch | None, stale: bool) -> dict:
    """``rollout.async_steps=1``: the batch's staleness (updates between the weights that sampled it and those
    that train on it: 1, or 0 at the first step) and the trainer's wait for the next batch
    (``perf/sample_wait_s``: 0 when sampling hid behind the updates; then ``perf/update_s`` includes it)."""
    if prefetch is None:
        return {}
    return {"rollout/staleness": float(stale), "perf/sample_wait_s": prefetch.wait_s,
            "perf/behaviour_sample_s": prefetch.sample_s}


def prepare_experience(policy: Policy, groups, cfg, forks, generators, dist_info: DistInfo, count_tokens: bool):
    """Steps 2-3: the batch with its advantages, fork positions and log pi_old (and, with a rollout
    correction, ``algo.tis_cap`` or ``algo.rollout_is``, its weights in ``extras["tis"]``). Returns
    ``(exp, first_order, fill, correction)``: the first epoch's row order, drawn here so the logp_old
    pass can run the first mini-batch as the first update will; what that update fills in (``update_policy``'s
    ``first_fill``): ``"logp_old"``, its own rows of logp_old (``logp_old_from_update``), ``"measure"``, the
    trainer's log pi_old beside the sampler's, which is logp_old (``algo.logp_old=rollout``, ``rollout_as_old``:
    no pass), or None; and the correction (`cispo.rollout.correction.RolloutWeights`, for its metrics) or None."""
    G, estimator = cfg.rollout.group_size, cfg.algo.advantage_estimator
    scale = advantage_scale(groups, policy, G, estimator, dist_info)
    if not groups:  # this rank has nothing, but it must join the other ranks' updates
        exp = empty_experience(policy)
    else:
        exp = build_experience(groups, policy, G, estimator, scale)
        if count_tokens:
            start_token_counts(exp)
    if forks is not None:  # where each tracked string starts, for the metrics of every update   [B, T]
        exp.extras["fork_index"] = forks.index(exp.response_ids, exp.response_mask)
    if cfg.rollout.vllm_sleep:  # free the inference engine's memory for the updates (no-op for torch)
        policy.sampler.sleep()
    # the same draw the update would make (same stream), so the logp_old pass knows the first mini-batch
    first_order = row_order(len(exp), G, cfg.algo, generators["shuffle"]).to(exp.input_ids.device)
    first_rows = minibatches(first_order, cfg.algo, full_rows(cfg), kept_rows(exp, dist_info))[0]
    from_rollout = rollout_as_old(cfg, policy)
    from_update = not from_rollout and logp_old_from_update(cfg, policy)
    exp.logp_old = compute_logp_old(policy, exp, cfg, dist_info, first_rows, from_update, from_rollout)
    settings, correction = rollout_correction(cfg.algo), None
    if settings is not None:  # the trainer's pi_old vs the sampler's own probabilities: c_it   [B, T]
        correction = rollout_is_weights(exp.logp_old, exp.logp_rollout, exp.response_mask, **settings)
        exp.extras["tis"] = correction.weight
    return exp, first_order, "measure" if from_rollout else "logp_old" if from_update else None, correction


def step_metrics(rollout: StepRollout, exp: Experience, stats: list[dict], task, forks) -> dict:
    """Step 5: the rollout's metrics (rewards, lengths, forks) and the updates' (objective, optimizer)."""
    groups = rollout.groups
    metrics = rollout_metrics(groups, exp, rollout.report, tracked_fork(task), reports_accuracy(task)) if groups else {}
    metrics["rollout/reward_errors"] = float(len(rollout.errors))
    if forks is not None and groups:  # reflective tokens per response (several on the `chain` task)
        is_fork = (exp.extras["fork_index"] >= 0) & exp.response_mask.bool()  # [B, T]
        metrics["rollout/fork_tokens_per_response"] = float(is_fork.sum()) / max(1, len(exp))
        metrics.update(fork_rollout_metrics(exp, forks.slugs))
    per_update = [s.pop("forks") for s in stats if "forks" in s]
    if stats:
        metrics.update(update_metrics(stats))
    if per_update:
        metrics.update(fork_metrics(per_update, forks.slugs))
    return metrics


def full_rows(cfg) -> int:
    """Rows of a full generation batch over every rank: prompts_per_step x group_size."""
    return cfg.rollout.prompts_per_step * cfg.rollout.group_size


def kept_rows(exp: Experience, dist_info: DistInfo) -> int:
    """Rows this step kept, summed over ranks."""
    return int(all_reduce_sum(torch.tensor(len(exp), device=exp.input_ids.device), dist_info))


def idle_passes(n: int, policy: Policy, dist_info: DistInfo) -> int:
    """With weights sharded across ranks (FSDP) every rank must run as many forward (and
    backward) passes as the busiest one: how many empty ones to add to this rank's ``n``."""
    if not (dist_info.enabled and is_sharded(policy.model)):
        return 0
    return max_over_ranks(n, dist_info) - n


def idle_pass(policy: Policy, cfg, backward: bool) -> None:
    """A forward (and backward) pass over one padding row with a zero loss: it joins the other
    ranks' FSDP collectives and adds nothing to the gradient."""
    ids = torch.full((1, 2), policy.pad_id, dtype=torch.long, device=policy.device)
    zero = torch.zeros(1, 1, device=policy.device)
    exp = Experience(ids, torch.ones_like(ids), zero, zero, zero[0], logp_old=zero)
    with policy.compute():
        logp = policy_logprobs(policy.model, exp, cfg.rollout.temperature, cfg.model.fp32_lm_head)
    if backward:
        (logp * 0).sum().backward()


def empty_experience(policy: Policy) -> Experience:
    """A batch of zero rows (a data-parallel rank whose groups were all dropped)."""
    z = torch.zeros(0, 1, device=policy.device)
    return Experience(z.long(), z.long(), z, z, torch.zeros(0, device=policy.device), logp_old=z,
                      extras={"group_mean_length": torch.zeros(0, device=policy.device)})


def tracked_fork(task):
    """``task.used_fork`` when the task tracks fork strings, else None (fork rates are then null,
    not 0)."""
    return task.used_fork if task.fork_tokens else None
