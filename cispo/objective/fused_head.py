"""The LM head and a token-level objective in one chunked pass: the gradient without the recompute.

``cispo.objective.logprobs.token_logprobs`` keeps the [N, V] logits out of memory by walking over chunks of
tokens, and its backward recomputes each chunk's logits: 4 large matmuls (h W^T, h W^T again,
dz W, dz^T h) against the naive path's 3. For an objective that is a sum of per-token terms, the
gradient of a chunk can be formed in the forward pass instead, while the chunk's logits exist:

    logp_t           from the chunk's logits (z - logsumexp z at y_t)
    g_t = d loss / d logp_t      the objective on this chunk alone (autograd on [c] numbers)
    dz  = g_t (onehot(y_t) - softmax(z_t))      (+ the entropy term, ``_grad_head_input``)
    grad_h[chunk] = dz W,   grad_W += dz^T h,   grad_b += sum dz

For the objective of ``cispo.objective.loss.policy_loss`` with a token-level ratio, g_t depends only
on token t: with r_t = exp(logp_t - logp_old_t) (known once logp_t is),

    g_t = -a_t sg(w_t) A_t M_t  (+ kl_coef a_t dKL_t/dlogp_t),

a_t the aggregation's weight of token t (``aggregation_weights``). The backward then only scales
the stored gradients by the incoming scalar: one pass, 3 large matmuls, the memory bound of the
chunked path (a few [chunk, V] blocks; grad_h [N, H] and grad_W [V, H] are outputs any method
makes, held from the forward instead of allocated in the backward).

Not for GSPO's sequence-level ratio (a token's weight depends on its whole sequence, so it is
not known chunk by chunk: ``token_objective`` raises). The trainer uses it with
``algo.fused_head=true`` (``cispo.models.policy.policy_fused_loss``; docs/performance.md, "The head
without the recompute").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cispo.objective.logprobs import IDENTITY, LogitTransform, _check_inputs, _chunk_logits, _dtypes, _grad_head_input
from cispo.objective.loss import (
    ObjectiveConfig,
    _group_mean_length,
    kl_penalty,
    log_ratio,
    signed_is_weight,
    token_mask,
)

__all__ = ["aggregation_weights", "token_objective", "fused_head_loss"]

# (logp [c], entropy [c] or None, start, end) -> the loss of tokens start:end (a scalar)
TokenLoss = Callable[[torch.Tensor, "torch.Tensor | None", int, int], torch.Tensor]


def aggregation_weights(response_mask: torch.Tensor, aggregation: str, num_tokens=None, num_seqs=None,
                        token_sum_norm: float | None = None,
                        group_mean_length: torch.Tensor | None = None) -> torch.Tensor:
    """a [B, T] with ``cispo.objective.loss.aggregate(x, mask, ...) == sum(a * x)`` for every x [B, T]:

        token-mean               a_it = M_it / num_tokens
        seq-mean-token-mean      a_it = M_it / (|o_i| num_seqs)
        seq-mean-token-sum-norm  a_it = M_it / (num_seqs token_sum_norm)
        prompt-mean-token-mean   a_it = M_it / (Lbar_g(i) num_seqs)   (Lbar: ``group_mean_length`` [B])

    (M the response mask; the same defaults as ``aggregate``: local counts, the padded length T)."""
    mask = response_mask.bool()  # [B, T]
    m = mask.to(torch.float64 if response_mask.dtype == torch.float64 else torch.float32)  # [B, T]
    if aggregation == "token-mean":
        n = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return m / n
    lengths = mask.sum(-1)  # |o_i|  [B]
    n_seq = (lengths > 0).sum().clamp(min=1) if num_seqs is None else num_seqs
    if aggregation == "seq-mean-token-mean":
        return m / (lengths.clamp(min=1)[:, None] * n_seq)
    if aggregation == "seq-mean-token-sum-norm":
        norm = token_sum_norm if token_sum_norm is not None else mask.shape[-1]
        return m / (n_seq * norm)
    if aggregation == "prompt-mean-token-mean":
        return m / (_group_mean_length(group_mean_length, lengths, m.dtype)[:, None] * n_seq)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def token_objective(cfg: ObjectiveConfig, logp_old: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, num_tokens=None, num_seqs=None,
                    logp_ref: torch.Tensor | None = None, entropy_coef: float | None = None,
                    group_mean_length: torch.Tensor | None = None) -> TokenLoss:
    """``policy_loss``'s value as a sum of per-token terms, evaluable on any range of the flattened
    [B * T] tokens:  loss = sum_t a_t ( -sg(w_t) A_t logp_t M_t + kl_coef KL_t - entropy_coef H_t ),
    ``entropy_coef`` the config's unless given (H_t needs ``fused_head_loss(..., with_entropy=True)``).

    logp_old, response_mask, logp_ref: [B, T]; advantages [B] or [B, T]. The flattening order is
    row-major ([B, T] -> [B * T]): ``fused_head_loss``'s hidden states and targets must follow it."""
    if cfg.ratio_level != "token":
        raise ValueError("token_objective needs ratio_level='token': with a sequence-level ratio (GSPO) a "
                         "token's weight depends on its whole sequence, so it is not known chunk by chunk")
    if cfg.kl_coef > 0 and logp_ref is None:
        raise ValueError("token_objective: cfg.kl_coef > 0 needs logp_ref")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp_old)  # [B, T]
    entropy_coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
    a = aggregation_weights(response_mask, cfg.aggregation, num_tokens, num_seqs, cfg.token_sum_norm,
                            group_mean_length).reshape(-1)
    old, adv, mask = logp_old.reshape(-1), advantages.reshape(-1), response_mask.bool().reshape(-1)  # [N]
    ref = None if logp_ref is None else logp_ref.reshape(-1)  # [N]

    def loss(logp: torch.Tensor, ent: torch.Tensor | None, s: int, e: int) -> torch.Tensor:
        m = mask[s:e]  # [c]
        ratio = torch.exp(log_ratio(logp, old[s:e], m, "token", cfg.max_log_ratio))  # r_t, detached  [c]
        A = adv[s:e].to(logp.dtype)  # [c]
        weight = signed_is_weight(ratio, A, cfg)  # sg(w_t)  [c]
        lp = torch.where(m, logp, 0.0)  # [c]
        terms = -(weight * A * lp)  # [c]
        if cfg.mask_rule != "none":
            terms = terms * token_mask(ratio, A, cfg, logp, old[s:e])  # M_t  [c]
        if ref is not None and cfg.kl_coef > 0:
            terms = terms + cfg.kl_coef * kl_penalty(lp, torch.where(m, ref[s:e], 0.0), cfg.kl_estimator)
        if entropy_coef and ent is not None:
            terms = terms - entropy_coef * ent
        return (a[s:e].to(logp.dtype) * torch.where(m, terms, 0.0)).sum()

    return loss


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, token_loss, temperature, fp32_head, chunk_size, with_entropy,
                transform):
        # hidden [N, H], weight [V, H], bias [V] or None, targets [N]
        cd, out_dtype = _dtypes(hidden, weight, bias, fp32_head)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        N = hidden.shape[0]
        w = weight.to(cd)  # [V, H]
        b = None if bias is None else bias.to(cd)  # [V]
        logp = torch.empty(N, dtype=out_dtype, device=hidden.device)  # [N]
        ent = torch.empty(N, dtype=out_dtype, device=hidden.device) if with_entropy else None  # [N]
        grad_h = torch.zeros_like(hidden) if need_h else None  # [N, H]
        grad_w = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(bias.shape, dtype=cd, device=bias.device) if need_b else None  # [V]
        total = torch.zeros((), dtype=cd, device=hidden.device)
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            h = hidden[s:e].to(cd)  # [c, H]
            z, slope = _chunk_logits(h, w, b, temperature, transform, with_slope=True)  # [c, V]
            logp_all = z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))  # [c, V]
            lp = logp_all.gather(1, targets[s:e, None]).squeeze(1)  # [c]
            en = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None  # [c]
            with torch.enable_grad():  # the objective of this chunk, on its [c] log-probs
                leaves = [lp.detach().requires_grad_()] + ([en.detach().requires_grad_()] if with_entropy else [])
                chunk_loss = token_loss(leaves[0], leaves[1] if with_entropy else None, s, e)
                grads = torch.autograd.grad(chunk_loss, leaves, allow_unused=True) if chunk_loss.requires_grad \
                    else (None,) * len(leaves)
            total += chunk_loss.detach().to(cd)
            logp[s:e] = lp
            if with_entropy:
                ent[s:e] = en
            g_logp, g_ent = grads[0], (grads[1] if with_entropy else None)
            if (g_logp is None and g_ent is None) or not (need_h or need_w or need_b):
                continue
            dz = _grad_head_input(logp_all, targets[s:e], g_logp, g_ent, temperature, slope, transform)  # [c, V]
            if need_h:
                grad_h[s:e] = (dz @ w).to(hidden.dtype)  # [c, H]
            if need_w:
                grad_w.addmm_(dz.T, h)  # [V, H]
            if need_b:
                grad_b += dz.sum(0)  # [V]
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                              None if grad_b is None else grad_b.to(bias.dtype))
        outs = (logp, ent) if with_entropy else (logp,)
        ctx.mark_non_differentiable(*outs)
        return (total.to(out_dtype), *outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_loss, *_):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = lambda g: None if g is None else g * g_loss.to(g.dtype)  # noqa: E731
        return scale(grad_h), scale(grad_w), scale(grad_b), None, None, None, None, None, None, None


