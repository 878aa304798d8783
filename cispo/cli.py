"""``cispo train | sft | pretrain | eval | plot``: a YAML file and/or ``key=value`` overrides.

    cispo train                                   # CISPO on the built-in task, defaults
    cispo train algo.objective=dapo lr=5e-5       # dotted keys, or unique leaf names
    cispo train --config run.yaml seed=1
    cispo train --print-config > run.yaml         # every field with its default and meaning, as YAML
    cispo train recipe=scalerl lr=3e-6            # a paper's settings across sections (cispo.config.recipes)
    cispo train --resume run_name=cispo__addition__seed0 steps=120   # its saved config.yaml, run longer
    cispo sft --config examples/calculator_sft.yaml      # a warm start: chat data, loss on the assistant's tokens
    cispo pretrain seed=1 --measure 2000
    cispo eval --model runs/cispo__addition__seed0/checkpoints/step_000060/model
    cispo eval --model runs/cispo__addition__seed0/checkpoints/step_000060/model "eval.pass_at_k=[1,4]"  # at each k
    cispo plot runs/a runs/b -o runs/ab.html      # overlay runs' curves: ab.png + ab.html
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import importlib
import json
import sys
import textwrap
from pathlib import Path

# Start-up imports nothing heavy: `cispo --help`, `cispo train --help` and a config error answer
# before torch, transformers or pandas would have loaded (each command imports what it runs).

INPUT_ERRORS = ("cispo.config.yaml_input.ConfigError", "cispo.data.datasets.DataError",
                "cispo.data.rewards.RewardSpecError", "builtins.FileExistsError", "cispo.data.tasks.UnknownTaskError",
                "cispo.envs.tools.ToolSpecError")
"""Bad input: one line on stderr, exit status 2, no traceback."""
RUN_ERRORS = ("cispo.training.checkpoint.CheckpointError", "cispo.models.cache.ChecksumError")
"""A run that cannot go on (its checkpoints, a shipped model that fails its checksums): one line, exit status 1."""
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "config.yaml", "curves.png", "checkpoints/")
"""What the closing line of `cispo train` lists of its run folder (those that exist)."""


def is_one_of(error: BaseException, names: tuple[str, ...]) -> bool:
    """Whether ``error`` is an instance of a class named ``module.Class`` in ``names``. By name, so
    that catching imports nothing: a class whose module was never imported was never raised."""
    return any(f"{c.__module__}.{c.__qualname__}" in names for c in type(error).__mro__)


def config_class(name: str) -> type:
    """The config class ``module:Class`` (imported on use: `cispo.models.pretrain` loads torch)."""
    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)


def _build_config(cls, config_file: str | None, overrides: list[str]):
    from cispo.config.train import apply_overrides, load_yaml

    if config_file:  # the file and the command line are one configuration, checked once
        return load_yaml(cls, config_file, overrides)
    return apply_overrides(cls(), overrides)


def cmd_train(args) -> int:
    from cispo.config.recipes import expand_recipes, named_recipe
    from cispo.config.train import TrainConfig
    from cispo.records.runfolder import resume_config, run_name

    overrides = expand_recipes(args.overrides)  # recipe=NAME: a paper's settings, in its place
    recipe = named_recipe(args.overrides)
    if recipe is not None:  # the default run folder names the recipe: no collision with the run without it
        given = _build_config(TrainConfig, args.config, overrides)
        if given.run_name is None:
            overrides = [*overrides, f"run_name={run_name(given, recipe)}"]
    if args.resume:  # the run's saved config.yaml, with the given keys on top (checked by train)
        cfg = resume_config(args.config, overrides)
    else:
        cfg = _build_config(TrainConfig, args.config, overrides)
    if args.print_config:  # the config the run would have, every field with its meaning; no run
        from cispo.config.describe import commented_yaml

        print(commented_yaml(cfg), end="")
        return 0
    with collector_paused(args.program):  # the config is good: now torch and the rest
        import transformers.modeling_utils  # noqa: F401  (every model loads through it: imported here, collector off)

        from cispo.foundations.distributed import close_distributed
        from cispo.training.runner import format_summary, train

    try:
        result = train(cfg, resume=args.resume, overwrite=args.overwrite)
    except BaseException:  # under torchrun: leave the process group, also when the run fails or is stopped
        close_distributed()
        raise
    close_distributed(synchronize=True)
    print(format_summary(result.summary))
    files = [name for name in RUN_FILES if (result.run_dir / name).exists()]
    print(f"run folder: {result.run_dir}  ({', '.join(files)})")
    if result.updates == 0:
        print("cispo train: error: the run made no optimizer update (see the warning above)", file=sys.stderr)
        return 1
    return 0


def cmd_sft(args) -> int:
    from cispo.config.sft import SFTConfig

    if args.resume:  # the run's saved config.yaml, with the given keys on top (only safe ones may change)
        from cispo.training.sft import resume_sft_config

        cfg = resume_sft_config(args.config, args.overrides)
    else:
        cfg = _build_config(SFTConfig, args.config, args.overrides)
    if args.print_config:
        from cispo.config.describe import commented_yaml

        print(commented_yaml(cfg), end="")
        return 0
    with collector_paused(args.program):  # the config is good: now torch and the rest
        from cispo.training.sft import sft

    result = sft(cfg, resume_run=args.resume, overwrite=args.overwrite)
    loss = result.summary.get("sft/loss") or {}
    print(f"sft loss {loss.get('first', float('nan')):.4f} -> {loss.get('last', float('nan')):.4f} over "
          f"{result.summary['steps']} steps")
    print(f"run folder: {result.run_dir}; the fine-tuned model: {result.final} (cispo train model.path={result.final})")
    return 0


def cmd_pretrain(args) -> int:
    from cispo.models.builtin import one_thread, rebuild_builtin_model
    from cispo.models.pretrain import PretrainConfig, measure_base_model, pretrain

    cfg = _build_config(PretrainConfig, args.config, args.overrides)
    if args.out:
        out = Path(args.out)
        with one_thread():  # as the cache's own pretraining (rebuild_builtin_model): measured, docs/builtin-task.md
            pretrain(cfg, out)
    else:  # always rebuilds, even when a shipped or cached copy exists
        out = rebuild_builtin_model(cfg)
    print(f"model: {out}")
    if args.measure:
        from cispo.records.tracking import json_safe

        report = measure_base_model(out, task=cfg.task, n=args.measure, seed=args.measure_seed)
        print(json.dumps(json_safe(report.to_dict()), indent=2, allow_nan=False))
    return 0


def run_config_of(model: str | None) -> Path | None:
    """``RUN/config.yaml`` when ``model`` is a run's checkpoint ``RUN/checkpoints/step_N/model``."""
    if not model:
        return None
    path = Path(model).expanduser().resolve()
    run_config = path.parents[2] / "config.yaml" if len(path.parents) > 2 else None
    if path.name == "model" and path.parent.parent.name == "checkpoints" and run_config and run_config.is_file():
        return run_config
    return None


