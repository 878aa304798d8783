"""One policy objective, many algorithms: CISPO and its family as settings of eq. 6.

MiniMax-M1 (arXiv 2506.13585), section 3.1. For a batch of responses o_i sampled from
pi_old, with advantages A_it and response tokens counted by the response mask:

    r_it    = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)              IS ratio
    w_it    = clip(r_it, 1 - eps_low_is, 1 + eps_high_is)                     eq. 5
    M_it    = 0 if A_it > 0 and r_it > 1 + eps_high     (the upper half)      eq. 7
              0 if A_it < 0 and r_it < 1 - eps_low      (the lower half)
              1 otherwise
    J       = agg_{i,t}( sg(w_it) * A_it * log pi_theta(o_it | q, o_i<t) * M_it )   eq. 6
    loss    = -J + kl_coef * agg_{i,t}( KL_it(pi_theta || pi_ref) ) - entropy_coef * agg_{i,t}( H_it )

``sg`` is stop-gradient: the weight is a constant coefficient and the gradient flows only
through ``log pi_theta``, so each token contributes ``sg(w) * A * M * grad log pi``:

    | token                              | PPO / GRPO / DAPO   | CISPO                           |
    |------------------------------------|---------------------|---------------------------------|
    | ratio inside the bound             | r * A * grad log pi | r * A * grad log pi             |
    | A > 0 and r above the upper bound  | 0 (token dropped)   | (1 + eps_high_is) * A * grad lp |

Every algorithm is a setting of five independent axes (fields of ``ObjectiveConfig``, with the
named presets in `cispo.objective.presets`, torch-free, re-exported here):

1. ratio unit — ``token`` (r_it) or ``sequence`` (GSPO, arXiv 2507.18071:
   s_i = exp(mean_t(log pi_theta - log pi_old)) shared by the tokens of o_i);
2. the IS-weight bounds ``eps_low_is`` / ``eps_high_is`` (None = unbounded on that side); with
   ``is_bounds_by_sign`` the tokens with A < 0 take their own bounds ``eps_low_is_neg`` /
   ``eps_high_is_neg`` (DISPO, arXiv 2602.00983: up- and down-clipping decoupled for correct and
   incorrect responses, four regimes);
3. the mask rule — ``none`` (M = 1, CISPO, REINFORCE), ``ppo`` (eq. 7 with ``eps_low`` /
   ``eps_high``: the trust region of PPO, GRPO, DAPO and, at sequence level, GSPO), or one half
   of it: ``ppo-low`` (only A < 0, r < 1 - eps_low dropped) or ``ppo-high`` (only A > 0,
   r > 1 + eps_high dropped); or DPPO's trust region on the probability itself (arXiv 2602.04879,
   ``dppo-tv`` / ``dppo-kl`` with ``delta_low`` / ``delta_high``: ``dppo_dropped``);
4. the aggregation — ``token-mean`` (DAPO's token-level loss, eq. 4's 1/sum_i|o_i|),
   ``seq-mean-token-mean`` (GRPO), ``seq-mean-token-sum-norm`` (Dr. GRPO, a constant length),
   ``prompt-mean-token-mean`` (ScaleRL, arXiv 2510.13786: each prompt's G responses pooled, then a mean
   over prompts);
5. an optional KL penalty to a reference policy (k1 or k3 estimator), off by default; and an optional
   entropy bonus (``entropy_coef``: H_it the full-vocabulary entropy of pi_theta at the token, with its
   gradient; verl's ``entropy_coeff``), off by default.

With a PPO mask and an unclipped weight, the gradient of eq. 6 equals the gradient of
PPO's ``min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`` exactly (the tests prove it); the
*value* of the loss is that of eq. 6, not of the surrogate.

Departures from the paper, in plain words:

1. The paper does not publish eps_high_is. The ``cispo`` preset uses eps_high_is = 4.0
   (IS weight capped at 5), the value of ScaleRL (arXiv 2510.13786); eps_low_is = None.
2. The log-ratio is clamped to +-``max_log_ratio`` (20 by default) before ``exp`` so that
   wildly off-policy tokens give finite weights; inside that range nothing changes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from cispo.objective.presets import (  # noqa: F401 - the objective's settings, re-exported
    AGGREGATIONS,
    KL_ESTIMATORS,
    MASK_RULES,
    PRESETS,
    RATIO_LEVELS,
    ObjectiveConfig,
    preset,
)

LOW_PROB = 0.1  # p_old below this counts as a low-probability ("fork") token in the stats


@dataclass(frozen=True)
class ObjectiveStats:
    """Detached diagnostics of one ``policy_loss`` call. Fractions and ratio statistics count
    only tokens with response_mask = 1; ``num_tokens`` / ``num_low_prob_tokens`` are their
    local counts, to weight averages over micro-batches (``merge``). ``capped`` and
    ``ppo_dropped`` are the per-token flags behind ``frac_capped`` / ``frac_ppo_dropped``, for
    callers that count them per row or per token kind, with ``ratio`` and ``weight`` (never part of
    ``to_dict``)."""

    loss: float
    pg_loss: float  # -J (eq. 6) alone
    kl: float  # aggregated KL to the reference policy (0 when off)
    frac_capped: float  # IS weight hit one of its bounds (eq. 5)
    frac_ppo_dropped: float  # a PPO mask with the config's eps_low / eps_high would drop (eq. 7)
    frac_ppo_dropped_low_prob: float  # the same among tokens with p_old < 0.1
    frac_masked: float  # M_it = 0 under the config's own mask rule (0 under "none"; verl's pg_clipfrac for DPPO)
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    approx_kl: float  # k3 estimate of KL(pi_old || pi_theta): mean of (r - 1) - log r
    num_tokens: int
    num_low_prob_tokens: int
    capped: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)
    """[B, T] bool: response tokens whose IS weight hit a bound of eq. 5 (w_it != r_it)."""
    ppo_dropped: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)
    """[B, T] bool: response tokens a PPO mask with eps_low / eps_high drops (M_it = 0, eq. 7)."""
    ratio: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)
    """[B, T] r_it (or s_i), detached; 1 at padding."""
    weight: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)
    """[B, T] sg(w_it), the IS weight of eq. 5 each token's gradient carries."""

    SCALARS: ClassVar[tuple[str, ...]]  # every scalar statistic: the fields above the flags, in order
    DIAGNOSTICS = ("frac_capped", "frac_ppo_dropped", "frac_ppo_dropped_low_prob", "frac_masked", "ratio_mean",
                   "ratio_min", "ratio_max", "approx_kl")
    """The diagnostics every caller logs (the trainer as ``objective/<name>``, the TRL and verl
    adapters as ``cispo/<name>``)."""

    def to_dict(self, prefix: str = "", keys: tuple[str, ...] | None = None) -> dict[str, float]:
        """``{prefix + name: value}`` for ``keys`` (default: every scalar statistic, ``SCALARS``)."""
        return {prefix + k: float(getattr(self, k)) for k in (self.SCALARS if keys is None else keys)}

    @staticmethod
    def merge(parts: list[ObjectiveStats]) -> ObjectiveStats:
        """The statistics of the parts' union (micro-batches of one mini-batch, whose losses
        were normalised by the whole mini-batch's counts): losses summed, fractions and means
        weighted by the parts' token counts (``frac_ppo_dropped_low_prob`` by their low-probability
        token counts), the ratio's min / max over the parts; no per-token flags."""
        n = sum(s.num_tokens for s in parts)
        n_low = sum(s.num_low_prob_tokens for s in parts)
        w = lambda name: sum(getattr(s, name) * s.num_tokens for s in parts) / max(n, 1)  # noqa: E731
        return ObjectiveStats(
            loss=sum(s.loss for s in parts),
            pg_loss=sum(s.pg_loss for s in parts),
            kl=sum(s.kl for s in parts),
            frac_capped=w("frac_capped"),
            frac_ppo_dropped=w("frac_ppo_dropped"),
            frac_ppo_dropped_low_prob=sum(s.frac_ppo_dropped_low_prob * s.num_low_prob_tokens for s in parts)
            / max(n_low, 1),
            frac_masked=w("frac_masked"),
            ratio_mean=w("ratio_mean"),
            ratio_min=min(s.ratio_min for s in parts),
            ratio_max=max(s.ratio_max for s in parts),
            approx_kl=w("approx_kl"),
            num_tokens=n,
            num_low_prob_tokens=n_low,
        )