def fused_head_loss(hidden, weight, targets, token_loss: TokenLoss, *, bias=None, temperature=1.0, fp32_head=True,
                    chunk_size=4096, with_entropy=False, transform: LogitTransform | None = None):
    """loss = sum over chunks of ``token_loss(logp[chunk], entropy[chunk], start, end)``, with
    ``logp`` / ``entropy`` as in ``cispo.objective.logprobs.token_logprobs`` (same arguments, same dtypes),
    and the gradient w.r.t. hidden / weight / bias formed during the forward, chunk by chunk.

    hidden [..., H], weight [V, H], targets [...]  ->  (loss [], logp [...], entropy [...] or None);
    logp and entropy are detached (for statistics). ``token_loss`` must be a sum of per-token
    terms (the loss of a chunk may depend only on that chunk's values: ``token_objective``);
    its gradient is taken once, in the forward, so call ``backward`` once on (a multiple of) the
    returned loss. First order only."""
    _check_inputs(hidden, weight, targets, bias, temperature, chunk_size)
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    y = targets.reshape(-1).long()  # [N]
    with torch.autocast(hidden.device.type, enabled=False):
        out = _FusedHeadLoss.apply(h2, weight, bias, y, token_loss, float(temperature), bool(fp32_head), chunk_size,
                                   bool(with_entropy), transform or IDENTITY)
    loss, logp = out[0], out[1].reshape(lead)
    return loss, logp, (out[2].reshape(lead) if with_entropy else None)
