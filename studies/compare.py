"""The paper's controlled comparison in miniature (MiniMax-M1 Figure 2), and a K sweep.

``compare``: named *arms* (``studies.arms``: GRPO, DAPO and CISPO by default;
any preset, an ablation such as ``cispo_seqmean`` or ``cispo_cap2``, or one defined in
``arm_defs``) trained from the same base model on the same prompts with the same compute,
over several seeds, each arm's learning rate tuned on seeds of its own. Reports held-out
accuracy vs step (mean +- 95% band), *steps-to-target* — the first step at which an arm
reaches the reference's (DAPO's) final accuracy (the paper's "50% of the steps" measure) —
the collapse rate, and the mechanism: fork-token rate, the fraction of fork tokens a PPO
mask drops, the fraction of capped IS weights, and entropy.

``sweep``: the same over the number of off-policy updates K, reporting the gaps of the
``contrast`` arm (CISPO) to the others (the paper used K = 16 only), with the learning rate
tuned per K (``tune_per_k``), the mini-batch held constant (``minibatch_prompts``) and the
warm-up a fraction of each run's optimizer steps (``warmup_fraction``) if asked.

Every run is an ordinary ``cispo train`` run folder plus ``study.json`` (its arm, K, seed,
learning rate, role and wall time; ``python -m studies data`` collects them); a half-finished
comparison resumes its unfinished runs and skips the finished ones.
"""

from __future__ import annotations

import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from cispo.config.algo import ObjectiveSection
from cispo.config.train import ConfigError, TrainConfig, apply_overrides
from cispo.foundations.nan import nan_mean
from cispo.records.runfolder import is_finished
from cispo.records.tracking import read_metrics
from studies.arms import ArmConfig, describe, resolve_arms
from studies.stats import at_edge, final_accuracy, mean_accuracy, pick_lr
from studies.tables import analyse, curve, format_sweep, format_table, plot_comparison, plot_sweep, sweep_gaps


