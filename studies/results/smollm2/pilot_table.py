"""The SmolLM2 pilot's table (queue.md), read from the committed run folders' ``summary.json``:
per run the greedy held-out accuracy under ``wordmath_working`` before -> after, the final
held-out answer length and the share of final answers cut at the 64-token limit (``eval/truncated``,
logged from session 14 on; a descriptive column added in session 15 after DAPO seed 1 ran to the limit;
for the three seed-0 runs, which came before it, measured in session 16 by re-evaluating their final
checkpoint, ``posthoc_eval.json`` beside ``summary.json``, marked "re-evaluated"); per objective the
mean gain; per seed the paired differences of the final accuracy CISPO - DAPO and CISPO - GRPO, with
their mean and range. A pilot: three seeds give no
test worth the name, so none is computed. A last table (added in session 16, after all runs but one
were in; descriptive) says how far the objectives' updates could differ at all: per run, over its
steps, the mean share of tokens whose IS weight CISPO's cap bounds (``objective/frac_capped``), the
mean share PPO's trust region drops or would drop (``objective/frac_ppo_dropped``, logged for every
objective at its own edges eps_low / eps_high: CISPO's defaults 0.2 / 0.2, DAPO's 0.2 / 0.28), the
mean ``objective/approx_kl`` and the largest ratio (``objective/ratio_max``).

    python studies/results/smollm2/pilot_table.py            # from the repository root

Run #1 (CISPO, seed 0) is stage D of the search, ``studies/results/smollm2/run_working_s0``; the
others are ``studies/results/smollm2/pilot/<objective>_s<seed>``. A run not yet in is shown as such.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cispo.foundations.jsonl import has_jsonl, read_jsonl_bytes

ROOT = Path(__file__).parent
OBJECTIVES = ("cispo", "dapo", "grpo")
SEEDS = (0, 1, 2)


def run_dir(objective: str, seed: int) -> Path:
    """Where the pilot's run of (objective, seed) is committed."""
    if (objective, seed) == ("cispo", 0):
        return ROOT / "run_working_s0"
    return ROOT / "pilot" / f"{objective}_s{seed}"


def read_run(path: Path) -> dict | None:
    """{before, after, gain, length, cut, cut_reevaluated} from ``summary.json`` (and ``posthoc_eval.json``);
    None while the run is not in."""
    summary = path / "summary.json"
    if not summary.exists():
        return None
    s = json.loads(summary.read_text())
    acc = s["eval/accuracy"]
    cut = s.get("eval/truncated")  # logged from session 14 on: None for the runs before
    cut = None if cut is None else cut["after"]
    posthoc = path / "posthoc_eval.json"  # the final checkpoint re-evaluated (``cispo eval``), for those runs
    if cut is None and posthoc.exists():
        again = json.loads(posthoc.read_text())["metrics"]
        if again["eval/accuracy_greedy"] != acc["after"]:
            raise SystemExit(f"{posthoc}: re-evaluated accuracy {again['eval/accuracy_greedy']} "
                             f"!= logged {acc['after']}")
        return {**read_summary(s), "cut": again["eval/truncated"], "cut_reevaluated": True}
    return {**read_summary(s), "cut": cut, "cut_reevaluated": False}


def read_summary(s: dict) -> dict:
    """{before, after, gain, length} of one run's ``summary.json``."""
    acc = s["eval/accuracy"]
    return {"before": acc["before"], "after": acc["after"], "gain": acc["after"] - acc["before"],
            "length": s["eval/response_length"]["after"]}


def trust_region(path: Path) -> dict | None:
    """Step means of the clip diagnostics in ``metrics.jsonl`` (committed as ``metrics.jsonl.gz``;
    steps with an update only)."""
    metrics = path / "metrics.jsonl"
    if not has_jsonl(metrics):
        return None
    rows = [r for r in map(json.loads, read_jsonl_bytes(metrics).decode().splitlines()) if "objective/frac_capped" in r]
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {"steps": len(rows), "capped": mean("objective/frac_capped"),
            "dropped": mean("objective/frac_ppo_dropped"), "kl": mean("objective/approx_kl"),
            "ratio_max": max(r["objective/ratio_max"] for r in rows)}


def paired(runs: dict, a: str, b: str) -> list[float]:
    """Final accuracy a - b on every seed where both runs are in."""
    return [runs[a, s]["after"] - runs[b, s]["after"] for s in SEEDS if runs.get((a, s)) and runs.get((b, s))]


def table(runs: dict) -> str:
    """The markdown tables: runs, per-objective mean gain, paired differences."""
    lines = ["| objective | seed | held-out before | after | gain | final answer length (tokens) "
             "| final answers cut at the limit |",
             "|---|---|---|---|---|---|---|"]
    for o in OBJECTIVES:
        for s in SEEDS:
            r = runs.get((o, s))
            cut = ("not logged" if r is None or r["cut"] is None else
                   f"{r['cut']:.0%}" + (" (re-evaluated)" if r["cut_reevaluated"] else ""))
            lines.append(f"| {o} | {s} | " + ("not yet run | | | | |" if r is None else
                         f"{r['before']:.2f} | {r['after']:.2f} | {r['gain']:+.2f} | {r['length']:.1f} | {cut} |"))
    lines += ["", "| objective | runs in | mean gain | gains |", "|---|---|---|---|"]
    for o in OBJECTIVES:
        gains = [runs[o, s]["gain"] for s in SEEDS if runs.get((o, s))]
        mean = f"{sum(gains) / len(gains):+.3f}" if gains else "-"
        lines.append(f"| {o} | {len(gains)} of {len(SEEDS)} | {mean} | {', '.join(f'{g:+.2f}' for g in gains)} |")
    lines += ["", "| paired final accuracy | seeds | mean | range |", "|---|---|---|---|"]
    for b in ("dapo", "grpo"):
        d = paired(runs, "cispo", b)
        stats = f"{sum(d) / len(d):+.3f} | {min(d):+.2f} .. {max(d):+.2f}" if d else "- | -"
        lines.append(f"| cispo - {b} | {len(d)} | {stats} |")
    lines += ["", "| objective | seed | steps with an update | tokens capped (CISPO's weight bound) "
              "| tokens PPO's mask drops or would drop | mean approx KL | largest ratio |",
              "|---|---|---|---|---|---|---|"]
    for o in OBJECTIVES:
        for s in SEEDS:
            t = trust_region(run_dir(o, s))
            if t is not None:
                capped = f"{t['capped']:.2%}" if o == "cispo" else "- (no weight bound)"
                lines.append(f"| {o} | {s} | {t['steps']} | {capped} | {t['dropped']:.2%} | {t['kl']:.4f} "
                             f"| {t['ratio_max']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    runs = {(o, s): read_run(run_dir(o, s)) for o in OBJECTIVES for s in SEEDS}
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
