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

    batch-raw-std  A_i = (R_i - mean_j R_j) / (std_raw + eps)  TRL's scale_rewards="batch": the std of the
            std_raw = std_k R_k                                raw rewards over all N rows of the batch

``std`` is the unbiased (Bessel-corrected) standard deviation, as in TRL and verl; ``std_batch`` is that of
the group-centred advantages over the batch (their mean over the batch is 0: each group's sum to 0), ``std_raw``
that of the rewards themselves (it also counts how far apart the groups' means are). Under data parallelism
pass the whole batch's scale (`batch_std` of every rank's sums, `raw_std` of theirs). A group whose rewards are
all equal carries no signal: its advantages are exactly 0 (never NaN), whatever the rounding of its mean.

    gdpo    several rewards r_ik (k = 1..K, weights w_k), each normalised in its group first:
            Rt_i = sum_k w_k (r_ik - mean_j r_jk) / (std_j r_jk + eps)      GDPO (arXiv 2601.05242), TRL's
            A_i  = (Rt_i - mean_batch Rt) / (std_batch Rt + eps)             multi_objective_aggregation=
                                                                             "normalize_then_sum"
            (``gdpo_advantages``: a reward that abstained on a response, NaN, is left out of its group's mean and
            std and adds nothing to Rt_i; one with fewer than two scores in a group adds nothing there either;
            a response every reward abstained on is left out of the batch's mean and std and gets 0: TRL's
            nanmean / nanstd / nansum, line for line)

A reward that is NaN marks a completion that could not be scored (every reward returned None: TRL's rule,
``GRPOTrainer``): it is left out of its group's mean, std and leave-one-out baseline and of the batch's std,
and its advantage is 0. A group with fewer than two scored rewards carries no signal either: advantages 0.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "drgrpo", "rloo", "batch-std", "batch-raw-std", "gdpo")
"""``gdpo`` reads each reward's score (`gdpo_advantages`), not the summed return `group_advantages` takes."""


