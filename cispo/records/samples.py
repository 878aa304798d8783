"""Saved completions: ``<run>/samples.jsonl`` and the rows the metric sinks show as a table.

Every ``log_samples_every`` steps the first ``max_samples_per_step`` responses of the step's
generation batch (whole groups first: rows are in group order) are appended, one JSON object
per line (``SAMPLE_FIELDS``):

* ``prompt``, ``completion`` (cut to ``samples_max_chars`` characters each, ``…`` marks a cut),
  ``reward`` (task reward + shaping), ``task_reward``, ``advantage`` (A_i; under
  ``algo.turn_credit=reward_to_go`` a list, each policy segment's A_{i,k}), ``length`` (tokens),
  ``finish_reason``, ``reward_error``;
* ``fork_tokens``: occurrences of the task's reflective (fork) strings in the completion's text
  (``cispo.foundations.forks.count_in_text``; None when the task tracks none);
* ``capped_tokens``: response tokens whose IS weight hit a bound of eq. 5 (w != r), and
  ``ppo_dropped_tokens``: tokens a PPO mask with the objective's eps_low / eps_high would
  drop (eq. 7), both counted at the update that used the row (summed over ``algo.epochs``).

A step that kept no group saves the groups it sampled and dropped (advantage and counts None).
The file stops growing, with one note on stderr, once it would pass ``samples_max_mb``.

``cispo eval --samples FILE`` writes every completion of its evaluation (`eval_records`), whole.
"""

from __future__ import annotations

import os
import sys
import warnings
from itertools import accumulate
from pathlib import Path

import torch

from cispo.foundations.experience import Completion, Experience
from cispo.foundations.forks import count_in_text
from cispo.foundations.jsonl import parse_step_lines
from cispo.foundations.text import valid_json_line
from cispo.objective.advantages import segment_index
from cispo.objective.loss import ObjectiveStats

SAMPLE_FIELDS = ("step", "group", "prompt", "completion", "reward", "task_reward", "advantage", "length",
                 "finish_reason", "fork_tokens", "capped_tokens", "ppo_dropped_tokens", "reward_error",
                 "templated_prompt")
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


def sample_records(step: int, groups: list[list[Completion]], exp: Experience | None, fork_tokens: tuple[str, ...],
                   max_rows: int, max_chars: int, decode=None) -> list[dict]:
    """The first ``max_rows`` responses of the step as ``SAMPLE_FIELDS`` dicts (rows of ``exp``
    are the flattened ``groups``, in order; ``exp`` None: groups no update used, dropped by dynamic
    sampling, whose advantage and token counts are null). ``decode(ids) -> str``: the tokenizer's,
    to record the prompt as the model saw it (``templated_prompt``: system prompt and chat template
    included); None: no such field (null)."""
    flat = [c for group in groups for c in group][:max_rows]
    G = len(groups[0]) if groups else 1
    extras = exp.extras if exp is not None else {}
    spans = episode_spans(flat)  # each episode's training rows of exp
    counts = [[sum(extras[k][a:b].tolist()) for a, b in spans] if k in extras else [None] * len(flat)
              for k in COUNT_KEYS]
    n_rows = spans[-1][1] if spans else 0
    by_row = row_advantages(exp, n_rows) if exp is not None else [None] * n_rows
    advantages = [by_row[a] if exp is None or exp.advantages.dim() == 1 else
                  [x for j in range(a, b) for x in by_row[j]] for a, b in spans]
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
            "fork_tokens": sum(count_in_text(fork_tokens, c.text)) if fork_tokens else None,
            "capped_tokens": counts[0][i],
            "ppo_dropped_tokens": counts[1][i],
            "reward_error": c.reward_error,
            "templated_prompt": _cut(decode(c.prompt_ids), max_chars) if decode else None,
            **episode_fields(c, max_chars),
        }
        for i, c in enumerate(flat)
    ]


def episode_spans(episodes: list[Completion]) -> list[tuple[int, int]]:
    """Each episode's training rows of the step's batch, ``(first, end)``: one row each but where a context
    rewrote the history (`Completion.rows`), laid out in order."""
    ends = list(accumulate(len(c.rows) for c in episodes))
    return [(end - len(c.rows), end) for c, end in zip(episodes, ends)]


def row_advantages(exp: Experience, n: int) -> list:
    """The first ``n`` rows' advantages: A_i each, or with per-token advantages (``algo.turn_credit=reward_to_go``)
    the list of each policy segment's A_{i,k}, in order (the value at the segment's first token)."""
    if exp.advantages.dim() == 1:
        return exp.advantages[:n].tolist()
    index = segment_index(1 - exp.response_mask[:n].long())  # k, or -1 off the policy's tokens   [n, T]
    before = torch.nn.functional.pad(index, (1, 0), value=-1)[:, :-1]  # [n, T]
    first = (index >= 0) & (index != before)  # a segment's first token   [n, T]
    return [exp.advantages[i][first[i]].tolist() for i in range(len(index))]


