"""A real model's RL step, cispo vs TRL's ``GRPOTrainer`` (``loss_type="cispo"``): SmolLM2-135M-Instruct on
the ``wordmath`` task, the same workload on both sides, interleaved in one run; and the update passes' FLOP
rate as a share of this machine's measured fp32 and bf16 matmul rates.

    python benchmarks/vs_trl/bench_trl_smollm2.py        # needs trl and builtin:smollm2-135m; the defaults below
    python benchmarks/vs_trl/bench_trl_smollm2.py --pairs 3 --steps 2 --prompts 4 --group 8 --max-new-tokens 64 \\
        --updates 4
    python benchmarks/vs_trl/bench_trl_smollm2.py --bf16-steps 1 --bf16-repeats 1    # also cispo under bf16 autocast
    python benchmarks/vs_trl/bench_trl_smollm2.py --cispo-set 'algo.minibatch_order=by_group'   # other cispo settings
    python benchmarks/vs_trl/bench_trl_smollm2.py --pairs 1 --steps 1 --prompts 2 --group 2 --max-new-tokens 8 \\
        --updates 1

The workload, the same on both sides: the model ``--model`` (default ``builtin:smollm2-135m``, cispo's
converted fp32 folder of the packaged GGUF, ``cispo.models.packaged``; each side loads it from that folder); the
``wordmath`` train problems (seed ``--seed``) as chat messages (the task's system prompt, then the
problem), through the tokenizer's chat template with the assistant turn opened; one list of
(``--steps`` + 1) x ``--prompts`` problems, handed out in the same order to both (cispo through
``_common.InOrder``, TRL with ``shuffle_dataset=False``), so step i of each side samples the same
prompts; G = ``--group`` answers each; L = ``--max-new-tokens``; K = ``--updates`` optimizer steps per
generation batch of B = prompts x G rows, one pass over it; the task's verifier as the reward; fp32;
temperature 1; no KL; AdamW at ``--lr`` (constant) with cispo's other optimizer defaults. The settings
of one step on each side: the table in ``_trl_common.py``. ``--eos suppressed`` (default) makes every
response exactly L tokens on both sides (identical work); ``--eos natural`` lets the policy stop (the
lengths then differ: compare tokens/s).

Each pair runs one TRL worker and one cispo worker back to back, each in a fresh process (TRL first
in even pairs, cispo first in odd ones); a worker runs 1 + ``--steps`` RL steps and drops the first
(set-up, first calls). Both run at their default thread count (``--threads default``: cispo's
``threads`` rule, which picks fewer threads on a loaded machine; TRL torch's, one per core), or at
``--threads N`` both. Printed: each side's medians (s/step, steps/s, tokens/s and the sample / score /
logp_old / update / overhead split), cispo / TRL steps/s pair by pair and their median; the prompt
tokens each side's steps held (equal when the prompts are); whether cispo's sampler took the
static-cache decode; and per side the update passes' useful FLOP rate (``_common.update_flops``,
≈ 6 x params x tokens) as a share of the fp32 and the bf16 matmul rate of the model's MLP shape,
1024 tokens x 576 -> 1536 (``_common.matmul_rate``: the faster of ``linear`` and ``mm``), measured in
that worker at its threads. Then each phase against its floor: sampling (a forward over the batch,
``_common.forward_flops``, each prompt once per group), logp_old (a forward over the rows that side's no-grad
pass computes: cispo all but the first update's, none under ``algo.logp_old=rollout``; TRL the batch) and the
update (``update_flops``, each prompt once per group): GFLOP, seconds, the share of the matmul rate at the
precision used, and the floor in seconds (those FLOPs at that rate).
``--bf16-steps N`` adds, after each of the first ``--bf16-repeats`` pairs, a cispo worker under bf16
autocast over FP32 master weights (``model.dtype=bfloat16``): its step and update time against the
fp32 cispo workers', its share of the bf16 matmul rate, and its sampler-vs-trainer log-prob gap
(``rollout/logp_abs_diff``) beside fp32's.

What still differs between the two workloads (what each trainer does, not only how):

1. Sampling: cispo's own static-cache decode loop vs TRL's ``model.generate`` with transformers'
   ``DynamicCache`` (TRL's default ``cache_implementation``). This is the implementation measured.
2. cispo's defaults changed here to match TRL: the repetition early stop (3/4 of L) is off
   (``rollout.repetition_stop_tokens=0``), dynamic sampling is off, the lr warm-up (16 updates) is 0.
3. EOS suppression: TRL masks its EOS ids' logits each step (``suppress_tokens``, a logits processor);
   cispo gets an EOS id outside the vocabulary (no extra work).
4. cispo tracks the task's reflective strings (fork diagnostics, per update) and samples with its FP32
   head (its defaults; on an fp32 model the same numbers by another code path); TRL does neither.
5. logp_old: cispo's no-grad pass skips the rows of the first update (it reads them from that update's
   forward); TRL's covers the whole batch.
6. Rewards: the same function; cispo calls it through its reward dispatch, TRL directly.
7. Bookkeeping: TRL's Trainer loop, accelerate and metrics every RL step (``logging_steps=K``); cispo's
   metrics every step. Prompt tokenisation: cispo ``apply_chat_template(tokenize=True)``, TRL renders
   the template then tokenises (the printed prompt tokens show whether they agree).
8. Threads at each side's default can differ (printed); ``--threads N`` removes that difference.
9. bf16 autocast is measured for cispo only (TRL runs ``bf16=False``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import MATMUL_SHAPE, machine_note, matmul_rate, median, table, update_flops  # noqa: E402
from benchmarks.vs_trl._trl_common import grpo_config, report, run_worker, train_timed, worker_threads  # noqa: E402

SIDES = ("TRL", "cispo", "cispo-bf16")
DTYPES = ("float32", "bfloat16")


def workload(a) -> list[dict]:
    """The prompts of every worker's steps, in the order both sides take them (the first P: the warm-up)."""
    from cispo.data.tasks import get_task

    return get_task("wordmath").train_samples(a.seed, (a.steps + 1) * a.prompts)


