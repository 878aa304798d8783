"""GPU readiness check: one script that measures the CUDA path in at most 6 minutes.

    python3 benchmarks/gpu/gpu_check.py --out gpu_out                     # one CUDA GPU: <= 320 s + start-up
    python benchmarks/gpu/gpu_check.py --tiny --out /tmp/gpu_tiny         # CPU, seconds (the test)
    python benchmarks/gpu/gpu_check.py --sections rl_compiled --out gpu2  # re-run one section

Needs torch and transformers only (and matplotlib for the plot): the rest of the project's
dependencies are imported where used, never on this path (``tests/test_benchmarks.py`` runs it
with them hidden, ``benchmarks/gpu/_bare_image.py``). The script puts the repository root on
``sys.path`` (as every benchmark does): the checkout's cispo runs, installed or not.

A randomly initialised model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV
heads, MLP 4864, vocabulary 151,936, tied embeddings; ~494M parameters) with a synthetic
character tokenizer of the same vocabulary. Its final norm is scaled so the logits have std
``--logit-std`` over the vocabulary (default 10): sampled tokens then have probabilities spread
over (0, 1) as a trained model's do. Sections (``benchmarks/gpu/_gpu_sections.py``, ``_gpu_rl.py``):

* environment: device, versions, peak bf16 TFLOP/s, a measured bf16 matmul rate;
* lm_head: chunked vs naive log-probs at V = 151,936, FP32 / bf16 head: time, memory, error;
* precision: FP32 master weights + bf16 autocast vs pure bf16 weights at lr 1e-6;
* logprob_agreement: rollout vs trainer log-probs with a bf16 / FP32 head on each side; with
  vLLM installed, vLLM's (MiniMax-M1's Figure 3), else the torch sampler's (same kernels as the
  trainer: an upper bound on agreement, said so in the report);
* rl_eager / rl_compiled: ``cispo.training.rl_step.RLStep`` on the path ``model.dtype=bfloat16`` gives
  (FP32 master weights, bf16 autocast, FP32 head), EOS sampled (variable lengths), peak memory per
  phase; compiled = ``model.compile=on`` through ``cispo.models.compile`` (decoder and decode step);
* head_share: the FP32 head's share of an update's time, TF32 off and on;
* long_responses: updates on responses of 1-2k tokens, gradient checkpointing off and on;
* decode_batch: sampling tokens/s against the batch size;
* checkpoint: ``save_checkpoint`` / ``load_checkpoint`` time and size (weights + AdamW state).

Time: ``--budget-s`` (default 320) is a hard limit: each section also has its own cap
(``CAPS``, shortened to what is left), and a section that reaches either is stopped there
(SIGALRM), keeping what it measured. The report (``gpu_check.json``, ``gpu_check.md``,
``figure3.png``) is rewritten after every measurement, so a run killed part-way keeps it too.
Fields that cannot be measured here (CUDA memory on a CPU, MFU without a known peak) are JSON
nulls whose reason is in the section's ``null_reasons``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.gpu._gpu_common import TINY, Device, Sizes, Skipped, log, parse_sets, peak_tflops  # noqa: E402
from benchmarks.gpu._gpu_report import write_report  # noqa: E402
from benchmarks.gpu._gpu_rl import (  # noqa: E402
    section_checkpoint,
    section_decode_batch,
    section_head_share,
    section_long_responses,
    section_rl,
)
from benchmarks.gpu._gpu_sections import (  # noqa: E402
    section_environment,
    section_lm_head,
    section_logprob_agreement,
    section_precision,
)

RUNNERS = {
    "environment": section_environment, "lm_head": section_lm_head, "precision": section_precision,
    "logprob_agreement": section_logprob_agreement,
    "rl_eager": lambda ctx: section_rl(ctx, compiled=False), "rl_compiled": lambda ctx: section_rl(ctx, compiled=True),
    "head_share": section_head_share, "long_responses": section_long_responses, "decode_batch": section_decode_batch,
    "checkpoint": section_checkpoint,
}
SECTIONS = tuple(RUNNERS)
CAPS = {"environment": 15, "lm_head": 30, "precision": 25, "logprob_agreement": 30, "rl_eager": 45,
        "rl_compiled": 70, "head_share": 20, "long_responses": 35, "decode_batch": 20, "checkpoint": 25}
"""Seconds each section may take on the GPU (335 in all: the budget cuts the last ones short)."""


class Stopped(BaseException):
    """A time limit (the section's cap or the budget) or SIGTERM: the running section stops where it is
    and keeps its partial results. A BaseException, so that no ``except Exception`` in a section
    swallows it."""


class Context:
    """What a section sees: the device, sizes and options, and ``results`` / ``nulls``, which it fills
    as it measures (``save()`` writes them to the report at once)."""

    def __init__(self, args, dev: Device, sizes: Sizes, report: dict):
        self.args, self.dev, self.sizes, self.tiny = args, dev, sizes, args.tiny
        self.out, self.logit_std = Path(args.out), args.logit_std
        self.peak, self.peak_source = peak_tflops(dev, args.peak_tflops)
        self.deadline = time.monotonic() + args.budget_s
        self.report, self.section = report, None
        self.results: dict = {}
        self.nulls: dict = {}
        self.stopped: str | None = None  # why the whole run stopped early (SIGTERM, the budget)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        """Rewrite the report with the running section's results so far."""
        if self.section is not None:
            entry = self.report["sections"][self.section]
            entry["results"], entry["null_reasons"] = self.results, self.nulls
        write_report(self.report, self.out)


def _alarm(signum, frame):
    raise Stopped("time limit" if signum == signal.SIGALRM else f"signal {signum} received")


def run_section(name: str, ctx: Context) -> dict:
    cap = min(CAPS[name] * ctx.args.cap_scale, ctx.remaining())
    if cap <= 0:
        why = ctx.stopped or f"budget of {ctx.args.budget_s:.0f} s spent"
        log(f"{name}: skipped ({why})")
        return {"status": "skipped", "seconds": 0.0, "error": why, "results": None, "null_reasons": {}}
    log(f"{name}: start (cap {cap:.0f} s, {ctx.remaining():.0f} s of the budget left)")
    ctx.section, ctx.results, ctx.nulls = name, {}, {}
    ctx.report["sections"][name] = {"status": "running", "seconds": 0.0, "error": "did not finish (killed?)",
                                    "results": {}, "null_reasons": {}}
    ctx.save()
    t0 = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, cap)
    try:
        RUNNERS[name](ctx)
        entry = {"status": "ok", "error": None}
    except (Exception, Stopped) as e:  # noqa: BLE001 - one section's failure must not lose the others
        if isinstance(e, Stopped) and "signal" in str(e):  # SIGTERM: skip what is left
            ctx.deadline, ctx.stopped = time.monotonic() - 1, f"{e} during {name}"
        status = "stopped" if isinstance(e, Stopped) else "skipped" if isinstance(e, Skipped) else "error"
        tb = traceback.format_exc(limit=-4)
        entry = {"status": status, "error": f"{type(e).__name__}: {e} after {time.monotonic() - t0:.0f} s",
                 "traceback": tb}
        log(f"{name}: {status.upper()} {type(e).__name__}: {e}" + ("" if status == "stopped" else f"\n{tb}"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    entry.update(results=ctx.results, null_reasons=ctx.nulls, seconds=time.monotonic() - t0)
    ctx.section = None
    ctx.dev.free()
    log(f"{name}: {entry['status']} in {entry['seconds']:.1f} s")
    return entry


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json, gpu_check.md, figure3.png")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (hidden 32, 2 layers, V=1000): seconds on a CPU")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=320.0, help="hard limit for all sections (stops the one running)")
    p.add_argument("--cap-scale", type=float, default=1.0, help="multiply every section's cap (CAPS) by this")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: table by device name)")
    p.add_argument("--logit-std", type=float, default=10.0, help="std of the random model's logits over V")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a size, e.g. --set max_new_tokens=512 --set updates=16 (fields: "
                        + ", ".join(f.name for f in fields(Sizes)) + ")")
    a = p.parse_args(argv)
    names = [n for n in a.sections.split(",") if n]
    bad = sorted(set(names) - set(SECTIONS))
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {','.join(SECTIONS)}")
    sizes = TINY if a.tiny else Sizes()
    try:
        sizes = replace(sizes, **parse_sets(a.set))
    except ValueError as e:
        p.error(str(e))
    dev = Device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    report = {"meta": {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "tiny": a.tiny, "device": str(dev.device),
                       "budget_s": a.budget_s, "sizes": asdict(sizes), "logit_std": a.logit_std, "total_s": 0.0},
              "sections": {}}
    ctx = Context(a, dev, sizes, report)
    log(f"device {dev.device}, sizes {asdict(sizes)}")
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _alarm)  # `timeout` kills: recorded in the running section
    signal.signal(signal.SIGALRM, _alarm)
    for name in names:
        report["sections"][name] = run_section(name, ctx)
        report["meta"]["total_s"] = time.monotonic() - t0
        write_report(report, Path(a.out))
    failed = [n for n, s in report["sections"].items() if s["status"] != "ok"]
    log(f"done in {report['meta']['total_s']:.0f} s; report in {a.out}; not ok: {failed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
