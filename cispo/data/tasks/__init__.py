"""Built-in synthetic verifiable tasks, looked up by name.

    >>> task = get_task("addition")
    >>> s = task.train_samples(seed=0, n=2)[0]          # {"prompt": "...=", "answer": "..."}
    >>> task.reward(s["prompt"], s["answer"], **{k: v for k, v in s.items() if k != "prompt"})
    1.0
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from cispo.data.tasks import arithmetic, chain, guess_number, wordmath, wordmath_calc

__all__ = ["Task", "UnknownTaskError", "get_task", "list_tasks", "arithmetic", "chain", "guess_number", "wordmath",
           "wordmath_calc"]


class UnknownTaskError(ValueError):
    """A task name that is not registered; the message lists the known ones."""


@dataclass(frozen=True)
class Task:
    """A verifiable task: prompt splits, a reward, fork detection and a pretraining corpus.

    All callables are plain functions (picklable with the module), seeded where random.
    """

    name: str
    fork_tokens: tuple[str, ...]
    """The reflective (fork) strings the fork diagnostics track (`cispo.foundations.forks`; ``data.fork_tokens``
    overrides them). The character-level tasks' is one character, the token their corpus plants."""
    alphabet: str
    """Every character prompts and completions use (the tokenizer's vocabulary)."""
    max_new_tokens: int
    """Longest well-formed completion, in tokens, counting the EOS."""
    train_samples: Callable[[int, int], list[dict]]
    """``(seed, n) -> [{"prompt", "answer"}, ...]`` from the train split (seeded; may repeat)."""
    eval_samples: Callable[[int, int], list[dict]]
    """``(seed, n) -> [...]`` from the held-out split, disjoint from train and corpus."""
    reward: Callable[..., float]
    """``reward(prompt, completion, **sample) -> 1.0 | 0.0`` (`chain_hidden_graded`: a value in [0, 1])."""
    used_fork: Callable[[str], bool]
    """Whether a completion uses a fork string (``rollout/fork_rate``, ``eval/fork_rate``)."""
    extract_answer: Callable[[str], str | None]
    corpus: Callable[..., list] = field(repr=False)
    """``corpus(seed, n, **options) -> [CorpusExample, ...]`` for pretraining the base model."""
    max_positions: int = 128
    """Context of the base model: the longest prompt plus 1.25 x `max_new_tokens` fits."""
    pretrain_defaults: dict = field(default_factory=dict)
    """`cispo.models.pretrain.PretrainConfig` values this task's base model uses where the config
    leaves them None (steps, batch_size, fork_fraction, derivation_fraction, wrong_guess_fraction)."""
    stratified_corpus: bool = True
    """Pretraining draws a fixed share ``derivation_fraction`` of every batch from the forked
    examples (a separate micro-batch: they are ~4x longer). False: batches are drawn from
    the whole corpus as it is (its forked share is not `derivation_fraction`)."""
    model: str | None = None
    """The model RL starts from when ``model.path`` is not given (``builtin:<name>``, a packaged model:
    ``cispo.models.packaged``). None: the task's own base model, shipped or pretrained from ``corpus``."""
    base_task: str | None = None
    """Start from this other built-in task's base model (shipped or pretrained for it): a variant
    of it with the same alphabet and grammar. None: this task's own."""
    chat: bool = False
    """Prompts are chat messages (a system prompt stating the answer format, then the problem) and go
    through the model's chat template whatever ``model.chat_template`` says."""
    accuracy: bool = True
    """The reward's mean is reported as an accuracy (``rollout/accuracy``, ``eval/accuracy...``): every
    built-in task's reward is a 0/1 verifier's, but `chain_hidden_graded`'s, a grade in [0, 1] whose
    mean keeps the name the studies read."""
    num_eval_prompts: int = 200
    """Held-out prompts of each evaluation where ``data.num_eval_prompts`` is None: sized to the task's model
    (the toy models' 200 take seconds; a real model's 100 greedy answers take minutes on a CPU)."""
    eval_num_samples: int = 4
    """Sampled answers per held-out prompt (k of mean@k, pass@k, maj@k) where ``eval.num_samples`` is None;
    0: greedy only."""
    scores_policy_text: bool = False
    """The reward and the answer extractor read the policy's own text — the response's tokens the policy sampled
    (``env_mask`` 0), decoded run by run (`cispo.training.sampling.policy_text`) — not the transcript with the
    environment's observations in it: a tool's output never states, hedges or restates an answer for the policy."""


