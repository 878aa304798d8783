"""Presets users look for: Dr. GRPO and ScaleRL as recipes (cispo.config.recipes), and the
two axes ScaleRL needed: the prompt-level aggregation ``prompt-mean-token-mean`` (value and per-token
gradient against a loop over prompts, exact when split) and the ``batch-std`` advantages (by hand)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cispo.cli import main
from cispo.config.recipes import RECIPES, expand_recipes, recipe_overrides
from cispo.config.train import ConfigError, TrainConfig, apply_overrides
from cispo.objective.advantages import batch_std, group_advantages
from cispo.objective.loss import aggregate, policy_loss, preset
from cispo.objective.presets import RECIPE_NAMES
from cispo.records.tracking import read_metrics
from cispo.training.runner import train
from cispo.training.setup import make_objective
from tests.conftest import small_config

F64 = dict(dtype=torch.float64)


# ---------------------------------------------------------------------------------------
# prompt-mean-token-mean: (1/P) sum_g sum_{i in g, t} x_it / sum_{j in g} |o_j|
# ---------------------------------------------------------------------------------------


def group_mean_length(mask, G):
    lengths = mask.sum(-1).reshape(-1, G)  # [P, G]
    return lengths.mean(-1).repeat_interleave(G)  # [B]


def oracle_prompt_mean_cispo(lp, lo, A, mask, G, cap):
    """ScaleRL's J: mean over prompts of sum_{i in g, t} sg(min(r_it, cap)) A_i log pi_it / sum_{j in g} |o_j|."""
    B, T = lp.shape
    total = 0.0
    for g in range(B // G):
        rows = range(g * G, (g + 1) * G)
        n_g = sum(int(mask[i].sum()) for i in rows)
        for i in rows:
            for t in range(T):
                if mask[i, t]:
                    w = torch.minimum(torch.exp(lp[i, t] - lo[i, t]).detach(), torch.tensor(cap, **F64))
                    total = total + w * A[i] * lp[i, t] / n_g
    return total / (B // G)


def batch(seed, P, G, T):
    g = torch.Generator().manual_seed(seed)
    B = P * G
    lp = -torch.rand(B, T, generator=g, **F64) * 3
    lo = lp + 0.8 * torch.randn(B, T, generator=g, **F64)
    A = torch.randn(B, generator=g, **F64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    return lp, lo, A, mask


def grad_of(fn, lp):
    lp = lp.detach().clone().requires_grad_()
    out = fn(lp)
    out.backward()
    return out.detach(), lp.grad


def test_prompt_mean_hand_computed():
    # two prompts of G = 2: lengths (3, 1) and (2, 2) -> group token counts 4 and 4, mean lengths 2 and 2
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [1.0, 1.0, 0.0], [2.0, 2.0, 0.0]], **F64)
    m = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]], **F64)
    lbar = group_mean_length(m, 2)
    assert lbar.tolist() == [2.0, 2.0, 2.0, 2.0]
    # (1/2) * ((1+2+3+4) / 4 + (1+1+2+2) / 4) = (2.5 + 1.5) / 2 = 2
    assert aggregate(x, m, "prompt-mean-token-mean", group_mean_length=lbar).item() == pytest.approx(2.0)
    # unequal groups: lengths (3, 1) and (1, 1) -> 10 / 4 and 3 / 2: (2.5 + 1.5) / 2 again, by other counts
    m2 = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0]], **F64)
    x2 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [1.0, 0.0, 0.0], [2.0, 0.0, 0.0]], **F64)
    got = aggregate(x2, m2, "prompt-mean-token-mean", group_mean_length=group_mean_length(m2, 2)).item()
    assert got == pytest.approx((10 / 4 + 3 / 2) / 2)
    # seq-mean-token-mean would weigh each response alike: ((6/3 + 4) / 2 + (1 + 2) / 2) / 2 differs
    assert aggregate(x2, m2, "seq-mean-token-mean").item() == pytest.approx((2 + 4 + 1 + 2) / 4) != got
    with pytest.raises(ValueError, match="group_mean_length"):
        aggregate(x, m, "prompt-mean-token-mean")


def test_prompt_mean_per_token_gradient_closed_form():
    """CISPO at r = 1: d loss / d log pi_it = -A_i / (P * sum_{j in g(i)} |o_j|): a token of a prompt whose
    responses are long weighs less, whatever its own response's length."""
    m = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]], **F64)  # groups of 4 and 3 tokens
    A = torch.tensor([1.0, -1.0, 2.0, -2.0], **F64)
    lo = torch.full((4, 3), -1.0, **F64)
    cfg = preset("cispo", aggregation="prompt-mean-token-mean")
    _, g = grad_of(lambda x: policy_loss(x, lo, A, m, cfg, group_mean_length=group_mean_length(m, 2))[0], lo)
    n_g = torch.tensor([4.0, 4.0, 3.0, 3.0], **F64)
    torch.testing.assert_close(g, -(A / (2 * n_g))[:, None] * m, atol=1e-15, rtol=0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), P=st.integers(1, 3), G=st.integers(2, 4), T=st.integers(1, 6))
