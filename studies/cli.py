"""``python -m studies compare | sweep | data | report``: the project's studies, run against the installed library.

    python -m studies compare --quick                         # GRPO vs DAPO vs CISPO, 3 seeds
    python -m studies sweep ks=[1,4,16]                       # the gap vs the number of off-policy updates K
    python -m studies compare arms=[dapo,cispo,cispo_seqmean] # named arms: presets, ablations, arm_defs.NAME...
    python -m studies data runs/study -o studies/results/study.csv.gz   # every run's curves in one CSV
    python -m studies report studies/results/study.csv.gz studies/results/v3/chain.csv.gz -o studies/results/study \\
        --check-doc studies/results.md

``compare`` and ``sweep`` take a YAML file and/or ``key=value`` overrides like ``cispo train``: the fields of
`studies.compare.CompareConfig` / `SweepConfig`, and any other key applies to every run (a `TrainConfig` field).
The parsing, the config errors and their exit statuses are the ``cispo`` program's (`cispo.cli`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cispo.cli import CommandParser, _build_config, parse_command, run_command

DEFAULT_DATA = "studies/results/study.csv.gz"
"""Where ``data`` writes, and the first file ``report`` reads by default (relative to the repository root)."""


def _split_overrides(cls, overrides: list[str]) -> tuple[list[str], list[str]]:
    """(overrides of ``cls``'s own fields, the rest: TrainConfig overrides for every run)."""
    import dataclasses

    own = {f.name for f in dataclasses.fields(cls)}
    mine = [o for o in overrides if o.split("=", 1)[0].split(".")[0] in own]
    return mine, [o for o in overrides if o not in mine]


def cmd_compare(args) -> int:
    """``compare`` / ``sweep``: the runs (resumable), then the table or the gaps per K."""
    from dataclasses import replace

    from cispo.config.train import ConfigError, TrainConfig, apply_overrides
    from studies.compare import RENAMED, CompareConfig, SweepConfig, compare, sweep
    from studies.tables import format_sweep, format_table

    cls = SweepConfig if args.command == "sweep" else CompareConfig
    for o in args.overrides:
        if (key := o.split("=", 1)[0]) in RENAMED:
            raise ConfigError(f"override {o!r}: {key} is now {RENAMED[key]}")
    mine, rest = _split_overrides(cls, args.overrides)
    cfg = _build_config(cls, args.config, mine)
    cfg = replace(cfg, train=list(cfg.train) + rest, quick=cfg.quick or args.quick)
    apply_overrides(TrainConfig(), cfg.train)  # fail fast on a bad run override
    if args.command == "sweep":
        print(format_sweep(sweep(cfg)))
    else:
        table = compare(cfg)
        print(format_table(table))
        print(f"wall time: {table['wall_s']:.0f} s; folder: {cfg.out_dir} (table.md, comparison.png)")
    return 0


def cmd_data(args) -> int:
    """``data``: run folders' curves into one CSV (`studies.study_data.collect`)."""
    from studies.study_data import collect

    try:
        path, runs, rows, unfinished = collect(args.runs, args.output)
    except FileNotFoundError as e:
        print(f"studies data: error: {e}", file=sys.stderr)
        return 2
    for d in unfinished:
        print(f"studies data: left out {d} (unfinished: no summary.json)", file=sys.stderr)
    print(f"{path}: {runs} runs, {rows} rows, {path.stat().st_size / 1e6:.2f} MB")
    return 0


def cmd_report(args) -> int:
    """``report``: every table, figure and quoted number from the CSV; ``--check-doc`` / ``--update-doc``."""
    from studies.study_report import Settings, check_doc, report, update_doc

    given = {k: v for k, v in vars(args).items() if k in ("reference", "contrast", "floor", "final_evals", "tune_score",
                                                          "tune_tie", "compute_fit") and v is not None}
    try:
        out = report(args.data, args.output, Settings(**given))
    except (FileNotFoundError, ValueError) as e:
        print(f"studies report: error: {e}", file=sys.stderr)
        return 2
    print(out["compute"])
    print(f"tables and figures: {args.output}")
    if args.update_doc:
        doc = Path(args.update_doc)
        doc.write_text(update_doc(doc.read_text(), out))
        print(f"updated the quoted tables and numbers of {doc}")
    if args.check_doc:
        problems = check_doc(Path(args.check_doc).read_text(), out, args.check_doc)
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{args.check_doc}: {len(problems)} quoted value(s) differ from the data")
        return 1 if problems else 0
    return 0


def _add_runs(sub) -> None:
    """The ``compare`` and ``sweep`` commands: overrides, ``--config``, ``--quick``."""
    specs = (("compare", "GRPO vs DAPO vs CISPO from the same base model over seeds; table and plots (resumable); "
              "key=value that are not comparison fields apply to every run", "studies.compare:CompareConfig",
              "a small size (9 runs of 8 steps): 3.5-12.5 min on 2 cores (3 min 38 s and 12 min 22 s measured, "
              "the second with other jobs loading the machine)"),
             ("sweep", "the comparison for each K (off-policy updates per batch): CISPO - DAPO / GRPO gaps",
              "studies.compare:SweepConfig", "the quick size for every K"))
    for name, help_text, config, quick in specs:
        p = sub.add_parser(name, help=help_text, description=help_text, config=config,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see below)")
        p.add_argument("--config", help="YAML config file (overrides apply on top)")
        p.add_argument("--quick", action="store_true", help=quick)
        p.set_defaults(fn=cmd_compare)


def _add_report(sub) -> None:
    """The ``report`` command."""
    p = sub.add_parser("report", help="regenerate every table and figure of the study from the raw-data CSV",
                       description="Tables (markdown), figures and quoted numbers from the CSV alone; the statistics "
                       "are stated in studies.study_report. --check-doc exits 1 when a value quoted in the "
                       "doc between <!-- study:NAME --> markers differs from the data.")
    p.add_argument("data", nargs="+", help="the CSV of `python -m studies data`, or several (their parts side by "
                   "side, e.g. studies/results/study.csv.gz studies/results/v3/chain.csv.gz)")
    p.add_argument("-o", "--output", default="studies/results/study", help="folder for the tables and figures")
    p.add_argument("--reference", help="arm whose final accuracy is the target (default dapo)")
    p.add_argument("--contrast", help="arm compared with the others (default cispo)")
    p.add_argument("--floor", type=float, help="a run whose peak accuracy is below this never learned "
                   "(left out of the collapse fraction; default 0.1)")
    p.add_argument("--final-evals", type=int, help="final accuracy = mean of the last N evaluations (default 2)")
    p.add_argument("--tune-score", choices=["mean_accuracy", "final_accuracy"], help="default mean_accuracy")
    p.add_argument("--tune-tie", type=float, help="tuning scores within this of the best tie (default 0.005)")
    p.add_argument("--compute-fit", choices=["steps", "step_seconds"], help="also fit ScaleRL's compute-performance "
                   "curve (arXiv 2510.13786, eq. 1) per arm, against RL steps or cumulative perf/step_s seconds, with "
                   "bootstrap intervals over seeds: compute_fit_PART.md (descriptive; off by default)")
    p.add_argument("--check-doc", metavar="MD", help="check the values quoted in this markdown file")
    p.add_argument("--update-doc", metavar="MD", help="rewrite the values quoted in this markdown file")
    p.set_defaults(fn=cmd_report)


def build_parser():
    """The ``studies`` program's parser: compare, sweep, data, report."""
    parser = argparse.ArgumentParser(prog="python -m studies", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    _add_runs(sub)
    p = sub.add_parser("data", help="collect run folders' curves and key metrics into one CSV (the raw data)",
                       description="Every run folder (with metrics.jsonl, or metrics.jsonl.gz) below RUN_DIR: its "
                       "evaluation curve and per-step key metrics, with its arm, K, seed, learning rate, role and "
                       "wall time, into one CSV (gzip if OUTPUT ends in .gz). Schema: studies.study_data.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders or folders of runs (a comparison's out_dir)")
    p.add_argument("-o", "--output", default=DEFAULT_DATA, help="output CSV (default %(default)s)")
    p.set_defaults(fn=cmd_data)
    _add_report(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (None: ``sys.argv``), run the command; bad input is one line on stderr and exit status 2,
    a run that cannot go on exit status 1, as for the ``cispo`` program. Returns the exit status."""
    return run_command("studies", parse_command(build_parser(), argv))