@dataclass
class CompareConfig:
    """A controlled comparison: same base model, prompts and compute for every arm."""

    arms: list[str] = field(default_factory=lambda: ["grpo", "dapo", "cispo"])
    """Arms to compare, by name: the built-in ones (the presets ``cispo``, ``ppo``, ``grpo``,
    ``dapo``, ``gspo``, ``reinforce``; ``cispo_seqmean``: CISPO with sequence-mean
    aggregation; ``cispo_cap0.2`` / ``cispo_cap1`` / ``cispo_cap2`` / ``cispo_cap4`` /
    ``cispo_cap8``: CISPO with eps_high_is = 0.2 ... 8) or those of ``arm_defs``. The name
    names the run folders and the table rows."""
    arm_defs: dict[str, ArmConfig] = field(default_factory=dict)
    """More arms (or built-in names redefined): ``arm_defs.NAME.objective=cispo
    arm_defs.NAME.objective_overrides.eps_high_is=3``, or the same as a YAML mapping."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Evaluation seeds per arm (sampling, shuffling, prompt order); the reported runs."""
    reference: str = "dapo"
    """Arm whose final accuracy (mean over seeds) is the steps-to-target target."""
    contrast: str = "cispo"
    """Arm whose paired gaps to every other arm the sweep reports (CISPO − baseline)."""
    learning_rates: dict[str, float] = field(default_factory=dict)
    """Fixed learning rates: ``ARM`` (every K) or ``ARM@K`` (that K only; wins over ``ARM``).
    An arm with a rate here for the K at hand is not tuned there."""
    tuning_from: str | None = None
    """Folder of an earlier comparison or sweep whose ``tuning.json`` chosen rates fill in
    `learning_rates` (an explicit ``ARM`` replaces every loaded ``ARM@K``, an explicit
    ``ARM@K`` its own): reuse the tuned rates, e.g. with `lr_scale`. An arm and K it has no
    rate for is an error (no tuning happens here then)."""
    lr_scale: float = 1.0
    """Every run's learning rate (tuned or fixed) times this, e.g. 3 for the stability runs
    at 3× the tuned rate. Tuning runs are not scaled."""
    tune_lrs: list[float] = field(default_factory=lambda: [3e-5, 1e-4, 3e-4])
    """Learning-rate grid tried for every arm (and every K it is tuned at) without a fixed
    rate — the same tuning budget for each; use >= 4 log-spaced values that bracket the
    optimum (the tuning table flags a choice at the edge of the grid). Empty: ``optim.lr``."""
    tune_seeds: list[int] = field(default_factory=lambda: [100])
    """Seeds of the tuning runs, disjoint from `seeds` (the reported runs are not the ones the
    rate was picked on). The score of a rate is its mean over these seeds."""
    tune_score: Literal["mean_accuracy", "final_accuracy"] = "mean_accuracy"
    """Tuning score of one run, fixed in advance: ``mean_accuracy``, held-out accuracy averaged
    over the evaluations after step 0 (area under the curve); ``final_accuracy``, the mean of
    the last `final_evals` evaluations. The highest mean over `tune_seeds` wins."""
    tune_tie: float = 0.005
    """Scores within this of the best one tie, and a tie goes to the smallest rate (the study
    protocol: |Δ| < 0.005). 0: only equal scores tie."""
    tune_extend: bool = True
    """Bracketing: when an arm's choice is at an edge of the grid, try one more rate beyond it
    (the edge ×/÷ √10, 3 significant digits) on the same tuning seeds and choose again — once.
    ``tuning.md`` still flags a choice at the edge of the extended grid."""
    lr_from: dict[str, str] = field(default_factory=dict)
    """Arms that are not tuned but take another arm's rate at the same K (tuned here, fixed, or
    from `tuning_from`), e.g. ``{cispo_seqmean: cispo, cispo_cap2: cispo}``: the ablations
    use CISPO's tuned rate. A rate of the arm's own in `learning_rates` wins."""
    final_evals: int = 1
    """Final held-out accuracy = mean of the run's last this many evaluations (also the target
    of steps-to-target). 1: the last one (the 2026-11-30 runs); the study protocol: 2."""
    minibatch_prompts: int | None = None
    """K-sweep fairness: hold the mini-batch constant across K. Set, every run samples
    ``rollout.prompts_per_step = K * minibatch_prompts`` prompts per step, so each of its K
    mini-batches holds ``minibatch_prompts * group_size`` responses at every K (before dynamic
    sampling drops uninformative groups). The trade: a step at larger K samples and trains on
    K times the responses, so the runs' sampling compute grows with K while the number of
    steps (generation batches) is the same. None: ``prompts_per_step`` fixed, so the
    mini-batch shrinks as 1/K (the 2026-11-30 sweep: ~4 responses per mini-batch at K = 32)."""
    warmup_fraction: float | None = None
    """Warm-up that cannot swallow a short run: each run's ``optim.warmup_updates`` becomes
    min(optim.warmup_updates, ceil(warmup_fraction * steps * K * epochs)), i.e. at most this
    fraction of its optimizer steps, capped at the configured count (16 by default). E.g. 0.1:
    K = 1 with 16 steps warms up over 2 of its 16 updates, K = 16 over 16 of 256. None: the
    configured count for every run (a 16-update warm-up covers a whole 16-step K = 1 run)."""
    part: str | None = None
    """Name of this part of a study (``main``, ``ksweep``, ``ablation``, ``stability``),
    recorded in each run's ``study.json`` and the raw-data file. None: `out_dir`'s name."""
    workers: int = 2
    """Runs in parallel (one torch thread each)."""
    out_dir: str = "runs/compare"
    """The comparison's folder: one sub-folder per run, plus the table and plots."""
    quick: bool = False
    """A small size, 9 runs of 8 steps (no tuning: `QUICK_LRS`): 3.5-12.5 min on 2 cores (3 min
    38 s and 12 min 22 s measured, the second with other jobs loading the machine)."""
    train: list[str] = field(default_factory=list)
    """``key=value`` overrides for every run's TrainConfig (e.g. ``steps=40``)."""

    def __post_init__(self) -> None:
        checks = [
            ("seeds", len(self.seeds) >= 1 and len(set(self.seeds)) == len(self.seeds),
             "must be distinct, >= 1 of them"),
            ("tune_seeds", not set(self.tune_seeds) & set(self.seeds),
             f"must be disjoint from seeds (shared: {sorted(set(self.tune_seeds) & set(self.seeds))})"),
            ("tune_seeds", len(self.tune_seeds) >= 1 or not self.tune_lrs, "must hold >= 1 seed when tune_lrs is set"),
            ("tune_lrs", all(lr > 0 for lr in self.tune_lrs), "must all be > 0"),
            ("learning_rates", all(v > 0 for v in self.learning_rates.values()), "must all be > 0"),
            ("lr_scale", self.lr_scale > 0, "must be > 0"),
            ("tune_tie", self.tune_tie >= 0, "must be >= 0"),
            ("final_evals", self.final_evals >= 1, "must be >= 1"),
            ("lr_from", all(a in self.arms for a in self.lr_from),
             f"names arms that are not compared: {sorted(set(self.lr_from) - set(self.arms))}"),
            ("lr_from", not _has_cycle(self.lr_from), "has a cycle (an arm takes its rate from itself)"),
            ("minibatch_prompts", self.minibatch_prompts is None or self.minibatch_prompts >= 1,
             "must be >= 1 or None"),
            ("warmup_fraction", self.warmup_fraction is None or 0 < self.warmup_fraction <= 1,
             "must be in (0, 1] or None"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}")
        resolve_arms(self.arms, self.arm_defs)  # unknown / repeated / unusable names


def _has_cycle(links: dict[str, str]) -> bool:
    for start in links:
        seen, arm = {start}, links[start]
        while arm in links:
            if arm in seen:
                return True
            seen.add(arm)
            arm = links[arm]
        if arm == start:
            return True
    return False


# Keys of the comparison before arms (2026-12-01), with what replaced them.
RENAMED = {"algorithms": "arms (named arms: the presets and more)", "tune_seed": "tune_seeds (a list)"}

# Every comparison run: short, evaluated often (steps-to-target needs a fine grid).
COMPARE_OVERRIDES = ["steps=16", "prompts_per_step=16", "eval.every=2", "num_eval_prompts=100", "eval.num_samples=4"]
QUICK_OVERRIDES = ["steps=8", "eval.every=4", "num_eval_prompts=50"]
# The learning rates the full comparison's tuning picked (studies/results.md); --quick uses them.
QUICK_LRS: dict[str, float] = {"grpo": 1e-4, "dapo": 1e-4, "cispo": 1e-4}


@dataclass(frozen=True)
class Run:
    """One training run of a comparison and what ``study.json`` records about it."""

    config: TrainConfig
    arm: str
    role: Literal["eval", "tune"]
    part: str
    spec: str = ""  # the arm in words (`arms.describe`)

    @property
    def dir(self) -> Path:
        return Path(self.config.out_dir) / self.config.run_name

    def meta(self) -> dict[str, Any]:
        c = self.config
        return {"part": self.part, "role": self.role, "arm": self.arm, "spec": self.spec,
                "objective": c.algo.objective.name, "objective_overrides": c.algo.objective.overrides(),
                "task": c.data.task,
                "K": c.algo.updates_per_batch, "seed": c.seed, "lr": c.optim.lr,
                "prompts_per_step": c.rollout.prompts_per_step, "group_size": c.rollout.group_size,
                "warmup_updates": c.optim.warmup_updates, "steps": c.steps}


def part_name(cfg: CompareConfig) -> str:
    return cfg.part or Path(cfg.out_dir).name


def base_k(cfg: CompareConfig) -> int:
    """K of the comparison's runs (``algo.updates_per_batch`` after `train`; default 16)."""
    return base_config(cfg).algo.updates_per_batch


def base_config(cfg: CompareConfig, arm: ArmConfig | None = None, k: int | None = None) -> TrainConfig:
    """The TrainConfig every run of `arm` at `k` starts from: the comparison's overrides, the
    arm's, K, then the fairness options (`minibatch_prompts`, `warmup_fraction`)."""
    overrides = (COMPARE_OVERRIDES + (QUICK_OVERRIDES if cfg.quick else []) + list(cfg.train)
                 + (list(arm.train) if arm else []) + ([f"algo.updates_per_batch={k}"] if k else []))
    c = apply_overrides(TrainConfig(), overrides)
    k = c.algo.updates_per_batch
    fair = []
    if cfg.minibatch_prompts is not None:
        fair.append(f"rollout.prompts_per_step={k * cfg.minibatch_prompts}")
    if cfg.warmup_fraction is not None:
        total = c.steps * k * c.algo.epochs  # optimizer updates over the run
        fair.append(f"optim.warmup_updates={warmup_updates(c.optim.warmup_updates, cfg.warmup_fraction, total)}")
    return apply_overrides(c, fair)


def warmup_updates(cap: int, fraction: float, total_updates: int) -> int:
    """min(cap, ceil(fraction * total_updates)): the warm-up of `warmup_fraction`."""
    return min(cap, math.ceil(fraction * total_updates - 1e-9))


def one_run(base: TrainConfig, arm_name: str, arm: ArmConfig, seed: int, lr: float | None, role: str, part: str,
            prefix: str = "") -> Run:
    """The run of `arm` with `seed` (and `lr`, if given), named ``{prefix}{arm}__{task}__K{K}__seed{seed}``."""
    c = replace(base, seed=seed, threads=1, progress=False,
                run_name=f"{prefix}{arm_name}__{base.data.task}__K{base.algo.updates_per_batch}__seed{seed}",
                algo=replace(base.algo, objective=ObjectiveSection(arm.objective, **arm.objective_overrides)))
    c = c if lr is None else replace(c, optim=replace(c.optim, lr=lr))
    return Run(c, arm_name, role, part, describe(arm))


def lr_for(cfg: CompareConfig, arm: str, k: int) -> float | None:
    """The fixed or tuned learning rate of `arm` at `k` (``ARM@K`` before ``ARM``), else that of
    the arm it takes its rate from (`lr_from`), or None."""
    own = cfg.learning_rates.get(f"{arm}@{k}", cfg.learning_rates.get(arm))
    return lr_for(cfg, cfg.lr_from[arm], k) if own is None and arm in cfg.lr_from else own


def run_configs(cfg: CompareConfig, k: int | None = None) -> list[Run]:
    """One evaluation run per (arm, seed) at `k` (None: the comparison's K), in ``cfg.out_dir``,
    seed by seed (every arm of seed 0, then of seed 1, ...): a part stopped early holds whole
    seeds, so every arm it ran is paired by seed."""
    arms, out = resolve_arms(cfg.arms, cfg.arm_defs), []
    for name, arm in arms.items():
        base = replace(base_config(cfg, arm, k), out_dir=cfg.out_dir)
        lr = lr_for(cfg, name, base.algo.updates_per_batch)
        if lr is None and name in cfg.lr_from:
            raise ConfigError(f"lr_from: {name} takes the rate of {cfg.lr_from[name]} at K = "
                              f"{base.algo.updates_per_batch}, which has none (tune it in this comparison, or give "
                              "learning_rates / tuning_from)")
        lr = (lr if lr is not None else base.optim.lr) * cfg.lr_scale
        out += [one_run(base, name, arm, seed, lr, "eval", part_name(cfg)) for seed in cfg.seeds]
    return sorted(out, key=lambda r: cfg.seeds.index(r.config.seed))  # stable: arms keep their order


def tuning_configs(cfg: CompareConfig, k: int | None = None, lrs: list[float] | None = None,
                   only: list[str] | None = None) -> dict[tuple[str, float, int], Run]:
    """(arm, lr, tuning seed) -> its tuning run at `k` over `lrs` (None: the grid), for every
    arm (of `only`, if given) without a fixed rate there and not in `lr_from`."""
    if cfg.quick or not cfg.tune_lrs:
        return {}
    out = {}
    for name, arm in resolve_arms(cfg.arms, cfg.arm_defs).items():
        base = replace(base_config(cfg, arm, k), out_dir=cfg.out_dir)
        if lr_for(cfg, name, base.algo.updates_per_batch) is not None or name in cfg.lr_from or (
                only is not None and name not in only):
            continue
        for lr in lrs or cfg.tune_lrs:
            for seed in cfg.tune_seeds:
                out[(name, lr, seed)] = one_run(base, name, arm, seed, lr, "tune", part_name(cfg),
                                                prefix=f"tune_lr{lr:g}__")
    return out


def tuning_score(rows: list[dict], score: str = "mean_accuracy", final_evals: int = 1) -> float:
    """The tuning score of one run (`CompareConfig.tune_score`) from its metrics rows."""
    acc = curve(rows, "eval/accuracy")
    return mean_accuracy(acc) if score == "mean_accuracy" else final_accuracy(acc, final_evals)


def beyond_edge(lr: float, grid) -> float:
    """The rate one step (×/÷ √10) past the edge `lr` of `grid`, to 3 significant digits."""
    return float(f"{lr / math.sqrt(10) if lr == min(grid) else lr * math.sqrt(10):.3g}")


def load_tuning(folder: str | Path) -> dict[str, float]:
    """The chosen rates (``ARM@K`` / ``ARM`` -> lr) of a comparison's ``tuning.json``."""
    path = Path(folder) / "tuning.json"
    try:
        return {k: float(v) for k, v in json.loads(path.read_text())["chosen"].items()}
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"tuning_from: cannot read the chosen rates from {path}: {e}") from None


