"""Probe (docs/builtin-task.md, `chain`): the `chain` task with a stricter length budget,
``slack`` characters over the shortest correct completion instead of `chain.LENGTH_SLACK`
(22: one unneeded recheck fits). Same shipped base model, same prompts; runs ``cispo`` with
the remaining arguments.

    python -m studies.scripts.chain_strict_probe 0 train task=chain lr=3e-5 prompts_per_step=16 steps=60 \\
        eval.every=5 num_eval_prompts=100 threads=1 out_dir=runs run_name=chain_strict_cispo_s0
"""

from __future__ import annotations

import sys
from dataclasses import replace
from functools import partial

import cispo.data.tasks as tasks
from cispo.cli import main
from cispo.data.tasks import chain


def strict_chain(slack: int) -> tasks.Task:
    """The registered `chain` task whose reward uses `slack` (a picklable partial)."""
    return replace(tasks.get_task("chain"), reward=partial(chain.reward, slack=slack))


if __name__ == "__main__":
    slack = int(sys.argv[1])
    task = strict_chain(slack)
    tasks._REGISTRY["chain"] = lambda: task   # this process only; the shipped base model still applies
    sys.exit(main(sys.argv[2:]))
