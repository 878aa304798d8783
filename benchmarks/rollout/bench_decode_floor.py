"""Sampling SmolLM2-135M against its floors: the bench_trl_smollm2 workload's sampling phase
(4 prompts x G = 8 of `wordmath`, 64 new tokens with EOS suppressed, the static-cache decode, one thread), timed
with the sampler's inverse-CDF draw and with torch.multinomial's exponential draw (the draw it replaced, whose V
exponentials per row were 13 % of sampling), interleaved; then the floors it is read against, each measured here:

* FLOP floor: the useful FLOPs (`forward_flops`, each prompt once per group) at the fp32 matmul rate of a
  1024-row matmul (`matmul_rate`), the issue's definition; and at the rate of a decode-shaped matmul
  ([32, 576] x [576, 1536]) whose weight is read again every call (90 distinct weights in turn, as a decode
  step reads each layer's once): the rate this machine gives a batch of 32 rows when weights come from memory.
* Bandwidth floor: every weight read once per decode step (the model's fp32 bytes x steps) at the memory rate
  that streamed matmul achieves.

    python benchmarks/rollout/bench_decode_floor.py                  # 3 pairs, one thread
    python benchmarks/rollout/bench_decode_floor.py --profile        # and the op table of one inverse-CDF call
    python benchmarks/rollout/bench_decode_floor.py --tiny           # a smoke run: a tiny Llama, 8 tokens, 1 pair
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.* and this cispo
from benchmarks._common import interleaved, machine_note, median, set_threads, spread  # noqa: E402


def exponential_draw(probs, generator, rows=None, batch=None):
    """torch.multinomial's draw, spelled out as the sampler had it before the inverse-CDF draw: argmax(p / q),
    q ~ Exp(1) of the whole batch's shape."""
    import torch

    full = probs.shape if rows is None else (batch, probs.shape[1])
    q = torch.empty(full, dtype=probs.dtype, device=probs.device).exponential_(1, generator=generator)  # [B, V]
    return (probs / (q if rows is None else q.index_select(0, rows))).argmax(-1)  # [b]


def streamed_rate(rows: int = 32, n_weights: int = 90, repeats: int = 4) -> tuple[float, float]:
    """(FLOP/s, weight bytes/s) of [rows, 576] x [576, 1536] with `n_weights` distinct weights taken in turn
    (~320 MB: none stays in cache between its uses)."""
    import torch

    x, ws = torch.randn(rows, 576), [torch.randn(1536, 576) for _ in range(n_weights)]
    for w in ws:
        torch.nn.functional.linear(x, w)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for w in ws:
            torch.nn.functional.linear(x, w)
    dt = time.perf_counter() - t0
    return 2 * rows * 576 * 1536 * n_weights * repeats / dt, 576 * 1536 * 4 * n_weights * repeats / dt


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama with SmolLM2's tokenizer, 8 tokens")
    a = p.parse_args(argv)
    threads = set_threads(a.threads)
    import torch

    import cispo.rollout.torch_sampler as ts
    from benchmarks._common import forward_flops, matmul_rate, ours_setup
    from cispo.data.tasks import get_task

    samples = get_task("wordmath").train_samples(0, 4)
    model_path, new_tokens = "builtin:smollm2-135m", 64
    if a.tiny:
        import tempfile

        from cispo.models.packaged import save_tiny_smollm2

        model_path, new_tokens, a.pairs = str(save_tiny_smollm2(Path(tempfile.mkdtemp()) / "tiny")), 8, 1
    s = ours_setup(group_size=8, updates=4, prompts=4, max_new_tokens=new_tokens, suppress_eos=True, task="wordmath",
                   model_path=model_path, samples=samples, extra=("rollout.repetition_stop_tokens=0",))
    sampler, model = s["policy"].sampler.inner, s["policy"].model
    prompts = [s["policy"].encode(x) for x in samples for _ in range(8)]
    cfg, inverse = s["sampling"], ts._multinomial
    gen = torch.Generator().manual_seed(0)
    sampler.generate(prompts, dataclasses.replace(cfg, max_new_tokens=4), gen)  # warm-up

    def with_draw(draw):
        def call():
            ts._multinomial = draw
            try:
                sampler.generate(prompts, cfg, gen)
            finally:
                ts._multinomial = inverse
        return call

    times = interleaved({"inverse-CDF": with_draw(inverse), "exponential": with_draw(exponential_draw)}, a.pairs, 0)
    ratios = [e / i for i, e in zip(times["inverse-CDF"], times["exponential"])]
    steps, rows = cfg.max_new_tokens, len(prompts)
    flops = forward_flops(model, rows, sum(map(len, prompts)) / rows, steps, 8)
    big, (dec, bandwidth) = matmul_rate("float32"), streamed_rate(rows, 8 if a.tiny else 90)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t = median(times["inverse-CDF"])
    print(machine_note(threads))
    print(f"sampling {rows} rows x {steps} tokens: inverse-CDF {t:.2f} s ({spread(times['inverse-CDF'])}), "
          f"exponential {median(times['exponential']):.2f} s; exponential / inverse-CDF by pair "
          f"{', '.join(f'{r:.3f}' for r in ratios)} (median {median(ratios):.3f}x)")
    print(f"useful FLOPs {flops / 1e9:.0f} G; matmul rate {big / 1e9:.1f} GFLOP/s (1024 rows), "
          f"{dec / 1e9:.1f} GFLOP/s streamed at {rows} rows ({bandwidth / 1e9:.2f} GB/s of weights)")
    floors = {"FLOP floor at the 1024-row rate": flops / big,
              f"FLOP floor at the streamed {rows}-row rate": flops / dec,
              "bandwidth floor (every weight once a step)": weight_bytes * steps / bandwidth}
    for name, floor in floors.items():
        print(f"  {name}: {floor:.2f} s -> share achieved {floor / t:.2f}")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sampler.generate(prompts, cfg, gen)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
