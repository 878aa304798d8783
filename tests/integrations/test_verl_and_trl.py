"""cispo.integrations: the objective inside verl (policy-loss registry) and TRL (GRPOTrainer).

The verl and TRL tests skip, with the reason, when the framework is not installed (the
default venv has neither). The first tests need neither.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import types
import warnings
import zlib
from pathlib import Path

import pytest
import torch

from cispo.integrations.trl import objective_config_from_trl, trl_available
from cispo.integrations.verl import verl_available
from cispo.objective.loss import is_weight, log_ratio, policy_loss, ppo_token_mask, preset

REPO = Path(__file__).resolve().parents[2]

needs_verl = pytest.mark.skipif(
    not verl_available(), reason="verl is not installed (pip install verl; see docs/integrations.md)"
)
needs_trl = pytest.mark.skipif(
    not trl_available(), reason="trl is not installed (pip install trl; see docs/integrations.md)"
)


# ---------------------------------------------------------------------------------------
# Without the frameworks
# ---------------------------------------------------------------------------------------


def test_modules_import_without_frameworks_and_name_the_pip_command():
    """Both modules import with verl and trl hidden; using them raises ImportError + pip hint."""
    code = """
import sys
for name in ("verl", "trl"):
    sys.modules[name] = None  # an import of it now raises ImportError
import cispo.integrations.verl as v, cispo.integrations.trl as t
assert not v.verl_available()
for call in (v.register, lambda: v.CISPOPolicyLossConfig, lambda: t.CISPOGRPOTrainer(model=None)):
    try:
        call()
    except ImportError as err:
        assert "pip install" in str(err), err
    else:
        raise AssertionError("no ImportError")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def _trl_args(**kw):
    base = dict(loss_type="dapo", epsilon=0.2, epsilon_high=None, delta=None, importance_sampling_level="token",
                beta=0.0, max_completion_length=16, use_bias_correction_kl=False)
    return types.SimpleNamespace(**{**base, **kw})


def test_objective_config_from_trl_mapping():
    cispo = objective_config_from_trl(_trl_args(loss_type="cispo", epsilon_high=5.0))
    assert (cispo.eps_high_is, cispo.eps_low_is, cispo.mask_rule) == (4.0, None, "none")
    assert cispo == preset("cispo")
    assert objective_config_from_trl(_trl_args(loss_type="grpo")) == preset("grpo")
    assert objective_config_from_trl(_trl_args(loss_type="dapo", epsilon_high=0.28)) == preset("dapo")
    gspo = objective_config_from_trl(
        _trl_args(loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence")
    )
    assert gspo == preset("gspo")
    dr = objective_config_from_trl(_trl_args(loss_type="dr_grpo", max_completion_length=64))
    assert (dr.aggregation, dr.token_sum_norm) == ("seq-mean-token-sum-norm", 64.0)
    kl = objective_config_from_trl(_trl_args(beta=0.04))
    assert (kl.kl_coef, kl.kl_estimator) == (0.04, "k3")
    with pytest.raises(ValueError, match="caps the IS weight at epsilon_high itself"):
        objective_config_from_trl(_trl_args(loss_type="cispo"))  # TRL default: epsilon_high = epsilon = 0.2
    for bad in (dict(loss_type="bnpo"), dict(loss_type="sapo"), dict(delta=2.0),
                dict(beta=0.1, use_bias_correction_kl=True)):
        with pytest.raises(ValueError):
            objective_config_from_trl(_trl_args(**bad))


# ---------------------------------------------------------------------------------------
# verl
# ---------------------------------------------------------------------------------------

VERL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _verl_batch(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 1, 6, 3, 4])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]  # bool, as verl's ppo_loss passes it
    logp_new = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    logp_old = logp_new.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8  # ratios ~ e^{+-2}
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()  # verl: token-level [B, T]
    is_w = torch.rand(B, T, generator=g, dtype=torch.float64) * 2  # truncated-IS weights in [0, 2)
    return logp_new, logp_old, adv, mask, is_w


