"""The unified objective as a verl policy loss: ``loss_mode=cispo_unified``.

Importing this module registers, in ``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``:

* ``cispo_unified``: the preset named by ``policy_loss.cispo_preset`` (default ``cispo``);
* ``cispo_unified_<preset>`` for each preset of ``cispo.objective.loss.PRESETS``
  (``cispo_unified_cispo``, ``_ppo``, ``_grpo``, ``_dapo``, ``_gspo``, ``_reinforce``).

verl imports this module by itself on ``import verl``: cispo declares it as a ``verl.plugins``
entry point (``pyproject.toml``), so an installed cispo needs no setting for
``loss_mode=cispo_unified_<preset>``.

Without verl installed the import succeeds and registers nothing; ``register()`` then raises
an ``ImportError`` naming the pip command. Tested with verl 0.9.1, whose actor calls the loss as

    pg_loss, pg_metrics = policy_loss_fn(old_log_prob=..., log_prob=..., advantages=...,
        response_mask=..., loss_agg_mode=config.loss_agg_mode, config=config,
        rollout_is_weights=...)                      # verl/workers/utils/losses.py::ppo_loss

What is read from verl's actor config (``actor_rollout_ref.actor``):

| verl | here |
|---|---|
| ``policy_loss.loss_mode`` | ``cispo_unified`` or ``cispo_unified_<preset>`` |
| ``policy_loss.cispo_preset`` | preset name for ``cispo_unified`` (needs ``CISPOPolicyLossConfig``) |
| ``policy_loss.cispo_overrides`` | ``ObjectiveConfig`` fields, e.g. ``{eps_high_is: 2.0}`` |
| ``loss_agg_mode`` | the aggregation (verl's wins over the preset's, see ``AGG_MODES``) |
| ``loss_scale_factor`` | ``token_sum_norm`` of ``seq-mean-token-sum-norm`` (None: response length) |
| ``global_batch_info`` | global token / sequence counts, so micro-batches and DP ranks add up |
| ``clip_ratio_low`` / ``clip_ratio_high`` | ``eps_low`` / ``eps_high`` of the PPO mask, where set (see below) |

verl's clip ratios (``clip_ratio_low`` / ``clip_ratio_high``, or ``clip_ratio`` where those are
null, as verl reads them) are read where the user set them, i.e. where they differ from verl's
defaults (``VERL_CLIP_DEFAULTS``; a default is not a setting, so ``cispo_unified_dapo`` keeps its
0.28 under verl's 0.2), and where the objective's mask uses that edge (``mask_rule`` ``ppo``: both,
as in the ppo, grpo, dapo and gspo presets; ``ppo-low``: the lower, cispo_lowmask; ``ppo-high``: the
upper; ``dppo-tv`` / ``dppo-kl``: DPPO's ``delta_low`` / ``delta_high``, as verl's own ``dppo_tv`` /
``dppo_kl`` read them). Where the edge has no effect (CISPO's and REINFORCE's ``mask_rule="none"``: their IS-weight
bounds are ``cispo_overrides.eps_low_is`` / ``eps_high_is``) a warning says so, once; so does a
``clip_ratio_c`` (verl's dual-clip) other than 3. ``cispo_overrides.eps_low`` / ``eps_high`` that
disagree with a clip ratio read are an error. The KL penalty stays verl's (``use_kl_loss`` /
``kl_loss_coef``): ``kl_coef > 0`` is refused.

Rollout correction (decoupled mode): verl multiplies each token's loss by
``rollout_is_weights``; here the weights multiply the advantages before ``policy_loss``,
which is the same thing (the weights are detached and >= 0, so the PPO mask's sign test on A
is unchanged and a 0 weight removes the token either way). verl's *bypass* mode
(``algorithm.rollout_correction.bypass_mode=True``) overwrites ``loss_mode`` with
``bypass_mode``: it cannot be combined with this loss.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from cispo.integrations import warn_if_untested
from cispo.objective.loss import PRESETS, ObjectiveConfig, ObjectiveStats, policy_loss, preset

LOSS_NAME = "cispo_unified"
LOSS_NAMES: dict[str, str | None] = {LOSS_NAME: None, **{f"{LOSS_NAME}_{p}": p for p in PRESETS}}
"""Registered loss_mode -> preset (None: read ``policy_loss.cispo_preset``, default ``cispo``)."""

AGG_MODES: dict[str, str] = {
    "token-mean": "token-mean",
    "token-sum": "token-mean",  # with num_tokens = 1 / dp_size: sum * dp_size, as verl
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum-norm",  # with token_sum_norm = 1
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",  # token_sum_norm = loss_scale_factor
}
"""verl ``loss_agg_mode`` -> our ``aggregation``. Every mode of verl 0.9.1 is supported;
any other raises ``ValueError``."""

INSTALL_HINT = (
    'pip install --no-deps verl==0.9.1 && pip install -e ".[verl-min-deps]"  (in a cispo clone; or the full '
    "`pip install verl==0.9.1`, which pins transformers<5.11; see docs/integrations.md)"
)

VERL_CLIP_DEFAULTS: dict[str, float] = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                                         "clip_ratio_c": 3.0}
"""verl 0.9.1's defaults of the actor's clip settings (``ActorConfig``, ``ppo_trainer.yaml``): a value
that differs is one the user set (tests check these against ``ActorConfig``)."""

MASK_EDGES: dict[str, dict[str, str]] = {
    "ppo": {"clip_ratio_low": "eps_low", "clip_ratio_high": "eps_high"},
    "ppo-low": {"clip_ratio_low": "eps_low"},
    "ppo-high": {"clip_ratio_high": "eps_high"},
    "dppo-tv": {"clip_ratio_low": "delta_low", "clip_ratio_high": "delta_high"},  # verl's dppo_tv reads them so
    "dppo-kl": {"clip_ratio_low": "delta_low", "clip_ratio_high": "delta_high"},
    "none": {},
}
"""Our ``mask_rule`` -> verl's clip ratios that act in it, and the ``ObjectiveConfig`` field each sets."""

