"""The agents search's tables (studies/results/agents/tables.py): tables.md is what the script prints from the
committed run folders, and the steps 1-5 numbers that docs/agents.md and search-plan.md quote for stage F's
runs are the data's."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "results" / "agents"


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("agents_tables", ROOT / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tables_md_is_what_the_script_prints(tables):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        tables.main()
    assert (ROOT / "tables.md").read_text() == out.getvalue()


def test_the_quoted_steps_1_to_5_of_stage_f(tables):
    early = {f"{o}_s{s}": tables.early_steps(tables.read_metrics(ROOT / f"stageF_{o}_s{s}"))
             for o in ("cispo", "dapo") for s in range(3)}
    dapo = [early[f"dapo_s{s}"] for s in range(3)]
    # DAPO's upper mask dropped 17 / 16 / 20 of the 51 / 47 / 55 positive <calc> tokens, 0 / 2 / 1 at p_old < 0.1
    assert [(e["pos_above"], e["pos"], e["pos_lowp_above"]) for e in dapo] == [(17, 51, 0), (16, 47, 2), (20, 55, 1)]
    assert [round(e["pos_mass"], 2) for e in dapo] == [0.30, 0.37, 0.32]  # all positive tokens' mass above 1.28
    assert [round(e["neg_mass"], 2) for e in dapo] == [0.18, 0.17, 0.10]  # the lower half's, below 0.8
    # the kept batch first at >= 0.9: CISPO 5 / 4 / 5, DAPO 7 / 5 / 6
    assert [early[f"cispo_s{s}"]["kept_90"] for s in range(3)] == [5, 4, 5]
    assert [e["kept_90"] for e in dapo] == [7, 5, 6]
    # the bounds each run counts at: CISPO's own eps_high 0.2, DAPO's 0.28
    assert tables.bounds(ROOT / "stageF_cispo_s0") == (0.2, 0.2)
    assert tables.bounds(ROOT / "stageF_dapo_s0") == (0.2, 0.28)
