"""Arms of a comparison: a name for an objective preset with some of its fields changed.

An arm is what one row of a comparison table trains: ``ArmConfig(objective="cispo",
objective_overrides={"aggregation": "seq-mean-token-mean"})`` is CISPO with GRPO's
sequence-mean aggregation. The built-in arms (``BUILTIN_ARMS``) are the six presets under
their own names plus the ablations of the study; a comparison can define more
(``CompareConfig.arm_defs``, from YAML or ``arm_defs.NAME.objective=...`` on the command line).
The arm's name names its run folders and its rows in every table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from cispo.foundations.suggest import did_you_mean
from cispo.objective.presets import PRESETS, preset


@dataclass
class ArmConfig:
    """One arm: an objective preset, fields of it replaced, and run overrides of its own."""

    objective: str = "cispo"
    """Objective preset (a name of ``cispo.objective.loss.PRESETS``)."""
    objective_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of ``ObjectiveConfig`` to replace (``algo.objective_overrides``), e.g.
    ``{"eps_high_is": 2.0}`` or ``{"aggregation": "seq-mean-token-mean"}``."""
    train: list[str] = field(default_factory=list)
    """``key=value`` TrainConfig overrides for this arm's runs only, applied after the
    comparison's own (e.g. ``["rollout.dynamic_sampling=false"]``). Keep the learning rate
    out of here: it is tuned or set in ``CompareConfig.learning_rates``."""

    def __post_init__(self) -> None:
        preset(self.objective, **self.objective_overrides)  # unknown preset / field / bad value -> ValueError


# The CISPO cap ablation: eps_high_is, the IS weight is capped at 1 + eps_high_is (eq. 5).
CAP_VALUES = (0.2, 1.0, 2.0, 4.0, 8.0)

BUILTIN_ARMS: dict[str, ArmConfig] = {
    **{name: ArmConfig(objective=name) for name in PRESETS},  # grpo, dapo, cispo, ppo, gspo, reinforce
    # CISPO with GRPO's aggregation: mean over tokens within each response, then over responses.
    "cispo_seqmean": ArmConfig(objective="cispo", objective_overrides={"aggregation": "seq-mean-token-mean"}),
    # cispo_cap0.2 ... cispo_cap8; cispo_cap4 is the `cispo` preset itself (eps_high_is = 4).
    **{f"cispo_cap{v:g}": ArmConfig(objective="cispo", objective_overrides={"eps_high_is": v}) for v in CAP_VALUES},
}

_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


def resolve_arms(names: list[str], arm_defs: dict[str, ArmConfig]) -> dict[str, ArmConfig]:
    """name -> ArmConfig for each of ``names``, in order: ``arm_defs`` first, then the built-in
    arms. An unknown name, a repeated one or one unfit for a folder name is a ``ValueError``."""
    known = {**BUILTIN_ARMS, **arm_defs}
    out: dict[str, ArmConfig] = {}
    for name in names:
        if not _NAME.fullmatch(name) or "__" in name:
            raise ValueError(f"arms: {name!r} is not a usable arm name (letters, digits, _ . + - only, no '__': "
                             "it names run folders)")
        if name not in known:
            raise ValueError(f"arms: unknown arm {name!r}{did_you_mean(name, known)}; built-in: "
                             f"{', '.join(BUILTIN_ARMS)}; define more in arm_defs")
        if name in out:
            raise ValueError(f"arms: {name!r} is listed twice")
        out[name] = known[name]
    return out


def describe(arm: ArmConfig) -> str:
    """``cispo`` / ``cispo(eps_high_is=2)`` / ``dapo + rollout.dynamic_sampling=false``."""
    text = arm.objective
    if arm.objective_overrides:
        text += "(" + ", ".join(f"{k}={v}" for k, v in arm.objective_overrides.items()) + ")"
    return text + "".join(f" + {o}" for o in arm.train)
