"""Correction for the mismatch between the rollout engine and the training engine.

A fast rollout engine (vLLM: other kernels, bf16 logits, its own sampler) does not compute exactly the
probabilities the trainer computes for the same weights, so the responses are in fact sampled from a
slightly different policy pi_rollout, not from pi_old. Importance sampling against that gap reweights
every response token by a function of the ratio of the two, computed once per generation batch from
the trainer's recomputed log pi_old and the sampler's own log-probs:

    log rho_it = logp_old_it - logp_rollout_it                    log(pi_old / pi_rollout)

    level      token             rho_it                                        (each token its own)
               seq-mean          rho_i = exp( mean_t log rho_it )              (the geometric mean over o_i:
                                                                                GSPO's length normalisation,
                                                                                verl's seq_mean_k1 "Geo")
               seq-sum           rho_i = exp( sum_t log rho_it )               (the product: TRL's and verl's
                                                                                "sequence" level)
    mode       truncate          c = clip(rho, lower, upper)                   (TIS: Yao et al. 2025)
               mask              c = rho * 1[lower <= rho <= upper]            (MIS; IcePop's M(k), Ring-1T,
                                                                                arXiv 2510.18855)
               reject            c = 1[lower <= rho <= upper]                  (rejection, no reweighting:
                                                                                verl's rollout_rs k1 modes)
               reject-k2         c = 1[D <= max_divergence],  d_it = (log rho_it)^2 / 2
               reject-k3         c = 1[D <= max_divergence],  d_it = rho_it - 1 - log rho_it
                                 (verl's token_k2 / k3, seq_mean_k2 / k3, seq_sum_k2 / k3: D = d_it at level
                                 token, mean_t d_it at seq-mean, sum_t d_it at seq-sum; the bounds lower / upper
                                 are not used)

(a bound that is None is absent: no clip, no mask on that side). The weight c_it is a constant (no
gradient flows through it) that the trainer multiplies into the policy-gradient term of that token:
``A_it <- c_it * A_it`` before ``cispo.objective.loss.policy_loss`` (which accepts [B, T] advantages).
``c_it >= 0``, so the sign of an advantage, and with it PPO's mask rule, is unchanged; a masked token
(c = 0) still counts in the aggregation's token / sequence counts (as in TRL and verl).

``truncated_is_weights`` is the token / truncate case with only an upper bound, ``algo.tis_cap``.

Departures, in plain words:

1. The log-ratio (after the level's mean or sum) is clamped to +-``max_log_ratio`` (20) before ``exp``,
   as verl's ``SAFETY_BOUND``: finite weights; inside that range nothing changes. The bounds are compared
   in log space, before the clamp.
2. A token whose sampler log-prob is NaN (vLLM could not score it) has log rho = 0, as in TRL 1.16: its own
   weight is 1 (no correction) and it adds nothing to its sequence's mean or sum, while it still counts
   among the tokens (the mean's count, the aggregation's). ``rollout/logp_rollout_nan`` counts them
   (``cispo.training.metrics.batch_metrics``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IS_LEVELS = ("token", "seq-mean", "seq-sum")
IS_MODES = ("truncate", "mask", "reject", "reject-k2", "reject-k3")
DIVERGENCE_MODES = ("reject-k2", "reject-k3")  # reject on a divergence estimate of rho, not on rho's bounds


@dataclass(frozen=True)
class RolloutWeights:
    """The correction of one generation batch: ``weight`` c_it [B, T] (detached, 0 at padding) and the
    per-token flags behind its metrics, response tokens only: ``masked`` [B, T] bool (rho outside
    [lower, upper] under ``mask`` / ``reject``: c = 0) and ``truncated`` [B, T] bool (rho clipped to a
    bound under ``truncate``)."""

    weight: torch.Tensor
    masked: torch.Tensor
    truncated: torch.Tensor

    def metrics(self, response_mask: torch.Tensor) -> dict[str, float]:
        """``rollout/is_weight_mean``, ``rollout/is_masked``, ``rollout/is_truncated``: the mean weight and
        the shares of response tokens masked / truncated (NaN with no response token)."""
        mask = response_mask.bool()  # [B, T]
        n = int(mask.sum())
        if n == 0:
            return {"rollout/is_weight_mean": math.nan, "rollout/is_masked": math.nan, "rollout/is_truncated": math.nan}
        return {"rollout/is_weight_mean": float(self.weight[mask].double().mean()),
                "rollout/is_masked": float(self.masked.sum()) / n,
                "rollout/is_truncated": float(self.truncated.sum()) / n}


def _check_bound(name: str, value: float | None, positive: bool) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'} or None, got {value!r}")


def rollout_is_weights(
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    lower: float | None = None,
    upper: float | None = 2.0,
    max_log_ratio: float = 20.0,
    max_divergence: float | None = None,
) -> RolloutWeights:
    """c_it = f(rho) of the module docstring, rho = pi_old / pi_rollout at ``level``, f the ``mode`` with the
    bounds ``[lower, upper]`` (None: no bound on that side).   -> RolloutWeights, weight float32 [B, T]

    Args:
        logp_old: [B, T] the trainer's log-probs of the sampled tokens before the updates (``Experience.logp_old``).
        logp_rollout: [B, T] the rollout engine's log-probs of the same tokens (``RolloutBatch.logp_rollout``).
        response_mask: [B, T] 1 at response tokens, 0 at padding.
        level: ``token``, ``seq-mean`` (geometric mean) or ``seq-sum`` (product).
        mode: ``truncate``, ``mask`` or ``reject``.
        lower, upper: the bounds, 0 <= lower < upper; at least one of them (not used by ``reject-k2`` /
            ``reject-k3``).
        max_divergence: the threshold of ``reject-k2`` / ``reject-k3`` (> 0; verl's ``rollout_rs_threshold``).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {IS_LEVELS}, got {level!r}")
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    if mode in DIVERGENCE_MODES:
        return _divergence_rejection(logp_old, logp_rollout, response_mask, level, mode, max_divergence,
                                     max_log_ratio)
    _check_bound("lower", lower, positive=False)
    _check_bound("upper", upper, positive=True)
    if lower is None and upper is None:
        raise ValueError("a rollout correction needs a bound: lower, upper or both")
    if lower is not None and upper is not None and not lower < upper:
        raise ValueError(f"lower must be < upper, got lower={lower}, upper={upper}")
    if logp_old.shape != logp_rollout.shape or logp_old.shape != response_mask.shape:
        raise ValueError(
            f"shape mismatch: logp_old {tuple(logp_old.shape)}, logp_rollout {tuple(logp_rollout.shape)}, "
            f"response_mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()  # [B, T]
    log_rho = torch.where(mask, logp_old.detach().double() - logp_rollout.detach().double(), 0.0)  # log rho_it  [B, T]
    log_rho = torch.nan_to_num(log_rho, nan=0.0)  # a NaN sampler log-prob: rho_it = 1 (departure 2)   [B, T]
    if level != "token":
        log_seq = log_rho.sum(-1, keepdim=True)  # sum_t log rho_it   [B, 1]
        if level == "seq-mean":
            log_seq = log_seq / mask.sum(-1, keepdim=True).clamp(min=1)  # mean_t log rho_it   [B, 1]
        log_rho = log_seq.expand_as(log_rho)  # log rho_i, shared by the tokens of o_i   [B, T]
    below = mask & (log_rho < math.log(lower)) if lower else torch.zeros_like(mask)  # rho < lower    [B, T]
    above = mask & (log_rho > math.log(upper)) if upper is not None else torch.zeros_like(mask)  # rho > upper  [B, T]
    rho = log_rho.clamp(-max_log_ratio, max_log_ratio).exp()  # rho   [B, T]
    outside = below | above  # [B, T]
    if mode == "truncate":
        weight = rho.clamp(min=lower, max=upper)  # clip(rho, lower, upper)   [B, T]
    elif mode == "mask":
        weight = torch.where(outside, 0.0, rho)  # rho * 1[lower <= rho <= upper]   [B, T]
    else:
        weight = (~outside).double()  # 1[lower <= rho <= upper]   [B, T]
    weight = torch.where(mask, weight, 0.0).float()  # c_it, 0 at padding   [B, T]
    masked = outside if mode != "truncate" else torch.zeros_like(mask)
    truncated = outside if mode == "truncate" else torch.zeros_like(mask)
    return RolloutWeights(weight, masked, truncated)


def _divergence_rejection(logp_old, logp_rollout, response_mask, level: str, mode: str,
                          max_divergence: float | None, max_log_ratio: float) -> RolloutWeights:
    """c_it = 1[D <= max_divergence] of ``reject-k2`` / ``reject-k3`` (module docstring), as verl's
    ``compute_rollout_rejection_mask`` computes its k2 / k3 options: log rho clamped to +-``max_log_ratio`` first
    (verl's SAFETY_BOUND, 20), then d_it = (log rho)^2 / 2 or rho - 1 - log rho, then the level's mean or sum over
    the response tokens of o_i.   -> RolloutWeights, weight float32 [B, T]"""
    if max_divergence is None:
        raise ValueError(f"mode {mode!r} needs max_divergence (the threshold of its divergence estimate)")
    _check_bound("max_divergence", max_divergence, positive=True)
    if logp_old.shape != logp_rollout.shape or logp_old.shape != response_mask.shape:
        raise ValueError(f"shape mismatch: logp_old {tuple(logp_old.shape)}, logp_rollout "
                         f"{tuple(logp_rollout.shape)}, response_mask {tuple(response_mask.shape)}")
    mask = response_mask.bool()  # [B, T]
    log_rho = torch.where(mask, logp_old.detach().double() - logp_rollout.detach().double(), 0.0)  # [B, T]
    log_rho = torch.nan_to_num(log_rho, nan=0.0).clamp(-max_log_ratio, max_log_ratio)  # log rho_it  [B, T]
    if mode == "reject-k2":
        d = 0.5 * log_rho.square()  # d_it = (log rho)^2 / 2   [B, T]
    else:
        d = log_rho.exp() - 1.0 - log_rho  # d_it = rho - 1 - log rho   [B, T]
    d = torch.where(mask, d, 0.0)  # [B, T]
    if level != "token":
        d_seq = d.sum(-1, keepdim=True)  # sum_t d_it   [B, 1]
        if level == "seq-mean":
            d_seq = d_seq / mask.sum(-1, keepdim=True).clamp(min=1)  # mean_t d_it   [B, 1]
        d = d_seq.expand_as(d)  # D_i, shared by the tokens of o_i   [B, T]
    outside = mask & (d > max_divergence)  # rejected   [B, T]
    weight = torch.where(mask & ~outside, 1.0, 0.0).float()  # c_it   [B, T]
    return RolloutWeights(weight, outside, torch.zeros_like(mask))


def truncated_is_weights(
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
) -> torch.Tensor:
    """TIS weights ``min(exp(logp_old - logp_rollout), cap)`` per token, detached (``rollout_is_weights`` at
    level ``token``, mode ``truncate``, ``upper = cap``; ``algo.tis_cap``).   -> float32 [B, T]

    Args:
        logp_old: [B, T] the trainer's log-probs of the sampled tokens before the updates (``Experience.logp_old``).
        logp_rollout: [B, T] the rollout engine's log-probs of the same tokens (``RolloutBatch.logp_rollout``).
        response_mask: [B, T] 1 at response tokens, 0 at padding.
        cap: C > 0, the truncation (Yao et al. use 2; verl's ``tis_imp_ratio_cap`` defaults to 2).

    Returns:
        The weights, 0 at padding; finite however large the ratio.
    """
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")
    return rollout_is_weights(logp_old, logp_rollout, response_mask, "token", "truncate", None, cap).weight
