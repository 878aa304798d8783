"""Held-out evaluation: greedy and sampled accuracy, pass@k and maj@k.

Runs the policy's sampler on held-out prompts (``cispo.training.sampling.sample_groups``, the same
rollout and scoring as training) with no update; ``cispo train`` calls it every
``eval.every`` steps, ``cispo eval`` once.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from cispo.foundations.experience import Completion
from cispo.models.policy import Policy
from cispo.rollout import SamplingConfig
from cispo.training.metrics import episode_metrics, reports_accuracy, reward_metrics, tracked_fork
from cispo.training.sampling import Scoring, sample_groups

if TYPE_CHECKING:
    from cispo.config.train import EvalConfig


DEFAULT_NUM_SAMPLES = 4
"""``eval.num_samples`` where it is None and no task says otherwise (a prompt file, a bare `evaluate` call)."""
CHUNK = 256
"""Prompts sampled at once: the batches, and so the random draws, of an evaluation (fixed: a change would change
the sampled answers)."""


def sample_count(eval_cfg: EvalConfig, default: int = DEFAULT_NUM_SAMPLES) -> int:
    """k, the sampled answers per held-out prompt: ``eval.num_samples``, else ``default`` (the task's own,
    ``Task.eval_num_samples``) raised to the largest k of ``eval.pass_at_k``."""
    if eval_cfg.num_samples is not None:
        return eval_cfg.num_samples
    return max([default, *(eval_cfg.pass_at_k or [])])


def answers_per_prompt(eval_cfg: EvalConfig) -> int:
    """Responses an evaluation samples per held-out prompt: the greedy one and k (`sample_count`)."""
    return 1 + sample_count(eval_cfg)


@dataclass
class Evaluation:
    """One held-out evaluation's settings: ``reward_fn`` (each call killed past ``reward_timeout_s``,
    ``data.reward_timeout_s``), ``eval_cfg`` (``eval.*``), the token budget, the ``seed`` of the sampled
    answers; ``used_fork(text)`` (the task's fork strings, None: none tracked), ``answer_fn(text)`` (the answer
    maj@k votes on), ``accuracy`` (False: the reward is no 0/1 verifier, `reports_accuracy`), and the hooks
    ``on_groups(mode, groups)`` and ``on_progress(n)``."""

    reward_fn: Callable
    eval_cfg: EvalConfig
    max_new_tokens: int
    seed: int
    used_fork: Callable | None = None
    answer_fn: Callable | None = None
    reward_timeout_s: float | None = None
    accuracy: bool = True
    on_groups: Callable | None = None
    on_progress: Callable | None = None
    policy_text: bool = False
    """The reward reads the policy's own text, not the transcript (`cispo.training.sampling.Scoring`)."""

    @staticmethod
    def of_task(task, cfg, max_new_tokens: int, seed: int, on_progress: Callable | None = None) -> Evaluation:
        """The settings a run's config ``cfg`` gives for ``task`` (its reward, fork strings and answers)."""
        return Evaluation(task.reward, cfg.eval, max_new_tokens, seed, tracked_fork(task), task.extract_answer,
                          cfg.data.reward_timeout_s, reports_accuracy(task), on_progress=on_progress,
                          policy_text=task.scores_policy_text)


