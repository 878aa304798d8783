"""Start-up of a fresh ``cispo train`` on the toy workload: where the seconds before the first step go.

    python benchmarks/vs_trl/bench_startup.py                           # 3 rounds of cispo train and the floor
    python benchmarks/vs_trl/bench_startup.py --baseline-tree /tmp/old  # + an older tree's cispo, interleaved
    python benchmarks/vs_trl/bench_startup.py --tiny

The toy workload (small enough that start-up is a visible share of the run): the built-in addition task and
its shipped base model, 8 prompts x G = 8, 32 new tokens, K = 4, 16 steps, no held-out evaluation, one thread,
``progress=false``. Each run is a fresh process, the arms in turn (the order reversed every other round):

* ``cispo``: ``cispo train`` as the console script runs it (``cispo.cli.main()`` on ``sys.argv``);
* ``floor``: ``import torch``, then transformers' ``AutoModelForCausalLM`` / ``AutoTokenizer`` load the same
  model folder: what any trainer of this model pays before its first step;
* ``baseline`` (with ``--baseline-tree DIR``): the ``cispo`` arm with ``PYTHONPATH=DIR``, i.e. another
  copy of the package (an older checkout) on the same interpreter and packages;
* ``trl`` (with ``--trl``): the same workload as a TRL user writes it — transformers loads the same model
  folder, ``GRPOTrainer(loss_type="cispo", epsilon_high=5.0)`` trains on the addition task's prompts with its
  verifier as the reward (``_trl_common.grpo_config``: B = P x G rows, K optimizer steps per batch, the same
  AdamW, temperature 1, EOS kept), then ``save_model``. The ``cispo`` arm then runs with
  ``rollout.dynamic_sampling=false`` and ``optim.warmup_updates=0`` (TRL has no refill rounds and a constant
  lr here), so both sample one batch of P x G responses per step from the same model; their lengths differ
  by chance (the mean response length is printed per arm). Whole-process times are compared pair by pair.

``--threads default`` runs each arm at its own default torch threads (cispo's ``threads`` rule, torch's
for TRL and the floor) instead of one.

Times are of one clock (``CLOCK_MONOTONIC``, shared by the processes) from the spawn: each progress line of
the run as it arrives (``model: loading``, ``model: ready``), the first RL step called
(`cispo.training.rl_step.RLStep`: the first step begins), ``finish`` called (summary, curves.png),
``cispo.cli.main`` returned, the process gone. Reported: the medians of each phase per arm, the start-up
(spawn -> first step) over the floor's and, with a baseline, cispo's start-up and total over the baseline's;
with ``--imports N``, one more (untimed) run under ``python -X importtime`` and its N largest top-level
imports, cumulative.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import load_average, machine_note, median, spread, table  # noqa: E402

PHASES = [  # (label, from mark, to mark)
    ("imports + config s", "spawn", "model: loading"),
    ("model s", "model: loading", "model: ready"),
    ("ready -> step 1 s", "model: ready", "first step"),
    ("start-up s", "spawn", "first step"),
    ("steps s", "first step", "finish"),
    ("finish s", "finish", "main returned"),
    ("exit s", "main returned", "exit"),
    ("total s", "spawn", "exit"),
]
LINE_MARKS = ("model: loading", "model: ready")
"""Progress lines (``cispo.training.progress``) whose arrival is a mark."""
FLOOR = """
import sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1]); AutoModelForCausalLM.from_pretrained(sys.argv[1])
print('{"first step": %r}' % time.monotonic())
"""


TRL_WORKER = """
import json, sys, time
marks = {}
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from datasets import Dataset
from trl import GRPOTrainer
sys.path.insert(0, sys.argv[1])
from benchmarks.vs_trl._trl_common import grpo_config
from cispo.data.tasks import get_task
a = json.loads(sys.argv[2])
if a["threads"] != "default":
    import torch; torch.set_num_threads(int(a["threads"]))
task = get_task("addition")
marks["model: loading"] = time.monotonic()
tok = AutoTokenizer.from_pretrained(a["model"]); model = AutoModelForCausalLM.from_pretrained(a["model"])
marks["model: ready"] = time.monotonic()
samples = task.train_samples(0, 4096)
data = Dataset.from_dict({"prompt": [s["prompt"] for s in samples], "answer": [s["answer"] for s in samples]})
def addition_reward(prompts, completions, answer, **_):
    return [task.reward(p, c, answer=x) for p, c, x in zip(prompts, completions, answer)]
class Marks(TrainerCallback):
    lengths = []
    def on_step_begin(self, *_, **__): marks.setdefault("first step", time.monotonic())
    def on_train_end(self, *_, **__): marks["finish"] = time.monotonic()
    def on_log(self, args, state, control, logs=None, **__):
        if logs and "completions/mean_length" in logs: self.lengths.append(logs["completions/mean_length"])
args = grpo_config(rows=a["prompts"] * a["group_size"], group=a["group_size"], updates=a["updates"], epochs=1,
                   max_new_tokens=a["max_new_tokens"], steps=a["steps"], lr=a["lr"], seed=0)
