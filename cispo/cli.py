"""``cispo train | pretrain | eval``: a YAML file and/or ``key=value`` overrides.

    cispo train                                   # CISPO on the built-in task, defaults
    cispo train algo.objective=dapo lr=5e-5       # dotted keys, or unique leaf names
    cispo train --config run.yaml seed=1
    cispo train --resume run_name=cispo__addition__seed0
    cispo pretrain seed=1 --measure 2000
    cispo eval --model runs/cispo__addition__seed0/checkpoints/step_000060/model
    cispo compare --quick                         # GRPO vs DAPO vs CISPO, 3 seeds
    cispo sweep ks=[1,4,16]                       # the gap vs the number of off-policy updates K
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cispo.config import ConfigError, TrainConfig, apply_overrides, format_help, load_yaml
from cispo.tasks import UnknownTaskError


def _build_config(cls, config_file: str | None, overrides: list[str]):
    cfg = load_yaml(cls, config_file) if config_file else cls()
    return apply_overrides(cfg, overrides)


def cmd_train(args) -> int:
    from cispo.runner import format_summary, train

    cfg = _build_config(TrainConfig, args.config, args.overrides)
    result = train(cfg, resume=args.resume, overwrite=args.overwrite)
    print(format_summary(result.summary))
    print(f"run folder: {result.run_dir}  (metrics.jsonl, curves.png, checkpoints/)")
    return 0


def cmd_pretrain(args) -> int:
    from cispo.builtin_model import rebuild_builtin_model
    from cispo.pretrain import PretrainConfig, measure_base_model, pretrain

    cfg = _build_config(PretrainConfig, args.config, args.overrides)
    if args.out:
        out = Path(args.out)
        pretrain(cfg, out)
    else:  # always rebuilds, even when a shipped or cached copy exists
        out = rebuild_builtin_model(cfg)
    print(f"model: {out}")
    if args.measure:
        report = measure_base_model(out, task=cfg.task, n=args.measure, seed=args.measure_seed)
        print(json.dumps(report.to_dict(), indent=2))
    return 0


def cmd_eval(args) -> int:
    from cispo.runner import load_policy_for, resolve_device
    from cispo.data import load_source
    from cispo.trainer import default_max_new_tokens, evaluate

    cfg = _build_config(TrainConfig, args.config, args.overrides)
    if args.model:
        from dataclasses import replace

        cfg = replace(cfg, model=replace(cfg.model, path=args.model))
    task = load_source(cfg.data, cfg.rollout.max_new_tokens)
    policy = load_policy_for(cfg, task, resolve_device(cfg.model.device))
    samples = task.eval_samples(cfg.data.seed, cfg.data.num_eval_prompts)
    max_new = cfg.rollout.max_new_tokens or default_max_new_tokens(task)
    metrics = evaluate(policy, samples, task.reward, task.used_fork, cfg, max_new, seed=cfg.seed)
    print(json.dumps(metrics, indent=2))
    return 0


def _split_overrides(cls, overrides: list[str]) -> tuple[list[str], list[str]]:
    """(overrides of ``cls``'s own fields, the rest: TrainConfig overrides for every run)."""
    import dataclasses

    own = {f.name for f in dataclasses.fields(cls)}
    mine = [o for o in overrides if o.split("=", 1)[0].split(".")[0] in own]
    return mine, [o for o in overrides if o not in mine]


def cmd_compare(args) -> int:
    from cispo.experiments.compare import CompareConfig, SweepConfig, compare, format_sweep, format_table, sweep

    cls = SweepConfig if args.command == "sweep" else CompareConfig
    mine, rest = _split_overrides(cls, args.overrides)
    cfg = _build_config(cls, args.config, mine)
    from dataclasses import replace

    cfg = replace(cfg, train=list(cfg.train) + rest, quick=cfg.quick or args.quick)
    apply_overrides(TrainConfig(), cfg.train)  # fail fast on a bad run override
    if args.command == "sweep":
        print(format_sweep(sweep(cfg)))
    else:
        table = compare(cfg)
        print(format_table(table))
        print(f"wall time: {table['wall_s']:.0f} s; folder: {cfg.out_dir} (table.md, comparison.png)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cispo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name, help_text, cls, fn):
        from cispo.pretrain import PretrainConfig  # noqa: F401  (import check for help)

        p = sub.add_parser(name, help=help_text, description=help_text, epilog=format_help(cls),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see below)")
        p.add_argument("--config", help="YAML config file (overrides apply on top)")
        p.set_defaults(fn=fn)
        return p

    from cispo.pretrain import PretrainConfig

    p = add("train", "train a policy with CISPO (or another preset) on a verifiable task", TrainConfig, cmd_train)
    p.add_argument("--resume", action="store_true", help="continue the run from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete an existing run folder of the same name")
    p = add("pretrain", "pretrain the built-in base model (cached; `train` does this on first use)",
            PretrainConfig, cmd_pretrain)
    p.add_argument("--out", help="output folder (default: the model cache)")
    p.add_argument("--measure", type=int, default=0, help="sample N held-out prompts and report fork rate / accuracy")
    p.add_argument("--measure-seed", type=int, default=0)
    p = add("eval", "held-out accuracy and fork rate of a model (default: the built-in base model)",
            TrainConfig, cmd_eval)
    p.add_argument("--model", help="model folder (a checkpoint's model/ or any HF causal LM)")
    from cispo.experiments.compare import CompareConfig, SweepConfig

    p = add("compare", "GRPO vs DAPO vs CISPO from the same base model over seeds; table and plots (resumable); "
            "key=value that are not comparison fields apply to every run", CompareConfig, cmd_compare)
    p.add_argument("--quick", action="store_true", help="a small size that finishes in about 10 minutes on 2 cores")
    p = add("sweep", "the comparison for each K (off-policy updates per batch): CISPO - DAPO / GRPO gaps",
            SweepConfig, cmd_compare)
    p.add_argument("--quick", action="store_true", help="the quick size for every K")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)  # key=value may follow options, too
    unknown = [r for r in rest if r.startswith("-") or "=" not in r]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = list(args.overrides) + rest
    try:
        return args.fn(args)
    except (ConfigError, FileExistsError, UnknownTaskError) as e:
        print(f"cispo {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"cispo {args.command}: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"cispo {args.command}: {e or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