def tune(cfg: CompareConfig, ks: list[int] | None = None) -> CompareConfig:
    """Run the tuning grid at every K of `ks` (None: the comparison's K) — resumable — and
    return `cfg` with each arm's chosen rate as ``learning_rates["ARM@K"]``; writes
    ``tuning.md`` / ``tuning.json`` (every tuned K, merged with an earlier file's)."""
    cfg = with_tuning_from(cfg)
    if cfg.quick:
        return replace(cfg, learning_rates={**QUICK_LRS, **cfg.learning_rates})
    out = Path(cfg.out_dir)
    previous = json.loads((out / "tuning.json").read_text()) if (out / "tuning.json").exists() else {}
    scores: dict[str, float] = dict(previous.get("scores", {}))  # "ARM@K@LR" -> mean over tuning seeds
    chosen = dict(cfg.learning_rates)
    for k in ks or [base_k(cfg)]:
        runs = tuning_configs(cfg, k)
        if not runs:
            continue
        if cfg.tuning_from:
            print(f"cispo: tuning {', '.join(sorted({a for a, _, _ in runs}))} at K = {k} here: "
                  f"{cfg.tuning_from}/tuning.json has no rate for them", file=sys.stderr)
        run_all(list(runs.values()), cfg.workers)
        per_arm = {arm: _scores(cfg, runs, arm, cfg.tune_lrs) for arm in dict.fromkeys(a for a, _, _ in runs)}
        if cfg.tune_extend:  # bracketing: one more rate past an edge choice, once
            extra = {}
            for arm, per_lr in per_arm.items():
                if at_edge(best := pick_lr(per_lr, cfg.tune_tie), per_lr):
                    extra.update(tuning_configs(cfg, k, [beyond_edge(best, per_lr)], [arm]))
            run_all(list(extra.values()), cfg.workers)
            for arm in dict.fromkeys(a for a, _, _ in extra):
                per_arm[arm].update(_scores(cfg, extra, arm, [lr for a, lr, _ in extra if a == arm][:1]))
        for arm, per_lr in per_arm.items():
            scores.update({f"{arm}@{k}@{lr:g}": v for lr, v in per_lr.items()})
            chosen[f"{arm}@{k}"] = pick_lr(per_lr, cfg.tune_tie)
    if scores:
        out.mkdir(parents=True, exist_ok=True)
        record = {"score": cfg.tune_score, "seeds": cfg.tune_seeds, "scores": scores,
                  "chosen": {**previous.get("chosen", {}), **chosen}}
        (out / "tuning.json").write_text(json.dumps(record, indent=1))
        (out / "tuning.md").write_text(format_tuning(scores, cfg) + "\n")
    return replace(cfg, learning_rates=chosen)


