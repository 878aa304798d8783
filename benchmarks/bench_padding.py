"""How much of the update passes' compute is padding: pure counting, no model.

    python benchmarks/bench_padding.py                  # B=256 (32 prompts x G=8), K=16
    python benchmarks/bench_padding.py --tiny
    python benchmarks/bench_padding.py --prompts 64 --group-size 16 --updates 8 --micro 8

A generation batch is B rows = prompt (left-padded) + response (right-padded). The K update
passes go over every row once per epoch; a pass over b rows computes the decoder on b x (P + T - 1)
positions and the LM head on b x T, where P and T are the longest prompt and response among
those b rows. Strategies (each row is used exactly once per epoch in all of them):

* ``whole-batch``: every mini-batch padded to the whole batch's longest prompt and response
  (``collate`` without ``Experience.select``; also what the single ``logp_old`` pass computes
  with ``micro_batch_size`` unset);
* ``current``: the trainer today: random mini-batches of B/K rows, each trimmed to its own
  longest row by ``Experience.select`` (the real ``collate`` / ``select`` code is run);
* ``sorted``: rows sorted by length, K contiguous mini-batches (least padding; but a
  mini-batch then holds only short or only long responses: the optimizer steps see
  length-biased batches, which changes the algorithm);
* ``current+sorted-micro``: random mini-batches as today, each split into micro-batches of
  ``--micro`` rows after sorting its rows by length. The gradient of a mini-batch is unchanged
  (the loss is normalised by the mini-batch's token count), only the padding goes.

Length distributions: ``builtin-fork=p`` draws prompts of the built-in addition task (2-4
digit operands) and, per response, the exact length of a direct answer (3-6 tokens with EOS)
or, with probability p, of a forked one (guess, fork token, derivation, answer: 18-46
tokens); ``lognormal`` draws response lengths from a lognormal (median ``--ln-median``,
sigma ``--ln-sigma``) capped at ``--max-len``. Medians over ``--seeds`` batches.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, table  # noqa: E402


def batch_lengths(dist: str, prompts: int, group_size: int, seed: int, ln_median: float, ln_sigma: float,
                  max_len: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths) of one generation batch, grouped by prompt."""
    from cispo.tasks import arithmetic

    rng = random.Random(seed)
    pairs = arithmetic.sample_pairs(seed, prompts, "train")
    p_len, r_len = [], []
    for a, b in pairs:
        prompt = arithmetic.make_prompt(a, b)
        for _ in range(group_size):
            p_len.append(len(prompt))  # the tokenizer is character-level
            if dist.startswith("builtin-fork="):
                if rng.random() < float(dist.split("=", 1)[1]):
                    ans = str(a + b)
                    guess = arithmetic.corrupt(ans, rng) if rng.random() < 0.5 else ans
                    r_len.append(len(arithmetic.forked_completion(a, b, guess)) + 1)  # + EOS
                else:
                    r_len.append(len(arithmetic.direct_completion(a, b)) + 1)
            elif dist == "lognormal":
                r_len.append(max(1, min(max_len, round(rng.lognormvariate(math.log(ln_median), ln_sigma)))))
            else:
                raise ValueError(f"unknown distribution {dist!r}")
    return p_len, r_len


def experience(p_len: list[int], r_len: list[int]):
    import torch

    from cispo.experience import Completion, collate

    comps = [Completion({}, [5] * p, torch.full((r,), 6), torch.zeros(r), "eos", "") for p, r in zip(p_len, r_len)]
    return collate(comps, torch.zeros(len(comps)), pad_id=0)


def cost(sub) -> tuple[int, int, int, int]:
    """(decoder positions computed, of them real; head positions computed, of them real) of one pass."""
    b, width = sub.input_ids.shape
    T = sub.response_mask.shape[1]
    real_dec = int(sub.attention_mask.sum()) - b  # the last token of each row predicts nothing
    real_head = int(sub.response_mask.sum())
    return b * (width - 1), real_dec, b * T, real_head


