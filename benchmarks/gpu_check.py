"""GPU readiness check (issue 19): one script that measures the CUDA path in a few minutes.

    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu_out          # one CUDA GPU, <= ~7 min
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu_tiny          # CPU, seconds (the test)
    python benchmarks/gpu_check.py --sections rl_compiled --out gpu2   # re-run one section

A randomly initialised model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV
heads, MLP 4864, vocabulary 151,936, tied embeddings; ~494M parameters) with a synthetic
character tokenizer of the same vocabulary (``cispo.models.build_tokenizer``). Its final norm
is scaled so the logits have std ``--logit-std`` over the vocabulary (default 10): sampled
tokens then have probabilities spread over (0, 1) as a trained model's do, instead of a random
model's ~1/V. Sections, each in its own try/except (an error is recorded, the rest still run):

* environment: device, versions, peak bf16 TFLOP/s (table by device name or ``--peak-tflops``)
  and a measured bf16 matmul rate;
* lm_head: ``cispo.logprobs.token_logprobs`` (chunked, FP32 / bf16 head) vs
  ``naive_token_logprobs`` (full [N, V] logits, bf16 or upcast to fp32) at V = 151,936: time
  and peak memory, forward and forward+backward;
* precision: bf16 compute with FP32 master weights (``torch.autocast``) vs pure bf16 weights:
  memory, and the fraction of weights that small-lr (1e-6) AdamW steps change;
* logprob_agreement: rollout (``TorchSampler``, KV cache, eval mode) vs training
  (``compute_logp_old``) log-probs with a bf16 vs FP32 LM head: Pearson correlation of the
  probabilities, mean |delta log p|; MiniMax-M1's Figure 3 in miniature (``figure3.png``);
* rl_eager / rl_compiled: ``cispo.trainer.rl_step`` on bf16 weights (32 prompts x G=8, 256
  new tokens, K=8 by default; EOS never sampled so every response has the full length):
  sampling / update tokens/s, model FLOP utilisation (FLOPs ~ 2N per token forward, 6N
  forward+backward; attention's own FLOPs not counted), peak memory; compiled = the trainer's
  decoder under ``torch.compile`` (the sampler's decode loop stays eager).

The report (``gpu_check.json``, ``gpu_check.md``, ``figure3.png``) is rewritten after every
section, so a run killed part-way keeps what it measured. Fields that cannot be measured on a
CPU (CUDA memory, MFU without a known peak) are JSON nulls whose reason is in the section's
``null_reasons``. ``--budget-s`` (default 420) skips the sections still to come once spent.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import signal
import statistics
import sys
import time
import traceback
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_common import (  # noqa: E402
    NO_CUDA,
    TINY,
    CompiledDecoder,
    Device,
    Sizes,
    build_qwen,
    fp32_sampler_head,
    log,
    num_params,
    parse_sets,
    peak_tflops,
    synthetic_tokenizer,
)
from _gpu_report import plot_figure3, write_report  # noqa: E402

SECTIONS = ("environment", "lm_head", "precision", "logprob_agreement", "rl_eager", "rl_compiled")


# --------------------------------------------------------------------------- sections


def section_environment(ctx) -> tuple[dict, dict]:
    import transformers

    dev, nulls = ctx.dev, {}
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "cuda": torch.version.cuda}
    if torch.version.cuda is None:
        nulls["versions.cuda"] = "this torch is built without CUDA"
    for pkg in ("peft", "triton", "matplotlib"):
        try:
            versions[pkg] = __import__(pkg).__version__
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
            versions[pkg] = None
            nulls[f"versions.{pkg}"] = f"not importable: {type(e).__name__}: {e}"
    n = 8192 if dev.cuda and not ctx.tiny else 256
    dtype = torch.bfloat16 if dev.cuda else torch.float32
    a = torch.randn(n, n, device=dev.device, dtype=dtype)
    b = torch.randn(n, n, device=dev.device, dtype=dtype)
    for _ in range(3):
        a @ b
    _, secs = dev.timed(lambda: [a @ b for _ in range(10)])
    name = torch.cuda.get_device_name(dev.device) if dev.cuda else platform.processor() or platform.machine()
    peak, source = ctx.peak, ctx.peak_source
    if peak is None:
        nulls["peak_bf16_tflops"] = source
    return {
        "device": name, "device_type": dev.device.type, "versions": versions,
        "gpu_memory_gib": torch.cuda.get_device_properties(dev.device).total_memory / 2**30 if dev.cuda else None,
        "peak_bf16_tflops": peak, "peak_source": source,
        "matmul": {"n": n, "dtype": str(dtype), "tflops": 10 * 2 * n**3 / secs / 1e12},
        "tf32_matmul_allowed": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }, {**nulls, **({} if dev.cuda else {"gpu_memory_gib": NO_CUDA})}


def section_lm_head(ctx) -> tuple[dict, dict]:
    """Chunked vs naive log-probs at the model's vocabulary, bf16 inputs (as in training)."""
    from cispo.logprobs import naive_token_logprobs, token_logprobs

    dev, s = ctx.dev, ctx.sizes
    g = torch.Generator(device=dev.device).manual_seed(0)
    h0 = torch.randn(s.head_tokens, s.hidden, device=dev.device, generator=g) * ctx.logit_std  # [N, H]
    w0 = torch.randn(s.vocab, s.hidden, device=dev.device, generator=g) * s.hidden**-0.5  # logits' std: logit_std
    y = torch.randint(0, s.vocab, (s.head_tokens,), device=dev.device, generator=g)
    h0, w0 = h0.bfloat16(), w0.bfloat16()
    variants = {
        "naive bf16": lambda h, w: naive_token_logprobs(h, w, y),
        "naive fp32 (upcast)": lambda h, w: naive_token_logprobs(h.float(), w.float(), y),
        "chunked fp32 head": lambda h, w: token_logprobs(h, w, y, chunk_size=s.head_chunk),
        "chunked bf16 head": lambda h, w: token_logprobs(h, w, y, chunk_size=s.head_chunk, fp32_head=False),
    }
    w64 = w0.double()
    ref = torch.cat([naive_token_logprobs(h.double(), w64, t)  # float64 reference, by chunks   [N]
                     for h, t in zip(h0.split(s.head_chunk), y.split(s.head_chunk))])
    del w64
    rows, nulls = [], {}
    for mode in ("fwd", "fwd+bwd"):
        for name, fn in variants.items():
            h, w = (t.detach().requires_grad_(mode == "fwd+bwd") for t in (h0, w0))

            def op():
                lp = fn(h, w)
                if mode == "fwd+bwd":
                    lp.sum().backward()
                    h.grad = w.grad = None
                return lp.detach()

            key = f"rows.{len(rows)}"
            try:
                op()  # warm-up
                dev.reset_peak()
                base = dev.allocated_gib()
                times = []
                for _ in range(s.head_repeats):
                    lp, secs = dev.timed(op)
                    times.append(secs)
                peak = None if base is None else dev.peak_gib() - base
                row = {"mode": mode, "variant": name, "seconds": statistics.median(times), "peak_extra_gib": peak,
                       "max_abs_err_vs_fp64": float((lp.double() - ref).abs().max())}
                if peak is None:
                    nulls[f"{key}.peak_extra_gib"] = NO_CUDA
            except torch.OutOfMemoryError as e:  # one variant out of memory: record it, keep going
                row = {"mode": mode, "variant": name, "seconds": None, "peak_extra_gib": None,
                       "max_abs_err_vs_fp64": None, "error": f"OutOfMemoryError: {str(e)[:200]}"}
                for f in ("seconds", "peak_extra_gib", "max_abs_err_vs_fp64"):
                    nulls[f"{key}.{f}"] = "out of memory"
            rows.append(row)
            log(f"  lm_head {mode:8s} {name:20s} {row['seconds']} s, peak extra {row['peak_extra_gib']} GiB")
            dev.free()
    logits_gib = s.head_tokens * s.vocab * 4 / 2**30
    return {"vocab": s.vocab, "tokens": s.head_tokens, "hidden": s.hidden, "chunk": s.head_chunk,
            "fp32_logits_gib": logits_gib, "rows": rows}, nulls


