"""What the benchmarks that run TRL's ``GRPOTrainer`` beside cispo share: TRL's config of one RL step,
TRL's step timed phase by phase, the worker subprocesses, and the report (medians, per-pair ratios).

One RL step, on each side:

==========================  =================================  ==========================================
                            cispo                              TRL 1.16 ``GRPOConfig``
==========================  =================================  ==========================================
rows sampled per step       B = prompts x G                    ``generation_batch_size`` = B
                                                               (= per_device_train_batch_size x
                                                               steps_per_generation)
group size                  ``group_size`` = G                 ``num_generations`` = G
optimizer steps per batch   ``updates_per_batch`` = K          ``steps_per_generation`` = K with
                                                               ``gradient_accumulation_steps`` = 1
rows per optimizer step     B / K                              ``per_device_train_batch_size`` = B / K
passes over the batch       ``epochs`` = E                     ``num_iterations`` = E (TRL's mu: passes,
                                                               not K)
response length             ``max_new_tokens`` = L             ``max_completion_length`` = L
logp_old                    one no-grad pass per batch, less   computed, because GA (1) is not a multiple
                            the first update's rows            of steps_per_generation x num_iterations
                            (``logp_old_from_update``; none    (with K = E = 1 it is not: on-policy)
                            with K = E = 1)
objective                   ``preset("cispo")``: weight        ``loss_type="cispo"``, ``epsilon_high=5``
                            capped at 1 + eps_high_is = 5      (TRL's is the cap itself)
optimizer                   AdamW, cispo's ``OptimConfig``     the same betas, eps, weight decay, grad-norm
                            defaults, constant lr (no warm-up)  clip and lr, ``lr_scheduler_type="constant"``
sampling                    temperature 1, top-p 1, no top-k   the same (``top_k=0``)
prompt order                as the benchmark hands them out    in dataset order (``shuffle_dataset=False``)
extra                       dynamic sampling off               ``beta=0`` (no KL, no reference model),
                                                               ``gradient_checkpointing=False`` (TRL
                                                               defaults it on), ``bf16=False``,
                                                               ``logging_steps=K``, no saving, no eval
==========================  =================================  ==========================================

``suppress`` (the benchmarks' ``--eos suppressed``) makes every response exactly L tokens on both sides:
TRL gets ``generation_kwargs={"suppress_tokens": [its EOS ids]}`` (their logits set to -inf), cispo an
EOS id outside the vocabulary (``_common.ours_setup``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks._common import PHASES, load_average, median, table


def worker_threads(threads: str, side: str) -> int:
    """``threads``: N for both sides, or ``default``: each side's own default — cispo's ``threads``
    rule (``cispo.foundations.threads.auto_threads``), TRL torch's (one per core). Returns the count in use."""
    import torch

    if threads != "default":
        torch.set_num_threads(int(threads))
    elif side == "ours":
        from cispo.foundations.threads import auto_threads

        torch.set_num_threads(auto_threads(None))
    return torch.get_num_threads()


def grpo_config(*, rows: int, group: int, updates: int, epochs: int, max_new_tokens: int, steps: int, lr: float,
                seed: int, suppress: list[int] | None = None):
    """TRL's ``GRPOConfig`` for ``steps`` RL steps of the table above (B = ``rows``, G = ``group``, K =
    ``updates``, E = ``epochs``, L = ``max_new_tokens``) with cispo's optimizer defaults at ``lr``;
    ``suppress``: token ids never sampled (EOS, for fixed-length responses)."""
    from trl import GRPOConfig

    from cispo.config.train import OptimConfig

    if rows % updates:
        raise ValueError(f"B = {rows} rows must be divisible by K = {updates}")
    o = OptimConfig()
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=rows // updates,
        gradient_accumulation_steps=1, steps_per_generation=updates, num_iterations=epochs, num_generations=group,
        max_completion_length=max_new_tokens, max_steps=updates * epochs * steps, loss_type="cispo",
        epsilon_high=5.0, beta=0.0, temperature=1.0, top_p=1.0, top_k=0, learning_rate=lr,
        adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps, weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip, lr_scheduler_type="constant", warmup_steps=0, gradient_checkpointing=False,
        bf16=False, use_cpu=True, report_to="none", logging_steps=updates, save_strategy="no", disable_tqdm=True,
        seed=seed, dataloader_num_workers=0, shuffle_dataset=False,
        generation_kwargs={"suppress_tokens": suppress} if suppress else None,
    )