def _addition(digits: tuple[int, ...], name: str) -> Task:
    n = max(digits)
    # guess (n+1) + fork + n steps of 8 chars + (n-1) commas + "=" + answer (n+1) + EOS
    longest = (n + 1) + 1 + 8 * n + (n - 1) + 1 + (n + 1) + 1
    return Task(
        name=name,
        fork_tokens=(arithmetic.FORK_TOKEN,),
        alphabet=arithmetic.ALPHABET,
        max_new_tokens=longest,
        train_samples=partial(arithmetic.samples, split="train", digits=digits),
        eval_samples=partial(arithmetic.samples, split="eval", digits=digits),
        reward=arithmetic.reward,
        used_fork=arithmetic.used_fork,
        extract_answer=arithmetic.extract_answer,
        corpus=partial(arithmetic.corpus, digits=digits),
        pretrain_defaults=dict(steps=1000, batch_size=96, fork_fraction=0.03, derivation_fraction=0.8,
                               wrong_guess_fraction=0.5),
    )


def _chain(steps: tuple[int, ...], name: str, carry_prob: float = chain.CARRY_PROB, min_carries: int = 0,
           base_task: str | None = None, bug_range: tuple[int, int | None] = (0, None),
           slack: int = chain.LENGTH_SLACK, corpus_weights: dict | None = None,
           recheck_cost: float | None = None) -> Task:
    bugs = chain.TASK_BUGS.get(name)  # None: the base model errs on every carrying step
    prompts = dict(steps=steps, carry_prob=carry_prob, min_carries=min_carries)
    if bugs is not None:
        prompts.update(bugs=bugs, bug_range=bug_range)
    variant = bugs is not None or slack != chain.LENGTH_SLACK
    return Task(
        name=name,
        fork_tokens=(chain.FORK_TOKEN,),
        alphabet=chain.ALPHABET,
        max_new_tokens=chain.max_new_tokens(steps),
        train_samples=partial(chain.samples, split="train", **prompts),
        eval_samples=partial(chain.samples, split="eval", **prompts),
        reward=(partial(chain.graded_reward, cost=recheck_cost, bugs=bugs) if recheck_cost is not None
                else partial(chain.reward, slack=slack, bugs=bugs) if variant else chain.reward),
        used_fork=chain.used_fork,
        extract_answer=chain.extract_answer,
        corpus=(partial(chain.corpus, steps=steps, bugs=bugs, **(corpus_weights or {})) if bugs is not None
                else partial(chain.corpus, steps=steps)),
        max_positions=384,
        stratified_corpus=False,
        pretrain_defaults=dict(steps=1000, batch_size=48, fork_fraction=0.04, derivation_fraction=0.5,
                               wrong_guess_fraction=1.0),
        base_task=base_task,
    )


def _no_corpus(*args, **kwargs):
    raise ValueError("wordmath has no pretraining corpus: its model is a real pretrained one (builtin:smollm2-135m)")


def _wordmath(name: str = wordmath.NAME, reward: Callable[..., float] = wordmath.reward,
              numbers: str = "small") -> Task:
    return Task(
        name=name,
        fork_tokens=wordmath.FORK_TOKENS,
        alphabet="",  # a real BPE vocabulary, not a built character set
        max_new_tokens=wordmath.MAX_NEW_TOKENS,
        train_samples=partial(wordmath.samples, split="train", numbers=numbers),
        eval_samples=partial(wordmath.samples, split="eval", numbers=numbers),
        reward=reward,
        used_fork=wordmath.used_fork,
        extract_answer=wordmath.extract_answer,
        corpus=_no_corpus,
        model="builtin:smollm2-135m",
        chat=True,
        # the example's held-out set (examples/smollm2-wordmath.yaml): 100 greedy answers, ~1-2 min on a CPU,
        # where 200 prompts x (greedy + 4 samples) took ~20 min before and after every run
        num_eval_prompts=100,
        eval_num_samples=0,
    )


def _wordmath_calc(name: str = wordmath_calc.NAME, prompt: str = "user", numbers: str = "small") -> Task:
    """wordmath's problems with the inline calculator (`wordmath_calc`: its prompt, reward and fork string)."""
    return replace(_wordmath(name, wordmath_calc.reward), fork_tokens=wordmath_calc.FORK_TOKENS,
                   max_new_tokens=wordmath_calc.MAX_NEW_TOKENS, used_fork=wordmath_calc.used_fork,
                   train_samples=partial(wordmath_calc.samples, split="train", prompt=prompt, numbers=numbers),
                   eval_samples=partial(wordmath_calc.samples, split="eval", prompt=prompt, numbers=numbers),
                   extract_answer=wordmath_calc.extract_answer, scores_policy_text=True)


