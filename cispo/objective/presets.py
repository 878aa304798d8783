"""The settings of the unified objective (`cispo.objective.loss`, MiniMax-M1 eq. 6): `ObjectiveConfig`,
its five axes, and the named presets (cispo, ppo, grpo, dapo, gspo, reinforce, cispo_lowmask,
cispo_highmask, dppo_tv, dppo_kl).

Plain data with no torch: a run's config names a preset and its overrides, and checking them
(``cispo train algo.objective.eps_high_is=-1`` is refused at once) must not wait for
torch to load. `cispo.objective.loss` computes the loss from them and re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cispo.foundations.suggest import did_you_mean

RATIO_LEVELS = ("token", "sequence")
MASK_RULES = ("none", "ppo", "ppo-low", "ppo-high", "dppo-tv", "dppo-kl")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "prompt-mean-token-mean")
KL_ESTIMATORS = ("k1", "k3")


def _is_number(value) -> bool:
    """A real number, not a bool nor a string such as ``"nan"`` (YAML reads ``nan`` as text; its NaN is ``.nan``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"ObjectiveConfig.{field} must be one of {choices}, got {value!r}"
                         f"{did_you_mean(value, choices)}")


@dataclass(frozen=True)
class ObjectiveConfig:
    """The axes of the unified objective (eq. 6). The defaults are the ``cispo`` preset."""

    ratio_level: str = "token"
    """Unit of the IS ratio: ``token`` (r_it) or ``sequence`` (GSPO's length-normalised s_i)."""
    eps_low_is: float | None = None
    """IS weight lower bound 1 - eps_low_is (eq. 5). None: no lower bound (the paper's choice)."""
    eps_high_is: float | None = 4.0
    """IS weight upper bound 1 + eps_high_is (eq. 5). None: no upper bound. Paper: unpublished."""
    is_bounds_by_sign: bool = False
    """False: eps_low_is / eps_high_is bound every token's weight. True (DISPO): they bound the
    tokens with A >= 0 (correct responses) and eps_low_is_neg / eps_high_is_neg those with A < 0."""
    eps_low_is_neg: float | None = None
    """With is_bounds_by_sign: lower weight bound 1 - eps_low_is_neg of A < 0 tokens. None: none."""
    eps_high_is_neg: float | None = None
    """With is_bounds_by_sign: upper weight bound 1 + eps_high_is_neg of A < 0 tokens. None: none."""
    mask_rule: str = "none"
    """Token mask M (eq. 7): ``none`` (M = 1), ``ppo`` (PPO's trust region, eps_low/eps_high),
    ``ppo-low`` (its lower half only: A < 0, r < 1 - eps_low) or ``ppo-high`` (its upper half
    only: A > 0, r > 1 + eps_high), or DPPO's divergence masks (arXiv 2602.04879): ``dppo-tv`` (A > 0 tokens
    with p - p_old > delta_high, A <= 0 tokens with p_old - p > delta_low dropped, p = pi(o_it)) or ``dppo-kl``
    (the binary KL between Bernoulli(p_old) and Bernoulli(p) above delta_high / delta_low, in the same
    directions)."""
    eps_low: float = 0.2
    """PPO trust region lower edge 1 - eps_low: masks A < 0 tokens below it (eq. 7).
    Also defines ``frac_ppo_dropped`` under every mask rule."""
    eps_high: float = 0.2
    """PPO trust region upper edge 1 + eps_high: masks A > 0 tokens above it (eq. 7).
    Also defines ``frac_ppo_dropped`` under every mask rule."""
    delta_low: float = 0.15
    """DPPO's divergence bound on the way down (``dppo-tv``, ``dppo-kl``): A <= 0 tokens whose probability fell
    by more than it (TV: p_old - p; KL: the binary KL, with p < p_old) are masked. Paper / verl recipe: 0.15 (TV),
    0.05 (KL)."""
    delta_high: float = 0.15
    """DPPO's divergence bound on the way up (``dppo-tv``, ``dppo-kl``): A > 0 tokens whose probability rose by
    more than it (TV: p - p_old; KL: the binary KL, with p > p_old) are masked. Paper / verl recipe: 0.15 (TV),
    0.05 (KL)."""
    aggregation: str = "token-mean"
    """How per-token terms become a scalar: ``token-mean`` (sum / total tokens),
    ``seq-mean-token-mean`` (mean over sequences of per-sequence means),
    ``seq-mean-token-sum-norm`` (sum / (num_seqs * token_sum_norm), Dr. GRPO),
    ``prompt-mean-token-mean`` (mean over prompts of the mean over their G responses' tokens, ScaleRL;
    needs each row's group mean length)."""
    token_sum_norm: float | None = None
    """Constant length for ``seq-mean-token-sum-norm`` (e.g. max new tokens).
    None: the padded length T of the batch (then split batches are not exact)."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to the reference policy. 0: no KL term (the paper's choice)."""
    kl_estimator: str = "k3"
    """KL estimator: ``k1`` (log pi - log pi_ref) or ``k3`` (r - 1 - log r, r = pi_ref / pi)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus: loss -= entropy_coef * agg_{i,t}(H_it), H_it the full-vocabulary
    entropy of pi_theta at response token t, with its gradient, aggregated as the policy term (verl's
    ``actor.entropy_coeff``; TRL's ``entropy_coef``, which is the token mean: the same under token-mean).
    0: off (every preset's)."""
    max_log_ratio: float | None = 20.0
    """Clamp of log r (and log s) to +-max_log_ratio before exp, for finite weights. None: off."""

    def __post_init__(self) -> None:
        _check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        _check_choice("mask_rule", self.mask_rule, MASK_RULES)
        _check_choice("aggregation", self.aggregation, AGGREGATIONS)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        for name in ("eps_low_is", "eps_high_is", "eps_low_is_neg", "eps_high_is_neg", "eps_low", "eps_high",
                     "kl_coef", "delta_low", "delta_high", "entropy_coef"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"ObjectiveConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.eps_low > 1:
            raise ValueError(f"ObjectiveConfig.eps_low must be <= 1 (bound 1 - eps_low >= 0), got {self.eps_low}")
        for name in ("token_sum_norm", "max_log_ratio"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value > 0 and math.isfinite(value)):
                raise ValueError(f"ObjectiveConfig.{name} must be a finite number > 0 or None, got {value!r}")


PRESETS: dict[str, ObjectiveConfig] = {
    # MiniMax-M1: weight capped above and detached, every token keeps its gradient.
    "cispo": ObjectiveConfig(),
    # Plain PPO-clip with a token-level loss.
    "ppo": ObjectiveConfig(eps_high_is=None, mask_rule="ppo", eps_low=0.2, eps_high=0.2),
    # DeepSeekMath's GRPO: PPO-clip, mean within each sequence then over sequences.
    "grpo": ObjectiveConfig(
        eps_high_is=None, mask_rule="ppo", eps_low=0.2, eps_high=0.2, aggregation="seq-mean-token-mean"
    ),
    # DAPO: clip-higher (0.2 / 0.28) and the token-level loss.
    "dapo": ObjectiveConfig(eps_high_is=None, mask_rule="ppo", eps_low=0.2, eps_high=0.28),
    # GSPO: sequence-level ratio and trust region, per-sequence normalisation.
    "gspo": ObjectiveConfig(
        ratio_level="sequence",
        eps_high_is=None,
        mask_rule="ppo",
        eps_low=3e-4,
        eps_high=4e-4,
        aggregation="seq-mean-token-mean",
    ),
    # IS-weighted REINFORCE: no clipping, no mask.
    "reinforce": ObjectiveConfig(eps_high_is=None),
    # CISPO plus one half of DAPO's trust region (which half CISPO needs): the capped, detached weight and the
    # token-level loss of CISPO, DAPO's 0.2 / 0.28.
    "cispo_lowmask": ObjectiveConfig(mask_rule="ppo-low", eps_low=0.2, eps_high=0.28),
    "cispo_highmask": ObjectiveConfig(mask_rule="ppo-high", eps_low=0.2, eps_high=0.28),
    # DPPO (arXiv 2602.04879): the trust region on the probability itself, not the ratio; an unbounded detached
    # weight (the paper's recipe sets verl's truncation clip_ratio_c to 10000: off) and the token-level loss.
    # Thresholds: verl's DPPO recipe (TV 0.15, binary KL 0.05). prime-rl's default loss is dppo_tv at 0.2.
    "dppo_tv": ObjectiveConfig(eps_high_is=None, mask_rule="dppo-tv", delta_low=0.15, delta_high=0.15),
    "dppo_kl": ObjectiveConfig(eps_high_is=None, mask_rule="dppo-kl", delta_low=0.05, delta_high=0.05),
}


_DR_GRPO = ("Dr. GRPO is a recipe, not an objective preset: it sets the advantages too "
            "(algo.advantage_estimator=drgrpo, R - group mean); `cispo train recipe=dr_grpo` (cispo.config.recipes). "
            "Its loss alone: preset('ppo', aggregation='seq-mean-token-sum-norm', token_sum_norm=<the longest "
            "response>)")
RECIPE_NAMES: dict[str, str] = {
    "dr_grpo": _DR_GRPO, "drgrpo": _DR_GRPO, "dr-grpo": _DR_GRPO,
    "scalerl": "ScaleRL is a recipe, not an objective preset: it sets the advantages, the sampling and the head's "
               "precision too; `cispo train recipe=scalerl` (cispo.config.recipes). Its loss alone: "
               "preset('cispo', aggregation='prompt-mean-token-mean')",
}
"""Names of papers whose settings span sections (`cispo.config.recipes`), each with the answer `preset` gives
for it: a recipe, never a near preset (``dr_grpo`` is not ``grpo``)."""


def preset(name: str, **overrides) -> ObjectiveConfig:
    """The named preset (``cispo``, ``ppo``, ``grpo``, ``dapo``, ``gspo``, ``reinforce``, ``cispo_lowmask``,
    ``cispo_highmask``, ``dppo_tv``, ``dppo_kl``), with any field replaced by ``overrides``
    (e.g. ``preset("cispo", eps_high_is=2.0)``).
    A recipe's name (``dr_grpo``, ``scalerl``: `RECIPE_NAMES`) is refused with the recipe to use."""
    if name in RECIPE_NAMES:
        raise ValueError(f"unknown objective preset {name!r}: {RECIPE_NAMES[name]}")
    if name not in PRESETS:
        raise ValueError(f"unknown objective preset {name!r}{did_you_mean(name, PRESETS)}; known: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ObjectiveConfig)}
    for key in overrides:
        if key not in fields:
            raise ValueError(f"ObjectiveConfig has no field {key!r}{did_you_mean(key, fields)}")
    return dataclasses.replace(PRESETS[name], **overrides)
