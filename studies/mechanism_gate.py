"""Study v3's gate (studies/results/protocol.md, amendment of 2026-12-02): does the paper's
mechanism act in a run? Read from the run's ``metrics.jsonl`` (the mechanism check of
`cispo.training.metrics`), with the criteria declared before the gate run:

(i)  persistence: ``objective/fork_pos_lowp_above`` (positive-advantage fork tokens with
     p_old < 0.1 and r > 1 + eps_high, counted per update) > 0 in at least `MIN_LATE_STEPS`
     of steps `LATE` (on `chain` they occurred only in steps 1-4);
(ii) size: the mean over steps 1..`LAST_STEP` (steps without a positive fork token left out)
     of ``objective/fork_pos_mass_above`` (the share of the positive fork tokens'
     gradient-mass proxy (1 - p)|w A| above 1 + eps_high) is >= `MIN_MASS_SHARE` and >=
     `MIN_MASS_RATIO` x the same mean of ``objective/other_pos_mass_above``.

Study v4 re-bases both criteria on every token (`gate_all_tokens`, ``--all-tokens``).

``python -m studies.mechanism_gate RUN/metrics.jsonl`` prints the figures and the verdict
(a committed run under studies/results/ has ``RUN/metrics.jsonl.gz``: either name reads it).
"""

from __future__ import annotations

import json
import math
import sys

from cispo.records.tracking import read_metrics

LATE = range(11, 41)
MIN_LATE_STEPS = 15
LAST_STEP = 40
MIN_MASS_SHARE = 0.10
MIN_MASS_RATIO = 1.5


def _mean(values: list[float]) -> float:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def gate(rows: list[dict]) -> dict:
    """The gate's figures and verdict from a run's metric rows (step 0, the evaluation, has none)."""
    steps = {r["step"]: r for r in rows if r.get("step", 0) >= 1 and "objective/fork_pos_lowp_above" in r}
    late = [s for s in LATE if s in steps]
    late_hits = sum(steps[s]["objective/fork_pos_lowp_above"] > 0 for s in late)
    early = [steps[s] for s in sorted(steps) if s <= LAST_STEP]
    fork_share = _mean([r.get("objective/fork_pos_mass_above") for r in early])
    other_share = _mean([r.get("objective/other_pos_mass_above") for r in early])
    persistence = late_hits >= MIN_LATE_STEPS
    size = fork_share >= MIN_MASS_SHARE and fork_share >= MIN_MASS_RATIO * other_share
    return {
        "steps_logged": len(steps), "late_steps_logged": len(late), "late_steps_with_paper_case": late_hits,
        "paper_case_count_by_phase": {f"{a}-{b}": sum(steps[s]["objective/fork_pos_lowp_above"]
                                                      for s in steps if a <= s <= b)
                                      for a, b in ((1, 10), (11, 20), (21, 40))},
        "fork_pos_mass_above_mean": fork_share, "other_pos_mass_above_mean": other_share,
        "persistence": persistence, "size": size, "mechanism_acts": persistence and size,
        "complete": len(late) == len(LATE),
    }


def paper_case_all_tokens(row: dict) -> float | None:
    """A step's count of the paper's case on every response token (A > 0, p_old < 0.1, r > 1 + eps_high,
    over its updates): ``objective/all_pos_lowp_above``, or for runs logged before that metric (study v3)
    the sum of the per-string counts ``fork/<s>/pos_lowp_above`` (the strings and ``other`` partition
    the tokens, so the two are equal); None when the step logged neither."""
    if "objective/all_pos_lowp_above" in row:
        return row["objective/all_pos_lowp_above"]
    counts = [v for k, v in row.items() if k.startswith("fork/") and k.endswith("/pos_lowp_above")]
    return sum(counts) if counts else None


def gate_all_tokens(rows: list[dict]) -> dict:
    """Study v4's gate (studies/results/protocol.md, amendment of 2026-12-04), v3's two criteria re-based on
    every token: (i) persistence — the paper's case (`paper_case_all_tokens`) > 0 in at least
    `MIN_LATE_STEPS` of steps `LATE`; (ii) size — the mean over steps 1..`LAST_STEP` (steps without a
    positive token left out) of ``objective/all_pos_mass_above`` (the share of every positive token's
    gradient-mass proxy above 1 + eps_high) is >= `MIN_MASS_SHARE`. Both must hold."""
    steps = {r["step"]: r for r in rows if r.get("step", 0) >= 1 and paper_case_all_tokens(r) is not None}
    late = [s for s in LATE if s in steps]
    late_hits = sum(paper_case_all_tokens(steps[s]) > 0 for s in late)
    share = _mean([steps[s].get("objective/all_pos_mass_above") for s in sorted(steps) if s <= LAST_STEP])
    persistence, size = late_hits >= MIN_LATE_STEPS, share >= MIN_MASS_SHARE
    return {
        "steps_logged": len(steps), "late_steps_logged": len(late), "late_steps_with_paper_case": late_hits,
        "paper_case_count_by_phase": {f"{a}-{b}": sum(paper_case_all_tokens(steps[s]) for s in steps if a <= s <= b)
                                      for a, b in ((1, 10), (11, 20), (21, 40))},
        "all_pos_mass_above_mean": share, "persistence": persistence, "size": size,
        "mechanism_acts": persistence and size, "complete": len(late) == len(LATE),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    all_tokens = "--all-tokens" in args
    args = [a for a in args if a != "--all-tokens"]
    if len(args) != 1:
        print("usage: python -m studies.mechanism_gate [--all-tokens] RUN/metrics.jsonl[.gz]  "
              "(--all-tokens: study v4's gate)", file=sys.stderr)
        return 2
    rows = read_metrics(args[0])
    print(json.dumps(gate_all_tokens(rows) if all_tokens else gate(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
