"""Prompt data: an endless, seeded, checkpointable stream of samples, and dynamic sampling.

A *sample* is a dict with at least ``prompt`` (str); every other field (``answer``, …) is
passed on to the reward as keyword arguments.

Dynamic sampling (DAPO, arXiv 2503.14476, section 3.2): a group whose G rewards are all
equal has zero advantage everywhere and contributes no gradient; drop it and sample new
prompts until the batch holds the configured number of informative groups, within a cap
on the number of generation rounds.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from cispo.foundations.forks import normalise, used_any

Group = TypeVar("Group")


class PromptStream:
    """Shuffled epochs over ``samples``, forever. Epoch e's order is a permutation drawn from
    ``seed`` and e alone, so the stream's position (epoch, index) is its whole state."""

    def __init__(self, samples: Sequence[dict], seed: int) -> None:
        if len(samples) == 0:
            raise ValueError("PromptStream needs at least one sample")
        self.samples = list(samples)
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)
        self.retired: set[int] = set()  # samples no longer taken (`retire`)
        self.all_retired = 0  # times every sample was retired and all were handed out again
        self._position = {id(s): i for i, s in enumerate(self.samples)}

    def index_of(self, sample: dict) -> int:
        """The position of ``sample`` (one this stream handed out) in ``samples``."""
        i = self._position.get(id(sample))
        if i is None:
            raise KeyError("not a sample of this stream")
        return i

    def retire(self, sample: dict) -> bool:
        """Take ``sample`` (one this stream handed out) no more (ScaleRL's No-Positive-Resampling);
        True if it was not retired yet. Once every sample is retired, ``take`` hands them all out again."""
        i = self._position.get(id(sample))
        if i is None or i in self.retired:
            return False
        self.retired.add(i)
        return True

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.samples), generator=g).tolist()

    def take(self, n: int) -> list[dict]:
        """The next ``n`` samples (crossing epoch boundaries as needed), retired ones skipped."""
        if len(self.retired) == len(self.samples):
            if not self.all_retired:  # said once: with few prompts it can come every step
                print(f"cispo: data.retire_pass_rate: all {len(self.samples)} training prompts retired; sampling them "
                      "all again (each time it happens again; said once)", file=sys.stderr)
            self.all_retired += 1
            self.retired.clear()
        out = []
        while len(out) < n:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            i = self._order[self.index]
            self.index += 1
            if i not in self.retired:
                out.append(self.samples[i])
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_samples": len(self.samples),
                "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != len(self.samples) or state["seed"] != self.seed:
            raise ValueError(
                f"prompt stream state is for {state['num_samples']} samples / seed {state['seed']}, "
                f"this stream has {len(self.samples)} / seed {self.seed}"
            )
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)
        self.retired = set(state.get("retired", []))  # a checkpoint from before retirement existed: none


@dataclass
class FillReport:
    """What dynamic sampling did for one batch."""

    rounds: int  # generation rounds used
    groups_sampled: int  # groups generated in all rounds
    groups_kept: int  # informative groups kept (<= target)


def fill_groups(
    take_prompts: Callable[[int], list[dict]],
    generate: Callable[[list[dict]], list[Group]],
    is_informative: Callable[[Group], bool],
    num_groups: int,
    max_rounds: int = 1,
    filter_groups: bool = True,
    any_rank: Callable[[bool], bool] | None = None,
    idle: Callable[[], object] | None = None,
) -> tuple[list[Group], FillReport]:
    """Collect ``num_groups`` groups, dropping uninformative ones when ``filter_groups``.

    Round 1 generates ``num_groups`` groups; each refill round generates enough to cover the
    deficit at the informative rate seen so far (at most ``num_groups``). After
    ``max_rounds`` rounds the batch may hold fewer groups (possibly none).

    With weights sharded across processes (FSDP) every rank must generate as many times as
    the others: ``any_rank(flag)`` says whether any rank wants another round, and a rank that
    does not calls ``idle()`` (a throw-away generation) while the others do.
    """
    if num_groups < 1 or max_rounds < 1:
        raise ValueError(f"fill_groups needs num_groups >= 1 and max_rounds >= 1, got {num_groups}, {max_rounds}")
    kept: list[Group] = []
    sampled = rounds = 0
    while True:
        want = len(kept) < num_groups and rounds < max_rounds and (filter_groups or rounds == 0)
        if any_rank is not None and any_rank(want) and not want:
            idle()
            continue
        if not want:
            break
        need = num_groups - len(kept)
        rate = len(kept) / sampled if sampled else 1.0
        n = need if rounds == 0 else min(num_groups, math.ceil(need / max(rate, 0.25)))
        groups = generate(take_prompts(n))
        rounds += 1
        sampled += len(groups)
        kept.extend(g for g in groups if not filter_groups or is_informative(g))
    kept = kept[:num_groups]
    return kept, FillReport(rounds=rounds, groups_sampled=sampled, groups_kept=len(kept))