# the required fields are the scalars (the per-token flags default to None)
ObjectiveStats.SCALARS = tuple(f.name for f in dataclasses.fields(ObjectiveStats) if f.default is dataclasses.MISSING)


# ---------------------------------------------------------------------------------------
# The axes, one function each. Tensors in, tensors out.
# ---------------------------------------------------------------------------------------


def log_ratio(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    response_mask: torch.Tensor,
    ratio_level: str = "token",
    max_log_ratio: float | None = 20.0,
) -> torch.Tensor:
    """log r_it = log pi_theta - log pi_old (token), or log s_i = mean_t log r_it (sequence,
    GSPO eq. 7) broadcast over the tokens of o_i. Detached; 0 at padding.  -> [B, T]"""
    mask = response_mask.bool()  # [B, T]
    log_r = torch.where(mask, logp_new.detach() - logp_old, 0.0)  # log r_it    [B, T]
    if ratio_level == "sequence":
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # |o_i|       [B, 1]
        log_s = log_r.sum(-1, keepdim=True) / lengths  # log s_i     [B, 1]
        log_r = torch.where(mask, log_s.expand_as(log_r), 0.0)  # log s_i     [B, T]
    if max_log_ratio is not None:
        log_r = log_r.clamp(-max_log_ratio, max_log_ratio)
    return log_r


