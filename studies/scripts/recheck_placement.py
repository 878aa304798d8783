"""Where a chain run's policy rechecks, by phase (post hoc, descriptive; the gate runs of study v3).

From a run's ``samples.jsonl`` (the logged training completions, `log_samples_every` /
`max_samples_per_step`): for every step ``a+b`` of a well-formed completion (on the operands as
written), whether a ``W`` follows it, grouped into *buggy* (the task's `chain.TASK_BUGS`: the
base model errs there, so the recheck pays), *other carrying* and *no carry*; and how often a
buggy step's direct result is already right (a "direct fix", no recheck needed). From its
``metrics.jsonl`` (each read from its ``.gz`` in a run committed under studies/results/), per
phase: the ``W`` tokens of the training batches (`fork/w/count`), those with a positive advantage
(`fork/w/pos`), of them above 1 + eps_high (`fork/w/pos_above`) and the paper's case
(`fork/w/pos_lowp_above`), and their mean p_old.

    python -m studies.scripts.recheck_placement chain_hidden studies/results/v3/gate/chain_hidden_dapo_s100
"""

from __future__ import annotations

import json
import sys

from cispo.data.tasks import chain
from cispo.foundations.jsonl import read_jsonl_bytes

PHASES = ((1, 5), (6, 10), (11, 20), (21, 40))


def placement(task_name: str, rows: list[dict], phases=PHASES) -> dict:
    """``{"a-b": {group: {"steps", "w_rate"}, "buggy_direct_right", "responses"}}`` per phase."""
    bugs = chain.TASK_BUGS.get(task_name)
    out = {}
    for lo, hi in phases:
        counts = {g: [0, 0] for g in ("buggy", "other_carry", "no_carry")}
        direct_right = responses = 0
        for r in rows:
            if not lo <= r["step"] <= hi:
                continue
            steps = chain.parse_steps(r["completion"])
            if steps is None:
                continue
            responses += 1
            for st in steps:
                group = ("buggy" if chain.is_buggy(st.a, st.b, bugs)
                         else "other_carry" if chain.has_carry(st.a, st.b) else "no_carry")
                counts[group][0] += 1
                counts[group][1] += st.corrected is not None
                direct_right += group == "buggy" and st.result == st.a + st.b
        out[f"{lo}-{hi}"] = {
            "responses": responses,
            **{g: {"steps": n, "w_rate": w / n if n else None} for g, (n, w) in counts.items()},
            "buggy_direct_right": direct_right / counts["buggy"][0] if counts["buggy"][0] else None,
        }
    return out


def fork_counts(rows: list[dict], phases=PHASES) -> dict:
    """``{"a-b": {"w_tokens", "w_positive", "w_positive_above", "w_paper_case", "w_p_old_mean"}}``."""
    out = {}
    for lo, hi in phases:
        rs = [r for r in rows if lo <= r.get("step", 0) <= hi and "fork/w/count" in r]
        n = sum(r["fork/w/count"] for r in rs)
        out[f"{lo}-{hi}"] = {
            "w_tokens": n, "w_positive": sum(r["fork/w/pos"] for r in rs),
            "w_positive_above": sum(r["fork/w/pos_above"] for r in rs),
            "w_paper_case": sum(r["fork/w/pos_lowp_above"] for r in rs),
            "w_p_old_mean": sum((r["fork/w/p_old"] or 0.0) * r["fork/w/count"] for r in rs) / n if n else None,
        }
    return out


def _read(path) -> list[dict]:
    """The rows of ``path`` or, as committed under studies/results/, of ``path.gz``."""
    return [json.loads(line) for line in read_jsonl_bytes(path).decode().splitlines() if line.strip()]


if __name__ == "__main__":
    task, run = sys.argv[1], sys.argv[2]
    print(json.dumps({"placement_in_logged_samples": placement(task, _read(f"{run}/samples.jsonl")),
                      "w_tokens_in_training_batches": fork_counts(_read(f"{run}/metrics.jsonl"))}, indent=1))