def measured(a, rows: list[dict], model, steps: int, logp_old_rows: float) -> dict:
    """A worker's result: its measured steps with each phase's useful FLOPs added (sampling: a forward over
    the batch, each prompt once per group; logp_old: a forward over the ``logp_old_rows`` rows that side's
    no-grad pass computes; update: `update_flops`, counted both ways), and the matmul rates of this process at
    its threads."""
    from benchmarks._common import forward_flops

    B = a.prompts * a.group
    for row in rows:
        P, T = row["prompt_tokens"] / B, row["tokens"] / B
        row["update_flops"] = update_flops(model, B, P, T)["total"]
        row["update_flops_once"] = update_flops(model, B, P, T, a.group)["total"]
        row["sample_flops"] = forward_flops(model, B, P, T, a.group)
        row["logp_old_flops"] = forward_flops(model, logp_old_rows, P, T, a.group)
    rates = {dt: matmul_rate(dt, a.mm_shape, a.mm_repeats) for dt in DTYPES}
    return {"steps": rows[-steps:], "matmul": rates}


def worker_cispo(a, bf16: bool) -> dict:
    from benchmarks._common import ours_setup, ours_steps
    from cispo.rollout.static_cache import unsupported_reason

    threads = worker_threads(a.threads, "ours")
    samples = workload(a)
    s = ours_setup(group_size=a.group, updates=a.updates, prompts=a.prompts, max_new_tokens=a.max_new_tokens,
                   seed=a.seed, suppress_eos=a.eos == "suppressed", model_path=a.model, task="wordmath",
                   samples=samples, extra=(f"lr={a.lr}", "warmup_updates=0", "rollout.repetition_stop_tokens=0",
                                           *(["model.dtype=bfloat16"] if bf16 else []), *a.cispo_set.split()))
    policy = s["policy"]
    steps = a.bf16_steps if bf16 else a.steps
    rows = ours_steps(s, 1 + steps)
    lens = [len(policy.encode(x)) for x in samples]
    for i, row in enumerate(rows):  # step i took prompts i*P .. (i+1)*P - 1 of the list, G rows each
        row["prompt_tokens"] = float(a.group * sum(lens[i * a.prompts:(i + 1) * a.prompts]))
    why = unsupported_reason(policy.model) if policy.sampler.inner.decode != "hf" else "decode=hf"
    return {**measured(a, rows, policy.model, steps, cispo_logp_old_rows(s["cfg"].algo, a.prompts * a.group)),
            "threads": threads, "desc": s["desc"],
            "decode": "static-cache decode" if why is None else f"forward path ({why})"}


def cispo_logp_old_rows(algo, rows: int) -> float:
    """The rows cispo's no-grad logp_old pass computes: none with ``logp_old=rollout`` (the sampler's), all but the
    first update's with ``logp_old_from_update`` (those come from that update's forward), else all. (Settings
    that turn ``logp_old_from_update`` off at run time, e.g. ``tis_cap``, are not read here.)"""
    if algo.logp_old == "rollout":
        return 0.0
    return rows - rows / algo.updates_per_batch if algo.logp_old_from_update else float(rows)


