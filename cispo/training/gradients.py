"""The gradient loop's pieces: one micro-batch's loss, one optimizer step, and the passes that keep
data-parallel ranks in step. `cispo.training.trainer.Trainer` drives them; nothing here keeps state.

A mini-batch's gradient is the sum of its micro-batches' gradients, each micro-batch's loss normalised by
the whole mini-batch's token / sequence counts (`Counts`), so the split changes nothing but float
summation order. Under data parallelism the counts are global and gradients are summed over ranks."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cispo.foundations.distributed import DistInfo, is_sharded, max_over_ranks
from cispo.foundations.experience import Experience
from cispo.models.policy import Policy, policy_fused_loss, policy_logprobs
from cispo.objective.fused_head import token_objective
from cispo.objective.loss import ObjectiveConfig, ObjectiveStats, policy_loss

Supply = Callable[[Experience, torch.Tensor, "torch.Tensor | None"], None]
"""``supply(sub, logp, entropy)``: what the first update's forward, on pi_old's weights, gives its rows of log
pi_old and entropy (detached, masked; entropy None under the fused head). Made by the trainer from its
log pi_old source (`cispo.training.logp_old.LogpOldSource.supply`)."""


@dataclass(frozen=True)
class Counts:
    """A mini-batch's response tokens and sequences, summed over ranks: the objective's normalisers."""

    num_tokens: torch.Tensor
    num_seqs: torch.Tensor


def planned_updates(cfg) -> int:
    """N, the optimizer updates a ``cispo train`` run plans: steps x algo.updates_per_batch x algo.epochs (the unit
    of ``optim.lr_scheduler_type``'s schedule; a step whose groups were all dropped, a ``fixed_size`` step that runs
    fewer updates or a skipped non-finite update leaves the run short of it, and its rate above the schedule's end)."""
    return cfg.steps * cfg.algo.updates_per_batch * cfg.algo.epochs


def warmup_of(optim, total: int) -> int:
    """W, the warm-up's updates: ceil(optim.warmup_ratio x N) where the ratio is set (HF's rule), else
    ``optim.warmup_updates``."""
    return math.ceil(optim.warmup_ratio * total) if optim.warmup_ratio is not None else optim.warmup_updates


def lr_at(update: int, optim, total: int) -> float:
    """The learning rate of optimizer update ``update`` (u, counted from 0) of a run of ``total`` (N) updates:
    ``optim.lr`` x the factor of ``optim.lr_scheduler_type``, with W = `warmup_of`::

        warm-up, u < W          (u + 1) / W                                  (not constant)
        constant_with_warmup    1
        constant                1 from the first update (no warm-up, as HF's)
        linear                  max(0, (N - u) / max(1, N - W))                 (at most 1)
        cosine                  max(0, 0.5 (1 + cos(pi (u - W) / max(1, N - W))))

    transformers' ``get_scheduler`` formulas from W on (tested); in the warm-up its factor is u / W, so its first
    update runs at lr 0: cispo's warm-up factor is HF's of the update after (one update ahead)."""
    kind = optim.lr_scheduler_type
    warm = 0 if kind == "constant" else warmup_of(optim, total)
    if update < warm:
        return optim.lr * (update + 1) / warm
    if kind == "linear":
        return optim.lr * min(1.0, max(0.0, (total - update) / max(1, total - warm)))
    if kind == "cosine":
        return optim.lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * (update - warm) / max(1, total - warm))))
    return optim.lr


