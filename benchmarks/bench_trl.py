"""End to end on CPU: our trainer vs TRL's ``GRPOTrainer`` (``loss_type="cispo"``, ``epsilon_high=5.0``)
on the same tiny model, prompts, reward, G, K and lengths, one thread each.

    python benchmarks/bench_trl.py            # needs trl (pip install 'cispo[bench]')
    python benchmarks/bench_trl.py --tiny
    python benchmarks/bench_trl.py --size small --prompts 16 --group-size 8 --updates 4 --max-new-tokens 32
    python benchmarks/bench_trl.py --prompts 8 --updates 1 --epochs 4 --steps 5 --rounds 5 --threads default

Both sides: the built-in ``--size`` Llama (``cispo.models.build_model``, random init, seed 0) with
the addition task's character tokenizer; the addition task's train prompts; its verifier as the
reward; temperature 1, top-p 1, no top-k; fp32; no KL (TRL ``beta=0``); AdamW with our defaults
(lr 1e-4, betas (0.9, 0.95), eps 1e-15, no weight decay, grad-norm clip 1, constant lr);
``--threads`` torch threads each (default 1; ``default``: ours by the ``threads`` rule, TRL torch's
default). ``--epochs E`` passes over each batch (TRL ``num_iterations``); issue 13's workload is
``--prompts 8 --updates 1 --epochs 4`` (4 full-batch updates per generation batch). What one RL
step is, on each side:

==========================  =================================  ==========================================
                            ours                               TRL 1.16 ``GRPOConfig``
==========================  =================================  ==========================================
rows sampled per step       B = prompts x G                    ``generation_batch_size`` = B
                                                               (= per_device_train_batch_size x
                                                               steps_per_generation)
group size                  ``group_size`` = G                 ``num_generations`` = G
optimizer steps per batch   ``updates_per_batch`` = K          ``steps_per_generation`` = K with
                                                               ``gradient_accumulation_steps`` = 1
rows per optimizer step     B / K                              ``per_device_train_batch_size`` = B / K
passes over the batch       ``epochs`` = E (``--epochs``)      ``num_iterations`` = E (TRL's mu: passes,
                                                               not K)
response length             ``max_new_tokens`` = L             ``max_completion_length`` = L
logp_old                    one no-grad pass per batch, less   computed, because GA (1) is not a multiple
                            the first update's rows
                            (``logp_old_from_update``)
                                                               of steps_per_generation x num_iterations
objective                   ``preset("cispo")``                ``loss_type="cispo"``, ``epsilon_high=5``
extra                       dynamic sampling off               ``gradient_checkpointing=False`` (TRL
                                                               defaults it on), ``bf16=False``,
                                                               ``logging_steps=K``, no saving, no eval
==========================  =================================  ==========================================

``--eos suppressed`` (default) makes every response exactly L tokens on both sides, so the two do
the same work: ours gets an EOS id outside the vocabulary (never matched); TRL gets
``generation_kwargs={"suppress_tokens": [eos]}`` (EOS logit set to -inf) and EOS is never produced.
``--eos natural`` keeps EOS (lengths then differ run to run; compare tokens/s). ``--ours-set``
passes overrides to our side only (e.g. ``micro_batch_split_cost=none`` for a before/after).

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
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PHASES, load_average, machine_note, median, table  # noqa: E402

LR, BETAS, EPS = 1e-4, (0.9, 0.95), 1e-15  # our TrainConfig defaults


# --------------------------------------------------------------------------- ours


def worker_threads(a, side: str) -> int:
    """``--threads``: N for both sides, or each side's own default: ours the ``threads`` rule
    (``cispo.threads.auto_threads``), TRL torch's default (one per core)."""
    import torch

    if a.threads != "default":
        torch.set_num_threads(int(a.threads))
    elif side == "ours":
        from cispo.threads import auto_threads

        torch.set_num_threads(auto_threads(None))
    return torch.get_num_threads()


