"""Every table and figure of the study, regenerated from the raw-data CSV alone
(``cispo.experiments.study_data``; ``cispo study-report``), and the check that the numbers
quoted in docs/results.md are the ones this script prints.

Measures, per evaluation run (``role = eval``), on its held-out accuracy curve:

* **final accuracy** (last evaluation), **mean accuracy over training** (the evaluations
  after step 0);
* **steps to target**: target = the `reference` arm's (DAPO's) final accuracy, mean over its
  seeds, per (part, task, K); the first evaluated step at or above it; a run that never
  reaches it is censored at its last step + one evaluation interval (`stats.censored_steps`);
* **collapsed**: `stats.collapsed` (below half its peak from some point after the peak to the
  end; runs whose peak is <= `floor` never learned and are left out).

Statistics:

* arms are compared to the `contrast` arm (CISPO) **paired by seed** (the seeds both ran):
  mean difference, two-sided 95% t-interval, paired t-test p-value; **Holm's correction**
  over the family = every comparison of one measure within one part (all its tasks, K values
  and baselines); "significant" = Holm-adjusted p <= 0.05;
* **the "≤ 50% of the steps" criterion**: R = mean steps-to-target of the contrast arm /
  mean steps-to-target of the reference arm (censored values included), paired by seed, with
  Fieller's 95% interval (`stats.fieller_ratio`) and a Bonferroni one over the part's m
  ratios (level 1 − 0.05/m). *Yes*: the 95% interval's upper end <= 0.5; *no*: its lower end
  > 0.5; else *unclear*. Censoring at the run's end biases R towards 1 when the reference is
  censored more often (against the claim) and away from it when the contrast is;
* **collapse fraction** per arm: collapsed / runs that learned, with Wilson's 95% interval;
* **tuning** (``role = tune``): per (part, task, K, arm) and learning rate, the score
  (`tune_score`) averaged over tuning seeds; the chosen rate; whether it sits at the grid's edge;
* **compute**: wall hours per part (``wall_s``; a run without it counts the sum of its
  ``perf/step_s``, which leaves out evaluation time — the table says how many did).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from cispo.experiments.stats import (COLLAPSE_FLOOR, censored_steps, collapsed, fieller_ratio, final_accuracy, holm,
                                     mean_accuracy, mean_band, paired_t, wilson)
from cispo.experiments.study_data import METRICS, read_csv

MEASURES = ("mean_accuracy", "final_accuracy", "steps_to_target")


@dataclass
class RunData:
    """One run of the CSV: its run columns and its per-step metrics."""

    meta: dict[str, str]
    steps: dict[int, dict[str, float]] = field(default_factory=dict)

    def curve(self, key: str = "eval/accuracy") -> dict[int, float]:
        return {s: m[key] for s, m in sorted(self.steps.items()) if key in m}

    @property
    def wall_s(self) -> tuple[float, bool]:
        """(seconds, measured): ``wall_s``, or the sum of ``perf/step_s`` (measured = False)."""
        if self.meta.get("wall_s"):
            return float(self.meta["wall_s"]), True
        return sum(m.get("perf/step_s", 0.0) for m in self.steps.values()), False


def load_study(path: str | Path) -> list[RunData]:
    """The CSV's runs (keyed by part and run folder name), in file order."""
    runs: dict[tuple[str, str], RunData] = {}
    for i, row in enumerate(read_csv(path), start=2):
        key = (row["part"], row["run"])
        run = runs.setdefault(key, RunData({c: row[c] for c in row if c not in METRICS and c != "step"}))
        try:
            run.steps[int(row["step"])] = {m: float(row[m]) for m in METRICS if row.get(m)}
        except ValueError as e:
            raise ValueError(f"{path}:{i}: {e}") from None
    return list(runs.values())


Groups = dict[tuple[str, str, int], dict[str, dict[int, RunData]]]


def group_eval_runs(runs: list[RunData]) -> Groups:
    """(part, task, K) -> arm -> seed -> run, for the evaluation runs."""
    out: Groups = defaultdict(lambda: defaultdict(dict))
    for r in runs:
        if r.meta["role"] == "eval":
            out[(r.meta["part"], r.meta["task"], int(r.meta["K"]))][r.meta["arm"]][int(r.meta["seed"])] = r
    return out


