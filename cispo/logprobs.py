"""Per-token log-probs (and entropy) of chosen tokens, computed in chunks.

Given final hidden states ``h_t`` [H], the LM-head weight ``W`` [V, H] (and an
optional bias ``b`` [V]), a sampling temperature ``tau`` and target ids ``y_t``::

    z_t       = (h_t W^T + b) / tau                      # logits, [V]
    lse_t     = logsumexp_v z_t,v
    logp_t    = z_t[y_t] - lse_t                         # log pi(y_t | ...)
    entropy_t = lse_t - sum_v softmax(z_t)_v z_t,v       # = -sum_v p_v log p_v

An RL loss only needs ``logp_t`` (and maybe ``entropy_t``): N numbers, not the
[N, V] logits.  ``token_logprobs`` therefore walks over the N tokens in chunks
of ``chunk_size``, so the logits of only one chunk exist at a time; backward
recomputes each chunk's logits instead of keeping them.  Saved for backward:
the inputs plus one logsumexp per token (N floats).  Peak extra memory is
O(chunk_size * V) (a few [chunk_size, V] temporaries), plus one copy of W in
the compute dtype when it differs from W's dtype.

FP32 LM head: MiniMax-M1 (arXiv 2506.13585, section 3, "Computational
precision mismatch between training and inference") found that token
probabilities of the training and inference engines disagreed, which harms
the importance-sampling ratio CISPO relies on; computing the LM head in FP32
fixed it.  With ``fp32_head=True`` (default) the head matmul, softmax and
entropy run in at least float32 whatever the dtype of ``hidden``/``weight``
(bf16 inputs are upcast; float64 stays float64).  With ``fp32_head=False`` they
run in the input dtype (the promotion of hidden, weight and bias).

Outputs are always at least float32: float32 for bf16/fp16/fp32 inputs, float64
for float64 inputs.  Gradients come back in each input's own dtype.
"""

from __future__ import annotations

import torch

__all__ = ["token_logprobs", "naive_token_logprobs"]


