"""The versions of other projects that cispo's code was written and checked against.

``TESTED_VERSIONS`` is the one list: the bounds of the ``trl`` / ``verl`` / ``vllm`` extras in
pyproject.toml (``tests/test_install.py`` checks they agree), and the range outside which
using the matching part of cispo warns once. Imports no cispo module.
"""

from __future__ import annotations

import importlib.metadata
import sys
import warnings

TESTED_VERSIONS: dict[str, tuple[str, str]] = {
    "trl": ("1.16.0", "1.17"),
    "verl": ("0.9.1", "0.10"),
    # VLLMSampler's engine arguments, weight push, sleep / wake and FP32 head were written against
    # the source of vLLM 0.33.0 (and checked with a stand-in engine); not yet run on a GPU.
    "vllm": ("0.33.0", "0.34"),
}
"""package -> (lowest tested version, first untested version): the range ``[low, high)``."""

USERS = {"trl": "cispo.integrations.trl", "verl": "cispo.integrations.verl", "vllm": "cispo.rollout.VLLMSampler"}
"""package -> the part of cispo that depends on it (named in the warning)."""


def is_tested_version(package: str, version: str) -> bool:
    """True when ``version`` of ``package`` lies in ``TESTED_VERSIONS[package]`` (``[low, high)``,
    pre-releases of ``high`` excluded)."""
    from packaging.version import Version  # a dependency of trl, verl, vllm and transformers

    low, high = TESTED_VERSIONS[package]
    v = Version(version)
    return Version(low) <= v and v.release < Version(high).release


def installed_version(package: str) -> str | None:
    """The installed distribution's version, else the imported module's ``__version__``, else None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # e.g. a source tree on PYTHONPATH, a stand-in module
        return getattr(sys.modules.get(package), "__version__", None)


def warn_if_untested(package: str, install_hint: str, version: str | None = None) -> bool:
    """Warn (``UserWarning``) when ``version`` (default: the installed one) of ``package`` is
    outside the tested range; return whether it warned. The parts of cispo that use these
    packages call or override interfaces that may change between versions."""
    version = version or installed_version(package)
    try:
        tested = version is None or is_tested_version(package, version)
    except ValueError:  # not a PEP 440 version (e.g. a local build's tag): say so rather than guess
        tested = False
    if tested:
        return False
    low, high = TESTED_VERSIONS[package]
    warnings.warn(
        f"{USERS[package]} is tested with {package} >= {low}, < {high}; this is {package} {version}. "
        f"It relies on {package} interfaces that may have changed: check the results, or install a tested "
        f"version: {install_hint}",
        stacklevel=3,
    )
    return True
