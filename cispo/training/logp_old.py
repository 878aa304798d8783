"""Where log pi_old of the importance ratio comes from, and what stands beside it.

One `LogpOldSource` per run (`logp_old_source`), three kinds:

* `Recompute` (``algo.logp_old=recompute``): the trainer's own pass over the batch, in train mode
  (`cispo.training.trainer.Trainer.compute_logp_old`);
* `FromFirstUpdate` (the same, ``algo.logp_old_from_update``, where exact): the first update's rows are left
  out of that pass and taken from the first update's own forward, which runs on pi_old's weights over the
  same micro-batches, detached: bitwise the numbers the pass would give, one forward fewer;
* `FromRollout` (``algo.logp_old=rollout``, verl's bypass mode), where the sampler is the same policy
  (`rollout_as_old`): the sampler's own log-probs, no pass; the first update's forward measures the
  train / rollout mismatch and the entropy on its rows (`measured_metrics`).

Each says which micro-batches the pass runs (`pass_micro_batches`), whether the first update's forward
supplies values (``first_update_supplies``) and what it does with them (`supply`).

Also the reference model's pass of a KL term (`reference_logprobs`, run either way) and the rollout
correction's settings (`rollout_correction`: the weights of pi_old / pi_rollout).
"""

from __future__ import annotations

import math
import sys

import torch

from cispo.foundations.distributed import is_sharded
from cispo.foundations.experience import Experience
from cispo.models.policy import Policy, policy_logprobs
from cispo.training.metrics import entropy_metrics, mismatch_kl, mismatch_tail, pearson

MEASURED = "logp_trainer"
"""``Experience.extras`` key of the trainer's own log pi_old of the rows the first update measured
(``algo.logp_old=rollout``)   [B, T]; NaN where nothing was measured."""


def logp_old_from_update(cfg, policy: Policy) -> bool:
    """Whether the first update's detached log-probs can stand in for its rows' logp_old pass
    (``algo.logp_old_from_update``). Exact (bitwise) when that update runs on
    the weights that logp_old is taken at, over the same micro-batches, deterministically: not
    with dropout in the passes (``model.dropout``, ``model.lora_dropout``: two passes draw
    different masks), not with the fused head (its objective needs logp_old before its forward),
    nor a rollout correction (``algo.tis_cap``, ``algo.rollout_is``: the weights of every row are formed
    before the first update), nor FSDP (not tested sharded)."""
    return (cfg.algo.logp_old_from_update and not cfg.model.dropout and not cfg.model.lora_dropout
            and not cfg.algo.fused_head and rollout_correction(cfg.algo) is None and not is_sharded(policy.model))


def rollout_correction(algo) -> dict | None:
    """``rollout_is_weights``' settings of ``algo`` (``tis_cap`` is the token / truncate case with that upper
    bound); None: no rollout correction."""
    if algo.tis_cap:
        return dict(level="token", mode="truncate", lower=None, upper=algo.tis_cap)
    if algo.rollout_is is None:
        return None
    settings = dict(level=algo.rollout_is, mode=algo.rollout_is_mode, lower=algo.rollout_is_lower,
                    upper=algo.rollout_is_upper)
    if algo.rollout_is_max_divergence is not None:  # reject-k2 / reject-k3's threshold
        settings["max_divergence"] = algo.rollout_is_max_divergence
    return settings


@torch.no_grad()
def reference_logprobs(policy: Policy, exp: Experience, cfg) -> torch.Tensor:
    """log pi_ref of every response token of ``exp`` from the frozen reference model, under the
    policy's autocast and LM-head precision.  -> [B, t] float32"""
    with policy.compute():
        lp = policy_logprobs(policy.ref_model, exp, cfg.rollout.temperature, cfg.model.fp32_lm_head,
                             share_prompts=policy.share_prompts)
    return lp.float()


# ---------------------------------------------------------------------------------------
# algo.logp_old=rollout
# ---------------------------------------------------------------------------------------


