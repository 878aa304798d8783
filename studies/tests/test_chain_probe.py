"""The chain-hidden base models as the gate study measured them (studies/results/v3/gate/): the shipped
models err on exactly the bug pairs (`studies.chain_probe`, rerun here on fewer prompts), and
`chain_hidden_graded`'s cost per unneeded recheck is the balanced cost at the measured rate of ``W``."""

import json
from pathlib import Path

import pytest

from cispo.data.tasks import chain as ch
from cispo.data.tasks import get_task

GATE = Path(__file__).resolve().parents[1] / "results" / "v3" / "gate"


@pytest.mark.parametrize("task_name,mean_max,pair_max,sampled_max", [("chain_hidden", 2e-3, 0.2, 1e-3),
                                                                    ("chain_hidden_sharp", 5e-5, 5e-4, 1e-4)])
def test_chain_hidden_base_model_errs_on_exactly_the_bug_pairs(task_name, mean_max, pair_max, sampled_max, one_thread):
    """The shipped base model drops the carry on the buggy pairs and adds every other step right,
    at the rates studies/results/v3/gate/<task>_base_model.json measured (8000 prompts; here 150 again),
    with `W` after a step at the trained ~4% wherever it is. P(right | buggy step) is a mean over
    steps (`mean_max`) and per pair (`pair_max`; a rare pair seen twice here can reach ~0.06 on
    chain_hidden); the sampled rate is checked on the measurement's >= 10^4 buggy steps."""
    from cispo.models.builtin import ensure_builtin_model
    from cispo.models.loading import load_policy
    from studies.chain_probe import probe

    model, tok = load_policy(ensure_builtin_model(task_name, progress=False))
    r = probe(model, tok, task_name, n_prompts=150, samples_per_step=1, seed=0)
    measured = json.loads((GATE / f"{task_name}_base_model.json").read_text())
    for report in (r, measured["probe"]):
        tf = report["teacher_forced"]
        assert tf["buggy"]["p_dropped"] > 0.99 and tf["buggy"]["p_right"] < mean_max
        assert tf["other_carry"]["p_right"] > 0.99 and tf["no_carry"]["p_right"] > 0.99
        assert all(0.02 < tf[g]["p_w"] < 0.06 for g in ("buggy", "other_carry", "no_carry"))
        for pair in report["per_pair"]:            # exactly the bug set: every buggy pair low, every other high
            assert (pair["p_right"] < pair_max) if pair["buggy"] else (pair["p_right"] > 0.5), pair
    sampled = measured["probe"]["sampled"]["buggy"]
    assert sampled["n"] >= 10_000 and sampled["right"] / sampled["n"] < sampled_max
    assert measured["probe"]["pairs_seen"] == {"buggy": 24, "other_carry": 48}


def test_graded_cost_is_the_balanced_cost_at_the_measured_base_model_rate():
    sampled = json.loads((GATE / "chain_hidden_sharp_base_model.json").read_text())["probe"]["sampled"]
    w = sum(g["w_after_written"] for g in sampled.values()) / sum(g["n_written"] for g in sampled.values())
    assert w == pytest.approx(0.0364, abs=5e-5)
    chains = [ch.parse_prompt(s["prompt"]) for s in get_task("chain_hidden_graded").train_samples(0, 20000)]
    assert ch.GRADED_COST == pytest.approx(ch.balanced_recheck_cost(chains, w, ch.HIDDEN_BUGS), abs=1e-3)