def cmd_eval(args) -> int:
    from cispo.config.train import TrainConfig

    config_file = args.config or run_config_of(args.model)
    if config_file and not args.config:
        print(f"cispo eval: using the run's config {config_file} (data, reward, sampling); --config overrides it",
              file=sys.stderr)
    # a checkpoint's model/ is a plain (merged) model: no LoRA on top, one process
    model = [f"model.path={args.model}", "model.lora_rank=0", "model.fsdp=false"] if args.model else []
    cfg = _build_config(TrainConfig, config_file, args.overrides + model)
    import torch

    from cispo.data.prompts import load_eval_sets, load_source  # the config is good: now torch and the rest
    from cispo.data.rewards import start_reward_workers
    from cispo.foundations.text import valid_json_line
    from cispo.foundations.threads import auto_threads
    from cispo.records.samples import HELD_OUT, eval_records
    from cispo.records.tracking import json_safe
    from cispo.training.evaluation import Evaluation, answers_per_prompt, evaluate, evaluate_sets
    from cispo.training.progress import evaluation_progress, interactive
    from cispo.training.run_policy import check_model, load_policy_for, resolve_chat_template, resolve_device
    from cispo.training.setup import default_max_new_tokens, eval_defaults

    cfg = eval_defaults(cfg)  # data.num_eval_prompts / eval.num_samples: the task's where unset
    check_model(cfg)  # before the data is loaded
    torch.set_num_threads(auto_threads(cfg.threads))  # cispo train's rule (by load unless threads= says)
    task = load_source(cfg.data, cfg.rollout.max_new_tokens)
    named_sets = load_eval_sets(cfg.data)
    cfg = resolve_chat_template(cfg, task, named_sets)
    with _samples_file(args.samples) as out:
        def on_groups(set_name, mode, groups) -> None:  # --samples: every completion, as it is scored
            if out is not None:
                out.writelines(valid_json_line(json_safe(r), allow_nan=False) + "\n"
                               for r in eval_records(set_name, mode, groups, task.extract_answer))

        start_reward_workers(task.reward)  # while the model loads
        policy = load_policy_for(cfg, task, resolve_device(cfg.model.device))
        samples = task.eval_samples(cfg.data.seed, cfg.data.num_eval_prompts)
        max_new = cfg.rollout.max_new_tokens or default_max_new_tokens(task)
        prompts = len(samples) + sum(map(len, named_sets.values()))
        bar = interactive(cfg.progress)
        with evaluation_progress(prompts, answers_per_prompt(cfg.eval), "evaluation", bar) as tick:
            settings = Evaluation.of_task(task, cfg, max_new, seed=cfg.seed, on_progress=tick)
            metrics = evaluate(policy, samples,
                               dataclasses.replace(settings, on_groups=functools.partial(on_groups, HELD_OUT)))
            metrics.update(evaluate_sets(policy, named_sets, dataclasses.replace(settings, on_groups=on_groups)))
    print(json.dumps(json_safe(metrics), indent=2, allow_nan=False))  # NaN (undefined) -> null, as metrics.jsonl
    if args.samples:
        print(f"cispo eval: completions written to {args.samples}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _samples_file(path: str | None):
    """``--samples``: a new temporary file beside ``path`` for the block, renamed to ``path`` only when
    the block ends without an error (a failed eval leaves ``path`` as it was); None when not asked.
    Refused with a `ConfigError` naming it, before any model is loaded: a path in a run folder
    (a run's own ``metrics.jsonl`` would be replaced; ``--overwrite`` deletes the folder), a folder,
    a file that cannot be written, and anything there that is not a regular file (a device such as
    ``/dev/full``, a FIFO, a socket): the rename would replace it with a regular file."""
    if not path:
        yield None
        return
    import os

    from cispo.config.train import ConfigError
    from cispo.records.runfolder import RUN_OWN_FILES, run_folder_of

    try:
        target = Path(path).expanduser().resolve()  # through a symlink: the file it names, as open() did
        run = run_folder_of(target)
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ConfigError(f"--samples {path}: cannot resolve it ({e})") from None
    if run is not None:
        own_file = target.parent == run and target.name in RUN_OWN_FILES
        what = f"the run's own {target.name} in" if own_file else "inside the run folder"
        raise ConfigError(f"--samples {path}: {what} {run}; cispo eval writes no file into a run folder. Choose a "
                          f"path outside it, e.g. {run.parent / (run.name + '.eval.jsonl')}")
    if target.is_dir():
        raise ConfigError(f"--samples {path}: a folder; give the name of a file to write")
    kind = _not_a_regular_file(target)
    if kind:
        via = f" ({target})" if target != Path(path).expanduser().absolute() else ""
        raise ConfigError(f"--samples {path}: {kind}{via}, not a regular file; cispo eval writes its completions to a "
                          f"new file and renames it over the path, which would replace it. Give a file's path")
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        f = open(tmp, "x", encoding="utf-8")  # "x": never through a file or link already there
    except OSError as e:
        raise ConfigError(f"--samples {path}: cannot write it ({e.strerror or e})") from None
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        os.replace(tmp, target)
    except OSError as e:
        raise ConfigError(f"--samples {path}: cannot replace it ({e.strerror or e}); the completions are in "
                          f"{tmp}") from None


def _not_a_regular_file(path: Path) -> str | None:
    """What ``path`` is ("a character device", "a FIFO", ...) when something other than a regular file
    or a folder is there; None when it is one of those or nothing is there (``path`` is already resolved:
    not followed again)."""
    import stat

    try:
        mode = path.lstat().st_mode
    except OSError:  # nothing there (or nothing that can be looked at: opening beside it fails in turn)
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kinds = [(stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "a special file")


def cmd_plot(args) -> int:
    from cispo.foundations.plotting import plot_runs

    metrics = [m for m in args.metrics.split(",") if m] if args.metrics else None
    try:
        png, page = plot_runs(args.runs, Path(args.output), metrics, args.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"cispo plot: error: {e}", file=sys.stderr)
        return 2
    print(f"{png}\n{page}")
    return 0


class CommandParser(argparse.ArgumentParser):
    """A sub-command's parser whose epilog, the help of every field of its config class
    (``config``: ``module:Class``), is written only when the help is printed."""

    def __init__(self, *args, config: str | None = None, notes=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config, self.notes = config, notes

    def format_help(self) -> str:
        if self.config is not None:
            from cispo.config.describe import format_help

            self.epilog = (self.notes() if self.notes else "") + format_help(config_class(self.config))
        return super().format_help()


def train_notes() -> str:
    """What ``cispo train --help`` says before the fields: ``recipe=`` and its recipes, and the built-in tasks."""
    from cispo.config.data import BUILTIN_TASKS
    from cispo.config.recipes import RECIPES

    recipes = "\n".join(f"  {name}: {recipe.paper.split(',')[0]}" for name, recipe in RECIPES.items())
    return ("recipe=NAME stands for a paper's settings across sections, in its place among the key=value\n"
            "overrides (later ones win; a key before it that it sets is refused), and names the run folder\n"
            f"({{recipe}}__{{task}}__seed{{seed}}). Recipes:\n{recipes}\n\n"
            "data.task=NAME picks a built-in task (or data.path=FILE.jsonl a prompt file):\n"
            + textwrap.fill(", ".join(BUILTIN_TASKS), 100, initial_indent="  ", subsequent_indent="  ") + "\n\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cispo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    def add(name, help_text, config, fn, notes=None):
        p = sub.add_parser(name, help=help_text, description=help_text, config=config, notes=notes,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (see below)")
        p.add_argument("--config", help="YAML config file (overrides apply on top)")
        p.set_defaults(fn=fn)
        return p

    p = add("train", "train a policy with CISPO (or another preset) on a verifiable task",
            "cispo.config.train:TrainConfig", cmd_train, train_notes)
    p.add_argument("--resume", action="store_true",
                   help="continue the run from its last intact checkpoint, with its saved config.yaml (key=value "
                   "may change only: steps, checkpoint_every, eval.*, trackers, ...; see docs/reliability.md)")
    p.add_argument("--print-config", action="store_true",
                   help="print the config the run would have (--config and key=value applied: the defaults without "
                   "them) as YAML, every field with its docstring as a comment, and exit (examples/defaults.yaml)")
    p.add_argument("--overwrite", action="store_true", help="delete an existing run folder of the same name "
                   "(only a folder cispo created: one with a .cispo-run marker, directly in out_dir)")
    p = add("sft", "fine-tune a model on chat data, the loss on the assistant's tokens only (a warm start for "
            "RL; its final/ model is what cispo train model.path=RUN/final starts from)", "cispo.config.sft:SFTConfig",
            cmd_sft)
    p.add_argument("--resume", action="store_true", help="continue the run from its last intact checkpoint, with its "
                   "saved config.yaml (key=value may change only checkpoint_every, threads, trackers, ...)")
    p.add_argument("--print-config", action="store_true", help="print the config the run would have as YAML, every "
                   "field with its docstring as a comment, and exit")
    p.add_argument("--overwrite", action="store_true", help="delete an existing run folder of the same name (only "
                   "a folder cispo created)")
    p = add("pretrain", "pretrain a built-in base model into the model cache or --out (the package ships the "
            "addition and chain models pretrained, and `train` uses those: this rebuilds one, e.g. with other "
            "settings)", "cispo.models.pretrain_config:PretrainConfig", cmd_pretrain)
    p.add_argument("--out", help="output folder (default: the model cache)")
    p.add_argument("--measure", type=int, default=0, help="sample N held-out prompts and report fork rate / accuracy")
    p.add_argument("--measure-seed", type=int, default=0)
    p = add("eval", "held-out accuracy and fork rate of a model (default: the built-in base model)",
            "cispo.config.train:TrainConfig", cmd_eval)
    p.add_argument("--model", help="model folder (a checkpoint's model/ or any HF causal LM)")
    p.add_argument("--samples", metavar="FILE", help="write every completion scored (prompt, completion, reward, "
                   "parsed answer, reference answer; greedy and sampled, each set) to FILE as JSONL")
    p = sub.add_parser("plot", help="overlay runs' curves (metrics.jsonl) into one PNG and a self-contained HTML page",
                       description="Overlay the curves of any runs into OUTPUT.png and OUTPUT.html (the page embeds "
                       "the PNG and a table of each run's final metrics; it needs no network or script).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run folders (with metrics.jsonl or metrics.jsonl.gz), or folders of runs (a "
                   "common out_dir)")
    p.add_argument("-o", "--output", default="plot.html",
                   help="output path; .png and .html are written (default plot.html)")
    p.add_argument("--metrics", help="comma-separated metric names (default: reward, accuracy, fork rate, "
                   "capped / dropped fractions, entropy, length, KL: each that some run logged)")
    p.add_argument("--title", default="", help="figure and page title (default: the run names)")
    p.set_defaults(fn=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``: the arguments; None: ``sys.argv``, i.e. the ``cispo`` program, whose process
    then ends: `skip_exit_collection`). Returns the exit status."""
    try:
        return _run(argv)
    finally:
        if argv is None:
            skip_exit_collection()


# The garbage collector, in the `cispo` program only. Its full passes walk every live object:
# the ~0.4 M that importing torch and transformers makes cost ~0.7 s of passes while they are imported and
# ~0.7 s more at the interpreter's exit, on 2 cores. A caller of ``main([...])`` (a test) keeps its collector.


@contextlib.contextmanager
def collector_paused(program: bool):
    """For the ``cispo`` program (``program``): the block (a command's imports) runs with the garbage collector
    off, and what exists when it ends is frozen (``gc.freeze``: left out of every later pass) before the
    collector is on again. Imports make module-lifetime objects, no large ones, so the few reference cycles
    among them stay for good at little cost. Otherwise a plain block."""
    if not program:
        yield
        return
    import gc

    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def skip_exit_collection() -> None:
    """Leave the objects alive now out of the collections of the interpreter's shutdown (``gc.freeze``). They
    are still freed as their references go; only reference cycles are left to the OS, and every process and
    file a command opens is closed by the command or by ``atexit`` (the reward pools), never by a collection."""
    import gc

    gc.freeze()


def _run(argv: list[str] | None) -> int:
    """`main`'s body: parse ``argv``, run the command, turn its input and run errors into exit statuses."""
    args = parse_command(build_parser(), argv)
    args.program = argv is None  # the `cispo` program, whose process ends with the command (`collector_paused`)
    return run_command("cispo", args)


def parse_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed by ``parser``, the ``key=value`` words anywhere among the options gathered into
    ``args.overrides`` for the commands that take them; any other unknown word is the parser's error."""
    args, rest = parser.parse_known_args(argv)  # key=value may follow options, too
    takes_overrides = "overrides" in vars(args)  # not `plot`
    unknown = [r for r in rest if r.startswith("-") or "=" not in r or not takes_overrides]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if takes_overrides:
        args.overrides = list(args.overrides) + rest
    return args


def run_command(program: str, args: argparse.Namespace) -> int:
    """``args.fn(args)``'s exit status, its errors said as ``PROGRAM COMMAND: ...`` in one line: bad input
    (`INPUT_ERRORS`) 2, a run that cannot go on (`RUN_ERRORS`, a full disk, non-finite weights) 1, a stop
    130; anything else is a bug and keeps its traceback."""
    where = f"{program} {args.command}"
    try:
        return args.fn(args)
    except FloatingPointError as e:
        print(f"{where}: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"{where}: {e or 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as e:
        known = is_one_of(e, INPUT_ERRORS + RUN_ERRORS)
        if not known and isinstance(e, OSError) and e.errno in DISK_FULL:
            print(f"{where}: error: {disk_full_line(e)}", file=sys.stderr)
            return 1
        if not known:
            raise
        print(f"{where}: error: {e}", file=sys.stderr)
        return 2 if is_one_of(e, INPUT_ERRORS) else 1


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a write that found no space (a full disk, a spent quota): one line, not a traceback."""


def disk_full_line(e: OSError) -> str:
    """What to say when a run's write found no space: which file, and that the newest checkpoint still holds."""
    where = f" writing {e.filename}" if e.filename else ""
    return (f"{e.strerror or 'no space left on device'}{where}. The newest checkpoint and the rows of metrics.jsonl "
            "up to it are intact (a torn last line is cut on resume): free space, then continue with --resume")


if __name__ == "__main__":
    sys.exit(main())