def micro_batch_loss(policy: Policy, sub: Experience, obj: ObjectiveConfig, cfg, counts: Counts,
                     supply: Supply | None = None) -> tuple[torch.Tensor, ObjectiveStats]:
    """One micro-batch's share of the mini-batch objective (normalised by ``counts``) and its statistics.
    The advantages carry the rollout correction's weight (``extras["tis"]``) when there is one; ``logp_ref``
    the KL term's pi_ref; ``group_mean_length`` each row's group mean length (``prompt-mean-token-mean``).

    ``algo.fused_head``: the LM head and the objective in one pass (``policy_fused_loss``, the gradient
    formed in the forward); the statistics are ``policy_loss``'s on its detached log-probs, so both paths log
    the same numbers.

    ``supply``: ``sub`` runs on the weights log pi_old is taken at (the first update), and this forward,
    detached, is handed to ``supply`` before the loss is formed (`Supply`): the numbers a separate pass would
    have given, bit for bit."""
    T = sub.response_mask.shape[1]
    advantages = sub.advantages  # [b], or [b, T] per token
    if "tis" in sub.extras:  # c_it, the rollout correction's weight   [b, T]
        advantages = sub.token_advantages * sub.extras["tis"][:, :T]
    lbar = sub.extras.get("group_mean_length")  # Lbar_g(i)   [b]
    logp_ref = sub.extras.get("logp_ref")  # [b, T] log pi_ref, with a KL penalty
    if logp_ref is not None:
        logp_ref = logp_ref[:, :T]
    norm = dict(num_tokens=counts.num_tokens, num_seqs=counts.num_seqs, logp_ref=logp_ref, group_mean_length=lbar)
    bonus = obj.entropy_coef > 0  # the entropy bonus needs pi_theta's entropy, with its gradient
    if not cfg.algo.fused_head:
        with policy.compute():
            out = policy_logprobs(policy.model, sub, cfg.rollout.temperature, cfg.model.fp32_lm_head,
                                  with_entropy=supply is not None or bonus, body=policy.train_body,
                                  share_prompts=policy.share_prompts)
        logp_new, entropy = out if supply is not None or bonus else (out, None)  # [b, T]
        if supply is not None:  # as the logp_old pass stores them
            supply(sub, logp_new.detach().float() * sub.response_mask, entropy.detach().float() * sub.response_mask)
        return policy_loss(logp_new, sub.logp_old, advantages, sub.response_mask, obj, **norm,
                           entropy=entropy if bonus else None)
    objective = token_objective(obj, sub.logp_old, advantages, sub.response_mask, **norm)
    with policy.compute():
        out = policy_fused_loss(policy.model, sub, objective, cfg.rollout.temperature, cfg.model.fp32_lm_head,
                                body=policy.train_body, share_prompts=policy.share_prompts, with_entropy=bonus)
    loss, logp_new, entropy = out if bonus else (*out, None)
    if supply is not None:  # the fused forward gives no entropy unless the bonus asks for it
        supply(sub, logp_new.detach().float() * sub.response_mask,
               None if entropy is None else entropy.detach().float() * sub.response_mask)
    _, stats = policy_loss(logp_new, sub.logp_old, advantages, sub.response_mask, obj, **norm, entropy=entropy)
    return loss, stats


def optimizer_step(policy: Policy, optimizer: torch.optim.Optimizer, params: list, optim,
                   update_count: int, total_updates: int) -> tuple[torch.Tensor, bool, float | None]:
    """Clip the accumulated gradient and take the AdamW step at update ``update_count``'s learning rate (`lr_at`,
    of a run of ``total_updates``),
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
            group["lr"] = lr_at(update_count, optim, total_updates)
        optimizer.step()
    if scaler is not None:
        scaler.update()  # S halves after an overflow (this update skipped), grows after a clean run
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, finite, scale


def merge_stats(parts: list[ObjectiveStats], grad_norm: float, finite: bool) -> dict:
    """One optimizer step's statistics: its micro-batches' ``ObjectiveStats`` merged
    (``ObjectiveStats.merge``) and the gradient norm."""
    merged = ObjectiveStats.merge(parts)
    return {
        "loss": merged.loss,
        "pg_loss": merged.pg_loss,
        "kl": merged.kl,
        **merged.to_dict(keys=ObjectiveStats.DIAGNOSTICS),
        "grad_norm": grad_norm,
        "skipped": 0.0 if finite else 1.0,
    }


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
