"""Stage G of the agents search (search-plan.md, amendment 6): its registered measure, its gate and its queue.

* `t90`: the step at which the held-out sampled tool-call rate (``eval/tool_call_rate``: 100 problems x 2 sampled
  answers at 0.7, every step 0-10) first reaches 0.9, interpolated linearly between the two evaluations around the
  crossing; a run below 0.9 at its last evaluation is censored at last + 1 (11).
* `gate`: the four criteria of the gate run (both fresh DAPO seeds must pass all four).
* The queue (``study_g_queue.json``): every run of the stage, phase by phase, with the command of each phase
  (`python -m studies compare --config study_g.yaml ...`, which skips finished runs and resumes a killed one) and
  a state that `refresh` reads off the run folders (pending / started / done).

    python studies/results/agents/study_g.py status                # each phase's runs: done / started / pending
    python studies/results/agents/study_g.py save                  # write the states into the queue file
    python studies/results/agents/study_g.py keep                  # copy finished runs' data into the repository
    python studies/results/agents/study_g.py restore               # put kept runs back where `compare` skips them
    python studies/results/agents/study_g.py next                  # the command of the first unfinished phase
    python studies/results/agents/study_g.py gate RUN_DIR ...      # the gate's verdict per run (metrics.jsonl)
    python studies/results/agents/study_g.py t90 RUN_DIR ...       # T90 per run
    python studies/results/agents/study_g.py precheck SFT_DIR EVAL_TXT  # the pre-check's (a) and (b)
    python studies/results/agents/study_g.py report                # the registered tests on the runs done so far
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUEUE = HERE / "study_g_queue.json"
CONFIG = HERE / "study_g.yaml"
THRESHOLD = 0.9
LAST_STEP = 10
EARLY = range(1, 6)
GATE = {"call_rate": (0.03, 0.15), "pos_above": 5, "pos_mass": 0.10, "t90": 3.5}
"""The gate's thresholds, about a third of stage F's DAPO values (17 / 16 / 20 positive ``<calc>`` tokens above
1.28 in steps 1-5; 0.30-0.37 of the positive mass): they test that the mechanism is present, not its size."""


def t90(curve: dict[int, float], threshold: float = THRESHOLD, last: int = LAST_STEP) -> tuple[float, bool]:
    """``(T, censored)``: the first evaluated step whose rate is >= `threshold`, moved back along the line from
    the evaluation before it: T = s0 + (s1 - s0) (threshold - r0) / (r1 - r0); 0 when step 0 already reaches it;
    ``(last + 1, True)`` when no evaluation up to `last` does."""
    steps = sorted(s for s in curve if s <= last)
    for i, s in enumerate(steps):
        if curve[s] >= threshold:
            if i == 0:
                return float(s), False
            s0, r0, r1 = steps[i - 1], curve[steps[i - 1]], curve[s]
            return s0 + (s - s0) * (threshold - r0) / (r1 - r0), False
    return float(last + 1), True


def call_rate_curve(rows: list[dict]) -> dict[int, float]:
    """``{step: eval/tool_call_rate}`` of a run's logged rows (the sampled answers' rate where it sampled)."""
    return {r["step"]: r["eval/tool_call_rate"] for r in rows if r.get("eval/tool_call_rate") is not None}


def gate(rows: list[dict]) -> dict:
    """The gate's four criteria on one run's rows, each ``(value, passed)``, and ``passed`` (all four):
    the step-0 sampled call rate in [0.03, 0.15] with accuracy with a ``<calc>`` above without; the positive
    ``<calc>`` tokens above 1 + eps_high summed over steps 1-5 (``fork/calc/pos_above``) >= 5; the mean over
    steps 1-5 of every positive token's mass share above it (``objective/all_pos_mass_above``) >= 0.10;
    T90 >= 3.5."""
    start = next((r for r in rows if r["step"] == 0 and "eval/tool_call_rate" in r), {})
    rate = start.get("eval/tool_call_rate")
    with_call, without = start.get("eval/accuracy_with_fork"), start.get("eval/accuracy_without_fork")
    lo, hi = GATE["call_rate"]
    early = [r for r in rows if r["step"] in EARLY]
    above = sum(r.get("fork/calc/pos_above") or 0 for r in early)
    masses = [r["objective/all_pos_mass_above"] for r in early if r.get("objective/all_pos_mass_above") is not None]
    mass = sum(masses) / len(masses) if masses else None
    t, censored = t90(call_rate_curve(rows))
    out = {"call_rate": ((rate, with_call, without), rate is not None and lo <= rate <= hi and with_call is not None
                         and without is not None and with_call > without),
           "pos_above": (above, above >= GATE["pos_above"]),
           "pos_mass": (mass, mass is not None and mass >= GATE["pos_mass"]),
           "t90": ((t, censored), t >= GATE["t90"])}
    return {**out, "passed": all(ok for _, ok in out.values())}


def read_rows(run: Path) -> list[dict]:
    """A run folder's metrics rows (``metrics.jsonl`` or its ``.gz``)."""
    from cispo.records.tracking import read_metrics

    return read_metrics(Path(run) / "metrics.jsonl")