_WARNED: set[tuple] = set()


def verl_available() -> bool:
    """True when ``verl`` is installed (checked without importing it)."""
    if "verl" in sys.modules:
        return sys.modules["verl"] is not None
    try:
        return importlib.util.find_spec("verl") is not None
    except (ImportError, ValueError):
        return False


def _core_algos():
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as err:
        raise ImportError(
            f"cispo.integrations.verl needs verl, which could not be imported ({err}). Install it: {INSTALL_HINT}"
        ) from err
    return core_algos


def register(names: tuple[str, ...] | None = None) -> list[str]:
    """Register the loss under ``names`` (default: every name of ``LOSS_NAMES``) in verl's
    policy-loss registry and return them. Idempotent. Raises ``ImportError`` without verl."""
    core_algos = _core_algos()
    names = tuple(LOSS_NAMES) if names is None else names
    for name in names:
        if name not in LOSS_NAMES:
            raise ValueError(f"unknown loss name {name!r}; known: {', '.join(LOSS_NAMES)}")
        core_algos.register_policy_loss(name)(make_policy_loss_fn(name))
    return list(names)


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """``obj[key]`` for dicts, DictConfigs and verl's BaseConfig dataclasses; ``default`` if absent."""
    if obj is None:
        return default
    getter = getattr(obj, "get", None)
    if callable(getter):
        try:
            value = getter(key, default)
        except (KeyError, AttributeError, TypeError):  # e.g. a struct DictConfig without the key
            value = default
        return default if value is None else value
    return getattr(obj, key, default)


