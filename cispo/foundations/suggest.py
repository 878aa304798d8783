"""The "did you mean" hint of every error message that names an unknown word."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: object, choices: Iterable[object], n: int = 1, cutoff: float = 0.6) -> str:
    """`` (did you mean 'x'?)`` naming the ``n`` choices closest to ``word`` (difflib's
    similarity ratio >= ``cutoff``), or ``""`` when none is that close."""
    return hint(closest(word, choices, n, cutoff))


def closest(word: object, choices: Iterable[object], n: int = 1, cutoff: float = 0.6) -> list[str]:
    """Up to ``n`` choices closest to ``word``, best first (difflib's similarity ratio >= ``cutoff``)."""
    return difflib.get_close_matches(str(word), [str(c) for c in choices], n=n, cutoff=cutoff)


def hint(suggestions: list[str]) -> str:
    """`` (did you mean 'x'?)`` for ``suggestions`` found some other way; ``""`` for none."""
    return f" (did you mean {' or '.join(repr(c) for c in suggestions)}?)" if suggestions else ""


# --------------------------------------------------------------------------- other frameworks' names

OTHER_NAMES: dict[str, tuple[str, tuple[str, ...], str]] = {
    # name: (where it comes from, cispo's key(s), what it is there)
    "beta": ("TRL", ("algo.objective_overrides.kl_coef",), "the KL penalty's coefficient (k3)"),
    "kl_coef": ("verl, TRL PPO", ("algo.objective_overrides.kl_coef",),
                "the KL coefficient (there a penalty in the reward; cispo's is a loss term)"),
    "use_kl_loss": ("verl", ("algo.objective_overrides.kl_coef",), "no switch here: a coefficient > 0 turns it on"),
    "kl_loss_coef": ("verl", ("algo.objective_overrides.kl_coef",), "the KL loss coefficient"),
    "kl_loss_type": ("verl", ("algo.objective_overrides.kl_estimator",), "k1 or k3 (verl's low_var_kl is k3)"),
    "num_generations": ("TRL", ("rollout.group_size",), "G, responses per prompt"),
    "num_iterations": ("TRL", ("algo.epochs",),
                       "passes over each generation batch (its optimizer steps: algo.updates_per_batch)"),
    "epsilon": ("TRL", ("algo.objective_overrides.eps_low",), "the clip's lower edge 1 - epsilon"),
    "epsilon_high": ("TRL", ("algo.objective_overrides.eps_high",),
                     "the clip's upper edge 1 + epsilon_high; with loss_type=cispo TRL caps the IS weight at "
                     "epsilon_high itself: eps_high_is = epsilon_high - 1"),
    "clip_ratio": ("verl", ("algo.objective_overrides.eps_low", "algo.objective_overrides.eps_high"),
                   "both edges of the clip 1 -/+ clip_ratio"),
    "clip_ratio_low": ("verl", ("algo.objective_overrides.eps_low",),
                       "the clip's lower edge; with loss_mode=cispo the IS weight's: eps_low_is"),
    "clip_ratio_high": ("verl", ("algo.objective_overrides.eps_high",),
                        "the clip's upper edge; with loss_mode=cispo the IS weight's: eps_high_is"),
    "loss_type": ("TRL", ("algo.objective",), "the objective preset (TRL's loss types in cispo: docs/integrations.md)"),
    "loss_mode": ("verl", ("algo.objective",), "the objective preset (verl's vanilla is ppo)"),
    "max_completion_length": ("TRL", ("rollout.max_new_tokens",), "the longest response, in tokens"),
    "max_response_length": ("verl", ("rollout.max_new_tokens",), "the longest response, in tokens"),
    "learning_rate": ("TRL", ("optim.lr",), "the peak learning rate"),
}
"""TRL's and verl's names of settings cispo has under another key: an unknown key with one of
these names gets cispo's key as its hint (`other_name_hint`). docs/integrations.md shows this
table (tests/test_config.py checks that the two agree)."""


def other_name_hint(name: str, keys: Iterable[str]) -> str:
    """`` (did you mean 'k'? 'beta' in TRL: ...)`` when ``name`` is one of `OTHER_NAMES` and its
    cispo key is among ``keys``: the key itself, a key below a dict field in ``keys``
    (``algo.objective_overrides``), or one given relative to its section (``kl_coef`` among
    ObjectiveConfig's fields); ``""`` otherwise."""
    if name not in OTHER_NAMES:
        return ""
    source, targets, what = OTHER_NAMES[name]
    keys = set(map(str, keys))
    found = [next((k for k in sorted(keys, key=len, reverse=True)
                   if t == k or t.startswith(k + ".") or t.endswith("." + k)), None) for t in targets]
    if None in found:
        return ""
    shown = [t if t.startswith(k + ".") else k for t, k in zip(targets, found)]
    return f" (did you mean {' and '.join(map(repr, shown))}? {name!r} in {source}: {what})"
