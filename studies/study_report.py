"""Every table and figure of the study, regenerated from the raw-data CSV alone
(``studies.study_data``; ``python -m studies report``), and the check that the values
quoted in studies/results.md are the ones this script prints. The definitions are those of
studies/results/protocol.md (the preregistered protocol); `Settings` holds its choices.

Measures, per evaluation run (``role = eval``), on its held-out accuracy curve:

* **final accuracy**: mean of the last `final_evals` evaluations (protocol: 2); **greedy
  final** the same of ``eval/accuracy_greedy`` (reported, never decides);
* **mean accuracy over training**: the evaluations after step 0;
* **steps to target**: target = the `reference` arm's (DAPO's) final accuracy, mean over its
  seeds, per (part, task, K); the first evaluated step at or above it; a run that never
  reaches it is censored at its last step + one evaluation interval (`stats.censored_steps`);
* **steps to 90%** of the run's own final accuracy (how early the curve flattens);
* **response length** and **fork (W) tokens per response**, means over the last 5 steps;
* the mechanism metrics (PPO-dropped fork tokens, capped IS weights, entropy), means over
  the steps, descriptive only; and, for runs that logged it, the v3 mechanism check's level
  (`mechanism_gate.gate`'s figures over steps 1–40, averaged per arm, descriptive);
* **collapsed**: `stats.collapsed` (peak P over all evaluations; below P / 2 from some
  evaluation after the peak to the end; P below `floor` = never learned, left out).

Statistics:

* differences are **paired by seed** (the seeds both arms ran): mean difference, two-sided
  95% t-interval, paired t-test p-value;
* **Holm's correction** over each family (`Family`; per part and task): the protocol's for the
  parts named ``main`` (all pairs × final accuracy, mean accuracy, steps to 90%: 9 tests),
  ``ksweep`` (CISPO − DAPO and CISPO − GRPO × every K × final accuracy and steps to target),
  ``ablation`` / ``ablation_k32`` (each arm − CISPO × final and mean accuracy) and ``v3_chain``
  (a declared family: cispo_lowmask − cispo, cispo_highmask − cispo, cispo_lowmask − dapo ×
  final and mean accuracy, 6 tests; a declared test that cannot run counts as p = 1); any other
  part: CISPO − each arm, one family per measure. "Significant" = Holm-adjusted p <= 0.05;
* **steps to target apart from the family** (``v3_chain``, `Family.steps_apart`): each run's
  steps to target per seed, and the family's pairs' paired differences with unadjusted 95%
  t-intervals, no test (`study_tables`);
* **Q1, "≤ 50% of the steps"**: d_s = T_contrast,s − 0.5 · T_other,s (steps to target,
  censored as above); *yes* if the 95% t-interval of mean d lies below 0, *no* if above,
  *unclear* otherwise — one pre-specified test, no correction (against the reference arm;
  the other arms as secondary). Beside it: the ratio of mean steps with Fieller's 95%
  interval (`stats.fieller_ratio`) and the censored counts. ``Settings.q1_notes`` says what a
  part's table may be read as (``v3_chain``: descriptive, neither Q1 nor the gated (d));
* **"grows with K"**: per seed, the least-squares slope of the gap (contrast − other, mean
  accuracy over training) on log2 K; t-interval over seeds; *yes* only if it lies above 0;
* **collapse fraction** per arm: collapsed / runs that learned, and **never learned** / all the
  arm's runs, each with Wilson's 95% interval (two arms differ only where the intervals do not
  overlap);
* **tuning** (``role = tune``): per (part, task, K, arm) and rate, the score averaged over the
  tuning seeds; the choice (`stats.pick_lr`: near ties within `tune_tie` to the smaller
  rate) and whether it sits at the grid's edge;
* **the compute–performance fit** (only with ``Settings.compute_fit``, ``--compute-fit``):
  ScaleRL's eq. 1, R(C) − R0 = (A − R0) / (1 + (C_mid / C)^B), per arm on the held-out curves of
  all its seeds, C in steps or cumulative ``perf/step_s`` seconds, with 95% bootstrap intervals
  over seeds (`compute_fit`; descriptive);
* **compute**: wall hours per part (``wall_s``; a run without it counts the sum of its
  ``perf/step_s``, which leaves out evaluation time — the table says how many did).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from studies.compute_fit import fit_runs
from studies.doc_quotes import MARKER, check_doc, update_doc  # noqa: F401  (the report's doc check)
from studies.mechanism_gate import gate
from studies.stats import (
    COLLAPSE_FLOOR,
    at_edge,
    censored_steps,
    collapsed,
    fieller_ratio,
    final_accuracy,
    holm,
    mean_accuracy,
    mean_band,
    mean_over_last_steps,
    paired_t,
    pick_lr,
    slope,
    steps_to_own_fraction,
    wilson,
)
from studies.study_runs import Groups, RunData, group_eval_runs, load_study
from studies.study_tables import ci as _ci
from studies.study_tables import (
    comparison_values,
    compute_fit_table,
    count_values,
    drop_table,
    has_mechanism_log,
    mechanism_level_table,
    paired_steps,
    paired_steps_table,
    steps_per_seed_table,
    tally,
)
from studies.study_tables import pm as _pm


@dataclass(frozen=True)
class Family:
    """A family of paired comparisons, Holm-corrected together (per part and task)."""

    pairs: Literal["contrast_vs_each", "each_vs_contrast", "all_pairs"] | tuple[tuple[str, str], ...]
    """``contrast_vs_each``: contrast − arm; ``each_vs_contrast``: arm − contrast;
    ``all_pairs``: every pair, contrast first, then the reference, then by name; or an explicit
    tuple of ``(arm_a, arm_b)`` pairs, each the difference arm_a − arm_b, in that order. An explicit
    family is *declared*: Holm counts every declared test (`declared_size`), run or not."""
    measures: tuple[str, ...]
    """Names of `measure`."""
    pooled: bool = True
    """One family over all its measures; False: one family per measure."""
    others: tuple[str, ...] | None = None
    """Only these other arms (None: every arm of the group)."""
    note: str = ""
    """Printed under the comparisons table (what the family's results may and may not be read as)."""
    steps_apart: bool = False
    """Also report steps to target per seed and the pairs' paired steps-to-target differences with
    unadjusted intervals, outside the family (`study_tables`; explicit pairs only)."""


V3_CHAIN_FAMILY = Family(
    (("cispo_lowmask", "cispo"), ("cispo_highmask", "cispo"), ("cispo_lowmask", "dapo")),
    ("final_accuracy", "mean_accuracy"),
    note="Part 3 of study v3 (protocol amendment of 2026-12-03, 07:39 UTC): one Holm family of 3 pairs × final and "
         "mean accuracy, 6 tests. On `chain` at lr 1e-4 these answer (a) and (c) as questions about stability at "
         "that rate, not about the fork-token effect (by the mechanism gate's criteria it does not bind on `chain`: "
         "the fork token stops being rare within ~5 steps). cispo_lowmask − dapo "
         "stays in the family so that the correction is the preregistered one; it is reported as "
         "\"cispo_lowmask − dapo on chain\", not as an answer to (b).",
    steps_apart=True)

V3_CHAIN_Q1_NOTE = (
    "Part 3 of study v3 (protocol amendment of 2026-12-03, 07:39 UTC): this ≤ 50% rule is printed as \"Statistics\" "
    "defines it and is **descriptive only**. No row is a primary test: it is not Q1 (the original study's, answered by "
    "its part `main`) and not an answer to (d) (\"does the best arm reach DAPO's final accuracy in ≤ 50% of DAPO's "
    "steps\"), which stays gated: only a task that passes the mechanism gate answers it, and `chain` does not pass "
    "it.")
Q1_NOTES = {"v3_chain": V3_CHAIN_Q1_NOTE}


PROTOCOL_FAMILIES = {
    "main": Family("all_pairs", ("final_accuracy", "mean_accuracy", "steps_to_90")),
    "ksweep": Family("contrast_vs_each", ("final_accuracy", "steps_to_target"), others=("dapo", "grpo")),
    "ablation": Family("each_vs_contrast", ("final_accuracy", "mean_accuracy")),
}
PROTOCOL_FAMILIES["ablation_k32"] = PROTOCOL_FAMILIES["ablation"]  # the K = 32 ablations (session 9 amendment)
PROTOCOL_FAMILIES["v3_chain"] = V3_CHAIN_FAMILY  # part 3 of study v3 (amendment of 2026-12-03, 07:39 UTC)
DEFAULT_FAMILY = Family("contrast_vs_each", ("final_accuracy", "mean_accuracy", "steps_to_target"), pooled=False)


@dataclass(frozen=True)
class Settings:
    """The protocol's choices the tables depend on."""

    reference: str = "dapo"
    contrast: str = "cispo"
    floor: float = COLLAPSE_FLOOR
    final_evals: int = 2
    tune_score: str = "mean_accuracy"
    tune_tie: float = 0.005
    families: dict[str, Family] = field(default_factory=lambda: dict(PROTOCOL_FAMILIES))
    q1_notes: dict[str, str] = field(default_factory=lambda: dict(Q1_NOTES))
    """PART -> what its ≤ 50% table may be read as; it replaces the default's "against the
    reference: the primary test" sentence."""
    posthoc_drops: tuple[str, ...] = ("v3_chain",)
    """Parts that get the post hoc ``drops/PART`` table (`study_tables.drop_steps`)."""
    compute_fit: str | None = None
    """``compute_fit/PART`` per part on this compute axis (`compute_fit.AXES`); None: not made."""
    fit_boot: int = 1000
    """Bootstrap resamples of the seeds for the compute fit's intervals."""
    lend: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=lambda: {
        "ablation": ("main", ("cispo",)), "explore_lr1e4": ("main", ("dapo",))})
    """PART -> (OTHER, ARMS): where PART has no runs of its own of an arm of ARMS at a task and
    K, it pairs with OTHER's there (the `chain` ablations use part 1's CISPO runs, protocol
    amendment of session 7; the exploratory CISPO-vs-PPO part at 1e-4 uses part 1's DAPO runs,
    at that same rate, amendment of session 9). The tables label such an arm with the part its
    runs come from, and show its learning rate."""


