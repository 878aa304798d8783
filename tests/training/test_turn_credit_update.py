"""``algo.turn_credit`` in the trainer: scripted multi-turn Completions (the environment's ``turn_rewards`` in
their ``episode`` records) become the hand-computed advantages of tests/objective/test_turn_credit.py, per
token under ``reward_to_go``; the trainer's update (micro-batches, the fused head, a rollout correction)
follows the closed-form gradient; ``episode`` credit without turn rewards is the old batch bit for bit."""

import pytest
import torch

from cispo.config.train import TrainConfig, apply_overrides
from cispo.foundations.experience import Completion, is_informative
from cispo.objective.advantages import group_advantages
from cispo.objective.loss import preset
from cispo.records.samples import row_advantages
from cispo.training.credit import batch_advantages, informative_test, turn_inputs
from tests.objective.test_turn_credit import EPISODE_GRPO, EPISODE_RLOO, TOKEN_ADVANTAGES

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def episode(layout, final, turn_rewards=None, finish="eos", seed=0):
    """A Completion whose response follows ``layout`` ("p" the policy's token, "e" the environment's), with the
    environment's ``turn_rewards`` (None: the record has none) and the final ``reward``."""
    g = torch.Generator().manual_seed(seed)
    env = torch.tensor([float(ch == "e") for ch in layout])
    record = {"tool_calls": layout.count("e")} if turn_rewards is None else {"turn_rewards": turn_rewards}
    return Completion({"prompt": "p"}, torch.randint(3, 12, (2 + seed % 3,), generator=g).tolist(),
                      torch.randint(3, 12, (len(layout),), generator=g), torch.zeros(len(layout)), finish, "",
                      task_reward=final, reward=final, env_mask=env, episode=record)


# The scripted group of tests/objective/test_turn_credit.py as Completions: the same layouts, rewards and finals.
SCRIPTED = [episode("ppepeeppp", 2.0, [1.0, 0.0, 2.0], seed=1),
            episode("pepp", 1.0, [0.0, 2.0], seed=2),
            episode("ppepepp", 0.0, [2.0, -1.0], finish="length", seed=3)]  # cut in its third turn


def algo(*overrides):
    return apply_overrides(TrainConfig(), ["group_size=3", *overrides]).algo


def test_turn_rewards_become_the_hand_computed_advantages():
    rtg = batch_advantages([SCRIPTED], algo("algo.turn_credit=reward_to_go", "advantage_estimator=rloo"))
    assert rtg.shape == (3, 9) and rtg.tolist() == TOKEN_ADVANTAGES
    assert [c.episode_return for c in SCRIPTED] == [5.0, 3.0, 1.0]
    assert batch_advantages([SCRIPTED], algo("advantage_estimator=rloo")).tolist() == EPISODE_RLOO
    torch.testing.assert_close(batch_advantages([SCRIPTED], algo()), torch.tensor(EPISODE_GRPO, dtype=torch.float32))


def test_turn_rewards_must_match_the_segments():
    """One reward per segment the environment stepped on: as many as segments, or one fewer (a row cut by the
    length limit); more, or two fewer, is a broken record."""
    with pytest.raises(ValueError, match="3 policy segment.*4 turn reward"):
        turn_inputs([episode("ppepeeppp", 0.0, [1.0, 0.0, 2.0, 1.0])])
    with pytest.raises(ValueError, match="3 policy segment.*1 turn reward"):
        turn_inputs([episode("ppepeeppp", 0.0, [1.0])])
    rewards, final, n = turn_inputs([episode("ppepeeppp", 0.5, [1.0, 0.0]), episode("pp", 0.0)])
    assert rewards.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]] and final.tolist() == [0.5, 0.0]
    assert n.tolist() == [3, 1]


def test_dynamic_sampling_keeps_a_group_whose_turns_differ():
    """Equal returns (1 and 1) reached by different turns: no signal for episode credit, some for reward to go
    (turn 1: G = 0 vs 1). A group equal in every turn is dropped by both."""
    group = [episode("pep", 0.0, [1.0, 0.0]), episode("pep", 0.0, [0.0, 1.0])]
    assert not is_informative(group) and not informative_test("episode")(group)
    assert informative_test("reward_to_go")(group)
    same = [episode("pep", 0.0, [1.0, 0.0]), episode("pep", 0.0, [1.0, 0.0])]
    assert not informative_test("reward_to_go")(same)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "batch-std"])
def test_episode_credit_without_turn_rewards_is_the_old_batch_bit_for_bit(estimator):
    g = torch.Generator().manual_seed(0)
    groups = [[episode("ppep", float(torch.rand(1, generator=g)), seed=4 * j + i) for i in range(4)]
              for j in range(3)]
    groups.append([Completion({"prompt": "q"}, [3], torch.tensor([4, 5]), torch.zeros(2), "eos", "", reward=r)
                   for r in (0.25, 0.5, 0.5, 1.0)])  # single-turn rows
    old = group_advantages(torch.tensor([c.reward for grp in groups for c in grp]), 4, estimator)
    new = batch_advantages(groups, algo("group_size=4", f"advantage_estimator={estimator}"))
    assert new.dtype == old.dtype and new.shape == old.shape
    assert torch.equal(new, old) and new.view(torch.int32).equal(old.view(torch.int32))


