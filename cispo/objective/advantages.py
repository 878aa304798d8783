"""Group-relative advantages: one scalar per response, computed within its prompt's group.

Rewards are laid out group by group: rows [g*G, (g+1)*G) are the G responses to prompt g.

    grpo    A_i = (R_i - mean_j R_j) / (std_j R_j + eps)       DeepSeekMath (arXiv 2402.03300)
    drgrpo  A_i =  R_i - mean_j R_j                            Dr. GRPO (arXiv 2503.20783)
    rloo    A_i =  R_i - mean_{j != i} R_j                     RLOO (arXiv 2402.14740)
            = G / (G - 1) * (R_i - mean_j R_j)
    batch-std  A_i = (R_i - mean_j R_j) / (std_batch + eps)    ScaleRL (arXiv 2510.13786), batch-level
            std_batch = sqrt( sum_k Ahat_k^2 / (N - 1) )       normalisation: Ahat_k = R_k - mean of k's group,
                                                               over all N rows of the batch (every group)

``std`` is the unbiased (Bessel-corrected) standard deviation, as in TRL and verl; ``std_batch`` is that of
the group-centred advantages over the batch (their mean over the batch is 0: each group's sum to 0). Under
data parallelism pass the whole batch's ``batch_std`` (`batch_std` of every rank's sums). A group whose
rewards are all equal carries no signal: its advantages are exactly 0 (never NaN), whatever the rounding of
its mean.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "drgrpo", "rloo", "batch-std")


def batch_std(sum_sq: float | torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """std_batch = sqrt( sum_sq / (count - 1) ): ``sum_sq`` = sum_k Ahat_k^2 of the group-centred advantages
    over the batch's ``count`` rows (summed over ranks under data parallelism); 0 for fewer than 2 rows."""
    sum_sq, count = torch.as_tensor(sum_sq, dtype=torch.float64), torch.as_tensor(count, dtype=torch.float64)
    return torch.where(count > 1, sum_sq / (count - 1).clamp(min=1), 0.0).sqrt()


def group_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6,
    batch_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """rewards [N] (N = num_groups * G, group by group) -> advantages [N] (see module docstring).

    ``batch_scale``: for ``batch-std``, the whole batch's std_batch (`batch_std`); None: that of ``rewards``."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; known: {', '.join(ESTIMATORS)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got shape {tuple(rewards.shape)}"
        )
    R = rewards.reshape(-1, group_size)  # R_i           [num_groups, G]
    mean = R.mean(-1, keepdim=True)  # mean_j R_j    [num_groups, 1]
    constant = (R == R[:, :1]).all(-1, keepdim=True)  # all rewards equal   [num_groups, 1]
    if estimator == "grpo":
        A = (R - mean) / (R.std(-1, keepdim=True) + eps)
    elif estimator == "drgrpo":
        A = R - mean
    elif estimator == "rloo":  # R_i - (sum_j R_j - R_i) / (G - 1)
        A = R - (R.sum(-1, keepdim=True) - R) / (group_size - 1)
    else:  # batch-std: Ahat_i / (std_batch + eps)
        A = torch.where(constant, 0.0, R - mean)  # Ahat_i   [num_groups, G]
        std = batch_std(A.double().square().sum(), A.numel()) if batch_scale is None else batch_scale
        A = A / (torch.as_tensor(std, dtype=A.dtype) + eps)
    return torch.where(constant, 0.0, A).reshape(-1)  # A_i   [N]
