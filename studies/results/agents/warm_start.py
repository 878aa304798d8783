"""The agents search's warm start (amendment 3, studies/results/agents/search-plan.md): SmolLM2-135M-Instruct
fine-tuned on worked answers before RL, as ReTool's cold start, so that its calls carry the problem's numbers.
Now ``cispo sft`` (`cispo.training.sft`) with this script's options as its config; the same steps, losses and
weights as this script's own loop gave (``examples/calculator_sft.yaml`` is its defaults).

    python studies/results/agents/warm_start.py --out /work/agent_runs/warm_calc_small          # with the calculator
    python studies/results/agents/warm_start.py --plain --out /work/agent_runs/warm_plain_small  # the control
    python studies/results/agents/warm_start.py --call-share 0.125 --out /work/agent_runs/warm_rare  # amendment 4

The demonstrations are ``wordmath_calc.demonstrations``: ``--n`` train problems of ``--data-seed`` (not the
held-out split), each answered in one line of working, ``539 / 11 = <calc>539/11</calc><result>49</result>``
then ``#### 49`` (``--plain``: ``539 / 11 = 49`` under wordmath's prompt; ``--call-share F``: a seeded share F of
the problems answered with the call, the rest by hand, all under the calculator's prompt: a rare call,
``wordmath_calc.mixed_demonstrations``). The loss is the mean cross-entropy

    L = - (1 / |T|) sum_{t in T} log pi(y_t | y_<t)

over T, the assistant's own tokens (the pieces marked trained and the turn's end ``<|im_end|>``): the prompt and
the environment's ``<result>...</result>`` are context only, as in RL. AdamW (``--lr``, constant, no weight
decay), mini-batches of ``--batch`` demonstrations in a seeded order, ``--epochs`` passes. ``--out`` is the run
folder (``cispo sft``'s: metrics.jsonl, checkpoints, ``warm_start.json`` with the arguments and each step's
loss); its ``final/`` is what ``cispo train model.path=DIR/final`` starts from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cispo.config.engine import apply_overrides  # noqa: E402
from cispo.config.sft import SFTConfig  # noqa: E402
from cispo.data.tasks import wordmath_calc  # noqa: E402
from cispo.records.tracking import read_metrics  # noqa: E402
from cispo.training.sft import sft  # noqa: E402
from cispo.training.sft_data import task_demonstrations  # noqa: E402


def warm_start(model_path: str, out: Path, *, calculator: bool, numbers: str, n: int, data_seed: int,
               epochs: int, batch: int, lr: float, seed: int, call_share: float | None = None,
               threads: int | None = None) -> dict:
    """``cispo sft`` of the model at ``model_path`` on the demonstrations into the run folder ``out`` (its model:
    ``out/final``); the record, also written to ``out/warm_start.json``. ``call_share`` (with ``calculator``):
    `wordmath_calc.mixed_demonstrations` instead of every answer calling."""
    out = Path(out)
    cfg = apply_overrides(SFTConfig(), [
        f"model.path={model_path}", f"data.calculator={calculator}", f"data.numbers={numbers}",
        f"data.num_demonstrations={n}", f"data.seed={data_seed}", f"data.call_share={call_share}",
        f"epochs={epochs}", f"batch_size={batch}", f"optim.lr={lr}", f"seed={seed}", f"threads={threads}",
        f"out_dir={out.parent}", f"run_name={out.name}", "checkpoint_every=0", "keep_checkpoints=1"])
    result = sft(cfg)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]  # step 0: the data's size
    demos = task_demonstrations(cfg.data)
    record = {"model": model_path, "calculator": calculator, "call_share": call_share,
              "calls": sum(wordmath_calc.CALL_OPEN in t for d in demos for t, _ in d["parts"]), "numbers": numbers,
              "n": n, "data_seed": data_seed, "epochs": epochs, "batch": batch, "lr": lr, "seed": seed,
              "losses": [round(r["sft/loss"], 5) for r in rows], "final": str(result.final),
              "seconds": round(sum(r["perf/step_s"] for r in rows), 1), "example": demos[0]}
    (out / "warm_start.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="the run folder to write (its model: OUT/final)")
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--plain", action="store_true", help="no calculator: the working's value written by hand")
    p.add_argument("--call-share", type=float, default=None, help="the share of demonstrations that call (else all)")
    p.add_argument("--numbers", default="small", choices=("small", "large"))
    p.add_argument("--n", type=int, default=256, help="demonstrations (distinct train problems)")
    p.add_argument("--data-seed", type=int, default=1, help="the problems' stream (the RL run's is data.seed=0)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    record = warm_start(a.model, a.out, calculator=not a.plain, numbers=a.numbers, n=a.n, data_seed=a.data_seed,
                        epochs=a.epochs, batch=a.batch, lr=a.lr, seed=a.seed, call_share=a.call_share,
                        threads=a.threads)
    print(f"wrote {a.out} ({len(record['losses'])} steps, loss {record['losses'][0]} -> {record['losses'][-1]}, "
          f"{record['seconds']} s)")


if __name__ == "__main__":
    main()
