"""What a run says while it runs, from its first second: a line per start-up phase (the reward workers,
the model, the held-out evaluation's cost where it dominates), the evaluation's own progress bar, and
each step, on a progress bar at a terminal, or as one plain line per step where there is none (a batch
job's log) or ``progress=false``.

Everything goes to stderr (the standard output keeps the summary and the run folder's line); `runner`
prints only on the main rank. Plain Python and tqdm: nothing here changes what a run computes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from cispo.foundations.nan import is_nan

PROGRESS_KEYS = {  # metric -> short label on the progress bar and the step lines
    "rollout/reward_mean": "reward",
    "rollout/fork_rate": "fork",
    "rollout/tool_call_rate": "tools",  # an agent run's share of responses that called a tool (beside fork)
    "objective/frac_capped": "capped",
    "eval/accuracy": "eval_acc",
    "eval/reward_mean": "eval_reward",  # in place of eval/accuracy where the reward is no 0/1 verifier's
}
KEPT_LABELS = ("eval_acc", "eval_reward")
"""Labels shown from the last step that had them: the held-out numbers stay on the bar between evaluations."""


def say(message: str) -> None:
    """``cispo: <message>`` on stderr, flushed (a batch job's log shows it at once)."""
    print(f"cispo: {message}", file=sys.stderr, flush=True)


def interactive(progress: bool, stream=None) -> bool:
    """Whether to draw progress bars: ``progress`` is on and stderr is a terminal that reports a width other
    than 0. Elsewhere (a log file, a pipe, a 0-column console, ``progress=false``) the run prints plain lines
    instead of a bar's redraws."""
    stream = sys.stderr if stream is None else stream
    return bool(progress) and hasattr(stream, "isatty") and stream.isatty() and terminal_columns(stream) != 0


def terminal_columns(stream) -> int | None:
    """The width the terminal behind ``stream`` reports; None where it says none. A terminal that reports 0
    columns (some container and CI consoles) would get a bar tqdm draws nowhere: plain lines there instead."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's fake), or not a terminal's
        return None


def duration(seconds: float) -> str:
    """``42 s``, ``9 min 30 s``, ``2 h 5 min``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


# --------------------------------------------------------------------------- start-up phases


def reward_workers_line(reward_members) -> str | None:
    """The start-up line of the reward worker processes a run starts (``members_of(task.reward)``: each
    isolated `cispo.data.rewards.loading.Reward`), or None when every reward runs in this process."""
    pools = [(m.workers, m.spec) for m in reward_members if getattr(m, "isolated", False)]
    if not pools:
        return None
    what = "; ".join(f"{n} for {spec}" for n, spec in pools)
    total = sum(n for n, _ in pools)
    return (f"reward workers: starting {total} process{'es' * (total != 1)} ({what}; data.reward_isolation), "
            "loading the reward while the model loads")


def model_line(model, seconds: float) -> str:
    """The line that says the policy is loaded: its size, dtype and device, and how long it took."""
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    size = f"{count / 1e6:.1f}M" if count >= 1e5 else f"{count / 1e3:.1f}k"
    first = params[0] if params else None
    where = f", {str(first.dtype).removeprefix('torch.')} on {first.device}" if first is not None else ""
    return f"model: ready in {duration(seconds)} ({size} parameters{where})"


# --------------------------------------------------------------------------- the evaluations' cost


def evaluation_count(steps: int, every: int, start: int = 0) -> int:
    """Held-out evaluations a run makes from ``start`` on: step 0's (a fresh start), every ``every``-th step
    after ``start`` (0: none), and the last step's."""
    count = int(start == 0)
    if steps <= start:
        return count
    periodic = steps // every - start // every if every else 0
    return count + periodic + int(not every or steps % every != 0)


def evaluation_plan(cfg, prompts: int, answers_per_prompt: int, max_new_tokens: int, start: int = 0) -> str | None:
    """One line, when the held-out evaluations would sample more answers than the training does (then they
    take most of the run's time): how many, and the settings that size them; None otherwise. ``prompts``:
    held-out prompts of one evaluation, the named sets' included; ``answers_per_prompt``: greedy + k."""
    evals = evaluation_count(cfg.steps, cfg.eval.every, start)
    eval_answers = evals * prompts * answers_per_prompt
    train_answers = max(0, cfg.steps - start) * cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if not eval_answers or eval_answers <= train_answers:
        return None
    k = answers_per_prompt - 1
    each = "greedy" + (f" + {k} sampled" if k else "")
    return (f"held-out evaluation will take most of this run: {evals} evaluation{'s' * (evals != 1)} of {prompts} "
            f"prompts x ({each}) = {eval_answers:,} answers of up to {max_new_tokens} tokens, against "
            f"{train_answers:,} sampled for training; data.num_eval_prompts, eval.num_samples and eval.every "
            "size it (the time of the first one is said when it ends)")


def evaluation_done_line(step: int, seconds: float, metrics: dict, remaining: int) -> str:
    """The line after an evaluation at start-up: its time, its headline number, and what the ``remaining``
    evaluations of the run will take at that rate."""
    key = "eval/accuracy" if "eval/accuracy" in metrics else "eval/reward_mean"
    value = metrics.get(key)
    shown = f" ({key} {value:.3f})" if isinstance(value, float) and not is_nan(value) else ""
    later = (f"; {remaining} more in this run, about {duration(remaining * seconds)} in all" if remaining > 0 else "")
    return f"step-{step} evaluation: done in {duration(seconds)}{shown}{later}"


@contextlib.contextmanager
def evaluation_progress(prompts: int, answers_per_prompt: int, title: str, bar: bool):
    """A function to call with each number of answers scored, for an evaluation of ``prompts`` x
    ``answers_per_prompt`` answers: at a terminal (``bar``) a progress bar of its own, redrawn every second so
    the clock moves while a chunk of prompts is sampled; otherwise a line that says it started (`say`)."""
    total, k = prompts * answers_per_prompt, answers_per_prompt - 1
    if not bar:
        each = f"greedy + {k} sampled" if k else "greedy only"
        say(f"{title}: {prompts:,} held-out prompts, {each}: {total:,} answers ...")
        yield lambda n: None
        return
    from tqdm.auto import tqdm

    progress = tqdm(total=total, desc=f"cispo {title}", unit="answer", dynamic_ncols=True, leave=False)
    stop = threading.Event()
    ticker = threading.Thread(target=_redraw_until, args=(progress, stop), daemon=True)
    ticker.start()
    try:
        yield progress.update
    finally:
        stop.set()
        ticker.join()
        progress.close()


def _redraw_until(progress, stop: threading.Event, every: float = 1.0) -> None:
    """Redraw ``progress`` (its elapsed time) every ``every`` seconds until ``stop`` is set."""
    while not stop.wait(every):
        progress.refresh()


# --------------------------------------------------------------------------- the steps


class StepProgress:
    """Each finished step said: on a tqdm bar (``bar``: one to draw on, None for plain lines), or as one
    line ``cispo: step N: reward ..., eval_acc ...; 3.2 s (N/steps)``. The held-out numbers (`KEPT_LABELS`)
    stay shown from the last evaluation until the next."""

    def __init__(self, bar, steps: int, clock=time.monotonic) -> None:
        self.bar, self.steps, self.clock = bar, steps, clock
        self.kept: dict[str, str] = {}
        self.last = clock()

    def keep(self, metrics: dict) -> None:
        """Hold the held-out numbers of ``metrics`` (an evaluation before the first step) for the next steps."""
        self.shown(metrics)

    def shown(self, metrics: dict) -> dict[str, str]:
        """The step's labels and values (NaN left out), the kept held-out ones where it has none."""
        shown = {label: f"{metrics[k]:.3f}" for k, label in PROGRESS_KEYS.items()
                 if k in metrics and not is_nan(metrics[k])}
        self.kept.update({label: v for label, v in shown.items() if label in KEPT_LABELS})
        return {**shown, **{label: v for label, v in self.kept.items() if label not in shown}}

    def advance(self, step: int, metrics: dict, no_update: str | None = None) -> None:
        """Step ``step`` is done with ``metrics``; ``no_update``: why it made no optimizer update, if it made none."""
        shown, now = self.shown(metrics), self.clock()
        seconds, self.last = now - self.last, now
        if self.bar is not None:
            if no_update is not None:
                shown["updates"] = "0 (no update this step)"
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
            return
        values = ", ".join(f"{label} {value}" for label, value in shown.items())
        said = "; ".join(part for part in (no_update and f"no update ({no_update})", values) if part)
        say(f"step {step}: {said or 'done'}; {duration(seconds)} ({step}/{self.steps})")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def step_progress(progress: bool, steps: int, start: int) -> StepProgress:
    """The run's `StepProgress`: a tqdm bar at a terminal with ``progress`` on, plain lines otherwise."""
    bar = None
    if interactive(progress):
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=start, desc="cispo train", unit="step", dynamic_ncols=True)
    return StepProgress(bar, steps)
