"""Soak: a long CPU run on the built-in task's tokenizer with a tiny model, sampling the
trainer process's resident memory (RSS) every step, to show it stays flat.

    python benchmarks/step/soak.py --steps 300            # prints RSS after warm-up vs at the end

Reports the RSS growth between step ``warmup`` and the last step, in MiB and as a ratio.
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


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return -1
    lines = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
    return json.loads(lines[-1])["step"] if lines else -1


def soak(steps: int, warmup: int = 10, size: str = "tiny", workdir: Path | None = None) -> dict:
    from cispo.data.tasks import arithmetic
    from cispo.models.loading import build_model, build_tokenizer, save_policy

    workdir = Path(workdir or tempfile.mkdtemp(prefix="cispo-soak-"))
    tok = build_tokenizer(arithmetic.ALPHABET)
    save_policy(build_model(tok, size=size, seed=0), tok, workdir / "model")
    cmd = [sys.executable, "-m", "cispo", "train", f"model.path={workdir / 'model'}", "model.device=cpu",
           f"out_dir={workdir}", "run_name=soak", f"steps={steps}", "prompts_per_step=8", "group_size=4",
           "updates_per_batch=4", "max_new_tokens=16", "eval.every=25", "num_eval_prompts=16", "eval.num_samples=2",
           "checkpoint_every=25", "dynamic_sampling=false", "progress=false", "threads=1", "--overwrite"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    samples: dict[int, float] = {}
    metrics = workdir / "soak" / "metrics.jsonl"
    while proc.poll() is None:
        step = last_step(metrics)
        if step >= 0 and step not in samples:
            try:
                samples[step] = rss_mib(proc.pid)
            except (FileNotFoundError, RuntimeError):
                break
        time.sleep(0.05)
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"soak run failed: {err[-2000:]}")
    steps_seen = sorted(samples)
    after_warmup = min((s for s in steps_seen if s >= warmup), default=steps_seen[0])
    end = steps_seen[-1]
    return {
        "steps": steps,
        "rss_mib_at_warmup": samples[after_warmup],
        "rss_mib_at_end": samples[end],
        "growth_mib": samples[end] - samples[after_warmup],
        "ratio_end_over_warmup": samples[end] / samples[after_warmup],
        "samples": {s: round(samples[s], 1) for s in steps_seen},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--size", default="tiny", help="built-in model size (tiny, small, default)")
    args = p.parse_args()
    r = soak(args.steps, args.warmup, args.size)
    print(f"RSS after warm-up (step {args.warmup}): {r['rss_mib_at_warmup']:.1f} MiB; "
          f"at step {args.steps}: {r['rss_mib_at_end']:.1f} MiB; growth {r['growth_mib']:+.1f} MiB "
          f"(ratio {r['ratio_end_over_warmup']:.3f})")


if __name__ == "__main__":
    main()
