"""Built-in synthetic verifiable tasks, looked up by name.

    >>> task = get_task("addition")
    >>> s = task.train_samples(seed=0, n=2)[0]          # {"prompt": "...=", "answer": "..."}
    >>> task.reward(s["prompt"], s["answer"], **{k: v for k, v in s.items() if k != "prompt"})
    1.0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from cispo.tasks import arithmetic

__all__ = ["Task", "get_task", "list_tasks", "arithmetic"]


@dataclass(frozen=True)
class Task:
    """A verifiable task: prompt splits, a reward, fork detection and a pretraining corpus.

    All callables are plain functions (picklable with the module), seeded where random.
    """

    name: str
    fork_token: str
    """The rare reflective token (a single character / token)."""
    alphabet: str
    """Every character prompts and completions use (the tokenizer's vocabulary)."""
    max_new_tokens: int
    """Longest well-formed completion, in tokens, counting the EOS."""
    train_samples: Callable[[int, int], list[dict]]
    """``(seed, n) -> [{"prompt", "answer"}, ...]`` from the train split (seeded; may repeat)."""
    eval_samples: Callable[[int, int], list[dict]]
    """``(seed, n) -> [...]`` from the held-out split, disjoint from train and corpus."""
    reward: Callable[..., float]
    """``reward(prompt, completion, **sample) -> 1.0 | 0.0``."""
    used_fork: Callable[[str], bool]
    extract_answer: Callable[[str], str | None]
    corpus: Callable[..., list] = field(repr=False)
    """``corpus(seed, n, **options) -> [CorpusExample, ...]`` for pretraining the base model."""


def _addition(digits: tuple[int, ...], name: str) -> Task:
    n = max(digits)
    # guess (n+1) + fork + n steps of 8 chars + (n-1) commas + "=" + answer (n+1) + EOS
    longest = (n + 1) + 1 + 8 * n + (n - 1) + 1 + (n + 1) + 1
    return Task(
        name=name,
        fork_token=arithmetic.FORK_TOKEN,
        alphabet=arithmetic.ALPHABET,
        max_new_tokens=longest,
        train_samples=partial(arithmetic.samples, split="train", digits=digits),
        eval_samples=partial(arithmetic.samples, split="eval", digits=digits),
        reward=arithmetic.reward,
        used_fork=arithmetic.used_fork,
        extract_answer=arithmetic.extract_answer,
        corpus=partial(arithmetic.corpus, digits=digits),
    )


_REGISTRY: dict[str, Callable[[], Task]] = {
    "addition": partial(_addition, arithmetic.DIGITS, "addition"),
    "addition4": partial(_addition, (4,), "addition4"),
}


def list_tasks() -> list[str]:
    """Names accepted by `get_task`."""
    return sorted(_REGISTRY)


def get_task(name: str = "addition") -> Task:
    """The built-in task called `name` (see `list_tasks`)."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known: {list_tasks()}") from None
