"""Sampling beside training (``rollout.async_steps=1``, docs/async.md) against the synchronous loop, on the
SmolLM2 workload of ``bench_trl_smollm2.py``: steps per second of the RL step itself
(`cispo.training.rl_step.RLStep`).

    python benchmarks/rollout/bench_async.py                  # builtin:smollm2-135m, 4 prompts x 8, 64 tokens, K = 4
    python benchmarks/rollout/bench_async.py --tiny           # the built-in tiny model (a smoke run)

Two trainers (``_common.ours_setup``: the model loaded as ``cispo train`` loads it, fp32, the FP32 head, EOS
suppressed so every response has the same length, ``algo.logp_old=rollout`` on both sides so that only the
overlap differs) take the same prompts in the same order. ``sync``: the synchronous ``RLStep``, at ``--threads``
torch threads (default 2: the whole machine for each phase in turn). ``async``: an ``RLStep`` with a
`cispo.training.prefetch.Prefetch` — the next batch sampled in a thread with its own copy of the weights
while the trainer updates — at half the threads per side (`split_threads`, as a run sets them). Two warm-up
steps each (the async side's first step samples its own batch), then ``--rounds`` steps each, alternating
which side goes first. Printed: per side the median seconds per step with the trainer's wait for the next
batch (``perf/sample_wait_s``) and the sampler thread's own time, then sync / async per round and the
median. Not a test: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import machine_note, median, ours_setup, set_threads, table, with_prefetch  # noqa: E402


def step(setup: dict, threads: int) -> dict:
    """One RL step (``setup["rl_step"]``) at ``threads`` torch threads; its metrics with its wall seconds."""
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    m = setup["rl_step"]()
    m["wall"] = time.perf_counter() - t0
    return m


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the sync side (async: half per side)")
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model on addition, 2 x 2 rows, 1 round")
    a = p.parse_args(argv)
    threads = set_threads(a.threads)
    extra = ("algo.logp_old=rollout",)
    if a.tiny:
        common = dict(size="tiny", prompts=2, group_size=2, updates=2, max_new_tokens=4, suppress_eos=True)
        a.rounds = 1
    else:
        from cispo.data.tasks import get_task

        samples = get_task("wordmath").train_samples(0, (a.rounds + 3) * a.prompts)
        common = dict(model_path=a.model, task="wordmath", samples=samples, prompts=a.prompts, group_size=a.group,
                      updates=a.updates, max_new_tokens=a.max_new_tokens, suppress_eos=True)
        extra += ("model.dtype=float32",)
    setups = {"sync": ours_setup(extra=extra, **common), "async": with_prefetch(ours_setup(extra=extra, **common))}
    per_side = {"sync": threads, "async": max(1, threads // 2)}
    for side in setups:  # warm-up: first calls, the static-cache decode's buffers; async's first batch is its own
        for _ in range(2):
            step(setups[side], per_side[side])
    runs = {side: [] for side in setups}
    for r in range(a.rounds):
        for side in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
            runs[side].append(step(setups[side], per_side[side]))
    setups["async"]["rl_step"].prefetch.close()
    rows = [[side, per_side[side], f"{median([m['wall'] for m in ms]):.2f}",
             f"{median([m.get('perf/sample_wait_s', 0.0) for m in ms]):.2f}",
             f"{median([m.get('perf/behaviour_sample_s', m.get('perf/sample_s', 0.0)) for m in ms]):.2f}",
             f"{median([m.get('perf/update_s', 0.0) for m in ms]):.2f}"] for side, ms in runs.items()]
    print(table(["side", "threads", "s/step", "wait for batch", "sampling", "update (incl. wait)"], rows))
    ratios = [s["wall"] / x["wall"] for s, x in zip(runs["sync"], runs["async"])]
    print("sync / async s/step per round: " + ", ".join(f"{x:.2f}" for x in ratios) + f"; median {median(ratios):.2f}x")
    print(machine_note(threads))


if __name__ == "__main__":
    main()