PRECHECK_SFT = ("cispo sft --config examples/calculator_sft.yaml data.call_share=0.125 out_dir=/work/agent_runs "
                "run_name=warm_rare_g")
PRECHECK_EVAL = ("cispo eval --model /work/agent_runs/warm_rare_g/final data.task=wordmath_calc "
                 "rollout.max_new_tokens=128 eval.num_samples=4 eval.temperature=0.7 threads=1 "
                 "--samples stageG0_rare_samples.jsonl > stageG0_rare.txt")
"""The pre-check: the rare-call warm start rebuilt, then F0b's evaluation of it."""


WARM_RARE = HERE / "warm_starts" / "warm_rare_small.json"
LOSS_TOLERANCE = 1e-3


def eval_numbers(text: str) -> dict:
    """The JSON object of a ``cispo eval`` output (its metrics), read out of the text around it."""
    return json.loads(text[text.index("{\n"): text.rindex("}") + 1])


def precheck(sft_losses: list[float], reference: list[float], numbers: dict) -> dict:
    """The pre-check, each part ``(value, passed)``: (a) the rebuilt warm start's losses equal the reference
    fine-tune's within `LOSS_TOLERANCE` each (value: the largest difference); (b) its sampled tool-call rate in
    the gate's [0.03, 0.15] with accuracy with a ``<calc>`` above without. Stage G runs only if (b) passes."""
    same_length = len(sft_losses) == len(reference)
    worst = max((abs(a - b) for a, b in zip(sft_losses, reference)), default=float("inf")) if same_length else None
    lo, hi = GATE["call_rate"]
    rate, with_call, without = (numbers.get(k) for k in ("eval/tool_call_rate", "eval/accuracy_with_fork",
                                                          "eval/accuracy_without_fork"))
    b_ok = (rate is not None and lo <= rate <= hi and with_call is not None and without is not None
            and with_call > without)
    return {"a": (worst, worst is not None and worst <= LOSS_TOLERANCE), "b": ((rate, with_call, without), b_ok)}


PRIMARY_ARMS = ("dapo", "cispo_lowmask", "cispo")
SECONDARY_ARM = "dapo_lr2e-5"
SUPPORT_GAP, EQUIVALENCE, ALPHA = 0.5, 0.75, 0.05
"""The registered rules' numbers: Support needs mean P1 >= 0.5 step; equivalence is a 90 % t-interval inside
+-0.75 step; the Holm family {P1, P2} is tested at 0.05."""


