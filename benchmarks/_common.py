"""Helpers shared by the benchmarks: interleaved timing, medians, tables, machine notes, and a
driver for our RL step with a sample / score / logp_old / update / overhead breakdown.

Every benchmark compares a baseline and a candidate measured in the same process (or in
alternating subprocesses), interleaved repeat by repeat, and reports medians and ratios: the
development machine has 2 CPU cores shared with other jobs, so absolute times drift by tens of
percent between minutes, while a ratio of interleaved medians is far more stable.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable


def set_threads(n: int | None) -> int:
    """Set torch's intra-op threads (None: leave torch's default); returns the count in use."""
    import torch

    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def spread(xs) -> str:
    """``min-max`` of a list of seconds, for the noise column."""
    xs = list(xs)
    return f"{min(xs):.3g}-{max(xs):.3g}" if xs else "-"


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each callable by ``clock`` (wall by default; ``time.process_time`` counts only this
    process's CPU time, so being descheduled on a loaded machine does not), ``repeats`` times,
    interleaved (ABAB..., the order reversed every other repeat so neither side always runs first);
    ``warmup`` untimed calls each first."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            t0 = clock()
            fns[n]()
            times[n].append(clock() - t0)
    return times


def table(headers: list[str], rows: list[list]) -> str:
    """A plain-text table (also valid Markdown)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1e4 else f"{c:.4g}"
    return str(c)


def machine_note(threads: int) -> str:
    """One line: CPU, cores, torch, threads, and the load average (other jobs on the machine)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cores = os.cpu_count()
    busy = "UNDER LOAD from other processes" if load > 0.5 * (cores or 1) else "machine mostly idle"
    return (f"machine: {cpu}, {cores} cores, torch {torch.__version__}, {threads} thread(s); "
            f"1-min load average {load:.2f} at start ({busy})")


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def model_desc(model) -> str:
    """``Llama h128 x4 layers, mlp 384, vocab 17, 0.86M params``: the shape, since size names may change."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    return (f"{type(model).__name__.replace('ForCausalLM', '')} h{c.hidden_size} x{c.num_hidden_layers} layers, "
            f"mlp {c.intermediate_size}, vocab {c.vocab_size}, {n / 1e6:.2f}M params")


# --------------------------------------------------------------------------- FLOPs and the matmul rate

MATMUL_SHAPE = (1024, 576, 1536)
"""(m, k, n) of `matmul_rate`: 1024 tokens through SmolLM2-135M's MLP up-projection (hidden 576 -> 1536)."""


def matmul_rate(dtype: str = "float32", shape: tuple[int, int, int] = MATMUL_SHAPE, repeats: int = 5) -> float:
    """This machine's matmul rate, FLOP/s, at this process's torch threads: [m, k] activations times an
    [n, k] weight in ``dtype``, 2·m·k·n FLOPs over the median of ``repeats`` timed calls (one untimed
    first), by the faster of ``torch.nn.functional.linear`` (the op of a model's ``nn.Linear`` layers,
    also under autocast) and ``torch.mm`` on the transposed weight: the kernels differ (in bfloat16 on
    a CPU without native bf16 instructions ``torch.mm`` takes a far slower one than ``linear``), and
    the limit is the best either reaches."""
    import torch

    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(r, c, generator=g).to(getattr(torch, dtype)) for r, c in ((m, k), (n, k)))
    wt = w.t().contiguous()  # [k, n]
    best = 0.0
    for op in (lambda: torch.nn.functional.linear(x, w), lambda: torch.mm(x, wt)):
        op()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        best = max(best, 2 * m * k * n / median(times))
    return best


def update_flops(model, rows: int, prompt_len: float, response_len: float, group: int = 1) -> dict:
    """Useful FLOPs of one pass, forward and backward, over ``rows`` rows of ``prompt_len`` prompt and
    ``response_len`` response tokens: ≈ 6 × params × tokens (2 per parameter per token forward, 4
    backward), counted the usual training-FLOPs way, with S = P + T - 1 decoder positions a row and the
    LM head on the T response positions only:

        6 * (decoder linear params) * rows * S  +  6 * (LM head params) * rows * T  +  12 * layers * hidden * S^2 * rows

    (embedding lookups, norms, softmax and the optimizer are not counted; the LM-head recompute of a
    chunked backward and the causal half of attention count as waste, not work). With a mean P over
    ragged prompts the attention term is a slight underestimate (S^2 of the mean).

    ``group`` = G counts each prompt once per group of G rows that share it (what work is needed when the prompt
    is computed once, ``algo.share_prompts``): rows * S becomes rows/G * P + rows * (T - 1) positions, and S^2 a
    row becomes P^2 once per group plus (T - 1)(2P + T - 1) a row (the responses' queries over the prompt's keys
    and their own); ``group=1`` is the formula above."""
    import torch

    c = model.config
    head = model.get_output_embeddings().weight.numel()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) - head
    P, T = prompt_len, response_len
    positions = rows / group * P + rows * (T - 1)
    square = rows / group * P * P + rows * (T - 1) * (2 * P + T - 1)
    parts = {"linear": 6 * linear * positions, "head": 6 * head * rows * T,
             "attention": 12 * c.num_hidden_layers * c.hidden_size * square}
    parts["total"] = sum(parts.values())
    return parts