def _plain(value: Any) -> Any:
    """OmegaConf containers to plain Python (leaves everything else alone)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    return value


def objective_from_verl_config(config: Any, loss_mode: str | None = None) -> ObjectiveConfig:
    """The ``ObjectiveConfig`` that ``loss_mode`` (default: ``config.policy_loss.loss_mode``)
    runs with verl's actor ``config``: preset from the loss name or ``policy_loss.cispo_preset``,
    then ``policy_loss.cispo_overrides``. The aggregation is set later from ``loss_agg_mode``."""
    pl = _get(config, "policy_loss", None)
    loss_mode = loss_mode or _get(pl, "loss_mode", LOSS_NAME)
    if loss_mode not in LOSS_NAMES:
        raise ValueError(f"loss_mode {loss_mode!r} is not one of ours: {', '.join(LOSS_NAMES)}")
    name_preset = LOSS_NAMES[loss_mode]
    cfg_preset = _get(pl, "cispo_preset", None)
    if name_preset is not None and cfg_preset is not None and cfg_preset != name_preset:
        raise ValueError(
            f"policy_loss.loss_mode={loss_mode!r} selects preset {name_preset!r} but policy_loss.cispo_preset="
            f"{cfg_preset!r}: use loss_mode={LOSS_NAME!r} with cispo_preset, or drop cispo_preset"
        )
    overrides = dict(_plain(_get(pl, "cispo_overrides", None)) or {})
    for key, verl_key in (("aggregation", "loss_agg_mode"), ("token_sum_norm", "loss_scale_factor")):
        if key in overrides:
            raise ValueError(
                f"policy_loss.cispo_overrides.{key} is not used under verl: set actor.{verl_key} instead "
                f"(it also aggregates verl's entropy and KL terms)"
            )
    name = name_preset or cfg_preset or "cispo"
    cfg = _with_verl_clip(config, preset(name, **overrides), name, overrides)
    if cfg.kl_coef > 0:
        raise ValueError(
            "ObjectiveConfig.kl_coef > 0 under verl: verl passes no reference log-probs to the policy loss. "
            "Use verl's actor.use_kl_loss=True, kl_loss_coef and kl_loss_type (low_var_kl is k3) instead."
        )
    return cfg


def _warn_once(key: tuple, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


def _with_verl_clip(config: Any, cfg: ObjectiveConfig, name: str, overrides: dict) -> ObjectiveConfig:
    """``cfg`` (preset ``name`` with ``overrides``) with verl's clip ratios that the user set (values
    other than `VERL_CLIP_DEFAULTS`; ``clip_ratio`` where a ratio is null, as verl) as the edges of
    its PPO mask that ``cfg.mask_rule`` uses (`MASK_EDGES`); a warning, once, for each that has no
    effect, and for a ``clip_ratio_c`` set (no dual-clip here). ``ValueError`` where an override of
    that edge disagrees."""
    acting, changes = MASK_EDGES.get(cfg.mask_rule, {}), {}
    for key in ("clip_ratio_low", "clip_ratio_high"):
        value = _get(config, key, None)
        value = _get(config, "clip_ratio", VERL_CLIP_DEFAULTS["clip_ratio"]) if value is None else value
        if value == VERL_CLIP_DEFAULTS[key]:
            continue  # verl's default: no setting of the user's
        field_name = acting.get(key)
        if field_name is None:
            why = ("it has no PPO mask; its IS weight's bounds are policy_loss.cispo_overrides.eps_low_is / eps_high_is"
                   if cfg.mask_rule == "none" else f"its mask_rule={cfg.mask_rule!r} uses the other edge only")
            _warn_once(("clip", key, value, name, cfg.mask_rule),
                       f"{LOSS_NAME}: actor.{key}={value} has no effect on preset {name!r}: {why}")
            continue
        if field_name in overrides and overrides[field_name] != value:
            raise ValueError(f"policy_loss.cispo_overrides.{field_name}={overrides[field_name]} and "
                             f"actor.{key}={value} disagree: give one")
        changes[field_name] = float(value)
    dual_clip = _get(config, "clip_ratio_c", VERL_CLIP_DEFAULTS["clip_ratio_c"])
    if dual_clip != VERL_CLIP_DEFAULTS["clip_ratio_c"]:
        _warn_once(("clip", "clip_ratio_c", dual_clip), f"{LOSS_NAME}: actor.clip_ratio_c={dual_clip} has no effect: "
                   "the unified objective has no dual-clip")
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _aggregation(
    loss_agg_mode: str, cfg: ObjectiveConfig, info: dict
) -> tuple[ObjectiveConfig, Any, Any]:
    """(cfg with verl's aggregation, num_tokens, num_seqs) such that ``aggregate`` equals
    verl's ``agg_loss(..., **config.global_batch_info)`` for the same per-token values."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(
            f"verl loss_agg_mode {loss_agg_mode!r} is not supported by {LOSS_NAME}; supported: {', '.join(AGG_MODES)}"
        )
    dp_size = info.get("dp_size") or 1
    batch_num_tokens = info.get("batch_num_tokens")
    global_batch_size = info.get("global_batch_size")
    num_tokens = num_seqs = None
    token_sum_norm = None
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None and dp_size > 1:
            raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
        if batch_num_tokens is not None:
            num_tokens = batch_num_tokens / dp_size  # verl: sum / batch_num_tokens * dp_size
    elif loss_agg_mode == "token-sum":
        num_tokens = 1.0 / dp_size  # verl: sum * dp_size
    else:
        if global_batch_size is None and dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        if global_batch_size is not None:
            num_seqs = global_batch_size / dp_size  # verl: ... / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum":
            token_sum_norm = 1.0
        elif loss_agg_mode == "seq-mean-token-sum-norm":
            token_sum_norm = info.get("loss_scale_factor")  # None: the padded response length, as verl
    aggregation = AGG_MODES[loss_agg_mode]
    if cfg.aggregation != aggregation and (loss_agg_mode, cfg.aggregation) not in _WARNED:
        _WARNED.add((loss_agg_mode, cfg.aggregation))
        warnings.warn(
            f"{LOSS_NAME}: verl's actor.loss_agg_mode={loss_agg_mode!r} replaces the preset's aggregation "
            f"{cfg.aggregation!r}; set actor.loss_agg_mode to change it",
            stacklevel=3,
        )
    return dataclasses.replace(cfg, aggregation=aggregation, token_sum_norm=token_sum_norm), num_tokens, num_seqs


