"""Measure a `chain_hidden*` task's shipped base model into one JSON (the gate's task variants).

* ``probe``: `studies.chain_probe.probe` on the task's held-out prompts — per step and per (tens
  digit, addend) pair, the teacher-forced probability of the right / dropped-carry direct result
  and of ``W`` after it, and sampled direct results (``samples_per_step`` draws per step);
* ``measure``: `cispo.models.pretrain.measure_chain_model` for each of `tasks` (accuracy, rechecks,
  the forced-recheck policies) on 300 held-out prompts;
* the model folder's ``SHA256SUMS`` entry for the weights, and the wall time.

    python -m studies.scripts.chain_hidden_base_model chain_hidden 8000 1 chain_hidden,chain_hidden_strict \
        studies/results/v3/gate/chain_hidden_base_model.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from cispo.models.builtin import ensure_builtin_model
from cispo.models.cache import read_checksums
from cispo.models.loading import load_policy
from cispo.models.pretrain import measure_chain_model
from studies.chain_probe import probe


def main(task: str, n_prompts: int, samples_per_step: int, tasks: list[str], out: str) -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    folder = ensure_builtin_model(task, progress=False)
    model, tokenizer = load_policy(folder)
    report = {"command": "python -m studies.scripts.chain_hidden_base_model " + " ".join(sys.argv[1:]),
              "model": str(folder.relative_to(folder.parents[3])),
              "model_sha256": read_checksums(folder)["model.safetensors"],
              "probe": probe(model, tokenizer, task, n_prompts, samples_per_step, seed=0)}
    report["probe_wall_s"] = time.perf_counter() - t0
    report["measure"] = {name: measure_chain_model(model, tokenizer, n=300, seed=0, task_name=name) for name in tasks}
    report["wall_s"] = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), sys.argv[5])
