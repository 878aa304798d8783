"""Sampling configuration, the rollout batch, and the sampler protocol.

A sampler turns a list of tokenised prompts into a :class:`RolloutBatch`: the sampled responses plus the
sampler's own log-probabilities of them (``logp_rollout``, the "old" policy of CISPO's importance ratio).
Every backend (the reference :class:`~cispo.rollout.torch_sampler.TorchSampler`, the
:class:`~cispo.rollout.vllm_sampler.VLLMSampler`) subclasses :class:`Sampler`, which declares ``generate``
and the optional capabilities (weight sync, sleep / wake, lock-step across ranks) with no-op defaults.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

FINISH_REASONS = ("eos", "length", "repetition")


def stop_ids(eos_token_id: int | Sequence[int]) -> tuple[int, ...]:
    """The ids that end a response, from a sampler's ``eos_token_id``: one id, or several, as a Hugging
    Face generation config lists them (Llama-3's ``<|end_of_text|>`` and ``<|eot_id|>``); ints, each
    once, in order. A response stops at the first of them it samples ("eos"), which it keeps (mask 1).
    ValueError when there is none."""
    ids = tuple(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else (eos_token_id,)
    try:
        out = tuple(dict.fromkeys(operator.index(i) for i in ids))
    except TypeError:
        out = ()
    if not out or any(isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a non-empty list of them, got {eos_token_id!r}")
    return out


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses. Invalid values raise ``ValueError`` at construction."""

    max_new_tokens: int = 64
    """Maximum number of generated tokens per response (the EOS token included); >= 1."""

    temperature: float = 1.0
    """Softmax temperature, >= 0. Tokens are drawn from softmax(logits / temperature). 0 means greedy
    (argmax); ``logp_rollout`` is then the log-prob under the untempered softmax(logits)."""

    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]: sample from the smallest set of most likely tokens whose total
    probability is >= top_p (the most likely token is always kept). 1.0 disables it."""

    top_k: int = 0
    """Sample from the ``top_k`` most likely tokens only (ties at the k-th kept); 0 disables it."""

    min_p: float = 0.0
    """Drop the tokens whose probability is below ``min_p`` times the most likely one's, in [0, 1); 0 disables it."""

    repetition_penalty: float = 1.0
    """HF's and vLLM's repetition penalty, > 0: the logit of every token already in the prompt or the response
    so far is divided by it where positive, multiplied where negative (before the temperature). 1 disables it.

    The penalty, temperature, min_p, top_k and top_p make the distribution sampled from, in vLLM's order
    (`cispo.rollout.processing`); ``logp_rollout`` is its log-prob of the sampled token."""

    repetition_stop_tokens: int | None = None
    """N for the repetition early stop of MiniMax-M1 (which used N=3000): a row stops (finish reason
    "repetition") once N consecutive sampled tokens each had probability > ``repetition_stop_prob``
    (the distribution sampled, as ``logp_rollout``). The token that reaches N is kept. None = off."""

    repetition_stop_prob: float = 0.99
    """Probability threshold of the repetition early stop, in (0, 1) (MiniMax-M1: 0.99)."""

    use_cache: bool = True
    """Decode with the model's KV cache. False recomputes the whole sequence at every step: a slow
    reference, used to test the cached path."""

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if not (0.0 <= self.min_p < 1.0):
            raise ValueError(f"min_p must be in [0, 1) (0: off), got {self.min_p}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty}")
        n = self.repetition_stop_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"repetition_stop_tokens must be None or an int >= 1, got {n!r}")
        if not (0.0 < self.repetition_stop_prob < 1.0):
            raise ValueError(f"repetition_stop_prob must be in (0, 1), got {self.repetition_stop_prob}")


@dataclass
class RolloutBatch:
    """B sampled responses with their prompts. T is the longest response of the batch.

    All tensors are ordinary tensors (not inference-mode tensors), on the sampler's device, so a trainer
    can use them in autograd computations.
    """

    prompt_ids: torch.Tensor
    """LongTensor [B, P]: the prompts, left-padded with the pad id."""

    prompt_mask: torch.Tensor
    """LongTensor [B, P]: 1 at real prompt tokens, 0 at padding."""

    response_ids: torch.Tensor
    """LongTensor [B, T]: the sampled tokens, right-padded with the pad id."""

    response_mask: torch.Tensor
    """float32 [B, T]: 1 at generated tokens (the stop token included, when one was emitted), 0 at padding."""

    logp_rollout: torch.Tensor
    """float32 [B, T]: log-prob of each sampled token under the distribution it was drawn from: softmax(logits /
    temperature) after the repetition penalty, min_p, top_k and top_p (renormalised over the tokens they keep;
    `cispo.rollout.processing`; the penalised softmax(logits) when temperature == 0); 0 at padding."""

    finish_reason: list[str]
    """Per row, why it stopped: "eos" (emitted a stop token: EOS or another of the sampler's stop ids,
    `stop_ids`; in a multi-turn rollout: the environment ended the episode), "length" (hit max_new_tokens)
    or "repetition" (repetition early stop)."""

    env_mask: torch.Tensor | None = None
    """float32 [B, T] in a multi-turn rollout (``generate(..., episodes=...)``): 1 at the environment's
    tokens (observations fed into the context, never sampled: log-prob 0), 0 at the policy's tokens and
    padding; ``response_mask`` is 1 at both. None: every response token is the policy's."""

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        """LongTensor [B]: number of generated tokens per row."""
        return self.response_mask.sum(-1).long()

    @property
    def num_repetition_stops(self) -> int:
        """How many rows were cut by the repetition early stop."""
        return self.finish_reason.count("repetition")

    @property
    def num_truncated(self) -> int:
        """How many rows hit max_new_tokens without emitting EOS."""
        return self.finish_reason.count("length")


