"""Use the unified objective (``cispo.objective.loss.policy_loss``) inside other RL frameworks.

* ``cispo.integrations.verl``: registers ``cispo_unified`` (and ``cispo_unified_<preset>``)
  in verl's policy-loss registry; the preset and overrides come from verl's actor config.
* ``cispo.integrations.trl``: ``CISPOGRPOTrainer``, a ``trl.GRPOTrainer`` whose loss is
  ``policy_loss`` with an ``ObjectiveConfig`` given at construction, and
  ``objective_config_from_trl`` (TRL's ``loss_type`` / ``epsilon*`` as an ``ObjectiveConfig``).

Neither module needs its framework to be importable: the framework is imported when the
integration is used, and a missing one raises an ``ImportError`` that names the pip command.
Importing either with a framework version outside ``TESTED_VERSIONS`` warns once.
See ``docs/integrations.md``.
"""

from __future__ import annotations

from cispo.foundations.versions import TESTED_VERSIONS, installed_version, is_tested_version, warn_if_untested

__all__ = ["TESTED_VERSIONS", "installed_version", "is_tested_version", "warn_if_untested"]
