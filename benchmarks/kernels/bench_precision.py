"""Memory and speed of one RL update step in float32, bfloat16 with FP32 master weights
(autocast, the default for model.dtype=bfloat16) and pure bfloat16 weights
(model.master_weights=false), on a small random Llama on CPU.

    python benchmarks/kernels/bench_precision.py [--tiny]
    python benchmarks/kernels/bench_precision.py --hidden 512 --layers 4 --vocab 8192 --rows 8 --len 128 --repeats 5

Each mode runs in its own subprocess (peak RSS = ru_maxrss of that process); modes are
interleaved repeat by repeat and the median step time is reported. The machine is shared:
absolute times are noisy, the ratios less so.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

MODES = {"float32": ("float32", True), "bf16 + fp32 master": ("bfloat16", True), "pure bf16": ("bfloat16", False)}


def one(mode: str, a) -> dict:
    import torch
    import transformers

    from cispo.models.loading import precision

    torch.set_num_threads(a.threads)
    dtype, master = MODES[mode]
    param_dtype, autocast = precision(dtype, None, master)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                                   num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=8,
                                   max_position_embeddings=2 * a.len)
    model = transformers.LlamaForCausalLM(cfg).to(param_dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    from cispo.foundations.experience import Completion, collate
    from cispo.models.policy import policy_logprobs

    g = torch.Generator().manual_seed(0)
    rows = [Completion({}, torch.randint(0, a.vocab, (8,), generator=g).tolist(),
                       torch.randint(0, a.vocab, (a.len,), generator=g), torch.zeros(a.len), "length", "")
            for _ in range(a.rows)]
    exp = collate(rows, torch.randn(a.rows), 0)
    times = []
    for _ in range(a.steps + 1):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            logp = policy_logprobs(model, exp)
        (-(logp * exp.advantages[:, None]).mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in model.parameters())
    return {"step_s": min(times[1:]), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "params_m": n_params / 1e6}


def main() -> None:
    p = argparse.ArgumentParser()
    for k, v in (("hidden", 512), ("layers", 4), ("vocab", 8192), ("rows", 8), ("len", 128), ("steps", 2),
                 ("repeats", 3), ("threads", 1)):
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--mode")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (the test suite's)")
    a = p.parse_args()
    if a.tiny:
        a.hidden, a.layers, a.vocab, a.rows, a.len, a.steps, a.repeats = 64, 1, 256, 2, 16, 1, 1
    if a.mode:
        print(json.dumps(one(a.mode, a)))
        return
    results = {m: [] for m in MODES}
    for _ in range(a.repeats):
        for m in MODES:
            out = subprocess.run([sys.executable, __file__, "--mode", m] + [f"--{k}={v}" for k, v in vars(a).items()
                                                                           if k not in ("mode", "tiny")],
                                 capture_output=True, text=True, check=True)
            results[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = sorted(r["step_s"] for r in results["float32"])[len(results["float32"]) // 2]
    print(f"Llama hidden={a.hidden} layers={a.layers} vocab={a.vocab} ({results['float32'][0]['params_m']:.1f}M "
          f"params), {a.rows} rows x {a.len} tokens, {a.threads} thread(s), median of {a.repeats}")
    print("| mode | step (s) | vs float32 | peak RSS (MiB) |\n|---|---|---|---|")
    for m, rs in results.items():
        t = sorted(r["step_s"] for r in rs)[len(rs) // 2]
        mem = sorted(r["peak_rss_mib"] for r in rs)[len(rs) // 2]
        print(f"| {m} | {t:.2f} | {t / base:.2f}x | {mem:.0f} |")


if __name__ == "__main__":
    main()