def is_weight(ratio: torch.Tensor, eps_low_is: float | None, eps_high_is: float | None) -> torch.Tensor:
    """sg(w_it), w = clip(r, 1 - eps_low_is, 1 + eps_high_is)   (eq. 5); None = unbounded."""
    low = None if eps_low_is is None else 1.0 - eps_low_is
    high = None if eps_high_is is None else 1.0 + eps_high_is
    if low is None and high is None:
        return ratio.detach()  # sg(r_it)    [B, T]
    return ratio.clamp(min=low, max=high).detach()  # sg(w_it)    [B, T]


def signed_is_weight(ratio: torch.Tensor, advantages: torch.Tensor, cfg: ObjectiveConfig) -> torch.Tensor:
    """sg(w_it) of eq. 5 with the bounds of the token's sign when ``cfg.is_bounds_by_sign`` (DISPO):
    clip(r, 1 - eps_low_is, 1 + eps_high_is) where A >= 0, clip(r, 1 - eps_low_is_neg, 1 + eps_high_is_neg)
    where A < 0; otherwise eq. 5 for every token."""
    weight = is_weight(ratio, cfg.eps_low_is, cfg.eps_high_is)  # sg(w_it)    [B, T]
    if not cfg.is_bounds_by_sign:
        return weight
    weight_neg = is_weight(ratio, cfg.eps_low_is_neg, cfg.eps_high_is_neg)  # [B, T]
    return torch.where(advantages < 0, weight_neg, weight)  # sg(w_it)    [B, T]


def ppo_dropped(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
                halves: str = "both") -> torch.Tensor:
    """1 - M_it of eq. 7, as a bool [B, T]: A > 0 and r > 1 + eps_high (the upper half), or A < 0 and
    r < 1 - eps_low (the lower half); ``halves`` = ``both``, ``low`` or ``high``."""
    high = (advantages > 0) & (ratio > 1.0 + eps_high)  # [B, T]
    low = (advantages < 0) & (ratio < 1.0 - eps_low)  # [B, T]
    return {"both": high | low, "low": low, "high": high}[halves]


def ppo_token_mask(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """M_it of eq. 7: 0 where A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low; else 1.
    These are exactly the tokens whose gradient PPO's min(r*A, clip(r)*A) sets to zero."""
    return (~ppo_dropped(ratio, advantages, eps_low, eps_high)).to(ratio.dtype)  # M_it        [B, T]


def binary_kl(p_old: torch.Tensor, logp_old: torch.Tensor, logp_new: torch.Tensor) -> torch.Tensor:
    """D_KL(Bernoulli(p_old) || Bernoulli(p)) of each sampled token, p = pi_theta(o_it), p_old = pi_old(o_it)
    (DPPO's Binary-KL, arXiv 2602.04879), with verl's 1e-8 guard inside the second log:

        p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))     -> [B, T]"""
    p = torch.exp(logp_new)  # p            [B, T]
    return p_old * (logp_old - logp_new) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))


