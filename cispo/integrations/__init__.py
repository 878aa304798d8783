"""Use the unified objective (``cispo.objective.policy_loss``) inside other RL frameworks.

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

import importlib.metadata
import sys
import warnings

TESTED_VERSIONS: dict[str, tuple[str, str]] = {"trl": ("1.16.0", "1.17"), "verl": ("0.9.1", "0.10")}
"""package -> (lowest tested version, first untested version): the range ``[low, high)`` the
integration was tested on (also the bounds of the ``trl`` / ``verl`` extras in pyproject.toml)."""


def is_tested_version(package: str, version: str) -> bool:
    """True when ``version`` of ``package`` lies in ``TESTED_VERSIONS[package]`` (``[low, high)``,
    pre-releases of ``high`` excluded)."""
    from packaging.version import Version  # a dependency of both trl and verl

    low, high = TESTED_VERSIONS[package]
    v = Version(version)
    return Version(low) <= v and v.release < Version(high).release


def installed_version(package: str) -> str | None:
    """The installed distribution's version, else the imported module's ``__version__``, else None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # e.g. a source tree on PYTHONPATH
        return getattr(sys.modules.get(package), "__version__", None)


def warn_if_untested(package: str, install_hint: str, version: str | None = None) -> bool:
    """Warn (``UserWarning``) when ``version`` (default: the installed one) of ``package`` is
    outside the tested range; return whether it warned. The integrations override or call
    framework internals that may change between versions."""
    version = version or installed_version(package)
    if version is None or is_tested_version(package, version):
        return False
    low, high = TESTED_VERSIONS[package]
    warnings.warn(
        f"cispo.integrations.{package} is tested with {package} >= {low}, < {high}; this is {package} {version}. "
        f"It relies on {package} internals that may have changed: check the results, or install a tested "
        f"version: {install_hint}",
        stacklevel=3,
    )
    return True
