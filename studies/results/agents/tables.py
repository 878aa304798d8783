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
a 3).

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
        print(f"## {run.name}\n\nHeld-out (100 greedy answers):\n")
        print("\n".join(table(rows, EVAL, "eval/accuracy_greedy")))
        print("\nTraining steps (4 prompts x 8 sampled responses, more with refills):\n")
        print("\n".join(table(rows, STEP, "rollout/accuracy")) + "\n")
    print("## Held-out answers (cispo eval --samples)\n\n| file | answers | accuracy | call the calculator "
          "| own-number call rate |\n|---|---|---|---|---|")
    for path in answer_files():
        n, accuracy, calls, own = call_rates(path)
        print(f"| `{path.name}` | {n} | {accuracy:.2f} | {calls:.2f} | {own:.2f} |")


if __name__ == "__main__":
    main()
