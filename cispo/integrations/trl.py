"""The unified objective inside TRL's ``GRPOTrainer``: ``CISPOGRPOTrainer``.

    from cispo.objective.loss import preset
    from cispo.integrations.trl import CISPOGRPOTrainer

    trainer = CISPOGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                               train_dataset=..., objective=preset("cispo"))
    trainer.train()

``CISPOGRPOTrainer`` overrides one method, ``GRPOTrainer._compute_loss`` (the per-micro-batch
loss: it has the per-token log-probs, ``old_per_token_logps``, the advantages and the
completion mask), and computes the loss with ``cispo.objective.loss.policy_loss`` and the
``ObjectiveConfig`` given as ``objective=`` (a preset name or an ``ObjectiveConfig``).
Generation, rewards, advantages, ``num_iterations`` and gradient accumulation stay TRL's.
Tested with trl 1.16.0 (transformers 5.24); ``_compute_loss`` is private TRL API.

What TRL still decides, and what it no longer does:

* normalisation across gradient accumulation: ``token-mean`` divides by the tokens of the
  accumulation window (TRL's ``num_items_in_batch`` rescaled exactly as its ``dapo`` /
  ``cispo`` losses); the ``seq-mean`` aggregations count ``B * gradient_accumulation_steps``
  sequences (TRL's ``grpo`` / ``dr_grpo``). ``seq-mean-token-sum-norm`` with
  ``token_sum_norm=None`` uses ``args.max_completion_length`` (TRL's ``dr_grpo``);
* KL: ``objective.kl_coef`` and ``objective.kl_estimator`` are used with TRL's reference
  log-probs, which TRL computes only when ``args.beta != 0``, so ``args.beta`` must equal
  ``objective.kl_coef`` (checked at construction);
* token weights TRL multiplies into the per-token loss -- the vLLM importance-sampling
  correction (``importance_sampling_ratio``), ``top_entropy_quantile``'s entropy mask and
  ``off_policy_mask_threshold``'s sequence mask -- multiply the advantages here (the same
  gradient: they are detached and >= 0);
* the MoE router auxiliary loss is added as TRL does;
* NOT read: ``loss_type``, ``epsilon``, ``epsilon_high``, ``delta``, ``importance_sampling_level``
  and ``use_bias_correction_kl`` (the objective says all that; a warning names the ones the
  user changed from their defaults, unless TRL's loss with them equals the objective). Not supported
  (ValueError): the entropy bonus (``entropy_coef`` / ``use_adaptive_entropy``).

Metrics, logged through TRL's ``self._metrics`` (averaged per logging step, across processes):
``cispo/frac_capped``, ``cispo/frac_ppo_dropped``, ``cispo/frac_ppo_dropped_low_prob``,
``cispo/frac_masked``, ``cispo/ratio_mean``, ``cispo/ratio_min``, ``cispo/ratio_max``, ``cispo/approx_kl``, plus TRL's
``entropy`` and (with a KL term) ``kl``.

``objective_config_from_trl(args)`` gives the ``ObjectiveConfig`` equal to TRL's own loss for
``loss_type`` in ``cispo``, ``grpo``, ``dapo``, ``dr_grpo`` (gradient-equal; tested).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import torch

from cispo.integrations import warn_if_untested
from cispo.objective.loss import ObjectiveConfig, ObjectiveStats, kl_penalty, policy_loss, preset

INSTALL_HINT = 'pip install "trl>=1.16,<1.17"  (or, in a cispo clone, pip install -e ".[trl]")'

STAT_KEYS = ObjectiveStats.DIAGNOSTICS
"""``ObjectiveStats`` fields logged as ``cispo/<field>``."""


# ---------------------------------------------------------------------------------------
# TRL's options as an ObjectiveConfig (no TRL import needed)
# ---------------------------------------------------------------------------------------


def objective_config_from_trl(args: Any) -> ObjectiveConfig:
    """The ``ObjectiveConfig`` whose gradient equals TRL's own ``GRPOTrainer`` loss for a
    ``GRPOConfig`` (or any object with its fields): ``loss_type``, ``epsilon``, ``epsilon_high``,
    ``importance_sampling_level``, ``beta``, ``max_completion_length``, ``delta``.

    | TRL ``loss_type`` | ours |
    |---|---|
    | ``cispo`` | mask ``none``, ``eps_high_is = epsilon_high - 1``, ``token-mean`` (TRL caps at ``epsilon_high``) |
    | ``grpo`` | mask ``ppo`` (``eps_low = epsilon``, ``eps_high = epsilon_high``), ``seq-mean-token-mean`` |
    | ``dapo`` | mask ``ppo``, ``token-mean`` |
    | ``dr_grpo`` | mask ``ppo``, ``seq-mean-token-sum-norm`` with ``token_sum_norm = max_completion_length`` |

    ``importance_sampling_level`` -> ``ratio_level``; ``beta`` -> ``kl_coef`` (k3 estimator).
    Raises ``ValueError`` for what eq. 6 cannot express: ``bnpo`` (local-batch token mean),
    ``sapo`` / ``luspo`` / ``vespo``, ``delta`` (two-sided clip), a cispo cap below 1 (TRL's
    ``epsilon_high`` defaults to ``epsilon`` = 0.2, which caps every weight at 0.2), and
    ``use_bias_correction_kl=True`` with ``beta > 0``.
    """
    loss_type = getattr(args, "loss_type", "dapo")
    eps_low = float(getattr(args, "epsilon", 0.2))
    eps_high = getattr(args, "epsilon_high", None)
    eps_high = eps_low if eps_high is None else float(eps_high)
    level = getattr(args, "importance_sampling_level", "token")
    beta = float(getattr(args, "beta", 0.0) or 0.0)
    if getattr(args, "delta", None) is not None:
        raise ValueError("TRL's two-sided clipping (delta) is not a setting of the unified objective")
    if beta > 0 and getattr(args, "use_bias_correction_kl", False):
        raise ValueError("TRL's use_bias_correction_kl=True (KL times the IS ratio) is not supported; set it to False")
    common = dict(ratio_level=level, kl_coef=beta, kl_estimator="k3")
    if loss_type == "cispo":
        if eps_high < 1.0:
            raise ValueError(
                f"TRL's cispo loss caps the IS weight at epsilon_high itself ({eps_high}; it defaults to epsilon when "
                "unset), below 1, which the unified objective (cap 1 + eps_high_is >= 1) does not express. "
                "TRL recommends epsilon_high=5.0, our preset('cispo')."
            )
        return ObjectiveConfig(
            eps_low_is=None, eps_high_is=eps_high - 1.0, mask_rule="none", eps_low=min(eps_low, 1.0),
            eps_high=eps_low, aggregation="token-mean", **common,
        )
    ppo = dict(eps_low_is=None, eps_high_is=None, mask_rule="ppo", eps_low=eps_low, eps_high=eps_high)
    if loss_type == "grpo":
        return ObjectiveConfig(aggregation="seq-mean-token-mean", **ppo, **common)
    if loss_type == "dapo":
        return ObjectiveConfig(aggregation="token-mean", **ppo, **common)
    if loss_type == "dr_grpo":
        return ObjectiveConfig(
            aggregation="seq-mean-token-sum-norm", token_sum_norm=float(args.max_completion_length), **ppo, **common
        )
    if loss_type == "bnpo":
        raise ValueError("TRL's bnpo (token mean over the local micro-batch) has no equivalent here; use dapo")
    raise ValueError(f"TRL loss_type {loss_type!r} is not a setting of the unified objective (eq. 6)")


# ---------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------

try:
    from trl import GRPOTrainer as _GRPOTrainer
except ImportError as _err:  # trl missing: the class exists but refuses to be built
    _GRPOTrainer = None
    _TRL_IMPORT_ERROR: ImportError | None = _err
else:
    _TRL_IMPORT_ERROR = None
    warn_if_untested("trl", INSTALL_HINT)


def trl_available() -> bool:
    """True when ``trl.GRPOTrainer`` could be imported."""
    return _GRPOTrainer is not None


IGNORED_TRL_OPTIONS = ("loss_type", "epsilon", "epsilon_high", "delta", "importance_sampling_level",
                       "use_bias_correction_kl")
"""``GRPOConfig`` fields that set TRL's own loss, which ``CISPOGRPOTrainer`` replaces by its objective."""


