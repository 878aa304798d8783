"""Where one RL step's time goes, and how it grows with G, K, response length and model size.

    python benchmarks/step/bench_step.py                      # profile + scaling table (minutes)
    python benchmarks/step/bench_step.py --tiny
    python benchmarks/step/bench_step.py --only profile       # just the one-step breakdown
    python benchmarks/step/bench_step.py --only padding       # unsorted vs length-sorted micro-batches
    python benchmarks/step/bench_step.py --model-path ~/.cache/cispo/models/loading/addition-<hash>   # a saved policy

Runs ``cispo.training.rl_step.RLStep`` in this process on the built-in addition task (CPU, fp32,
``--threads``), with the built-in Llama (random init unless ``--model-path``) and the
trainer's defaults otherwise (32 prompts x G=8, K=16, dynamic sampling off so every step has
the same B). Each step is split into sample (``TorchSampler.generate``), score (reward calls
incl. their thread-pool dispatch), logp_old (``perf/logp_old_s``: collate + the no-grad pass),
update (``perf/update_s``: the K optimizer steps) and overhead (decoding, completions, metrics).

* profile: the base configuration with EOS as the model samples it (a random-init model's
  responses are ~geometric in length, capped at max_new_tokens);
* padding (``--only padding``): the profile's configuration at each ``--split-costs`` value of
  ``algo.micro_batch_split_cost`` (none: each mini-batch one call, rows in random order);
* scaling: one factor changed at a time from the base, with EOS suppressed (the sampler gets an
  EOS id outside the vocabulary) so each response is exactly L tokens and the cost depends
  on the factor alone.

All configurations are set up and warmed up first (one step each), then measured one step at
a time, round-robin (order reversed every other round), ``--rounds`` times; medians, and each
configuration's step time relative to the base's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import PHASES, load_average, machine_note, median, ours_setup, ours_steps, set_threads, table  # noqa: E402
from cispo.models.loading import MAX_POSITIONS, MODEL_SIZES  # noqa: E402


def configs(a) -> dict[str, dict]:
    base = {"size": a.size, "group_size": 8, "updates": 16, "prompts": 32, "max_new_tokens": a.max_new_tokens}
    if a.only == "padding":  # the base with EOS sampled, at each micro-batch split cost
        return {f"split cost {c}": {**base, "suppress_eos": False, "extra": (f"micro_batch_split_cost={c}",)}
                for c in a.split_costs.split(",")}
    out = {"base, EOS sampled": {**base, "suppress_eos": False}}
    if a.only == "profile":
        return out
    fixed = {**base, "suppress_eos": True}
    out[f"base, L={a.max_new_tokens} fixed"] = fixed
    for g in (4, 16):
        out[f"G={g}"] = {**fixed, "group_size": g}
    for k in (4, 32):
        out[f"K={k}"] = {**fixed, "updates": k}
    longest_prompt = 10  # "1234+5678=": the addition task's longest prompt, in tokens
    for L in (a.max_new_tokens // 2, min(a.max_new_tokens * 2, MAX_POSITIONS - longest_prompt)):
        out[f"L={L}"] = {**fixed, "max_new_tokens": L}
    for s in MODEL_SIZES:
        if s != a.size:
            out[f"size={s}"] = {**fixed, "size": s}
    return out


def main(argv=None) -> None:
    from cispo.data.tasks import get_task
    from cispo.training.setup import default_max_new_tokens

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="default",
                   help="built-in model size of the base (cispo.models.loading.MODEL_SIZES)")
    p.add_argument("--max-new-tokens", type=int, default=default_max_new_tokens(get_task("addition")),
                   help="L (default: the trainer's for the addition task)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", choices=("profile", "padding", "all"), default="all",
                   help="profile: the base row only; padding: the base (EOS sampled) at each --split-costs")
    p.add_argument("--split-costs", default="none,128",
                   help="algo.micro_batch_split_cost values for --only padding (default none,128: unsorted "
                        "mini-batches vs length-sorted micro-batches)")
    p.add_argument("--model-path", help="a saved policy for the EOS-sampled rows (default: random init)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: every time (ours and the trainer's perf/*) in this process's CPU seconds "
                        "(time.process_time): robust to other jobs' load on a shared machine; default wall")
    p.add_argument("--tiny", action="store_true", help="tiny model, 2 prompts x G=2, K=2, L=4, 1 round")
    a = p.parse_args(argv)
    threads = set_threads(a.threads)
    print(machine_note(threads))
    if a.clock == "cpu":  # every time.perf_counter() call, the trainer's included, now reads CPU seconds
        time.perf_counter = time.process_time
        print("clock: CPU seconds of this process (all its threads), not wall time")
    if a.tiny:
        a.size, a.max_new_tokens, a.rounds = "tiny", 4, 1
        tiny = {"size": "tiny", "group_size": 2, "updates": 2, "prompts": 2, "max_new_tokens": 4}
        cfgs = {"base, EOS sampled": tiny, "K=1": {**tiny, "updates": 1, "suppress_eos": True}}
    else:
        cfgs = configs(a)
    t0 = time.monotonic()  # wall, whatever --clock
    setups = {}
    for name, c in cfgs.items():
        path = a.model_path if name.startswith(("base, EOS", "split cost")) else None
        setups[name] = ours_setup(model_path=path, **c)
        ours_steps(setups[name], 1)  # warm-up
    runs = {n: [] for n in setups}
    names = list(setups)
    for r in range(a.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            runs[n] += ours_steps(setups[n], 1)
    fixed_base = len(names) > 1 and not a.tiny and a.only != "padding"
    base = median(s["wall"] for s in runs[names[1] if fixed_base else names[0]])
    for n, s in setups.items():
        if n.startswith(("size=", "base, EOS", "split cost")):
            print(f"{n}: {s['desc']}")
    rows = []
    for n, steps in runs.items():
        c, s = cfgs[n], setups[n]
        wall = median(x["wall"] for x in steps)
        rows.append([n, f"{s['params'] / 1e6:.2f}M", c["prompts"] * c["group_size"], c["updates"],
                     f"{median(x['response_len'] for x in steps):.1f}", wall, f"{wall / base:.2f}",
                     median(x["tokens"] / x["wall"] for x in steps)]
                    + [f"{median(x[ph] for x in steps):.3g} ({median(x[ph] / x['wall'] for x in steps):.0%})"
                       for ph in PHASES])
    ratio_header = "vs fixed base" if fixed_base else f"vs {names[0]}"
    print(table(["config", "params", "B", "K", "resp len", "s/step", ratio_header, "tokens/s"]
                + [f"{ph} s (share)" for ph in PHASES], rows))
    print(f"\n{a.rounds} measured step(s) per configuration after one warm-up step, round-robin; took "
          f"{time.monotonic() - t0:.0f} s; 1-min load average at end {load_average():.2f}")


if __name__ == "__main__":
    main()