def _verl_batch_across_the_edges(B=6, T=13):
    """As `_verl_batch`, with each row's ratios 0.55, 0.65, ..., 1.75: every clip edge tried here
    (0.8, 0.9; 1.2, 1.28, 1.5) has tokens of both signs of A on each side."""
    g = torch.Generator().manual_seed(3)
    mask = torch.arange(T)[None, :] < torch.tensor([13, 10, 13, 9, 12, 4])[:B, None]
    logp_new = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    ratio = torch.linspace(0.55, 1.75, T, dtype=torch.float64).expand(B, T)
    logp_old = logp_new.detach() - ratio.log()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.7, 1.3, -0.2], dtype=torch.float64)[:B, None].expand(B, T).clone()
    is_w = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return logp_new, logp_old, adv, mask, is_w


def _actor_config(loss_mode, loss_agg_mode="token-mean", preset_name=None, overrides=None, info=None, **kw):
    from verl.workers.config import ActorConfig

    from cispo.integrations.verl import CISPOPolicyLossConfig

    pl = CISPOPolicyLossConfig(loss_mode=loss_mode, cispo_preset=preset_name, cispo_overrides=dict(overrides or {}))
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=loss_agg_mode,
                       policy_loss=pl, global_batch_info=dict(info or {}), **kw)