def _user_set_loss_options(args: Any) -> list[str]:
    """``name=value`` for each ``IGNORED_TRL_OPTIONS`` field of ``args`` that differs from its
    ``GRPOConfig`` default, i.e. that the user set (a default is not a setting to warn about)."""
    defaults = {f.name: f.default for f in dataclasses.fields(args) if f.default is not dataclasses.MISSING}
    return [f"{name}={getattr(args, name)!r}" for name in IGNORED_TRL_OPTIONS
            if name in defaults and getattr(args, name) != defaults[name]]


def _trl_objective_or_none(args: Any) -> ObjectiveConfig | None:
    """``objective_config_from_trl(args)``, or None where TRL's options have no equivalent."""
    try:
        return objective_config_from_trl(args)
    except ValueError:
        return None


_FORWARD_FIXED = {"self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                  "compute_entropy", "compute_aux_loss"}


def _resolve_objective(objective: ObjectiveConfig | str) -> ObjectiveConfig:
    if isinstance(objective, str):
        return preset(objective)
    if not isinstance(objective, ObjectiveConfig):
        raise TypeError(f"objective must be an ObjectiveConfig or a preset name, got {type(objective).__name__}")
    return objective


if _GRPOTrainer is not None:

    class CISPOGRPOTrainer(_GRPOTrainer):
        """``trl.GRPOTrainer`` whose loss is ``cispo.objective.loss.policy_loss`` with ``objective``.

        Args: those of ``GRPOTrainer``, plus the keyword ``objective``: an ``ObjectiveConfig``
        or a preset name (default ``"cispo"``: IS weight capped at 5, no mask, token-mean).
        """

        def __init__(self, *args, objective: ObjectiveConfig | str = "cispo", **kwargs):
            cfg = _resolve_objective(objective)
            super().__init__(*args, **kwargs)
            self.objective = cfg
            self._check_trl_options()

        def _check_trl_options(self) -> None:
            cfg, args = self.objective, self.args
            if float(args.beta) != float(cfg.kl_coef):
                raise ValueError(
                    f"GRPOConfig.beta ({args.beta}) must equal objective.kl_coef ({cfg.kl_coef}): TRL computes the "
                    "reference log-probs only when beta != 0, and the KL term is the objective's"
                )
            if self._entropy_bonus_enabled:
                raise ValueError(
                    "CISPOGRPOTrainer does not support TRL's entropy bonus (entropy_coef / use_adaptive_entropy)"
                )
            ignored = _user_set_loss_options(args)
            if ignored and _trl_objective_or_none(args) != cfg:
                warnings.warn(
                    f"CISPOGRPOTrainer ignores GRPOConfig {', '.join(ignored)}: the loss is set by objective={cfg}",
                    stacklevel=3,
                )

        def _compute_loss(self, model, inputs):
            cfg = self.objective
            prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            logits_to_keep = completion_ids.size(1)
            mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

            # Same forward as GRPOTrainer._compute_loss; the optional (multimodal) inputs are
            # whatever this TRL version's _get_per_token_logps_and_entropies accepts.
            params = inspect.signature(self._get_per_token_logps_and_entropies).parameters
            extra = {name: inputs.get(name) for name in params if name not in _FORWARD_FIXED}
            per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep,
                compute_entropy=True, compute_aux_loss=self.aux_loss_enabled, **extra,
            )  # [B, T]

            advantages = inputs["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)  # [B, 1]
            old_per_token_logps = inputs.get("old_per_token_logps")
            if old_per_token_logps is None:  # on-policy step: TRL skips computing them
                old_per_token_logps = per_token_logps.detach()

            # Token weights TRL multiplies into its per-token loss: here into the advantages.
            weight = torch.ones_like(per_token_logps)  # [B, T]
            if self.top_entropy_quantile < 1.0:
                weight = weight * self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            if self.off_policy_mask_threshold is not None:
                sampling_logps = inputs.get("sampling_per_token_logps", old_per_token_logps)
                weight = weight * self.get_off_policy_mask(
                    advantages=advantages, per_token_logps=per_token_logps, sampling_per_token_logps=sampling_logps,
                    mask=mask, off_policy_threshold=self.off_policy_mask_threshold,
                )
            if self.use_vllm and self.vllm_importance_sampling_correction:
                weight = weight * inputs["importance_sampling_ratio"]
            advantages = advantages * weight.detach()  # [B, T]

            # Normalisation over the gradient-accumulation window (HF's GA scaling is off here).
            mode = "train" if self.model.training else "eval"
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
            num_tokens = num_seqs = None
            if cfg.aggregation == "token-mean":  # == TRL's dapo / cispo normaliser
                num_tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
                if mode == "train":
                    num_tokens = num_tokens * accumulation / self.args.steps_per_generation
            else:  # == TRL's grpo / dr_grpo: per-micro-batch mean over all B, divided by GA
                num_seqs = per_token_logps.size(0) * accumulation
            if cfg.aggregation == "seq-mean-token-sum-norm" and cfg.token_sum_norm is None:
                cfg = dataclasses.replace(cfg, token_sum_norm=float(self.max_completion_length))
            ref = inputs.get("ref_per_token_logps") if cfg.kl_coef > 0 else None
            if cfg.kl_coef > 0 and ref is None:
                raise ValueError("objective.kl_coef > 0 needs TRL's ref_per_token_logps: set GRPOConfig.beta = kl_coef")

            loss, stats = policy_loss(
                per_token_logps, old_per_token_logps, advantages, mask, cfg,
                num_tokens=num_tokens, logp_ref=ref, num_seqs=num_seqs,
            )
            if self.aux_loss_enabled:
                loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
                self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
            self._log_objective_stats(mode, stats, entropies, mask, per_token_logps, ref, cfg)
            return loss

        def _log_objective_stats(self, mode, stats, entropies, mask, per_token_logps, ref, cfg) -> None:
            with torch.no_grad():
                m = mask.to(per_token_logps.dtype)
                sums = [(entropies * m).sum(), m.sum()]
                if ref is not None:
                    sums.append((kl_penalty(per_token_logps, ref, cfg.kl_estimator) * m).sum())
                totals = self.accelerator.reduce(torch.stack([s.float() for s in sums]), reduction="sum")
                count = totals[1].clamp(min=1.0)
                self._metrics[mode]["entropy"].append((totals[0] / count).item())
                if ref is not None:
                    self._metrics[mode]["kl"].append((totals[2] / count).item())
                local = torch.tensor(list(stats.to_dict(keys=STAT_KEYS).values()), device=per_token_logps.device)
                gathered = self.accelerator.gather(local[None]).reshape(-1, len(STAT_KEYS))  # [processes, k]
            for j, key in enumerate(STAT_KEYS):
                column = gathered[:, j]
                value = column.min() if key == "ratio_min" else column.max() if key == "ratio_max" else column.mean()
                self._metrics[mode][f"cispo/{key}"].append(value.item())

else:

    class CISPOGRPOTrainer:  # type: ignore[no-redef]
        """Placeholder: TRL is not installed."""

        def __init__(self, *args, **kwargs):
            raise ImportError(
                f"CISPOGRPOTrainer needs trl, which could not be imported ({_TRL_IMPORT_ERROR}). "
                f"Install it: {INSTALL_HINT}"
            )