def train_timed(trainer, updates: int, epochs: int, rows: int) -> list[dict]:
    """Run ``trainer.train()``; per RL step after the first (warm-up, set-up): wall seconds split like
    cispo's (``_common.PHASES``) — sample (``_generate``), score (``_calculate_rewards``), logp_old (the
    log-prob pass made while generating), update (``training_step`` less ``_prepare_inputs``, plus the
    optimizer steps), overhead (the rest: advantages, shuffling, metrics, the Trainer loop) — and the
    prompt and response tokens TRL's batch held (its masks' sums)."""
    from transformers import TrainerCallback

    acc = {k: 0.0 for k in ("sample", "score", "logp_old", "train_step", "prepare", "optim", "prompt_tokens",
                            "tokens")}
    state = {"in_gen": False, "t_opt": 0.0}

    def timed(name, key, generating=False):
        fn = getattr(trainer, name)

        def wrapper(*args, **kwargs):
            k = None if name == "_get_per_token_logps_and_entropies" and not state["in_gen"] else key
            state["in_gen"] |= generating
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                if k:
                    acc[k] += time.perf_counter() - t0
                state["in_gen"] &= not generating
            if generating:
                acc["prompt_tokens"] += float(out["prompt_mask"].sum())
                acc["tokens"] += float(out["completion_mask"].sum())
            return out

        setattr(trainer, name, wrapper)

    timed("_generate", "sample")
    timed("_calculate_rewards", "score")
    timed("_get_per_token_logps_and_entropies", "logp_old")  # only the calls made while generating
    timed("_generate_and_score_completions", None, generating=True)
    timed("_prepare_inputs", "prepare")
    timed("training_step", "train_step")
    marks = []

    class Marks(TrainerCallback):
        def on_pre_optimizer_step(self, *_, **__):
            state["t_opt"] = time.perf_counter()

        def on_optimizer_step(self, *_, **__):
            acc["optim"] += time.perf_counter() - state["t_opt"]

        def on_step_end(self, args_, st, *_, **__):
            if st.global_step % (updates * epochs) == 0:
                marks.append((time.perf_counter(), dict(acc)))

    trainer.add_callback(Marks())
    trainer.train()
    out = []
    for (t0, a0), (t1, a1) in zip(marks, marks[1:]):
        d = {k: a1[k] - a0[k] for k in a1}
        row = {"wall": t1 - t0, "sample": d["sample"], "score": d["score"], "logp_old": d["logp_old"],
               "update": d["train_step"] - d["prepare"] + d["optim"], "rows": rows, "tokens": d["tokens"],
               "prompt_tokens": d["prompt_tokens"], "response_len": d["tokens"] / rows}
        row["overhead"] = row["wall"] - sum(row[p] for p in PHASES[:4])
        out.append(row)
    return out


def run_worker(argv: list[str], threads: str):
    """Run ``python argv...`` in a fresh process (torch threads: ``threads``, or each side's default with
    ``OMP_NUM_THREADS`` unset); returns the JSON of its last line of output."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(k, None)
        if threads != "default":
            env[k] = threads
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {' '.join(argv[:3])} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(runs: dict[str, list[list[dict]]], ours: str = "ours", other: str = "TRL") -> list[float]:
    """Print the medians of every side's measured steps (steps/s, tokens/s, the phases) and, pair by pair
    (``runs[side][i]``: the steps of pair i's worker; each pair's workers ran back to back), ``ours``'s
    steps/s over ``other``'s; returns those ratios, sorted."""
    rows = []
    for side, workers in runs.items():
        steps = [s for w in workers for s in w]
        rows.append([side, len(steps), median(s["wall"] for s in steps), 1 / median(s["wall"] for s in steps),
                     median(s["tokens"] / s["wall"] for s in steps), median(s["response_len"] for s in steps)]
                    + [f"{median(s[ph] for s in steps):.3g} ({median(s[ph] / s['wall'] for s in steps):.0%})"
                       for ph in PHASES])
    print(table(["trainer", "steps", "s/step (median)", "steps/s", "tokens/s", "resp len"]
                + [f"{ph} s (share)" for ph in PHASES], rows))
    pairs = sorted(median(s["wall"] for s in b) / median(s["wall"] for s in a)
                   for a, b in zip(runs[ours], runs[other]))
    print(f"\n{ours} / {other} steps/s by pair (each pair's two workers ran back to back): "
          + ", ".join(f"{r:.2f}" for r in pairs) + f"; median {median(pairs):.2f}")
    walls = {side: median(s["wall"] for w in ws for s in w) for side, ws in runs.items()}
    tps = {side: median(s["tokens"] / s["wall"] for w in ws for s in w) for side, ws in runs.items()}
    print(f"{ours} / {other}: steps/s x{walls[other] / walls[ours]:.2f}, tokens/s x{tps[ours] / tps[other]:.2f}"
          f"; 1-min load average at end {load_average():.2f}")
    return pairs