def test_prompt_mean_matches_its_oracle(seed, P, G, T):
    lp, lo, A, mask = batch(seed, P, G, T)
    cfg = preset("cispo", aggregation="prompt-mean-token-mean")
    lbar = group_mean_length(mask, G)
    loss, g = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg, group_mean_length=lbar)[0], lp)
    want, g_ref = grad_of(lambda x: -oracle_prompt_mean_cispo(x, lo, A, mask, G, 1 + cfg.eps_high_is), lp)
    assert loss.item() == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-13)


def test_prompt_mean_split_batch_equals_full_batch():
    lp, lo, A, mask = batch(3, 3, 4, 5)
    cfg = preset("cispo", aggregation="prompt-mean-token-mean", kl_coef=0.1)
    ref, lbar = lp.detach() + 0.1, group_mean_length(mask, 4)
    full, g_full = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg, logp_ref=ref, group_mean_length=lbar)[0], lp)
    S = (mask.sum(-1) > 0).sum()

    def split(x):  # rows of different groups, in micro-batches trimmed to their own length
        total = 0.0
        for rows in (torch.tensor([0, 5, 11]), torch.tensor([1, 2, 3, 4]), torch.tensor([6, 7, 8, 9, 10])):
            t = int(mask[rows].sum(-1).max())
            total = total + policy_loss(x[rows, :t], lo[rows, :t], A[rows], mask[rows, :t], cfg, num_seqs=S,
                                        logp_ref=ref[rows, :t], group_mean_length=lbar[rows])[0]
        return total

    part, g_part = grad_of(split, lp)
    torch.testing.assert_close(part, full, atol=1e-14, rtol=0)
    torch.testing.assert_close(g_part, g_full, atol=1e-15, rtol=0)


# ---------------------------------------------------------------------------------------
# batch-std advantages: (R_i - group mean) / (std of the centred advantages over the batch + eps)
# ---------------------------------------------------------------------------------------


def test_batch_std_advantages_hand_computed():
    R = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    # centred: [.75, -.25 x3], [.5, .5, -.5, -.5], [0 x4]; sum of squares 0.75 + 1 = 1.75 over N = 12
    std = math.sqrt(1.75 / 11)
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0])
    a = group_advantages(R, 4, "batch-std")
    torch.testing.assert_close(a, centred / (std + 1e-6))
    assert torch.equal(a[8:], torch.zeros(4))  # a zero-variance group stays exactly 0
    # not the group's own std (grpo): group 1's std is sqrt(1/4), group 2's sqrt(1/3)
    assert not torch.allclose(a, group_advantages(R, 4, "grpo"))
    # the whole batch's std from per-rank sums (data parallelism): the same numbers
    halves = [group_advantages(R[:4], 4, "drgrpo"), group_advantages(R[4:], 4, "drgrpo")]
    scale = batch_std(sum(h.double().square().sum() for h in halves), 12)
    assert scale.item() == pytest.approx(std)
    torch.testing.assert_close(group_advantages(R[:4], 4, "batch-std", batch_scale=scale), a[:4])
    assert torch.equal(group_advantages(torch.full((4,), 0.1), 2, "batch-std"), torch.zeros(4))


def _batch_std_worker(rank, world, port, out_path):
    import os
    from types import SimpleNamespace

    import torch.distributed as dist

    from cispo.foundations.distributed import DistInfo
    from cispo.training.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]] if rank == 0 else []  # rank 1: none
    groups = [[SimpleNamespace(reward=r, episode_return=r) for r in g] for g in rewards]
    cfg = SimpleNamespace(rollout=SimpleNamespace(group_size=4), algo=SimpleNamespace(advantage_estimator="batch-std"))
    trainer = Trainer.__new__(Trainer)  # only what advantage_scale reads: no model, sampler or optimizer
    trainer.policy, trainer.cfg, trainer.dist_info = SimpleNamespace(device="cpu"), cfg, DistInfo(rank, world, 0)
    scale = trainer.advantage_scale(groups)
    if rank == 1:
        torch.save(scale, out_path)
    dist.barrier()
    dist.destroy_process_group()


def test_batch_std_over_ranks_joins_a_rank_without_groups(tmp_path):
    from tests.training.test_distributed import spawn_two_ranks

    spawn_two_ranks(_batch_std_worker, str(tmp_path / "scale.pt"))
    assert torch.load(tmp_path / "scale.pt").item() == pytest.approx(math.sqrt(1.75 / 11))


def test_batch_std_is_an_advantage_estimator_setting():
    assert apply_overrides(TrainConfig(), ["advantage_estimator=batch-std"]).algo.advantage_estimator == "batch-std"