# ---------------------------------------------------------------------------------------
# The loss function verl calls
# ---------------------------------------------------------------------------------------


def make_policy_loss_fn(loss_mode: str = LOSS_NAME):
    """verl's policy-loss function for ``loss_mode`` (one of ``LOSS_NAMES``)."""
    if loss_mode not in LOSS_NAMES:
        raise ValueError(f"unknown loss name {loss_mode!r}; known: {', '.join(LOSS_NAMES)}")

    def compute_policy_loss_cispo_unified(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """verl policy loss: ``cispo.objective.loss.policy_loss`` with the preset of ``loss_mode``.
        Returns (pg_loss, metrics): verl's ``actor/pg_clipfrac``, ``actor/ppo_kl``,
        ``actor/pg_clipfrac_lower`` and our ``cispo/*`` diagnostics."""
        if config is None:
            raise ValueError(f"{loss_mode}: verl's actor config is required")
        cfg = objective_from_verl_config(config, loss_mode)
        info = dict(_get(config, "global_batch_info", None) or {})
        if _get(config, "loss_scale_factor", None) is not None and info.get("loss_scale_factor") is None:
            info["loss_scale_factor"] = _get(config, "loss_scale_factor")
        cfg, num_tokens, num_seqs = _aggregation(loss_agg_mode, cfg, info)
        if rollout_is_weights is not None:
            advantages = advantages * rollout_is_weights.detach()  # == verl's pg_losses * rollout_is_weights
        loss, stats = policy_loss(
            log_prob, old_log_prob, advantages, response_mask, cfg, num_tokens=num_tokens, num_seqs=num_seqs
        )
        with torch.no_grad():  # verl's ppo_kl: mean of log pi_old - log pi_theta, clamped like verl
            mask = response_mask.bool()
            neg_kl = torch.clamp(log_prob.detach() - old_log_prob, min=-20.0, max=20.0)
            ppo_kl = (torch.where(mask, -neg_kl, 0.0).sum() / mask.sum().clamp(min=1)).item()
        metrics = {
            # the tokens whose contribution the objective altered: dropped by the PPO mask, or capped
            "actor/pg_clipfrac": stats.frac_masked if cfg.mask_rule in ("ppo", "dppo-tv", "dppo-kl")
            else stats.frac_capped,
            "actor/ppo_kl": ppo_kl,
            "actor/pg_clipfrac_lower": 0.0,  # verl's dual-clip (clip_ratio_c) is not part of eq. 6
            **stats.to_dict("cispo/", keys=ObjectiveStats.DIAGNOSTICS),
        }
        return loss, metrics

    compute_policy_loss_cispo_unified.__name__ = f"compute_policy_loss_{loss_mode}"
    compute_policy_loss_cispo_unified.__qualname__ = compute_policy_loss_cispo_unified.__name__
    return compute_policy_loss_cispo_unified


# ---------------------------------------------------------------------------------------
# verl config class for cispo_preset / cispo_overrides, and registration on import
# ---------------------------------------------------------------------------------------

if verl_available():
    try:
        from verl.workers.config import PolicyLossConfig as _PolicyLossConfig
    except ImportError:  # verl present but broken: register() will say why
        _PolicyLossConfig = None
    else:
        warn_if_untested("verl", INSTALL_HINT)
else:
    _PolicyLossConfig = None

if _PolicyLossConfig is not None:

    @dataclass
    class CISPOPolicyLossConfig(_PolicyLossConfig):
        """verl's ``PolicyLossConfig`` plus our settings. Select it with
        ``actor_rollout_ref.actor.policy_loss._target_=cispo.integrations.verl.CISPOPolicyLossConfig``
        (instantiating it imports this module, which registers the losses in that process)."""

        loss_mode: str = LOSS_NAME
        cispo_preset: str | None = None
        """Preset for ``loss_mode=cispo_unified`` (None: ``cispo``)."""
        cispo_overrides: dict = field(default_factory=dict)
        """``ObjectiveConfig`` fields replacing the preset's (not ``aggregation`` / ``token_sum_norm``)."""

    register()
else:

    def __getattr__(name: str):
        if name == "CISPOPolicyLossConfig":
            _core_algos()  # raises the ImportError with the install hint
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
