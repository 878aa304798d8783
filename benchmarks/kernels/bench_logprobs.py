"""Chunked ``token_logprobs`` vs ``naive_token_logprobs`` (full [N, V] logits): time and peak
extra memory, forward and forward+backward, at Qwen2.5-0.5B's hidden size (896).

    python benchmarks/kernels/bench_logprobs.py                 # V=32k N=16k and V=152k N=4k (minutes)
    python benchmarks/kernels/bench_logprobs.py --tiny          # seconds
    python benchmarks/kernels/bench_logprobs.py --configs 32000x8192 --chunk-sizes 4096,1024
    python benchmarks/kernels/bench_logprobs.py --modes fwd+bwd --configs 32000x4096   # + the fused head + objective

In fwd+bwd mode a third variant runs: ``fused`` (``cispo.objective.fused_head.fused_head_loss``, the
gradient formed chunk by chunk in the forward, no recompute) on the same loss, sum_t up_t logp_t.

Each measurement runs in a fresh subprocess (one op, one configuration), so peak memory is
that of this op alone: the child allocates the inputs, records its resident set (VmRSS), resets
the kernel's high-water mark (``/proc/self/clear_refs``), runs the op once and reads the new
high-water mark (VmHWM). Peak extra = VmHWM - RSS before: every byte the op touched, torch's
and MKL's alike, at page granularity. (tracemalloc does not see torch's allocations and torch
has no CPU allocator statistics by default, hence RSS.) For forward+backward the extra includes
the gradients themselves (grad_hidden [N, H], grad_weight [V, H]).

Subprocesses for the variants alternate (naive, chunked, chunked, naive, ...) for ``--repeats``
rounds; the table gives medians and the chunked/naive ratios of those medians. On CPU the
inputs are fp32 (bf16 matmuls on CPU are neither fast nor representative of a GPU); with fp32
inputs the fp32 head makes no upcast copy of W.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import load_average, machine_note, median, peak_rss_mib, reset_peak_rss, rss_mib, table  # noqa: E402

HIDDEN = 896  # Qwen2.5-0.5B


def child(vocab: int, n: int, hidden: int, variant: str, chunk: int, backward: bool, threads: int, seed: int) -> dict:
    """One op in this (fresh) process: seconds and peak extra RSS (MiB)."""
    import torch

    from cispo.objective.fused_head import fused_head_loss
    from cispo.objective.logprobs import naive_token_logprobs, token_logprobs

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g) * 0.5
    w = torch.randn(vocab, hidden, generator=g) * hidden**-0.5
    y = torch.randint(0, vocab, (n,), generator=g)
    up = torch.randn(n, generator=g)  # upstream gradient of logp
    h.requires_grad_(backward)
    w.requires_grad_(backward)

    def op(hh, yy, upstream):
        if variant == "fused":  # the same loss, sum_t up_t logp_t, gradient formed in the forward
            loss, lp, _ = fused_head_loss(hh, w, yy, lambda lp, _ent, s, e: (upstream[s:e] * lp).sum(),
                                          chunk_size=chunk)
            loss.backward()
            return lp
        if variant == "naive":
            lp = naive_token_logprobs(hh, w, yy)
        else:
            lp = token_logprobs(hh, w, yy, chunk_size=chunk)
        if backward:
            (lp * upstream).sum().backward()
        return lp

    op(h[:64].detach().requires_grad_(backward), y[:64], up[:64])  # warm up MKL / OpenMP threads
    w.grad = None
    base = rss_mib()
    if not reset_peak_rss():
        raise RuntimeError("cannot reset the RSS high-water mark (/proc/self/clear_refs)")
    t0 = time.perf_counter()
    op(h, y, up)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_extra_mib": peak_rss_mib() - base, "base_mib": base}


def run_child(args, vocab, n, variant, chunk, backward) -> dict:
    if args.in_process:
        return child(vocab, n, args.hidden, variant, chunk, backward, args.threads, args.seed)
    cmd = [sys.executable, __file__, "--child", json.dumps(
        {"vocab": vocab, "n": n, "hidden": args.hidden, "variant": variant, "chunk": chunk, "backward": backward,
         "threads": args.threads, "seed": args.seed})]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(args) -> list[dict]:
    results = []
    for vocab, n in args.configs:
        for backward in [m == "fwd+bwd" for m in args.modes]:
            variants = [("naive", 0)] + [("chunked", c) for c in args.chunk_sizes]
            if backward:
                variants += [("fused", c) for c in args.chunk_sizes]
            samples = {v: [] for v in variants}
            for r in range(args.repeats):
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    samples[v].append(run_child(args, vocab, n, v[0], v[1], backward))
            for v, runs in samples.items():
                ok = [x for x in runs if "error" not in x]
                results.append({
                    "vocab": vocab, "n": n, "mode": "fwd+bwd" if backward else "fwd", "variant": v[0], "chunk": v[1],
                    "seconds": median(x["seconds"] for x in ok), "peak_mib": median(x["peak_extra_mib"] for x in ok),
                    "all_seconds": [x["seconds"] for x in ok], "errors": [x["error"] for x in runs if "error" in x],
                })
    return results


def report(results: list[dict], hidden: int) -> str:
    rows = []
    for r in results:
        base = next(x for x in results if (x["vocab"], x["n"], x["mode"], x["variant"]) ==
                    (r["vocab"], r["n"], r["mode"], "naive"))
        logits_mib = r["n"] * r["vocab"] * 4 / 2**20
        chunk_mib = min(r["chunk"] or r["n"], r["n"]) * r["vocab"] * 4 / 2**20
        spread = f"{min(r['all_seconds']):.3g}-{max(r['all_seconds']):.3g}" if r["all_seconds"] else "-"
        rows.append([
            f"{r['vocab']}", r["n"], r["mode"], r["variant"] if r["variant"] == "naive" else
            f"{'chunk' if r['variant'] == 'chunked' else 'fused'} {r['chunk']}",
            r["seconds"], spread, r["seconds"] / base["seconds"], r["peak_mib"], r["peak_mib"] / base["peak_mib"],
            r["peak_mib"] / logits_mib if r["variant"] == "naive" else r["peak_mib"] / chunk_mib,
            "; ".join(r["errors"]) or "",
        ])
    return table(["V", "N", "mode", "variant", "time s (median)", "range", "time / naive", "peak extra MiB",
                  "mem / naive", "peak / logits-block", "errors"], rows) + (
        f"\n\nfp32 inputs, hidden {hidden}. 'logits-block' = the fp32 logits the variant holds at once: "
        "N x V for naive, chunk x V for chunked (chunk capped at N). Peak extra (VmHWM - RSS before the op) "
        "includes the outputs and, for fwd+bwd, grad_hidden [N, H] and grad_weight [V, H].")


def parse_configs(s: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in c.lower().split("x")) for c in s.split(",")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=parse_configs, default=parse_configs("32000x16384,152064x4096"),
                   help="comma-separated VxN (vocab x tokens); default 32000x16384,152064x4096 (naive at "
                        "152064x16384 needs ~10 GB per [N, V] fp32 tensor: too big for this 23 GB machine)")
    p.add_argument("--chunk-sizes", default="4096,1024", help="chunk sizes of token_logprobs to run (default 4096,1024;"
                   " 4096 is the library default)")
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--modes", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both (fused runs in fwd+bwd)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on 2 shared cores, 2 OpenMP threads make small ops erratic)")
    p.add_argument("--in-process", action="store_true",
                   help="measure in this process (VmHWM reset between ops) instead of a fresh one per op")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="V=2048, N=512, H=64, chunk 128, 2 repeats, in-process: seconds")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return
    args.chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    args.modes = args.modes.split(",")
    if not args.modes or any(m not in ("fwd", "fwd+bwd") for m in args.modes):
        p.error(f"--modes: fwd, fwd+bwd or both, got {','.join(args.modes)!r}")
    if args.tiny:
        args.configs, args.chunk_sizes, args.repeats, args.hidden = [(2048, 512)], [128], 2, 64
        args.in_process = True
    print(machine_note(args.threads))
    t0 = time.perf_counter()
    results = bench(args)
    print(report(results, args.hidden))
    where = "in-process" if args.in_process else "fresh-process"
    if args.in_process:
        print("NOTE: in-process peaks are not meaningful for small tensors (malloc reuses freed heap pages).")
    print(f"\n{args.repeats} {where} repeats per cell, interleaved; took {time.perf_counter() - t0:.0f} s; "
          f"1-min load average at end {load_average():.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
