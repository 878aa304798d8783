"""``gpu_check.py``'s training sections: rl_eager / rl_compiled, head_share, long_responses,
decode_batch, checkpoint. All run the path ``model.dtype=bfloat16`` gives a user (FP32 master
weights, bf16 autocast, the FP32 head: ``cispo.models.loading.precision``), built with the trainer's own
pieces. Each fills ``ctx.results`` / ``ctx.nulls`` as it measures and calls ``ctx.save()``."""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import replace

import torch

from benchmarks.gpu._gpu_common import (
    NO_CUDA,
    Device,
    Skipped,
    build_qwen,
    calibrate_eos,
    log,
    num_params,
    synthetic_tokenizer,
    train_config,
)


def user_policy(ctx, model, tok, cfg, sampler=None):
    """The ``Policy`` ``cispo.training.run_policy.load_policy_for`` builds for ``cfg`` around ``model`` (FP32 weights):
    bf16 autocast, the FP32 head in the sampler, the compiled decoder where ``model.compile=on``."""
    from cispo.models.compile import train_body
    from cispo.models.loading import precision
    from cispo.models.policy import Policy, loss_scaler
    from cispo.rollout import TorchSampler

    _, autocast = precision(cfg.model.dtype, None, cfg.model.master_weights)
    dev = ctx.dev.device
    if sampler is None:
        sampler = TorchSampler(model, tok.eos_token_id, tok.pad_token_id, autocast=autocast,
                               fp32_head=cfg.model.fp32_lm_head, compile_step=cfg.model.compile == "on")
    return Policy(model, tok, sampler, dev, autocast=autocast, grad_scaler=loss_scaler(autocast, dev),
                  train_body=train_body(cfg.model, model, dev, tok.pad_token_id, cfg.steps))


class CountingSampler:
    """A sampler that times its ``generate`` calls (synchronised), counts their tokens and records the
    peak memory of sampling."""

    def __init__(self, inner, dev: Device, phases: dict):
        self.inner, self.dev, self.phases = inner, dev, phases
        self.reset()

    def __getattr__(self, name):  # the inner sampler's other methods (update_weights, sleep, ...)
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.prompt_tokens = self.response_tokens = 0
        self.seconds = 0.0

    def generate(self, prompt_ids, cfg, generator=None):
        with phase(self.dev, self.phases, "sample"):
            batch, secs = self.dev.timed(lambda: self.inner.generate(prompt_ids, cfg, generator=generator))
        self.seconds += secs
        self.prompt_tokens += int(batch.prompt_mask.sum())
        self.response_tokens += int(batch.response_mask.sum())
        return batch


@contextlib.contextmanager
def phase(dev: Device, phases: dict, name: str):
    """Peak CUDA memory (GiB) while the block runs, kept as the largest seen for ``name``."""
    if dev.cuda:
        torch.cuda.reset_peak_memory_stats(dev.device)
    yield
    if dev.cuda:
        phases[name] = max(phases.get(name, 0.0), dev.peak_gib())


@contextlib.contextmanager
def phases_of_the_trainer(dev: Device, phases: dict):
    """The trainer's logp_old pass and updates (``Trainer.compute_logp_old``, ``Trainer.update``), each under
    :func:`phase` (the class's methods swapped for the duration: measurement only)."""
    from cispo.training.trainer import Trainer

    originals = {"logp_old": Trainer.compute_logp_old, "update": Trainer.update}

    def wrapped(name, fn):
        def run(*a, **k):
            with phase(dev, phases, name):
                return fn(*a, **k)
        return run

    Trainer.compute_logp_old = wrapped("logp_old", originals["logp_old"])
    Trainer.update = wrapped("update", originals["update"])
    try:
        yield
    finally:
        Trainer.compute_logp_old, Trainer.update = originals["logp_old"], originals["update"]


