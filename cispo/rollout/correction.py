"""Correction for the mismatch between the rollout engine and the training engine.

A fast rollout engine (vLLM: other kernels, bf16 logits, its own sampler) does not compute exactly the
probabilities the trainer computes for the same weights, so the responses are in fact sampled from a
slightly different policy pi_rollout, not from pi_old. Truncated importance sampling (TIS; Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training") reweights every token by the
ratio of the two, capped:

    w_it = min( pi_old(o_it) / pi_rollout(o_it), C )  = min( exp(logp_old - logp_rollout), C )

and multiplies it into the policy-gradient term of that token (a constant: no gradient flows through it).
In this library that is the advantage: ``A_it <- w_it * A_it`` before ``cispo.objective.loss.policy_loss``
(which accepts [B, T] advantages). ``w_it > 0``, so the sign of the advantage, and with it PPO's mask
rule, is unchanged.
"""

from __future__ import annotations

import math

import torch


def truncated_is_weights(
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
) -> torch.Tensor:
    """TIS weights ``min(exp(logp_old - logp_rollout), cap)`` per token, detached.   -> float32 [B, T]

    Args:
        logp_old: [B, T] the trainer's log-probs of the sampled tokens before the updates (``Experience.logp_old``).
        logp_rollout: [B, T] the rollout engine's log-probs of the same tokens (``RolloutBatch.logp_rollout``).
        response_mask: [B, T] 1 at response tokens, 0 at padding.
        cap: C > 0, the truncation (Yao et al. use 2; verl's ``tis_imp_ratio_cap`` defaults to 2).

    Returns:
        The weights, 0 at padding. The log-ratio is clamped at log(cap) before ``exp``, which is the same
        function (``exp`` is increasing) and never overflows.
    """
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"cap must be a finite number > 0, got {cap!r}")
    if logp_old.shape != logp_rollout.shape or logp_old.shape != response_mask.shape:
        raise ValueError(
            f"shape mismatch: logp_old {tuple(logp_old.shape)}, logp_rollout {tuple(logp_rollout.shape)}, "
            f"response_mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()  # [B, T]
    log_ratio = (logp_old.detach().float() - logp_rollout.detach().float()).clamp(max=math.log(cap))  # [B, T]
    return torch.where(mask, log_ratio.exp(), 0.0)  # [B, T]