def worker_ours(a) -> list[dict]:
    from _common import ours_setup, ours_steps

    threads = worker_threads(a, "ours")
    s = ours_setup(a.size, a.group_size, a.updates, a.prompts, a.max_new_tokens, a.seed,
                   suppress_eos=a.eos == "suppressed",
                   extra=(f"lr={LR}", "warmup_updates=0", f"algo.epochs={a.epochs}", *a.ours_set))
    return [{**row, "threads": threads} for row in ours_steps(s, a.steps)[1:]]


# --------------------------------------------------------------------------- TRL


def worker_trl(a) -> list[dict]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from cispo.models import build_model, build_tokenizer
    from cispo.tasks import get_task

    threads = worker_threads(a, "trl")
    task = get_task("addition")
    tok = build_tokenizer(task.alphabet)
    model = build_model(tok, size=a.size, seed=a.seed)
    samples = task.train_samples(0, 4096)
    data = Dataset.from_dict({"prompt": [s["prompt"] for s in samples], "answer": [s["answer"] for s in samples]})

    def addition_reward(prompts, completions, answer, **_):
        return [task.reward(p, c, answer=ans) for p, c, ans in zip(prompts, completions, answer)]

    B, K = a.prompts * a.group_size, a.updates
    if B % K:
        raise ValueError(f"B = {B} rows must be divisible by K = {K}")
    gen_kwargs = {"suppress_tokens": [tok.eos_token_id]} if a.eos == "suppressed" else None
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=B // K,
        gradient_accumulation_steps=1, steps_per_generation=K, num_iterations=a.epochs, num_generations=a.group_size,
        max_completion_length=a.max_new_tokens, max_steps=K * a.epochs * a.steps, loss_type="cispo", epsilon_high=5.0, beta=0.0,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
        adam_epsilon=EPS, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
        gradient_checkpointing=False, bf16=False, use_cpu=True, report_to="none", logging_steps=K,
        save_strategy="no", disable_tqdm=True, seed=a.seed, dataloader_num_workers=0, generation_kwargs=gen_kwargs,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=addition_reward, args=args, train_dataset=data,
                          processing_class=tok)

    acc = {k: 0.0 for k in ("sample", "score", "logp_old", "train_step", "prepare", "optim")}
    state = {"in_gen": False, "t_opt": 0.0}

    def timed(name, key, flag=False):
        fn = getattr(trainer, name)

        def wrapper(*args, **kwargs):
            k = key if not (name == "_get_per_token_logps_and_entropies" and not state["in_gen"]) else None
            if flag:
                state["in_gen"] = True
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if k:
                    acc[k] += time.perf_counter() - t0
                if flag:
                    state["in_gen"] = False

        setattr(trainer, name, wrapper)

    timed("_generate", "sample")
    timed("_calculate_rewards", "score")
    timed("_get_per_token_logps_and_entropies", "logp_old")  # only the calls made while generating
    timed("_generate_and_score_completions", None, flag=True)
    timed("_prepare_inputs", "prepare")
    timed("training_step", "train_step")
    marks = []

    class Marks(TrainerCallback):
        def on_pre_optimizer_step(self, *_, **__):
            state["t_opt"] = time.perf_counter()

        def on_optimizer_step(self, *_, **__):
            acc["optim"] += time.perf_counter() - state["t_opt"]

        def on_step_end(self, args_, st, *_, **__):
            if st.global_step % (K * a.epochs) == 0:
                marks.append((time.perf_counter(), dict(acc)))

    trainer.add_callback(Marks())
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    rows = []
    for i in range(1, len(marks)):
        (t0, a0), (t1, a1) = marks[i - 1], marks[i]
        d = {k: a1[k] - a0[k] for k in a1}
        row = {"wall": t1 - t0, "sample": d["sample"], "score": d["score"], "logp_old": d["logp_old"],
               "update": d["train_step"] - d["prepare"] + d["optim"],
               "response_len": lengths[i] if i < len(lengths) else float("nan"), "rows": B}
        row["overhead"] = row["wall"] - sum(row[p] for p in PHASES[:4])
        row["tokens"] = row["response_len"] * B
        row["threads"] = threads
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- driver