trainer = GRPOTrainer(model=model, reward_funcs=addition_reward, args=args, train_dataset=data, processing_class=tok,
                      callbacks=[Marks()])
trainer.train()
trainer.save_model(a["out"])
marks["main returned"] = time.monotonic()
marks["response length"] = sum(Marks.lengths) / max(len(Marks.lengths), 1)
print(json.dumps(marks), flush=True)
"""
"""The ``trl`` arm: one process, TRL's ``GRPOTrainer`` on the toy workload (its argv: the repository root and
the settings as JSON); marks as the ``cispo`` worker's, plus the mean response length over its logged steps."""


def toy_overrides(a, out_dir: str) -> list[str]:
    """``cispo train``'s key=value for the toy workload, into a fresh run folder under ``out_dir``; with
    ``--trl``, TRL's algorithm (no refill rounds, constant lr)."""
    threads = [] if a.threads == "default" else [f"threads={a.threads}"]
    like_trl = ["rollout.dynamic_sampling=false", "optim.warmup_updates=0"] if a.trl else []
    return [f"steps={a.steps}", f"rollout.prompts_per_step={a.prompts}", f"rollout.group_size={a.group_size}",
            f"rollout.max_new_tokens={a.max_new_tokens}", f"algo.updates_per_batch={a.updates}", "eval.every=0",
            "data.num_eval_prompts=0", *threads, "progress=false", f"out_dir={out_dir}",
            f"run_name=run-{time.time_ns()}", *like_trl, *a.set]


def worker(argv: list[str]) -> None:
    """``cispo train ARGV`` as the console script runs it; the last line of stdout (JSON) holds the times of
    first RL step called (``RLStep.__call__``), of ``finish`` (summary, curves.png) and of ``main`` returning. The
    modules are marked as ``cispo train`` imports them (`on_import`), not imported ahead: when they are imported
    is timed too.
    ``PYTHONPATH`` goes ahead of the checkout this script put first on ``sys.path``, so the ``baseline`` arm
    runs its own tree's cispo."""
    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    from cispo.cli import main

    marks = {}

    def marked(name: str, fn):
        def call(*args, **kwargs):
            marks.setdefault(name, time.monotonic())
            return fn(*args, **kwargs)
        return call

    def mark_step(module) -> None:
        module.RLStep.__call__ = marked("first step", module.RLStep.__call__)

    def mark_runner(runner) -> None:
        runner.finish = marked("finish", runner.finish)
        if hasattr(runner, "rl_step"):  # a --baseline-tree from before RLStep: the step was the runner's function
            runner.rl_step = marked("first step", runner.rl_step)

    on_import("cispo.training.rl_step", mark_step)
    on_import("cispo.training.runner", mark_runner)
    sys.argv = ["cispo", "train", *argv]
    code = main()
    marks["main returned"] = time.monotonic()
    setting = dict(x.split("=", 1) for x in argv if "=" in x)
    run = Path(setting["out_dir"]) / setting["run_name"]
    lengths = [r["rollout/response_length"] for r in map(json.loads, (run / "metrics.jsonl").open())
               if "rollout/response_length" in r]
    marks["response length"] = sum(lengths) / max(len(lengths), 1)
    print(json.dumps(marks), flush=True)
    sys.exit(code)