def section_rl(ctx, compiled: bool) -> None:
    """Warm-up + measured RL steps (`cispo.training.rl_step.RLStep`) on the user's default precision path,
    EOS sampled."""
    import cispo.training.setup as su
    from cispo.data.prompts import PromptStream
    from cispo.data.tasks import get_task
    from cispo.training.probes import ForkDiagnostics
    from cispo.training.rl_step import RLStep
    from cispo.training.sampling import StepSampler
    from cispo.training.trainer import Trainer

    dev, s, res = ctx.dev, ctx.sizes, ctx.results
    task, tok = get_task("addition"), synthetic_tokenizer(s.vocab)
    model = build_qwen(s, dev, torch.float32, ctx.logit_std)  # FP32 master weights
    res["eos"] = calibrate_eos(model, s, dev)  # responses of ~max_new_tokens / 2 on average
    n = num_params(model)
    cfg = train_config(model={"device": str(dev.device), "dtype": "bfloat16", "compile": "on" if compiled else "off"},
                       rollout={"prompts_per_step": s.prompts, "group_size": s.group_size,
                                "max_new_tokens": s.max_new_tokens, "dynamic_sampling": False},
                       algo={"updates_per_batch": s.updates}, progress=False, seed=0, steps=1 + s.rl_steps)
    phases: dict = {}
    policy = user_policy(ctx, model, tok, cfg)
    policy.sampler = CountingSampler(policy.sampler, dev, phases)
    res.update(compiled=compiled, compiled_decoder=policy.train_body is not None, params=n,
               rows=s.prompts * s.group_size, max_new_tokens=s.max_new_tokens, updates_per_batch=s.updates,
               precision="FP32 master weights, bf16 autocast, FP32 head", steps=[], peak_gib_by_phase=phases)
    if compiled and policy.train_body is None:
        ctx.nulls["compiled_decoder"] = "cispo.models.compile fell back to eager (its warning is in the log)"
    sampling = replace(su.sampling_config(cfg.rollout, s.max_new_tokens), repetition_stop_tokens=None)
    optimizer = su.make_optimizer(model, cfg.optim)
    obj = su.make_objective(cfg.algo, cfg.rollout.max_new_tokens)
    stream = PromptStream(task.train_samples(cfg.data.seed, 4096), seed=0)
    gens = {"sample": torch.Generator(device=dev.device).manual_seed(0), "shuffle": torch.Generator().manual_seed(1)}
    trainer = Trainer(policy, optimizer, obj, cfg, gens["shuffle"])
    forks = su.fork_matcher(tok, task)
    if forks is not None:  # as ``cispo train`` registers it
        trainer.add_probe(ForkDiagnostics(forks, obj))
    rl_step = RLStep(trainer, StepSampler(stream, task, cfg, sampling, gens["sample"]))
    with phases_of_the_trainer(dev, phases):
        for i in range(1 + s.rl_steps):
            policy.sampler.reset()
            m, wall = dev.timed(rl_step)
            row = {"wall_s": wall, "sample_s": m["perf/sample_s"], "generate_s": policy.sampler.seconds,
                   "logp_old_s": m["perf/logp_old_s"], "update_s": m["perf/update_s"],
                   "prompt_tokens": policy.sampler.prompt_tokens, "response_tokens": policy.sampler.response_tokens}
            res["steps"].append(row)
            if i > 0:
                res.update(rl_summary(res["steps"], n, s, ctx))
            ctx.save()
            log(f"  {'compiled' if compiled else 'eager'} step {i}{' (warm-up)' if i == 0 else ''}: {wall:.2f} s "
                f"(sample {row['sample_s']:.2f}, logp_old {row['logp_old_s']:.2f}, update {row['update_s']:.2f}), "
                f"{row['response_tokens']} response tokens")
    if compiled:
        res["dynamo"] = dynamo_counts()
    if not dev.cuda:
        ctx.nulls["peak_gib_by_phase"] = NO_CUDA
    if ctx.peak is None:
        ctx.nulls.update({f"mfu.{k}": ctx.peak_source for k in ("generate", "logp_old", "update")})