# ---------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------


def test_recipe_names_are_refused_as_presets_with_the_recipe():
    assert set(RECIPES) <= set(RECIPE_NAMES)
    for name in ("dr_grpo", "drgrpo", "scalerl"):
        with pytest.raises(ValueError) as err:
            preset(name)
        assert "recipe" in str(err.value) and "did you mean" not in str(err.value)
    with pytest.raises(ValueError, match="did you mean 'grpo'"):  # a plain typo still gets its hint
        preset("grpoo")


def test_recipes_expand_in_place():
    want = ["seed=1", *RECIPES["dr_grpo"].overrides, "lr=3e-6"]
    assert expand_recipes(["seed=1", "recipe=dr_grpo", "lr=3e-6"]) == want
    assert expand_recipes(["seed=1"]) == ["seed=1"]
    with pytest.raises(ConfigError, match="unknown recipe 'scale_rl' \\(did you mean 'scalerl'\\?\\)"):
        expand_recipes(["recipe=scale_rl"])
    # later overrides win over the recipe's
    cfg = apply_overrides(TrainConfig(), expand_recipes(["recipe=scalerl", "max_sampling_rounds=2"]))
    assert cfg.rollout.max_sampling_rounds == 2


def test_dr_grpo_recipe_settings():
    cfg = apply_overrides(TrainConfig(), recipe_overrides("dr_grpo"))
    a = cfg.algo
    assert (a.objective.name, a.advantage_estimator) == ("ppo", "drgrpo")
    obj = make_objective(a, max_new_tokens=64)  # the constant normaliser: the longest response
    assert (obj.mask_rule, obj.eps_low, obj.eps_high, obj.eps_high_is) == ("ppo", 0.2, 0.2, None)
    assert (obj.aggregation, obj.token_sum_norm, obj.kl_coef) == ("seq-mean-token-sum-norm", 64.0, 0.0)


def test_scalerl_recipe_settings():
    cfg = apply_overrides(TrainConfig(), recipe_overrides("scalerl"))
    obj = make_objective(cfg.algo, max_new_tokens=64)
    assert (obj.mask_rule, obj.eps_low_is, obj.eps_high_is, obj.aggregation) == (
        "none", None, 4.0, "prompt-mean-token-mean")  # weight min(r, 5)
    assert cfg.algo.advantage_estimator == "batch-std"
    assert (cfg.rollout.dynamic_sampling, cfg.rollout.max_sampling_rounds) == (True, 1)  # filtered, not resampled
    assert cfg.model.fp32_lm_head
    assert cfg.data.retire_pass_rate == 0.9  # No-Positive-Resampling
    assert RECIPES["scalerl"].missing.startswith("PipelineRL")


def test_cli_reads_recipes(capsys):
    assert main(["train", "recipe=dr_grp0"]) == 2
    assert "unknown recipe 'dr_grp0' (did you mean 'dr_grpo'?)" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_recipe_trains(tiny_model, dense_task, tmp_path, name):
    result = train(small_config(tiny_model, tmp_path, *recipe_overrides(name), "steps=1", "eval.every=0"))
    row = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    assert row["optim/updates"] == 4 and row["optim/skipped"] == 0
    assert math.isfinite(row["objective/loss"])
    if name == "scalerl":
        assert row["rollout/rounds"] == 1.0


def test_a_recipe_typed_as_an_objective_points_to_the_recipe():
    for name, recipe in (("dr_grpo", "dr_grpo"), ("drgrpo", "dr_grpo"), ("scalerl", "scalerl")):
        with pytest.raises(ConfigError) as e:
            apply_overrides(TrainConfig(), [f"algo.objective={name}"])
        assert f"recipe={recipe}" in str(e.value) and "did you mean 'grpo'" not in str(e.value)
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        apply_overrides(TrainConfig(), ["algo.objective=grpoo"])  # a typo still gets the nearest preset


def test_a_key_before_a_recipe_that_sets_it_is_refused():
    """``eps_high_is=2 recipe=scalerl``: the recipe would replace the explicit key silently; refused in one line.
    After the recipe, a key overrides the recipe's value, as the command line's order says."""
    from cispo.config.engine import ConfigError
    from cispo.config.recipes import expand_recipes

    with pytest.raises(ConfigError, match=r"'algo.objective.eps_high_is=2' comes before recipe=scalerl, which sets "
                                          r"algo.objective.eps_high_is itself"):
        expand_recipes(["algo.objective.eps_high_is=2", "recipe=scalerl"])
    with pytest.raises(ConfigError, match="'objective=dapo' comes before recipe=scalerl"):
        expand_recipes(["objective=dapo", "recipe=scalerl"])
    after = expand_recipes(["lr=1e-5", "recipe=scalerl", "algo.objective.eps_high_is=2"])
    assert after[0] == "lr=1e-5" and after[-1] == "algo.objective.eps_high_is=2"
