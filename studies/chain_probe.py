"""Where a `chain` base model makes its error, step by step (the `chain_hidden` tasks).

For every step ``a+b`` of the task's held-out prompts, on the shortest correct completion's
prefix (every earlier buggy step rechecked, so the running sum ``a`` is right):

* **teacher-forced** (exact): ``p_right`` = P(the direct result is ``a+b``), ``p_dropped`` =
  P(it is the dropped-carry value, `chain.dropped_carry_sum`, carrying steps only), and
  ``p_w`` = P(``W`` right after the result the base model writes (`chain.is_buggy`: the dropped
  value on a buggy step, else the right one)) — the probability of the recheck where it pays
  (buggy steps) and where it does not;
* **sampled** (T = 1, `cispo.models.pretrain.sample_completions`): the two result digits and the token
  after them, `samples_per_step` times per step — how often the right value is written
  directly at a buggy step (the "direct fix" RL could find without a recheck) and how often
  ``W`` follows.

Steps are grouped into *buggy* (the task's bug set, `chain.TASK_BUGS`), *other carrying* and
*no carry*, and the carrying ones also per (tens digit, addend) pair.

    python -m studies.chain_probe MODEL_DIR --task chain_hidden --prompts 8000 --out report.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from cispo.data.tasks import chain

GROUPS = ("buggy", "other_carry", "no_carry")


def step_contexts(numbers, bugs) -> list[dict]:
    """One dict per step of `numbers`: ``context`` (the prompt and the shortest correct
    completion up to and including the step's ``a+b=``), ``a``, ``b``, ``group`` (`GROUPS`),
    ``written`` (the base model's direct result), ``right`` and ``dropped``."""
    prompt = chain.make_prompt(numbers)
    parts = chain.reference(numbers, bugs).split(chain.STEP_SEP)
    out, total = [], numbers[0]
    for i, b in enumerate(numbers[1:]):
        head = chain.STEP_SEP.join(parts[:i]) + (chain.STEP_SEP if i else "")
        buggy, carry = chain.is_buggy(total, b, bugs), chain.has_carry(total, b)
        right, dropped = str(total + b), str(chain.dropped_carry_sum(total, b))
        out.append({"context": f"{prompt}{head}{total}+{b}=", "a": total, "b": b,
                    "group": "buggy" if buggy else "other_carry" if carry else "no_carry",
                    "written": dropped if buggy else right, "right": right, "dropped": dropped})
        total += b
    return out


@torch.no_grad()
def _teacher_forced(model, tokenizer, contexts: list[str], targets: list[str], w_id: int,
                    batch_size: int = 256) -> tuple[list[float], list[float]]:
    """``(log P(target | context), P(W | context + target))`` per row, by one forward pass each."""
    logp_target, p_w = [], []
    for start in range(0, len(contexts), batch_size):
        ctx, tgt = contexts[start: start + batch_size], targets[start: start + batch_size]
        enc = [tokenizer(c + t, add_special_tokens=False)["input_ids"] for c, t in zip(ctx, tgt)]
        T = max(map(len, enc))
        ids = torch.tensor([e + [tokenizer.pad_token_id] * (T - len(e)) for e in enc])      # [B, T]
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)                  # [B, T, V]
        for j, (c, t) in enumerate(zip(ctx, tgt)):
            n_ctx, n = len(c), len(c) + len(t)
            pos = torch.arange(n_ctx - 1, n - 1)                                            # predicts t
            logp_target.append(float(logp[j, pos, ids[j, pos + 1]].sum()))
            p_w.append(float(logp[j, n - 1, w_id].exp()))
    return logp_target, p_w


def _summary(rows: list[dict]) -> dict:
    mean = lambda k: sum(r[k] for r in rows) / len(rows) if rows else math.nan  # noqa: E731
    return {"n": len(rows), "p_right": mean("p_right"), "p_dropped": mean("p_dropped"), "p_w": mean("p_w"),
            "error_rate": 1 - mean("p_right") if rows else math.nan}


def probe(model, tokenizer, task_name: str = "chain_hidden", n_prompts: int = 2000, samples_per_step: int = 1,
          seed: int = 0) -> dict:
    """The report described in the module docstring, on `n_prompts` held-out prompts (seed `seed`)."""
    from cispo.data.tasks import get_task
    from cispo.models.pretrain import sample_completions

    bugs = chain.TASK_BUGS.get(task_name)
    model.eval()
    numbers = [chain.parse_prompt(s["prompt"]) for s in get_task(task_name).eval_samples(seed, n_prompts)]
    steps = [st for ns in numbers for st in step_contexts(ns, bugs)]
    w_id = tokenizer.convert_tokens_to_ids(chain.FORK_TOKEN)
    contexts = [st["context"] for st in steps]
    lp_right, _ = _teacher_forced(model, tokenizer, contexts, [st["right"] for st in steps], w_id)
    lp_written, p_w = _teacher_forced(model, tokenizer, contexts, [st["written"] for st in steps], w_id)
    carry = [i for i, st in enumerate(steps) if st["group"] != "no_carry"]
    lp_dropped, _ = _teacher_forced(model, tokenizer, [contexts[i] for i in carry],
                                    [steps[i]["dropped"] for i in carry], w_id)
    for i, st in enumerate(steps):
        st.update(p_right=math.exp(lp_right[i]), p_w=p_w[i], p_dropped=0.0)
    for i, lp in zip(carry, lp_dropped):
        steps[i]["p_dropped"] = math.exp(lp)

    # sampled: the two result digits and the decision after them
    rows = [i for i in range(len(steps)) for _ in range(samples_per_step)]
    drawn = sample_completions(model, tokenizer, [contexts[i] for i in rows], 3, 1.0, seed, batch_size=1024)
    sampled = {g: {"n": 0, "right": 0, "dropped": 0, "w_after_written": 0, "n_written": 0} for g in GROUPS}
    for i, text in zip(rows, drawn):
        st, s = steps[i], sampled[steps[i]["group"]]
        s["n"] += 1
        s["right"] += text[:2] == st["right"]
        s["dropped"] += st["group"] != "no_carry" and text[:2] == st["dropped"]
        if text[:2] == st["written"]:
            s["n_written"] += 1
            s["w_after_written"] += text[2:3] == chain.FORK_TOKEN
    for s in sampled.values():
        s["right_rate"] = s["right"] / s["n"] if s["n"] else math.nan
        s["w_rate_after_written"] = s["w_after_written"] / s["n_written"] if s["n_written"] else math.nan

    pairs = {}
    for st in steps:
        if st["group"] != "no_carry":
            pairs.setdefault((st["a"] // 10 % 10, st["b"]), []).append(st)
    per_pair = [{"tens": t, "addend": b, "buggy": rs[0]["group"] == "buggy", **_summary(rs)}
                for (t, b), rs in sorted(pairs.items())]
    by_group = {g: _summary([st for st in steps if st["group"] == g]) for g in GROUPS}
    bug_pairs = [p for p in per_pair if p["buggy"]]
    other_pairs = [p for p in per_pair if not p["buggy"]]
    return {
        "task": task_name, "n_prompts": n_prompts, "seed": seed, "samples_per_step": samples_per_step,
        "bugs": sorted(map(list, bugs)) if bugs is not None else None,
        "teacher_forced": by_group, "sampled": sampled,
        "pairs_seen": {"buggy": len(bug_pairs), "other_carry": len(other_pairs)},
        "max_p_right_on_a_buggy_pair": max((p["p_right"] for p in bug_pairs), default=math.nan),
        "min_p_right_on_another_carry_pair": min((p["p_right"] for p in other_pairs), default=math.nan),
        "per_pair": per_pair,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Where a chain base model errs, per step and per (tens, addend) pair.")
    p.add_argument("model", help="model folder (cispo.models.loading.load_policy)")
    p.add_argument("--task", default="chain_hidden")
    p.add_argument("--prompts", type=int, default=2000, help="held-out prompts")
    p.add_argument("--samples-per-step", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the JSON report here (else stdout)")
    args = p.parse_args(argv)
    from cispo.models.loading import load_policy

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = load_policy(args.model)
    report = {"model": str(args.model),
              "command": "python -m studies.chain_probe "
                         + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
              **probe(model, tokenizer, args.task, args.prompts, args.samples_per_step, args.seed)}
    report["wall_s"] = time.perf_counter() - t0
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if not args.out else json.dumps({k: v for k, v in report.items() if k != "per_pair"}, indent=1))


if __name__ == "__main__":
    main()