def section_precision(ctx) -> tuple[dict, dict]:
    """FP32 master weights + bf16 autocast vs pure bf16 weights, AdamW at lr 1e-6.

    Implemented here with plain torch so it does not depend on the trainer's mixed-precision
    path (``model.dtype=bfloat16`` with fp32 master weights, in progress on another branch);
    once that lands, variant "fp32 master + bf16 autocast" can be built with
    ``cispo.runner.load_policy_for`` + ``cispo.setup.make_optimizer`` instead.
    The head is computed outside autocast: ``token_logprobs`` under autocast runs its matmul in
    bf16 (a custom autograd Function without ``custom_fwd``), which would undo the FP32 head.
    """
    dev, s, lr = ctx.dev, ctx.sizes, 1e-6
    out, nulls = {"lr": lr, "steps": s.prec_steps, "rows": s.prec_rows, "length": s.prec_len}, {}
    for variant in ("fp32 master + bf16 autocast", "pure bf16"):
        out[variant] = res = precision_variant(ctx, master=variant.startswith("fp32"), lr=lr)
        if res["peak_gib"] is None:
            nulls[f"{variant}.peak_gib"] = NO_CUDA
        log(f"  precision {variant}: changed {res['frac_changed_after_step']}, peak {res['peak_gib']} GiB")
        dev.free()
    return out, nulls


