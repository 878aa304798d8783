"""Achieved FLOP/s of the K update passes, as a fraction of this machine's own fp32 matmul rate.

    python benchmarks/kernels/bench_update.py                       # default-size Llama, B=256, P=12, T=46, K=16
    python benchmarks/kernels/bench_update.py --tiny
    python benchmarks/kernels/bench_update.py --size small --updates 4 --threads 2
    python benchmarks/kernels/bench_update.py --fused-head --no-profile   # also algo.fused_head=true, interleaved
    python benchmarks/kernels/bench_update.py --compile --no-profile      # also model.compile=on, interleaved
    python benchmarks/kernels/bench_update.py --bare --no-profile         # also the bare Hugging Face loop (the floor)

What is timed: ``cispo.training.trainer.Trainer.update`` on one generation batch, i.e. the K optimizer
steps (per mini-batch: ``policy_logprobs`` forward, ``policy_loss``, backward, grad clipping,
AdamW step), on a batch shaped like the default run's: B rows of a ``--prompt-len``-token prompt
and a ``--response-len``-token response (random ids: every row has the same length, so there is
no padding in the count), built-in Llama of ``--size`` with random init, CPU, fp32.

Useful FLOPs: ``_common.update_flops`` (≈ 6 × params × tokens, split into the decoder's linear
layers, the LM head on the response positions and attention; its docstring has the formula). The reference rate is a
square fp32 ``torch.mm`` (``--mm-size``) at the same thread count, timed interleaved with the
update passes; the fraction is median(update FLOP/s) / median(matmul FLOP/s). A short
``torch.profiler`` pass over one call then splits the time into matmul / attention / other
ops / optimizer / outside ATen ops (Python, autograd and Hugging Face module overhead), and gives
the FLOP/s achieved inside the matmuls themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import (  # noqa: E402
    interleaved,
    load_average,
    machine_note,
    median,
    model_desc,
    set_threads,
    spread,
    table,
    update_flops,
)


def build(args):
    import torch

    from cispo.config.train import TrainConfig, apply_overrides
    from cispo.data.tasks import get_task
    from cispo.foundations.experience import Experience
    from cispo.models.loading import build_model, build_tokenizer
    from cispo.models.policy import Policy, policy_logprobs
    from cispo.rollout import TorchSampler
    from cispo.training.setup import make_objective, make_optimizer

    task = get_task("addition")
    tok = build_tokenizer(task.alphabet)
    model = build_model(tok, size=args.size, seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    B, P, T = args.rows, args.prompt_len, args.response_len
    ids = torch.randint(3, len(tok), (B, P + T), generator=g)
    exp = Experience(ids, torch.ones(B, P + T, dtype=torch.long), torch.ones(B, T), torch.zeros(B, T),
                     torch.randn(B, generator=g))
    with torch.no_grad():
        exp.logp_old = policy_logprobs(model, exp).float()
    cfg = apply_overrides(TrainConfig(), ["model.device=cpu", f"updates_per_batch={args.updates}"])
    policy = Policy(model, tok, TorchSampler(model, tok.eos_token_id, tok.pad_token_id), torch.device("cpu"))
    return policy, exp, cfg, make_objective(cfg.algo, cfg.rollout.max_new_tokens), make_optimizer(model, cfg.optim)


def bare_updates(model, opt, exp, k: int, grad_clip: float):
    """The floor of the K update passes: the same K optimizer steps written as a plain
    Hugging Face training loop — ``model(ids).logits``, log-softmax, gather, an
    advantage-weighted token mean, backward, gradient clipping, AdamW — with none of the
    trainer around it (no objective terms, statistics, micro-batching or chunked head)."""
    import torch

    T = exp.response_mask.shape[1]
    params = [p for p in model.parameters() if p.requires_grad]
    for rows in torch.arange(len(exp)).tensor_split(k):
        ids = exp.input_ids[rows]  # [b, P + T]
        logits = model(input_ids=ids, attention_mask=exp.attention_mask[rows]).logits[:, -T - 1:-1]  # [b, T, V]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -T:, None]).squeeze(-1)  # [b, T]
        loss = -(logp * exp.advantages[rows, None] * exp.response_mask[rows]).sum() / exp.response_mask[rows].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()


def profile_once(run) -> dict:
    """Seconds by category from one profiled call, plus the FLOP/s inside the matmuls."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        run()
    wall = time.perf_counter() - t0
    cats = {"matmul": 0.0, "attention": 0.0, "optimizer": 0.0, "autograd engine": 0.0, "other ops": 0.0}
    mm_flops = 0.0
    top = []
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        name = e.key
        if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"):
            cats["matmul"] += s
            mm_flops += e.flops or 0
        elif "attention" in name or "sdpa" in name.lower():
            cats["attention"] += s
        elif "foreach" in name or "adam" in name.lower() or name.startswith("Optimizer"):
            cats["optimizer"] += s
        elif name.startswith("autograd::") or "Backward" in name:
            cats["autograd engine"] += s
        else:
            cats["other ops"] += s
        top.append((s, e.count, name))
    cats["outside ops (Python, autograd, HF)"] = max(wall - sum(cats.values()), 0.0)
    top.sort(reverse=True)
    return {"wall": wall, "cats": cats, "mm_flops": mm_flops, "top": top[:8]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="default", help="built-in model size (tiny, small, default)")
    p.add_argument("--rows", type=int, default=256, help="rows in the generation batch (default 256 = 32 x G 8)")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--response-len", type=int, default=46)
    p.add_argument("--updates", type=int, default=16, help="K (default 16)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mm-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--fused-head", action="store_true",
                   help="also time the update with algo.fused_head=true (cispo.objective.fused_head), interleaved")
    p.add_argument("--compile", action="store_true",
                   help="also time the update and the logp_old pass with the decoder compiled (model.compile=on), "
                        "interleaved with eager")
    p.add_argument("--bare", action="store_true",
                   help="also time the same K steps as a bare Hugging Face loop (`bare_updates`), interleaved")
    p.add_argument("--tiny", action="store_true", help="tiny model, 16 rows, K=2, 2 repeats, --bare")
    args = p.parse_args(argv)
    if args.tiny:
        args.size, args.rows, args.updates, args.repeats, args.mm_size, args.bare = "tiny", 16, 2, 2, 256, True
    import torch

    from cispo.training.trainer import Trainer

    threads = set_threads(args.threads)
    print(machine_note(threads))
    policy, exp, cfg, obj, opt = build(args)
    shuffle = torch.Generator().manual_seed(args.seed)
    trainer = Trainer(policy, opt, obj, cfg, shuffle)
    run = lambda: trainer.update(exp)  # noqa: E731
    n = args.mm_size
    a, b = torch.randn(n, n), torch.randn(n, n)
    fns = {"update": run, "mm": lambda: torch.mm(a, b)}
    if args.fused_head:
        fused_cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, fused_head=True))
        fused_trainer = Trainer(policy, opt, obj, fused_cfg, shuffle)
        fns["fused"] = lambda: fused_trainer.update(exp)
    if args.bare:
        fns["bare"] = lambda: bare_updates(policy.model, opt, exp, args.updates, cfg.optim.grad_clip)
    compile_s = None
    if args.compile:
        from cispo.models.compile import compiled_decoder

        t0 = time.perf_counter()
        body = compiled_decoder(policy.model, policy.pad_id)
        compile_s = time.perf_counter() - t0
        if body is None:
            raise SystemExit("--compile: torch.compile failed here (see the warning above)")
        compiled = dataclasses.replace(policy, train_body=body)
        compiled_trainer = Trainer(compiled, opt, obj, cfg, shuffle)
        fns["compiled"] = lambda: compiled_trainer.update(exp)
        fns["logp_old"] = lambda: trainer.compute_logp_old(exp)  # every row: no first mini-batch left to the update
        fns["logp_old compiled"] = lambda: compiled_trainer.compute_logp_old(exp)
    times = interleaved(fns, args.repeats, warmup=1)
    flops = update_flops(policy.model, args.rows, args.prompt_len, args.response_len)
    upd_rate = flops["total"] / median(times["update"])
    mm_rate = 2 * n**3 / median(times["mm"])
    print(f"model: built-in '{args.size}' = {model_desc(policy.model)}; batch {args.rows} rows x "
          f"(P={args.prompt_len} + T={args.response_len}), K={args.updates} mini-batches of "
          f"{args.rows // args.updates} rows; useful GFLOP per K passes: {flops['total'] / 1e9:.2f} (linear "
          f"{flops['linear'] / 1e9:.2f}, head {flops['head'] / 1e9:.3f}, attention {flops['attention'] / 1e9:.2f})")
    print(table(["what", "s (median)", "range", "GFLOP/s", "fraction of matmul rate"], [
        [f"K={args.updates} update passes", median(times["update"]), spread(times["update"]), upd_rate / 1e9,
         f"{upd_rate / mm_rate:.1%}"],
        *([[f"K={args.updates} update passes, fused head", median(times["fused"]), spread(times["fused"]),
            flops["total"] / median(times["fused"]) / 1e9,
            f"{flops['total'] / median(times['fused']) / mm_rate:.1%}"]] if args.fused_head else []),
        *([[f"K={args.updates} update passes, compiled decoder", median(times["compiled"]),
            spread(times["compiled"]), flops["total"] / median(times["compiled"]) / 1e9,
            f"{flops['total'] / median(times['compiled']) / mm_rate:.1%}"]] if args.compile else []),
        [f"torch.mm {n}x{n} fp32", median(times["mm"]), spread(times["mm"]), mm_rate / 1e9, "100%"],
    ]))
    if args.compile:
        for name, base in (("compiled", "update"), ("logp_old compiled", "logp_old")):
            pairs = sorted(c / e for c, e in zip(times[name], times[base]))
            print(f"{name} / eager {base} time: median of pairs {median(pairs):.3f} (range {pairs[0]:.3f}-"
                  f"{pairs[-1]:.3f}); eager {base} {median(times[base]):.3f} s")
        print(f"compile at set-up (probe batch, both graphs): {compile_s:.1f} s")
    if args.bare:
        pairs = sorted(u / b for u, b in zip(times["update"], times["bare"]))
        print(f"update / bare Hugging Face loop time: median of pairs {median(pairs):.3f} (range {pairs[0]:.3f}-"
              f"{pairs[-1]:.3f}); bare {median(times['bare']):.4f} s, update {median(times['update']):.4f} s")
    if args.fused_head:
        pairs = sorted(f / u for f, u in zip(times["fused"], times["update"]))
        print(f"fused / chunked update time: median of pairs {median(pairs):.3f} "
              f"(range {pairs[0]:.3f}-{pairs[-1]:.3f})")
    if not args.no_profile:
        prof = profile_once(run)
        w = prof["wall"]
        mm_s = prof["cats"]["matmul"]
        print(f"\nprofile of one call ({w:.2f} s under the profiler vs {median(times['update']):.2f} s without: the "
              "profiler's per-op cost lands mostly in 'outside ops'):")
        print(table(["category", "s", "share"], [[k, v, f"{v / w:.0%}"] for k, v in prof["cats"].items()]))
        if mm_s > 0 and prof["mm_flops"]:
            print(f"inside the matmul ops: {prof['mm_flops'] / 1e9:.2f} GFLOP (the profiler's count) in {mm_s:.2f} s = "
                  f"{prof['mm_flops'] / mm_s / 1e9:.1f} GFLOP/s = "
                  f"{prof['mm_flops'] / mm_s / mm_rate:.0%} of the big-mm rate; "
                  f"matmul self time = {mm_s / median(times['update']):.0%} of the unprofiled update time")
        print("top ops by self time: " + "; ".join(f"{name} {s * 1e3:.0f} ms x{c}" for s, c, name in prof["top"]))
    print(f"\n{args.repeats} interleaved repeats after a warm-up; 1-min load average at end {load_average():.2f}")


if __name__ == "__main__":
    main()