def worker_trl(a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from cispo.data.tasks import get_task
    from cispo.models.packaged import resolve_model_path

    threads = worker_threads(a.threads, "trl")
    task = get_task("wordmath")
    path = str(resolve_model_path(a.model))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    data = Dataset.from_list([{"prompt": s["messages"], "answer": s["answer"]} for s in workload(a)])

    def wordmath_reward(completions, answer, **_):  # conversational: each completion is [assistant message]
        return [task.reward(None, c[-1]["content"], answer=ans) for c, ans in zip(completions, answer)]

    eos = model.generation_config.eos_token_id  # the ids TRL ends a completion at: these and the tokenizer's
    eos = sorted({tok.eos_token_id, *([] if eos is None else [eos] if isinstance(eos, int) else eos)})
    B = a.prompts * a.group
    args = grpo_config(rows=B, group=a.group, updates=a.updates, epochs=1, max_new_tokens=a.max_new_tokens,
                       steps=1 + a.steps, lr=a.lr, seed=a.seed, suppress=eos if a.eos == "suppressed" else None)
    trainer = GRPOTrainer(model=model, reward_funcs=wordmath_reward, args=args, train_dataset=data,
                          processing_class=tok)
    rows = train_timed(trainer, a.updates, 1, B)  # the warm-up step already dropped
    logp_old_rows = B if any(r["logp_old"] > 0 for r in rows) else 0  # TRL's pass, where it made one, covers the batch
    return {**measured(a, rows, trainer.model, a.steps, logp_old_rows), "threads": threads}


def worker(a, side: str) -> dict:
    if a.in_process:
        out = worker_trl(a) if side == "TRL" else worker_cispo(a, side == "cispo-bf16")
        return json.loads(json.dumps(out))
    flags = [f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
             for k, v in vars(a).items() if k not in ("worker", "in_process", "pairs")]
    return run_worker([__file__, "--worker", side, *flags], a.threads)


def flop_table(results: dict[str, list[dict]]) -> str:
    """Per side: the update passes' useful GFLOP per step and GFLOP/s (medians over its steps), the matmul
    rates (medians over its workers) and the shares."""
    out = []
    for side, workers in results.items():
        steps = [s for w in workers for s in w["steps"]]
        if not steps:
            continue
        rate = median(s["update_flops"] / s["update"] for s in steps)
        mm = {dt: median(w["matmul"][dt] for w in workers) for dt in DTYPES}
        once = median(s["update_flops_once"] / s["update"] for s in steps)
        used = "bfloat16" if side.endswith("bf16") else "float32"
        out.append([side, median(s["update_flops"] for s in steps) / 1e9, median(s["update"] for s in steps),
                    rate / 1e9, mm["float32"] / 1e9, f"{rate / mm['float32']:.1%}", mm["bfloat16"] / 1e9,
                    f"{rate / mm['bfloat16']:.1%}", f"{rate / mm[used]:.1%} ({used})",
                    f"{once / mm[used]:.1%} ({used})"])
    return table(["side", "update GFLOP/step", "update s", "update GFLOP/s", "matmul fp32 GFLOP/s", "share fp32",
                  "matmul bf16 GFLOP/s", "share bf16", "share, precision used",
                  "share, each prompt once per group"], out)


PHASE_FLOPS = (("sample", "sample_flops"), ("logp_old", "logp_old_flops"), ("update", "update_flops_once"))
"""Each phase's measured time and its useful FLOPs, each prompt counted once per group (`measured`)."""


def phase_table(results: dict[str, list[dict]]) -> str:
    """Per side and phase (sampling, logp_old, update): useful GFLOP per step, seconds, GFLOP/s and the share of
    the matmul rate at the precision used (medians over its steps / workers), and the phase's floor: the seconds
    it would take at that matmul rate. A phase with no work on a side (cispo's logp_old under
    ``algo.logp_old=rollout``) reads 0 and no share."""
    out = []
    for side, workers in results.items():
        steps = [s for w in workers for s in w["steps"]]
        if not steps:
            continue
        used = "bfloat16" if side.endswith("bf16") else "float32"
        mm = median(w["matmul"][used] for w in workers)
        for phase, key in PHASE_FLOPS:
            flops, secs = median(s[key] for s in steps), median(s[phase] for s in steps)
            share = f"{flops / secs / mm:.1%}" if flops > 0 and secs > 0 else "-"
            out.append([side, phase, flops / 1e9, secs, flops / secs / 1e9 if secs > 0 else 0.0, mm / 1e9,
                        share, flops / mm])
    return table(["side", "phase", "GFLOP/step", "s", "GFLOP/s", "matmul GFLOP/s", "share of floor", "floor s"], out)


def bf16_lines(results: dict[str, list[dict]]) -> list[str]:
    """cispo under bf16 autocast against the fp32 cispo workers: step and update time, log-prob gap."""
    fp32 = [s for w in results["cispo"] for s in w["steps"]]
    bf16 = [s for w in results["cispo-bf16"] for s in w["steps"]]
    if not bf16:
        return []
    ratio = {k: median(s[k] for s in bf16) / median(s[k] for s in fp32) for k in ("wall", "update", "sample")}
    gap = {name: median(s["logp_abs_diff"] for s in xs) for name, xs in (("fp32", fp32), ("bf16", bf16))}
    return [f"cispo bf16 autocast / fp32 time ({len(bf16)} bf16 step(s) vs {len(fp32)} fp32): "
            f"step x{ratio['wall']:.2f}, "
            f"update x{ratio['update']:.2f}, sample x{ratio['sample']:.2f} (> 1: bf16 slower)",
            f"sampler vs trainer log-prob gap, mean |logp_rollout - logp_old| per token: fp32 {gap['fp32']:.2e}, "
            f"bf16 {gap['bf16']:.2e}"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m", help="a chat model folder or builtin:<name>")
    p.add_argument("--pairs", type=int, default=3, help="TRL / cispo worker pairs, the order alternating")
    p.add_argument("--steps", type=int, default=2, help="measured RL steps per worker (after one dropped warm-up)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
    p.add_argument("--group", type=int, default=8, help="G, answers per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="L")
    p.add_argument("--updates", type=int, default=4, help="K optimizer steps per generation batch")
    p.add_argument("--eos", choices=("suppressed", "natural"), default="suppressed")
    p.add_argument("--threads", default="default", help="torch threads of both sides, or 'default' (each its own)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16-steps", type=int, default=0,
                   help="measured steps of each cispo bf16-autocast worker (0: none)")
    p.add_argument("--bf16-repeats", type=int, default=1, help="bf16 workers, one after each of the first pairs")
    p.add_argument("--mm-repeats", type=int, default=5, help="timed matmul calls per matmul rate")
    p.add_argument("--mm-shape", type=lambda v: tuple(int(x) for x in v.split(",")), default=MATMUL_SHAPE,
                   metavar="M,K,N", help="the matmul timed: [M, K] x [N, K]^T (default %(default)s)")
    p.add_argument("--cispo-set", default="", metavar="'KEY=VALUE ...'",
                   help="cispo settings on top of the workload's, space-separated "
                        "(e.g. 'algo.minibatch_order=by_group')")
    p.add_argument("--in-process", action="store_true", help="run every worker in this process (tests)")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if min(a.pairs, a.steps, a.prompts, a.group, a.max_new_tokens, a.updates) < 1 or a.bf16_steps < 0:
        p.error("--pairs, --steps, --prompts, --group, --max-new-tokens and --updates must be >= 1")
    if a.worker:
        print(json.dumps(worker_trl(a) if a.worker == "TRL" else worker_cispo(a, a.worker == "cispo-bf16")))
        return
    try:
        import trl
    except ImportError as e:
        raise SystemExit("bench_trl_smollm2 needs trl (pip install 'cispo[bench]')") from e
    import torch

    print(machine_note(int(a.threads) if a.threads != "default" else 0)
          + f"; trl {trl.__version__}; torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    t0 = time.perf_counter()
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(a.pairs):
        for side in ("TRL", "cispo") if r % 2 == 0 else ("cispo", "TRL"):
            results[side].append(worker(a, side))
        if a.bf16_steps and r < a.bf16_repeats:
            results["cispo-bf16"].append(worker(a, "cispo-bf16"))
    B = a.prompts * a.group
    cispo = results["cispo"][0]
    threads = {side: sorted({w["threads"] for w in ws}) for side, ws in results.items() if ws}
    prompt_tokens = {side: median(s["prompt_tokens"] for w in ws for s in w["steps"])
                     for side, ws in results.items() if ws}
    print(f"{a.model} = {cispo['desc']}; wordmath, B = {a.prompts} prompts x G={a.group} = {B} rows, K = {a.updates} "
          f"optimizer steps of {B // a.updates} rows, L = {a.max_new_tokens} tokens, EOS {a.eos}; {a.pairs} pair(s) x "
          f"{a.steps} measured step(s) per worker (TRL first in even pairs); threads {threads}; cispo sampling: "
          f"{cispo['decode']}")
    if a.cispo_set:
        print(f"cispo settings on top of the workload's: {a.cispo_set}")
    print("prompt tokens per step (median): " + ", ".join(f"{k} {v:.0f}" for k, v in prompt_tokens.items()))
    report({side: [w["steps"] for w in results[side]] for side in ("cispo", "TRL")}, "cispo", "TRL")
    m, k, n = a.mm_shape
    print(f"\nupdate passes' useful FLOP rate (_common.update_flops) vs the matmul rate ([{m}, {k}] x "
          f"[{n}, {k}]^T, the faster of linear and mm) in each worker at its threads:")
    print(flop_table(results))
    print("\neach phase against its floor (useful FLOPs, each prompt once per group: _common.forward_flops for "
          "sampling and logp_old, _common.update_flops for the update; floor = those FLOPs at the matmul rate of "
          "the precision used):")
    print(phase_table(results))
    for line in bf16_lines(results):
        print(line)
    print(f"took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
