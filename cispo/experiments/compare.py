"""The paper's controlled comparison in miniature (MiniMax-M1 Figure 2), and a K sweep.

``compare``: GRPO, DAPO and CISPO (GSPO and REINFORCE selectable) trained from the same
base model on the same prompts with the same compute, over several seeds. Reports
held-out accuracy vs step (mean +- 95% band), *steps-to-target* — the first step at which
an algorithm reaches DAPO's final accuracy (the paper's "50% of the steps" measure) — and
the mechanism: fork-token rate, the fraction of fork tokens a PPO mask drops, the fraction
of capped IS weights, and entropy.

``sweep``: the same over the number of off-policy updates K, reporting the CISPO − DAPO
and CISPO − GRPO gaps (the paper used K = 16 only).

Every run is an ordinary ``cispo train`` run folder; a half-finished comparison resumes
its unfinished runs and skips the finished ones.
"""

from __future__ import annotations

import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cispo.config import TrainConfig, apply_overrides
from cispo.tracking import read_metrics

# Two-sided 95% Student-t quantiles for n - 1 degrees of freedom (n seeds).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


@dataclass
class CompareConfig:
    """A controlled comparison: same base model, prompts and compute for every algorithm."""

    algorithms: list[str] = field(default_factory=lambda: ["grpo", "dapo", "cispo"])
    """Objective presets to compare."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds per algorithm (sampling, shuffling, prompt order)."""
    reference: str = "dapo"
    """Algorithm whose final accuracy is the steps-to-target target."""
    learning_rates: dict[str, float] = field(default_factory=dict)
    """Per-algorithm learning rate; an algorithm listed here is not tuned."""
    tune_lrs: list[float] = field(default_factory=lambda: [3e-5, 1e-4, 3e-4])
    """Learning rates tried for every algorithm not in `learning_rates` — the same tuning
    budget for each — on `tune_seed`; the one with the highest mean held-out accuracy over
    the evaluations after step 0 (area under the curve) is used. Empty: ``optim.lr``."""
    tune_seed: int = 100
    """Seed of the tuning runs (kept apart from `seeds`, so the reported runs are not the
    ones the learning rate was picked on)."""
    workers: int = 2
    """Runs in parallel (one torch thread each)."""
    out_dir: str = "runs/compare"
    """The comparison's folder: one sub-folder per run, plus the table and plots."""
    quick: bool = False
    """A small size that finishes in <= 10 minutes on 2 cores (no tuning: `QUICK_LRS`)."""
    train: list[str] = field(default_factory=list)
    """``key=value`` overrides for every run's TrainConfig (e.g. ``steps=40``)."""


# Every comparison run: short, evaluated often (steps-to-target needs a fine grid).
COMPARE_OVERRIDES = ["steps=16", "prompts_per_step=16", "eval.every=2", "num_eval_prompts=100", "eval.num_samples=4"]
QUICK_OVERRIDES = ["steps=8", "eval.every=4", "num_eval_prompts=50"]
# The learning rates the full comparison's tuning picked (docs/results.md); --quick uses them.
QUICK_LRS: dict[str, float] = {"grpo": 1e-4, "dapo": 1e-4, "cispo": 1e-4}


def base_config(cfg: CompareConfig, extra: list[str] = ()) -> TrainConfig:
    """The TrainConfig every run of the comparison starts from."""
    overrides = COMPARE_OVERRIDES + (QUICK_OVERRIDES if cfg.quick else []) + list(cfg.train) + list(extra)
    return apply_overrides(TrainConfig(), overrides)


def one_run(base: TrainConfig, algo: str, seed: int, out_dir: str, lr: float | None = None,
            prefix: str = "") -> TrainConfig:
    """The run of `algo` with `seed` (and `lr`, if given) in `out_dir`."""
    c = replace(base, seed=seed, out_dir=out_dir, threads=1, progress=False,
                run_name=f"{prefix}{algo}__{base.data.task}__K{base.algo.updates_per_batch}__seed{seed}",
                algo=replace(base.algo, objective=algo))
    return c if lr is None else replace(c, optim=replace(c.optim, lr=lr))