def hodges_lehmann(diffs: list[float]) -> float:
    """The median of the Walsh averages (d_i + d_j) / 2, i <= j: the Wilcoxon signed-rank test's estimate of
    the median difference, whose sign is the direction that test reads."""
    walsh = sorted((a + b) / 2 for i, a in enumerate(diffs) for b in diffs[i:])
    n = len(walsh)
    return (walsh[(n - 1) // 2] + walsh[n // 2]) / 2


def paired_test(diffs: list[float]) -> dict:
    """One registered contrast over its seeds' differences: the paired t test (mean, two-sided p, 95 % and 90 %
    intervals), the Wilcoxon signed-rank p and its direction (`hodges_lehmann`)."""
    from scipy import stats as sp

    from studies.stats import paired_t

    t95, t90 = paired_t(diffs, 0.95), paired_t(diffs, 0.90)
    wilcoxon = float(sp.wilcoxon(diffs).pvalue) if any(diffs) and len(diffs) > 1 else 1.0
    return {"n": len(diffs), "mean": t95.mean, "p": t95.p, "ci95": (t95.lo, t95.hi), "ci90": (t90.lo, t90.hi),
            "wilcoxon_p": wilcoxon, "hl": hodges_lehmann(diffs) if diffs else float("nan")}


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def decide(t90s: dict[str, dict[int, tuple[float, bool]]], gate_passed: bool = True) -> dict:
    """The registered tests on ``{arm: {seed: (T90, censored)}}``: P1 = T90(dapo) - T90(cispo_lowmask) and
    P2 = T90(dapo) - T90(cispo) over the seeds every primary arm has; Holm over {P1, P2}, a rejection counting
    only where Wilcoxon's direction agrees with the t test's sign; the verdict (support / refuted here / not the
    paper's mechanism / not shown); "half the steps" (T90(best CISPO arm) - T90(dapo) / 2, said below 0 only if
    its 95 % interval is); the secondary contrast T90(dapo_lr2e-5) - T90(cispo_lowmask); censored runs per arm."""
    from studies.stats import holm

    seeds = sorted(set.intersection(*(set(t90s.get(a, {})) for a in PRIMARY_ARMS)))
    censored = {a: sum(c for _, c in runs.values()) for a, runs in t90s.items()}
    if len(seeds) < 2:
        return {"seeds": seeds, "verdict": "too few paired seeds to test", "censored": censored}
    t = {a: [t90s[a][s][0] for s in seeds] for a in PRIMARY_ARMS}
    tests = {name: paired_test([x - y for x, y in zip(t["dapo"], t[arm])])
             for name, arm in (("P1", "cispo_lowmask"), ("P2", "cispo"))}
    for test, adjusted in zip(tests.values(), holm([tests["P1"]["p"], tests["P2"]["p"]])):
        test["p_holm"] = adjusted
        test["rejects"] = adjusted <= ALPHA and _sign(test["hl"]) == _sign(test["mean"]) != 0
        test["equivalent"] = -EQUIVALENCE < test["ci90"][0] and test["ci90"][1] < EQUIVALENCE
    p1, p2 = tests["P1"], tests["P2"]
    if p1["rejects"] and p1["mean"] >= SUPPORT_GAP:
        verdict = "support"
    elif gate_passed and p1["equivalent"]:
        verdict = "not the paper's mechanism" if p2["rejects"] else "refuted here"
    else:
        verdict = "not shown either way"
    best = min(("cispo_lowmask", "cispo"), key=lambda a: sum(t[a]))
    half = paired_test([b - d / 2 for b, d in zip(t[best], t["dapo"])])
    secondary_seeds = sorted(set(t90s.get(SECONDARY_ARM, {})) & set(t90s["cispo_lowmask"]))
    secondary = [t90s[SECONDARY_ARM][s][0] - t90s["cispo_lowmask"][s][0] for s in secondary_seeds]
    return {"seeds": seeds, "tests": tests, "verdict": verdict,
            "half_the_steps": {"arm": best, **half, "said": half["ci95"][1] < 0},
            "secondary": paired_test(secondary) if len(secondary) > 1 else None, "censored": censored}


def finished_t90s(folders: list[Path]) -> dict[str, dict[int, tuple[float, bool]]]:
    """``{arm: {seed: (T90, censored)}}`` of every finished run (`is_finished`) in `folders`."""
    from cispo.records.runfolder import is_finished

    out: dict[str, dict[int, tuple[float, bool]]] = {}
    for folder in folders:
        for d in sorted(p for p in folder.glob("*__seed*") if p.is_dir() and is_finished(p)):
            arm, seed = d.name.split("__")[0], int(d.name.rsplit("__seed", 1)[1])
            out.setdefault(arm, {})[seed] = t90(call_rate_curve(read_rows(d)))
    return out


def phases() -> list[dict]:
    """The stage's phases in order, each with its ``compare`` overrides, from `CONFIG`: the gate (two fresh DAPO
    seeds, 100 and 101, their own folder), the primary arms (seeds 0-15) and the secondary arm (DAPO at 2e-5)."""
    return [{"phase": "gate", "overrides": ["arms=[dapo]", "seeds=[100,101]", "part=study_g_gate",
                                            "out_dir=/work/agent_runs/study_g_gate"]},
            {"phase": "primary", "overrides": []},
            {"phase": "secondary", "overrides": ["arms=[dapo_lr2e-5]", "part=study_g_secondary",
                                                 "out_dir=/work/agent_runs/study_g_secondary"]}]


def build_queue() -> dict:
    """The queue as first registered: every run of every phase (`studies.compare.run_configs` of `CONFIG` with
    the phase's overrides: its folder, arm, seed and learning rate), each pending."""
    from cispo.cli import _build_config
    from studies.compare import CompareConfig, run_configs

    out = [{"phase": "precheck", "command": f"{PRECHECK_SFT} && {PRECHECK_EVAL}",
            "runs": [{"arm": "warm start", "seed": 0, "lr": 5e-5, "dir": "/work/agent_runs/warm_rare_g",
                      "state": "pending"}]}]
    for p in phases():
        cfg = _build_config(CompareConfig, str(CONFIG), p["overrides"])
        runs = [{"arm": r.arm, "seed": r.config.seed, "lr": r.config.optim.lr, "dir": str(r.dir), "state": "pending"}
                for r in run_configs(cfg)]
        command = " ".join(["python -m studies compare --config studies/results/agents/study_g.yaml", *p["overrides"]])
        out.append({"phase": p["phase"], "command": command.strip(), "runs": runs})
    return {"phases": out}


KEPT_FILES = ("config.yaml", "meta.json", "summary.json", "study.json")
GZIPPED_FILES = ("metrics.jsonl", "samples.jsonl")


def kept(run_dir: str | Path) -> Path:
    """Where the repository keeps a run's data: ``HERE/<its phase folder>/<its run folder>`` (e.g.
    ``study_g_gate/dapo__wordmath_calc__K4__seed100``), as stage F's runs are kept."""
    d = Path(run_dir)
    return HERE / d.parent.name / d.name


def keep(run_dir: Path) -> Path:
    """Copy a finished run's data into the repository (`kept`): its config, meta, summary and study record,
    its metrics and samples gzipped; not its checkpoints."""
    import gzip
    import shutil

    out = kept(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in KEPT_FILES:
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, out / name)
    for name in GZIPPED_FILES:
        if (run_dir / name).exists():
            with open(run_dir / name, "rb") as src, gzip.open(out / f"{name}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    return out


def run_rows(run_dir: str | Path) -> list[dict]:
    """A run's metrics rows, from its folder where this machine has it, else from the repository's copy."""
    d = Path(run_dir)
    return read_rows(d if d.exists() else kept(d))


def refresh(queue: dict) -> dict:
    """`queue` with each run's state read off its folder: ``done`` (finished here, or kept in the repository by an
    earlier session), ``started`` (a folder, not finished: the phase's command resumes it) or ``pending``."""
    from cispo.records.runfolder import is_finished

    for p in queue["phases"]:
        for r in p["runs"]:
            d = Path(r["dir"])
            done = (d.exists() and is_finished(d)) or (p["phase"] != "precheck" and is_finished(kept(d)))
            r["state"] = "done" if done else "started" if d.exists() else "pending"
    return queue


def next_step(queue: dict, verdicts: list[dict] | None = None) -> str:
    """The command of the first phase with an unfinished run; once the gate's runs are done and either failed
    (`gate` of each, or `verdicts` given), the registered stop instead of the comparison's commands."""
    for p in queue["phases"]:
        if p["phase"] in ("primary", "secondary"):
            gate_runs = next(q for q in queue["phases"] if q["phase"] == "gate")["runs"]
            found = verdicts if verdicts is not None else [gate(run_rows(r["dir"])) for r in gate_runs]
            if not all(v["passed"] for v in found):
                return "the gate failed: no comparison runs (amendment 6); report the gate's numbers"
        if any(r["state"] != "done" for r in p["runs"]):
            return p["command"]
    return "every run of the queue is done"


def main(argv: list[str]) -> int:
    cmd, args = (argv[0], argv[1:]) if argv else ("status", [])
    if cmd in ("status", "next", "save"):
        queue = refresh(json.loads(QUEUE.read_text()))
        if cmd == "save":
            QUEUE.write_text(json.dumps(queue, indent=1) + "\n")
        if cmd == "next":
            print(next_step(queue))
            return 0
        for p in queue["phases"]:
            states = [r["state"] for r in p["runs"]]
            print(f"{p['phase']}: " + ", ".join(f"{states.count(s)} {s}" for s in ("done", "started", "pending")))
        return 0
    if cmd in ("keep", "restore"):
        import shutil

        from cispo.records.runfolder import is_finished

        for p in json.loads(QUEUE.read_text())["phases"][1:]:
            for r in p["runs"]:
                d = Path(r["dir"])
                if cmd == "keep" and d.exists() and is_finished(d):
                    print(keep(d))
                elif cmd == "restore" and not d.exists() and is_finished(kept(d)):
                    shutil.copytree(kept(d), d)
                    print(d)
        return 0
    if cmd == "report":
        sys.path.insert(0, str(HERE.parents[2]))  # the repository root: `studies` is not installed
        folders = [kept(p["runs"][0]["dir"]).parent for p in json.loads(QUEUE.read_text())["phases"]
                   if p["phase"] in ("primary", "secondary")]  # the kept runs (`keep` first)
        print(json.dumps(decide(finished_t90s([f for f in folders if f.exists()])), indent=1))
        return 0
    if cmd == "precheck":
        sft, text = Path(args[0]), Path(args[1]).read_text()
        losses = [r["sft/loss"] for r in read_rows(sft) if "sft/loss" in r]
        print(json.dumps(precheck(losses, json.loads(WARM_RARE.read_text())["losses"], eval_numbers(text))))
        return 0
    for run in args:
        rows = read_rows(Path(run))
        print(run, json.dumps(gate(rows) if cmd == "gate" else t90(call_rate_curve(rows))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