class Episodes(Protocol):
    """A batch's environment in a multi-turn rollout, token in, token out (one episode per row; built by
    ``cispo.envs.tool_env``). The sampler calls it; it never sees text. A sampler that cannot ask
    ``pauses`` after every token (vLLM: ``cispo.rollout.vllm_episodes``) also reads its ``stop_strings``
    (a tuple of str) where it has them, to stop the engine there; ``pauses`` still decides."""

    def pauses(self, row: int, segment_ids: list[int]) -> bool:
        """Whether row ``row``'s policy segment (the ids it sampled since the prompt or its last
        observation, newest last) ends here by one of the environment's stop strings."""

    def respond(self, rows: list[int], segments: list[list[int]], by_stop_token: list[bool]) -> list:
        """Each paused row's observation (token ids fed into its context, not trained on), or None: the
        episode ends and the row's response is final. ``by_stop_token``: the segment ended with a stop id."""


class Sampler:
    """Anything that samples responses for a batch of tokenised prompts.

    A backend subclasses it and implements ``generate``; the optional capabilities below have
    no-op defaults, so the trainer calls them on every sampler and a backend overrides only
    what it has:

    * ``update_weights(model)``: a separate inference engine (vLLM) takes the trainer's new
      weights after every optimizer step; a sampler that runs the trained model itself needs
      nothing.
    * ``sleep()`` / ``wake_up()``: free the engine's memory while the trainer updates (vLLM's
      sleep mode), and take it back.
    * ``lock_step(all_ranks_done)``: for a model sharded across processes (FSDP), where every
      rank must run the same number of forward passes, ``all_ranks_done(done)`` takes this
      rank's "every row has stopped" and says whether that holds on every rank; the sampler
      then keeps decoding (padding only) until it does.
    * ``info()``: facts about the engine for the run's ``meta.json`` (its version, what it
      supports); ``{}`` by default.
    * ``for_model(model)``: the same sampler over another module with the same architecture (a copy of
      the policy that samples beside the trainer, ``rollout.async_steps=1``); None by default: it cannot.

    ``own_weights`` says whether the sampler holds its own copy of the weights, changed only by
    ``update_weights`` (a separate engine: vLLM); sampling beside the trainer (``rollout.async_steps=1``,
    `cispo.training.prefetch`) then needs no copy of its own.
    """

    own_weights: bool = False
    model: torch.nn.Module | None = None
    """The module it samples from when that is the trainer's own model (the torch sampler); None for an engine
    with weights of its own. ``algo.logp_old=rollout`` reads it: the sampler's log-probs are the trainer's only
    when it samples ``policy.model`` itself."""
    autocast: torch.dtype | None = None
    """The autocast dtype its passes run under (None: none, or not the trainer's passes at all)."""
    rows_done: Callable[[int], None] | None = None
    """When set, told during ``generate`` how many more rows have stopped (a held-out evaluation's progress bar,
    `cispo.training.evaluation.evaluate`); None: not told. A sampler that decodes step by step (torch) tells it
    after each step; an engine that returns the whole batch at once (vLLM) does not, and the caller counts the
    batch when it returns."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        cfg: SamplingConfig,
        generator: torch.Generator | None = None,
        episodes: Episodes | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt (prompts are lists of token ids, non-empty, of any lengths);
        with ``episodes``, a multi-turn response per prompt (policy segments and the environment's
        observations, ``RolloutBatch.env_mask``)."""
        raise NotImplementedError(f"{type(self).__name__}.generate")

    def update_weights(self, model) -> int:
        """Take the trainer's current weights; returns the number of tensors taken (0: none needed)."""
        return 0

    def sleep(self) -> None:
        """Free the engine's memory until the next ``generate`` / ``wake_up`` (default: nothing to free)."""

    def wake_up(self) -> None:
        """Take back what ``sleep`` freed (default: nothing)."""

    def lock_step(self, all_ranks_done: Callable[[bool], bool] | None) -> None:
        """Decode in lock-step with the other ranks through ``all_ranks_done`` (None: alone).
        Default: nothing, for a sampler whose forward passes need no other rank."""

    def info(self) -> dict:
        """Facts about the engine worth recording with the run (plain JSON data; default: none)."""
        return {}

    def for_model(self, model) -> Sampler | None:
        """A sampler with these settings over ``model`` (default None: not built for this backend)."""
        return None