def run_configs(cfg: CompareConfig, extra: list[str] = ()) -> list[TrainConfig]:
    """One TrainConfig per (algorithm, seed), all in ``cfg.out_dir``."""
    base = base_config(cfg, extra)
    return [one_run(base, algo, seed, cfg.out_dir, cfg.learning_rates.get(algo))
            for algo in cfg.algorithms for seed in cfg.seeds]


def tuning_configs(cfg: CompareConfig) -> dict[tuple[str, float], TrainConfig]:
    """(algorithm, lr) -> its tuning run, for every algorithm without a fixed learning rate."""
    if cfg.quick or not cfg.tune_lrs:
        return {}
    base = base_config(cfg)
    return {(algo, lr): one_run(base, algo, cfg.tune_seed, cfg.out_dir, lr, prefix=f"tune_lr{lr:g}__")
            for algo in cfg.algorithms if algo not in cfg.learning_rates for lr in cfg.tune_lrs}


def tuning_score(rows: list[dict]) -> float:
    """Mean held-out accuracy over the evaluations after step 0 (area under the curve)."""
    return _mean(v for s, v in curve(rows, "eval/accuracy").items() if s > 0)


def tune(cfg: CompareConfig) -> CompareConfig:
    """Run the tuning grid (resumable) and return `cfg` with every algorithm's chosen
    learning rate in `learning_rates`; writes ``tuning.md`` / ``tuning.json``."""
    runs = tuning_configs(cfg)
    if not runs:
        lrs = {**QUICK_LRS, **cfg.learning_rates} if cfg.quick else dict(cfg.learning_rates)
        return replace(cfg, learning_rates=lrs)
    run_all(list(runs.values()), cfg.workers)
    scores = {key: tuning_score(read_metrics(Path(c.out_dir) / c.run_name / "metrics.jsonl")) for key, c in runs.items()}
    chosen = dict(cfg.learning_rates)
    for algo in {a for a, _ in scores}:
        chosen[algo] = max((lr for a, lr in scores if a == algo), key=lambda lr: scores[(algo, lr)])
    lines = ["| algorithm | " + " | ".join(f"lr {lr:g}" for lr in cfg.tune_lrs) + " | chosen |",
             "|---|" + "---|" * (len(cfg.tune_lrs) + 1)]
    for algo in cfg.algorithms:
        if any(a == algo for a, _ in scores):
            lines.append(f"| {algo} | " + " | ".join(f"{scores[(algo, lr)]:.3f}" for lr in cfg.tune_lrs)
                         + f" | {chosen[algo]:g} |")
    lines += ["", f"Mean held-out accuracy over the evaluations after step 0, seed {cfg.tune_seed} (one run per cell)."]
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuning.md").write_text("\n".join(lines) + "\n")
    (out / "tuning.json").write_text(json.dumps({f"{a}@{lr:g}": v for (a, lr), v in scores.items()}
                                                | {"chosen": chosen}, indent=1))
    return replace(cfg, learning_rates=chosen)


def _is_finished(c: TrainConfig) -> bool:
    return (Path(c.out_dir) / c.run_name / "summary.json").exists()


def _run_one(c: TrainConfig) -> str:
    from cispo.runner import train

    run_dir = Path(c.out_dir) / c.run_name
    started = time.perf_counter()
    train(c, resume=run_dir.exists())
    return f"{c.run_name}: {time.perf_counter() - started:.0f} s"