def count(exp, strategy: str, updates: int, micro: int, seed: int) -> tuple[int, int, int, int]:
    import torch

    B = len(exp)
    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    lengths = exp.response_mask.sum(-1) * 1000 + exp.attention_mask.sum(-1)  # by response, then total length
    if strategy == "sorted":
        order = torch.argsort(lengths, stable=True)
    passes = []
    for rows in order.tensor_split(updates):
        if strategy == "whole-batch":
            passes.append(_rows_untrimmed(exp, rows))
        elif strategy in ("current", "sorted"):
            passes.append(exp.select(rows))
        elif strategy == "current+sorted-micro":
            rows = rows[torch.argsort(lengths[rows], stable=True)]
            passes += [exp.select(m) for m in rows.split(micro)]
        else:
            raise ValueError(strategy)
    totals = [sum(x) for x in zip(*(cost(p) for p in passes))]
    return tuple(totals)


def _rows_untrimmed(exp, rows):
    from dataclasses import replace

    return replace(exp, input_ids=exp.input_ids[rows], attention_mask=exp.attention_mask[rows],
                   response_mask=exp.response_mask[rows])


STRATEGIES = ("whole-batch", "current", "sorted", "current+sorted-micro")


def bench(args) -> list[list]:
    rows = []
    for dist in args.dists:
        per = {s: [] for s in STRATEGIES}
        mean_len = []
        for seed in range(args.seeds):
            p_len, r_len = batch_lengths(dist, args.prompts, args.group_size, seed, args.ln_median, args.ln_sigma,
                                         args.max_len)
            mean_len.append(sum(r_len) / len(r_len))
            exp = experience(p_len, r_len)
            for s in STRATEGIES:
                per[s].append(count(exp, s, args.updates, args.micro, seed))
        cur = median(x[0] for x in per["current"])
        for s in STRATEGIES:
            dec = median(1 - real / comp for comp, real, _, _ in per[s])
            head = median(1 - real / comp for _, _, comp, real in per[s])
            rows.append([dist, f"{median(mean_len):.1f}", s, f"{dec:.1%}", f"{head:.1%}",
                         f"{median(x[0] for x in per[s]) / cur:.2f}"])
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (default 32, the trainer's)")
    p.add_argument("--group-size", type=int, default=8, help="G (default 8)")
    p.add_argument("--updates", type=int, default=16, help="K mini-batches per epoch (default 16)")
    p.add_argument("--micro", type=int, default=4, help="rows per micro-batch for current+sorted-micro (default 4)")
    p.add_argument("--dists", default="builtin-fork=0.03,builtin-fork=0.3,lognormal",
                   help="comma-separated length distributions (builtin-fork=p, lognormal)")
    p.add_argument("--ln-median", type=float, default=16.0)
    p.add_argument("--ln-sigma", type=float, default=0.8)
    p.add_argument("--max-len", type=int, default=57, help="cap of the lognormal (the trainer's default max_new_tokens)")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="3 seeds, 8 prompts: under a second")
    args = p.parse_args(argv)
    args.dists = args.dists.split(",")
    if args.tiny:
        args.seeds, args.prompts = 3, 8
    B = args.prompts * args.group_size
    print(f"B = {args.prompts} prompts x G={args.group_size} = {B} rows, K = {args.updates} mini-batches of "
          f"~{B // args.updates} rows, micro-batches of {args.micro} for current+sorted-micro; medians over "
          f"{args.seeds} batches")
    print(table(["lengths", "mean resp len", "strategy", "padding (decoder)", "padding (LM head)",
                 "decoder positions / current"], bench(args)))
    print("\npadding = 1 - real / computed positions, over the K passes of one epoch. Attention's T^2 term "
          "is not counted (it favours trimming further).")


if __name__ == "__main__":
    main()
