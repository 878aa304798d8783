"""Probe (docs/real-models.md): are reflective tokens low-probability under a model?

Samples ``--group`` responses (temperature 1, the RL rollout's settings) to each of ``--prompts``
training prompts of a task and prints, for each of the task's fork strings (``cispo.foundations.forks``) and for
the other response tokens, the probability the sampler gave each token it drew: how many, the mean,
the median, the share below 0.1 (``LOW_PROB``) and the mean percentile among the other tokens (the
share of other tokens drawn with a lower probability). For strings of several tokens, the first
token carries the string (as in the trainer's diagnostics); the later tokens' mean is printed too.

    python -m studies.scripts.fork_probe model.path=builtin:smollm2-135m data.task=wordmath \\
        --prompts 32 --group 8 max_new_tokens=96 threads=1 seed=0

Arguments without ``--`` are ``cispo train`` overrides (model, task, sampling, seed, threads).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch


def token_stats(p: torch.Tensor, others: torch.Tensor) -> dict:
    """Count, mean, median, share < LOW_PROB of probabilities ``p`` [n], and their mean percentile
    among ``others`` [m] (sorted ascending)."""
    from cispo.objective.loss import LOW_PROB

    if not len(p):
        return {"n": 0}
    below = torch.searchsorted(others, p.contiguous()).double() / max(len(others), 1)  # share of others below
    return {"n": len(p), "mean": float(p.mean()), "median": float(p.median()),
            "lowp": float((p < LOW_PROB).double().mean()), "pct": float(below.mean())}


def later_tokens(forks, response_ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """For each token after the first of a match (the rest of a multi-token string), the string's
    index, else -1.  ``response_ids``, ``index`` (``ForkTokens.index``): [B, T]  -> [B, T] long"""
    T = response_ids.shape[1]
    cont = torch.full_like(index, -1)
    for i, seq in forks.sequences:
        n = len(seq)
        if n < 2 or n > T:
            continue
        spelled = (response_ids.unfold(1, n, 1) == torch.tensor(seq)).all(-1)  # [B, T-n+1]
        starts = (index == i) & torch.nn.functional.pad(spelled, (0, n - 1))  # this spelling starts here  [B, T]
        for k in range(1, n):
            cont[:, k:][starts[:, : T - k]] = i
    return cont


def main(argv=None) -> int:
    from cispo.config.train import TrainConfig, apply_overrides
    from cispo.data.prompts import load_source
    from cispo.foundations.experience import collate
    from cispo.foundations.threads import auto_threads
    from cispo.training.run_policy import load_policy_for, resolve_device
    from cispo.training.sampling import sample_groups
    from cispo.training.setup import default_max_new_tokens, fork_matcher, sampling_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="ignored (no --tiny size: this probe needs a model)")
    args, overrides = ap.parse_known_args(argv)
    cfg = apply_overrides(TrainConfig(), overrides)
    torch.set_num_threads(auto_threads(cfg.threads))
    task = load_source(cfg.data, cfg.rollout.max_new_tokens)
    sampling = sampling_config(cfg.rollout, default_max_new_tokens(task))
    cfg = replace(cfg, rollout=replace(cfg.rollout, max_new_tokens=sampling.max_new_tokens))
    policy = load_policy_for(cfg, task, resolve_device(cfg.model.device))
    forks = fork_matcher(policy.tokenizer, task)
    if forks is None:
        print("the task tracks no fork strings (data.fork_tokens)", file=sys.stderr)
        return 2
    samples = task.train_samples(cfg.data.seed, args.prompts)
    gen = torch.Generator().manual_seed(cfg.seed)
    flat = [c for g in sample_groups(policy, samples, args.group, sampling, task.reward, gen) for c in g]
    exp = collate(flat, torch.zeros(len(flat)), policy.pad_id)
    mask = exp.response_mask.bool()  # [B, T]
    index = forks.index(exp.response_ids, exp.response_mask)  # [B, T]
    p = exp.logp_rollout.double().exp()  # the sampler's probability of each drawn token   [B, T]
    cont = later_tokens(forks, exp.response_ids, index)  # [B, T]
    other = mask & (index < 0) & (cont < 0)  # [B, T]
    others = p[other].sort().values
    print(f"{len(flat)} responses ({args.prompts} prompts x {args.group}), {int(mask.sum())} tokens, "
          f"accuracy {sum(c.task_reward for c in flat) / len(flat):.3f}, model {cfg.model.path or task.model}, "
          f"seed {cfg.seed}, temperature {cfg.rollout.temperature}")
    print(f"{'string':<18} {'tokens':>6} {'responses':>9} {'mean p':>7} {'median p':>8} {'p<0.1':>6} "
          f"{'pctile':>6} {'later tokens mean p':>19}")

    def row(name, s, rows, later):
        fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        print(f"{name:<18} {s['n']:>6} {rows:>9} {fmt(s.get('mean')):>7} {fmt(s.get('median')):>8} "
              f"{fmt(s.get('lowp')):>6} {fmt(s.get('pct')):>6} {fmt(later):>19}")

    every = mask & (index >= 0)
    for i, name in enumerate(forks.names):
        here = mask & (index == i)
        later = p[mask & (cont == i)]
        row(name, token_stats(p[here], others), int(here.any(-1).sum()), float(later.mean()) if len(later) else None)
    row("(every string)", token_stats(p[every], others), int(every.any(-1).sum()), None)
    row("(other tokens)", token_stats(others, others), len(flat), None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