def _guess_number() -> Task:
    """Find a secret number in 1..15 from the environment's answers (`guess_number`; its environment is
    ``cispo.envs.guess``): SmolLM2-135M-Instruct in a chat, scored on the policy's own lines; the held-out set is
    every secret once, 8 sampled episodes each (cheap: an episode is a few short lines)."""
    return Task(name=guess_number.NAME, fork_tokens=(), alphabet="", max_new_tokens=guess_number.MAX_NEW_TOKENS,
                train_samples=partial(guess_number.samples, split="train"),
                eval_samples=partial(guess_number.samples, split="eval"),
                reward=guess_number.reward, used_fork=guess_number.used_fork,
                extract_answer=guess_number.extract_answer, corpus=_no_corpus, model="builtin:smollm2-135m",
                chat=True, num_eval_prompts=guess_number.HIGH - guess_number.LOW + 1, eval_num_samples=8,
                scores_policy_text=True)


_REGISTRY: dict[str, Callable[[], Task]] = {
    "addition": partial(_addition, arithmetic.DIGITS, "addition"),
    "addition4": partial(_addition, (4,), "addition4"),
    "chain": partial(_chain, chain.STEPS, "chain"),
    # chain's prompts with rare carries (>= 1 per prompt); its base model is chain's, whose per-step
    # behaviour (carries dropped, W ~4% per step, correct derivations) does not depend on the carry rate
    "chain_sparse": partial(_chain, chain.STEPS, "chain_sparse", chain.SPARSE_CARRY_PROB, 1, "chain"),
    # chain's prompts with >= 1 buggy step; its own base model errs only on chain.HIDDEN_BUGS' carrying steps
    "chain_hidden": partial(_chain, chain.STEPS, "chain_hidden", bug_range=(1, None)),
    # the same base model; 0 or 1 buggy step per prompt and no slack: an unneeded recheck costs the reward
    "chain_hidden_strict": partial(_chain, chain.STEPS, "chain_hidden_strict", base_task="chain_hidden",
                                   bug_range=(0, 1), slack=0),
    # chain_hidden_strict with its own base model, pretrained with the carry table's results weighted
    # (rare pairs balanced, buggy ones x16) so that the right value at a buggy step is (almost) never sampled
    "chain_hidden_sharp": partial(_chain, chain.STEPS, "chain_hidden_sharp", bug_range=(0, 1), slack=0,
                                  corpus_weights=dict(pair_weight_cap=32.0, bug_weight=16.0)),
    # chain_hidden_sharp's prompts and base model (same corpus and prompt stream: only the reward differs);
    # an unneeded recheck costs chain.GRADED_COST of the reward, the fraction at which a recheck after a
    # random step has expected reward change ~0 at the base model's rate (chain.balanced_recheck_cost)
    "chain_hidden_graded": partial(_chain, chain.STEPS, "chain_hidden_graded", base_task="chain_hidden_sharp",
                                   bug_range=(0, 1), slack=0, recheck_cost=chain.GRADED_COST),
    "wordmath": _wordmath,
    # the same problems and instruction; the answer pays only after a line of true working that ends in it
    "wordmath_working": partial(_wordmath, "wordmath_working", wordmath.reward_working),
    # the same problems with an inline calculator (<calc>2+3</calc> -> <result>5</result>); scored on the policy's text
    "wordmath_calc": _wordmath_calc,
    # the same, the calculator taught by a worked example in the system prompt, wordmath's instruction in the user turn
    "wordmath_calc_example": partial(_wordmath_calc, wordmath_calc.EXAMPLE_NAME, "system_example"),
    # 2-3 digit operands, which a 135M model cannot add or multiply in its head: without and with the calculator
    "wordmath_large": partial(_wordmath, "wordmath_large", numbers="large"),
    "wordmath_calc_large": partial(_wordmath_calc, wordmath_calc.LARGE_NAME, numbers="large"),
    # a secret number in 1..15 found from the environment's higher / lower answers (cispo.envs.guess)
    "guess_number": _guess_number,
}


def list_tasks() -> list[str]:
    """Names accepted by `get_task`."""
    return sorted(_REGISTRY)


def get_task(name: str = "addition") -> Task:
    """The built-in task called `name` (see `list_tasks`); `UnknownTaskError` otherwise."""
    if name not in _REGISTRY:
        raise UnknownTaskError(f"unknown task {name!r} (data.task); the built-in tasks are: "
                               f"{', '.join(list_tasks())} (or give data.path=... for prompt files)")
    return _REGISTRY[name]()