def _call_like_verl(config, logp_new, logp_old, adv, mask, is_w):
    """Exactly as verl 0.9.1's verl/workers/utils/losses.py::ppo_loss calls a policy loss."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    policy_loss_fn = get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
    return policy_loss_fn(
        old_log_prob=logp_old, log_prob=logp_new, advantages=adv, response_mask=mask,
        loss_agg_mode=config.loss_agg_mode, config=config, rollout_is_weights=is_w,
    )


def _loss_and_grad(fn, logp_new):
    logp_new.grad = None
    out = fn()
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach().clone(), logp_new.grad.clone(), out


@needs_verl
def test_verl_registers_every_name():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    import cispo.integrations.verl as integ

    assert integ.register() == list(integ.LOSS_NAMES)
    for name in ("cispo_unified", "cispo_unified_cispo", "cispo_unified_grpo", "cispo_unified_gspo"):
        assert name in POLICY_LOSS_REGISTRY


@needs_verl
@pytest.mark.parametrize("mode", VERL_AGG_MODES)
@pytest.mark.parametrize("name", ["cispo", "ppo", "grpo", "dapo", "gspo", "reinforce"])
def test_verl_loss_matches_eq6_under_verl_aggregation(name, mode):
    """Loss and gradient == verl's own agg_loss over eq. 6's per-token terms times the rollout
    IS weights, with global batch info of 2 DP ranks (so micro-batches/ranks add up as in verl)."""
    from verl.trainer.ppo.core_algos import agg_loss

    logp_new, logp_old, adv, mask, is_w = _verl_batch()
    info = dict(dp_size=2, batch_num_tokens=int(mask.sum()) * 2 + 3, global_batch_size=13, loss_scale_factor=None)
    config = _actor_config(f"cispo_unified_{name}", mode, info=info, loss_scale_factor=None)

    def ours():
        return _call_like_verl(config, logp_new, logp_old, adv, mask, is_w)

    def reference():
        cfg = preset(name)
        ratio = torch.exp(log_ratio(logp_new, logp_old, mask, cfg.ratio_level, cfg.max_log_ratio))
        w = is_weight(ratio, cfg.eps_low_is, cfg.eps_high_is)
        m = ppo_token_mask(ratio, adv, cfg.eps_low, cfg.eps_high) if cfg.mask_rule == "ppo" else 1.0
        per_token = -(w * adv * logp_new * m) * is_w  # verl: pg_losses * rollout_is_weights
        return agg_loss(loss_mat=per_token, loss_mask=mask, loss_agg_mode=mode, **info)

    loss, grad, (_, metrics) = _loss_and_grad(ours, logp_new)
    ref_loss, ref_grad, _ = _loss_and_grad(reference, logp_new)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-9)
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "cispo/frac_capped",
            "cispo/frac_ppo_dropped"} <= set(metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


@needs_verl
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", ["cispo", "grpo", "gspo"])
def test_verl_loss_equals_policy_loss_without_global_info(name, mode):
    """With no global batch info, the registered fn == policy_loss(A * is_w) on the same tensors."""
    logp_new, logp_old, adv, mask, is_w = _verl_batch(seed=1)
    config = _actor_config("cispo_unified", mode, preset_name=name)
    cfg = preset(name, aggregation=mode)
    loss, grad, (_, metrics) = _loss_and_grad(
        lambda: _call_like_verl(config, logp_new, logp_old, adv, mask, is_w), logp_new
    )
    ref_loss, ref_grad, (_, stats) = _loss_and_grad(
        lambda: policy_loss(logp_new, logp_old, adv * is_w, mask, cfg), logp_new
    )
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert metrics["cispo/frac_capped"] == stats.frac_capped
    assert metrics["cispo/frac_ppo_dropped"] == stats.frac_ppo_dropped
    expected_clipfrac = stats.frac_ppo_dropped if cfg.mask_rule == "ppo" else stats.frac_capped
    assert metrics["actor/pg_clipfrac"] == expected_clipfrac


@needs_verl
@pytest.mark.parametrize(
    "verl_mode, verl_kw, ours, overrides, agg, same_value",
    [
        # verl's built-in CISPO is two-sided, clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)
        ("cispo", dict(clip_ratio_low=0.2, clip_ratio_high=0.2), "cispo_unified_cispo",
         dict(eps_low_is=0.2, eps_high_is=0.2), "token-mean", True),
        # our default (cap 5, no lower bound) in verl's terms: clip_ratio_low=1, clip_ratio_high=4
        ("cispo", dict(clip_ratio_low=1.0, clip_ratio_high=4.0), "cispo_unified_cispo", {}, "token-mean", True),
        # PPO-clip (dual-clip off): same gradient, loss value is eq. 6's, not the surrogate's
        ("vanilla", dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1e9), "cispo_unified_dapo", {},
         "token-mean", False),
        ("gspo", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4), "cispo_unified_gspo", {},
         "seq-mean-token-mean", False),
    ],
)
def test_verl_builtin_losses_equal_presets(verl_mode, verl_kw, ours, overrides, agg, same_value):
    logp_new, logp_old, adv, mask, is_w = _verl_batch(seed=2)
    info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None)
    theirs_cfg = _actor_config("cispo_unified", agg, info=info, **verl_kw)  # policy_loss unused by verl's fns
    ours_cfg = _actor_config(ours, agg, overrides=overrides, info=info)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    def theirs():
        return get_policy_loss_fn(verl_mode)(
            old_log_prob=logp_old, log_prob=logp_new, advantages=adv, response_mask=mask,
            loss_agg_mode=agg, config=theirs_cfg, rollout_is_weights=is_w,
        )

    ref_loss, ref_grad, (_, ref_metrics) = _loss_and_grad(theirs, logp_new)
    loss, grad, (_, metrics) = _loss_and_grad(
        lambda: _call_like_verl(ours_cfg, logp_new, logp_old, adv, mask, is_w), logp_new
    )
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-10)
    if same_value:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(metrics["actor/ppo_kl"], ref_metrics["actor/ppo_kl"])
    if verl_mode in ("cispo", "vanilla"):
        torch.testing.assert_close(metrics["actor/pg_clipfrac"], ref_metrics["actor/pg_clipfrac"])


@needs_verl
@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("clips", [{}, dict(clip_ratio_low=0.02, clip_ratio_high=0.04)])
def test_verl_dppo_equals_the_adapters_dppo_preset(mode, clips):
    """verl's own dppo_tv / dppo_kl and cispo_unified_dppo_tv / _kl under the same actor config: the clip ratios
    the user set are DPPO's bounds in both (verl's defaults 0.2 are not a setting: the preset's 0.15 / 0.05 stay,
    so there verl runs at the preset's values); verl's weight cap clip_ratio_c is the preset's eps_high_is + 1."""
    import warnings

    logp_new, logp_old, adv, mask, is_w = _verl_batch(seed=4)
    info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None)
    cfg = preset(mode)
    bounds = clips or dict(clip_ratio_low=cfg.delta_low, clip_ratio_high=cfg.delta_high)
    theirs_cfg = _actor_config("cispo_unified", "token-mean", info=info, clip_ratio_c=1e4, **bounds)
    ours_cfg = _actor_config(f"cispo_unified_{mode}", "token-mean", info=info, **clips)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    def theirs():
        return get_policy_loss_fn(mode)(old_log_prob=logp_old, log_prob=logp_new, advantages=adv, response_mask=mask,
                                         loss_agg_mode="token-mean", config=theirs_cfg, rollout_is_weights=is_w)

    ref_loss, ref_grad, (_, ref_metrics) = _loss_and_grad(theirs, logp_new)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, grad, (_, metrics) = _loss_and_grad(
            lambda: _call_like_verl(ours_cfg, logp_new, logp_old, adv, mask, is_w), logp_new)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(ref_metrics["actor/pg_clipfrac"], abs=1e-7)
    assert 0 < ref_metrics["actor/pg_clipfrac"] < 1