def not_same_policy(policy: Policy) -> str | None:
    """Why the sampler's ``logp_rollout`` is not the trainer's log pi_old to float32 rounding, in what the
    config cannot tell (`cispo.config.train` refuses the rest: vLLM, dropout, a low-precision
    ``model.dtype``, a rollout correction, FSDP); None: it is.

    The same policy means: the sampler draws from ``policy.model`` itself (not another engine's copy)
    under the trainer's autocast, and every pass computes in float32 (a model saved in bfloat16 or
    float16 with ``model.dtype`` unset runs under autocast: the sampler's KV-cached decode and the
    trainer's forward then differ by that dtype's rounding, which the recomputed pass exists to see).
    In float32 the LM head's code path (``model.fp32_lm_head``'s chunked head or the model's own) is the
    same arithmetic. Both take log_softmax(logits / temperature) (a repetition penalty, top_k, min_p or top_p makes
    the sampler's another distribution: `cispo.config.train` refuses them with ``algo.logp_old=rollout``)."""
    sampler = policy.sampler
    if sampler.model is not policy.model:
        return f"the sampler ({type(sampler).__name__}) does not sample from the trainer's model"
    if sampler.autocast != policy.autocast:
        return f"the sampler computes under autocast {sampler.autocast}, the trainer under {policy.autocast}"
    low = policy.autocast or next((p.dtype for p in policy.model.parameters() if p.dtype != torch.float32), None)
    if low is not None:
        return f"the passes compute in {low} (the model's saved dtype; model.dtype=float32 computes in float32)"
    return None


_SAID: set[tuple[int, str]] = set()


def rollout_as_old(cfg, policy: Policy) -> bool:
    """Whether logp_old is the sampler's ``logp_rollout`` this step: ``algo.logp_old=rollout`` and the
    sampler is the same policy (`not_same_policy`). Otherwise the recomputed pass, said in one line
    per policy (not once per step)."""
    if cfg.algo.logp_old != "rollout":
        return False
    why = not_same_policy(policy)
    if why is not None and (id(policy.model), why) not in _SAID:
        _SAID.add((id(policy.model), why))
        print(f"cispo: algo.logp_old=rollout: logp_old is recomputed instead ({why})", file=sys.stderr)
    return why is None


def start_measuring(exp: Experience) -> None:
    """``algo.logp_old=rollout``: no pass ran, so the trainer's log pi_old (`MEASURED`) and entropy are
    unknown (NaN) until the first update's forward writes its rows'."""
    exp.extras[MEASURED] = torch.full_like(exp.logp_rollout, math.nan)  # [B, T]
    exp.extras["entropy"] = torch.full_like(exp.logp_rollout, math.nan)  # [B, T]


def measured_metrics(exp: Experience) -> dict:
    """The metrics the recomputed pass would give, over the tokens the first update measured (its
    mini-batch: 1/K of the batch, all of it at K = 1), as ``batch_metrics`` defines them with
    logp_old = the trainer's log pi_old there:

        objective/entropy       mean_t H_t (and its spread: ``entropy_metrics``)
        rollout/logp_corr       pearson(log pi_rollout, log pi_old)
        rollout/logp_abs_diff   mean_t |log pi_rollout - log pi_old|
        rollout/mismatch_kl     mean_t rho - 1 - log rho,  rho = pi_old / pi_rollout
        rollout/ratio_*         the tail of rho (``mismatch_tail``)

    NaN with no measured token (the entropy also under ``algo.fused_head``, whose forward gives none)."""
    old = exp.extras[MEASURED]  # [B, T]
    mask = exp.response_mask.bool() & ~old.isnan()  # measured response tokens   [B, T]
    entropy = exp.extras["entropy"][mask]  # [n]
    rollout, trainer = exp.logp_rollout[mask], old[mask]  # [n]
    return {
        "rollout/logp_rollout_nan": float((exp.response_mask.bool() & exp.logp_rollout.isnan()).sum()),
        **entropy_metrics(entropy),
        "rollout/logp_corr": pearson(rollout, trainer) if mask.any() else math.nan,
        "rollout/logp_abs_diff": float((rollout - trainer).abs().mean()) if mask.any() else math.nan,
        "rollout/mismatch_kl": mismatch_kl(old, exp.logp_rollout, mask),
        **mismatch_tail(old, exp.logp_rollout, mask),
    }


