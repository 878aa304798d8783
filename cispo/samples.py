"""Saved completions: ``<run>/samples.jsonl`` and the rows the metric sinks show as a table.

Every ``log_samples_every`` steps the first ``max_samples_per_step`` responses of the step's
generation batch (whole groups first: rows are in group order) are appended, one JSON object
per line (``SAMPLE_FIELDS``):

* ``prompt``, ``completion`` (cut to ``samples_max_chars`` characters each, ``…`` marks a cut),
  ``reward`` (task reward + shaping), ``task_reward``, ``advantage`` (A_i), ``length``
  (tokens), ``finish_reason``, ``reward_error``;
* ``fork_tokens``: occurrences of the task's reflective (fork) token in the completion
  (None when the task has none);
* ``capped_tokens``: response tokens whose IS weight hit a bound of eq. 5 (w != r), and
  ``ppo_dropped_tokens``: tokens a PPO mask with the objective's eps_low / eps_high would
  drop (eq. 7), both counted at the update that used the row (summed over ``algo.epochs``).

The file stops growing, with one note on stderr, once it would pass ``samples_max_mb``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from cispo.experience import Completion, Experience
from cispo.objective import ObjectiveStats

SAMPLE_FIELDS = ("step", "group", "prompt", "completion", "reward", "task_reward", "advantage", "length",
                 "finish_reason", "fork_tokens", "capped_tokens", "ppo_dropped_tokens", "reward_error")
COUNT_KEYS = ("samples/capped_tokens", "samples/ppo_dropped_tokens")
"""``Experience.extras`` keys of the per-row counts   [B]; present only in steps that log samples."""


def start_token_counts(exp: Experience) -> None:
    """Make ``add_token_counts`` count, in this batch, the capped / PPO-dropped tokens of each row."""
    for key in COUNT_KEYS:
        exp.extras[key] = torch.zeros(len(exp), dtype=torch.long, device=exp.response_mask.device)


@torch.no_grad()
def add_token_counts(exp: Experience, rows: torch.Tensor, stats: ObjectiveStats) -> None:
    """Add the capped (w_it != r_it, eq. 5) and PPO-dropped (M_it = 0, eq. 7) response tokens of
    each row to ``exp.extras``, from the objective's own per-token flags (``stats.capped`` /
    ``stats.ppo_dropped``) of its call on the micro-batch ``exp.select(rows)``; a no-op unless
    ``start_token_counts(exp)`` ran."""
    if COUNT_KEYS[0] not in exp.extras:
        return
    exp.extras[COUNT_KEYS[0]][rows] += stats.capped.sum(-1)  # [b]
    exp.extras[COUNT_KEYS[1]][rows] += stats.ppo_dropped.sum(-1)  # [b]


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + "…"


def sample_records(step: int, groups: list[list[Completion]], exp: Experience, fork_token: str | None,
                   max_rows: int, max_chars: int) -> list[dict]:
    """The first ``max_rows`` responses of the step as ``SAMPLE_FIELDS`` dicts (rows of ``exp``
    are the flattened ``groups``, in order)."""
    flat = [c for group in groups for c in group][:max_rows]
    G = len(groups[0]) if groups else 1
    counts = [exp.extras[k][: len(flat)].tolist() if k in exp.extras else [None] * len(flat) for k in COUNT_KEYS]
    advantages = exp.advantages[: len(flat)].tolist()
    return [
        {
            "step": step,
            "group": i // G,
            "prompt": _cut(str(c.sample.get("prompt", "")), max_chars),
            "completion": _cut(c.text, max_chars),
            "reward": c.reward,
            "task_reward": c.task_reward,
            "advantage": advantages[i],
            "length": c.length,
            "finish_reason": c.finish_reason,
            "fork_tokens": c.text.count(fork_token) if fork_token else None,
            "capped_tokens": counts[0][i],
            "ppo_dropped_tokens": counts[1][i],
            "reward_error": c.reward_error,
        }
        for i, c in enumerate(flat)
    ]


class SampleFile:
    """``samples.jsonl``: appends records until the file would pass ``max_mb`` megabytes."""

    def __init__(self, path: Path, max_mb: float) -> None:
        self.path = Path(path)
        self.max_bytes = int(max_mb * 1e6)
        self.full = False

    def append(self, records: list[dict]) -> bool:
        """Append ``records``; False (and a note on stderr, once) when the size bound stops it."""
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        size = self.path.stat().st_size if self.path.exists() else 0
        if size + len(text.encode()) > self.max_bytes:
            if not self.full:
                print(f"cispo: {self.path} reached samples_max_mb={self.max_bytes / 1e6:g}; no more samples are "
                      f"saved in this run", file=sys.stderr)
            self.full = True
            return False
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
        return True

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after ``step`` (a resumed run samples them again)."""
        if not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def markdown_table(records: list[dict], fields: tuple[str, ...] = SAMPLE_FIELDS[1:]) -> str:
    """``records`` as a Markdown table (TensorBoard's text plugin renders it)."""
    def cell(v) -> str:
        text = "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "⏎")

    head = "| " + " | ".join(fields) + " |\n|" + "---|" * len(fields) + "\n"
    return head + "".join("| " + " | ".join(cell(r.get(f)) for f in fields) + " |\n" for r in records)
