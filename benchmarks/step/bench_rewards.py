"""What running rewards in worker processes costs per call, against calling them in the main thread.

    python benchmarks/step/bench_rewards.py                  # B=256 calls per batch (32 prompts x G=8)
    python benchmarks/step/bench_rewards.py --tiny
    python benchmarks/step/bench_rewards.py --batch 1024 --workers 1 2 4 8

One batch = one step's reward calls, as `cispo.training.sampling.sample_groups` makes them: ``B``
``(prompt, completion, sample)`` triples scored by one `cispo.data.rewards.score_rewards` call. Two
rewards, each loaded from a file spec like a user's (``file.py:fn``):

* ``trivial``: returns ``len(completion) % 2`` -- the pure dispatch cost (pickling the call,
  the pipe to the worker, the result back, the per-call output capture);
* ``math``: `cispo.data.rewards.math.math_reward` on GSM8K-like completions (math-verify parses
  and compares) -- a realistic verifier.

Paths: ``main`` (``data.reward_isolation=main``: called one after another in this thread) and
``pool, W workers`` (the default for user rewards; the pool is started and warm before timing,
its cold start is reported apart). Columns: median wall seconds per batch over ``--repeats``
interleaved runs, microseconds per call, and the ratio to the main-thread path.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import interleaved, median, spread, table  # noqa: E402

REWARDS = '''
from cispo.data.rewards.math import math_reward

def trivial(prompt, completion, **sample):
    return float(len(completion) % 2)

def math(prompt, completion, **sample):
    return math_reward(prompt, completion, **sample)
'''


def make_calls(batch: int) -> list[tuple[str, str, dict]]:
    calls = []
    for i in range(batch):
        a, b = 17 + i, 25 + 3 * i
        answer = a + b if i % 3 else a + b + 1  # a third are wrong
        prompt = f"Tom has {a} apples and buys {b} more. How many apples does he have?"
        completion = f"Tom starts with {a} apples. He buys {b} more, so {a} + {b} = {a + b}.\n#### {answer}"
        calls.append((prompt, completion, {"answer": str(a + b), "messages": [{"role": "user", "content": prompt}]}))
    return calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256, help="reward calls per batch (P x G)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="B=32, 1 and 2 workers, 2 repeats (a smoke run)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.batch, args.workers, args.repeats = 32, [1, 2], 2

    from cispo.data.rewards import score_rewards
    from cispo.data.rewards.loading import load_reward
    from cispo.data.rewards.pool import shutdown_pools

    calls = make_calls(args.batch)
    tmp = tempfile.TemporaryDirectory()
    path = Path(tmp.name) / "bench_rewards_fns.py"
    path.write_text(REWARDS)
    rows = []
    try:
        for name in ("trivial", "math"):
            spec = f"{path}:{name}"
            runs = {"main": (load_reward(spec, isolation="main"), None)}
            for w in args.workers:
                runs[f"pool, {w} worker{'s' if w > 1 else ''}"] = (load_reward(spec, workers=w), None)
            cold = {}
            for label, (reward, _) in runs.items():  # start each pool (and check every path agrees)
                t0 = time.perf_counter()
                out = score_rewards(reward, calls, 60.0)
                cold[label] = time.perf_counter() - t0
                assert all(e is None for _, e in out), out[:3]
            fns = {label: (lambda r=reward: score_rewards(r, calls, 60.0)) for label, (reward, _) in runs.items()}
            times = interleaved(fns, args.repeats, warmup=0)
            base = median(times["main"])
            for label, ts in times.items():
                m = median(ts)
                rows.append([name, label, m, spread(ts), 1e6 * m / len(calls), m / base, cold[label]])
    finally:
        shutdown_pools()
        tmp.cleanup()
    print(f"B = {len(calls)} reward calls per batch; median of {args.repeats} interleaved runs")
    print(table(["reward", "path", "s / batch", "spread", "us / call", "x main", "first batch s (cold)"], rows))


if __name__ == "__main__":
    main()
