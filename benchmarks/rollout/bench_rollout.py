"""Rollout throughput: our ``TorchSampler`` (KV cache) vs Hugging Face ``model.generate(do_sample=True)``
on the same model and prompts, and our sampler with vs without its KV cache.

    python benchmarks/rollout/bench_rollout.py                    # default-size Llama, B=64 and 256, 32 new tokens
    python benchmarks/rollout/bench_rollout.py --tiny
    python benchmarks/rollout/bench_rollout.py --size small --batch-sizes 64 --new-tokens 64 --threads 2
    python benchmarks/rollout/bench_rollout.py --decode-pairs     # lean static-cache decode vs the forward path
    python benchmarks/rollout/bench_rollout.py --profile --batch-sizes 128 --new-tokens 60   # the decode's time, by op
    python benchmarks/rollout/bench_rollout.py --compile-pairs --cpu-time   # the decode step compiled vs eager

``--decode-pairs``: ``TorchSampler(decode="static")`` (cispo.rollout.static_cache) against
``decode="hf"`` (the model's forward with a DynamicCache, the sampler before it), same seed, same
prompts, EOS never sampled, on the built-in ``tiny`` (the TRL workload's model) and ``default``
models, 8 prompts x 8 samples, 32 and 128 new tokens. ``--pairs`` interleaved pairs (the order
alternates); each pair gives one ratio hf time / static time; the table gives the median ratio
and its range (load on a shared machine moves both sides of a pair together).

The model is the built-in ``--size`` Llama (``cispo.models.loading.build_model``, default ``default``; its
shape is printed) with the addition task's character tokenizer (17 ids) and random init; the prompts are the
addition task's (6-10 tokens, left-padded). Every row generates exactly ``--new-tokens``:

* ours: ``TorchSampler`` is given ``eos_token_id = vocab size``, an id the model can never
  sample (the sampler only compares sampled ids with it), and the repetition stop is off;
* Hugging Face: ``generate`` gets ``eos_token_id=None`` (no stopping criterion on EOS), top-k
  off, temperature 1, top-p 1: plain multinomial sampling like ours. It returns token ids only;
  ours also returns the sampled tokens' log-probs (a log-softmax + gather per step), so the
  comparison slightly favours ``generate``.

Both run under ``torch.inference_mode``-like conditions (ours: inference_mode; generate: its own
no_grad). Calls are interleaved (ours, generate, uncached, then the reverse order) ``--repeats``
times after a warm-up; the table gives median new tokens/s and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import interleaved, load_average, machine_note, median, model_desc, set_threads, spread, table  # noqa: E402


def setup(size: str, seed: int):
    from cispo.data.tasks import get_task
    from cispo.models.loading import build_model, build_tokenizer

    task = get_task("addition")
    tok = build_tokenizer(task.alphabet)
    model = build_model(tok, size=size, seed=seed).eval()
    return task, tok, model


def bench(args) -> list[list]:
    import torch
    from transformers import GenerationConfig

    from cispo.rollout import SamplingConfig, TorchSampler

    task, tok, model = setup(args.size, args.seed)
    sampler = TorchSampler(model, eos_token_id=len(tok), pad_token_id=tok.pad_token_id)  # EOS never sampled
    n = args.new_tokens
    cached = SamplingConfig(max_new_tokens=n, temperature=1.0, repetition_stop_tokens=None)
    uncached = SamplingConfig(max_new_tokens=n, temperature=1.0, repetition_stop_tokens=None, use_cache=False)
    gen_cfg = GenerationConfig(do_sample=True, max_new_tokens=n, temperature=1.0, top_k=None, top_p=1.0,
                               eos_token_id=None, pad_token_id=tok.pad_token_id, bos_token_id=None)
    rows = []
    for B in args.batch_sizes:
        prompts = [s["prompt"] for s in task.train_samples(args.seed, B)]
        ids = [tok.encode(p) for p in prompts]
        enc = tok(prompts, return_tensors="pt", padding=True)  # left-padded (padding_side="left")
        g = torch.Generator().manual_seed(args.seed)

        def ours(ids=ids, g=g, B=B):
            out = sampler.generate(ids, cached, generator=g)
            assert out.response_mask.sum() == B * n, "a row stopped early"

        def ours_uncached(ids=ids, g=g, B=B):
            out = sampler.generate(ids, uncached, generator=g)
            assert out.response_mask.sum() == B * n, "a row stopped early"

        def hf(enc=enc):
            with torch.no_grad():
                out = model.generate(**enc, generation_config=gen_cfg)
            assert out.shape[1] == enc["input_ids"].shape[1] + n, "generate stopped early"

        fns = {"ours (KV cache)": ours, "HF generate": hf}
        if not args.skip_uncached:
            fns["ours, no cache"] = ours_uncached
        times = interleaved(fns, args.repeats, warmup=1)
        tps = {k: B * n / median(v) for k, v in times.items()}
        for k, v in times.items():
            ratios = f"{tps['ours (KV cache)'] / tps[k]:.2f}" if k != "ours (KV cache)" else "1"
            rows.append([B, n, k, median(v), spread(v), tps[k], ratios])
    print(f"model: built-in '{args.size}' = {model_desc(model)}, random init (seed {args.seed}); prompts "
          f"{min(map(len, ids))}-{max(map(len, ids))} tokens")
    return rows


def decode_pairs(args, modes=("hf", "static")) -> list[list]:
    """Per-pair speed ratios of one decode mode over another: ``hf`` (the forward path), ``static``
    (the static-cache loop, eager) or ``compiled`` (the static loop with its layer stack compiled,
    ``compile_step=True``; its compile, in the warm-up, is timed on its own)."""
    import torch

    from cispo.rollout import SamplingConfig, TorchSampler

    clock = time.process_time if args.cpu_time else time.perf_counter
    rows = []
    for size in args.sizes:
        task, tok, model = setup(size, args.seed)
        ids = [tok.encode(s["prompt"]) for s in task.train_samples(args.seed, args.batch_sizes[0])]
        samplers = {mode: TorchSampler(model, eos_token_id=len(tok), pad_token_id=tok.pad_token_id,
                                       decode="static" if mode == "compiled" else mode,
                                       compile_step=mode == "compiled")
                    for mode in modes}
        for n in args.new_tokens_list:
            cfg = SamplingConfig(max_new_tokens=n, temperature=1.0, repetition_stop_tokens=None)
            fns = {mode: (lambda s=s, ids=ids, cfg=cfg: s.generate(ids, cfg, torch.Generator().manual_seed(args.seed)))
                   for mode, s in samplers.items()}
            t0 = time.perf_counter()
            fns[modes[1]]()  # the first call compiles (compiled mode)
            first = time.perf_counter() - t0
            times = interleaved(fns, args.pairs, warmup=1, clock=clock)
            ratios = [a / b for a, b in zip(times[modes[0]], times[modes[1]])]
            rows.append([size, model_desc(model), len(ids), n, median(times[modes[0]]), median(times[modes[1]]),
                         median(ratios), f"{min(ratios):.2f}-{max(ratios):.2f}", f"{first:.1f}",
                         f"{load_average():.1f}"])
    return rows


def profile_decode(args, top: int = 8) -> list[list]:
    """Where one ``generate`` of the default (static-cache) decode spends its time, after a warm-up.

    Prints the CPU seconds (``time.process_time``: descheduling under load does not count) of the
    whole call and of its attention calls (``StaticDecoder``'s SDPA function, wrapped); returns
    torch.profiler's operators by self time [operator, calls, self ms, share] (wall-clock per op,
    so inflated under load; the shares are what to read)."""
    import torch
    from torch.profiler import profile

    from cispo.rollout import SamplingConfig, TorchSampler
    from cispo.rollout.static_cache import StaticDecoder

    task, tok, model = setup(args.size, args.seed)
    ids = [tok.encode(s["prompt"]) for s in task.train_samples(args.seed, args.batch_sizes[0])]
    sampler = TorchSampler(model, eos_token_id=len(tok), pad_token_id=tok.pad_token_id)  # EOS never sampled
    cfg = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, repetition_stop_tokens=None)
    attention_s = [0.0]
    plain_init = StaticDecoder.__init__

    def timed_init(self, *a, **kw):  # wrap this decoder's attention function with a CPU-time counter
        plain_init(self, *a, **kw)
        attend = self._attention

        def timed(*x, **y):
            t = time.process_time()
            out = attend(*x, **y)
            attention_s[0] += time.process_time() - t
            return out
        self._attention = timed

    StaticDecoder.__init__ = timed_init
    try:
        sampler.generate(ids, cfg, torch.Generator().manual_seed(args.seed))
        attention_s[0] = 0.0
        t = time.process_time()
        sampler.generate(ids, cfg, torch.Generator().manual_seed(args.seed))
        total_s = time.process_time() - t
    finally:
        StaticDecoder.__init__ = plain_init
    with profile() as prof:
        sampler.generate(ids, cfg, torch.Generator().manual_seed(args.seed))
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    print(f"model: built-in '{args.size}' = {model_desc(model)}, random init; B = {len(ids)}, "
          f"{args.new_tokens} new tokens; load {load_average():.1f}\n"
          f"CPU time of one generate {total_s:.3f} s, of which attention (SDPA) {attention_s[0]:.3f} s "
          f"({attention_s[0] / total_s:.0%})")
    return [[e.key, e.count, e.self_cpu_time_total / 1e3, f"{e.self_cpu_time_total / total:.1%}"] for e in ops[:top]]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="default", help="built-in model size (tiny, small, default)")
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-uncached", action="store_true")
    p.add_argument("--tiny", action="store_true", help="tiny model, B=8, 4 new tokens, 2 repeats")
    p.add_argument("--decode-pairs", action="store_true",
                   help="static-cache decode vs the forward path, per-pair ratios (B = first --batch-sizes, "
                        "default 64 = 8 prompts x 8 samples)")
    p.add_argument("--sizes", default="tiny,default", help="with --decode-pairs: built-in model sizes")
    p.add_argument("--new-tokens-list", default="32,128", help="with --decode-pairs: response lengths")
    p.add_argument("--pairs", type=int, default=7, help="with --decode-pairs: interleaved pairs (>= 5)")
    p.add_argument("--compile-pairs", action="store_true",
                   help="the static decode with its layer stack compiled (model.compile) vs eager, per-pair "
                        "ratios, as --decode-pairs")
    p.add_argument("--cpu-time", action="store_true",
                   help="with --decode-pairs / --compile-pairs: time CPU seconds of this process, not wall")
    p.add_argument("--profile", action="store_true",
                   help="profile one static-cache generate (B = first --batch-sizes, --new-tokens): top operators")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.sizes = args.sizes.split(",")
    args.new_tokens_list = [int(n) for n in args.new_tokens_list.split(",")]
    if args.tiny:
        args.size, args.batch_sizes, args.new_tokens, args.repeats = "tiny", [8], 4, 2
        args.sizes, args.new_tokens_list, args.pairs = ["tiny"], [4], 2
    threads = set_threads(args.threads)
    print(machine_note(threads))
    t0 = time.perf_counter()
    if args.profile or args.tiny:
        print(table(["operator", "calls", "self ms", "share"], profile_decode(args)))
        if args.profile:
            return
    for flag, modes in (("decode_pairs", ("hf", "static")), ("compile_pairs", ("static", "compiled"))):
        if getattr(args, flag) or (args.tiny and flag == "decode_pairs"):  # --tiny: no compile
            a, b = modes
            rows = decode_pairs(args, modes)
            print(table(["model", "shape", "B", "new tokens", f"{a} s (median)", f"{b} s (median)",
                         f"{b} speed-up (median of pairs)", "range", f"{b}: first call s", "load"], rows))
            print(f"\n{args.pairs} interleaved pairs after a warm-up, {'CPU' if args.cpu_time else 'wall'} "
                  f"seconds; took {time.perf_counter() - t0:.0f} s")
    if args.decode_pairs or args.compile_pairs:
        return
    rows = bench(args)
    print(table(["B", "new tokens", "sampler", "s (median)", "range", "new tokens/s", "ours (cached) speed-up"], rows))
    print(f"\ntargets: ours >= 1.0x HF generate; ours >= 5x uncached. {args.repeats} interleaved repeats after a "
          f"warm-up; took {time.perf_counter() - t0:.0f} s; 1-min load average at end {load_average():.2f}")


if __name__ == "__main__":
    main()