def on_import(name: str, then) -> None:
    """Call ``then(module)`` once module ``name`` has been imported, by whoever imports it first."""
    import importlib.abc
    import importlib.util

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run_module = spec.loader.exec_module

            def exec_module(module):
                run_module(module)
                then(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def run(cmd: list[str], env: dict) -> dict:
    """One fresh process: {mark: seconds since its spawn}; marks from its progress lines, its own
    last stdout line (JSON: monotonic times) and its exit."""
    spawn = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    marks, err = {"spawn": 0.0}, []
    for line in proc.stderr:  # stdout is a few lines: read after
        err.append(line)
        for mark in LINE_MARKS:
            if f"cispo: {mark}" in line:
                marks.setdefault(mark, time.monotonic() - spawn)
    out = proc.stdout.read()
    proc.wait()
    marks["exit"] = time.monotonic() - spawn
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({proc.returncode}):\n{''.join(err)[-3000:]}")
    own = json.loads(out.strip().splitlines()[-1])
    length = own.pop("response length", None)
    return {**marks, **{k: t - spawn for k, t in own.items()}, "response length": length}


def arm_command(a, arm: str, out_dir: str, model: Path) -> tuple[list[str], dict]:
    """The command and environment of one run of ``arm``: one thread, unbuffered output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if a.threads != "default":
        env.update(OMP_NUM_THREADS=a.threads, MKL_NUM_THREADS=a.threads)
    if arm == "floor":
        return [sys.executable, "-c", FLOOR, str(model)], env
    if arm == "trl":
        from cispo.config.train import OptimConfig

        settings = {"model": str(model), "prompts": a.prompts, "group_size": a.group_size, "updates": a.updates,
                    "max_new_tokens": a.max_new_tokens, "steps": a.steps, "threads": a.threads, "lr": OptimConfig().lr,
                    "out": os.path.join(out_dir, f"trl-{time.time_ns()}")}
        return [sys.executable, "-c", TRL_WORKER, str(Path(__file__).resolve().parents[2]), json.dumps(settings)], env
    if arm == "baseline":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (a.baseline_tree, env.get("PYTHONPATH")) if p)
    return [sys.executable, __file__, "--worker", *toy_overrides(a, out_dir)], env


def top_imports(a, out_dir: str, n: int) -> list[tuple[str, float]]:
    """The ``n`` largest top-level imports (cumulative seconds) of one ``cispo`` run under ``-X importtime``."""
    cmd, env = arm_command(a, "cispo", out_dir, Path())
    proc = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True, env=env, check=True)
    found = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S+)$", line)  # depth 0: no indent before the name
        if m:
            found.append((m.group(2), int(m.group(1)) / 1e6))
    return sorted(found, key=lambda x: -x[1])[:n]


def phase_rows(runs: dict[str, list[dict]]) -> list[list]:
    """Per arm: the runs, each phase's median seconds ("-": a phase the arm does not have), the range of the
    start-up and of the total."""
    rows = []
    for arm, results in runs.items():
        cells = [median(r[end] - r[begin] for r in results) if all(begin in r and end in r for r in results) else "-"
                 for _, begin, end in PHASES]
        length = median(r["response length"] for r in results) if results[0].get("response length") else "-"
        rows.append([arm, len(results), *cells, spread(r["first step"] for r in results),
                     spread(r["exit"] for r in results), length])
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--updates", type=int, default=4, help="K")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=16, help="RL steps per run")
    p.add_argument("--rounds", type=int, default=3, help="rounds of one run per arm, the order reversed every other")
    p.add_argument("--baseline-tree", help="a folder holding another cispo/ package (an older checkout): a third arm")
    p.add_argument("--imports", type=int, default=10,
                   help="top-level imports to list from one -X importtime run (0: none)")
    p.add_argument("--trl", action="store_true", help="a third arm: the workload through TRL's GRPOTrainer (needs trl)")
    p.add_argument("--threads", default="1", help="torch threads of every arm (default 1), or 'default': each its own")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more cispo train override for the cispo arms (repeatable)")
    p.add_argument("--tiny", action="store_true",
                   help="2 prompts x G=2, K=2, 4 tokens, 2 steps, dynamic sampling off, 1 round, 3 imports")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args(argv)
    if a.worker:
        return worker(rest)
    if a.tiny:
        a.prompts, a.group_size, a.updates, a.max_new_tokens, a.steps, a.rounds, a.imports = 2, 2, 2, 4, 2, 1, 3
        a.set = [*a.set, "rollout.dynamic_sampling=false"]  # a step with equal rewards still updates: exit status 0
    from cispo.models.builtin import ensure_builtin_model

    print(machine_note(0 if a.threads == "default" else int(a.threads)))
    model, t0 = ensure_builtin_model("addition"), time.perf_counter()
    arms = ("cispo", "floor") + (("baseline",) if a.baseline_tree else ()) + (("trl",) if a.trl else ())
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as d:
        for r in range(a.rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                runs[arm].append(run(*arm_command(a, arm, d, model)))
        imports = top_imports(a, d, a.imports) if a.imports else []
    print(f"{a.prompts} prompts x G={a.group_size}, K={a.updates}, {a.max_new_tokens} new tokens, {a.steps} steps, "
          f"{a.threads} thread(s), a fresh process per run, {a.rounds} round(s); medians over runs (floor: import "
          f"torch + transformers, load the model; its 'start-up' ends with the model loaded)")
    print(table(["arm", "runs", *[label for label, _, _ in PHASES], "start-up range", "total range",
                 "response tokens"], phase_rows(runs)))
    start = {arm: median(x["first step"] for x in rs) for arm, rs in runs.items()}
    ratios = [f"cispo start-up / floor x{start['cispo'] / start['floor']:.2f}"]
    if a.baseline_tree:
        total = {arm: median(x["exit"] for x in runs[arm]) for arm in ("cispo", "baseline")}
        ratios += [f"cispo / baseline: start-up x{start['cispo'] / start['baseline']:.2f}, total "
                   f"x{total['cispo'] / total['baseline']:.2f}"]
    if a.trl:  # pair by pair: run r of each arm
        pairs = sorted(t["exit"] / c["exit"] for t, c in zip(runs["trl"], runs["cispo"]))
        steps = sorted((t["finish"] - t["first step"]) / (c["finish"] - c["first step"])
                       for t, c in zip(runs["trl"], runs["cispo"]))
        ratios += [f"TRL / cispo whole process x{median(pairs):.2f} (pairs {min(pairs):.2f}-{max(pairs):.2f}), "
                   f"the {a.steps} steps alone x{median(steps):.2f} ({min(steps):.2f}-{max(steps):.2f})"]
    print("\n" + "; ".join(ratios) + f"; took {time.perf_counter() - t0:.0f} s; 1-min load average at end "
          f"{load_average():.2f}")
    if imports:
        print("\nlargest top-level imports of one cispo run (python -X importtime, cumulative s):")
        print(table(["module", "s"], [[name, s] for name, s in imports]))


if __name__ == "__main__":
    main()