@torch.no_grad()
def evaluate(policy: Policy, samples: list[dict], settings: Evaluation) -> dict:
    """Held-out accuracy (``settings``: `Evaluation`): greedy, and over ``eval_cfg.num_samples`` = k samples per
    prompt at ``eval_cfg.temperature`` the mean (avg@k), pass@k and maj@k (``group_accuracies``; at each k of
    ``eval.pass_at_k`` too, `pass_at`; k = 0: greedy only, and ``eval/accuracy``, the fork rate, the
    length and ``eval/truncated`` (the share cut at ``max_new_tokens``) are the greedy answers';
    ``answer_fn(completion)`` gives the answer maj@k votes on). Each reward call is killed past
    ``reward_timeout_s`` (``data.reward_timeout_s``). ``on_groups(mode, groups)``, if given, gets
    the scored completions of each mode (``"greedy"``, ``"sampled"``; a group per prompt). Each
    ``data.reward``'s mean and std (``eval/rewards/<name>/...``) and the calls' extras
    (``eval/reward_extra/<key>``) are over the completions ``eval/accuracy`` is. ``accuracy=False``
    (`cispo.training.metrics.reports_accuracy`: the reward is no 0/1 verifier) says every accuracy as
    a reward (`reward_named`). ``on_progress(n)``, if given, is told of each ``n`` answers scored (a chunk
    of `CHUNK` prompts at a time), of `answers_per_prompt` per prompt in all."""
    if not samples:
        return {}
    ev, eval_cfg, max_new_tokens = settings, settings.eval_cfg, settings.max_new_tokens
    answer_fn, used_fork = ev.answer_fn, ev.used_fork
    generator = torch.Generator(device=policy.device).manual_seed(ev.seed)
    scoring = Scoring(ev.reward_fn, ev.reward_timeout_s, policy_text=ev.policy_text)
    greedy = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    sampled = SamplingConfig(max_new_tokens=max_new_tokens, temperature=eval_cfg.temperature)
    out, errors, num_samples = {}, [], sample_count(eval_cfg)
    modes = [("greedy", greedy, 1)] + [("sampled", sampled, num_samples)] * (num_samples > 0)
    for name, sampling, k in modes:
        groups = []
        for start in range(0, len(samples), CHUNK):
            with answers_told(policy, ev.on_progress, k * len(samples[start : start + CHUNK])):
                groups += sample_groups(policy, samples[start : start + CHUNK], k, sampling, scoring, generator)
        if ev.on_groups is not None:
            ev.on_groups(name, groups)
        flat = [c for g in groups for c in g]
        acc = sum(c.task_reward for c in flat) / len(flat)
        errors += [c.reward_error for c in flat if c.reward_error]
        if name == "greedy":
            out["eval/accuracy_greedy"] = acc
            if len(modes) > 1:
                continue
        else:
            out[f"eval/accuracy_mean_at_{k}"] = acc
            out.update({f"eval/accuracy_{m}_at_{k}": v for m, v in group_accuracies(groups, answer_fn).items()})
            for j in sorted(set(eval_cfg.pass_at_k or []) - {k}):  # eval.pass_at_k: the other k
                out.update({f"eval/accuracy_{m}_at_{j}": v for m, v in group_accuracies(groups, answer_fn, j).items()})
        out["eval/accuracy"] = acc  # mean@k; greedy when k = 0 (eval.num_samples=0)
        if used_fork:
            fork = [c for c in flat if used_fork(c.text)]
            rest = [c for c in flat if not used_fork(c.text)]
            out["eval/fork_rate"] = len(fork) / len(flat)
            out["eval/accuracy_with_fork"] = sum(c.task_reward for c in fork) / len(fork) if fork else float("nan")
            out["eval/accuracy_without_fork"] = sum(c.task_reward for c in rest) / len(rest) if rest else float("nan")
        out.update(reward_metrics(flat, "eval/"))
        out.update(episode_metrics(flat, "eval/"))  # tool calls, with an environment
        out["eval/response_length"] = sum(c.policy_length for c in flat) / len(flat)
        out["eval/truncated"] = sum(c.finish_reason == "length" for c in flat) / len(flat)  # cut at max_new_tokens
    out["eval/reward_errors"] = float(len(errors))  # greedy and sampled calls together
    if errors:
        print(f"cispo: evaluation: {len(errors)} reward call(s) failed and scored 0 (first: {errors[0]})",
              file=sys.stderr)
    return out if ev.accuracy else reward_named(out)


