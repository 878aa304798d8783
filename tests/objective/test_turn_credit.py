"""Per-turn credit (`cispo.objective.advantages`: `reward_to_go`, `segment_index`, `segment_to_tokens`), pinned
by hand on a scripted group of three episodes with different numbers of turns, and the per-token gradient of
the objective with those advantages against its closed form."""

import math

import pytest
import torch

from cispo.objective.advantages import (
    group_advantages,
    returns_to_go,
    reward_to_go,
    segment_index,
    segment_to_tokens,
)
from cispo.objective.loss import policy_loss
from cispo.objective.presets import preset

# One group, G = 3. Each episode's policy segments (turns) k, the environment's reward of each, the final reward.
#   episode 0: 3 turns, r = [1, 0, 2], final 2
#   episode 1: 2 turns, r = [0, 2],    final 1   (it stopped after turn 1)
#   episode 2: 3 turns, r = [2, -1],   final 0   (cut by the length limit in its third turn: no reward for it)
TURN_REWARDS = torch.tensor([[1.0, 0.0, 2.0], [0.0, 2.0, 0.0], [2.0, -1.0, 0.0]], dtype=torch.float64)
FINAL = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64)
NUM_SEGMENTS = torch.tensor([3, 2, 3])

# G_{i,k} = sum_{j >= k} r_{i,j} + final_i, 0 once the episode has ended:
#   episode 0: (1+0+2+2, 0+2+2, 2+2) = (5, 4, 4)
#   episode 1: (0+2+1,   2+1,   0)   = (3, 3, 0)
#   episode 2: (2-1+0,   -1+0,  0+0) = (1, -1, 0)
RETURNS_TO_GO = [[5.0, 4.0, 4.0], [3.0, 3.0, 0.0], [1.0, -1.0, 0.0]]

# A_{i,k} = G_{i,k} - (sum_{j != i} G_{j,k}) / 2:
#   k = 0, column (5, 3, 1):  5 - (3+1)/2 = 3;   3 - (5+1)/2 = 0;    1 - (5+3)/2 = -3
#   k = 1, column (4, 3, -1): 4 - (3-1)/2 = 3;   3 - (4-1)/2 = 1.5;  -1 - (4+3)/2 = -4.5
#   k = 2, column (4, 0, 0):  4 - (0+0)/2 = 4;   episode 1 has no turn 2: 0;  0 - (4+0)/2 = -2
REWARD_TO_GO = [[3.0, 3.0, 4.0], [0.0, 1.5, 0.0], [-3.0, -4.5, -2.0]]

# Episode credit: the returns R_i = final + sum of the turn rewards = G_{i,0} = (5, 3, 1), one advantage each.
#   rloo:   5 - (3+1)/2 = 3;  3 - (5+1)/2 = 0;  1 - (5+3)/2 = -3
#   grpo:   mean 3, std = sqrt(((5-3)^2 + 0 + (1-3)^2) / 2) = 2  ->  (2, 0, -2) / (2 + 1e-6)
RETURNS = [5.0, 3.0, 1.0]
EPISODE_RLOO = [3.0, 0.0, -3.0]
EPISODE_GRPO = [2 / (2 + 1e-6), 0.0, -2 / (2 + 1e-6)]

# Token layout of each response (p: the policy's, e: the environment's observation), right-padded to T = 9:
#   episode 0: p p e p e e p p p
#   episode 1: p e p p . . . . .     (padding counts as no segment)
#   episode 2: p p e p e p p . .
ENV_MASK = torch.tensor([[0, 0, 1, 0, 1, 1, 0, 0, 0],
                         [0, 1, 0, 0, 1, 1, 1, 1, 1],
                         [0, 0, 1, 0, 1, 0, 0, 1, 1]])
SEGMENT_INDEX = [[0, 0, -1, 1, -1, -1, 2, 2, 2],
                 [0, -1, 1, 1, -1, -1, -1, -1, -1],
                 [0, 0, -1, 1, -1, 2, 2, -1, -1]]
# each policy token carries its segment's A_{i,k}, every other column 0
TOKEN_ADVANTAGES = [[3.0, 3.0, 0.0, 3.0, 0.0, 0.0, 4.0, 4.0, 4.0],
                    [0.0, 0.0, 1.5, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0],
                    [-3.0, -3.0, 0.0, -4.5, 0.0, -2.0, -2.0, 0.0, 0.0]]


def test_returns_to_go_by_hand():
    assert returns_to_go(TURN_REWARDS, FINAL, NUM_SEGMENTS).tolist() == RETURNS_TO_GO


def test_reward_to_go_advantages_by_hand():
    assert reward_to_go(TURN_REWARDS, FINAL, NUM_SEGMENTS, 3).tolist() == REWARD_TO_GO


def test_episode_credit_advantages_by_hand():
    R = TURN_REWARDS.sum(-1) + FINAL  # the padded entries are 0
    assert R.tolist() == RETURNS
    assert group_advantages(R, 3, "rloo").tolist() == EPISODE_RLOO
    torch.testing.assert_close(group_advantages(R, 3, "grpo"), torch.tensor(EPISODE_GRPO, dtype=torch.float64))
    # with one turn each and no turn reward, reward_to_go is RLOO on the final reward
    one = torch.ones(3, dtype=torch.long)
    assert reward_to_go(torch.zeros(3, 1, dtype=torch.float64), R, one, 3)[:, 0].tolist() == EPISODE_RLOO


def test_segments_and_their_tokens():
    index = segment_index(ENV_MASK)
    assert index.tolist() == SEGMENT_INDEX
    assert segment_index(ENV_MASK[0]).tolist() == SEGMENT_INDEX[0]  # one row, [T]
    A = reward_to_go(TURN_REWARDS, FINAL, NUM_SEGMENTS, 3)
    assert segment_to_tokens(A, index).tolist() == TOKEN_ADVANTAGES


