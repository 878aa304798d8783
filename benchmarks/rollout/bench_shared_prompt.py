"""Each prompt once per group (``algo.share_prompts``: a group's G rows share their prompt's forward): the
sampler's prefill and the trainer's passes with ``share`` on against off, on the SmolLM2 workload (4 prompts
x G = 8, ``wordmath`` chat prompts, 64-token responses), interleaved in one process, medians and ratios.

    python benchmarks/rollout/bench_shared_prompt.py                     # builtin:smollm2-135m, 5 repeats
    python benchmarks/rollout/bench_shared_prompt.py --tiny              # a random tiny Llama, 2 repeats (a smoke run)

Timed, each with sharing on and off: ``prefill`` (the sampler's prompt pass: one row per distinct prompt
against one per row), ``logp_old`` (one no-grad forward over the 32 rows: what ``compute_logp_old`` runs
per micro-batch), ``update`` (forward + backward of the objective over one mini-batch of 8 rows, as
the trainer draws it: ``random`` rows of the batch, ~2 per prompt at K = 4, or ``by group``: one
prompt's 8 rows). Responses are fixed random ids of the full length (no EOS), so both sides do the
same work; fp32, the trainer's FP32 head, at the threads given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks._common import interleaved, machine_note, median, set_threads, table  # noqa: E402


def load(name: str):
    """The model and the 4 distinct chat prompts' ids."""
    from cispo.data.tasks import get_task

    task = get_task("wordmath")
    samples = task.train_samples(0, 4)
    if name == "tiny":
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg).float(), [list(range(3, 69))] * 2 + [list(range(5, 66))] * 2
    from cispo.models.loading import load_policy
    from cispo.models.packaged import resolve_model_path

    model, tok = load_policy(resolve_model_path(name), dtype=torch.float32, device=torch.device("cpu"))
    prompts = []
    for s in samples:  # the task's chat messages: its system prompt, then the problem
        ids = tok.apply_chat_template(s["messages"], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return model, prompts


def experience(prompts, G: int, T: int, vocab: int):
    from cispo.foundations.experience import Completion, collate

    g = torch.Generator().manual_seed(0)
    rows = [Completion({}, p, torch.randint(3, vocab, (T,), generator=g), torch.zeros(T), "length", "")
            for p in prompts for _ in range(G)]
    return collate(rows, torch.randn(len(rows), generator=g), 0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--minibatch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a random tiny Llama, 2 repeats (a smoke run)")
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.repeats = "tiny", 2
    threads = set_threads(args.threads)
    from cispo.models.policy import decoder, policy_logprobs
    from cispo.objective.loss import policy_loss
    from cispo.objective.presets import preset

    model, prompts = load(args.model)
    G, T = args.group, args.max_new_tokens
    exp = experience(prompts, G, T, model.config.vocab_size)
    rows_random = torch.randperm(len(exp), generator=torch.Generator().manual_seed(1))[: args.minibatch]
    rows_group = torch.arange(args.minibatch)
    grouped = [ids for ids in prompts for _ in range(G)]
    from cispo.rollout.torch_sampler import shared_rows

    def prefill(share: bool):
        P = max(len(q) for q in grouped)
        ids = torch.tensor([[0] * (P - len(q)) + q for q in grouped])
        mask = torch.tensor([[0] * (P - len(q)) + [1] * len(q) for q in grouped])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        first, _ = shared_rows(grouped) if share else (None, None)
        sel = first if first is not None else slice(None)
        with torch.inference_mode():
            decoder(model)(input_ids=ids[sel], attention_mask=mask[sel], position_ids=pos[sel], use_cache=True)

    def logp_old(share: bool):
        with torch.no_grad():
            policy_logprobs(model, exp, 1.0, True, share_prompts=share)

    def update(share: bool, rows):
        sub = exp.select(rows)
        logp = policy_logprobs(model, sub, 1.0, True, share_prompts=share)
        loss, _ = policy_loss(logp, logp.detach(), sub.advantages, sub.response_mask, preset("cispo"))
        loss.backward()
        model.zero_grad(set_to_none=True)

    model.train()
    fns = {}
    for share in (False, True):
        tag = "shared" if share else "plain"
        fns[f"prefill {tag}"] = lambda s=share: prefill(s)
        fns[f"logp_old {tag}"] = lambda s=share: logp_old(s)
        fns[f"update random {tag}"] = lambda s=share: update(s, rows_random)
        fns[f"update by group {tag}"] = lambda s=share: update(s, rows_group)
    times = interleaved(fns, args.repeats)
    out = []
    for part in ("prefill", "logp_old", "update random", "update by group"):
        plain, shared = median(times[f"{part} plain"]), median(times[f"{part} shared"])
        out.append([part, f"{plain:.3f}", f"{shared:.3f}", f"{plain / shared:.2f}x"])
    P = sum(len(q) for q in prompts) / len(prompts)
    print(f"{args.model}: {len(prompts)} prompts (mean {P:.0f} tokens) x G = {G}, {T}-token responses; "
          f"mini-batch {args.minibatch} rows; {machine_note(threads)}")
    print(table(["pass", "plain s (median)", "shared s", "speed-up"], out))


if __name__ == "__main__":
    main()