def with_tuning_from(cfg: CompareConfig) -> CompareConfig:
    """`cfg` with the chosen rates of `tuning_from` in `learning_rates` (an explicit ``ARM``
    replaces every loaded ``ARM@K``, an explicit ``ARM@K`` just its own)."""
    if not cfg.tuning_from:
        return cfg
    loaded = {k: v for k, v in load_tuning(cfg.tuning_from).items() if k.split("@")[0] not in cfg.learning_rates}
    return replace(cfg, learning_rates={**loaded, **cfg.learning_rates})


def _scores(cfg: CompareConfig, runs: dict[tuple[str, float, int], Run], arm: str,
            lrs: list[float]) -> dict[float, float]:
    """lr -> the arm's tuning score at that rate, mean over the tuning seeds."""
    return {lr: nan_mean(tuning_score(read_metrics(runs[(arm, lr, s)].dir / "metrics.jsonl"), cfg.tune_score,
                                      cfg.final_evals) for s in cfg.tune_seeds) for lr in lrs}


def format_tuning(scores: dict[str, float], cfg: CompareConfig) -> str:
    """Markdown: one row per (arm, K), one column per rate, the choice and an edge flag."""
    keys = [k.rsplit("@", 1) for k in scores]
    lrs = sorted({float(lr) for _, lr in keys})
    rows = list(dict.fromkeys(ak for ak, _ in keys))
    lines = ["| arm | K | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen | at grid edge |",
             "|---|---|" + "---|" * (len(lrs) + 2)]
    for ak in rows:
        arm, k = ak.rsplit("@", 1)
        per = {lr: scores.get(f"{ak}@{lr:g}") for lr in lrs}
        got = {lr: v for lr, v in per.items() if v is not None}
        best = pick_lr(got, cfg.tune_tie)
        edge = "yes" if at_edge(best, got) else "no"
        lines.append(f"| {arm} | {k} | " + " | ".join("n/a" if v is None else f"{v:.3f}" for v in per.values())
                     + f" | {best:g} | {edge} |")
    what = "mean held-out accuracy over the evaluations after step 0" if cfg.tune_score == "mean_accuracy" \
        else "final held-out accuracy"
    lines += ["", f"Score: {what}, mean over tuning seeds {cfg.tune_seeds} (one run per seed and cell); the highest "
              f"wins, scores within {cfg.tune_tie:g} of it tie and a tie goes to the smallest rate. \"At grid edge\": "
              "the optimum may lie outside the grid"
              + (" (already extended once past an edge choice)." if cfg.tune_extend else ".")]
    return "\n".join(lines)


