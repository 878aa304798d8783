"""Per-token log-probs (and entropy) of chosen tokens, computed in chunks.

Given final hidden states ``h_t`` [H], the LM-head weight ``W`` [V, H] (and an
optional bias ``b`` [V]), the model's own logit post-processing (``LogitTransform``:
a scale ``s`` and a tanh soft cap ``c``), a sampling temperature ``tau`` and target ids ``y_t``::

    u_t       = s (h_t W^T + b)                          # [V]  (s = 1 for most models)
    z_t       = c tanh(u_t / c) / tau                    # logits, [V]  (no cap: u_t / tau)
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

from dataclasses import dataclass

import torch

__all__ = ["LogitTransform", "logit_transform", "lm_logits", "token_logprobs", "naive_token_logprobs"]


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to ``h W^T + b`` before its softmax: ``softcap(scale * x)`` with
    ``softcap(x) = cap * tanh(x / cap)`` (no cap: the identity). Temperature comes after."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.scale < float("inf")):
            raise ValueError(f"logit scale must be a positive finite number, got {self.scale!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"logit soft cap must be > 0 or None, got {self.softcap!r}")


IDENTITY = LogitTransform()


def logit_transform(config) -> LogitTransform:
    """The logit post-processing a Hugging Face causal-LM config defines (its text config's):

    * ``final_logit_softcapping`` (Gemma 2/3): ``cap * tanh(logits / cap)``;
    * ``logit_scale`` (Cohere): ``logits * logit_scale``;
    * ``logits_scaling`` (Granite): ``logits / logits_scaling``;
    * ``lm_head_multiplier`` (Falcon-H1): ``logits * lm_head_multiplier``.

    Scaling is applied before the cap. A config without them gives the identity."""
    text = config.get_text_config(decoder=True)
    scale = 1.0
    for name, invert in (("logit_scale", False), ("logits_scaling", True), ("lm_head_multiplier", False)):
        value = getattr(text, name, None)
        if value is not None and float(value) != 1.0:
            scale *= 1.0 / float(value) if invert else float(value)
    cap = getattr(text, "final_logit_softcapping", None)
    return LogitTransform(scale=scale, softcap=float(cap) if cap else None)


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


def _chunk_logits(h, w, b, temperature, transform=IDENTITY, with_slope=False):
    """z = softcap(scale (h W^T + b)) / temperature  [c, V]; with ``with_slope`` also
    d softcap(x) / dx = 1 - tanh^2(x / cap) at x = scale (h W^T + b)  ([c, V], None without a cap)."""
    z = h @ w.T  # [c, V]
    if b is not None:
        z = z + b
    if transform.scale != 1.0:
        z = z * transform.scale
    slope = None
    if transform.softcap is not None:
        t = torch.tanh(z / transform.softcap)  # [c, V]
        if with_slope:
            slope = 1.0 - t * t
        z = t * transform.softcap
    if temperature != 1.0:
        z = z / temperature
    return (z, slope) if with_slope else z  # [c, V]


def _grad_head_input(logp_all, targets, g_logp, g_ent, temperature, slope, transform):
    """d loss / d x for x = h W^T + b of one chunk, from d loss / d logp_t (``g_logp`` [c] or None) and
    d loss / d entropy_t (``g_ent`` [c] or None); ``logp_all`` = z - lse [c, V] is consumed.

    With p = softmax(z):  d logp_t / dz_j = [j == y_t] - p_j;  d H_t / dz_j = -p_j (logp_all_j + H_t)
    (H = lse - sum_v p_v z_v; d lse/dz_j = p_j, dp_v/dz_j = p_v ([v == j] - p_j)); then
    dx = dz * softcap'(scale x) * scale / temperature.  -> [c, V]"""
    p = logp_all.exp()  # [c, V]
    dz = None
    if g_ent is not None:
        ent = -(p * logp_all).sum(-1, keepdim=True)  # [c, 1]
        dz = p * (logp_all + ent) * (-g_ent[:, None].to(p.dtype))  # [c, V]
    if g_logp is not None:
        gl = g_logp[:, None].to(p.dtype)  # [c, 1]
        dz_l = p.mul_(-gl)  # [c, V]  (p is no longer needed)
        dz_l.scatter_add_(1, targets[:, None], gl)
        dz = dz_l if dz is None else dz.add_(dz_l)
    if temperature != 1.0:
        dz.div_(temperature)
    if slope is not None:
        dz.mul_(slope)
    if transform.scale != 1.0:
        dz.mul_(transform.scale)
    return dz


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, fp32_head, chunk_size, with_entropy, transform):
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
            z = _chunk_logits(hidden[s:e].to(cd), w, b, temperature, transform)  # [c, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [c]
            lse[s:e] = lse_c
            logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse_c  # [c]
            if with_entropy:
                logp_all = z - lse_c[:, None]  # [c, V]
                ent[s:e] = -(logp_all.exp() * logp_all).sum(-1)  # [c]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.cfg = (temperature, cd, chunk_size, transform)
        ctx.set_materialize_grads(False)
        return (logp, ent) if with_entropy else logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent=None):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, cd, chunk_size, transform = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_logp is None and g_ent is None) or not (need_h or need_w or need_b):
            return (None,) * 9
        # The chunk's gradient w.r.t. h W^T + b: _grad_head_input (the formula is stated there).
        N = hidden.shape[0]
        w = weight.to(cd)  # [V, H]
        b = None if bias is None else bias.to(cd)  # [V]
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        grad_w = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(bias.shape, dtype=cd, device=bias.device) if need_b else None  # [V]
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            h = hidden[s:e].to(cd)  # [c, H]
            z, slope = _chunk_logits(h, w, b, temperature, transform, with_slope=True)  # [c, V]
            logp_all = z.sub_(lse[s:e, None])  # [c, V]
            dz = _grad_head_input(logp_all, targets[s:e], None if g_logp is None else g_logp[s:e],
                                  None if g_ent is None else g_ent[s:e], temperature, slope, transform)  # [c, V]
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
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, fp32_head=True,
                   chunk_size=4096, with_entropy=False, transform: LogitTransform | None = None):
    """Log-probs (and entropies) of ``targets`` under the LM head, chunked over tokens.

    hidden [..., H], weight [V, H], targets [...] (integer, ``0 <= targets < V``),
    bias [V] or None  ->  logp [...]  or  (logp [...], entropy [...]) if with_entropy.

    ``logp_t = z_t[y_t] - logsumexp(z_t)``, ``z_t = softcap(scale (h_t W^T + b)) / temperature``
    (``transform``: the model's own post-processing, ``logit_transform(model.config)``; None: none);
    ``entropy_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v``.

    The [N, V] logits are never materialised: at most ``chunk_size`` tokens' logits exist
    at once, in forward and in backward (which recomputes them).  ``fp32_head=True`` computes
    the head in at least float32 (MiniMax-M1's fix); ``fp32_head=False`` computes in the input
    dtype.  Outputs are float32, or float64 for float64 inputs.  Positions holding padding /
    ignored tokens must still carry a valid id (any one); callers mask the result.
    Out-of-range targets (e.g. -100) raise ValueError.  Differentiable w.r.t. hidden, weight
    and bias (first order only).  Runs with autocast disabled (under mixed precision the
    head keeps the dtypes stated above).
    """
    _check_inputs(hidden, weight, targets, bias, temperature, chunk_size)
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    y = targets.reshape(-1).long()  # [N]
    with torch.autocast(hidden.device.type, enabled=False):
        out = _ChunkedTokenLogprobs.apply(h2, weight, bias, y, float(temperature), bool(fp32_head),
                                          chunk_size, bool(with_entropy), transform or IDENTITY)
    if with_entropy:
        logp, ent = out
        return logp.reshape(lead), ent.reshape(lead)
    return out.reshape(lead)