def borrow_arms(groups: Groups, st: Settings) -> Groups:
    """`groups` with, for each part of `st.lend` lacking one of its arms at a (task, K), that
    arm's runs of the other part there (the runs keep their own ``part``)."""
    for part, (other, lent) in st.lend.items():
        for (p, task, k), arms in list(groups.items()):
            if p != part:
                continue
            for arm in lent:
                if arm not in arms and arm in groups.get((other, task, k), {}):
                    arms[arm] = dict(groups[(other, task, k)][arm])
    return groups


def _arm_label(arm: str, runs: dict[int, RunData], part: str) -> str:
    """The arm's name, plus where its runs come from when another part lent them."""
    src = sorted({r.meta["part"] for r in runs.values()} - {part})
    return f"{arm} ({', '.join(src)} part's runs)" if src else arm


def target_of(arms: dict[str, dict[int, RunData]], st: Settings) -> float | None:
    """The reference arm's final held-out accuracy, mean over its seeds (None: not run)."""
    if st.reference not in arms:
        return None
    return mean_band([final_accuracy(r.curve(), st.final_evals) for r in arms[st.reference].values()])[0]


def measure(run: RunData, name: str, target: float | None, st: Settings) -> float:
    """One per-run measure by name (module docstring)."""
    c = run.curve()
    if name == "mean_accuracy":
        return mean_accuracy(c)
    if name == "final_accuracy":
        return final_accuracy(c, st.final_evals)
    if name == "greedy_final":
        return final_accuracy(run.curve("eval/accuracy_greedy"), st.final_evals)
    if name == "steps_to_target":
        return censored_steps(c, target)[0] if target is not None else float("nan")
    if name == "steps_to_90":
        s = steps_to_own_fraction(c, 0.9, st.final_evals)
        return float("nan") if s is None else float(s)
    if name in ("rollout/response_length", "rollout/fork_tokens_per_response"):
        return mean_over_last_steps(run.curve(name), 5)
    vals = list(run.curve(name).values())  # a mechanism metric: mean over the steps
    return sum(vals) / len(vals) if vals else float("nan")