def base_model_id(c: TrainConfig) -> str:
    """``builtin:<first 12 hex of the sha256 of its SHA256SUMS>`` for the built-in base model
    (which weights the run started from), else ``model.path``."""
    if c.model.path is not None:
        return str(c.model.path)
    from cispo.models.builtin import ensure_builtin_model
    from cispo.models.cache import CHECKSUMS, file_sha256

    return "builtin:" + file_sha256(ensure_builtin_model(c.data.task, progress=False) / CHECKSUMS)[:12]


def _run_one(run: Run) -> str:
    """Train (or resume) `run`; then write ``study.json``: its meta, the base model it started
    from and the wall time of this call (a run resumed after an interruption counts only the
    part that finished it)."""
    from cispo.training.runner import train

    started = time.perf_counter()
    train(run.config, resume=run.dir.exists())
    wall = time.perf_counter() - started
    (run.dir / "study.json").write_text(json.dumps({**run.meta(), "base_model": base_model_id(run.config),
                                                    "wall_s": round(wall, 2)}, indent=1))
    return f"{run.config.run_name}: {wall:.0f} s"


def run_all(runs: list[Run], workers: int) -> None:
    """Train every unfinished run, ``workers`` at a time (resuming half-finished ones)."""
    todo = [r for r in runs if not is_finished(r.dir)]
    print(f"cispo: {len(runs) - len(todo)} of {len(runs)} runs already finished", file=sys.stderr)
    for r in runs:  # finished before study.json existed (or lost it): its labels, wall time unknown
        if r not in todo and not (r.dir / "study.json").exists():
            (r.dir / "study.json").write_text(json.dumps({**r.meta(), "wall_s": None}, indent=1))
    if not todo:
        return
    from cispo.models.builtin import ensure_builtin_model

    if todo[0].config.model.path is None:  # a given model (a folder, builtin:<name>) is not built here
        ensure_builtin_model(todo[0].config.data.task)  # once, before the workers race for it
    if workers <= 1:
        for r in todo:
            print("cispo:", _run_one(r), file=sys.stderr)
        return
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        for msg in pool.map(_run_one, todo):
            print("cispo:", msg, file=sys.stderr)


