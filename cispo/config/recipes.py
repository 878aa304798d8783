"""Recipes: a paper's settings across the config's sections, as one name.

An objective preset (`cispo.objective.presets`) fixes the loss alone; a paper's algorithm often also
fixes the advantages (``algo.advantage_estimator``), the sampling (``rollout.*``) or the model's
precision (``model.*``), which no preset can carry. A recipe is a frozen list of ``key=value``
overrides, every one an existing setting, so the resolved ``config.yaml`` names only cispo's keys.

``cispo train recipe=scalerl lr=3e-6``: ``recipe=NAME`` stands for its overrides, in its place among
the others (later ones win; `expand_recipes`), and names the default run folder
(``scalerl__addition__seed0``). In Python: ``apply_overrides(TrainConfig(),
recipe_overrides("scalerl"))``. Plain data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from cispo.config.engine import ConfigError
from cispo.foundations.suggest import did_you_mean

__all__ = ["RECIPES", "Recipe", "expand_recipes", "named_recipe", "recipe_overrides"]


@dataclass(frozen=True)
class Recipe:
    """A paper's settings: ``overrides`` (``key=value``, applied in order), the ``paper``, and what of it
    cispo does not have (``missing``; "" when nothing)."""

    overrides: tuple[str, ...]
    paper: str
    missing: str = ""


RECIPES: dict[str, Recipe] = {
    # Dr. GRPO: PPO's clipped loss (0.2) summed over each response's tokens and divided by a constant
    # (the longest response, rollout.max_new_tokens: cispo.training.setup.make_objective), and advantages
    # R - mean of the group, no std. No KL term (the default).
    "dr_grpo": Recipe(
        ("algo.objective=ppo", "algo.objective.aggregation=seq-mean-token-sum-norm",
         "algo.advantage_estimator=drgrpo"),
        "Dr. GRPO, Liu et al. 2025, 'Understanding R1-Zero-Like Training: A Critical Perspective', arXiv 2503.20783",
    ),
    # ScaleRL: CISPO with the weight capped at 5, prompt-level loss averaging, batch-level advantage
    # normalisation, zero-variance groups dropped and not resampled (one generation round), FP32 LM head.
    "scalerl": Recipe(
        ("algo.objective=cispo", "algo.objective.eps_high_is=4.0",
         "algo.objective.aggregation=prompt-mean-token-mean", "algo.advantage_estimator=batch-std",
         "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=1", "model.fp32_lm_head=true",
         "data.retire_pass_rate=0.9"),
        "ScaleRL, Khatri et al. 2025, 'The Art of Scaling Reinforcement Learning Compute for LLMs', arXiv 2510.13786",
        "PipelineRL-8 "
        "(asynchronous generation; cispo alternates: algo.updates_per_batch updates per generation batch), forced "
        "length interruptions; its IS ratio is anchored on the generator's log-probs, cispo's on the recomputed "
        "logp_old (docs/objective.md)",
    ),
}


def recipe_overrides(name: str) -> list[str]:
    """The ``key=value`` overrides of recipe ``name``; ConfigError for an unknown one (naming the known)."""
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}{did_you_mean(name, RECIPES)}; known: {', '.join(RECIPES)}")
    return list(RECIPES[name].overrides)


def expand_recipes(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """``overrides`` with each ``recipe=NAME`` replaced, in its place, by the recipe's overrides. A key given
    before the recipe that the recipe also sets is refused (`ConfigError`): the recipe would replace it
    silently; given after it, it overrides the recipe's value (the order is the command line's)."""
    out: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
        if not (sep and key.strip() == "recipe"):
            out.append(item)
            continue
        recipe = recipe_overrides(value.strip())
        sets = {k.partition("=")[0].strip().split(".")[-1]: k.partition("=")[0].strip() for k in recipe}
        for earlier in out:
            leaf = earlier.partition("=")[0].strip().split(".")[-1]
            if leaf in sets:
                raise ConfigError(f"override {earlier!r} comes before recipe={value.strip()}, which sets "
                                  f"{sets[leaf]} itself and would replace it: put recipe= first")
        out.extend(recipe)
    return out


def named_recipe(overrides: list[str] | tuple[str, ...]) -> str | None:
    """The recipe ``overrides`` name (``recipe=NAME``; the last one), else None. ``cispo train`` names the default
    run folder after it (``{recipe}__{task}__seed{seed}``, `cispo.records.runfolder.run_name`), so a recipe's run
    and the default run of the same task and seed do not want one folder."""
    names = [item.partition("=")[2].strip() for item in overrides
             if isinstance(item, str) and item.partition("=")[0].strip() == "recipe" and "=" in item]
    return names[-1] if names else None