def lm_logits(hidden, weight, *, bias=None, transform: LogitTransform | None = None, fp32_head=True):
    """The model's logits ``softcap(scale (h W^T + b))`` of hidden [..., H] -> [..., V], all of
    them (for a few positions: the sampler's last one), in at least float32 with ``fp32_head``."""
    cd, _ = _dtypes(hidden, weight, bias, fp32_head)
    with torch.autocast(hidden.device.type, enabled=False):
        return _chunk_logits(hidden.to(cd), weight.to(cd), None if bias is None else bias.to(cd), 1.0,
                             transform or IDENTITY)


def naive_token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, with_entropy=False,
                         transform: LogitTransform | None = None):
    """Reference: full log_softmax + gather (materialises the [N, V] logits).

    Computes in the input dtype (promotion of hidden, weight, bias); same output dtype rule
    and return convention as ``token_logprobs``.  For tests and benchmarks.
    """
    _check_inputs(hidden, weight, targets, bias, temperature)
    cd, out_dtype = _dtypes(hidden, weight, bias, fp32_head=False)
    z = hidden.to(cd) @ weight.to(cd).T  # [..., V]
    if bias is not None:
        z = z + bias.to(cd)
    t = transform or IDENTITY
    z = z * t.scale
    if t.softcap is not None:
        z = t.softcap * torch.tanh(z / t.softcap)
    z = z / temperature  # [..., V]
    logp_all = torch.log_softmax(z, dim=-1)  # [..., V]
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1).to(out_dtype)  # [...]
    if not with_entropy:
        return logp
    ent = -(logp_all.exp() * logp_all).sum(-1).to(out_dtype)  # [...]
    return logp, ent