# ---------------------------------------------------------------------------------------
# Prompt sources: a built-in task, or prompt files with a reward given by name
# ---------------------------------------------------------------------------------------


class PromptSource(Protocol):
    """What a run asks of its task: a built-in one (`cispo.data.tasks.Task`) or prompt files (`FileSource`).

    Samples are dicts with a ``prompt`` (text, or ``messages``) and the fields the reward reads."""

    name: str
    fork_tokens: tuple[str, ...]
    """The fork strings the fork diagnostics track (``data.fork_tokens``; () for none)."""
    max_new_tokens: int
    """The task's own response budget (a run's default is 1.25 x it)."""
    model: str | None
    """The model a run starts from when ``model.path`` is unset (None: the built-in or given one)."""
    chat: bool
    """The prompts are chat messages for the model's chat template, whatever ``model.chat_template`` says."""
    accuracy: bool
    """The reward's mean is an accuracy (a 0/1 verifier): ``rollout/accuracy``, ``eval/accuracy``."""
    reward: Callable[..., float]
    """``reward(prompt, completion, **sample) -> float``."""
    scores_policy_text: bool
    """The reward and `extract_answer` read the policy's own text (the environment's observations taken out by
    their mask, ``cispo.training.sampling.policy_text``), not the transcript."""

    def train_samples(self, seed: int, n: int) -> list[dict]:
        """``n`` training samples (seeded where random)."""

    def eval_samples(self, seed: int, n: int) -> list[dict]:
        """``n`` held-out samples, disjoint from the training ones."""

    def used_fork(self, completion: str) -> bool:
        """Whether ``completion`` uses one of the fork strings."""

    def extract_answer(self, completion: str) -> str | None:
        """The final answer maj@k votes on (None: no answer)."""


@dataclass(frozen=True)
class FileSource:
    """Prompts from files (``cispo.data.datasets.load_prompts``) as a `PromptSource`."""

    name: str
    train: tuple
    eval: tuple
    reward: Callable[..., float]
    fork_tokens: tuple[str, ...]
    max_new_tokens: int
    model: str | None = None  # no model of its own (model.path or the built-in one)
    chat: bool = False  # the chat template only where model.chat_template asks
    accuracy: bool = False
    """Whether the reward's mean is an accuracy (a built-in 0/1 verifier's, ``Reward.binary``)."""
    scores_policy_text: bool = False
    """A user's reward reads the whole transcript, the tools' observations included."""

    def train_samples(self, seed: int, n: int) -> list[dict]:
        return list(self.train[:n])

    def eval_samples(self, seed: int, n: int) -> list[dict]:
        return list(self.eval[:n])

    def used_fork(self, completion: str) -> bool:
        return used_any(self.fork_tokens, completion)

    def extract_answer(self, completion: str) -> str | None:
        """The final answer maj@k votes on (``cispo.data.rewards.exact.extract_final_answer``)."""
        from cispo.data.rewards.exact import extract_final_answer

        return extract_final_answer(completion)


