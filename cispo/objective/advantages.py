"""Group-relative advantages: one scalar per response, computed within its prompt's group; and per-turn
credit for multi-turn episodes whose environment rewards each turn (`reward_to_go`, below: one advantage per
policy segment, with a leave-one-out baseline over turn index).

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


# ---------------------------------------------------------------------------------------
# Per-turn credit: multi-turn episodes whose environment rewards each policy turn
# ---------------------------------------------------------------------------------------
#
# Episode i of a group of G has n_i policy segments (turns) k = 0 .. n_i - 1, a reward r_{i,k} for each
# (0 where the environment gave none) and a final reward final_i (the task's score of the whole episode).
#
#     G_{i,k} = sum_{j >= k} r_{i,j} + final_i        k < n_i  (reward to go; the final reward counts
#             = 0                                      k >= n_i  toward the last segment)
#     b_{i,k} = 1/(G-1) sum_{j != i} G_{j,k}                    (leave-one-out, over turn index k)
#     A_{i,k} = G_{i,k} - b_{i,k}
#
# b_{i,k} is built from the other episodes only, which were sampled independently of episode i, so it
# does not depend on i's actions (also not on its choice to stop before turn k: an episode that ended
# counts 0 in the others' baselines, it is not left out of them): E[b_{i,k} grad log pi(segment i,k)] = 0
# and the estimator is unbiased whatever the numbers of turns. Dividing by a number of turns, or averaging
# the baseline over the episodes still alive at turn k, would make it depend on that choice (biased).
# No standard-deviation scaling: a std over the group, taken per turn, would also depend on i's own return.


def segment_index(env_mask: torch.Tensor) -> torch.Tensor:
    """env_mask [..., T] (1 at the environment's tokens, 0 at the policy's) -> [..., T] long: k at each token of
    the k-th policy segment (the k-th maximal run of env_mask == 0, counted from 0), -1 at the environment's."""
    policy = env_mask == 0  # [..., T]
    before = torch.cat([torch.zeros_like(policy[..., :1]), policy[..., :-1]], dim=-1)  # the token before   [..., T]
    k = (policy & ~before).long().cumsum(-1) - 1  # segments started so far, minus one   [..., T]
    return torch.where(policy, k, -1)


def returns_to_go(turn_rewards: torch.Tensor, final: torch.Tensor, num_segments: torch.Tensor) -> torch.Tensor:
    """G_{i,k} = sum_{j >= k} r_{i,j} + final_i for k < n_i, 0 for k >= n_i (see above).

    turn_rewards [N, K] (entries at k >= n_i are ignored), final [N], num_segments [N] (n_i <= K) -> [N, K]"""
    K = turn_rewards.shape[-1]
    alive = torch.arange(K, device=turn_rewards.device) < num_segments[:, None]  # k < n_i         [N, K]
    r = torch.where(alive, turn_rewards, 0.0)  # r_{i,k}                                             [N, K]
    tail = r.flip(-1).cumsum(-1).flip(-1)  # sum_{j >= k} r_{i,j}                                    [N, K]
    return torch.where(alive, tail + final[:, None], 0.0)  # G_{i,k}                                 [N, K]


def reward_to_go(turn_rewards: torch.Tensor, final: torch.Tensor, num_segments: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """A_{i,k} = G_{i,k} - 1/(G-1) sum_{j != i} G_{j,k}: each policy segment's advantage (see above).

    Rows laid out group by group as `group_advantages`'. turn_rewards [N, K], final [N], num_segments [N]
    -> [N, K]: 0 at k >= n_i (no such segment), and exactly 0 in a turn whose G_{j,k} are equal over the
    group (never rounding noise). With one segment each and no turn reward this is RLOO on the final reward."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a leave-one-out baseline, got {group_size}")
    N, K = turn_rewards.shape
    if final.shape != (N,) or num_segments.shape != (N,) or N % group_size != 0:
        raise ValueError(f"turn_rewards [N, K] = {tuple(turn_rewards.shape)}, final {tuple(final.shape)} and "
                         f"num_segments {tuple(num_segments.shape)} must agree on N, a multiple of {group_size}")
    if bool((num_segments > K).any()):
        raise ValueError(f"num_segments must be <= K = {K} (turn_rewards' columns)")
    G_ik = returns_to_go(turn_rewards, final, num_segments).reshape(-1, group_size, K)  # [groups, G, K]
    baseline = (G_ik.sum(1, keepdim=True) - G_ik) / (group_size - 1)  # b_{i,k}            [groups, G, K]
    constant = (G_ik == G_ik[:, :1]).all(1, keepdim=True)  # every G_{j,k} equal        [groups, 1, K]
    A = torch.where(constant, 0.0, G_ik - baseline).reshape(N, K)  # A_{i,k}           [N, K]
    alive = torch.arange(K, device=A.device) < num_segments[:, None]  # [N, K]
    return torch.where(alive, A, 0.0)


def segment_to_tokens(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each token's value from its segment's: values [N, K], index [N, T] (`segment_index`: -1 at tokens of
    no segment) -> [N, T], values[i, index[i, t]], 0 where index is -1."""
    if values.shape[1] == 0:
        return torch.zeros(index.shape, dtype=values.dtype, device=values.device)
    picked = values.gather(1, index.clamp(min=0))  # [N, T]
    return torch.where(index >= 0, picked, 0.0)