def rl_summary(steps: list[dict], n: int, s, ctx) -> dict:
    """Medians over the measured steps (all but the first); FLOPs = 2N per token forward, 6N forward +
    backward (attention's own FLOPs not counted)."""
    measured = steps[1:]
    med = lambda k: statistics.median(r[k] for r in measured)  # noqa: E731
    tokens = med("prompt_tokens") + med("response_tokens")
    flops = {"generate": 2 * n * tokens, "logp_old": 2 * n * tokens, "update": 6 * n * tokens}
    return {"measured_steps": len(measured), "warmup_step_s": steps[0]["wall_s"], "step_s": med("wall_s"),
            "sample_s": med("sample_s"), "generate_s": med("generate_s"), "logp_old_s": med("logp_old_s"),
            "update_s": med("update_s"), "response_tokens": med("response_tokens"), "tokens": tokens,
            "mean_response_length": med("response_tokens") / (s.prompts * s.group_size),
            "sampling_tokens_per_s": med("response_tokens") / med("generate_s"),
            "update_tokens_per_s": tokens / med("update_s"),
            "mfu": {k: None if ctx.peak is None else flops[k] / med(f"{k}_s") / (ctx.peak * 1e12) for k in flops},
            "achieved_tflops": {k: flops[k] / med(f"{k}_s") / 1e12 for k in flops}}


def dynamo_counts() -> dict:
    """Graphs compiled and graph breaks so far (torch._dynamo's counters: private, may move)."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def random_experience(s, dev: Device, rows: int, lengths: list[int], prompt_len: int, seed: int = 5):
    """An ``Experience`` of random tokens: ``rows`` responses of the given lengths, advantages +-1."""
    from cispo.foundations.experience import Completion, collate

    g = torch.Generator().manual_seed(seed)
    comps = [Completion({"prompt": ""}, torch.randint(3, s.vocab, (prompt_len,), generator=g).tolist(),
                        torch.randint(3, s.vocab, (n,), generator=g), torch.zeros(n), "length", "")
             for n in lengths[:rows]]
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(rows)])
    return collate(comps, adv, 0, device=dev.device)


def timed_update(ctx, policy, exp, cfg) -> float:
    """Seconds of one ``Trainer.update`` (K=1) on ``exp``, synchronised."""
    import cispo.training.setup as su
    from cispo.training.trainer import Trainer

    optimizer = su.make_optimizer(policy.model, cfg.optim)
    trainer = Trainer(policy, optimizer, su.make_objective(cfg.algo, None), cfg, torch.Generator().manual_seed(0))
    exp.logp_old = trainer.compute_logp_old(exp)
    return ctx.dev.timed(lambda: trainer.update(exp))[1]


def section_head_share(ctx) -> None:
    """One update's time with the FP32 head and with a bf16 one, TF32 matmuls off and on: the FP32
    head's share of the update is 1 - bf16 / FP32 (medians of interleaved repeats)."""
    dev, s, res = ctx.dev, ctx.sizes, ctx.results
    tok = synthetic_tokenizer(s.vocab)
    model = build_qwen(s, dev, torch.float32, ctx.logit_std)
    exp = random_experience(s, dev, s.share_rows, [s.share_len] * s.share_rows, s.prompt_len)
    times: dict = {}
    res.update(rows=s.share_rows, length=s.share_len, seconds=times)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for repeat in range(3):
            for allow in (False, True):
                torch.backends.cuda.matmul.allow_tf32 = allow
                for fp32 in (True, False):
                    cfg = train_config(model={"dtype": "bfloat16", "fp32_lm_head": fp32},
                                       algo={"updates_per_batch": 1, "micro_batch_size": s.share_rows})
                    key = f"tf32 {'on' if allow else 'off'}, {'fp32' if fp32 else 'bf16'} head"
                    secs = timed_update(ctx, user_policy(ctx, model, tok, cfg), exp, cfg)
                    if repeat:  # the first round warms up
                        times.setdefault(key, []).append(secs)
            if repeat:
                res["fp32_head_share"] = {f"tf32 {t}": 1 - statistics.median(times[f"tf32 {t}, bf16 head"])
                                          / statistics.median(times[f"tf32 {t}, fp32 head"]) for t in ("off", "on")}
                ctx.save()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    if not dev.cuda:
        ctx.nulls["tf32"] = "TF32 exists only on a GPU: on a CPU both settings are the same"