def load_runs(runs: list[Run]) -> dict[str, list[list[dict]]]:
    """arm -> list (over seeds, in `runs` order) of metrics rows."""
    out: dict[str, list[list[dict]]] = {}
    for r in runs:
        out.setdefault(r.arm, []).append(read_metrics(r.dir / "metrics.jsonl"))
    return out


def compare(cfg: CompareConfig) -> dict:
    """Run (or resume) the comparison and write ``table.md``, ``table.json``, ``comparison.png``."""
    started = time.perf_counter()
    cfg = tune(cfg)
    configs = run_configs(cfg)
    run_all(configs, cfg.workers)
    runs = load_runs(configs)
    table = analyse(runs, cfg.reference, cfg.final_evals)
    table["learning_rates"] = {r.arm: r.config.optim.lr for r in configs}
    out = Path(cfg.out_dir)
    (out / "table.json").write_text(json.dumps(table, indent=1))
    (out / "table.md").write_text(format_table(table) + "\n")
    plot_comparison(runs, out / "comparison.png", f"{', '.join(cfg.arms)} — {len(cfg.seeds)} seeds")
    table["wall_s"] = time.perf_counter() - started
    return table


# ---------------------------------------------------------------------------------------
# K sweep
# ---------------------------------------------------------------------------------------


