"""The agents search's warm start script (studies/results/agents/warm_start.py, amendment 3, now `cispo sft` with its
options; tests/training/test_sft.py checks which tokens the loss counts): a run learns and writes a folder the
trainer can load."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from cispo.data.tasks import wordmath_calc
from cispo.models.loading import load_policy
from cispo.models.packaged import save_tiny_smollm2

SCRIPT = Path(__file__).resolve().parent.parent / "results" / "agents" / "warm_start.py"


@pytest.fixture(scope="module")
def warm():
    spec = importlib.util.spec_from_file_location("warm_start", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_warm_start_on_the_tiny_model_learns_and_saves_a_loadable_folder(warm, tmp_path):
    tiny = save_tiny_smollm2(tmp_path / "tiny")
    out = tmp_path / "warm"
    record = warm.warm_start(str(tiny), out, calculator=True, numbers="small", n=8, data_seed=1, epochs=6, batch=8,
                             lr=3e-3, seed=0)
    assert len(record["losses"]) == 6 and record["losses"][-1] < record["losses"][0] - 0.5
    assert json.loads((out / "warm_start.json").read_text())["losses"] == record["losses"]
    before, _ = load_policy(tiny)
    after, tok = load_policy(out / "final")
    assert tok.chat_template and not torch.equal(before.lm_head.weight, after.lm_head.weight)


def test_own_number_calls_are_calls_made_of_the_problems_numbers():
    spec = importlib.util.spec_from_file_location("agent_tables", SCRIPT.parent / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    problem = "A box holds 12 coins. How many coins are in 3 boxes?"
    assert tables.own_number_call(problem, "12 * 3 = <calc>12*3</calc><result>36</result>\n#### 36")
    assert tables.own_number_call(problem, "<calc>2+3</calc> then <calc>3 * 12</calc>")  # the second is own
    assert not tables.own_number_call(problem, "You have a calculator: write <calc>2+3</calc>")  # the echo
    assert not tables.own_number_call(problem, "<calc>12*4</calc>") and not tables.own_number_call(problem, "12 * 3")
    assert not tables.own_number_call(problem, "<calc></calc>")
    assert not tables.own_number_call(problem, "<calc>x</calc>")


def test_a_call_share_mixes_called_and_hand_written_answers_under_the_calculators_prompt():
    mixed = wordmath_calc.mixed_demonstrations(1, 256, "small", 0.125)
    calc = wordmath_calc.demonstrations(1, 256)
    called = [m for m in mixed if any("<calc>" in t for t, _ in m["parts"])]
    assert 16 <= len(called) <= 48 and [m["messages"] for m in mixed] == [c["messages"] for c in calc]
    assert mixed == wordmath_calc.mixed_demonstrations(1, 256, "small", 0.125)  # seeded
    assert all(wordmath_calc.reward(None, "".join(t for t, _ in m["parts"]), m["answer"]) == 1.0 for m in mixed)