@needs_verl
def test_verl_warns_once_when_loss_agg_mode_replaces_the_presets(monkeypatch):
    import cispo.integrations.verl as integ

    monkeypatch.setattr(integ, "_WARNED", set())
    logp_new, logp_old, adv, mask, is_w = _verl_batch()
    config = _actor_config("cispo_unified_grpo", "token-mean")  # grpo's own: seq-mean-token-mean
    with pytest.warns(UserWarning, match="replaces the preset's aggregation"):
        _call_like_verl(config, logp_new, logp_old, adv, mask, is_w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call_like_verl(config, logp_new, logp_old, adv, mask, is_w)  # once per (mode, aggregation)


@needs_verl
@pytest.mark.parametrize(
    "name, verl_kw, agg",
    [
        ("dapo", dict(clip_ratio_low=0.1, clip_ratio_high=0.5), "token-mean"),
        ("ppo", dict(clip_ratio_high=0.28), "token-mean"),  # DAPO's 0.28 on ppo's 0.2 / 0.2
        ("grpo", dict(clip_ratio_high=0.28), "seq-mean-token-mean"),
        ("ppo", dict(clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=None), "token-mean"),  # verl: clip_ratio
    ],
)
def test_verl_clip_ratios_set_by_the_user_act_where_the_preset_has_a_mask(name, verl_kw, agg, monkeypatch):
    """verl's clip_ratio_low / clip_ratio_high set by the user are read (they once were ignored). The gradient and clip
    fraction equal verl's own vanilla
    loss with the same clip ratios (dual-clip off; the value is eq. 6's), and differ from the preset's
    own edges; no warning."""
    import cispo.integrations.verl as integ

    monkeypatch.setattr(integ, "_WARNED", set())
    logp_new, logp_old, adv, mask, is_w = _verl_batch_across_the_edges()
    info = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None)
    theirs_cfg = _actor_config("cispo_unified", agg, info=info, clip_ratio_c=1e9, **verl_kw)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    def theirs():
        return get_policy_loss_fn("vanilla")(
            old_log_prob=logp_old, log_prob=logp_new, advantages=adv, response_mask=mask,
            loss_agg_mode=agg, config=theirs_cfg, rollout_is_weights=is_w,
        )

    _, ref_grad, (_, ref_metrics) = _loss_and_grad(theirs, logp_new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, grad, (_, metrics) = _loss_and_grad(lambda: _call_like_verl(
            _actor_config(f"cispo_unified_{name}", agg, info=info, **verl_kw), logp_new, logp_old, adv, mask, is_w),
            logp_new)
    _, preset_grad, _ = _loss_and_grad(lambda: _call_like_verl(
        _actor_config(f"cispo_unified_{name}", agg, info=info), logp_new, logp_old, adv, mask, is_w), logp_new)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(metrics["actor/pg_clipfrac"], ref_metrics["actor/pg_clipfrac"])
    assert not torch.allclose(grad, preset_grad)  # the setting acted


@needs_verl
def test_verl_clip_ratios_that_have_no_effect_warn_once(monkeypatch):
    """CISPO has no PPO mask: verl's clip_ratio_high changes nothing, and a warning says so once
    (as CISPOGRPOTrainer does for TRL's epsilon_high); cispo_lowmask reads the lower edge and warns
    about the upper; a dual-clip warns; an override that disagrees is an error."""
    from verl.workers.config import ActorConfig

    import cispo.integrations.verl as integ

    monkeypatch.setattr(integ, "_WARNED", set())
    assert integ.VERL_CLIP_DEFAULTS == {f.name: f.default for f in dataclasses.fields(ActorConfig)
                                        if f.name in integ.VERL_CLIP_DEFAULTS}
    logp_new, logp_old, adv, mask, is_w = _verl_batch_across_the_edges()

    def run(config):
        return _loss_and_grad(lambda: _call_like_verl(config, logp_new, logp_old, adv, mask, is_w), logp_new)[:2]

    config = _actor_config("cispo_unified_cispo", clip_ratio_high=0.28)
    with pytest.warns(UserWarning, match=r"cispo_unified: actor\.clip_ratio_high=0\.28 has no effect on preset "
                                         r"'cispo': "
                                         r"it has no PPO mask; its IS weight's bounds are policy_loss\.cispo_overrides"):  # noqa: E501
        loss, grad = run(config)
    ref_loss, ref_grad = run(_actor_config("cispo_unified_cispo"))
    torch.testing.assert_close((loss, grad), (ref_loss, ref_grad))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(config)  # once

    config = _actor_config("cispo_unified", preset_name="cispo_lowmask", clip_ratio_low=0.1, clip_ratio_high=0.28)
    with pytest.warns(UserWarning, match=r"clip_ratio_high=0\.28 has no effect on preset 'cispo_lowmask': its "
                                         r"mask_rule='ppo-low' uses the other edge only"):
        loss, grad = run(config)
    ref_loss, ref_grad = _loss_and_grad(lambda: policy_loss(
        logp_new, logp_old, adv * is_w, mask, preset("cispo_lowmask", eps_low=0.1)), logp_new)[:2]
    torch.testing.assert_close((loss, grad), (ref_loss, ref_grad))

    with pytest.warns(UserWarning, match=r"actor\.clip_ratio_c=10\.0 has no effect: the unified objective has no "
                                         r"dual-clip"):
        run(_actor_config("cispo_unified_ppo", clip_ratio_c=10.0))
    with pytest.raises(ValueError, match=r"^policy_loss\.cispo_overrides\.eps_high=0\.3 and "
                                         r"actor\.clip_ratio_high=0\.5 "
                                         r"disagree: give one$"):
        run(_actor_config("cispo_unified_dapo", overrides={"eps_high": 0.3}, clip_ratio_high=0.5))
    run(_actor_config("cispo_unified_dapo", overrides={"eps_high": 0.5}, clip_ratio_high=0.5))  # the same: fine


@needs_verl
def test_verl_config_errors():
    logp_new, logp_old, adv, mask, is_w = _verl_batch()
    cases = [
        (_actor_config("cispo_unified_grpo", preset_name="cispo"), "selects preset"),
        (_actor_config("cispo_unified", overrides={"kl_coef": 0.1}), "use_kl_loss"),
        (_actor_config("cispo_unified", overrides={"aggregation": "token-mean"}), "loss_agg_mode"),
        (_actor_config("cispo_unified", overrides={"eps_hihg_is": 1.0}), "did you mean"),
        (_actor_config("cispo_unified", info={"dp_size": 2}), "batch_num_tokens is required"),
    ]
    for config, match in cases:
        with pytest.raises(ValueError, match=match):
            _call_like_verl(config, logp_new, logp_old, adv, mask, is_w)
    from cispo.integrations.verl import make_policy_loss_fn

    with pytest.raises(ValueError, match="not supported"):
        make_policy_loss_fn("cispo_unified")(logp_old, logp_new, adv, mask, "token-max", _actor_config("cispo_unified"))


@needs_verl
def test_verl_hydra_overrides_as_documented():
    """The command-line overrides of docs/integrations.md, composed on verl's own ppo_trainer.yaml
    and turned into the actor config the way verl's workers do (omega_conf_to_dataclass)."""
    pytest.importorskip("hydra", reason="hydra-core is not installed (a verl dependency)")

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from cispo.integrations.verl import CISPOPolicyLossConfig, objective_from_verl_config

    overrides = [
        "actor_rollout_ref.actor.policy_loss._target_=cispo.integrations.verl.CISPOPolicyLossConfig",
        "actor_rollout_ref.actor.policy_loss.loss_mode=cispo_unified",
        "+actor_rollout_ref.actor.policy_loss.cispo_preset=dapo",
        "+actor_rollout_ref.actor.policy_loss.cispo_overrides.eps_high=${actor_rollout_ref.actor.clip_ratio_high}",
        "actor_rollout_ref.actor.clip_ratio_high=0.3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=4",
    ]
    # the lighter route: a per-preset name, verl's own PolicyLossConfig, no overrides
    plain = [
        "actor_rollout_ref.actor.policy_loss.loss_mode=cispo_unified_gspo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.model.external_lib=cispo.integrations.verl",
        *overrides[-2:],
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
        cfg_plain = compose(config_name="ppo_trainer", overrides=plain)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.policy_loss, CISPOPolicyLossConfig)
    assert objective_from_verl_config(actor) == preset("dapo", eps_high=0.3)
    actor = omega_conf_to_dataclass(cfg_plain.actor_rollout_ref.actor)
    assert type(actor.policy_loss).__name__ == "PolicyLossConfig"
    assert objective_from_verl_config(actor) == preset("gspo")
    assert cfg_plain.actor_rollout_ref.model.external_lib == "cispo.integrations.verl"


# ---------------------------------------------------------------------------------------
# TRL
# ---------------------------------------------------------------------------------------

CHARS = "0123456789+= abc"


def _reward(completions, **kwargs):
    return [float(zlib.crc32(c.encode()) % 7) for c in completions]  # varied, deterministic


def _grpo_setup(tmp_path, **args_kw):
    from datasets import Dataset
    from trl import GRPOConfig

    from cispo.models.loading import build_model, build_tokenizer

    tok = build_tokenizer(CHARS)
    model = build_model(tok, size="tiny", seed=0)
    data = Dataset.from_dict({"prompt": ["1+2=", "3+4=", "5+5=", "2+2="]})
    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
              num_iterations=2, max_steps=2, learning_rate=1e-2, report_to="none", use_cpu=True, logging_steps=1,
              save_strategy="no", seed=0, disable_tqdm=True)
    return model, tok, data, GRPOConfig(**{**kw, **args_kw})