@contextlib.contextmanager
def answers_told(policy: Policy, on_progress: Callable | None, answers: int):
    """``on_progress(n)`` told of a chunk's ``answers`` as ``policy``'s sampler stops them (`Sampler.rows_done`:
    a bar that moves while the chunk decodes, not 0 then all), the rest when the chunk is done and scored (an
    engine that tells nothing: all of them then). None: nothing told."""
    if on_progress is None:
        yield
        return
    told = 0

    def tick(n: int) -> None:
        nonlocal told
        n = min(n, answers - told)
        if n > 0:
            told += n
            on_progress(n)

    sampler = policy.sampler
    previous, sampler.rows_done = sampler.rows_done, tick
    try:
        yield
    finally:
        sampler.rows_done = previous
    tick(answers - told)


def reward_named(metrics: dict) -> dict:
    """``metrics`` with each accuracy said as what it is, the mean of a reward that is no 0/1 verdict:
    ``eval/accuracy`` -> ``eval/reward_mean``, ``eval/accuracy_<x>`` -> ``eval/reward_<x>``
    (``eval/reward_greedy``, ``eval/reward_pass_at_4``, ...); the other names as they are."""
    def renamed(key: str) -> str:
        if key == "eval/accuracy":
            return "eval/reward_mean"
        return "eval/reward_" + key.removeprefix("eval/accuracy_") if key.startswith("eval/accuracy_") else key

    return {renamed(key): value for key, value in metrics.items()}


def evaluate_sets(policy: Policy, sets: dict[str, list[dict]], settings: Evaluation) -> dict:
    """`evaluate` on each named set (``data.eval_sets``), its metrics renamed
    ``eval/<metric>`` -> ``eval/<name>/<metric>``; ``settings.on_groups(name, mode, groups)`` (here with the
    set's name first) and ``on_progress`` as `evaluate`'s."""
    out = {}
    for name, samples in sets.items():
        hook = None if settings.on_groups is None else functools.partial(settings.on_groups, name)
        metrics = evaluate(policy, samples, replace(settings, on_groups=hook))
        out.update(set_metrics(metrics, name))
    return out


def set_metrics(metrics: dict, name: str) -> dict:
    """``{"eval/accuracy": a}`` -> ``{"eval/<name>/accuracy": a}``."""
    return {f"eval/{name}/{key.removeprefix('eval/')}": v for key, v in metrics.items()}


def pass_at(rewards: list[float], k: int) -> float:
    """The expected best reward of k answers drawn without replacement from the n = ``len(rewards)`` given:
    sum_i r_(i) C(i-1, k-1) / C(n, k) over the rewards sorted up (i = 1..n). For 0/1 rewards it is the
    unbiased pass@k estimator, 1 - C(n-c, k) / C(n, k) with c right (Chen et al. 2021); at k = n, the max."""
    n = len(rewards)
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n = {n} answers, got k = {k}")
    if k == n:
        return max(rewards)
    total = math.comb(n, k)  # int / int: a correctly rounded float however large the counts
    return sum(r * (math.comb(i, k - 1) / total) for i, r in enumerate(sorted(rewards)))


def group_accuracies(groups: list[list[Completion]], answer_fn=None, k: int | None = None) -> dict[str, float]:
    """Over prompts (one group of n samples each), the mean of
    pass@k = `pass_at` (for 0/1 verifiers: at least one of k is right; at k = n: max_j R_j), and
    maj@k  = R of the most frequent answer among the group's first k (``answer_fn`` of `Completion.answer_text`,
    default the stripped text; None answers do not vote; a tie goes to the answer seen first; no answer at all: 0).
    ``k``: None, the whole group."""
    answer_fn = answer_fn or str.strip
    pass_k, maj_k = [], []
    for group in groups:
        size = len(group) if k is None else k
        pass_k.append(pass_at([c.task_reward for c in group], size))
        votes: dict[str, list[Completion]] = {}
        for c in group[:size]:
            answer = answer_fn(c.answer_text)
            if answer is not None:
                votes.setdefault(answer, []).append(c)
        best = max(votes.values(), key=len, default=None)  # first of the largest: insertion order
        maj_k.append(best[0].task_reward if best else 0.0)
    n = max(len(groups), 1)
    return {"pass": sum(pass_k) / n, "maj": sum(maj_k) / n}