def dppo_dropped(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, delta_low: float,
                 delta_high: float, divergence: str = "tv") -> torch.Tensor:
    """1 - M_it of DPPO's divergence mask (arXiv 2602.04879; verl's ``dppo_tv`` / ``dppo_kl``), a bool [B, T]:
    the trust region on the probability p = pi_theta(o_it) itself, not on the ratio, one direction per sign:

        tv:  A > 0 and p - p_old > delta_high;    A <= 0 and p_old - p > delta_low
        kl:  A > 0 and p > p_old and D > delta_high;    A <= 0 and p < p_old and D > delta_low

    with D = ``binary_kl``. Written as verl writes it, as the complement of the kept tokens (so a NaN
    divergence, from a log-prob above 0, drops the token). Always per token (the mask of a sequence-level ratio
    too). Detached."""
    logp_new, logp_old = logp_new.detach(), logp_old.detach()
    p, p_old = torch.exp(logp_new), torch.exp(logp_old)  # p, p_old     [B, T]
    if divergence == "tv":
        keep_high = p - p_old <= delta_high  # [B, T]
        keep_low = p - p_old >= -delta_low  # [B, T]
    else:
        kl = binary_kl(p_old, logp_old, logp_new)  # D           [B, T]
        keep_high = (kl <= delta_high) | (p <= p_old)  # [B, T]
        keep_low = (kl <= delta_low) | (p >= p_old)  # [B, T]
    return ~torch.where(advantages > 0, keep_high, keep_low)  # [B, T]


def token_mask(ratio: torch.Tensor, advantages: torch.Tensor, cfg: ObjectiveConfig,
               logp_new: torch.Tensor | None = None, logp_old: torch.Tensor | None = None) -> torch.Tensor:
    """M_it of the config's mask rule: 1 (``none``), eq. 7 (``ppo``) or one half of it, or DPPO's
    (``dppo-tv``, ``dppo-kl``: on the probabilities, so it needs ``logp_new`` and ``logp_old`` [B, T])."""
    if cfg.mask_rule == "none":
        return torch.ones_like(ratio)  # M_it        [B, T]
    if cfg.mask_rule.startswith("dppo-"):
        if logp_new is None or logp_old is None:
            raise ValueError(f"mask_rule {cfg.mask_rule!r} needs logp_new and logp_old (a mask on the probabilities)")
        dropped = dppo_dropped(logp_new, logp_old, advantages, cfg.delta_low, cfg.delta_high, cfg.mask_rule[5:])
        return (~dropped).to(ratio.dtype)  # M_it        [B, T]
    halves = {"ppo": "both", "ppo-low": "low", "ppo-high": "high"}[cfg.mask_rule]
    return (~ppo_dropped(ratio, advantages, cfg.eps_low, cfg.eps_high, halves)).to(ratio.dtype)  # [B, T]


