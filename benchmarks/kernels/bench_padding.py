"""How much of the update passes' compute is padding: pure counting, no model.

    python benchmarks/kernels/bench_padding.py                  # B=256 (32 prompts x G=8), K=16
    python benchmarks/kernels/bench_padding.py --tiny
    python benchmarks/kernels/bench_padding.py --prompts 64 --group-size 16 --updates 8 --split-cost 64

A generation batch is B rows = prompt (left-padded) + response (right-padded). The K update
passes go over every row once per epoch; a pass over b rows computes the decoder on b x (P + T - 1)
positions and the LM head on b x T, where P and T are the longest prompt and response among
those b rows. Strategies (each row is used exactly once per epoch in all of them):

* ``whole-batch``: every mini-batch padded to the whole batch's longest prompt and response
  (``collate`` without ``Experience.select``);
* ``unsorted``: random mini-batches of B/K rows, each one call trimmed to its own longest row
  by ``Experience.select`` (the trainer with ``micro_batch_split_cost=None``, before length
  sorting; the real ``collate`` / ``select`` code is run);
* ``sorted``: rows sorted by length, K contiguous mini-batches (least padding; but a
  mini-batch then holds only short or only long responses: the optimizer steps see
  length-biased batches, which changes the algorithm);
* ``sorted-micro``: random mini-batches as ``unsorted``, each split into micro-batches of
  ``--micro`` rows after sorting its rows by length;
* ``split-cost``: the trainer's default (``cispo.training.batching.length_micro_batches``): random
  mini-batches, each sorted by length and cut wherever a cut saves more than
  ``--split-cost`` padded positions (``algo.micro_batch_split_cost``).

The gradient of a mini-batch is the same in the last two (the loss is normalised by the
mini-batch's token count), only the padding goes. The ``calls`` column counts forward
(+backward) calls per epoch: on small models each call has a fixed cost. A second table
counts the single ``logp_old`` pass over the whole batch: one call (``unsorted`` with
``micro_batch_size`` unset) or ``length_micro_batches`` over all B rows.

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

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import median, table  # noqa: E402


def batch_lengths(dist: str, prompts: int, group_size: int, seed: int, ln_median: float, ln_sigma: float,
                  max_len: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths) of one generation batch, grouped by prompt."""
    from cispo.data.tasks import arithmetic

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

    from cispo.foundations.experience import Completion, collate

    comps = [Completion({}, [5] * p, torch.full((r,), 6), torch.zeros(r), "eos", "") for p, r in zip(p_len, r_len)]
    return collate(comps, torch.zeros(len(comps)), pad_id=0)


def cost(sub) -> tuple[int, int, int, int]:
    """(decoder positions computed, of them real; head positions computed, of them real) of one pass."""
    b, width = sub.input_ids.shape
    T = sub.response_mask.shape[1]
    real_dec = int(sub.attention_mask.sum()) - b  # the last token of each row predicts nothing
    real_head = int(sub.response_mask.sum())
    return b * (width - 1), real_dec, b * T, real_head


def count(exp, strategy: str, updates: int, micro: int, split_cost: float, seed: int) -> tuple[int, ...]:
    """(decoder positions computed, real; head positions computed, real; calls) of one epoch."""
    import torch

    from cispo.training.batching import length_micro_batches

    B = len(exp)
    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    lengths = exp.response_mask.sum(-1) * 1000 + exp.attention_mask.sum(-1)  # by response, then total length
    if strategy == "sorted":
        order = torch.argsort(lengths, stable=True)
    passes = []
    for rows in order.tensor_split(updates):
        if strategy == "whole-batch":
            passes.append(_rows_untrimmed(exp, rows))
        elif strategy in ("unsorted", "sorted"):
            passes.append(exp.select(rows))
        elif strategy == "sorted-micro":
            rows = rows[torch.argsort(lengths[rows], stable=True)]
            passes += [exp.select(m) for m in rows.split(micro)]
        elif strategy == "split-cost":
            passes += [exp.select(m) for m in length_micro_batches(exp, rows, None, split_cost)]
        else:
            raise ValueError(strategy)
    return _totals(passes)


def count_logp_old(exp, strategy: str, split_cost: float) -> tuple[int, ...]:
    """The same for the single logp_old pass over all B rows."""
    import torch

    from cispo.training.batching import length_micro_batches

    rows = torch.arange(len(exp))
    if strategy == "unsorted":
        return _totals([exp.select(rows)])
    return _totals([exp.select(m) for m in length_micro_batches(exp, rows, None, split_cost)])