def batch_std(sum_sq: float | torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """std_batch = sqrt( sum_sq / (count - 1) ): ``sum_sq`` = sum_k Ahat_k^2 of the group-centred advantages
    over the batch's ``count`` rows (summed over ranks under data parallelism); 0 for fewer than 2 rows."""
    sum_sq, count = torch.as_tensor(sum_sq, dtype=torch.float64), torch.as_tensor(count, dtype=torch.float64)
    return torch.where(count > 1, sum_sq / (count - 1).clamp(min=1), 0.0).sqrt()


def raw_std(total: float | torch.Tensor, total_sq: float | torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """std_raw = sqrt( (sum_k R_k^2 - (sum_k R_k)^2 / count) / (count - 1) ): the unbiased std of ``count``
    rewards from their sum and sum of squares (summed over ranks under data parallelism); 0 for fewer than 2."""
    total, total_sq = torch.as_tensor(total, dtype=torch.float64), torch.as_tensor(total_sq, dtype=torch.float64)
    count = torch.as_tensor(count, dtype=torch.float64)
    sum_sq = (total_sq - total.square() / count.clamp(min=1)).clamp(min=0)  # sum_k (R_k - mean R)^2
    return batch_std(sum_sq, count)


def group_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6,
    batch_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """rewards [N] (N = num_groups * G, group by group; NaN: not scored) -> advantages [N] (module docstring).

    ``batch_scale``: for ``batch-std`` / ``batch-raw-std``, the whole batch's std_batch / std_raw (`batch_std`,
    `raw_std`); None: that of ``rewards``. A group whose every reward is scored computes exactly what it did
    before NaN was read (the same operations, bit for bit)."""
    if estimator not in ESTIMATORS or estimator == "gdpo":
        raise ValueError(f"unknown advantage estimator {estimator!r}; known: {', '.join(ESTIMATORS[:-1])} "
                         "(gdpo reads each reward's score: gdpo_advantages)")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got shape {tuple(rewards.shape)}"
        )
    R = rewards.reshape(-1, group_size)  # R_i           [num_groups, G]
    scored = ~R.isnan()  # R_i is a number   [num_groups, G]
    n = scored.sum(-1, keepdim=True)  # the group's scored rewards   [num_groups, 1]
    full = n == group_size  # [num_groups, 1]
    total = torch.where(full, R.sum(-1, keepdim=True), torch.nan_to_num(R, nan=0.0).sum(-1, keepdim=True))  # sum_j
    mean = torch.where(full, R.mean(-1, keepdim=True), total / n.clamp(min=1))  # mean_j R_j    [num_groups, 1]
    R_in = torch.where(scored, R, mean)  # an unscored R_i as its group's mean: no weight in the sums   [num_groups, G]
    first = R.gather(-1, scored.long().argmax(-1, keepdim=True))  # a scored reward of the group   [num_groups, 1]
    constant = ((R_in == first).all(-1, keepdim=True)) | (n < 2)  # no signal   [num_groups, 1]
    if estimator == "grpo":  # std_j R_j over the n scored: the G - 1 of R_in's std rescaled to n - 1
        std = R_in.std(-1, keepdim=True) * ((group_size - 1) / (n - 1).clamp(min=1).to(R.dtype)).sqrt()
        A = (R_in - mean) / (std + eps)
    elif estimator == "drgrpo":
        A = R_in - mean
    elif estimator == "rloo":  # R_i - (sum_j R_j - R_i) / (n - 1)
        A = R_in - (total - R_in) / (n - 1).clamp(min=1)
    elif estimator == "batch-std":  # Ahat_i / (std_batch + eps)
        A = torch.where(constant, 0.0, R_in - mean)  # Ahat_i   [num_groups, G]
        std = batch_std(A.double().square().sum(), scored.sum()) if batch_scale is None else batch_scale
        A = A / (torch.as_tensor(std, dtype=A.dtype) + eps)
    else:  # batch-raw-std: Ahat_i / (std_raw + eps)
        kept = R[scored].double()  # the batch's scored R_k   [n]
        std = (kept.std() if kept.numel() > 1 else kept.new_zeros(())) if batch_scale is None else batch_scale
        A = (R_in - mean) / (torch.as_tensor(std, dtype=R.dtype) + eps)
    return torch.where(constant | ~scored, 0.0, A).reshape(-1)  # A_i   [N]


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The unbiased std of ``x`` over ``dim`` (all: None) leaving NaNs out, NaN where fewer than two numbers
    remain (TRL's ``trl.trainer.utils.nanstd``; keeps the reduced dim when ``dim`` is given)."""
    kw = dict(dim=dim, keepdim=True) if dim is not None else {}
    mean = torch.nanmean(x, **kw)
    count = (~x.isnan()).sum(**kw)
    var = torch.nanmean((x - mean) ** 2, **kw) * torch.where(count > 1, count / (count - 1).clamp(min=1), torch.nan)
    return var.sqrt()


def gdpo_rewards(parts: torch.Tensor, weights: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Rt_i = nansum_k w_k (r_ik - nanmean_j r_jk) / (nanstd_j r_jk + eps), j over i's group: each reward
    normalised within the group, then the weighted sum (module docstring, ``gdpo``).

    parts [N, K] (r_ik, group by group; NaN: reward k abstained on response i), weights [K]  -> [N], NaN where
    every reward abstained (TRL's "unscorable" completion)."""
    N, K = parts.shape
    if N % group_size != 0 or weights.shape != (K,):
        raise ValueError(f"parts must be [N, K] with N a multiple of group_size={group_size} and weights [K], got "
                         f"{tuple(parts.shape)} and {tuple(weights.shape)}")
    grouped = parts.reshape(-1, group_size, K)  # r_jk   [groups, G, K]
    z = (grouped - torch.nanmean(grouped, 1, keepdim=True)) / (nanstd(grouped, 1) + eps)  # [groups, G, K]
    summed = (z * weights.to(z.dtype)).nansum(-1).reshape(N)  # Rt_i   [N]
    return torch.where(parts.isnan().all(-1), torch.nan, summed)


def gdpo_advantages(parts: torch.Tensor, weights: torch.Tensor, group_size: int, eps: float = 1e-6,
                    batch_moments: tuple | None = None) -> torch.Tensor:
    """A_i = (Rt_i - mean Rt) / (std Rt + eps) over the batch (`gdpo_rewards`; NaN Rt left out of both, its
    A_i = 0).  -> [N]

    ``batch_moments``: (mean, std) of Rt over the whole batch under data parallelism (every rank's rows);
    None: those of this batch. TRL adds eps = 1e-4 to both stds; cispo's estimators 1e-6."""
    summed = gdpo_rewards(parts, weights, group_size, eps)  # Rt_i   [N]
    if batch_moments is None:
        mean = torch.nanmean(summed)
        std = nanstd(summed) if summed.numel() > 1 else summed.new_zeros(())
    else:
        mean, std = (torch.as_tensor(v, dtype=summed.dtype) for v in batch_moments)
    return torch.nan_to_num((summed - mean) / (std + eps), nan=0.0)  # A_i   [N]


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
    group (never rounding noise). With one segment each and no turn reward this is RLOO on the final reward.
    A NaN ``final_i`` (no reward scored episode i) leaves episode i out of the others' baselines and gives
    it advantage 0, as `group_advantages` does."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a leave-one-out baseline, got {group_size}")
    N, K = turn_rewards.shape
    if final.shape != (N,) or num_segments.shape != (N,) or N % group_size != 0:
        raise ValueError(f"turn_rewards [N, K] = {tuple(turn_rewards.shape)}, final {tuple(final.shape)} and "
                         f"num_segments {tuple(num_segments.shape)} must agree on N, a multiple of {group_size}")
    if bool((num_segments > K).any()):
        raise ValueError(f"num_segments must be <= K = {K} (turn_rewards' columns)")
    scored = ~final.isnan()  # final_i is a number (NaN: no reward scored episode i)   [N]
    G_ik = returns_to_go(turn_rewards, torch.nan_to_num(final, nan=0.0), num_segments)  # [N, K]
    G_ik = torch.where(scored[:, None], G_ik, 0.0).reshape(-1, group_size, K)  # [groups, G, K]
    v = scored.reshape(-1, group_size, 1)  # [groups, G, 1]
    others = v.sum(1, keepdim=True) - v.long()  # the scored episodes j != i   [groups, G, 1]
    baseline = (G_ik.sum(1, keepdim=True) - G_ik) / others.clamp(min=1)  # b_{i,k}            [groups, G, K]
    first = G_ik.gather(1, v.long().argmax(1, keepdim=True).expand(-1, 1, K))  # a scored episode's   [groups, 1, K]
    constant = ((G_ik == first) | ~v).all(1, keepdim=True)  # every scored G_{j,k} equal        [groups, 1, K]
    A = torch.where(constant | ~v | (others < 1), 0.0, G_ik - baseline).reshape(N, K)  # A_{i,k}   [N, K]
    alive = torch.arange(K, device=A.device) < num_segments[:, None]  # [N, K]
    return torch.where(alive, A, 0.0)


def segment_to_tokens(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each token's value from its segment's: values [N, K], index [N, T] (`segment_index`: -1 at tokens of
    no segment) -> [N, T], values[i, index[i, t]], 0 where index is -1."""
    if values.shape[1] == 0:
        return torch.zeros(index.shape, dtype=values.dtype, device=values.device)
    picked = values.gather(1, index.clamp(min=0))  # [N, T]
    return torch.where(index >= 0, picked, 0.0)
