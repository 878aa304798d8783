"""Issue 60 item 3's registered analysis (protocol.md): is ``algo.minibatch_order=by_group`` non-inferior to
``random`` on held-out accuracy? Reads the run folders of ``builtin.yaml`` (``{arm}__{task}__K{K}__seed{s}``).

    python studies/results/speed_defaults/noninferiority.py status runs/speed_defaults/builtin   # runs done / to do
    python studies/results/speed_defaults/noninferiority.py table runs/speed_defaults/builtin    # the verdict
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: `studies` is not installed
from cispo.records.tracking import read_metrics  # noqa: E402
from studies.stats import final_accuracy, mean_accuracy, paired_t  # noqa: E402

ARMS = ("random", "by_group")
DELTA = {"builtin": 0.02, "smollm2": 0.03}
"""The non-inferiority margins fixed in protocol.md before any run."""
SEEDS = {"builtin": 10, "smollm2": 6}
"""The paired seeds each part registered: no decision before all of them have run."""


def runs(folder: Path) -> dict[tuple[str, int], list[dict]]:
    """``{(arm, seed): metrics rows}`` of the finished runs in `folder` (a run is finished when it has its
    ``summary.json``, written when it ends)."""
    out = {}
    for d in sorted(p for p in folder.iterdir() if p.is_dir() and "__seed" in p.name):
        arm, seed = d.name.split("__")[0], int(d.name.rsplit("__seed", 1)[1])
        rows = read_metrics(d / "metrics.jsonl")
        if arm in ARMS and rows and (d / "summary.json").exists():
            out[arm, seed] = rows
    return out


def curve(rows: list[dict]) -> dict[int, float]:
    """``{step: eval/accuracy}`` of a run's rows."""
    return {r["step"]: r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None}


def acts(a: list[dict], b: list[dict]) -> bool:
    """The protocol's check that the setting acts (amendment 1): the ``objective/*`` metrics of the first step at
    which both runs made an update differ between the two runs (step 1 wherever it updated)."""
    def objective(rows):
        return {r["step"]: {k: v for k, v in r.items() if k.startswith("objective/")} for r in rows}
    oa, ob = objective(a), objective(b)
    first = min((s for s in oa if oa[s] and ob.get(s)), default=None)
    return first is not None and oa[first] != ob[first]


def verdict(done: dict, delta: float, registered: int) -> list[str]:
    """The table: per seed the two measures of each arm and d; then the paired means, the one-sided 95 % lower
    bound of the primary and the decision."""
    seeds = sorted({s for (_, s) in done if all((arm, s) in done for arm in ARMS)})
    lines = ["| seed | mean acc random | mean acc by_group | d | final random | final by_group | setting acts |",
             "|---|---|---|---|---|---|---|"]
    d_mean, d_final, void = [], [], []
    for s in seeds:
        a, b = done["random", s], done["by_group", s]
        ma, mb = mean_accuracy(curve(a)), mean_accuracy(curve(b))
        fa, fb = final_accuracy(curve(a)), final_accuracy(curve(b))
        d_mean.append(mb - ma)
        d_final.append(fb - fa)
        void += [] if acts(a, b) else [s]
        lines.append(f"| {s} | {ma:.4f} | {mb:.4f} | {mb - ma:+.4f} | {fa:.4f} | {fb:.4f} | {s not in void} |")
    if len(seeds) < 2:
        return lines + ["", f"{len(seeds)} paired seed(s): no verdict"]
    one_sided = paired_t(d_mean, level=0.90)  # its lower end is the one-sided 95 % bound
    two_sided = paired_t(d_final, level=0.95)
    ok = one_sided.lo > -delta and not void
    return lines + [
        "",
        f"primary (mean held-out accuracy after step 0), by_group - random over {len(seeds)} paired seeds: "
        f"{one_sided.mean:+.4f}, one-sided 95 % lower bound {one_sided.lo:+.4f} (margin -{delta})",
        f"secondary (final accuracy), by_group - random: {two_sided.mean:+.4f}, 95 % interval "
        f"[{two_sided.lo:+.4f}, {two_sided.hi:+.4f}] (descriptive)",
        "the setting acted in every seed" if not void else f"VOID: the two arms' runs are identical in seeds {void}",
        f"decision: by_group is {'non-inferior' if ok else 'NOT shown non-inferior'} (protocol.md)"
        if len(seeds) >= registered else f"no decision: {len(seeds)} of the {registered} registered seeds paired",
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("status", "table"):
        print(__doc__)
        return 2
    folder = Path(argv[1])
    done = runs(folder) if folder.is_dir() else {}
    if argv[0] == "status":
        print(f"{len(done)} finished run(s): " + ", ".join(f"{a} seed {s}" for a, s in sorted(done)))
        return 0
    part = "smollm2" if "smollm2" in folder.name else "builtin"
    print("\n".join(verdict(done, DELTA[part], SEEDS[part])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
