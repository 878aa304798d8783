"""End to end on CPU: our trainer vs TRL's ``GRPOTrainer`` (``loss_type="cispo"``, ``epsilon_high=5.0``)
on the same tiny model, prompts, reward, G, K and lengths, one thread each.

    python benchmarks/vs_trl/bench_trl.py            # needs trl (pip install 'cispo[bench]')
    python benchmarks/vs_trl/bench_trl.py --tiny
    python benchmarks/vs_trl/bench_trl.py --size small --prompts 16 --group-size 8 --updates 4 --max-new-tokens 32
    python benchmarks/vs_trl/bench_trl.py --prompts 8 --updates 1 --epochs 4 --steps 5 --rounds 5 --threads default

Both sides: the built-in ``--size`` Llama (``cispo.models.loading.build_model``, random init, seed 0) with
the addition task's character tokenizer; the addition task's train prompts; its verifier as the reward;
temperature 1, top-p 1, no top-k; fp32; no KL (TRL ``beta=0``); AdamW with our defaults (lr 1e-4, betas (0.9,
0.95), eps 1e-15, no weight decay, grad-norm clip 1, constant lr); ``--threads`` torch threads each (default
1; ``default``: ours by the ``threads`` rule, TRL torch's default). ``--epochs E`` passes over each batch (TRL
``num_iterations``); the decode-bound workload (short responses, several passes over a small batch) is
``--prompts 8 --updates 1 --epochs 4`` (4 full-batch updates per generation batch). What one RL step is on
each side, setting by setting: the table in ``_trl_common.py``.

``--eos suppressed`` (default) makes every response exactly L tokens on both sides, so the two do
the same work (``_trl_common``). ``--eos natural`` keeps EOS (lengths then differ run to run;
compare tokens/s). ``--ours-set`` passes overrides to our side only (e.g.
``micro_batch_split_cost=none`` for a before/after).

Each side runs in its own fresh subprocess for ``--steps`` RL steps; the first step (warm-up,
set-up) is dropped. Subprocesses alternate (ours, TRL, TRL, ours, ...) for ``--rounds`` rounds.
Reported: median seconds per RL step, steps/s, response tokens/s, and each side's breakdown:
sample (``generate``), score (reward calls incl. dispatch), logp_old (the no-grad pass over the
batch; ours also collates here), update (forward+backward of the K mini-batches and the optimizer
steps), overhead (the rest: decoding, advantages, shuffling, metrics, TRL's Trainer loop).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import machine_note  # noqa: E402
from benchmarks.vs_trl._trl_common import grpo_config, report, run_worker, train_timed, worker_threads  # noqa: E402


def worker_ours(a) -> list[dict]:
    from benchmarks._common import ours_setup, ours_steps

    threads = worker_threads(a.threads, "ours")
    s = ours_setup(a.size, a.group_size, a.updates, a.prompts, a.max_new_tokens, a.seed,
                   suppress_eos=a.eos == "suppressed",
                   extra=("warmup_updates=0", f"algo.epochs={a.epochs}", *a.ours_set))
    return [{**row, "threads": threads} for row in ours_steps(s, a.steps)[1:]]


def worker_trl(a) -> list[dict]:
    from datasets import Dataset
    from trl import GRPOTrainer

    from cispo.config.train import OptimConfig
    from cispo.data.tasks import get_task
    from cispo.models.loading import build_model, build_tokenizer

    threads = worker_threads(a.threads, "trl")
    task = get_task("addition")
    tok = build_tokenizer(task.alphabet)
    model = build_model(tok, size=a.size, seed=a.seed)
    samples = task.train_samples(0, 4096)
    data = Dataset.from_dict({"prompt": [s["prompt"] for s in samples], "answer": [s["answer"] for s in samples]})

    def addition_reward(prompts, completions, answer, **_):
        return [task.reward(p, c, answer=ans) for p, c, ans in zip(prompts, completions, answer)]

    B = a.prompts * a.group_size
    args = grpo_config(rows=B, group=a.group_size, updates=a.updates, epochs=a.epochs, max_new_tokens=a.max_new_tokens,
                       steps=a.steps, lr=OptimConfig().lr, seed=a.seed,
                       suppress=[tok.eos_token_id] if a.eos == "suppressed" else None)
    trainer = GRPOTrainer(model=model, reward_funcs=addition_reward, args=args, train_dataset=data,
                          processing_class=tok)
    return [{**row, "threads": threads} for row in train_timed(trainer, a.updates, a.epochs, B)]


def worker(a, side: str) -> list[dict]:
    if a.in_process:
        return json.loads(json.dumps(worker_ours(a) if side == "ours" else worker_trl(a)))
    return run_worker([__file__, "--worker", side, "--size", a.size, "--prompts", str(a.prompts), "--group-size",
                       str(a.group_size), "--updates", str(a.updates), "--max-new-tokens", str(a.max_new_tokens),
                       "--steps", str(a.steps), "--eos", a.eos, "--seed", str(a.seed), "--epochs", str(a.epochs),
                       "--threads", a.threads] + [x for kv in a.ours_set for x in ("--ours-set", kv)], a.threads)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", help="built-in model size (tiny, small, default); default tiny")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--updates", type=int, default=4, help="K")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1,
                   help="passes over each generation batch: ours algo.epochs, TRL num_iterations (decode-bound: "
                        "--prompts 8 --updates 1 --epochs 4)")
    p.add_argument("--threads", default="1",
                   help="torch threads of both sides (default 1), or 'default': each side's own default (ours: the "
                        "cispo.foundations.threads rule, TRL: torch's)")
    p.add_argument("--steps", type=int, default=4, help="RL steps per worker (the first is dropped)")
    p.add_argument("--rounds", type=int, default=2, help="ours/TRL worker pairs, alternating")
    p.add_argument("--eos", choices=("suppressed", "natural"), default="suppressed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a TrainConfig override for our side only (repeatable), e.g. micro_batch_split_cost=none "
                        "(each mini-batch one call, as before length-sorted micro-batches)")
    p.add_argument("--in-process", action="store_true", help="run both sides in this process (no fresh subprocesses)")
    p.add_argument("--tiny", action="store_true", help="2 prompts x G=2, K=2, 4 tokens, 2 steps, 1 round, in-process")
    p.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tiny:
        a.size, a.prompts, a.group_size, a.updates, a.max_new_tokens, a.steps, a.rounds = "tiny", 2, 2, 2, 4, 2, 1
        a.in_process = True
    if a.worker:
        print(json.dumps(worker_ours(a) if a.worker == "ours" else worker_trl(a)))
        return
    try:
        import trl
    except ImportError as e:
        raise SystemExit("bench_trl needs trl (pip install 'cispo[bench]')") from e

    print(machine_note(int(a.threads) if a.threads != "default" else 0) + f"; trl {trl.__version__}")
    t0 = time.perf_counter()
    runs = {"ours": [], "TRL": []}
    for r in range(a.rounds):
        for side in (("ours", "TRL") if r % 2 == 0 else ("TRL", "ours")):
            runs[side].append(worker(a, "ours" if side == "ours" else "trl"))
    B = a.prompts * a.group_size
    from benchmarks._common import model_desc
    from cispo.data.tasks import get_task
    from cispo.models.loading import build_model, build_tokenizer

    desc = model_desc(build_model(build_tokenizer(get_task("addition").alphabet), size=a.size))
    ours_with = f"; ours with {' '.join(a.ours_set)}" if a.ours_set else ""
    threads = {side: sorted({s["threads"] for w in ws for s in w}) for side, ws in runs.items()}
    print(f"built-in '{a.size}' = {desc}; B = {a.prompts} prompts x G={a.group_size} = {B} rows, "
          f"K = {a.updates} optimizer steps of {B // a.updates} rows x {a.epochs} epoch(s), "
          f"L = {a.max_new_tokens} tokens, EOS {a.eos}; threads "
          f"ours {threads['ours']}, TRL {threads['TRL']}; {a.rounds} round(s) x {a.steps - 1} measured steps per "
          f"side{ours_with}")
    report(runs, "ours", "TRL")
    print(f"took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