def test_equal_turns_give_exact_zeros_and_bad_shapes_are_refused():
    # the same returns to go in every turn: no signal, exactly 0 (never rounding noise)
    r = torch.tensor([[0.1, 0.2]] * 3, dtype=torch.float64)
    A = reward_to_go(r, torch.full((3,), 0.7, dtype=torch.float64), torch.tensor([2, 2, 2]), 3)
    assert A.eq(0).all()
    with pytest.raises(ValueError, match="group_size"):
        reward_to_go(TURN_REWARDS, FINAL, NUM_SEGMENTS, 1)
    with pytest.raises(ValueError, match="multiple of 2"):
        reward_to_go(TURN_REWARDS, FINAL, NUM_SEGMENTS, 2)
    with pytest.raises(ValueError, match="num_segments"):
        reward_to_go(TURN_REWARDS, FINAL, torch.tensor([4, 2, 3]), 3)


def test_the_baseline_of_an_episode_is_free_of_its_own_turns():
    """b_{i,k} reads only the other episodes: changing episode 0's rewards, or making it stop earlier, leaves
    the others' G_{j,k} and so episode 0's baseline unchanged (what makes the estimator unbiased)."""
    base = reward_to_go(TURN_REWARDS, FINAL, NUM_SEGMENTS, 3)
    G = returns_to_go(TURN_REWARDS, FINAL, NUM_SEGMENTS)
    b0 = G[0] - base[0]  # b_{0,k}
    shorter = NUM_SEGMENTS.clone()
    shorter[0] = 1  # episode 0 stops after its first turn
    other = TURN_REWARDS.clone()
    other[0] = torch.tensor([7.0, 0.0, 0.0])
    G2 = returns_to_go(other, FINAL, shorter)
    A2 = reward_to_go(other, FINAL, shorter, 3)
    assert (G2[0, :1] - A2[0, :1]).tolist() == b0[:1].tolist() == [2.0]  # (3 + 1) / 2


# ---------------------------------------------------------------------------------------
# The per-token gradient with per-turn advantages
# ---------------------------------------------------------------------------------------


def _grad(name, log_ratio):
    """d loss / d log pi_theta of every token, with the per-token advantages above and logp_old = logp_new -
    log_ratio (so r_it = exp(log_ratio))."""
    mask = (1 - ENV_MASK).double()  # response_mask: the policy's tokens (ENV_MASK is 1 at the padding)   [3, 9]
    lp = (-1.0 - 0.1 * torch.arange(27, dtype=torch.float64).reshape(3, 9)).requires_grad_(True)
    old = (lp.detach() - log_ratio) * mask
    A = torch.tensor(TOKEN_ADVANTAGES, dtype=torch.float64)
    loss, _ = policy_loss(lp, old, A, mask, preset(name))
    loss.backward()
    return lp.grad, A, mask


# r_it: off-policy enough that CISPO's cap (5) and PPO's trust region (0.8, 1.2) bite on some tokens
LOG_RATIO = torch.tensor([[2.0, 0.1, 0.0, -0.5, 0.0, 0.0, 0.3, 0.0, -2.0],
                          [0.0, 0.0, 0.5, -0.1, 0.0, 0.0, 0.0, 0.0, 0.0],
                          [2.0, -0.5, 0.0, 0.1, 0.0, -0.05, 0.4, 0.0, 0.0]], dtype=torch.float64)


def test_cispo_per_token_gradient_with_reward_to_go_advantages():
    """CISPO: d loss / d log pi_it = -sg(w_it) A_{i,k(t)} / N, w_it = min(r_it, 5), N = 6 + 3 + 5 = 14 policy
    tokens; 0 at
    the environment's tokens and the padding."""
    grad, A, mask = _grad("cispo", LOG_RATIO)
    w = LOG_RATIO.exp().clamp(max=5.0)
    assert int(mask.sum()) == 14
    torch.testing.assert_close(grad, -w * A * mask / 14, rtol=1e-12, atol=1e-15)
    # by hand, three tokens: row 0 col 0: r = e^2 = 7.39 capped at 5, A = 3 -> -5 * 3 / 14 = -15/14
    #                        row 0 col 8: r = e^-2, A = 4 -> -e^-2 * 4 / 14;  row 2 col 5: r = e^-0.05, A = -2
    assert grad[0, 0].item() == pytest.approx(-15 / 14, abs=1e-12)
    assert grad[0, 8].item() == pytest.approx(-math.exp(-2) * 4 / 14, abs=1e-12)
    assert grad[2, 5].item() == pytest.approx(math.exp(-0.05) * 2 / 14, abs=1e-12)
    assert grad[(mask == 0)].eq(0).all()


def test_ppo_masks_each_token_by_its_own_turns_sign():
    """PPO: -r_it A_it M_it / N with M_it from the token's own advantage: the turn with A > 0 and r > 1.2 is
    dropped (row 0 col 0, A = 3), the one with A < 0 and r > 1.2 kept (row 2 col 0, A = -3, r = e^2)."""
    grad, A, mask = _grad("ppo", LOG_RATIO)
    r = LOG_RATIO.exp()
    M = ~(((A > 0) & (r > 1.2)) | ((A < 0) & (r < 0.8)))
    torch.testing.assert_close(grad, -r * A * M * mask / 14, rtol=1e-12, atol=1e-15)
    assert grad[0, 0].item() == 0.0
    assert grad[2, 0].item() == pytest.approx(math.exp(2.0) * 3 / 14, abs=1e-12)