def precision_variant(ctx, master: bool, lr: float) -> dict:
    """``prec_steps`` AdamW steps of an LM loss on random tokens: fp32 weights under bf16
    autocast (``master``) or bf16 weights; memory, time and how many weights each step moved."""
    from cispo.config import TrainConfig

    dev, s, optim = ctx.dev, ctx.sizes, TrainConfig().optim
    model = build_qwen(s, dev, torch.float32 if master else torch.bfloat16, ctx.logit_std)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay)
    before = [p.detach().to("cpu", copy=True) for p in params]  # on the CPU: not in the GPU peaks
    g = torch.Generator(device=dev.device).manual_seed(1)
    ids = torch.randint(3, s.vocab, (s.prec_rows, s.prec_len + 1), device=dev.device, generator=g)  # [b, L+1]
    changed, times, peaks = [], [], []
    for _ in range(s.prec_steps):
        dev.reset_peak()
        times.append(dev.timed(lambda: lm_adamw_step(model, opt, ids, master))[1])
        peaks.append(dev.peak_gib())  # before the comparison's temporaries
        changed.append(fraction_changed(params, before))
    state_bytes = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                      if torch.is_tensor(t))
    return {
        "param_dtype": str(params[0].dtype), "params": num_params(model),
        "param_gib": sum(p.numel() * p.element_size() for p in params) / 2**30,
        "optimizer_state_gib": state_bytes / 2**30, "peak_gib": None if None in peaks else max(peaks),
        "step_seconds": statistics.median(times[1:] or times),
        "frac_changed_after_step": [c["param"] for c in changed],
        "frac_bf16_view_changed_after_step": [c["bf16"] for c in changed],
    }


