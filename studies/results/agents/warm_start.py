"""The agents search's warm start (amendment 3, studies/results/agents/search-plan.md): SmolLM2-135M-Instruct
fine-tuned on worked answers before RL, as ReTool's cold start, so that its calls carry the problem's numbers.

    python studies/results/agents/warm_start.py --out /work/agent_runs/warm_calc_small          # with the calculator
    python studies/results/agents/warm_start.py --plain --out /work/agent_runs/warm_plain_small  # the control
    python studies/results/agents/warm_start.py --call-share 0.125 --out /work/agent_runs/warm_rare  # amendment 4

The demonstrations are ``wordmath_calc.demonstrations``: ``--n`` train problems of ``--data-seed`` (not the
held-out split), each answered in one line of working, ``539 / 11 = <calc>539/11</calc><result>49</result>``
then ``#### 49`` (``--plain``: ``539 / 11 = 49`` under wordmath's prompt; ``--call-share F``: a seeded share F of
the problems answered with the call, the rest by hand, all under the calculator's prompt: a rare call). The loss
is the mean cross-entropy

    L = - (1 / |T|) sum_{t in T} log pi(y_t | y_<t)

over T, the assistant's own tokens (the pieces marked trained and the turn's end ``<|im_end|>``): the prompt and
the environment's ``<result>...</result>`` are context only, as in RL. AdamW (``--lr``, constant, no weight
decay), mini-batches of ``--batch`` demonstrations in a seeded order, ``--epochs`` passes. The folder written
(model, tokenizer, ``warm_start.json`` with the arguments and each step's loss) is what ``cispo train
model.path=DIR`` starts from.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cispo.data.tasks import wordmath_calc  # noqa: E402
from cispo.envs.tool_env import render_prompt  # noqa: E402
from cispo.models.loading import load_policy, save_policy, turn_end_id  # noqa: E402
from cispo.models.packaged import resolve_model_path  # noqa: E402

IGNORE = -100


def encode(tokenizer, demo: dict) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of one demonstration: the chat-templated prompt, then each piece's ids
    (``add_special_tokens=False``), then the turn's end; ``labels[i] = ids[i]`` where the token is trained,
    ``IGNORE`` elsewhere (the prompt, the environment's pieces)."""
    ids = render_prompt(tokenizer, {"messages": demo["messages"]})
    labels = [IGNORE] * len(ids)
    for text, trained in demo["parts"]:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    end = turn_end_id(tokenizer)
    end = tokenizer.eos_token_id if end is None else end
    return ids + [end], labels + [end]


def batch_tensors(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``attention_mask`` / ``labels`` [B, T_max] of encoded rows."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        labels[i, :len(row_labels)] = torch.tensor(row_labels)
        mask[i, :len(row_ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def step_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean cross-entropy over the batch's trained tokens (label at position t predicted from t-1)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # [B, T, V]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                                             ignore_index=IGNORE)


def mixed_demonstrations(seed: int, n: int, numbers: str, call_share: float) -> list[dict]:
    """The calculator's demonstrations where a seeded draw falls below ``call_share``, elsewhere the plain one
    under the calculator's prompt (the same problems, the same messages, the value written by hand)."""
    rng = random.Random(f"call-share/{seed}/{n}/{numbers}")
    calc = wordmath_calc.demonstrations(seed, n, numbers, True)
    plain = wordmath_calc.demonstrations(seed, n, numbers, False)
    return [c if rng.random() < call_share else {**p, "messages": c["messages"]} for c, p in zip(calc, plain)]


def warm_start(model_path: str, out: Path, *, calculator: bool, numbers: str, n: int, data_seed: int,
               epochs: int, batch: int, lr: float, seed: int, call_share: float | None = None) -> dict:
    """Fine-tune the model at ``model_path`` on the demonstrations and save it to ``out``; the record.
    ``call_share`` (with ``calculator``): `mixed_demonstrations` instead of every answer calling."""
    torch.manual_seed(seed)
    model, tokenizer = load_policy(resolve_model_path(model_path), dtype="float32", dropout=False)
    demos = (mixed_demonstrations(data_seed, n, numbers, call_share) if calculator and call_share is not None
             else wordmath_calc.demonstrations(data_seed, n, numbers, calculator))
    rows = [encode(tokenizer, d) for d in demos]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    order, losses, started = list(range(len(rows))), [], time.monotonic()
    model.train()
    for epoch in range(epochs):
        random.Random(f"{seed}/{epoch}").shuffle(order)
        for start in range(0, len(order), batch):
            loss = step_loss(model, batch_tensors([rows[i] for i in order[start:start + batch]], pad))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(round(loss.item(), 5))
            print(f"epoch {epoch} step {len(losses)} loss {losses[-1]:.4f} ({time.monotonic() - started:.0f} s)",
                  flush=True)
    model.eval()
    save_policy(model, tokenizer, out)
    record = {"model": model_path, "calculator": calculator, "call_share": call_share,
              "calls": sum("<calc>" in t for d in demos for t, _ in d["parts"]), "numbers": numbers, "n": n,
              "data_seed": data_seed,
              "epochs": epochs, "batch": batch, "lr": lr, "seed": seed, "losses": losses,
              "seconds": round(time.monotonic() - started, 1), "example": demos[0]}
    (Path(out) / "warm_start.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="the folder to write (model, tokenizer, warm_start.json)")
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
    if a.threads:
        torch.set_num_threads(a.threads)
    record = warm_start(a.model, a.out, calculator=not a.plain, numbers=a.numbers, n=a.n, data_seed=a.data_seed,
                        epochs=a.epochs, batch=a.batch, lr=a.lr, seed=a.seed, call_share=a.call_share)
    print(f"wrote {a.out} ({len(record['losses'])} steps, loss {record['losses'][0]} -> {record['losses'][-1]}, "
          f"{record['seconds']} s)")


if __name__ == "__main__":
    main()
