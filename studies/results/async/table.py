"""The ``rollout.async_steps=1`` pilot's table (docs/async.md): the SmolLM2 example
(``examples/smollm2-wordmath.yaml``, seed 0) run synchronously and one step off policy, both with
``algo.logp_old=rollout`` (the async mode's anchor), read from the committed run folders: held-out greedy
accuracy at each evaluation, and over steps 2-19 (step 1 of the async run is sampled on-policy) the means of
the behaviour-vs-proximal gap (``rollout/logp_abs_diff``, ``rollout/mismatch_kl``), the largest IS ratio
(``objective/ratio_max``), the share CISPO's cap bounds (``objective/frac_capped``), the share PPO's region
would drop (``objective/frac_ppo_dropped``) and the step's seconds.

    python studies/results/async/table.py            # from the repository root; prints Markdown
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from cispo.foundations.jsonl import read_jsonl_bytes

ROOT = Path(__file__).parent
RUNS = (("synchronous", "pilot_sync_s0"), ("async_steps=1", "pilot_async1_s0"))
MEANS = (("rollout/logp_abs_diff", ".2g"), ("rollout/mismatch_kl", ".2g"), ("objective/ratio_max", ".2f"),
         ("objective/frac_capped", ".3f"), ("objective/frac_ppo_dropped", ".3f"), ("perf/step_s", ".1f"))


def read(folder: str) -> list[dict]:
    """One run's metrics rows."""
    return [json.loads(x) for x in read_jsonl_bytes(ROOT / folder / "metrics.jsonl").splitlines() if x.strip()]


def main() -> None:
    print("| run | accuracy at steps 0 / 7 / 14 / 19 | " + " | ".join(f"mean {k}" for k, _ in MEANS) + " |")
    print("|---" * (len(MEANS) + 2) + "|")
    for name, folder in RUNS:
        rows = read(folder)
        acc = " / ".join(f"{r['eval/accuracy_greedy']:.2f}" for r in rows if "eval/accuracy_greedy" in r)
        means = [statistics.mean(r[k] for r in rows if k in r and r["step"] >= 2) for k, _ in MEANS]
        print(f"| {name} | {acc} | " + " | ".join(format(m, f) for m, (_, f) in zip(means, MEANS)) + " |")


if __name__ == "__main__":
    main()
