"""Stage A of search-plan.md, read from `cispo eval --samples` files: per temperature, the share of
problems whose sampled answers are neither all right nor all wrong (q, an informative group) and
the share of right samples that end within 64 tokens.

    python studies/results/smollm2/stage_a.py studies/results/smollm2/stageA/stageA_1.0.jsonl.gz \
        studies/results/smollm2/stageA/stageA_0.7.jsonl.gz
"""
import gzip
import json
import sys
from collections import defaultdict


def stage_a(path: str) -> dict:
    """q = #{prompts with 0 < right < n} / #prompts over the sampled records; short = share of the
    right sampled answers with length <= 64 tokens."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    by_prompt = defaultdict(list)
    for r in rows:
        if r["mode"] != "greedy":
            by_prompt[r["prompt_index"]].append(r["reward"] > 0)
    right = [r for r in rows if r["mode"] != "greedy" and r["reward"] > 0]
    informative = sum(0 < sum(v) < len(v) for v in by_prompt.values())
    return {"file": path, "prompts": len(by_prompt), "samples": sum(map(len, by_prompt.values())),
            "right_samples": len(right), "informative": informative,
            "q": informative / max(1, len(by_prompt)),
            "greedy_right": sum(r["reward"] > 0 for r in rows if r["mode"] == "greedy"),
            "right_within_64": sum(r["length"] <= 64 for r in right) / max(1, len(right))}


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(json.dumps(stage_a(p)))