def test_reward_to_go_is_refused_with_a_std_scaled_or_self_including_estimator():
    from cispo.config.yaml_input import ConfigError

    for estimator in ("grpo", "drgrpo", "batch-std"):
        with pytest.raises((ConfigError, ValueError), match="algo.turn_credit.*set algo.advantage_estimator=rloo"):
            apply_overrides(TrainConfig(), ["algo.turn_credit=reward_to_go", f"advantage_estimator={estimator}"])
    assert algo("algo.turn_credit=reward_to_go", "advantage_estimator=rloo").turn_credit == "reward_to_go"


# ---------------------------------------------------------------------------------------
# The trainer's update with per-token advantages
# ---------------------------------------------------------------------------------------


def _policy():
    from cispo.data.tasks import arithmetic
    from cispo.models.loading import build_model, build_tokenizer
    from cispo.models.policy import Policy
    from cispo.rollout import TorchSampler

    tok = build_tokenizer(arithmetic.ALPHABET)
    model = build_model(tok, size="tiny", seed=0).double()
    return Policy(model, tok, TorchSampler(model, tok.eos_token_id, tok.pad_token_id), torch.device("cpu"))


# a second group of single-turn and two-turn episodes, so that the batch has two groups and ragged rows
SECOND = [episode("ppp", 1.0, [], seed=5), episode("pepp", 0.0, [0.5, 0.0], seed=6),
          episode("pp", 0.0, [], seed=7)]
# second group, by hand: G_{i,k} = (1, 0; 0.5, 0; 0, 0) with n = (1, 2, 1)
#   k = 0, column (1, 0.5, 0): 1 - 0.25 = 0.75; 0.5 - 0.5 = 0; 0 - 0.75 = -0.75
#   k = 1, column (0, 0, 0): all 0
SECOND_TOKENS = [[0.75] * 3 + [0.0] * 6, [0.0] * 9, [-0.75] * 2 + [0.0] * 7]


@pytest.mark.parametrize("variant", ["micro", "fused", "tis"])
def test_the_update_follows_the_closed_form_gradient(variant):
    """One SGD update (K = 1, no clipping) from the trainer's own batch: its gradient equals that of the closed
    form -1/N sum_it sg(w_it) c_it A_it log pi_it, w_it = min(r_it, 5) (CISPO), over the policy's tokens, with
    A_it the hand-computed values (and c_it the rollout correction's weight for ``tis``)."""
    from cispo.models.policy import policy_logprobs
    from cispo.training.trainer import Trainer

    policy = _policy()
    cfg = apply_overrides(TrainConfig(), [
        "group_size=3", "prompts_per_step=2", "updates_per_batch=1", "grad_clip=0", "lr=1e-2", "warmup_updates=0",
        "algo.turn_credit=reward_to_go", "advantage_estimator=rloo", "micro_batch_size=2",
        *(["algo.fused_head=true"] if variant == "fused" else [])])
    trainer = Trainer(policy, torch.optim.SGD(policy.model.parameters(), lr=cfg.optim.lr), preset("cispo"), cfg,
                      torch.Generator().manual_seed(0))
    exp = trainer.experience([SCRIPTED, SECOND])
    assert exp.advantages.tolist() == TOKEN_ADVANTAGES + SECOND_TOKENS
    # samples.jsonl's advantage: each policy segment's A_{i,k}, in order
    assert row_advantages(exp, 6) == [[3.0, 3.0, 4.0], [0.0, 1.5], [-3.0, -4.5, -2.0], [0.75], [0.0, 0.0], [-0.75]]
    exp.advantages = exp.advantages.double()
    exp.response_mask = exp.response_mask.double()
    with torch.no_grad():
        logp = policy_logprobs(policy.model, exp, 1.0, True)  # [B, T]
    g = torch.Generator().manual_seed(1)
    exp.logp_old = ((logp + 0.8 * torch.randn(logp.shape, generator=g, dtype=torch.float64)) * exp.response_mask)
    exp.logp_old[::2, 0] -= 3.0  # rows 0, 2, 4 start with a policy token: r ~ e^3 there, the cap of 5 bites
    c = torch.ones_like(exp.logp_old)
    if variant == "tis":
        c = torch.rand(exp.logp_old.shape, generator=g, dtype=torch.float64) + 0.5
        exp.extras["tis"] = c
    got, lp = update_then_replay(policy, trainer, exp, cfg.optim.lr)
    mask = exp.response_mask
    w = torch.exp(lp.detach() - exp.logp_old).clamp(max=5.0)  # sg(w_it)   [B, T]
    A = torch.tensor(TOKEN_ADVANTAGES + SECOND_TOKENS, dtype=torch.float64)
    (-(w * c * A * lp * mask).sum() / mask.sum()).backward()
    assert (w[mask.bool()] == 5.0).any() and (w[mask.bool()] < 5.0).any()
    for k, p in policy.model.named_parameters():
        torch.testing.assert_close(got[k], p.grad, rtol=1e-8, atol=1e-10, msg=k)
    assert sum(float(v.abs().sum()) for v in got.values()) > 0


def update_then_replay(policy, trainer, exp, lr: float):
    """``trainer.update(exp)`` with SGD at ``lr``: ``(got, lp)``, each parameter's step / lr (the gradient the
    update applied), then the weights put back and π_θ's log-probs [B, T] recomputed with their graph, for the
    closed form to be differentiated against."""
    from cispo.models.policy import policy_logprobs

    before = {k: p.detach().clone() for k, p in policy.model.named_parameters()}
    trainer.update(exp)
    got = {k: (before[k] - p.detach()) / lr for k, p in policy.model.named_parameters()}
    for k, p in policy.model.named_parameters():
        p.data.copy_(before[k])
    policy.model.zero_grad()
    return got, policy_logprobs(policy.model, exp, 1.0, True)  # [B, T]
