"""The agents search's tables (search-plan.md, docs/agents.md), read from the committed run folders
(``<run>/metrics.jsonl.gz``): per run, the held-out evaluations (greedy accuracy, the share of answers
that call the calculator, answer length), then per training step the sampled responses' accuracy and
tool-call rate and the fork numbers of the calculator call ``<calc>`` (the task's fork string): how many
``<calc>`` tokens the step had, their mean probability under the old policy (``fork/calc/p_old``), the share
whose IS weight CISPO's cap bounds (``fork/calc/frac_capped``) and the share PPO's / DAPO's trust region
would drop (``fork/calc/frac_ppo_dropped``, at the run's eps_low / eps_high). A step whose responses held
no ``<calc>`` shows "—" for the fork columns; a step missing from the table kept no group (every group
all right or all wrong after the refill rounds: ``rollout/groups_kept`` 0, no update). Last, for each file of
held-out answers (``cispo eval --samples``: ``*_samples.jsonl.gz``), the share of answers that call the
calculator and the **own-number call rate** (amendment 3): the share with a call whose every number appears in
the problem's text (`own_number_call`; the instruction's echo ``2+3`` counts only where the problem has a 2 and
a 3). Between them, per run, steps 1-5 in sums and means (`early_steps`): what the trust region's halves would
drop while the call is still rare, and the first step at which the kept batch's tool-call rate reaches 0.9.

Which answers each column covers: a held-out evaluation's accuracy is greedy (100 answers); its tool-call rate
and length are the sampled answers' where the run sampled (``eval.num_samples``: 4 a problem at the training
temperature, 400) and the greedy ones' otherwise. A training step's columns are those of the **kept** groups
only, the responses the update trained on (dynamic sampling drops a group whose responses are all right or all
wrong and samples again, up to 4 prompts kept: 32 responses, fewer where the refill rounds ran out). A file of
held-out answers holds the greedy answers and, where sampled, the sampled ones, all counted together.

    python studies/results/agents/tables.py            # from the repository root; prints Markdown
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from cispo.foundations.jsonl import has_jsonl, read_jsonl_bytes

ROOT = Path(__file__).parent
EVAL = (("eval/accuracy_greedy", "accuracy", ".2f"), ("eval/tool_call_rate", "tool-call rate", ".2f"),
        ("eval/response_length", "length", ".1f"))
STEP = (("rollout/accuracy", "accuracy", ".3f"), ("rollout/tool_call_rate", "tool-call rate", ".3f"),
        ("fork/calc/count", "`<calc>` tokens", ".0f"), ("fork/calc/p_old", "p_old", ".3f"),
        ("fork/calc/frac_capped", "capped", ".2f"), ("fork/calc/frac_ppo_dropped", "PPO would drop", ".2f"))


EARLY = range(1, 6)
"""The steps of `early_steps`: while the call is rare (stage F's kept batches call in 9-28 % of responses)."""
NUMBER = re.compile(r"\d+")
CALL = re.compile(r"<calc>(.*?)</calc>", re.S)


def own_number_call(problem: str, completion: str) -> bool:
    """Whether ``completion`` makes a calculator call (``<calc>E</calc>``) whose numbers are all numbers of
    ``problem``'s text (at least one number)."""
    own = set(NUMBER.findall(problem))
    return any((found := NUMBER.findall(call)) and set(found) <= own for call in CALL.findall(completion))


def answer_files() -> list[Path]:
    """The committed files of held-out answers, in name order."""
    return sorted(ROOT.glob("*_samples.jsonl.gz"))


def call_rates(path: Path) -> tuple[int, float, float, float]:
    """``(answers, accuracy, share that call the calculator, own-number call rate)`` of a file of answers."""
    rows = [json.loads(line) for line in read_jsonl_bytes(path).splitlines() if line.strip()]
    n = max(len(rows), 1)
    return (len(rows), sum(r["reward"] for r in rows) / n, sum("<calc>" in r["completion"] for r in rows) / n,
            sum(own_number_call(r["prompt"], r["completion"]) for r in rows) / n)


def runs() -> list[Path]:
    """The committed run folders, in name order."""
    return sorted(p for p in ROOT.iterdir() if p.is_dir() and has_jsonl(p / "metrics.jsonl"))


def read_metrics(run: Path) -> list[dict]:
    """The run's metrics, one dict per logged row."""
    return [json.loads(line) for line in read_jsonl_bytes(run / "metrics.jsonl").splitlines() if line.strip()]


def bounds(run: Path) -> tuple[float, float]:
    """(eps_low, eps_high) of the run's objective: the preset named in its ``config.yaml`` with its overrides
    (what its ``frac_ppo_dropped``, ``pos_above`` and mass columns count against)."""
    import yaml

    from cispo.objective.presets import preset

    algo = yaml.safe_load((run / "config.yaml").read_text())["algo"]
    name = algo["objective"] if isinstance(algo["objective"], str) else algo["objective"]["name"]
    extra = algo.get("objective_overrides") or {}
    if isinstance(algo["objective"], dict):
        extra = {k: v for k, v in algo["objective"].items() if k != "name" and v != "preset"}
    cfg = preset(name, **extra) if extra else preset(name)
    return cfg.eps_low, cfg.eps_high


def first_step_at(rows: list[dict], key: str, threshold: float) -> int | None:
    """The first logged step whose ``key`` is at least ``threshold`` (None: never)."""
    return next((r["step"] for r in rows if r.get(key) is not None and r[key] >= threshold), None)


def early_steps(rows: list[dict]) -> dict:
    """Steps 1-5 (`EARLY`) of a run: sums of the positive ``<calc>`` tokens (``fork/calc/pos``), of those above
    1 + eps_high (``pos_above``: the upper mask drops them) and of those also at p_old < 0.1
    (``pos_lowp_above``); means over the steps that logged them of the gradient-mass proxy's shares
    ``objective/all_pos_mass_above`` (every positive token, above 1 + eps_high) and
    ``objective/all_neg_mass_below`` (every negative token, below 1 - eps_low); and the first step at which the
    kept batch's tool-call rate (``rollout/tool_call_rate``) reached 0.9, a threshold chosen after stage F's data."""
    early = [r for r in rows if r["step"] in EARLY]

    def total(key):
        return sum(r.get(key) or 0 for r in early)

    def mean(key):
        found = [r[key] for r in early if r.get(key) is not None]
        return sum(found) / len(found) if found else None

    return {"pos": total("fork/calc/pos"), "pos_above": total("fork/calc/pos_above"),
            "pos_lowp_above": total("fork/calc/pos_lowp_above"), "pos_mass": mean("objective/all_pos_mass_above"),
            "neg_mass": mean("objective/all_neg_mass_below"),
            "kept_90": first_step_at(rows, "rollout/tool_call_rate", 0.9)}


def early_table(found: list[Path]) -> list[str]:
    """`early_steps` of every run with ``<calc>`` fork counts, one Markdown row each."""
    out = ["| run | bounds 1 - eps_low, 1 + eps_high | positive `<calc>` tokens | of them above 1 + eps_high "
           "| of those at p_old < 0.1 | positive mass above (all tokens) | negative mass below (all tokens) "
           "| kept batch's tool-call rate first >= 0.9 |", "|---" * 8 + "|"]
    for run in found:
        rows = read_metrics(run)
        if not any("fork/calc/pos" in r for r in rows):
            continue
        e, (lo, hi) = early_steps(rows), bounds(run)
        out.append(f"| {run.name} | {1 - lo:g}, {1 + hi:g} | {e['pos']:.0f} | {e['pos_above']:.0f} "
                   f"| {e['pos_lowp_above']:.0f} | {cell(e['pos_mass'], '.3f')} | {cell(e['neg_mass'], '.3f')} "
                   f"| {cell(e['kept_90'], 'd')} |")
    return out


def cell(value, fmt: str) -> str:
    """``value`` in ``fmt`` ("—" for a missing one)."""
    return "—" if value is None else format(value, fmt)


def table(rows: list[dict], columns: tuple, key: str) -> list[str]:
    """Markdown rows of ``columns`` ((metric, header, format), ...) for the rows that log ``key``; the fork
    columns of a step without a ``<calc>`` token are missing."""
    out = ["| step | " + " | ".join(name for _, name, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for r in rows:
        if key not in r:
            continue
        calls = r.get("fork/calc/count") or 0
        values = [None if k.startswith("fork/calc/") and k != "fork/calc/count" and not calls
                  else calls if k == "fork/calc/count" else r.get(k) for k, _, _ in columns]
        out.append(f"| {r['step']} | " + " | ".join(cell(v, f) for v, (_, _, f) in zip(values, columns)) + " |")
    return out


def main() -> None:
    found = runs()
    if not found:
        sys.exit(f"no run folders with metrics.jsonl(.gz) under {ROOT}")
    for run in found:
        rows = read_metrics(run)
        sampled = any(r.get("eval/accuracy_mean_at_4") is not None for r in rows)
        covers = "the 400 sampled answers (4 a problem, temperature 0.7)" if sampled else "the same greedy answers"
        print(f"## {run.name}\n\nHeld-out: accuracy of 100 greedy answers; tool-call rate and length of {covers}:\n")
        print("\n".join(table(rows, EVAL, "eval/accuracy_greedy")))
        print("\nTraining steps: the kept groups' responses (at most 4 prompts x 8, the groups the update trained "
              "on after dynamic sampling's filter):\n")
        print("\n".join(table(rows, STEP, "rollout/accuracy")) + "\n")
    print("## Steps 1-5: what the trust region's halves would drop while the call is rare\n\nSums over steps 1-5 "
          "(tokens counted once, in the update that trained them); mass: the share of the gradient-mass proxy "
          "(1 - p)|w A| beyond the run's own bound, mean over the steps that logged it; the last column is the "
          "first training step (any step) whose kept batch reached 0.9, a threshold chosen after stage F's data. "
          "Each run counts at its own objective's bounds (second column).\n")
    print("\n".join(early_table(found)) + "\n")
    print("## Held-out answers (cispo eval --samples)\n\nEach file's greedy answers (100) and, where the run "
          "sampled, its sampled ones (400), counted together.\n\n| file | answers | accuracy | call the calculator "
          "| own-number call rate |\n|---|---|---|---|---|")
    for path in answer_files():
        n, accuracy, calls, own = call_rates(path)
        print(f"| `{path.name}` | {n} | {accuracy:.2f} | {calls:.2f} | {own:.2f} |")


if __name__ == "__main__":
    main()