def forward_flops(model, rows: float, prompt_len: float, response_len: float, group: int = 1) -> float:
    """Useful FLOPs of one forward pass (no backward) over ``rows`` rows: a third of `update_flops`,

        2 * (decoder linear params) * positions  +  2 * (LM head params) * rows * T  +  4 * layers * hidden * S^2 terms

    the work of sampling (a prefill of each prompt, once per group of ``group`` rows when the sampler shares it,
    and T decode steps a row, each with the head) and of a no-grad log-prob pass (``logp_old``) over ``rows``
    rows alike."""
    return update_flops(model, rows, prompt_len, response_len, group)["total"] / 3


# --------------------------------------------------------------------------- memory (Linux)


def rss_mib() -> float:
    """Current resident set size of this process, MiB (``VmRSS``)."""
    return _status_kib("VmRSS") / 1024


def peak_rss_mib() -> float:
    """Peak resident set size since start or the last ``reset_peak_rss`` (``VmHWM``), MiB."""
    return _status_kib("VmHWM") / 1024


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (writes 5 to /proc/self/clear_refs; Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


# --------------------------------------------------------------------------- our RL step, profiled


class Stopwatch:
    """Wraps a callable and adds up the wall seconds spent in it."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


class TimedSampler:
    """A sampler whose ``generate`` calls are timed (``.seconds``)."""

    def __init__(self, sampler):
        self.inner = sampler
        self.generate = Stopwatch(sampler.generate)

    def __getattr__(self, name):  # the inner sampler's other methods (update_weights, sleep, ...)
        return getattr(self.inner, name)


class InOrder:
    """A prompt stream (``take`` is all `RLStep`'s sampler asks of one) that hands out ``samples`` in the given
    order, cycling: two trainers given the same list take the same prompts at every step."""

    def __init__(self, samples: list[dict]):
        self.samples, self.index = list(samples), 0

    def take(self, n: int) -> list[dict]:
        out = [self.samples[(self.index + i) % len(self.samples)] for i in range(n)]
        self.index += n
        return out

    def state_dict(self) -> dict:
        """Where the stream stands (what ``rollout.async_steps=1`` notes before sampling ahead)."""
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]


def ours_setup(size: str = "default", group_size: int = 8, updates: int = 16, prompts: int = 32,
               max_new_tokens: int = 57, seed: int = 0, suppress_eos: bool = False, extra: tuple = (),
               model_path: str | None = None, task: str = "addition", samples: list[dict] | None = None):
    """Everything an RL step needs for the built-in ``task`` on CPU: a built-in Llama of ``size``
    with random init (character tasks), or the model at ``model_path`` (a folder or
    ``builtin:<name>``) loaded as ``cispo train`` loads it (``cispo.training.run_policy.load_policy_for``: the
    chat template of a chat task, ``model.dtype`` from ``extra``, the FP32 head, ``decode=auto``).

    ``suppress_eos``: the sampler gets an EOS id outside the vocabulary, so every response runs
    to ``max_new_tokens`` (fixed lengths, for comparisons), and the repetition early stop is off.
    ``samples``: the prompts to take, in this order (`InOrder`); None: the task's shuffled train
    stream. Returns a dict of the pieces, with the run's ``trainer`` (`cispo.training.trainer.Trainer`, the
    fork probe registered where the task tracks fork strings, as ``cispo train`` does) and ``rl_step``
    (`cispo.training.rl_step.RLStep`, synchronous: `with_prefetch` makes an asynchronous one).
    """
    import dataclasses

    import torch

    import cispo.training.sampling as sampling_mod
    import cispo.training.setup as setup_mod
    from cispo.config.train import TrainConfig, apply_overrides
    from cispo.data.prompts import PromptStream
    from cispo.data.tasks import get_task
    from cispo.models.compile import train_body
    from cispo.models.loading import build_model, build_tokenizer
    from cispo.models.policy import Policy
    from cispo.rollout import TorchSampler
    from cispo.training.probes import ForkDiagnostics
    from cispo.training.rl_step import RLStep
    from cispo.training.run_policy import load_policy_for
    from cispo.training.sampling import StepSampler
    from cispo.training.trainer import Trainer

    the_task = get_task(task)
    cfg = apply_overrides(TrainConfig(), [
        "model.device=cpu", "progress=false", f"prompts_per_step={prompts}", f"group_size={group_size}",
        f"updates_per_batch={updates}", f"max_new_tokens={max_new_tokens}", "dynamic_sampling=false",
        f"seed={seed}", f"data.task={task}", *([f"model.path={model_path}"] if model_path else []), *extra,
    ])
    cpu = torch.device("cpu")
    if model_path:
        policy = load_policy_for(cfg, the_task, cpu)
    else:
        tok = build_tokenizer(the_task.alphabet)
        model = build_model(tok, size=size, seed=seed)
        policy = Policy(model, tok, TorchSampler(model, tok.eos_token_id, tok.pad_token_id), cpu,
                        train_body=train_body(cfg.model, model, cpu, tok.pad_token_id))
    model, tok = policy.model, policy.tokenizer
    sampler = policy.sampler
    if suppress_eos:  # an id past the last logit is never sampled
        sampler = TorchSampler(model, model.get_output_embeddings().weight.shape[0], tok.pad_token_id,
                               autocast=policy.autocast, fp32_head=sampler.fp32_head, decode=sampler.decode)
    policy = dataclasses.replace(policy, sampler=TimedSampler(sampler))
    sampling = setup_mod.sampling_config(cfg.rollout, setup_mod.default_max_new_tokens(the_task))
    if suppress_eos:
        sampling = dataclasses.replace(sampling, repetition_stop_tokens=None)
    score = sampling_mod.score_completions
    if not isinstance(score, Stopwatch):  # RLStep -> StepSampler -> sample_groups -> score_completions
        score = sampling_mod.score_completions = Stopwatch(score)  # dispatch + verifier
    optimizer = setup_mod.make_optimizer(model, cfg.optim)
    obj = setup_mod.make_objective(cfg.algo, cfg.rollout.max_new_tokens)
    stream = InOrder(samples) if samples else PromptStream(the_task.train_samples(cfg.data.seed, 4096), seed=seed)
    generators = {"sample": torch.Generator().manual_seed(seed), "shuffle": torch.Generator().manual_seed(seed + 1)}
    trainer = Trainer(policy, optimizer, obj, cfg, generators["shuffle"])
    forks = setup_mod.fork_matcher(tok, the_task)
    if forks is not None:
        trainer.add_probe(ForkDiagnostics(forks, obj))
    sampler = StepSampler(stream, the_task, cfg, sampling, generators["sample"])
    return {
        "policy": policy, "cfg": cfg, "task": the_task, "sampling": sampling, "score": score,
        "trainer": trainer, "rl_step": RLStep(trainer, sampler),  # the optimizer, stream, generators: theirs
        "params": sum(p.numel() for p in model.parameters()),
        "desc": model_desc(model),
    }


def with_prefetch(setup: dict) -> dict:
    """``setup`` with an asynchronous ``rl_step`` (``rollout.async_steps=1``): the same trainer and sampler,
    and a `cispo.training.prefetch.Prefetch` whose thread samples the next batch while the trainer updates.
    Close it after the last step (``setup["rl_step"].prefetch.close()``)."""
    from cispo.training.prefetch import Prefetch
    from cispo.training.rl_step import RLStep

    step = setup["rl_step"]
    return {**setup, "rl_step": RLStep(step.trainer, step.sampler, Prefetch(setup["policy"]))}


def ours_steps(setup: dict, steps: int) -> list[dict]:
    """Run ``steps`` RL steps; per step: wall seconds split into sample (``generate``), score
    (reward calls incl. their dispatch), logp_old (the ``perf/logp_old_s`` phase: collate + one
    no-grad forward), update (``perf/update_s``: the K optimizer steps) and overhead (the rest:
    decoding, building completions, metrics); plus response tokens, rows, and the mean |sampler log-prob -
    trainer log-prob| of the sampled tokens (``rollout/logp_abs_diff``)."""
    s = setup
    gen, score = s["policy"].sampler.generate, s["score"]
    out = []
    for _ in range(steps):
        g0, r0 = gen.seconds, score.seconds
        t0 = time.perf_counter()
        m = s["rl_step"]()
        wall = time.perf_counter() - t0
        sample, sc = gen.seconds - g0, score.seconds - r0
        row = {"wall": wall, "sample": sample, "score": sc, "logp_old": m["perf/logp_old_s"],
               "update": m["perf/update_s"], "response_len": m.get("rollout/response_length", float("nan")),
               "logp_abs_diff": m.get("rollout/logp_abs_diff", float("nan"))}
        row["overhead"] = wall - sample - sc - row["logp_old"] - row["update"]
        row["rows"] = s["cfg"].rollout.prompts_per_step * s["cfg"].rollout.group_size
        row["tokens"] = row["response_len"] * row["rows"]
        out.append(row)
    return out


PHASES = ("sample", "score", "logp_old", "update", "overhead")