def run_all(configs: list[TrainConfig], workers: int) -> None:
    """Train every unfinished run, ``workers`` at a time (resuming half-finished ones)."""
    todo = [c for c in configs if not _is_finished(c)]
    print(f"cispo: {len(configs) - len(todo)} of {len(configs)} runs already finished", file=sys.stderr)
    if not todo:
        return
    from cispo.builtin_model import ensure_builtin_model

    ensure_builtin_model(todo[0].data.task)  # once, before the workers race for it
    if workers <= 1:
        for c in todo:
            print("cispo:", _run_one(c), file=sys.stderr)
        return
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        for msg in pool.map(_run_one, todo):
            print("cispo:", msg, file=sys.stderr)


# ---------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------


def mean_band(values: list[float]) -> tuple[float, float, float]:
    """(mean, std, half-width of the 95% t-interval) of ``values``."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0, 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, std, _T95.get(n - 1, 1.96) * std / math.sqrt(n)


def curve(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if r.get(key) is not None}


def steps_to_target(acc_curve: dict[int, float], target: float) -> int | None:
    """First evaluated step whose held-out accuracy is >= target (None: never)."""
    for step in sorted(acc_curve):
        if step > 0 and acc_curve[step] >= target:
            return step
    return None


def load_runs(configs: list[TrainConfig]) -> dict[str, list[list[dict]]]:
    """algorithm -> list (over seeds) of metrics rows."""
    runs: dict[str, list[list[dict]]] = {}
    for c in configs:
        rows = read_metrics(Path(c.out_dir) / c.run_name / "metrics.jsonl")
        runs.setdefault(c.algo.objective, []).append(rows)
    return runs


def analyse(runs: dict[str, list[list[dict]]], reference: str) -> dict[str, Any]:
    """The comparison table: final accuracy, steps-to-target, mechanism metrics."""
    final = {a: [curve(rows, "eval/accuracy")[max(curve(rows, "eval/accuracy"))] for rows in rs] for a, rs in runs.items()}
    target = mean_band(final[reference])[0] if reference in final else None
    table = {"target": target, "reference": reference, "algorithms": {}}
    for algo, rs in runs.items():
        reached = [steps_to_target(curve(rows, "eval/accuracy"), target) for rows in rs] if target is not None else []
        reached90 = [steps_to_target(curve(rows, "eval/accuracy"), 0.9 * target) for rows in rs] if target is not None else []
        hit = [s for s in reached if s is not None]
        mean_of = lambda key: mean_band([_mean(curve(rows, key).values()) for rows in rs])  # noqa: E731
        table["algorithms"][algo] = {
            "seeds": len(rs),
            "final_accuracy": mean_band(final[algo]),
            "initial_accuracy": mean_band([curve(rows, "eval/accuracy")[0] for rows in rs]),
            "steps_to_target": mean_band(hit) if hit else None,
            "reached_target": f"{len(hit)}/{len(rs)}",
            # the target itself sits at the plateau, where one evaluation's noise decides
            # whether a run "reaches" it; 90% of it measures the climb
            "steps_to_90": mean_band(hit90) if (hit90 := [s for s in reached90 if s is not None]) else None,
            "reached_90": f"{len(hit90)}/{len(rs)}",
            "mean_accuracy": mean_band([tuning_score(rows) for rows in rs]),
            "final_fork_rate": mean_band([_last(curve(rows, "eval/fork_rate")) for rows in rs]),
            "frac_ppo_dropped_fork": mean_of("objective/frac_ppo_dropped_fork"),
            "frac_capped": mean_of("objective/frac_capped"),
            "entropy": mean_of("objective/entropy"),
        }
    return table


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def _last(c: dict[int, float]) -> float:
    return c[max(c)] if c else float("nan")


def _fmt_lr(lr) -> str:
    return "n/a" if lr is None else f"{lr:g}"


def format_table(table: dict) -> str:
    """Markdown."""
    fmt = lambda mb, p=3: "n/a" if mb is None else f"{mb[0]:.{p}f} ± {mb[1]:.{p}f}"  # noqa: E731
    lines = [
        f"Target: {table['reference']}'s final held-out accuracy = "
        + ("n/a" if table["target"] is None else f"{table['target']:.3f}"),
        "",
        "| algorithm | lr | seeds | held-out acc. start | final | mean over training | steps to target | reached "
        "| steps to 90% of target | reached | final fork rate | PPO-dropped fork tokens | IS weight capped | entropy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for algo, row in table["algorithms"].items():
        lines.append(
            f"| {algo} | {_fmt_lr(table.get('learning_rates', {}).get(algo))} | {row['seeds']} | {fmt(row['initial_accuracy'])} | {fmt(row['final_accuracy'])} "
            f"| {fmt(row.get('mean_accuracy'))} | {fmt(row['steps_to_target'], 1)} | {row['reached_target']} "
            f"| {fmt(row.get('steps_to_90'), 1)} | {row.get('reached_90', 'n/a')} | {fmt(row['final_fork_rate'])} "
            f"| {fmt(row['frac_ppo_dropped_fork'])} | {fmt(row['frac_capped'])} | {fmt(row['entropy'])} |"
        )
    lines.append("")
    lines.append("mean ± std over seeds; steps averaged over the seeds that reached the level; mean over training: "
                 "held-out accuracy averaged over the evaluations after step 0 (area under the curve).")
    return "\n".join(lines)


PLOTS = [
    ("eval/accuracy", "held-out accuracy (mean@k)"),
    ("rollout/fork_rate", "fork-token rate (training samples)"),
    ("objective/frac_ppo_dropped_fork", "fork tokens a PPO mask drops"),
    ("objective/frac_capped", "IS weights capped"),
    ("objective/entropy", "policy entropy"),
    ("rollout/accuracy", "training accuracy"),
]


def plot_comparison(runs: dict[str, list[list[dict]]], path: Path, title: str) -> Path:
    """Mean ± 95% band over seeds (clamped to [0, 1] for fractions), one curve per algorithm,
    one panel per metric."""
    import matplotlib.pyplot as plt

    from cispo.plotting import fill_band, save_figure, style_axis

    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (key, name) in zip(axes.flat, PLOTS):
        for algo, rs in runs.items():
            curves = [curve(rows, key) for rows in rs]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            stats = [mean_band([c[s] for c in curves]) for s in steps]
            m = [s[0] for s in stats]
            ax.plot(steps, m, label=algo)
            fill_band(ax, steps, [a - s[2] for a, s in zip(m, stats)], [a + s[2] for a, s in zip(m, stats)], key, alpha=0.2)
        style_axis(ax, name)
    return save_figure(fig, path, title)


def compare(cfg: CompareConfig) -> dict:
    """Run (or resume) the comparison and write ``table.md``, ``table.json``, ``comparison.png``."""
    started = time.perf_counter()
    cfg = tune(cfg)
    configs = run_configs(cfg)
    run_all(configs, cfg.workers)
    runs = load_runs(configs)
    table = analyse(runs, cfg.reference)
    table["learning_rates"] = {a: cfg.learning_rates.get(a, configs[0].optim.lr) for a in cfg.algorithms}
    out = Path(cfg.out_dir)
    (out / "table.json").write_text(json.dumps(table, indent=1))
    (out / "table.md").write_text(format_table(table) + "\n")
    plot_comparison(runs, out / "comparison.png", f"{', '.join(cfg.algorithms)} — {len(cfg.seeds)} seeds")
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


def sweep(cfg: SweepConfig) -> dict:
    """For each K: the comparison; then the CISPO − DAPO and CISPO − GRPO gaps vs K."""
    cfg = tune(cfg)  # once, at the K of `train` (default 16); the same rates for every K
    per_k = {}
    for k in cfg.ks:
        sub = replace(cfg, train=list(cfg.train) + [f"algo.updates_per_batch={k}"])
        configs = run_configs(sub)
        run_all(configs, cfg.workers)
        per_k[k] = load_runs(configs)
    gaps = sweep_gaps(per_k, cfg.reference)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(gaps, indent=1))
    (out / "sweep.md").write_text(format_sweep(gaps) + "\n")
    plot_sweep(gaps, out / "sweep.png")
    return gaps


def sweep_gaps(per_k: dict[int, dict[str, list[list[dict]]]], reference: str) -> dict:
    """Per K and baseline: CISPO − baseline in final accuracy (paired by seed) and in
    steps-to-target (target: the reference's final accuracy at that K; a run that never
    reaches it counts as its last step + one evaluation interval, a censored value)."""
    out = {}
    for k, runs in per_k.items():
        table = analyse(runs, reference)
        target = table["target"]
        row = {"target": target}
        for base in [a for a in runs if a != "cispo"]:
            if "cispo" not in runs:
                continue
            acc_gap = [_last(curve(c, "eval/accuracy")) - _last(curve(b, "eval/accuracy"))
                       for c, b in zip(runs["cispo"], runs[base])]
            stt_gap = [_censored_steps(c, target) - _censored_steps(b, target) for c, b in zip(runs["cispo"], runs[base])]
            auc_gap = [tuning_score(c) - tuning_score(b) for c, b in zip(runs["cispo"], runs[base])]
            row[base] = {"final_accuracy_gap": mean_band(acc_gap), "steps_to_target_gap": mean_band(stt_gap),
                         "mean_accuracy_gap": mean_band(auc_gap)}
        out[k] = row
    return out


def _censored_steps(rows: list[dict], target: float) -> float:
    c = curve(rows, "eval/accuracy")
    s = steps_to_target(c, target)
    if s is not None:
        return float(s)
    steps = sorted(c)
    return float(steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 1))


def format_sweep(gaps: dict) -> str:
    bases = sorted({b for row in gaps.values() for b in row if b != "target"})
    head = "| K | " + " | ".join(f"CISPO − {b.upper()} final acc. | CISPO − {b.upper()} mean acc. over training "
                                 f"| CISPO − {b.upper()} steps to target" for b in bases)
    lines = [head + " |", "|---|" + "---|---|---|" * len(bases)]
    for k, row in sorted(gaps.items()):
        cells = []
        for b in bases:
            g = row.get(b)
            if g is None:
                cells += ["n/a", "n/a", "n/a"]
                continue
            a, m, s = g["final_accuracy_gap"], g.get("mean_accuracy_gap"), g["steps_to_target_gap"]
            cells += [f"{a[0]:+.3f} ± {a[2]:.3f}", "n/a" if m is None else f"{m[0]:+.3f} ± {m[2]:.3f}",
                      f"{s[0]:+.1f} ± {s[2]:.1f}"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("mean ± 95% half-width over seeds (paired by seed); negative steps = CISPO reaches the target sooner.")
    return "\n".join(lines)


def plot_sweep(gaps: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(gaps)
    bases = sorted({b for row in gaps.values() for b in row if b != "target"})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for b in bases:
        for ax, key, name in ((axes[0], "final_accuracy_gap", "final held-out accuracy gap"),
                              (axes[1], "mean_accuracy_gap", "mean held-out accuracy over training, gap"),
                              (axes[2], "steps_to_target_gap", "steps-to-target gap")):
            pts = [(k, gaps[k][b][key]) for k in ks if b in gaps[k] and key in gaps[k][b]]
            if not pts:
                continue
            x = [p[0] for p in pts]
            m = [p[1][0] for p in pts]
            h = [p[1][2] for p in pts]
            ax.errorbar(x, m, yerr=h, marker="o", capsize=3, label=f"CISPO − {b.upper()}")
            ax.set_xscale("log", base=2)
            ax.axhline(0, color="k", lw=0.5)
            ax.set_xlabel("K (off-policy updates per generation batch)")
            ax.set_title(name, fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)