def run_worker(a, side: str) -> list[dict]:
    if a.in_process:
        return json.loads(json.dumps(worker_ours(a) if side == "ours" else worker_trl(a)))
    cmd = [sys.executable, __file__, "--worker", side, "--size", a.size, "--prompts", str(a.prompts), "--group-size",
           str(a.group_size), "--updates", str(a.updates), "--max-new-tokens", str(a.max_new_tokens), "--steps",
           str(a.steps), "--eos", a.eos, "--seed", str(a.seed), "--epochs", str(a.epochs), "--threads", a.threads
           ] + [x for kv in a.ours_set for x in ("--ours-set", kv)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(k, None)
        if a.threads != "default":
            env[k] = a.threads
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", help="built-in model size (tiny, small, default); default tiny")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--updates", type=int, default=4, help="K")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1,
                   help="passes over each generation batch: ours algo.epochs, TRL num_iterations (issue 13's workload: "
                        "--prompts 8 --updates 1 --epochs 4)")
    p.add_argument("--threads", default="1",
                   help="torch threads of both sides (default 1), or 'default': each side's own default (ours: the "
                        "cispo.threads rule, TRL: torch's)")
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
    except ImportError:
        raise SystemExit("bench_trl needs trl (pip install 'cispo[bench]')")

    print(machine_note(int(a.threads) if a.threads != "default" else 0) + f"; trl {trl.__version__}")
    t0 = time.perf_counter()
    runs = {"ours": [], "TRL": []}
    for r in range(a.rounds):
        for side in (("ours", "TRL") if r % 2 == 0 else ("TRL", "ours")):
            runs[side] += run_worker(a, "ours" if side == "ours" else "trl")
    B = a.prompts * a.group_size
    from _common import model_desc

    from cispo.models import build_model, build_tokenizer
    from cispo.tasks import get_task

    desc = model_desc(build_model(build_tokenizer(get_task("addition").alphabet), size=a.size))
    ours_with = f"; ours with {' '.join(a.ours_set)}" if a.ours_set else ""
    print(f"built-in '{a.size}' = {desc}; B = {a.prompts} prompts x G={a.group_size} = {B} rows, K = {a.updates} optimizer "
          f"steps of {B // a.updates} rows x {a.epochs} epoch(s), L = {a.max_new_tokens} tokens, EOS {a.eos}; threads "
          f"ours {sorted({s['threads'] for s in runs['ours']})}, TRL {sorted({s['threads'] for s in runs['TRL']})}; "
          f"{a.rounds} round(s) x "
          f"{a.steps - 1} measured steps per side{ours_with}")
    rows = []
    med = {}
    for side, steps in runs.items():
        wall = median(s["wall"] for s in steps)
        tps = median(s["tokens"] / s["wall"] for s in steps)
        med[side] = (wall, tps)
        rows.append([side, len(steps), wall, 1 / wall, tps, median(s["response_len"] for s in steps)]
                    + [f"{median(s[ph] for s in steps):.3g} ({median(s[ph] / s['wall'] for s in steps):.0%})"
                       for ph in PHASES])
    print(table(["trainer", "steps", "s/step (median)", "steps/s", "tokens/s", "resp len"]
                + [f"{ph} s (share)" for ph in PHASES], rows))
    per = a.steps - 1  # measured steps per worker: round r's pair is runs[side][r * per:(r + 1) * per]
    pairs = sorted(median(s["wall"] for s in runs["TRL"][r * per:(r + 1) * per])
                   / median(s["wall"] for s in runs["ours"][r * per:(r + 1) * per]) for r in range(a.rounds))
    print(f"\nours / TRL steps/s by round (each round's two workers ran back to back): median {median(pairs):.2f}, "
          f"range {pairs[0]:.2f}-{pairs[-1]:.2f}")
    print(f"ours / TRL: steps/s x{med['TRL'][0] / med['ours'][0]:.2f}, tokens/s x{med['ours'][1] / med['TRL'][1]:.2f}"
          f"; took {time.perf_counter() - t0:.0f} s; 1-min load average at end {load_average():.2f}")


if __name__ == "__main__":
    main()