def _check_inputs(hidden, weight, targets, bias, temperature, chunk_size=1):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise ValueError("hidden must be a tensor of shape [..., H]")
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must have shape [V, H], got {tuple(getattr(weight, 'shape', ()))}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be floating point, got {weight.dtype}")
    V, H = weight.shape
    if hidden.shape[-1] != H:
        raise ValueError(f"hidden last dim {hidden.shape[-1]} != weight hidden dim {H}")
    if not isinstance(targets, torch.Tensor) or targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets must have shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), "
            f"got {tuple(getattr(targets, 'shape', ()))}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (V,)):
        raise ValueError(f"bias must have shape [{V}], got {tuple(getattr(bias, 'shape', ()))}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    # One reduction (one device sync on GPU) for the range check.
    if targets.numel() > 0 and bool(((targets < 0) | (targets >= V)).any()):
        raise ValueError(
            f"targets must satisfy 0 <= targets < V={V}; replace ignore ids (e.g. -100 or "
            "padding) with any valid id and mask the result instead")


def _dtypes(hidden, weight, bias, fp32_head):
    """(compute dtype, output dtype)."""
    cd = torch.promote_types(hidden.dtype, weight.dtype)
    if bias is not None:
        cd = torch.promote_types(cd, bias.dtype)
    out = torch.promote_types(cd, torch.float32)
    return (out if fp32_head else cd), out


def _chunk_logits(h, w, b, temperature):
    z = h @ w.T  # [c, V]
    if b is not None:
        z = z + b
    if temperature != 1.0:
        z = z / temperature
    return z  # [c, V]


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, fp32_head, chunk_size, with_entropy):
        # hidden [N, H], weight [V, H], bias [V] or None, targets [N]
        cd, out_dtype = _dtypes(hidden, weight, bias, fp32_head)
        N = hidden.shape[0]
        w = weight.to(cd)  # [V, H]  (no copy if already cd)
        b = None if bias is None else bias.to(cd)  # [V]
        lse = torch.empty(N, dtype=cd, device=hidden.device)  # [N]
        logp = torch.empty(N, dtype=out_dtype, device=hidden.device)  # [N]
        ent = torch.empty(N, dtype=out_dtype, device=hidden.device) if with_entropy else None  # [N]
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            z = _chunk_logits(hidden[s:e].to(cd), w, b, temperature)  # [c, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [c]
            lse[s:e] = lse_c
            logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse_c  # [c]
            if with_entropy:
                logp_all = z - lse_c[:, None]  # [c, V]
                ent[s:e] = -(logp_all.exp() * logp_all).sum(-1)  # [c]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.cfg = (temperature, cd, chunk_size)
        ctx.set_materialize_grads(False)
        return (logp, ent) if with_entropy else logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent=None):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, cd, chunk_size = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_logp is None and g_ent is None) or not (need_h or need_w or need_b):
            return (None,) * 8
        # Gradient w.r.t. the logits z of one token (p = softmax(z), logp_all = z - lse):
        #   d logp_t / dz_j = [j == y_t] - p_j
        #   H = lse - sum_v p_v z_v, with d lse/dz_j = p_j and dp_v/dz_j = p_v ([v == j] - p_j):
        #   d H / dz_j = p_j - p_j - sum_v z_v p_v ([v == j] - p_j)
        #              = -p_j (z_j - sum_v p_v z_v) = -p_j (z_j - lse + H) = -p_j (logp_all_j + H)
        # so dz = g_logp * (onehot(y) - p) + g_ent * (-p * (logp_all + H)),
        # and d/d(h W^T + b) = dz / temperature.
        N = hidden.shape[0]
        w = weight.to(cd)  # [V, H]
        b = None if bias is None else bias.to(cd)  # [V]
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        grad_w = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(bias.shape, dtype=cd, device=bias.device) if need_b else None  # [V]
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            h = hidden[s:e].to(cd)  # [c, H]
            logp_all = _chunk_logits(h, w, b, temperature) - lse[s:e, None]  # [c, V]
            p = logp_all.exp()  # [c, V]
            dz = None
            if g_ent is not None:
                ent = -(p * logp_all).sum(-1, keepdim=True)  # [c, 1]
                dz = p * (logp_all + ent) * (-g_ent[s:e, None].to(cd))  # [c, V]
            if g_logp is not None:
                gl = g_logp[s:e, None].to(cd)  # [c, 1]
                dz_l = p.mul_(-gl)  # [c, V]  (p is no longer needed)
                dz_l.scatter_add_(1, targets[s:e, None], gl)
                dz = dz_l if dz is None else dz.add_(dz_l)
            if temperature != 1.0:
                dz.div_(temperature)
            if need_h:
                grad_h[s:e] = (dz @ w).to(hidden.dtype)  # [c, H]
            if need_w:
                grad_w.addmm_(dz.T, h)  # [V, H]
            if need_b:
                grad_b += dz.sum(0)  # [V]
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, fp32_head=True,
                   chunk_size=4096, with_entropy=False):
    """Log-probs (and entropies) of ``targets`` under the LM head, chunked over tokens.

    hidden [..., H], weight [V, H], targets [...] (integer, ``0 <= targets < V``),
    bias [V] or None  ->  logp [...]  or  (logp [...], entropy [...]) if with_entropy.

    ``logp_t = z_t[y_t] - logsumexp(z_t)``, ``z_t = (h_t W^T + b) / temperature``;
    ``entropy_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v``.

    The [N, V] logits are never materialised: at most ``chunk_size`` tokens' logits exist
    at once, in forward and in backward (which recomputes them).  ``fp32_head=True`` computes
    the head in at least float32 (MiniMax-M1's fix); ``fp32_head=False`` computes in the input
    dtype.  Outputs are float32, or float64 for float64 inputs.  Positions holding padding /
    ignored tokens must still carry a valid id (any one); callers mask the result.
    Out-of-range targets (e.g. -100) raise ValueError.  Differentiable w.r.t. hidden, weight
    and bias (first order only).
    """
    _check_inputs(hidden, weight, targets, bias, temperature, chunk_size)
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    y = targets.reshape(-1).long()  # [N]
    out = _ChunkedTokenLogprobs.apply(h2, weight, bias, y, float(temperature), bool(fp32_head),
                                      chunk_size, bool(with_entropy))
    if with_entropy:
        logp, ent = out
        return logp.reshape(lead), ent.reshape(lead)
    return out.reshape(lead)


def naive_token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, with_entropy=False):
    """Reference: full log_softmax + gather (materialises the [N, V] logits).

    Computes in the input dtype (promotion of hidden, weight, bias); same output dtype rule
    and return convention as ``token_logprobs``.  For tests and benchmarks.
    """
    _check_inputs(hidden, weight, targets, bias, temperature)
    cd, out_dtype = _dtypes(hidden, weight, bias, fp32_head=False)
    z = hidden.to(cd) @ weight.to(cd).T  # [..., V]
    if bias is not None:
        z = z + bias.to(cd)
    z = z / temperature  # [..., V]
    logp_all = torch.log_softmax(z, dim=-1)  # [..., V]
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1).to(out_dtype)  # [...]
    if not with_entropy:
        return logp
    ent = -(logp_all.exp() * logp_all).sum(-1).to(out_dtype)  # [...]
    return logp, ent
