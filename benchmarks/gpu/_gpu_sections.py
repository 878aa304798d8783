"""``gpu_check.py``'s first sections: environment, lm_head, precision, logprob_agreement. Each fills
``ctx.results`` / ``ctx.nulls`` as it measures and calls ``ctx.save()``, so a section stopped by its
time limit keeps what it had."""

from __future__ import annotations

import contextlib
import importlib.util
import platform
import statistics

import torch

from benchmarks.gpu._gpu_common import (
    NO_CUDA,
    build_qwen,
    fp32_sampler_head,
    log,
    num_params,
    synthetic_tokenizer,
    train_config,
)
from benchmarks.gpu._gpu_report import plot_figure3


def section_environment(ctx) -> None:
    import transformers

    dev, res, nulls = ctx.dev, ctx.results, ctx.nulls
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "cuda": torch.version.cuda}
    if torch.version.cuda is None:
        nulls["versions.cuda"] = "this torch is built without CUDA"
    for pkg in ("vllm", "peft", "triton", "matplotlib", "pydantic"):
        try:
            versions[pkg] = __import__(pkg).__version__
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
            versions[pkg] = None
            nulls[f"versions.{pkg}"] = f"not importable: {type(e).__name__}: {e}"
    name = torch.cuda.get_device_name(dev.device) if dev.cuda else platform.processor() or platform.machine()
    res.update(device=name, device_type=dev.device.type, versions=versions,
               gpu_memory_gib=torch.cuda.get_device_properties(dev.device).total_memory / 2**30 if dev.cuda else None,
               peak_bf16_tflops=ctx.peak, peak_source=ctx.peak_source,
               tf32_matmul_allowed=torch.backends.cuda.matmul.allow_tf32,
               float32_matmul_precision=torch.get_float32_matmul_precision())
    if ctx.peak is None:
        nulls["peak_bf16_tflops"] = ctx.peak_source
    if not dev.cuda:
        nulls["gpu_memory_gib"] = NO_CUDA
    ctx.save()
    n = 8192 if dev.cuda and not ctx.tiny else 256
    dtype = torch.bfloat16 if dev.cuda else torch.float32
    a = torch.randn(n, n, device=dev.device, dtype=dtype)
    b = torch.randn(n, n, device=dev.device, dtype=dtype)
    for _ in range(3):
        a @ b
    _, secs = dev.timed(lambda: [a @ b for _ in range(10)])
    res["matmul"] = {"n": n, "dtype": str(dtype), "tflops": 10 * 2 * n**3 / secs / 1e12}
    ctx.save()


def section_lm_head(ctx) -> None:
    """Chunked vs naive log-probs at the model's vocabulary, bf16 inputs (as in training)."""
    from cispo.objective.logprobs import naive_token_logprobs, token_logprobs

    dev, s, nulls = ctx.dev, ctx.sizes, ctx.nulls
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
    rows = []
    ctx.results.update(vocab=s.vocab, tokens=s.head_tokens, hidden=s.hidden, chunk=s.head_chunk,
                       fp32_logits_gib=s.head_tokens * s.vocab * 4 / 2**30, rows=rows)
    for mode in ("fwd", "fwd+bwd"):
        for name, fn in variants.items():
            h, w = (t.detach().requires_grad_(mode == "fwd+bwd") for t in (h0, w0))

            def op(fn=fn, h=h, w=w, mode=mode):  # this iteration's values, bound as defaults
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
            ctx.save()
            log(f"  lm_head {mode:8s} {name:20s} {row['seconds']} s, peak extra {row['peak_extra_gib']} GiB")
            dev.free()


def section_precision(ctx) -> None:
    """FP32 master weights + bf16 autocast (what ``model.dtype=bfloat16`` gives, ``cispo.models.loading.precision``)
    vs pure bf16 weights (``model.master_weights=false``), AdamW at lr 1e-6. The forward runs under the
    policy's autocast; ``cispo.objective.logprobs.token_logprobs`` turns autocast off inside, so the head stays FP32."""
    dev, s, lr = ctx.dev, ctx.sizes, 1e-6
    ctx.results.update(lr=lr, steps=s.prec_steps, rows=s.prec_rows, length=s.prec_len)
    for variant in ("fp32 master + bf16 autocast", "pure bf16"):
        ctx.results[variant] = res = precision_variant(ctx, master=variant.startswith("fp32"), lr=lr)
        if res["peak_gib"] is None:
            ctx.nulls[f"{variant}.peak_gib"] = NO_CUDA
        ctx.save()
        log(f"  precision {variant}: changed {res['frac_changed_after_step']}, peak {res['peak_gib']} GiB")
        dev.free()