def _totals(passes) -> tuple[int, ...]:
    return tuple(sum(x) for x in zip(*(cost(p) for p in passes))) + (len(passes),)


def _rows_untrimmed(exp, rows):
    from dataclasses import replace

    return replace(exp, input_ids=exp.input_ids[rows], attention_mask=exp.attention_mask[rows],
                   response_mask=exp.response_mask[rows])


STRATEGIES = ("whole-batch", "unsorted", "sorted", "sorted-micro", "split-cost")


def _row(dist, mean_len, name, runs, ref) -> list:
    dec = median(1 - real / comp for comp, real, *_ in runs)
    head = median(1 - real / comp for _, _, comp, real, _ in runs)
    return [dist, f"{mean_len:.1f}", name, f"{dec:.1%}", f"{head:.1%}", f"{median(x[0] for x in runs) / ref:.2f}",
            f"{median(x[4] for x in runs):g}"]


def bench(args) -> tuple[list[list], list[list]]:
    rows, logp_rows = [], []
    for dist in args.dists:
        per = {s: [] for s in STRATEGIES}
        logp = {s: [] for s in ("unsorted", "split-cost")}
        mean_len = []
        for seed in range(args.seeds):
            p_len, r_len = batch_lengths(dist, args.prompts, args.group_size, seed, args.ln_median, args.ln_sigma,
                                         args.max_len)
            mean_len.append(sum(r_len) / len(r_len))
            exp = experience(p_len, r_len)
            for s in STRATEGIES:
                per[s].append(count(exp, s, args.updates, args.micro, args.split_cost, seed))
            for s in logp:
                logp[s].append(count_logp_old(exp, s, args.split_cost))
        ref = median(x[0] for x in per["unsorted"])
        for s in STRATEGIES:
            rows.append(_row(dist, median(mean_len), s, per[s], ref))
        ref = median(x[0] for x in logp["unsorted"])
        for s in logp:
            logp_rows.append(_row(dist, median(mean_len), s, logp[s], ref))
    return rows, logp_rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (default 32, the trainer's)")
    p.add_argument("--group-size", type=int, default=8, help="G (default 8)")
    p.add_argument("--updates", type=int, default=16, help="K mini-batches per epoch (default 16)")
    p.add_argument("--micro", type=int, default=4, help="rows per micro-batch for sorted-micro (default 4)")
    p.add_argument("--split-cost", type=float, default=None,
                   help="split cost in positions for split-cost (default: the trainer's algo.micro_batch_split_cost)")
    p.add_argument("--dists", default="builtin-fork=0.03,builtin-fork=0.3,lognormal",
                   help="comma-separated length distributions (builtin-fork=p, lognormal)")
    p.add_argument("--ln-median", type=float, default=16.0)
    p.add_argument("--ln-sigma", type=float, default=0.8)
    p.add_argument("--max-len", type=int, default=57,
                   help="cap of the lognormal (the trainer's default max_new_tokens)")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="3 seeds, 8 prompts: under a second")
    args = p.parse_args(argv)
    args.dists = args.dists.split(",")
    if args.tiny:
        args.seeds, args.prompts = 3, 8
    if args.split_cost is None:
        from cispo.config.train import AlgoConfig

        args.split_cost = AlgoConfig().micro_batch_split_cost
    B = args.prompts * args.group_size
    print(f"B = {args.prompts} prompts x G={args.group_size} = {B} rows, K = {args.updates} mini-batches of "
          f"~{B // args.updates} rows, micro-batches of {args.micro} for sorted-micro, split cost "
          f"{args.split_cost:g} positions for split-cost; medians over {args.seeds} batches")
    rows, logp_rows = bench(args)
    headers = ["lengths", "mean resp len", "strategy", "padding (decoder)", "padding (LM head)",
               "decoder positions / unsorted", "calls"]
    print("K update passes (one epoch):")
    print(table(headers, rows))
    print("\nthe logp_old pass (all B rows, micro_batch_size unset):")
    print(table(headers, logp_rows))
    print("\npadding = 1 - real / computed positions. Attention's T^2 term is not counted (it favours "
          "trimming further).")

if __name__ == "__main__":
    main()
