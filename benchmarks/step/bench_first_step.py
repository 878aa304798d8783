"""The first RL step with a file reward: does it cost what the later steps do?

    python benchmarks/step/bench_first_step.py               # 3 rounds of 2 fresh runs each
    python benchmarks/step/bench_first_step.py --tiny

A reward given as ``file.py:function`` runs in worker processes (``data.reward_isolation=auto``:
``cispo.data.rewards.pool``); starting them (a fresh interpreter each, which then imports the reward) takes ~2
s. Each run here is a fresh ``cispo.training.runner.train`` in its own subprocess, on a JSONL of the addition
task's prompts and a TRL-style reward file (``def reward(prompts, completions, answer, **kwargs)``), with the
built-in ``--size`` Llama (random init), no held-out evaluation, dynamic sampling off, ``--steps`` steps.
Three arms, in turn run by run (the order reversed every other round): the reward in its worker processes,
started during set-up while the model loads (``process``, now); the same with the workers started by the first
reward call (``first-call``: ``start_reward_workers`` in ``cispo.training.run``'s set-up made a no-op, as the
pool behaved before set-up started it early); the same reward in the trainer's main thread (``main``, no pool:
the baseline). Reported per arm: set-up (``train`` called -> first step starts), step 1 and the median of the
later steps (``perf/step_s``), and step 1 / later steps; then each pool arm's step 1 over ``main``'s (1.0: the
pool costs step 1 nothing).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import load_average, machine_note, median, table  # noqa: E402

ARMS = ("process", "first-call", "main")
REWARD = '''
def reward(prompts, completions, answer, **kwargs):
    """TRL's signature: 1.0 where the completion's text before EOS is the answer."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]
'''


def prepare(folder: Path, size: str) -> None:
    """The prompts (JSONL), the reward file and the model in ``folder``."""
    from cispo.data.tasks import get_task
    from cispo.models.loading import build_model, build_tokenizer, save_policy

    task = get_task("addition")
    rows = task.train_samples(0, 2048)
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n"
                                                  for r in rows))
    (folder / "trl_reward.py").write_text(REWARD)
    tok = build_tokenizer(task.alphabet)
    save_policy(build_model(tok, size=size, seed=0), tok, folder / "model")


def worker(a, arm: str) -> dict:
    """One fresh run of ``arm``: its set-up seconds and per-step ``perf/step_s``. The first step's start is
    when ``RLStep.__call__`` is first called (the method swapped for the run: measurement only)."""
    import cispo.training.run as run_mod
    import cispo.training.runner as runner
    from cispo.config.train import TrainConfig, apply_overrides
    from cispo.records.tracking import read_metrics
    from cispo.training.rl_step import RLStep

    folder = Path(a.dir)
    cfg = apply_overrides(TrainConfig(), [
        f"model.path={folder / 'model'}", "model.device=cpu", f"data.path={folder / 'prompts.jsonl'}",
        f"data.reward={folder / 'trl_reward.py'}:reward", "data.num_eval_prompts=0",
        f"data.reward_isolation={'main' if arm == 'main' else 'process'}",
        "eval.every=0", "progress=false", f"steps={a.steps}", f"prompts_per_step={a.prompts}",
        f"group_size={a.group_size}", f"updates_per_batch={a.updates}", f"max_new_tokens={a.max_new_tokens}",
        "dynamic_sampling=false", "threads=1", f"out_dir={folder / 'runs'}", f"run_name={arm}-{time.time_ns()}",
        f"checkpoint_every={a.steps}",
    ])
    first_step = []
    step, start = RLStep.__call__, run_mod.start_reward_workers

    def timed_step(*args, **kwargs):
        first_step.append(time.perf_counter())
        return step(*args, **kwargs)

    RLStep.__call__ = timed_step
    if arm == "first-call":  # the workers start at the first reward call
        run_mod.start_reward_workers = lambda reward: None
    t0 = time.perf_counter()
    try:
        result = runner.train(cfg)
    finally:
        RLStep.__call__, run_mod.start_reward_workers = step, start
    rows = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["step"] > 0]
    return {"setup": first_step[0] - t0, "steps": [r["perf/step_s"] for r in rows]}


def run(a, arm: str) -> dict:
    if a.in_process:
        return worker(a, arm)
    cmd = [sys.executable, __file__, "--worker", arm, "--dir", a.dir, "--steps", str(a.steps), "--prompts",
           str(a.prompts), "--group-size", str(a.group_size), "--updates", str(a.updates), "--max-new-tokens",
           str(a.max_new_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{arm} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", help="built-in model size (default tiny)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--updates", type=int, default=4, help="K")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="RL steps per run")
    p.add_argument("--rounds", type=int, default=3, help="rounds of one run per arm, the order reversed every other")
    p.add_argument("--in-process", action="store_true", help="every run in this process (no fresh interpreter)")
    p.add_argument("--tiny", action="store_true", help="2 prompts x G=2, K=2, 4 tokens, 2 steps, 1 round, in-process")
    p.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tiny:
        a.prompts, a.group_size, a.updates, a.max_new_tokens, a.steps, a.rounds = 2, 2, 2, 4, 2, 1
        a.in_process = True
    if a.worker:
        print(json.dumps(worker(a, a.worker)))
        return
    print(machine_note(1))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-first-step-") as d:
        a.dir = d
        prepare(Path(d), a.size)
        runs = {arm: [] for arm in ARMS}
        for r in range(a.rounds):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                runs[arm].append(run(a, arm))
    rows, first = [], {}
    for arm, results in runs.items():
        step1 = median(x["steps"][0] for x in results)
        later = median(median(x["steps"][1:]) for x in results)
        first[arm] = step1
        rows.append([arm, len(results), median(x["setup"] for x in results), step1, later, step1 / later])
    print(f"{a.prompts} prompts x G={a.group_size}, K={a.updates}, {a.max_new_tokens} new tokens, {a.steps} steps "
          f"per run, {a.rounds} round(s); medians over runs")
    print(table(["reward runs in", "runs", "set-up s", "step 1 s", "later steps s", "step 1 / later"], rows))
    print(f"\nstep 1 / main's step 1: process x{first['process'] / first['main']:.2f}, first-call "
          f"x{first['first-call'] / first['main']:.2f}; took {time.perf_counter() - t0:.0f} s; "
          f"1-min load average at end {load_average():.2f}")


if __name__ == "__main__":
    main()
