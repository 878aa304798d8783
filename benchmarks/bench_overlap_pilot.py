"""A pilot for sampling beside training (issue 47 item 4, docs/async.md): before building a second process,
does a second *thread* already overlap the sampler with the update passes on a CPU?

    python benchmarks/bench_overlap_pilot.py                  # builtin:smollm2-135m, 4 prompts x 8, 64 tokens, K = 4
    python benchmarks/bench_overlap_pilot.py --tiny           # the built-in tiny model (a smoke run)

One trainer (``_common.ours_setup``: the model loaded as ``cispo train`` loads it, fp32, the FP32 head, EOS
suppressed so every response has the same length) and a second copy of the model for the sampler (its
weights copied from the trainer's before each round, the time counted). Per round, two arms in turn (the
order alternating): ``sequential`` — sample batch n+1, then train on batch n (prepare_experience, K updates),
one after the other, at ``--threads`` torch threads (default 2: today's loop on both cores); ``overlap`` —
the sampler's copy samples batch n+1 in a Python thread while the main thread trains on batch n, one torch
thread each (torch's intra-op pool is per process: with one thread each op runs in its caller). Printed: each
arm's median wall seconds per round with its parts, and sequential / overlap, round by round and the median.
The ideal ratio is (sample + train) / max(sample, train) of the sequential arm at one thread. Not a test:
nothing asserts a time.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_note, median, ours_setup, set_threads, table  # noqa: E402


def sampler_policy(setup: dict):
    """The trainer's policy with its own model copy and a sampler over it (same settings)."""
    from cispo.rollout import TorchSampler

    policy = setup["policy"]
    model = copy.deepcopy(policy.model).eval()
    inner = policy.sampler.inner
    eos = model.get_output_embeddings().weight.shape[0]  # suppressed, as in ours_setup
    sampler = TorchSampler(model, eos, policy.tokenizer.pad_token_id, autocast=policy.autocast,
                           fp32_head=inner.fp32_head, decode=inner.decode)
    return dataclasses.replace(policy, model=model, sampler=sampler)


def copy_weights(src, dst) -> float:
    """Copy the trainer's parameters into the sampler's copy; seconds."""
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        for p, q in zip(src.parameters(), dst.parameters(), strict=True):
            q.copy_(p)
    return time.perf_counter() - t0


def sample(setup: dict, policy):
    from cispo.foundations.distributed import DistInfo
    from cispo.training.sampling import sample_step

    s = setup
    return sample_step(policy, s["stream"], s["task"], s["cfg"], s["sampling"], s["generators"], DistInfo(),
                       keep_all=False)


def train(setup: dict, rollout, updates: int) -> int:
    from cispo.foundations.distributed import DistInfo
    from cispo.training.trainer import prepare_experience, update_policy

    s = setup
    exp, first_order, fill, _ = prepare_experience(s["policy"], rollout.groups, s["cfg"], s["forks"],
                                                   s["generators"], DistInfo(), False)
    _, updates = update_policy(s["policy"], s["optimizer"], exp, s["obj"], s["cfg"], s["generators"]["shuffle"],
                               updates, s["forks"], DistInfo(), first_order, first_fill=fill)
    return updates


def sequential(setup, policy_s, pending, updates, threads):
    import torch

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    copy_s = copy_weights(setup["policy"].model, policy_s.model)
    t1 = time.perf_counter()
    nxt = sample(setup, policy_s)
    t2 = time.perf_counter()
    updates = train(setup, pending, updates)
    t3 = time.perf_counter()
    return nxt, updates, {"wall": t3 - t0, "copy": copy_s, "sample": t2 - t1, "train": t3 - t2}


def overlap(setup, policy_s, pending, updates, threads):
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    copy_s = copy_weights(setup["policy"].model, policy_s.model)
    box, when = {}, {}

    def worker():
        t = time.perf_counter()
        box["rollout"] = sample(setup, policy_s)
        when["sample"] = time.perf_counter() - t

    th = threading.Thread(target=worker)
    th.start()
    t1 = time.perf_counter()
    updates = train(setup, pending, updates)
    t2 = time.perf_counter()
    th.join()
    t3 = time.perf_counter()
    return box["rollout"], updates, {"wall": t3 - t0, "copy": copy_s, "sample": when["sample"], "train": t2 - t1,
                                     "wait": t3 - t2}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the sequential arm")
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model on addition, 2 x 2 rows, 1 round")
    a = p.parse_args(argv)
    set_threads(a.threads)
    if a.tiny:
        setup = ours_setup(size="tiny", prompts=2, group_size=2, updates=2, max_new_tokens=4, suppress_eos=True)
        a.rounds = 1
    else:
        from cispo.data.tasks import get_task

        samples = get_task("wordmath").train_samples(0, (2 * a.rounds + 3) * a.prompts)
        setup = ours_setup(model_path=a.model, task="wordmath", samples=samples, prompts=a.prompts,
                           group_size=a.group, updates=a.updates, max_new_tokens=a.max_new_tokens, suppress_eos=True,
                           extra=("model.dtype=float32",))
    policy_s = sampler_policy(setup)
    arms = {"sequential": sequential, "overlap": overlap}
    pending, updates = sample(setup, policy_s), 0
    pending, updates, _ = sequential(setup, policy_s, pending, updates, a.threads)  # warm-up
    pending, updates, _ = overlap(setup, policy_s, pending, updates, a.threads)
    runs = {k: [] for k in arms}
    for r in range(a.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            pending, updates, row = arms[name](setup, policy_s, pending, updates, a.threads)
            runs[name].append(row)
    keys = ("wall", "copy", "sample", "train", "wait")
    print(table(["arm", *keys], [[k, *[f"{median([x.get(c, 0.0) for x in v]):.2f}" for c in keys]]
                                 for k, v in runs.items()]))
    ratios = [s["wall"] / o["wall"] for s, o in zip(runs["sequential"], runs["overlap"])]
    print("sequential / overlap per round: " + ", ".join(f"{x:.2f}" for x in ratios)
          + f"; median {median(ratios):.2f}x")
    print(machine_note(a.threads))


if __name__ == "__main__":
    main()
