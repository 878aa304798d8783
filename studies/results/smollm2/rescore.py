"""How many answers the word-problem verifier paid in the SmolLM2 runs would the stricter verifier of
2026-12-04 (issue 44: every number after the stated answer must equal it; ASCII digits; exact
comparison) no longer pay? Only the logged training samples (samples.jsonl.gz) can be re-scored:
held-out completions were not saved. The gold answer of a paid sample is the answer the old verifier
read (it was judged equal to the gold one).

    python studies/results/smollm2/rescore.py
"""

import gzip
import json
import subprocess
from pathlib import Path

from cispo.data.tasks import wordmath

OLD_VERIFIER = "74dc63e~1:cispo/data/tasks/wordmath.py"  # the verifier the runs were scored with


def old_extract_answer():
    src = subprocess.run(["git", "show", OLD_VERIFIER], capture_output=True, text=True, check=True).stdout
    namespace = {"__name__": "old_wordmath"}
    exec(compile(src, "old_wordmath.py", "exec"), namespace)
    return namespace["extract_answer"]


def main() -> None:
    extract = old_extract_answer()
    here = Path(__file__).parent
    total_paid = total_flipped = 0
    for run in sorted(p.parent for p in here.rglob("samples.jsonl.gz")):
        config = (run / "config.yaml").read_text()
        reward = wordmath.reward_working if "task: wordmath_working" in config else wordmath.reward
        rows = [json.loads(line) for line in gzip.open(run / "samples.jsonl.gz")]
        paid = [r for r in rows if r["task_reward"] == 1.0]
        flipped = [r for r in paid if reward(r["prompt"], r["completion"], answer=extract(r["completion"])) != 1.0]
        total_paid, total_flipped = total_paid + len(paid), total_flipped + len(flipped)
        print(f"{run.relative_to(here)}: {len(rows)} logged, {len(paid)} paid, {len(flipped)} no longer paid")
    print(f"all: {total_flipped} of {total_paid} paid samples no longer paid")


if __name__ == "__main__":
    main()