def lm_adamw_step(model, opt, ids, autocast: bool) -> None:
    """One optimizer step on -mean log p(ids[:, 1:]); the decoder under bf16 autocast when asked,
    the head outside it (FP32, as the trainer computes it)."""
    from cispo.policy import decoder, lm_head
    from cispo.logprobs import token_logprobs

    ctx = torch.autocast(ids.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        hidden = decoder(model)(input_ids=ids[:, :-1], use_cache=False).last_hidden_state  # [b, L, H]
    logp = token_logprobs(hidden, lm_head(model).weight, ids[:, 1:])  # [b, L]
    (-logp.mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@torch.no_grad()
def fraction_changed(params, before) -> dict:
    """Fraction of elements that differ from ``before``: of the parameters themselves, and of
    their bf16 rounding (what a bf16 forward pass sees)."""
    total = sum(p.numel() for p in params)
    diff = diff16 = 0
    for p, b in zip(params, before):
        q, b = p.detach(), b.to(p.device)
        diff += int((q != b).sum())
        diff16 += int((q.bfloat16() != b.bfloat16()).sum())
    return {"param": diff / total, "bf16": diff16 / total}


def section_logprob_agreement(ctx) -> tuple[dict, dict]:
    """Sampler vs trainer log-probs of the same tokens, bf16 weights, each head precision."""
    from cispo.config import TrainConfig, apply_overrides
    from cispo.experience import Experience
    from cispo.metrics import pearson
    from cispo.rollout import SamplingConfig, TorchSampler
    from cispo.policy import Policy
    from cispo.trainer import compute_logp_old

    dev, s = ctx.dev, ctx.sizes
    model = build_qwen(s, dev, torch.bfloat16, ctx.logit_std)
    tok = synthetic_tokenizer(s.vocab)
    g = torch.Generator(device=dev.device).manual_seed(2)
    prompts = torch.randint(3, s.vocab, (s.agree_rows, s.prompt_len), device=dev.device, generator=g).tolist()
    sampling = SamplingConfig(max_new_tokens=s.agree_new_tokens, temperature=1.0)
    out, points = {"rows": s.agree_rows, "new_tokens": s.agree_new_tokens, "logit_std": ctx.logit_std,
                   "pairs": {}}, {}
    for sampler_head in ("bf16", "fp32"):
        with fp32_sampler_head(model, sampler_head == "fp32"):
            sampler = TorchSampler(model, eos_token_id=s.vocab, pad_token_id=0)  # EOS outside V: full length
            batch = sampler.generate(prompts, sampling, generator=torch.Generator(device=dev.device).manual_seed(3))
        exp = Experience(torch.cat([batch.prompt_ids, batch.response_ids], 1),
                         torch.cat([batch.prompt_mask, batch.response_mask.long()], 1), batch.response_mask,
                         batch.logp_rollout, torch.zeros(len(prompts), device=dev.device))
        mask = exp.response_mask.bool()
        for trainer_fp32 in (False, True):
            cfg = apply_overrides(TrainConfig(), [f"model.fp32_lm_head={str(trainer_fp32).lower()}"])
            policy = Policy(model, tok, sampler, dev.device)
            lp_train = compute_logp_old(policy, exp, cfg)[mask].float()  # [n]
            lp_roll = exp.logp_rollout[mask].float()  # [n]
            name = f"sampler {sampler_head} head / trainer {'fp32' if trainer_fp32 else 'bf16'} head"
            d = (lp_train - lp_roll).abs()
            p_roll = lp_roll.exp()
            out["pairs"][name] = {
                "tokens": int(mask.sum()), "prob_pearson": pearson(p_roll, lp_train.exp()),
                "logp_pearson": pearson(lp_roll, lp_train), "mean_abs_dlogp": float(d.mean()),
                "max_abs_dlogp": float(d.max()), "median_rollout_prob": float(p_roll.median()),
            }
            keep = torch.randperm(len(p_roll), generator=torch.Generator().manual_seed(4))[:4000]
            points[name] = (p_roll.cpu()[keep].tolist(), lp_train.exp().cpu()[keep].tolist())
            log(f"  agreement {name}: prob corr {out['pairs'][name]['prob_pearson']:.4f}, "
                f"mean |dlogp| {out['pairs'][name]['mean_abs_dlogp']:.4g}")
    del model
    dev.free()
    out["plot"], nulls = plot_figure3(points, ctx.out / "figure3.png", out["pairs"])
    return out, nulls


def section_rl(ctx, compiled: bool) -> tuple[dict, dict]:
    """Warm-up + measured ``rl_step``s on bf16 weights through the trainer's own code path."""
    import cispo.setup as su
    import cispo.trainer as tr
    from cispo.policy import Policy
    from cispo.config import TrainConfig, apply_overrides
    from cispo.data import PromptStream
    from cispo.rollout import TorchSampler
    from cispo.tasks import get_task

    dev, s = ctx.dev, ctx.sizes
    if compiled and ctx.remaining() < ctx.compile_min_s:
        raise Skipped(f"{ctx.remaining():.0f} s of the budget left, < --compile-min-s {ctx.compile_min_s}")
    task, tok = get_task("addition"), synthetic_tokenizer(s.vocab)
    model = build_qwen(s, dev, torch.bfloat16, ctx.logit_std)
    n = num_params(model)
    cfg = apply_overrides(TrainConfig(), [
        f"model.device={dev.device}", "progress=false", f"prompts_per_step={s.prompts}",
        f"group_size={s.group_size}", f"updates_per_batch={s.updates}", f"max_new_tokens={s.max_new_tokens}",
        "dynamic_sampling=false", "seed=0"])
    sampler = CountingSampler(TorchSampler(model, eos_token_id=s.vocab, pad_token_id=tok.pad_token_id), dev)
    trained = CompiledDecoder(model, ctx.compile_backend) if compiled else model
    policy = Policy(trained, tok, sampler, dev.device)
    sampling = replace(su.sampling_config(cfg.rollout, s.max_new_tokens), repetition_stop_tokens=None)
    optimizer = su.make_optimizer(trained, cfg.optim)
    obj = su.make_objective(cfg.algo, cfg.rollout.max_new_tokens)
    stream = PromptStream(task.train_samples(cfg.data.seed, 4096), seed=0)
    gens = {"sample": torch.Generator(device=dev.device).manual_seed(0), "shuffle": torch.Generator().manual_seed(1)}
    updates, steps = 0, []
    for i in range(1 + s.rl_steps):
        if i > 0 and ctx.remaining() < 0:
            log("  budget spent: no more measured steps")
            break
        if i == 1:
            dev.reset_peak()
        sampler.reset()
        (m, updates), wall = dev.timed(lambda: tr.rl_step(policy, optimizer, stream, task, cfg, obj, sampling,
                                                          gens, updates, su.fork_matcher(tok, task)))
        row = {"wall_s": wall, "sample_s": m["perf/sample_s"], "generate_s": sampler.seconds,
               "logp_old_s": m["perf/logp_old_s"], "update_s": m["perf/update_s"],
               "prompt_tokens": sampler.prompt_tokens, "response_tokens": sampler.response_tokens}
        log(f"  {'compiled' if compiled else 'eager'} step {i}{' (warm-up)' if i == 0 else ''}: "
            f"{wall:.2f} s (sample {row['sample_s']:.2f}, logp_old {row['logp_old_s']:.2f}, "
            f"update {row['update_s']:.2f})")
        steps.append(row)
    res, nulls = rl_summary(steps, n, s, ctx, compiled)
    if compiled:
        res["dynamo"] = dynamo_counts()
    return res, nulls


def dynamo_counts() -> dict:
    """Graphs compiled and graph breaks so far (torch._dynamo's counters: private, may move)."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


class CountingSampler:
    """A sampler that times its ``generate`` calls (synchronised) and counts their prompt and
    response tokens."""

    def __init__(self, inner, dev: Device):
        self.inner, self.dev = inner, dev
        self.reset()

    def __getattr__(self, name):  # the inner sampler's other methods (update_weights, sleep, ...)
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.prompt_tokens = self.response_tokens = 0
        self.seconds = 0.0

    def generate(self, prompt_ids, cfg, generator=None):
        batch, secs = self.dev.timed(lambda: self.inner.generate(prompt_ids, cfg, generator=generator))
        self.seconds += secs
        self.prompt_tokens += int(batch.prompt_mask.sum())
        self.response_tokens += int(batch.response_mask.sum())
        return batch


def rl_summary(steps: list[dict], n: int, s: Sizes, ctx, compiled: bool) -> tuple[dict, dict]:
    """Medians over the measured steps; FLOPs = 2N per token forward, 6N forward+backward.
    Sampling is timed around ``generate`` alone; ``sample_s`` (the trainer's) adds decoding
    the responses and scoring them."""
    measured = steps[1:]
    if not measured:
        raise Skipped("budget spent during the warm-up step: nothing measured")
    med = lambda k: statistics.median(r[k] for r in measured)  # noqa: E731
    tokens = med("prompt_tokens") + med("response_tokens")  # every row's real positions (epochs=1)
    flops = {"generate": 2 * n * tokens, "logp_old": 2 * n * tokens, "update": 6 * n * tokens}
    res = {
        "compiled": compiled, "compile_backend": ctx.compile_backend if compiled else None, "params": n,
        "rows": s.prompts * s.group_size, "max_new_tokens": s.max_new_tokens, "updates_per_batch": s.updates,
        "measured_steps": len(measured), "warmup_step_s": steps[0]["wall_s"],
        "step_s": med("wall_s"), "sample_s": med("sample_s"), "generate_s": med("generate_s"),
        "logp_old_s": med("logp_old_s"),
        "update_s": med("update_s"), "response_tokens": med("response_tokens"), "tokens": tokens,
        "sampling_tokens_per_s": med("response_tokens") / med("generate_s"),
        "update_tokens_per_s": tokens / med("update_s"),
        "mfu": {k: (None if ctx.peak is None else flops[k] / med(f"{k}_s") / (ctx.peak * 1e12)) for k in flops},
        "achieved_tflops": {k: flops[k] / med(f"{k}_s") / 1e12 for k in flops},
        "peak_gib": ctx.dev.peak_gib(), "steps": steps,
    }
    nulls = {f"mfu.{k}": ctx.peak_source for k in flops} if ctx.peak is None else {}
    if res["peak_gib"] is None:
        nulls["peak_gib"] = NO_CUDA
    if not compiled:
        nulls["compile_backend"] = "eager run: nothing compiled"
    return res, nulls


# --------------------------------------------------------------------------- report


class Context:
    def __init__(self, args, dev: Device, sizes: Sizes):
        self.args, self.dev, self.sizes, self.tiny = args, dev, sizes, args.tiny
        self.out, self.logit_std = Path(args.out), args.logit_std
        self.compile_backend, self.compile_min_s = args.compile_backend, args.compile_min_s
        self.peak, self.peak_source = peak_tflops(dev, args.peak_tflops)
        self.deadline = time.monotonic() + args.budget_s
        self.stopped: str | None = None  # why the run stopped early (SIGTERM), if it did

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


RUNNERS = {
    "environment": section_environment, "lm_head": section_lm_head, "precision": section_precision,
    "logprob_agreement": section_logprob_agreement,
    "rl_eager": lambda ctx: section_rl(ctx, compiled=False), "rl_compiled": lambda ctx: section_rl(ctx, compiled=True),
}


class Skipped(Exception):
    """Not enough budget left for this section (or for a measured step of it)."""


class Terminated(BaseException):
    """SIGTERM arrived (e.g. from ``timeout``): the running section stops, the report is written.
    A BaseException, so that no ``except Exception`` inside a section swallows it."""


def _terminated(signum, frame):
    raise Terminated(f"signal {signum} received")


def run_section(name: str, ctx: Context) -> dict:
    if ctx.remaining() < 0:
        why = ctx.stopped or f"budget of {ctx.args.budget_s:.0f} s spent"
        log(f"{name}: skipped ({why})")
        return {"status": "skipped", "seconds": 0.0, "error": why, "results": None, "null_reasons": {}}
    log(f"{name}: start ({ctx.remaining():.0f} s of the budget left)")
    t0 = time.monotonic()
    try:
        results, nulls = RUNNERS[name](ctx)
        entry = {"status": "ok", "error": None, "results": results, "null_reasons": nulls}
    except (Exception, Terminated) as e:  # noqa: BLE001 - one section's failure must not lose the others
        if isinstance(e, Terminated):  # skip what is left
            ctx.deadline, ctx.stopped = time.monotonic() - 1, f"{e} during {name}"
        tb = traceback.format_exc(limit=-4)
        status = "skipped" if isinstance(e, Skipped) else "error"
        entry = {"status": status, "error": f"{type(e).__name__}: {e}", "traceback": tb, "results": None,
                 "null_reasons": {}}
        log(f"{name}: ERROR {type(e).__name__}: {e}\n{tb}")
    ctx.dev.free()
    entry["seconds"] = time.monotonic() - t0
    log(f"{name}: {entry['status']} in {entry['seconds']:.1f} s")
    return entry


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json, gpu_check.md, figure3.png")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (hidden 32, 2 layers, V=1000): seconds on a CPU")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining sections once this is spent")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: table by device name)")
    p.add_argument("--logit-std", type=float, default=10.0, help="std of the random model's logits over V")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; aot_eager "
                   "with --tiny)")
    p.add_argument("--compile-min-s", type=float, default=90.0, help="skip rl_compiled with less budget left")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a size, e.g. --set max_new_tokens=512 --set updates=16 (fields: "
                        + ", ".join(f.name for f in fields(Sizes)) + ")")
    a = p.parse_args(argv)
    names = [n for n in a.sections.split(",") if n]
    bad = sorted(set(names) - set(SECTIONS))
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {','.join(SECTIONS)}")
    sizes = TINY if a.tiny else Sizes()
    try:
        sizes = replace(sizes, **parse_sets(a.set))
    except ValueError as e:
        p.error(str(e))
    a.compile_backend = a.compile_backend or ("aot_eager" if a.tiny else "inductor")
    dev = Device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    ctx = Context(a, dev, sizes)
    report = {"meta": {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "tiny": a.tiny, "device": str(dev.device),
                       "budget_s": a.budget_s, "sizes": asdict(sizes), "logit_std": a.logit_std, "total_s": 0.0},
              "sections": {}}
    log(f"device {dev.device}, sizes {asdict(sizes)}")
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _terminated)  # `timeout` kills: record it in the running section
    for name in names:
        report["sections"][name] = {"status": "running", "seconds": 0.0, "error": "did not finish (killed?)",
                                    "results": None, "null_reasons": {}}
        write_report(report, Path(a.out))
        report["sections"][name] = run_section(name, ctx)
        report["meta"]["total_s"] = time.monotonic() - t0
        write_report(report, Path(a.out))
    failed = [n for n, s in report["sections"].items() if s["status"] != "ok"]
    log(f"done in {report['meta']['total_s']:.0f} s; report in {a.out}; not ok: {failed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