@needs_trl
def test_trl_training_step_matches_trl_cispo(tmp_path):
    """Two optimizer steps (num_iterations=2: the second is off-policy, ratios != 1) on a tiny
    Llama: parameters change, losses are finite, our metrics are logged -- and losses and final
    parameters equal TRL's own loss_type="cispo" with epsilon_high=5 (its absolute cap 5)."""
    from trl import GRPOTrainer

    from cispo.integrations.trl import CISPOGRPOTrainer

    model, tok, data, args = _grpo_setup(tmp_path / "ours")
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    ours = CISPOGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                            processing_class=tok, objective=preset("cispo"))
    ours.train()
    logs = [h for h in ours.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())
    for h in logs:
        assert {f"cispo/{k}" for k in ("frac_capped", "frac_ppo_dropped", "ratio_max", "approx_kl")} <= set(h)
    assert logs[0]["cispo/ratio_max"] == 1.0 and logs[1]["cispo/ratio_max"] != 1.0  # step 2 reuses the rollouts

    model2, tok2, data2, args2 = _grpo_setup(tmp_path / "trl", loss_type="cispo", epsilon_high=5.0)
    trl_trainer = GRPOTrainer(model=model2, reward_funcs=_reward, args=args2, train_dataset=data2,
                              processing_class=tok2)
    trl_trainer.train()
    trl_logs = [h for h in trl_trainer.state.log_history if "loss" in h]
    assert len(trl_logs) == len(logs)
    for a, b in zip(logs, trl_logs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for (k, p), (_, q) in zip(model.named_parameters(), model2.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    if not trl_available():
        pytest.skip("trl is not installed (pip install trl; see docs/integrations.md)")
    from cispo.integrations.trl import CISPOGRPOTrainer

    model, tok, data, args = _grpo_setup(tmp_path_factory.mktemp("grpo"), max_completion_length=16)
    trainer = CISPOGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data,
                               processing_class=tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # exercise the GA normalisation
    return trainer


def _trl_inputs(trainer, seed=0, B=6, P=4, T=16):
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    lengths = torch.tensor([16, 9, 3, 12, 1, 7])[:B]
    completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    inputs = {
        "prompt_ids": torch.randint(3, vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (B, T), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": completion_mask.sum() * 2,  # the window holds 2 micro-batches
    }
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], completion_mask], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, T)
    inputs["old_per_token_logps"] = logps + torch.randn(B, T, generator=g) * 0.8  # ratios ~ e^{+-2}
    inputs["ref_per_token_logps"] = logps + torch.randn(B, T, generator=g) * 0.3
    inputs["importance_sampling_ratio"] = torch.rand(B, T, generator=g) * 2
    return inputs


