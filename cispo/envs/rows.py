"""A batch of episodes sampled as training rows: the first ``generate`` over every episode, then one more round
for the episodes a context rewrote (``cispo.envs.base.StepResult.context``), until none is left.

Row 0 of an episode is its prompt and the response the first round sampled; where a step's context does not
extend the row's ids, that row ends there (its response final: exactly what was sampled and observed) and the
episode's next row is the context's ids as prompt, with the response a further ``generate`` samples for it —
on either sampler (the torch sampler, vLLM's turn loop), through the same ``Episodes`` protocol, so the rounds
know nothing of the backend. Each row's budget is the sampler's ``max_new_tokens``; ``rollout.max_turns`` bounds
the episode (a context counts as a turn), so the rounds end.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["SampledRow", "sample_episode_rows"]


@dataclass
class SampledRow:
    """One training row of an episode: its prompt and response, as sampled."""

    prompt_ids: list[int]
    response_ids: torch.Tensor  # [T] the response: policy ids and observation ids
    logp_rollout: torch.Tensor  # [T] the sampler's log-probs (0 at observation ids)
    env_mask: torch.Tensor | None  # [T] 1 at observation ids
    finish_reason: str


def batch_rows(batch, prompts: list[list[int]]) -> list[SampledRow]:
    """A ``RolloutBatch``'s rows, each cut to its own length, on the CPU."""
    lengths = batch.response_lengths.tolist()
    return [SampledRow(list(prompts[i]), batch.response_ids[i, :n].cpu(), batch.logp_rollout[i, :n].cpu(),
                       None if batch.env_mask is None else batch.env_mask[i, :n].cpu(), batch.finish_reason[i])
            for i, n in enumerate(lengths)]


def sample_episode_rows(sampler, prompt_ids: list[list[int]], cfg, generator, episodes,
                        encode=None) -> list[list[SampledRow]]:
    """Each episode's training rows, in order (module docstring): ``sampler.generate`` over ``prompt_ids`` with
    ``episodes`` (an ``cispo.envs.episodes.EnvEpisodes``, given the prompts first: `EnvEpisodes.begin`, with
    ``encode`` for contexts given as chat messages), then over each round's continued episodes with their new
    prompts, until no episode is continued. Under lock-step sampling (weights sharded across ranks, where every
    rank must run as many forward passes: ``Sampler.lock_step``) the rounds go on until no rank continues one,
    a rank with none left joining each round with a throw-away greedy ``generate``."""
    episodes.begin(prompt_ids, encode)
    batch = sampler.generate(prompt_ids, cfg, generator=generator, episodes=episodes)
    out = [[row] for row in batch_rows(batch, prompt_ids)]
    all_ranks_done = getattr(sampler, "_all_ranks_done", None)  # lock-step sampling (FSDP): `Sampler.lock_step`
    while True:
        continued = episodes.continuations()
        if all_ranks_done is not None and not all_ranks_done(not continued) and not continued:
            sampler.generate([list(prompt_ids[0][:1])], replace(cfg, temperature=0.0))  # idle: join the others' round
            continue
        if not continued:
            return out
        which, prompts = [e for e, _ in continued], [ids for _, ids in continued]
        batch = sampler.generate(prompts, cfg, generator=generator, episodes=episodes.rows_of(which))
        for e, row in zip(which, batch_rows(batch, prompts)):
            out[e].append(row)
