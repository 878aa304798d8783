"""Install metadata: the verl.plugins entry point, the dependency bounds of pyproject.toml, and
install hints that name the documented routes (docs/install.md, docs/integrations.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from cispo.integrations.verl import verl_available

REPO = Path(__file__).resolve().parents[2]

needs_verl = pytest.mark.skipif(
    not verl_available(), reason="verl is not installed (pip install verl; see docs/integrations.md)"
)


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _extra(name: str) -> dict[str, str]:
    """pyproject's optional-dependency ``name`` as {package: specifier}."""
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in _pyproject()["project"]["optional-dependencies"][name]]
    return {r.name: str(r.specifier) for r in reqs}


def test_tested_versions_bound_the_extras_and_others_warn():
    """The trl / verl / vllm extras allow exactly TESTED_VERSIONS; another version warns, naming both."""
    from packaging.specifiers import SpecifierSet

    from cispo.integrations import TESTED_VERSIONS, is_tested_version, warn_if_untested

    for package, extra in (("trl", "trl"), ("verl", "verl"), ("trl", "bench"), ("vllm", "vllm")):
        low, high = TESTED_VERSIONS[package]
        assert SpecifierSet(_extra(extra)[package]) == SpecifierSet(f">={low},<{high}"), extra
    assert is_tested_version("trl", "1.16.0") and is_tested_version("trl", "1.16.3")
    assert not is_tested_version("trl", "1.17.0") and not is_tested_version("trl", "1.17.0.dev0")
    assert is_tested_version("verl", "0.9.1") and not is_tested_version("verl", "0.9.0")
    assert is_tested_version("vllm", "0.33.0") and not is_tested_version("vllm", "0.34.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_untested("verl", "HINT", version="0.9.1")
    with pytest.warns(UserWarning, match=r"tested with verl >= 0.9.1, < 0.10; this is verl 0.11.0.*HINT"):
        assert warn_if_untested("verl", "HINT", version="0.11.0")


def test_dependency_floors_and_the_packaging_downgrade():
    """transformers >= 4.56: load_policy passes from_pretrained(dtype=...), which older versions
    ignore. [verl-min-deps] keeps tensordict < 0.9: tensordict 0.9.1 / 0.10 need pyvers 0.1,
    which pins packaging < 26 and so downgraded it silently."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    train = SpecifierSet(_extra("train")["transformers"])
    assert not train.contains("4.55.4") and train.contains("4.56.2")
    tensordict = SpecifierSet(_extra("verl-min-deps")["tensordict"])
    assert tensordict.contains("0.8.3") and not any(tensordict.contains(v) for v in ("0.9.1", "0.10.0"))
    assert Version("0.8.3") in SpecifierSet(">=0.8,!=0.9.0,<=0.10.0")  # still what verl 0.9.1 allows


def test_install_hints_name_the_documented_route():
    """The ImportError hints give the install commands that docs/integrations.md documents."""
    from cispo.integrations import trl as cispo_trl
    from cispo.integrations import verl as cispo_verl

    docs = (REPO / "docs" / "integrations.md").read_text() + (REPO / "README.md").read_text()
    assert "pip install --no-deps verl==0.9.1" in cispo_verl.INSTALL_HINT and "verl-min-deps" in cispo_verl.INSTALL_HINT
    assert "cispo[verl]" not in cispo_verl.INSTALL_HINT and "cispo[trl]" not in cispo_trl.INSTALL_HINT
    for route in ("pip install --no-deps verl==0.9.1", '".[verl-min-deps]"', 'pip install "trl>=1.16,<1.17"'):
        assert route in docs, route


def test_every_extra_an_install_hint_names_exists():
    """Each ``cispo[x]`` / ``".[x]"`` that the package, the benchmarks or the docs tell users to
    install is an optional-dependency of pyproject.toml."""
    import re

    extras = set(_pyproject()["project"]["optional-dependencies"])
    files = [*(REPO / "cispo").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"), *(REPO / "docs").glob("*.md"),
             REPO / "README.md"]
    named = {(f.relative_to(REPO).as_posix(), x) for f in files
             for m in re.finditer(r"(?:cispo|[\"']\.)\[([a-z0-9_,-]+)\]", f.read_text()) for x in m.group(1).split(",")}
    assert len(named) > 10 and {x for _, x in named} >= {"code", "vllm", "lora", "math", "data"}
    assert sorted((f, x) for f, x in named if x not in extras) == []


def _entry_points_from_pyproject(group: str) -> dict[str, str]:
    return _pyproject()["project"].get("entry-points", {}).get(group, {})


@needs_verl
def test_verl_plugin_entry_point_registers_losses_on_import_verl(tmp_path):
    """pyproject declares a "verl.plugins" entry point; installed (here: a dist-info with
    pyproject's entry points, shadowing the installed cispo's), a plain `import verl` in a
    fresh process loads it, and get_policy_loss_fn finds every cispo_unified_<preset>."""
    eps = _entry_points_from_pyproject("verl.plugins")
    assert eps == {"cispo": "cispo.integrations.verl"}
    dist = tmp_path / "cispo-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: cispo\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[verl.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    code = """
import sys
import torch
assert "cispo.integrations.verl" not in sys.modules
import verl  # loads the verl.plugins entry points
assert "cispo.integrations.verl" in sys.modules, "verl did not load the entry point"
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from cispo.objective.loss import PRESETS
for name in PRESETS:
    fn = get_policy_loss_fn(f"cispo_unified_{name}")
logp = torch.zeros(2, 3)
loss, metrics = get_policy_loss_fn("cispo_unified_grpo")(
    old_log_prob=logp, log_prob=logp + 0.1, advantages=torch.ones(2, 3), response_mask=torch.ones(2, 3),
    loss_agg_mode="seq-mean-token-mean", config={"policy_loss": {"loss_mode": "cispo_unified_grpo"}})
assert torch.isfinite(loss) and "cispo/frac_capped" in metrics
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "VERL_USE_EXTERNAL_PLUGINS": "auto"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_the_dev_extra_installs_peft_so_the_lora_tests_run():
    """Issue 59: `pip install -e ".[dev]"` (the README's test command) left peft out, so every LoRA test skipped."""
    assert "lora" in _pyproject()["project"]["optional-dependencies"]["dev"][0].partition("[")[2].rstrip("]").split(",")