def _grads(trainer, compute):
    trainer.model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


TRL_CASES = {
    "cispo-cap5": dict(loss_type="cispo", epsilon_high=5.0),
    "cispo-cap1.5": dict(loss_type="cispo", epsilon_high=1.5),
    "cispo-sequence": dict(loss_type="cispo", epsilon_high=1.2, importance_sampling_level="sequence"),
    "grpo": dict(loss_type="grpo"),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "gspo": dict(loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence"),
    "dapo-kl": dict(loss_type="dapo", beta=0.05),
    "cispo-masks-vllm-is": dict(loss_type="cispo", epsilon_high=5.0, top_entropy_quantile=0.5,
                                off_policy_mask_threshold=0.3, use_vllm=True),
}


@needs_trl
@pytest.mark.parametrize("case", list(TRL_CASES))
def test_trl_gradient_equals_trl_loss(trl_trainer, case):
    """Same inputs, same model: TRL's GRPOTrainer._compute_loss with loss_type=X and ours with
    objective_config_from_trl(X) give the same gradient (and, for cispo, the same loss)."""
    from trl import GRPOTrainer

    kw = TRL_CASES[case]
    trainer = trl_trainer
    opts = _trl_args(max_completion_length=16, **{k: v for k, v in kw.items() if k in _trl_args().__dict__})
    saved = {k: getattr(trainer, k) for k in ("loss_type", "epsilon_low", "epsilon_high", "importance_sampling_level",
                                              "beta", "top_entropy_quantile", "off_policy_mask_threshold",
                                              "use_vllm", "vllm_importance_sampling_correction", "objective")}
    saved_bias = trainer.args.use_bias_correction_kl
    try:
        trainer.loss_type = opts.loss_type
        trainer.epsilon_low = opts.epsilon
        trainer.epsilon_high = opts.epsilon_high if opts.epsilon_high is not None else opts.epsilon
        trainer.importance_sampling_level = opts.importance_sampling_level
        trainer.beta = opts.beta
        trainer.args.use_bias_correction_kl = False
        trainer.top_entropy_quantile = kw.get("top_entropy_quantile", 1.0)
        trainer.off_policy_mask_threshold = kw.get("off_policy_mask_threshold")
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = kw.get("use_vllm", False)
        trainer.objective = objective_config_from_trl(opts)
        inputs = _trl_inputs(trainer)
        if not opts.beta:
            inputs.pop("ref_per_token_logps")
        ref_loss, ref_grad = _grads(trainer, lambda: GRPOTrainer._compute_loss(trainer, trainer.model, inputs))
        loss, grad = _grads(trainer, lambda: trainer._compute_loss(trainer.model, inputs))
    finally:
        for k, v in saved.items():
            setattr(trainer, k, v)
        trainer.args.use_bias_correction_kl = saved_bias
    assert grad.abs().sum() > 0
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    if opts.loss_type == "cispo":
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert "cispo/frac_capped" in trainer._metrics["train"]


@needs_trl
def test_trl_trainer_checks_options(tmp_path):
    from cispo.integrations.trl import CISPOGRPOTrainer

    model, tok, data, args = _grpo_setup(tmp_path, epsilon_high=0.28)
    with pytest.warns(UserWarning, match="ignores GRPOConfig epsilon_high=0.28"):
        CISPOGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data, processing_class=tok)
    model, tok, data, args = _grpo_setup(tmp_path, importance_sampling_level="sequence")
    with pytest.warns(UserWarning, match="ignores GRPOConfig importance_sampling_level='sequence'"):
        CISPOGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data, processing_class=tok)
    # No warning for what the user did not set (GSPO's sequence level vs TRL's default "token"),
    # nor for TRL options that give the objective itself.
    for objective, kw in (("gspo", {}), ("cispo", dict(loss_type="cispo", epsilon_high=5.0))):
        model, tok, data, args = _grpo_setup(tmp_path, **kw)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="CISPOGRPOTrainer ignores")
            CISPOGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data, processing_class=tok,
                             objective=objective)
    model, tok, data, args = _grpo_setup(tmp_path)
    with pytest.raises(ValueError, match="must equal objective.kl_coef"):
        CISPOGRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=data, processing_class=tok,
                         objective=preset("cispo", kl_coef=0.1))