def aggregate(
    values: torch.Tensor,
    response_mask: torch.Tensor,
    aggregation: str,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    token_sum_norm: float | None = None,
    group_mean_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token values [B, T] to a scalar, counting only response tokens.

    token-mean:               sum_{i,t} x_it / num_tokens              (num_tokens = sum_i |o_i|)
    seq-mean-token-mean:      sum_i (sum_t x_it / |o_i|) / num_seqs
    seq-mean-token-sum-norm:  sum_{i,t} x_it / (num_seqs * token_sum_norm)
    prompt-mean-token-mean:   sum_i (sum_t x_it / Lbar_g(i)) / num_seqs
                              = (1/P) sum_g (sum_{i in g, t} x_it / sum_{j in g} |o_j|)   (whole batch, P prompts
                              of G rows, num_seqs = P G)

    ``group_mean_length`` [B]: Lbar_g(i) = mean_{j in g(i)} |o_j|, the mean response length of row i's
    group (prompt) over all its G responses, also those outside this call (``prompt-mean-token-mean``
    only). Pass the *global* ``num_tokens`` / ``num_seqs`` of the whole batch (all micro-batches, all
    ranks) and the sum of the parts' results equals the full batch's. Defaults: the local
    counts (sequences with at least one response token).
    """
    mask = response_mask.bool()  # [B, T]
    x = torch.where(mask, values, 0.0)  # [B, T]
    if aggregation == "token-mean":
        if num_tokens is None:
            num_tokens = mask.sum().clamp(min=1)
        return x.sum() / num_tokens
    lengths = mask.sum(-1)  # |o_i|       [B]
    if num_seqs is None:
        num_seqs = (lengths > 0).sum().clamp(min=1)
    if aggregation == "seq-mean-token-mean":
        return (x.sum(-1) / lengths.clamp(min=1)).sum() / num_seqs
    if aggregation == "seq-mean-token-sum-norm":
        norm = token_sum_norm if token_sum_norm is not None else values.shape[-1]
        return x.sum() / (num_seqs * norm)
    if aggregation == "prompt-mean-token-mean":
        lbar = _group_mean_length(group_mean_length, lengths, x.dtype)  # Lbar_g(i)   [B]
        return (x.sum(-1) / lbar).sum() / num_seqs
    raise ValueError(f"unknown aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")


def _group_mean_length(group_mean_length: torch.Tensor | None, lengths: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Lbar_g(i) [B] for ``prompt-mean-token-mean``, checked to be given and of shape [B] (``lengths``: |o_i|);
    1 where row i has no response token (such a row adds nothing)."""
    if group_mean_length is None:
        raise ValueError("aggregation 'prompt-mean-token-mean' needs group_mean_length: each row's mean response "
                         "length over its prompt's G responses, [B]")
    if group_mean_length.shape != lengths.shape:
        raise ValueError(f"group_mean_length must be [B] = {tuple(lengths.shape)}, "
                         f"got {tuple(group_mean_length.shape)}")
    return torch.where(lengths > 0, group_mean_length.to(dtype), 1.0)  # [B]


def kl_penalty(logp_new: torch.Tensor, logp_ref: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) on samples of pi_theta (Schulman 2020):
    k1 = log pi - log pi_ref;  k3 = r - 1 - log r with r = pi_ref / pi.  -> [B, T]"""
    log_r = logp_ref - logp_new  # log (pi_ref / pi)   [B, T]
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


def policy_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: ObjectiveConfig,
    num_tokens: float | torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    group_mean_length: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ObjectiveStats]:
    """loss = -agg( sg(w_it) * A_it * log pi_theta(o_it) * M_it ) + kl_coef * agg(KL_it) - entropy_coef * agg(H_it)
    (eq. 6 and the optional terms)

    Args:
        logp_new: [B, T] log pi_theta of the sampled tokens; carries the gradient.
        logp_old: [B, T] log pi_old of the same tokens (the policy that sampled them).
        advantages: [B] (one per response, broadcast over its tokens) or [B, T].
        response_mask: [B, T], 1 = a response token that counts, 0 = prompt/padding.
        cfg: the objective's settings, e.g. ``preset("cispo")``.
        num_tokens: global sum_i |o_i| for token-mean aggregation (default: local count).
        logp_ref: [B, T] log pi_ref, needed when cfg.kl_coef > 0.
        num_seqs: global number of sequences for the seq-mean and prompt-mean aggregations (default: local).
        group_mean_length: [B] each row's mean response length over its prompt's G responses
            (``prompt-mean-token-mean`` only; see ``aggregate``).
        entropy: [B, T] H_it, the full-vocabulary entropy of pi_theta at each token, carrying its gradient
            (``token_logprobs(..., with_entropy=True)``); needed when cfg.entropy_coef > 0.
    Returns:
        (loss, stats): the scalar loss to minimise and detached ``ObjectiveStats``.
    """
    _check_shapes(logp_new, logp_old, advantages, response_mask, logp_ref)
    if cfg.kl_coef > 0 and logp_ref is None:
        raise ValueError("policy_loss: cfg.kl_coef > 0 needs logp_ref (the reference policy's log-probs)")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("policy_loss: cfg.entropy_coef > 0 needs entropy (pi_theta's entropy per token, [B, T])")
    mask = response_mask.bool()  # [B, T]
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp_new)  # A_it        [B, T]
    advantages = advantages.to(logp_new.dtype)

    log_r = log_ratio(logp_new, logp_old, mask, cfg.ratio_level, cfg.max_log_ratio)  # [B, T]
    ratio = torch.exp(log_r)  # r_it (or s_i)    [B, T]
    weight = signed_is_weight(ratio, advantages, cfg)  # sg(w_it)         [B, T]
    ppo_mask = ppo_token_mask(ratio, advantages, cfg.eps_low, cfg.eps_high)  # [B, T]
    mask_it = token_mask(ratio, advantages, cfg, logp_new, logp_old)  # M_it             [B, T]

    logp = torch.where(mask, logp_new, 0.0)  # padding never reaches the graph   [B, T]
    per_token = weight * advantages * logp * mask_it  # eq. 6 term    [B, T]
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, token_sum_norm=cfg.token_sum_norm,
               group_mean_length=group_mean_length)
    pg_loss = -aggregate(per_token, mask, cfg.aggregation, **agg)

    kl = torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)
    if logp_ref is not None and cfg.kl_coef > 0:
        kl_tokens = kl_penalty(logp, torch.where(mask, logp_ref, 0.0), cfg.kl_estimator)  # [B, T]
        kl = aggregate(kl_tokens, mask, cfg.aggregation, **agg)
    loss = pg_loss + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * aggregate(torch.where(mask, entropy, 0.0), mask, cfg.aggregation, **agg)

    stats = _stats(loss, pg_loss, kl, ratio, log_r, weight, ppo_mask, mask_it, logp_old, mask, cfg)
    return loss, stats


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def _stats(loss, pg_loss, kl, ratio, log_r, weight, ppo_mask, mask_it, logp_old, mask, cfg) -> ObjectiveStats:
    """All diagnostics in one host transfer (one device sync)."""
    with torch.no_grad():
        n = mask.sum()
        n_safe = n.clamp(min=1)
        capped = weight != ratio  # the weight hit a bound of eq. 5 (its sign's, with is_bounds_by_sign)
        dropped = (ppo_mask == 0) & mask  # [B, T]
        low_prob = (logp_old < math.log(LOW_PROB)) & mask  # [B, T]
        n_low = low_prob.sum()
        big, small = torch.finfo(ratio.dtype).max, torch.finfo(ratio.dtype).min
        k3 = torch.where(mask, ratio - 1.0 - log_r, 0.0)  # [B, T]
        values = torch.stack(
            [
                loss.detach().float(),
                pg_loss.detach().float(),
                kl.detach().float(),
                ((capped & mask).sum() / n_safe).float(),
                (dropped.sum() / n_safe).float(),
                ((dropped & low_prob).sum() / n_low.clamp(min=1)).float(),
                (((mask_it == 0) & mask).sum() / n_safe).float(),
                (torch.where(mask, ratio, 0.0).sum() / n_safe).float(),
                torch.where(n > 0, torch.where(mask, ratio, big).min(), 1.0).float(),
                torch.where(n > 0, torch.where(mask, ratio, small).max(), 1.0).float(),
                (k3.sum() / n_safe).float(),
                n.float(),
                n_low.float(),
            ]
        ).tolist()
    kwargs = dict(zip(ObjectiveStats.SCALARS, values))
    kwargs["num_tokens"] = int(kwargs["num_tokens"])
    kwargs["num_low_prob_tokens"] = int(kwargs["num_low_prob_tokens"])
    return ObjectiveStats(**kwargs, capped=capped & mask, ppo_dropped=dropped, ratio=ratio.detach(),
                          weight=weight.detach())


def _check_shapes(logp_new, logp_old, advantages, response_mask, logp_ref) -> None:
    if logp_new.dim() != 2:
        raise ValueError(f"policy_loss: logp_new must be [B, T], got shape {tuple(logp_new.shape)}")
    shape = logp_new.shape
    for name, t in (("logp_old", logp_old), ("response_mask", response_mask), ("logp_ref", logp_ref)):
        if t is not None and t.shape != shape:
            raise ValueError(f"policy_loss: {name} must have logp_new's shape {tuple(shape)}, got {tuple(t.shape)}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(
            f"policy_loss: advantages must be [B] = {tuple(shape[:1])} or [B, T] = {tuple(shape)}, "
            f"got {tuple(advantages.shape)}"
        )