def section_long_responses(ctx) -> None:
    """Updates on responses of long_min..long_max tokens (evenly spread, length-sorted micro-batches),
    gradient checkpointing off and on: seconds and peak memory of one update."""
    dev, s, res = ctx.dev, ctx.sizes, ctx.results
    tok = synthetic_tokenizer(s.vocab)
    model = build_qwen(s, dev, torch.float32, ctx.logit_std)
    lengths = torch.linspace(s.long_min, s.long_max, s.long_rows).round().long().tolist()
    exp = random_experience(s, dev, s.long_rows, lengths, s.prompt_len)
    res.update(rows=s.long_rows, lengths=lengths, micro_batch_size=s.long_micro, runs={})
    for checkpointing in (False, True):
        if checkpointing:
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        cfg = train_config(model={"dtype": "bfloat16", "gradient_checkpointing": checkpointing},
                           algo={"updates_per_batch": 1, "micro_batch_size": s.long_micro})
        policy = user_policy(ctx, model, tok, cfg)
        dev.reset_peak()
        key = f"gradient checkpointing {'on' if checkpointing else 'off'}"
        try:
            secs = timed_update(ctx, policy, exp, cfg)
            res["runs"][key] = {"update_s": secs, "tokens_per_s": float(exp.response_mask.sum()) / secs,
                                "peak_gib": dev.peak_gib()}
            if not dev.cuda:
                ctx.nulls[f"runs.{key}.peak_gib"] = NO_CUDA
        except torch.OutOfMemoryError as e:
            res["runs"][key] = {"error": f"OutOfMemoryError: {str(e)[:200]}"}
        ctx.save()
        log(f"  long responses, {key}: {res['runs'][key]}")
        dev.free()


def section_decode_batch(ctx) -> None:
    """Sampling tokens/s against the batch size: ``TorchSampler`` (bf16 autocast, FP32 head, static KV
    cache), ``decode_tokens`` new tokens per row (EOS outside the vocabulary: every row runs to the end)."""
    from cispo.rollout import SamplingConfig, TorchSampler

    dev, s, res = ctx.dev, ctx.sizes, ctx.results
    model = build_qwen(s, dev, torch.float32, ctx.logit_std)
    sampler = TorchSampler(model, s.vocab, 0, autocast=torch.bfloat16, fp32_head=True)
    sampling = SamplingConfig(max_new_tokens=s.decode_tokens, temperature=1.0)
    res.update(new_tokens=s.decode_tokens, rows=[])
    for b in [int(x) for x in s.decode_batches.split(",")]:
        prompts = torch.randint(3, s.vocab, (b, s.prompt_len), generator=torch.Generator().manual_seed(b)).tolist()
        gen = torch.Generator(device=dev.device).manual_seed(0)
        sampler.generate(prompts[:1], replace(sampling, max_new_tokens=2), generator=gen)  # warm-up
        batch, secs = dev.timed(lambda prompts=prompts, gen=gen: sampler.generate(prompts, sampling, generator=gen))
        tokens = int(batch.response_mask.sum())
        res["rows"].append({"batch": b, "seconds": secs, "tokens_per_s": tokens / secs,
                            "ms_per_step": 1000 * secs / s.decode_tokens})
        ctx.save()
        log(f"  decode batch {b}: {tokens / secs:.0f} tokens/s")
        if ctx.remaining() < 0:
            raise Skipped("budget spent")


def section_checkpoint(ctx) -> None:
    """``save_checkpoint`` / ``load_checkpoint`` of the model with its AdamW state (after one step), in a
    temporary folder next to ``--out``: seconds and size."""
    from cispo.training.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
    from cispo.training.setup import make_optimizer

    dev, s, res = ctx.dev, ctx.sizes, ctx.results
    tok = synthetic_tokenizer(s.vocab)
    model = build_qwen(s, dev, torch.float32, ctx.logit_std)
    optimizer = make_optimizer(model, train_config().optim)
    sum(p.float().pow(2).sum() for p in model.parameters()).backward()
    optimizer.step()  # the AdamW state exists (two FP32 moments per weight)
    with tempfile.TemporaryDirectory(dir=ctx.out) as run_dir:
        from pathlib import Path

        t0 = time.perf_counter()
        path = save_checkpoint(Path(run_dir), 1, Checkpoint(model, tok, optimizer, {"step": 1}, {}))
        res["save_s"] = time.perf_counter() - t0
        res["gib_on_disk"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30
        ctx.save()
        t0 = time.perf_counter()
        load_checkpoint(path, model, optimizer)
        dev.sync()
        res["load_s"] = time.perf_counter() - t0
    ctx.save()
    log(f"  checkpoint: save {res['save_s']:.1f} s, load {res['load_s']:.1f} s, {res['gib_on_disk']:.2f} GiB")