def _label(name: str) -> str:
    return name.replace("_", " ").replace("steps to 90", "steps to 90% of own final")


# --------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------


def _lrs(runs: dict[int, RunData]) -> str:
    return ", ".join(sorted({f"{float(r.meta['lr']):g}" for r in runs.values()}))


def _groups_of(groups: Groups, part: str):
    return [(task, k, arms) for (p, task, k), arms in sorted(groups.items()) if p == part]


def summary_table(groups: Groups, part: str, st: Settings) -> str:
    lines = ["| task | K | arm | lr | seeds | final | greedy final | mean over training | steps to target | reached "
             "| steps to 90% of own final | response length | W per response | collapsed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for task, k, arms in _groups_of(groups, part):
        target = target_of(arms, st)
        for arm, runs in arms.items():
            m = lambda name, p=3, runs=runs, target=target: _pm(  # noqa: E731
                [measure(r, name, target, st) for r in runs.values()], p)
            hits = [censored_steps(r.curve(), target)[1] for r in runs.values()] if target is not None else []
            flags = [f for f in (collapsed(r.curve(), st.floor) for r in runs.values()) if f is not None]
            lines.append(f"| {task} | {k} | {_arm_label(arm, runs, part)} | {_lrs(runs)} | {len(runs)} "
                         f"| {m('final_accuracy')} | {m('greedy_final')} "
                         f"| {m('mean_accuracy')} | {m('steps_to_target', 1)} | {sum(hits)}/{len(hits)} "
                         f"| {m('steps_to_90', 1)} | {m('rollout/response_length', 1)} "
                         f"| {m('rollout/fork_tokens_per_response', 2)} | {sum(flags)}/{len(flags)} |")
    lines += ["", f"mean ± 95% t half-width over seeds. Final: mean of the last {st.final_evals} evaluations. Steps to "
              f"target: target = {st.reference}'s final held-out accuracy (mean over its seeds) at that task and K; "
              "a run that never reaches it counts as its last step + one evaluation interval. Response length and W "
              "(fork) tokens per response: means over the last 5 steps. Collapsed: of the runs whose peak reached "
              f"{st.floor:g}."]
    return "\n".join(lines)


MECHANISM = ("objective/frac_ppo_dropped_fork", "objective/frac_capped", "objective/entropy")


def mechanism_table(groups: Groups, part: str, st: Settings) -> str:
    lines = ["| task | K | arm | PPO-dropped fork tokens | IS weight capped | entropy |", "|---|---|---|---|---|---|"]
    for task, k, arms in _groups_of(groups, part):
        for arm, runs in arms.items():
            lines.append(f"| {task} | {k} | {_arm_label(arm, runs, part)} | "
                         + " | ".join(_pm([measure(r, m, None, st) for r in runs.values()]) for m in MECHANISM) + " |")
    lines += ["", "Means over each run's steps, then mean ± 95% t half-width over seeds; descriptive only."]
    return "\n".join(lines)


def _pairs(arms: list[str], fam: Family, st: Settings) -> list[tuple[str, str]]:
    if isinstance(fam.pairs, tuple):  # declared pairs: those whose two arms both ran
        return [(a, b) for a, b in fam.pairs if a in arms and b in arms]
    if st.contrast not in arms and fam.pairs != "all_pairs":
        return []
    others = [a for a in arms if a != st.contrast and (fam.others is None or a in fam.others)]
    if fam.pairs == "contrast_vs_each":
        return [(st.contrast, a) for a in others]
    if fam.pairs == "each_vs_contrast":
        return [(a, st.contrast) for a in others]
    order = sorted(arms, key=lambda a: (a != st.contrast, a != st.reference, a))
    return [(a, b) for i, a in enumerate(order) for b in order[i + 1:]]


def declared_size(fam: Family) -> int | None:
    """m of a declared family, per Holm family: |pairs| × |measures| when pooled, |pairs| when
    one family per measure; None when the pairs are a rule (m = the tests that ran)."""
    if not isinstance(fam.pairs, tuple):
        return None
    return len(fam.pairs) * (len(fam.measures) if fam.pooled else 1)


def holm_of_declared(pvalues: list[float], size: int | None) -> list[float]:
    """`stats.holm` over a family of `size` tests of which only `pvalues` ran: each missing test
    counts as p = 1, so the tests that ran keep the multipliers m, m − 1, … of the declared
    m (conservative: a missing test is never rejected). size None: m = len(pvalues)."""
    pad = max(0, (size or 0) - len(pvalues))
    return holm(list(pvalues) + [1.0] * pad)[:len(pvalues)]


def comparisons(groups: Groups, part: str, st: Settings) -> list[dict]:
    """Every paired comparison of the part's family, with Holm-adjusted p-values (a family per
    task, and per measure unless the family is pooled; a declared family counts its declared
    number of tests, `holm_of_declared`)."""
    fam = st.families.get(part, DEFAULT_FAMILY)
    rows = []
    for task, k, arms in _groups_of(groups, part):
        target = target_of(arms, st)
        for a, b in _pairs(list(arms), fam, st):
            seeds = sorted(set(arms[a]) & set(arms[b]))
            for name in fam.measures:
                diffs = [measure(arms[a][s], name, target, st) - measure(arms[b][s], name, target, st) for s in seeds]
                if len(diffs) >= 2 and all(d == d for d in diffs):
                    rows.append({"task": task, "K": k, "a": a, "b": b, "measure": name, "t": paired_t(diffs)})
    for key in {(r["task"], None if fam.pooled else r["measure"]) for r in rows}:
        family = [r for r in rows if (r["task"], None if fam.pooled else r["measure"]) == key]
        size = declared_size(fam)
        for r, adj in zip(family, holm_of_declared([r["t"].p for r in family], size)):
            r["holm_p"], r["family"] = adj, size or len(family)
    return rows


def comparisons_table(rows: list[dict], fam: Family) -> str:
    lines = ["| task | K | measure | difference | seeds | mean | 95% CI | p | Holm p | family | significant |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, p = r["t"], (1 if r["measure"].startswith("steps") else 3)
        lines.append(f"| {r['task']} | {r['K']} | {_label(r['measure'])} | {r['a']} − {r['b']} | {t.n} "
                     f"| {t.mean:+.{p}f} | {_ci(t.lo, t.hi, p)} | {t.p:.3g} | {r['holm_p']:.3g} | {r['family']} "
                     f"| {'yes' if r['holm_p'] <= 0.05 else 'no'} |")
    what = "over all its measures" if fam.pooled else "per measure"
    lines += ["", "Paired by seed; two-sided 95% t-intervals (unadjusted) and paired t-tests; Holm's correction "
              f"within each task's family {what} (family = its number of tests); significant: Holm p <= 0.05."]
    if isinstance(fam.pairs, tuple):
        lines.append("The family is declared: its size counts every declared test; one that could not run (an arm "
                     "missing) counts as p = 1.")
    if fam.note:
        lines += ["", fam.note]
    return "\n".join(lines)


def q1_rows(groups: Groups, part: str, st: Settings) -> list[dict]:
    """The "≤ 50% of the steps" rule of the contrast arm against the reference (and the others)."""
    rows = []
    for task, k, arms in _groups_of(groups, part):
        target = target_of(arms, st)
        if st.contrast not in arms or target is None:
            continue
        for base in sorted((a for a in arms if a != st.contrast), key=lambda a: (a != st.reference, a)):
            seeds = sorted(set(arms[st.contrast]) & set(arms[base]))
            if len(seeds) < 2:
                continue
            c = [censored_steps(arms[st.contrast][s].curve(), target) for s in seeds]
            d = [censored_steps(arms[base][s].curve(), target) for s in seeds]
            rows.append({"task": task, "K": k, "base": base, "target": target, "c": c, "d": d,
                         "ratio": fieller_ratio([x for x, _ in c], [x for x, _ in d]),
                         "rule": paired_t([x - 0.5 * y for (x, _), (y, _) in zip(c, d)])})
    return rows


def verdict(t) -> str:
    """Yes if the 95% interval of mean d lies below 0, no if above, else unclear."""
    return "yes" if t.hi < 0 else "no" if t.lo > 0 else "unclear"


def q1_table(rows: list[dict], st: Settings, note: str = "") -> str:
    """The ≤ 50% rule's table; `note` (``Settings.q1_notes``) replaces the sentence that calls the
    row against the reference the primary test."""
    c = st.contrast
    lines = [f"| task | K | {c} vs | target | seeds | {c} steps (censored) | its steps (censored) | ratio "
             f"| Fieller 95% CI | T_{c} − 0.5·T_other | 95% CI | ≤ 50% of the steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        (rat, lo, hi), t, n = r["ratio"], r["rule"], len(r["c"])
        cm, dm = (sum(x for x, _ in v) / n for v in (r["c"], r["d"]))
        lines.append(f"| {r['task']} | {r['K']} | {r['base']} | {r['target']:.3f} | {n} "
                     f"| {cm:.1f} ({n - sum(h for _, h in r['c'])}) | {dm:.1f} ({n - sum(h for _, h in r['d'])}) "
                     f"| {rat:.2f} | {_ci(lo, hi, 2)} | {t.mean:+.1f} | {_ci(t.lo, t.hi, 1)} | {verdict(t)} |")
    lines += ["", f"Target: {st.reference}'s final held-out accuracy (mean over seeds of the mean of its last "
              f"{st.final_evals} evaluations). Steps to target per run, censored at the last step + one evaluation "
              f"interval (censored runs in brackets). Rule: d = T_{c} − 0.5·T_other paired by seed; yes if the 95% "
              f"t-interval of mean d lies below 0, no if above, else unclear. "
              + (f"Against {st.reference}: the primary, uncorrected test; the other rows are secondary. "
                 if not note else "")
              + "Ratio of mean steps with Fieller's interval: descriptive."]
    return "\n".join(lines + (["", note] if note else []))


def slope_rows(groups: Groups, part: str, st: Settings) -> list[dict]:
    """Per task and other arm: per seed, the slope of the mean-accuracy gap on log2 K."""
    gaps: dict[tuple[str, str], dict[int, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for task, k, arms in _groups_of(groups, part):
        if st.contrast not in arms:
            continue
        for base in (a for a in arms if a != st.contrast):
            for s in set(arms[st.contrast]) & set(arms[base]):
                gap = mean_accuracy(arms[st.contrast][s].curve()) - mean_accuracy(arms[base][s].curve())
                gaps[(task, base)][s].append((math.log2(k), gap))
    rows = []
    for (task, base), per_seed in sorted(gaps.items()):
        slopes = [slope([x for x, _ in pts], [y for _, y in pts]) for pts in per_seed.values() if len(pts) >= 2]
        slopes = [v for v in slopes if v == v]
        if len(slopes) >= 2 and len({x for pts in per_seed.values() for x, _ in pts}) >= 2:
            rows.append({"task": task, "base": base, "t": paired_t(slopes)})
    return rows


def slope_table(rows: list[dict], st: Settings) -> str:
    lines = ["| task | gap | seeds | slope per doubling of K | 95% CI | grows with K |", "|---|---|---|---|---|---|"]
    for r in rows:
        t = r["t"]
        lines.append(f"| {r['task']} | {st.contrast} − {r['base']} | {t.n} | {t.mean:+.4f} | {_ci(t.lo, t.hi, 4)} "
                     f"| {'yes' if t.lo > 0 else 'no'} |")
    lines += ["", "Gap: mean held-out accuracy over training, paired by seed; per seed the least-squares slope on "
              "log2 K over the K values that seed ran; t-interval over seeds. Grows: only if the interval lies "
              "above 0."]
    return "\n".join(lines)


def collapse_counts(groups: Groups, part: str, st: Settings) -> list[tuple[str, int, str, list[bool | None]]]:
    """(task, K, arm, per run: collapsed, or None for never learned) of the part's arms."""
    return [(task, k, arm, [collapsed(r.curve(), st.floor) for r in runs.values()])
            for task, k, arms in _groups_of(groups, part) for arm, runs in arms.items()]


def collapse_table(groups: Groups, part: str, st: Settings) -> str:
    lines = ["| task | K | arm | lr | runs that learned | collapsed | fraction | Wilson 95% CI | never learned "
             "| Wilson 95% CI |", "|---|---|---|---|---|---|---|---|---|---|"]
    for task, k, arms in _groups_of(groups, part):
        for arm, runs in arms.items():
            never, n, hit, learned = tally([collapsed(r.curve(), st.floor) for r in runs.values()])
            lo, hi = wilson(hit, learned)
            nlo, nhi = wilson(never, n)
            frac = f"{hit / learned:.2f}" if learned else "n/a"
            lines.append(f"| {task} | {k} | {_arm_label(arm, runs, part)} | {_lrs(runs)} | {learned} | {hit} | {frac} "
                         f"| [{lo:.2f}, {hi:.2f}] | {never} | [{nlo:.2f}, {nhi:.2f}] |")
    lines += ["", "Collapsed: held-out accuracy below half its peak P (over all evaluations) from some evaluation "
              f"after the peak to the last one; never learned: P < {st.floor:g} (left out of the fraction). Wilson 95% "
              "intervals: collapsed out of the runs that learned, never learned out of all the arm's runs. Two arms "
              "differ only where their intervals do not overlap."]
    return "\n".join(lines)


def steps_outputs(groups: Groups, part: str, st: Settings) -> dict[str, str]:
    """For a declared family with `Family.steps_apart`: ``steps/PART`` (steps to target per run),
    ``steps_paired/PART`` (the family's pairs, paired by seed, unadjusted intervals; `study_tables`)
    and each difference as ``steps_paired/PART/TASK/K{k}/A-B`` ("+mean [lo, hi]")."""
    fam = st.families.get(part, DEFAULT_FAMILY)
    if not (fam.steps_apart and isinstance(fam.pairs, tuple)):
        return {}
    cells, rows = [], []
    for task, k, arms in _groups_of(groups, part):
        if (target := target_of(arms, st)) is None:
            continue
        steps = {a: {s: censored_steps(r.curve(), target) for s, r in sorted(arms[a].items())}
                 for a in sorted(arms, key=lambda a: (a != st.reference, a))}
        cells.append((task, k, target, steps))
        rows += [{"task": task, "K": k, "a": a, "b": b, **d} for a, b in _pairs(list(arms), fam, st)
                 if (d := paired_steps(steps[a], steps[b]))]
    out = {f"steps/{part}": steps_per_seed_table(cells, st.reference, st.final_evals)} if cells else {}
    if rows:
        out[f"steps_paired/{part}"] = paired_steps_table(rows)
        out.update({f"steps_paired/{part}/{r['task']}/K{r['K']}/{r['a']}-{r['b']}":
                    f"{r['t'].mean:+.1f} {_ci(r['t'].lo, r['t'].hi, 1)}" for r in rows})
    return out


def mechanism_level(groups: Groups, part: str) -> str | None:
    """``mechanism_check/PART``: per arm, `mechanism_gate.gate`'s figures averaged over the runs
    that logged the mechanism check (`study_tables.mechanism_level_table`); None when none did."""
    cells = []
    for task, k, arms in _groups_of(groups, part):
        rows = {a: [[{"step": s, **m} for s, m in sorted(r.steps.items())] for r in runs.values()]
                for a, runs in arms.items()}
        per_arm = {a: [gate(x) for x in rs if has_mechanism_log(x)] for a, rs in rows.items()}
        if per_arm := {a: g for a, g in per_arm.items() if g}:
            cells.append((task, k, per_arm))
    return mechanism_level_table(cells) if cells else None


def tuning_table(runs: list[RunData], part: str, st: Settings) -> str | None:
    cells: dict[tuple[str, int, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r.meta["role"] == "tune" and r.meta["part"] == part:
            c = r.curve()
            cells[(r.meta["task"], int(r.meta["K"]), r.meta["arm"])][float(r.meta["lr"])].append(
                mean_accuracy(c) if st.tune_score == "mean_accuracy" else final_accuracy(c, st.final_evals))
    if not cells:
        return None
    lrs = sorted({lr for per in cells.values() for lr in per})
    lines = ["| task | K | arm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen | at grid edge |",
             "|---|---|---|" + "---|" * (len(lrs) + 2)]
    for (task, k, arm), per in sorted(cells.items()):
        mean = {lr: sum(v) / len(v) for lr, v in per.items()}
        best = pick_lr(mean, st.tune_tie)
        lines.append(f"| {task} | {k} | {arm} | " + " | ".join(f"{mean[lr]:.3f}" if lr in mean else "n/a" for lr in lrs)
                     + f" | {best:g} | {'yes' if at_edge(best, mean) else 'no'} |")
    lines += ["", f"Score: {st.tune_score.replace('_', ' ')} (mean over the tuning seeds); the highest wins, "
              f"scores within {st.tune_tie:g} of it tie and a tie goes to the smallest rate."]
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
# The report (the doc check: `doc_quotes`)
# --------------------------------------------------------------------------------------


def report(csv_path: str | Path | list[str | Path], out_dir: str | Path | None = None,
           st: Settings = Settings()) -> dict[str, str]:
    """name -> text of every table (``summary/PART``, ``mechanism/PART``, ``comparisons/PART``,
    ``q1/PART``, ``slope/PART``, ``collapse/PART``, ``steps/PART``, ``steps_paired/PART``,
    ``mechanism_check/PART``, ``drops/PART`` (post hoc), ``compute_fit/PART`` (with
    ``st.compute_fit``), ``tuning/PART``, ``compute``) and quoted
    value (``target/PART/TASK/K16``; ``ratio/PART/TASK/K16/ARM`` "0.52 [0.41, 0.66]";
    ``diff/PART/TASK/K16/MEASURE/A-B``, ``never/...`` and ``collapsed/PART/TASK/K16/ARM`` (`study_tables`);
    ``q1/PART/TASK/K16/ARM`` yes / no / unclear; ``slope/PART/TASK/ARM``; ``hours/PART``,
    ``hours/total``). With `out_dir`: each table as ``NAME.md`` (``/`` -> ``_``), the values
    in ``numbers.json``, and the figures ``curves_PART.png`` / ``gaps_PART.png``. Several CSVs
    are read as one study whose parts sit side by side (`load_study`)."""
    from studies.study_figures import plot_curves, plot_gaps

    runs = load_study(csv_path)
    groups = borrow_arms(group_eval_runs(runs), st)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    out: dict[str, str] = {}
    for part in sorted({r.meta["part"] for r in runs}):
        if any(k[0] == part for k in groups):
            out[f"summary/{part}"] = summary_table(groups, part, st)
            out[f"mechanism/{part}"] = mechanism_table(groups, part, st)
            if comp := comparisons(groups, part, st):
                out[f"comparisons/{part}"] = comparisons_table(comp, st.families.get(part, DEFAULT_FAMILY))
                out.update(comparison_values(comp, part))
            if q1 := q1_rows(groups, part, st):
                out[f"q1/{part}"] = q1_table(q1, st, st.q1_notes.get(part, ""))
            for r in q1:
                tag = f"{part}/{r['task']}/K{r['K']}"
                (v, lo, hi) = r["ratio"]
                out[f"target/{tag}"] = f"{r['target']:.3f}"
                out[f"ratio/{tag}/{r['base']}"] = f"{v:.2f} {_ci(lo, hi, 2)}".replace("+", "")
                out[f"q1/{tag}/{r['base']}"] = verdict(r["rule"])
            if slopes := slope_rows(groups, part, st):
                out[f"slope/{part}"] = slope_table(slopes, st)
                for r in slopes:
                    out[f"slope/{part}/{r['task']}/{r['base']}"] = f"{r['t'].mean:+.4f} {_ci(r['t'].lo, r['t'].hi, 4)}"
            out[f"collapse/{part}"] = collapse_table(groups, part, st)
            out.update(count_values(part, collapse_counts(groups, part, st)))
            if part in st.posthoc_drops:
                cells = [(task, k, arm, {s: r.curve() for s, r in runs.items()})
                         for task, k, arms in _groups_of(groups, part) for arm, runs in arms.items()]
                out[f"drops/{part}"] = drop_table(cells, st.floor)
            out.update(steps_outputs(groups, part, st))
            if level := mechanism_level(groups, part):
                out[f"mechanism_check/{part}"] = level
            if st.compute_fit:  # ScaleRL's eq. 1 per arm, descriptive (`compute_fit`)
                out[f"compute_fit/{part}"] = compute_fit_table([(task, k, _arm_label(arm, runs, part), fit_runs(
                    runs, st.compute_fit, f"{part}/{task}/K{k}/{arm}", st.fit_boot)) for task, k, arms
                    in _groups_of(groups, part) for arm, runs in arms.items()], st.compute_fit, st.fit_boot)
            if out_dir is not None:
                plot_curves(groups, part, Path(out_dir) / f"curves_{part}.png")
                plot_gaps(groups, part, st.contrast, Path(out_dir) / f"gaps_{part}.png")
        if tuning := tuning_table(runs, part, st):
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
