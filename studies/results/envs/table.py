"""The tables of the guess-the-number search (search-plan.md) from the raw run data in this folder.

    python studies/results/envs/table.py            # prints markdown

Reads each run folder's ``metrics.jsonl`` (the held-out evaluations, the per-step rollout metrics) and
``samples.jsonl.gz`` (every training episode: its segments and per-turn rewards), and ``stage0/eval.txt`` (the
base model's evaluation). Per step of an RL run, over its 32 sampled games: the solve rate, the mean return
(solved + the turn rewards), the mean guesses of a solved game, the share of policy turns whose line is unreadable,
the share of readable guesses inside the interval the answers so far leave (consistent), and the share of first
guesses that halve 1..15 (8) — the last two numbers chosen after seeing the transcripts.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from cispo.data.tasks.guess_number import read_guess  # noqa: E402


def rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def base_eval() -> dict:
    """The JSON block of ``stage0/eval.txt`` (``cispo eval``'s printout)."""
    text = (HERE / "stage0" / "eval.txt").read_text()
    return json.loads(re.search(r"\{.*\}", text, re.S).group(0))


def eval_row(name: str, step, m: dict) -> str:
    """One evaluation: greedy and sampled solve rates, turns, turn reward, return, truncation."""
    sampled = m.get("eval/accuracy_mean_at_8", float("nan"))
    # every policy turn was stepped (and so rewarded) unless cut by the length: then exact, else approximate
    ret = sampled + m["eval/turn_reward_mean"] * m["eval/turns"]
    return (f"| {name} | {step} | {m['eval/accuracy_greedy']:.2f} | {sampled:.2f} | {m['eval/turns']:.2f} | "
            f"{m['eval/turn_reward_mean']:+.3f} | {ret:+.2f} | {m['eval/truncated']:.2f} |")


def policy_lines(sample: dict) -> list[str]:
    """Each policy segment's line (its text up to the newline)."""
    return [s["text"].split("\n", 1)[0] for s in sample["segments"] if s["role"] == "policy"]


def consistency(sample: dict) -> tuple[int, int]:
    """(readable guesses inside the interval the environment's answers so far leave, readable guesses)."""
    lo, hi, inside, total, last = 1, 15, 0, 0, None
    for seg in sample["segments"]:
        text = seg["text"].split("\n", 1)[0].strip()
        if seg["role"] == "policy":
            last = read_guess(text)
            if last is not None:
                total, inside = total + 1, inside + (lo <= last <= hi)
        elif last is not None and text in ("higher", "lower"):
            lo, hi = (max(lo, last + 1), hi) if text == "higher" else (lo, min(hi, last - 1))
    return inside, total


def step_stats(samples: list[dict]) -> dict:
    """Per-step numbers over the step's sampled games (module docstring)."""
    n = len(samples)
    returns = [s["task_reward"] + sum(s.get("turn_rewards") or []) for s in samples]
    solved = [s for s in samples if s["task_reward"] >= 1.0]
    lines = [line for s in samples for line in policy_lines(s)]
    counts = [consistency(s) for s in samples]
    firsts = [read_guess(policy_lines(s)[0]) if policy_lines(s) else None for s in samples]
    return {"n": n, "solve": len(solved) / n, "return": sum(returns) / n,
            "guesses_solved": (sum(len(policy_lines(s)) for s in solved) / len(solved)) if solved else float("nan"),
            "unreadable": sum(read_guess(line) is None for line in lines) / max(len(lines), 1),
            "first_8": sum(f == 8 for f in firsts) / n,
            "consistent": sum(i for i, _ in counts) / max(sum(t for _, t in counts), 1)}


def run_tables(run: Path) -> str:
    metrics = rows(run / "metrics.jsonl")
    samples = rows(run / "samples.jsonl.gz")
    out = [f"### {run.name}", "", "Held-out (every secret once: greedy 15 games, sampled 8 x 15 at temperature 1.0):",
           "", "| model | step | greedy solve | sampled solve | turns | turn reward | return (sampled) | truncated |",
           "|---|---|---|---|---|---|---|---|"]
    out += [eval_row(run.name, r["step"], r) for r in metrics if "eval/accuracy_greedy" in r]
    out += ["", "Training games per step (32 sampled at temperature 1.0):", "",
            "| step | solve | return | guesses when solved | unreadable turns | consistent guesses | first guess 8 |",
            "|---|---|---|---|---|---|---|"]
    steps = sorted({s["step"] for s in samples})
    for step in steps:
        st = step_stats([s for s in samples if s["step"] == step])
        out.append(f"| {step} | {st['solve']:.2f} | {st['return']:+.2f} | {st['guesses_solved']:.2f} | "
                   f"{st['unreadable']:.2f} | {st['consistent']:.2f} | {st['first_8']:.2f} |")
    return "\n".join(out)


def main() -> None:
    print("| model | step | greedy solve | sampled solve | turns | turn reward | return (sampled) | truncated |")
    print("|---|---|---|---|---|---|---|---|")
    print(eval_row("base (stage 0)", "-", base_eval()))
    print()
    runs = [p for p in HERE.iterdir() if (p / "metrics.jsonl").exists() and (p / "samples.jsonl.gz").exists()]
    for run in sorted(runs):
        print(run_tables(run))
        print()


if __name__ == "__main__":
    main()