def _docs_python_block(heading: str) -> str:
    """The first ```python block after ``heading`` in docs/integrations.md."""
    text = (REPO / "docs" / "integrations.md").read_text()
    start = text.index("```python\n", text.index(heading)) + len("```python\n")
    return text[start:text.index("```\n", start)]


@needs_trl
def test_trl_documented_example_runs_as_written(tmp_path, monkeypatch):
    """docs/integrations.md's TRL example, run as written (CPU here: TRL's default bf16=True
    would refuse), with a tiny local model for Qwen, 8-token completions and 2 steps."""
    from cispo.models.loading import build_model, build_tokenizer, save_policy

    tok = build_tokenizer(CHARS + "TelmajokNrinubWht?.")
    save_policy(build_model(tok, size="tiny", seed=0), tok, tmp_path / "tiny")
    code = _docs_python_block("## TRL")
    for old, new in (('"Qwen/Qwen2.5-0.5B-Instruct"', repr(str(tmp_path / "tiny"))),
                     ("max_completion_length=256", "max_completion_length=8, max_steps=2, logging_steps=1, "
                                                   "report_to='none'")):
        assert old in code, old
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="CISPOGRPOTrainer ignores")
        exec(compile(code, "docs/integrations.md", "exec"), scope)
    logs = [h for h in scope["trainer"].state.log_history if "loss" in h]
    assert scope["trainer"].state.global_step == 2 and len(logs) == 2
    assert all(math.isfinite(h["loss"]) and "cispo/frac_capped" in h for h in logs)