def load_source(data_cfg, max_new_tokens: int | None) -> PromptSource:
    """The built-in task ``data_cfg.task``, or the prompt files of ``data_cfg.path``, tracking the fork
    strings ``data_cfg.fork_tokens`` where they are given (`with_fork_tokens`)."""
    if data_cfg.path is None:
        from cispo.data.tasks import get_task

        task = get_task(data_cfg.task)
        return task if data_cfg.fork_tokens is None else with_fork_tokens(task, data_cfg.fork_tokens)
    from cispo.data.datasets import load_prompts
    from cispo.data.rewards.loading import load_rewards

    if data_cfg.reward is None:
        raise ValueError("data.reward is required with data.path (e.g. math, exact_match, code, module:function)")
    if max_new_tokens is None:
        raise ValueError("rollout.max_new_tokens is required with data.path")
    kwargs = dict(prompt_field=data_cfg.prompt_field, answer_field=data_cfg.answer_field,
                  extra_fields=data_cfg.extra_fields, split=data_cfg.split, name=data_cfg.name)
    train = load_prompts(data_cfg.path, on_error=data_cfg.on_error, **kwargs)
    if data_cfg.eval_path:
        held_out = load_prompts(data_cfg.eval_path, on_error=data_cfg.on_error, **kwargs)
    else:  # hold out a seeded slice of the training file
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(data_cfg.seed)).tolist()
        n_eval = min(data_cfg.num_eval_prompts, len(train) // 5)
        if data_cfg.num_eval_prompts and not n_eval:
            from cispo.data.datasets import DataError

            raise DataError(data_cfg.path, f"{len(train)} prompts: too few to hold out 1/5 of them for evaluation; "
                            f"add prompts (>= 5), give data.eval_path, or set data.num_eval_prompts=0")
        held_out = [train[i] for i in order[:n_eval]]
        train = [train[i] for i in order[n_eval:]]
    reward = load_rewards(data_cfg.reward, data_cfg.reward_weights, data_cfg.reward_isolation, data_cfg.reward_workers)
    return FileSource(
        name=Path(data_cfg.path).stem,
        train=tuple(train),
        eval=tuple(held_out),
        reward=reward,
        fork_tokens=normalise(data_cfg.fork_tokens or ()),
        max_new_tokens=max_new_tokens,
        accuracy=reward.binary,
    )


def chat_samples(data_cfg, source, named_sets: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The samples whose prompt is a chat message list (they have ``messages``), by the file they came
    from: ``data.path`` (training and held-out rows), ``data.eval_path`` and each ``data.eval_sets``
    path; files with none are left out. {} for a built-in task (``Task.chat`` says whether its
    prompts are messages) or no ``source``."""
    if data_cfg.path is None or source is None:
        return {}
    parts = [(data_cfg.path, source.train), (data_cfg.eval_path or data_cfg.path, source.eval)]
    parts += [(data_cfg.eval_sets[name].path, samples) for name, samples in named_sets.items()]
    found: dict[str, list[dict]] = {}
    for path, samples in parts:
        found.setdefault(str(path), []).extend(s for s in samples if "messages" in s)
    return {path: samples for path, samples in found.items() if samples}


def with_fork_tokens(task, strings):
    """``task`` tracking ``strings`` (``normalise`` d) as its fork strings, ``used_fork`` included."""
    strings = normalise(strings)
    return replace(task, fork_tokens=strings, used_fork=partial(used_any, strings))


def load_eval_sets(data_cfg) -> dict[str, list[dict]]:
    """The named evaluation sets ``data_cfg.eval_sets``: name -> samples, each set read with its
    own path and fields (``cispo.config.data.EvalSetConfig``) and ``data_cfg.on_error``; {} if none."""
    from cispo.data.datasets import load_prompts

    return {name: load_prompts(s.path, prompt_field=s.prompt_field, answer_field=s.answer_field,
                               extra_fields=s.extra_fields, split=s.split, name=s.name, limit=s.num_prompts,
                               on_error=data_cfg.on_error)
            for name, s in data_cfg.eval_sets.items()}
