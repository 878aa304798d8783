"""Agent observations prefilled in one forward: the sampling phase of the calculator example
(``examples/smollm2-wordmath-calc.yaml``: 4 prompts x G = 8, 128 tokens, temperature 0.7, up to 4 calculator
calls) with ``rollout.prefill_observations`` on (a row's observation runs through its KV cache in one forward)
against off (fed one token per decode step), interleaved in one process, medians and ratios.

    python benchmarks/rollout/bench_observation_prefill.py                # the example's model, 5 repeats
    python benchmarks/rollout/bench_observation_prefill.py --tiny         # a random tiny Llama, 2 repeats (smoke)

Each repeat samples and scores the first step's 4 groups (``cispo.training.sampling.sample_groups``, what a
training step's sampling phase runs) from the same prompts and seed with either setting. The draws fall on
other steps under the two schedules, so the responses differ: the table prints the decode steps and the
tokens each side's batch took (mean over repeats) beside its time, and the time per decode step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# the repository root, so that benchmarks.* and this checkout's cispo import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks._common import interleaved, machine_note, median, set_threads, spread, table  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "smollm2-wordmath-calc.yaml"


def set_up(tiny: bool, overrides: list[str]):
    """(policy, the first step's samples, sampling config, scoring, group size) of the example's run."""
    from cispo.config.engine import load_yaml
    from cispo.config.train import TrainConfig
    from cispo.data.prompts import PromptStream
    from cispo.training.run import set_up_data
    from cispo.training.run_policy import load_policy_for
    from cispo.training.sampling import Scoring

    more = []
    if tiny:
        import tempfile

        from cispo.models.packaged import save_tiny_smollm2

        folder = save_tiny_smollm2(Path(tempfile.mkdtemp()) / "tiny")
        more = [f"model.path={folder}", "rollout.max_new_tokens=48"]
    cfg = load_yaml(TrainConfig, CONFIG, [*more, *overrides])
    cfg, task, _, sampling, _ = set_up_data(cfg)
    policy = load_policy_for(cfg, task, torch.device("cpu"))
    stream = PromptStream(task.train_samples(cfg.data.seed, cfg.data.num_train_prompts), seed=cfg.seed)
    scoring = Scoring(task.reward, cfg.data.reward_timeout_s, cfg.rollout.overlong_buffer,
                      cfg.rollout.overlong_scope, task.scores_policy_text)
    return policy, stream.take(cfg.rollout.prompts_per_step), sampling, scoring, cfg.rollout.group_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a random tiny SmolLM2-shaped model, 2 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value) on top of the example's")
    args = ap.parse_args()
    threads = set_threads(args.threads)
    repeats = args.repeats or (2 if args.tiny else 5)
    from cispo.training.sampling import sample_groups

    policy, samples, sampling, scoring, G = set_up(args.tiny, args.overrides)
    sampler = policy.sampler
    steps: dict[str, list[int]] = {"token by token": [], "prefilled": []}
    tokens: dict[str, list[int]] = {"token by token": [], "prefilled": []}
    fed: dict[str, list[int]] = {"token by token": [], "prefilled": []}
    seed = iter(range(10**6))

    def run(name: str, prefill: bool):
        def go():
            sampler.prefill_observations = prefill
            generator = torch.Generator().manual_seed(next(seed) // 2)  # both sides of a repeat: one seed
            groups = sample_groups(policy, samples, G, sampling, scoring, generator)
            rows = [c for g in groups for c in g]
            lengths = [len(c.response_ids) for c in rows]
            obs = [int(c.env_mask.sum()) if c.env_mask is not None else 0 for c in rows]
            # decode steps of the batch: its longest row, without the observations when they are prefilled
            steps[name].append(max(n - (o if prefill else 0) for n, o in zip(lengths, obs)))
            tokens[name].append(sum(lengths))
            fed[name].append(sum(obs))
        return go

    times = interleaved({"token by token": run("token by token", False), "prefilled": run("prefilled", True)},
                        repeats, warmup=1)
    base, new = median(times["token by token"]), median(times["prefilled"])
    rows = []
    for name in times:
        t = median(times[name])
        s = sum(steps[name]) / len(steps[name])
        rows.append([name, f"{t:.2f}", spread(times[name]), f"{s:.0f}", f"{t / s * 1000:.0f}",
                     f"{sum(tokens[name]) / len(tokens[name]):.0f}", f"{sum(fed[name]) / len(fed[name]):.0f}"])
    print(machine_note(threads))
    print(f"calculator example, {len(samples)} prompts x G={G}, max_new_tokens {sampling.max_new_tokens}, "
          f"temperature {sampling.temperature}, {repeats} interleaved repeats{' (tiny model)' if args.tiny else ''}")
    print(table(["schedule", "sampling s (median)", "range", "decode steps", "ms / step", "tokens", "observation"],
                rows))
    print(f"prefilled / token by token: {new / base:.3f}x the sampling time (speed-up {base / new:.2f}x)")


if __name__ == "__main__":
    main()
