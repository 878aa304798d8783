"""``algo.logp_old=rollout`` against ``recompute`` (what skipping the logp_old pass saves): one RL step's time
with pi_old taken from the sampler's own log-probs (no logp_old pass) and with the trainer's recomputed pass,
on the SmolLM2 workload of ``bench_trl_smollm2.py`` (``wordmath`` chat prompts, G answers of L tokens with EOS
suppressed, K updates), interleaved in one process.

    python benchmarks/step/bench_logp_old.py                          # builtin:smollm2-135m, 2 prompts x 8, 32 tokens
    python benchmarks/step/bench_logp_old.py --prompts 4 --max-new-tokens 64 --rounds 2    # the full workload
    python benchmarks/step/bench_logp_old.py --tiny                   # the built-in tiny model (a smoke run)

Two trainers (``_common.ours_setup``: the model loaded as ``cispo train`` loads it, fp32, the FP32 head,
shared prompts) take the same prompts in the same order with the same seeds, so each step samples the
same responses on both sides; one warm-up step each, then ``--rounds`` steps each, alternating which
side goes first. Printed: per side the median s/step and its split (sample / score / logp_old / update
/ overhead), ``perf/logp_old_s`` being the whole of step 3 (collate, the pass), and each side's
train / rollout gap ``rollout/logp_abs_diff`` (for ``rollout``, measured by the first update on its
rows); then recompute / rollout step time, round by round and the median. Not a test: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import PHASES, machine_note, median, ours_setup, ours_steps, set_threads, table  # noqa: E402

MODES = ("recompute", "rollout")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model on addition, 2 x 2 rows, 1 round")
    a = p.parse_args(argv)
    threads = set_threads(a.threads)
    t0 = time.monotonic()
    if a.tiny:
        common = dict(size="tiny", prompts=2, group_size=2, updates=2, max_new_tokens=4, suppress_eos=True)
        a.rounds, a.model, a.prompts, a.group, a.max_new_tokens, a.updates = 1, "tiny", 2, 2, 4, 2
    else:
        from cispo.data.tasks import get_task

        samples = get_task("wordmath").train_samples(0, (a.rounds + 1) * a.prompts)
        common = dict(model_path=a.model, task="wordmath", samples=samples, prompts=a.prompts, group_size=a.group,
                      updates=a.updates, max_new_tokens=a.max_new_tokens, suppress_eos=True)
    setups = {m: ours_setup(extra=(f"algo.logp_old={m}", "model.dtype=float32") if not a.tiny else
                            (f"algo.logp_old={m}",), **common) for m in MODES}
    for m in MODES:  # warm-up: first calls, the static-cache decode's buffers
        ours_steps(setups[m], 1)
    runs = {m: [] for m in MODES}
    for r in range(a.rounds):
        for m in (MODES if r % 2 == 0 else MODES[::-1]):
            runs[m] += ours_steps(setups[m], 1)
    print(f"{a.model}: {a.prompts} prompts x G = {a.group}, {a.max_new_tokens} tokens (EOS suppressed), "
          f"K = {a.updates}; {machine_note(threads)}")
    rows = []
    for m in MODES:
        s = runs[m]
        wall = median(x["wall"] for x in s)
        rows.append([m, wall] + [f"{median(x[ph] for x in s):.3g} ({median(x[ph] / x['wall'] for x in s):.0%})"
                                 for ph in PHASES] + [f"{median(x['logp_abs_diff'] for x in s):.3g}"])
    print(table(["algo.logp_old", "s/step (median)"] + [f"{ph} s (share)" for ph in PHASES]
                + ["rollout/logp_abs_diff"], rows))
    ratios = [r["wall"] / o["wall"] for r, o in zip(runs["recompute"], runs["rollout"])]
    print(f"recompute / rollout step time: {', '.join(f'{x:.3f}' for x in ratios)} by round; "
          f"median {median(ratios):.3f}x")
    print(f"{a.rounds} measured step(s) per side after one warm-up step, interleaved; took "
          f"{time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