def precision_variant(ctx, master: bool, lr: float) -> dict:
    """``prec_steps`` AdamW steps of an LM loss on random tokens; memory, time and how many weights moved."""
    from cispo.models.loading import precision

    dev, s = ctx.dev, ctx.sizes
    optim = train_config().optim
    param_dtype, autocast = precision("bfloat16", None, master_weights=master)
    model = build_qwen(s, dev, param_dtype or torch.bfloat16, ctx.logit_std)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay)
    before = [p.detach().to("cpu", copy=True) for p in params]  # on the CPU: not in the GPU peaks
    g = torch.Generator(device=dev.device).manual_seed(1)
    ids = torch.randint(3, s.vocab, (s.prec_rows, s.prec_len + 1), device=dev.device, generator=g)  # [b, L+1]
    changed, times, peaks = [], [], []
    for _ in range(s.prec_steps):
        dev.reset_peak()
        times.append(dev.timed(lambda: lm_adamw_step(model, opt, ids, autocast))[1])
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


def lm_adamw_step(model, opt, ids, autocast: torch.dtype | None) -> None:
    """One optimizer step on -mean log p(ids[:, 1:]) (decoder and head under the policy's autocast)."""
    from cispo.models.policy import decoder, lm_head
    from cispo.objective.logprobs import token_logprobs

    on = torch.autocast(ids.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with on:
        hidden = decoder(model)(input_ids=ids[:, :-1], use_cache=False).last_hidden_state  # [b, L, H]
        logp = token_logprobs(hidden, lm_head(model).weight, ids[:, 1:])  # [b, L]
    (-logp.mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@torch.no_grad()
def fraction_changed(params, before) -> dict:
    """Fraction of elements that differ from ``before``: of the parameters, and of their bf16 rounding."""
    total = sum(p.numel() for p in params)
    diff = diff16 = 0
    for p, b in zip(params, before):
        q, b = p.detach(), b.to(p.device)
        diff += int((q != b).sum())
        diff16 += int((q.bfloat16() != b.bfloat16()).sum())
    return {"param": diff / total, "bf16": diff16 / total}


def section_logprob_agreement(ctx) -> None:
    """Rollout vs trainer log-probs of the same tokens, each head precision on each side. The rollout
    comes from vLLM where it is installed (and a GPU is present): MiniMax-M1's Figure 3. Otherwise from
    ``TorchSampler``, which runs the trainer's own kernels: an upper bound on agreement, not Figure 3."""
    from cispo.foundations.experience import Experience
    from cispo.models.policy import Policy
    from cispo.rollout import SamplingConfig, TorchSampler
    from cispo.training.metrics import pearson
    from cispo.training.setup import make_objective, make_optimizer
    from cispo.training.trainer import Trainer

    dev, s = ctx.dev, ctx.sizes
    vllm = dev.cuda and importlib.util.find_spec("vllm") is not None
    model = build_qwen(s, dev, torch.bfloat16, ctx.logit_std)
    tok = synthetic_tokenizer(s.vocab)
    g = torch.Generator(device=dev.device).manual_seed(2)
    prompts = torch.randint(3, s.vocab, (s.agree_rows, s.prompt_len), device=dev.device, generator=g).tolist()
    sampling = SamplingConfig(max_new_tokens=s.agree_new_tokens, temperature=1.0)
    pairs, points = {}, {}
    ctx.results.update(rows=s.agree_rows, new_tokens=s.agree_new_tokens, logit_std=ctx.logit_std, pairs=pairs,
                       sampler="vllm" if vllm else "torch (the trainer's kernels: an upper bound, not Figure 3)")
    if not vllm:
        ctx.nulls["vllm"] = "vLLM is not installed here (or no GPU): the torch sampler stands in"
    for sampler_head in ("bf16", "fp32"):
        batch = (vllm_rollout(ctx, model, tok, prompts, sampling, sampler_head == "fp32") if vllm
                 else torch_rollout(model, prompts, sampling, sampler_head == "fp32", s, dev))
        exp = Experience(torch.cat([batch.prompt_ids, batch.response_ids], 1).to(dev.device),
                         torch.cat([batch.prompt_mask, batch.response_mask.long()], 1).to(dev.device),
                         batch.response_mask.to(dev.device), batch.logp_rollout.to(dev.device),
                         torch.zeros(len(prompts), device=dev.device))
        mask = exp.response_mask.bool()
        for trainer_fp32 in (False, True):
            cfg = train_config(model={"fp32_lm_head": trainer_fp32})
            policy = Policy(model, tok, TorchSampler(model, s.vocab, 0), dev.device)
            trainer = Trainer(policy, make_optimizer(model, cfg.optim), make_objective(cfg.algo, None), cfg,
                              torch.Generator().manual_seed(0))  # only its logp_old pass runs: no update
            lp_train = trainer.compute_logp_old(exp)[mask].float()  # [n]
            lp_roll = exp.logp_rollout[mask].float()  # [n]
            name = f"sampler {sampler_head} head / trainer {'fp32' if trainer_fp32 else 'bf16'} head"
            d = (lp_train - lp_roll).abs()
            p_roll = lp_roll.exp()
            pairs[name] = {"tokens": int(mask.sum()), "prob_pearson": pearson(p_roll, lp_train.exp()),
                           "logp_pearson": pearson(lp_roll, lp_train), "mean_abs_dlogp": float(d.mean()),
                           "max_abs_dlogp": float(d.max()), "median_rollout_prob": float(p_roll.median())}
            keep = torch.randperm(len(p_roll), generator=torch.Generator().manual_seed(4))[:4000]
            points[name] = (p_roll.cpu()[keep].tolist(), lp_train.exp().cpu()[keep].tolist())
            ctx.save()
            log(f"  agreement {name}: prob corr {pairs[name]['prob_pearson']:.4f}, "
                f"mean |dlogp| {pairs[name]['mean_abs_dlogp']:.4g}")
    del model
    dev.free()
    ctx.results["plot"], plot_nulls = plot_figure3(points, ctx.out / "figure3.png", pairs)
    ctx.nulls.update(plot_nulls)


def torch_rollout(model, prompts, sampling, fp32_head: bool, s, dev):
    """``TorchSampler`` on the bf16 model, its head in bf16 or FP32; EOS outside V: full length."""
    from cispo.rollout import TorchSampler

    with fp32_sampler_head(model, fp32_head):
        sampler = TorchSampler(model, eos_token_id=s.vocab, pad_token_id=0)
        return sampler.generate(prompts, sampling, generator=torch.Generator(device=dev.device).manual_seed(3))


def vllm_rollout(ctx, model, tok, prompts, sampling, fp32_head: bool):
    """A vLLM engine on the same weights (saved to ``out/agreement_model``), its head in bf16 or FP32
    (``hf_overrides={"head_dtype": "float32"}``); the engine is shut down afterwards."""
    import gc

    from cispo.models.loading import save_policy
    from cispo.rollout import VLLMSampler

    path = ctx.out / "agreement_model"
    if not path.exists():
        save_policy(model, tok, path)
    sampler = VLLMSampler(path, tok, eos_token_id=2, pad_token_id=0, gpu_memory_utilization=0.25,
                          dtype="bfloat16", fp32_head=fp32_head, max_model_len=ctx.sizes.prompt_len
                          + ctx.sizes.agree_new_tokens + 8, enforce_eager=ctx.tiny)
    ctx.results.setdefault("vllm_info", {})[f"fp32_head={fp32_head}"] = sampler.info()
    batch = sampler.generate(prompts, sampling, generator=torch.Generator().manual_seed(3))
    del sampler
    gc.collect()
    torch.cuda.empty_cache()
    return batch