# ---------------------------------------------------------------------------------------
# The three sources
# ---------------------------------------------------------------------------------------


class LogpOldSource:
    """Log pi_old recomputed by the trainer's pass over every row (`Recompute`'s behaviour; the base of the
    other two). ``passes``: forward passes over the batch it costs (for ``perf/tokens_per_s``)."""

    first_update_supplies = False
    """Whether the first update's first mini-batch forward supplies its rows' values (`supply`)."""
    passes = 1

    def pass_micro_batches(self, first: list, rest: list) -> list:
        """The micro-batches the policy's pass runs: ``first`` (the first update's, in its shapes) and ``rest``."""
        return first + rest

    def logp_old(self, exp: Experience, computed: torch.Tensor) -> torch.Tensor:
        """Log pi_old of ``exp``'s response tokens, given the pass's ``computed`` values.  -> [B, T] masked"""
        T = exp.response_mask.shape[1]
        return computed[:, :T] * exp.response_mask

    def after_pass(self, exp: Experience) -> None:
        """Anything to note in ``exp.extras`` once the pass has run (default: nothing)."""

    def supply(self, exp: Experience, rows: torch.Tensor, sub: Experience, logp: torch.Tensor,
               entropy: torch.Tensor | None) -> None:
        """Take the first update's detached ``logp`` / ``entropy`` of micro-batch ``sub`` = ``exp.select(rows)``."""
        raise RuntimeError(f"{type(self).__name__} takes nothing from the first update")

    def metrics(self, exp: Experience) -> dict:
        """Metrics of its own for the step (default: none)."""
        return {}


class Recompute(LogpOldSource):
    """``algo.logp_old=recompute``: every row from the trainer's pass."""


class FromFirstUpdate(LogpOldSource):
    """The pass skips the first update's rows; that update's forward fills their log pi_old (so their ratio is
    exactly 1) and entropy (`logp_old_from_update` says when this is exact)."""

    first_update_supplies = True

    def pass_micro_batches(self, first: list, rest: list) -> list:
        return rest

    def supply(self, exp, rows, sub, logp, entropy) -> None:
        t = sub.response_mask.shape[1]
        sub.logp_old = logp
        exp.logp_old[rows, :t] = logp
        sub.extras["entropy"] = entropy
        exp.extras["entropy"][rows, :t] = entropy


class FromRollout(LogpOldSource):
    """``algo.logp_old=rollout``: log pi_old is the sampler's ``logp_rollout``; no pass. The first update's
    forward measures the trainer's own log pi_old (`MEASURED`) and entropy on its rows."""

    first_update_supplies = True
    passes = 0

    def pass_micro_batches(self, first: list, rest: list) -> list:
        return []

    def logp_old(self, exp, computed) -> torch.Tensor:
        T = exp.response_mask.shape[1]
        return exp.logp_rollout[:, :T] * exp.response_mask

    def after_pass(self, exp) -> None:
        start_measuring(exp)

    def supply(self, exp, rows, sub, logp, entropy) -> None:
        t = sub.response_mask.shape[1]
        exp.extras[MEASURED][rows, :t] = logp
        if entropy is not None:  # the fused head gives none: it stays NaN
            exp.extras["entropy"][rows, :t] = entropy

    def metrics(self, exp) -> dict:
        return measured_metrics(exp) if len(exp) else {}


def logp_old_source(cfg, policy: Policy) -> LogpOldSource:
    """The run's source of log pi_old (module docstring), decided once from ``cfg`` and ``policy``."""
    if rollout_as_old(cfg, policy):
        return FromRollout()
    if logp_old_from_update(cfg, policy):
        return FromFirstUpdate()
    return Recompute()