def episode_fields(c: Completion, max_chars: int) -> dict:
    """A multi-turn completion's ``policy_length`` (its own tokens; ``length`` counts the observations
    too), ``tool_calls``, ``tool_errors``, ``calls`` (name, arguments, error, seconds of each),
    ``segments`` (each with its ``role``, ``policy`` or ``tool``, and ``text``) and ``turn_rewards`` (the
    environment's reward of each policy segment; ``reward`` is the final one), and an agent program's
    ``agent`` (its calls, how it ended, its reward and error: ``cispo.envs.agent_env``); nothing for a
    single-turn one."""
    if c.episode is None:
        return {}
    segments = [{**seg, "text": _cut(str(seg.get("text", "")), max_chars)} for seg in c.episode.get("segments", [])]
    rows = {"rows": len(c.rows)} if c.continuations else {}
    if "agent" in c.episode:
        rows["agent"] = c.episode["agent"]
    return {"policy_length": c.policy_length, "tool_calls": c.episode.get("tool_calls", 0),
            "tool_errors": c.episode.get("tool_errors", 0), "calls": c.episode.get("calls", []),
            "segments": segments, "turn_rewards": c.turn_rewards, **rows}


HELD_OUT = "held_out"
"""The ``set`` of `eval_records` for the held-out prompts (``data.eval_sets`` go by their names)."""


def eval_records(set_name: str, mode: str, groups: list[list[Completion]], answer_fn=None) -> list[dict]:
    """``cispo eval --samples``: one record per completion of an evaluation (``evaluate``'s
    ``on_groups``): ``set``, ``mode`` (greedy / sampled), ``prompt_index``, ``sample_index`` (of
    the k), the whole ``prompt`` and ``completion``, ``reward``, ``parsed_answer``
    (``answer_fn`` of the text the reward scored, `Completion.answer_text`; None without one),
    ``reference_answer`` (the sample's ``answer``), ``length``, ``finish_reason``,
    ``reward_error``."""
    return [{"set": set_name, "mode": mode, "prompt_index": g, "sample_index": j,
             "prompt": c.sample.get("prompt"), "completion": c.text, "reward": c.task_reward,
             "parsed_answer": answer_fn(c.answer_text) if answer_fn else None,
             "reference_answer": c.sample.get("answer"), "length": c.length, "finish_reason": c.finish_reason,
             "reward_error": c.reward_error}
            for g, group in enumerate(groups) for j, c in enumerate(group)]


def rows_up_to(path: Path, step: int) -> list[dict]:
    """The rows of a run's step file (``metrics.jsonl``, ``samples.jsonl``) of steps <= ``step``, as a resume
    keeps them: torn, NUL-filled or unreadable lines dropped (`parse_step_lines`) with one warning naming
    them when ``step >= 0`` (a resume; a fresh start clears the file silently)."""
    rows, bad, _ = parse_step_lines(path)
    if bad and step >= 0:
        lines = "; ".join(f"line {n}: {what}" for n, what in bad)
        warnings.warn(f"cispo: {path}: dropped {len(bad)} unreadable line(s) on resume ({lines})",
                      RuntimeWarning, stacklevel=3)
    return [r for r in rows if r["step"] <= step]


def check_run_file(path: Path) -> None:
    """ConfigError when a run's file (``metrics.jsonl``, ``samples.jsonl``) exists but is not a regular
    file (a folder, a FIFO): resuming would otherwise fail on it with a library traceback."""
    if path.exists() and not path.is_file():
        from cispo.config.engine import ConfigError

        raise ConfigError(f"{path} is not a file (a folder or a device?): this run folder is damaged; move it "
                          "aside to resume the run, or start a new run")


def replace_atomically(path: Path, text: str) -> None:
    """``path`` now holds ``text`` (UTF-8), or, after a crash, its old content: a fsynced temporary
    file renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SampleFile:
    """``samples.jsonl``: appends records until the file would pass ``max_mb`` megabytes."""

    def __init__(self, path: Path, max_mb: float) -> None:
        self.path = Path(path)
        self.max_bytes = int(max_mb * 1e6)
        self.full = False

    def append(self, records: list[dict]) -> bool:
        """Append ``records``; False (and a note on stderr, once) when the size bound stops it. Text UTF-8
        cannot write (a lone surrogate, in a tool call's JSON arguments say) is replaced (`valid_json_line`)."""
        text = "".join(valid_json_line(r) + "\n" for r in records)
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
        """Drop the records of steps after ``step`` (a resumed run samples them again), and torn or
        non-UTF-8 lines (a kill or a full disk during an append) with a warning naming them; the
        file is replaced atomically."""
        check_run_file(self.path)
        if not self.path.exists():
            return
        replace_atomically(self.path, "".join(valid_json_line(r) + "\n"
                                              for r in rows_up_to(self.path, step)))


def markdown_table(records: list[dict], fields: tuple[str, ...] = SAMPLE_FIELDS[1:]) -> str:
    """``records`` as a Markdown table (TensorBoard's text plugin renders it)."""
    def cell(v) -> str:
        text = "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "⏎")

    head = "| " + " | ".join(fields) + " |\n|" + "---|" * len(fields) + "\n"
    return head + "".join("| " + " | ".join(cell(r.get(f)) for f in fields) + " |\n" for r in records)