@dataclass
class SweepConfig(CompareConfig):
    """The comparison repeated for each number of off-policy updates K."""

    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    """Values of K (``algo.updates_per_batch``)."""
    out_dir: str = "runs/sweep"
    """The sweep's folder."""
    tune_per_k: bool = False
    """Tune every arm's learning rate at each K (the grid, seeds and score of the comparison;
    ``ARM@K`` in ``tuning.json``). False: tune once, at the K of `train` (default 16), and use
    that rate at every K (the 2026-11-30 sweep)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.ks or any(k < 1 for k in self.ks) or len(set(self.ks)) != len(self.ks):
            raise ValueError(f"ks must be distinct values >= 1, got {self.ks}")


def sweep(cfg: SweepConfig) -> dict:
    """For each K: the comparison; then the gaps of the `contrast` arm (CISPO) to the others vs K."""
    if cfg.tune_per_k:
        cfg = tune(cfg, list(cfg.ks))
    else:  # once, at the K of `train` (default 16); the same rates for every K
        k0 = base_k(cfg)
        cfg = tune(cfg, [k0])
        once = {key.rsplit("@", 1)[0]: v for key, v in cfg.learning_rates.items() if key.endswith(f"@{k0}")}
        cfg = replace(cfg, learning_rates={**once, **cfg.learning_rates})
    per_k = {}
    for k in cfg.ks:
        configs = run_configs(cfg, k)
        run_all(configs, cfg.workers)
        per_k[k] = load_runs(configs)
    gaps = sweep_gaps(per_k, cfg.reference, cfg.contrast, cfg.final_evals)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(gaps, indent=1))
    (out / "sweep.md").write_text(format_sweep(gaps) + "\n")
    plot_sweep(gaps, out / "sweep.png")
    return gaps