def target_of(arms: dict[str, dict[int, RunData]], reference: str) -> float | None:
    """The reference arm's final held-out accuracy, mean over its seeds (None: not run)."""
    if reference not in arms:
        return None
    return mean_band([final_accuracy(r.curve()) for r in arms[reference].values()])[0]


def measure(run: RunData, name: str, target: float | None) -> float:
    c = run.curve()
    if name == "mean_accuracy":
        return mean_accuracy(c)
    if name == "final_accuracy":
        return final_accuracy(c)
    return censored_steps(c, target)[0] if target is not None else float("nan")


# --------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------


def _pm(mb: tuple[float, float, float], p: int = 3) -> str:
    return f"{mb[0]:.{p}f} ± {mb[2]:.{p}f}"


def _ci(lo: float, hi: float, p: int = 3) -> str:
    f = lambda v: "∞" if v == math.inf else "−∞" if v == -math.inf else f"{v:+.{p}f}"  # noqa: E731
    return f"[{f(lo)}, {f(hi)}]"


def _lrs(runs: dict[int, RunData]) -> str:
    return ", ".join(sorted({f"{float(r.meta['lr']):g}" for r in runs.values()}))


def summary_table(groups: Groups, part: str, reference: str, floor: float) -> str:
    lines = ["| task | K | arm | lr | seeds | final | mean over training | steps to target | reached | collapsed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (p, task, k), arms in sorted(groups.items()):
        if p != part:
            continue
        target = target_of(arms, reference)
        for arm, runs in arms.items():
            curves = [r.curve() for r in runs.values()]
            stt = [censored_steps(c, target) for c in curves] if target is not None else []
            flags = [f for f in (collapsed(c, floor) for c in curves) if f is not None]
            lines.append(f"| {task} | {k} | {arm} | {_lrs(runs)} | {len(runs)} | {_pm(mean_band([final_accuracy(c) for c in curves]))} "
                         f"| {_pm(mean_band([mean_accuracy(c) for c in curves]))} "
                         f"| {_pm(mean_band([s for s, _ in stt]), 1) if stt else 'n/a'} "
                         f"| {sum(hit for _, hit in stt)}/{len(stt)} | {sum(flags)}/{len(flags)} |")
    lines += ["", f"mean ± 95% t half-width over seeds. Steps to target: target = {reference}'s final held-out accuracy "
              "(mean over its seeds) at that task and K; a run that never reaches it counts as its last step + one "
              f"evaluation interval. Collapsed: of the runs whose peak passed {floor:g}."]
    return "\n".join(lines)


def comparisons(groups: Groups, part: str, reference: str, contrast: str) -> list[dict]:
    """Every paired comparison of the part: contrast − baseline per (task, K, baseline, measure),
    with Holm-adjusted p-values over each measure's family."""
    rows = []
    for (p, task, k), arms in sorted(groups.items()):
        if p != part or contrast not in arms:
            continue
        target = target_of(arms, reference)
        for base in (a for a in arms if a != contrast):
            seeds = sorted(set(arms[contrast]) & set(arms[base]))
            for name in MEASURES:
                diffs = [measure(arms[contrast][s], name, target) - measure(arms[base][s], name, target) for s in seeds]
                if len(diffs) >= 2 and all(d == d for d in diffs):
                    rows.append({"task": task, "K": k, "base": base, "measure": name, "t": paired_t(diffs)})
    for name in MEASURES:
        family = [r for r in rows if r["measure"] == name]
        for r, adj in zip(family, holm([r["t"].p for r in family])):
            r["holm_p"], r["family"] = adj, len(family)
    return rows


def comparisons_table(rows: list[dict], contrast: str) -> str:
    lines = [f"| task | K | measure | {contrast} − baseline | seeds | difference | 95% CI | p | Holm p | significant |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, p = r["t"], (1 if r["measure"] == "steps_to_target" else 3)
        lines.append(f"| {r['task']} | {r['K']} | {r['measure'].replace('_', ' ')} | {contrast} − {r['base']} | {t.n} "
                     f"| {t.mean:+.{p}f} | {_ci(t.lo, t.hi, p)} | {t.p:.3g} | {r['holm_p']:.3g} "
                     f"| {'yes' if r['holm_p'] <= 0.05 else 'no'} |")
    fam = {r["measure"]: r["family"] for r in rows}
    lines += ["", "Paired by seed; two-sided t-intervals and paired t-tests; Holm's correction over each measure's "
              "family within this part (" + ", ".join(f"{m.replace('_', ' ')}: {n}" for m, n in fam.items())
              + " comparisons); significant: Holm p <= 0.05."]
    return "\n".join(lines)


def ratio_rows(groups: Groups, part: str, reference: str, contrast: str) -> list[dict]:
    rows = []
    for (p, task, k), arms in sorted(groups.items()):
        if p != part or contrast not in arms or reference not in arms:
            continue
        target = target_of(arms, reference)
        seeds = sorted(set(arms[contrast]) & set(arms[reference]))
        if not seeds:
            continue
        c = [censored_steps(arms[contrast][s].curve(), target) for s in seeds]
        d = [censored_steps(arms[reference][s].curve(), target) for s in seeds]
        rows.append({"task": task, "K": k, "target": target, "n": len(seeds), "c": c, "d": d,
                     "ratio": fieller_ratio([s for s, _ in c], [s for s, _ in d])})
    for r in rows:
        r["bonferroni"] = fieller_ratio([s for s, _ in r["c"]], [s for s, _ in r["d"]], 1 - 0.05 / len(rows))
    return rows


def verdict(lo: float, hi: float) -> str:
    """The "≤ 50% of the steps" criterion on the ratio's interval."""
    return "yes" if hi <= 0.5 else "no" if lo > 0.5 else "unclear"


def ratio_table(rows: list[dict], reference: str, contrast: str) -> str:
    m = len(rows)
    lines = [f"| task | K | target | seeds | {contrast} steps (reached) | {reference} steps (reached) | ratio "
             f"| 95% CI | Bonferroni CI (m = {m}) | ≤ 50% of the steps |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        (rat, lo, hi), (_, blo, bhi) = r["ratio"], r["bonferroni"]
        cm, dm = (sum(s for s, _ in x) / len(x) for x in (r["c"], r["d"]))
        lines.append(f"| {r['task']} | {r['K']} | {r['target']:.3f} | {r['n']} | {cm:.1f} ({sum(h for _, h in r['c'])}/{r['n']}) "
                     f"| {dm:.1f} ({sum(h for _, h in r['d'])}/{r['n']}) | {rat:.2f} | {_ci(lo, hi, 2)} "
                     f"| {_ci(blo, bhi, 2)} | {verdict(lo, hi)} |")
    lines += ["", f"ratio = mean steps to target of {contrast} / of {reference} (target: {reference}'s final held-out "
              "accuracy, mean over seeds; censored runs count as their last step + one evaluation interval), paired by "
              "seed, Fieller's interval. ≤ 50%: yes if the 95% interval's upper end is <= 0.5, no if its lower end "
              "is > 0.5, else unclear."]
    return "\n".join(lines)


def collapse_table(groups: Groups, part: str, floor: float) -> str:
    lines = ["| task | K | arm | lr | runs that learned | collapsed | fraction | Wilson 95% CI | never learned |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (p, task, k), arms in sorted(groups.items()):
        if p != part:
            continue
        for arm, runs in arms.items():
            flags = [collapsed(r.curve(), floor) for r in runs.values()]
            learned = [f for f in flags if f is not None]
            lo, hi = wilson(sum(learned), len(learned))
            frac = f"{sum(learned) / len(learned):.2f}" if learned else "n/a"
            lines.append(f"| {task} | {k} | {arm} | {_lrs(runs)} | {len(learned)} | {sum(learned)} | {frac} "
                         f"| [{lo:.2f}, {hi:.2f}] | {len(flags) - len(learned)} |")
    lines += ["", f"Collapsed: held-out accuracy below half its peak from some evaluation after the peak to the last "
              f"one; \"never learned\": peak <= {floor:g} (left out of the fraction)."]
    return "\n".join(lines)


def tuning_table(runs: list[RunData], part: str, score: str) -> str | None:
    cells: dict[tuple[str, int, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r.meta["role"] == "tune" and r.meta["part"] == part:
            c = r.curve()
            cells[(r.meta["task"], int(r.meta["K"]), r.meta["arm"])][float(r.meta["lr"])].append(
                mean_accuracy(c) if score == "mean_accuracy" else final_accuracy(c))
    if not cells:
        return None
    lrs = sorted({lr for per in cells.values() for lr in per})
    lines = ["| task | K | arm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen | at grid edge |",
             "|---|---|---|" + "---|" * (len(lrs) + 2)]
    for (task, k, arm), per in sorted(cells.items()):
        mean = {lr: sum(v) / len(v) for lr, v in per.items()}
        best = max(sorted(mean), key=lambda lr: mean[lr])
        edge = "yes" if best in (min(mean), max(mean)) and len(mean) > 1 else "no"
        lines.append(f"| {task} | {k} | {arm} | " + " | ".join(f"{mean[lr]:.3f}" if lr in mean else "n/a" for lr in lrs)
                     + f" | {best:g} | {edge} |")
    lines += ["", f"Score: {score.replace('_', ' ')} (mean over the tuning seeds); the highest wins."]
    return "\n".join(lines)


def compute_table(runs: list[RunData]) -> tuple[str, dict[str, float]]:
    per: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in runs:
        s, measured = r.wall_s
        p = per[r.meta["part"]]
        p[f"{r.meta['role']}_runs"] += 1
        p[f"{r.meta['role']}_h"] += s / 3600
        p["unmeasured"] += not measured
    lines = ["| part | eval runs | tuning runs | eval hours | tuning hours | total hours | runs without wall_s |",
             "|---|---|---|---|---|---|---|"]
    hours = {}
    for part, p in sorted(per.items()):
        hours[part] = p["eval_h"] + p["tune_h"]
        lines.append(f"| {part} | {p['eval_runs']:.0f} | {p['tune_runs']:.0f} | {p['eval_h']:.2f} | {p['tune_h']:.2f} "
                     f"| {hours[part]:.2f} | {p['unmeasured']:.0f} |")
    lines.append(f"| total | | | | | {sum(hours.values()):.2f} | |")
    lines += ["", "Wall-clock hours of the runs (each run's `wall_s`; one without it counts its summed `perf/step_s`, "
              "evaluation time left out). Runs ran `workers` at a time, so elapsed time is shorter."]
    return "\n".join(lines), hours


# --------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------


def plot_curves(groups: Groups, part: str, path: Path) -> Path | None:
    """Held-out accuracy vs step, mean ± 95% band over seeds, one panel per (task, K)."""
    keys = sorted(k for k in groups if k[0] == part)
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cispo.plotting import fill_band, save_figure, style_axis

    cols = min(3, len(keys))
    fig, axes = plt.subplots(math.ceil(len(keys) / cols), cols, figsize=(5 * cols, 3.6 * math.ceil(len(keys) / cols)),
                             squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for arm, runs in groups[key].items():
            curves = [r.curve() for r in runs.values()]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            bands = [mean_band([c[s] for c in curves]) for s in steps]
            ax.plot(steps, [b[0] for b in bands], label=arm)
            fill_band(ax, steps, [b[0] - b[2] for b in bands], [b[0] + b[2] for b in bands], "eval/accuracy", alpha=0.2)
        style_axis(ax, f"{key[1]}, K = {key[2]}: held-out accuracy")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    return save_figure(fig, path, f"{part}: mean ± 95% band over seeds")


def plot_gaps(rows: list[dict], part: str, contrast: str, path: Path) -> Path | None:
    """contrast − baseline mean accuracy over training vs K, with 95% intervals (parts with > 1 K)."""
    rows = [r for r in rows if r["measure"] == "mean_accuracy"]
    if len({r["K"] for r in rows}) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for task, base in sorted({(r["task"], r["base"]) for r in rows}):
        pts = sorted((r["K"], r["t"]) for r in rows if (r["task"], r["base"]) == (task, base))
        ax.errorbar([k for k, _ in pts], [t.mean for _, t in pts], yerr=[t.half for _, t in pts], marker="o", capsize=3,
                    label=f"{task}: {contrast} − {base}")
    ax.set_xscale("log", base=2)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("K (off-policy updates per generation batch)")
    ax.set_title(f"{part}: mean held-out accuracy over training, paired gap (95% CI)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


# --------------------------------------------------------------------------------------
# The report and the doc check
# --------------------------------------------------------------------------------------


def report(csv_path: str | Path, out_dir: str | Path | None = None, reference: str = "dapo", contrast: str = "cispo",
           floor: float | None = None, tune_score: str = "mean_accuracy") -> dict[str, str]:
    """name -> text of every table (``summary/PART``, ``comparisons/PART``, ``ratio/PART``,
    ``collapse/PART``, ``tuning/PART``, ``compute``) and quoted number (``ratio/PART/TASK/K16``
    "0.52 [0.41, 0.66]", ``target/PART/TASK/K16``, ``hours/PART``, ``hours/total``). With
    `out_dir`: each table as ``NAME.md`` (``/`` -> ``_``), the numbers in ``numbers.json``, and
    the figures ``curves_PART.png`` / ``gaps_PART.png``. `floor` None: ``COLLAPSE_FLOOR``."""
    floor = COLLAPSE_FLOOR if floor is None else floor
    runs = load_study(csv_path)
    groups = group_eval_runs(runs)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    out: dict[str, str] = {}
    for part in sorted({r.meta["part"] for r in runs}):
        if any(k[0] == part for k in groups):
            out[f"summary/{part}"] = summary_table(groups, part, reference, floor)
            comp = comparisons(groups, part, reference, contrast)
            if comp:
                out[f"comparisons/{part}"] = comparisons_table(comp, contrast)
            rat = ratio_rows(groups, part, reference, contrast)
            if rat:
                out[f"ratio/{part}"] = ratio_table(rat, reference, contrast)
            for r in rat:
                (v, lo, hi), tag = r["ratio"], f"{part}/{r['task']}/K{r['K']}"
                out[f"ratio/{tag}"] = f"{v:.2f} {_ci(lo, hi, 2)}".replace("+", "")
                out[f"target/{tag}"] = f"{r['target']:.3f}"
            out[f"collapse/{part}"] = collapse_table(groups, part, floor)
            if out_dir is not None:
                plot_curves(groups, part, Path(out_dir) / f"curves_{part}.png")
                plot_gaps(comp, part, contrast, Path(out_dir) / f"gaps_{part}.png")
        tuning = tuning_table(runs, part, tune_score)
        if tuning:
            out[f"tuning/{part}"] = tuning
    out["compute"], hours = compute_table(runs)
    out.update({f"hours/{p}": f"{h:.2f}" for p, h in hours.items()})
    out["hours/total"] = f"{sum(hours.values()):.2f}"
    if out_dir is not None:
        d = Path(out_dir)
        for name, text in out.items():
            if "\n" in text:
                (d / (name.replace("/", "_") + ".md")).write_text(text + "\n")
        (d / "numbers.json").write_text(json.dumps({k: v for k, v in out.items() if "\n" not in v}, indent=1) + "\n")
    return out


MARKER = re.compile(r"<!-- study:(?P<name>\S+) -->(?P<body>.*?)<!-- /study:(?P=name) -->", re.S)
"""A quoted table or number in a doc: ``<!-- study:ratio/main/chain/K16 -->0.52 [0.41, 0.66]<!-- /study:ratio/main/chain/K16 -->``;
a table sits on its own lines between the two markers."""


def check_doc(text: str, outputs: dict[str, str], where: str = "doc") -> list[str]:
    """Every quoted block of `text` that differs from the report's output (or names no output),
    as ``where:line: name: ...``; [] when all agree. A doc with no marker has nothing to check."""
    problems = []
    for m in MARKER.finditer(text):
        line, name = text.count("\n", 0, m.start()) + 1, m["name"]
        if name not in outputs:
            problems.append(f"{where}:{line}: {name}: not an output of the report")
        elif m["body"].strip() != outputs[name].strip():
            problems.append(f"{where}:{line}: {name}: the doc says {m['body'].strip()[:200]!r}, the data give "
                            f"{outputs[name].strip()[:200]!r}")
    return problems


def update_doc(text: str, outputs: dict[str, str]) -> str:
    """`text` with every quoted block replaced by the report's output (unknown names kept)."""
    def fill(m: re.Match) -> str:
        if m["name"] not in outputs:
            return m[0]
        body = outputs[m["name"]].strip()
        body = f"\n{body}\n" if "\n" in body or m["body"].startswith("\n") else body
        return f"<!-- study:{m['name']} -->{body}<!-- /study:{m['name']} -->"

    return MARKER.sub(fill, text)
