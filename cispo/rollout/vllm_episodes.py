"""Multi-turn episodes in the vLLM sampler, and the padding of engine responses into a
:class:`~cispo.rollout.base.RolloutBatch` (`pad_rollout`, for single-turn responses too).

vLLM's offline ``LLM.generate`` runs whole requests: it cannot feed an observation into a running
sequence as :mod:`cispo.rollout.decoding` does, token by token. `sample_episodes` therefore runs a batch
of episodes as a loop of **turns**, one ``generate`` per turn for the rows still running:

* a row's request is its prompt ids + its response ids so far (policy tokens and observation ids:
  exactly those ids, never decoded and re-encoded), with ``max_tokens`` its remaining budget
  (``max_new_tokens`` minus the response so far) and the environment's stop strings
  (``SamplingParams.stop`` with ``include_stop_str_in_output=True``; ``detokenize=True``, which vLLM
  requires for stop strings) besides the sampler's stop ids. Re-sending the context each turn is cheap:
  vLLM's automatic prefix caching (on by default in its V1 engine) finds the KV blocks the row's
  previous turn computed, so the prefill computes little more than the observation and the context's
  last, partly filled block;
* the returned **token ids** are scanned in order by the torch sampler's rules (`scan_segment`): a stop
  id pauses the segment (``by_stop_token``), the repetition early stop ends the row, and
  ``episodes.pauses`` is asked after every other token, on the segment's ids. So the environment, not
  vLLM's text match, decides where a segment ends: the ids after its first pause are dropped (vLLM
  stopped there already, unless the two disagree), and a segment vLLM stopped on a stop string that
  ``pauses`` does not confirm goes on in the next turn, without an observation. vLLM matches stop
  strings on its detokenized text; where one ends inside a token (SmolLM2 spells ``</calc>.`` as ``</``,
  ``calc``, ``>.``), vLLM cuts the returned *text* after the stop string, but its ``token_ids`` keep the
  whole token (vLLM's detokenizer truncates ``output_text`` only): the ids are what the response holds,
  as in the torch sampler, and ``episodes.pauses`` reads a stop string that the last token's text runs
  past;
* every row that paused in this turn is answered at once (``episodes.respond``): its observation ids
  are appended (``env_mask`` 1, log-prob 0), cut to the budget (the row then ends "length"); None or no
  ids ends the episode ("eos").

The loop ends when every row has ended; each turn adds at least one token to every live row, so
``max_new_tokens`` bounds the number of turns. ``rollout.max_turns`` is the environment's (its
``respond`` answers None past it). The batch has the torch sampler's fields and meaning (response ids
and mask, vLLM's log-probs of the sampled tokens, 0 at observations, ``env_mask``, the finish reasons),
so the trainer does not tell the two apart. Tested against the stand-in engine of ``tests/fake_vllm.py``
only: not yet run on vLLM itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cispo.rollout.base import Episodes, RolloutBatch, SamplingConfig

STOP_ID, STOP_STRING, REPETITION = "stop id", "stop string", "repetition"
"""The events that end a policy segment in `scan_segment`."""


@dataclass
class EpisodeRow:
    """One row's response so far, built turn by turn."""

    ids: list[int] = field(default_factory=list)
    """[n] the response: policy ids and observation ids, in order."""
    logps: list[float] = field(default_factory=list)
    """[n] the engine's log-prob of each policy id; 0 at observation ids."""
    env: list[float] = field(default_factory=list)
    """[n] 1 at observation ids, 0 at policy ids."""
    segment_start: int = 0
    """Where the current policy segment starts in ``ids`` (after the last observation)."""
    run: int = 0
    """Consecutive policy tokens with probability > ``repetition_stop_prob`` (observations skip it)."""
    reason: str | None = None
    """The finish reason once the row has ended ("eos", "length", "repetition"); None while it runs."""


def scan_segment(new_ids: Sequence[int], new_logps: Sequence[float], segment: list[int], run: int, stops: set[int],
                 cfg: SamplingConfig, pauses: Callable[[list[int]], bool]) -> tuple[int, str | None, int]:
    """Where the ids the engine sampled for a row end its policy segment, token by token, by the rules of
    ``cispo.rollout.decoding.DecodeRows.record``: a stop id (`STOP_ID`: the segment pauses, by a stop
    token), else the repetition stop (`REPETITION`: the row ends), else ``pauses(segment ids so far)``
    (`STOP_STRING`: the environment's stop string). ``segment``: the segment's ids before ``new_ids``;
    ``run``: the confident run before them. Returns (how many of ``new_ids`` to keep, the event at the
    last kept id or None, the confident run after the kept ids)."""
    n_rep = cfg.repetition_stop_tokens
    for k, (tok, lp) in enumerate(zip(new_ids, new_logps)):
        if n_rep is not None:
            run = run + 1 if math.exp(lp) > cfg.repetition_stop_prob else 0
        if tok in stops:
            return k + 1, STOP_ID, run
        if n_rep is not None and run >= n_rep:
            return k + 1, REPETITION, run
        if pauses(segment + list(new_ids[: k + 1])):
            return k + 1, STOP_STRING, run
    return len(new_ids), None, run


def take_sampled(row: EpisodeRow, ids: list[int], logps: list[float], engine_reason: str | None, n_new: int,
                 stops: set[int], cfg: SamplingConfig, pauses: Callable[[list[int]], bool]) -> bool | None:
    """Append to ``row`` what the engine sampled for it this turn (``ids`` [m], ``logps`` [m]), up to where
    the segment ends (`scan_segment`). Returns how the segment paused: True by a stop id, False by a stop
    string; None where it did not (the row ended "repetition" or "length", or its segment goes on).
    RuntimeError where the engine's answer cannot be right (more ids than the budget, no ids, a "length"
    stop short of it: the context + ``max_tokens`` exceeds the engine's ``max_model_len``)."""
    budget = n_new - len(row.ids)
    if len(ids) != len(logps) or not 0 < len(ids) <= budget:
        raise RuntimeError(f"engine returned {len(ids)} tokens and {len(logps)} log-probs for a budget of {budget}")
    if engine_reason == "length" and len(ids) < budget:
        raise RuntimeError(f"engine stopped after {len(ids)} < max_tokens={budget} tokens for length "
                           "(the context + max_tokens exceeds the engine's max_model_len?)")
    kept, event, row.run = scan_segment(ids, logps, row.ids[row.segment_start:], row.run, stops, cfg, pauses)
    row.ids += ids[:kept]
    row.logps += logps[:kept]
    row.env += [0.0] * kept
    if event == REPETITION:
        row.reason = "repetition"
    elif event is not None:
        return event == STOP_ID
    elif len(row.ids) >= n_new:
        row.reason = "length"
    return None


def add_observation(row: EpisodeRow, observation: Sequence[int] | None, n_new: int) -> None:
    """Append the environment's answer to a paused ``row``: None or no ids ends the episode ("eos"); else
    the observation ids (env 1, log-prob 0), cut to the ``n_new`` budget, after which a row with no room
    left ends "length" (also one whose observation fitted exactly: nothing more can be sampled)."""
    if observation is None or len(observation) == 0:
        row.reason = "eos"
        return
    fit = [int(x) for x in observation][: n_new - len(row.ids)]
    row.ids += fit
    row.logps += [0.0] * len(fit)
    row.env += [1.0] * len(fit)
    row.segment_start = len(row.ids)
    if len(row.ids) >= n_new:
        row.reason = "length"


def draw_seeds(generator: torch.Generator | None, n: int) -> list[int | None]:
    """``n`` request seeds from ``generator`` (as ``VLLMSampler.generate`` draws them); None each without one
    (the engine's own seeded stream)."""
    if generator is None:
        return [None] * n
    return torch.randint(0, 2**31 - 1, (n,), generator=generator, device=generator.device).tolist()


def engine_turn(sampler, contexts: list[list[int]], budgets: list[int], seeds: list[int | None],
                stop_strings: Sequence[str], cfg: SamplingConfig) -> list[tuple[list[int], list[float], str | None]]:
    """One ``LLM.generate`` of ``sampler`` (a ``VLLMSampler``) for the live rows: each ``contexts[j]`` (ids)
    continued by at most ``budgets[j]`` tokens, stopping at the sampler's stop ids and at ``stop_strings``
    (kept in the output). Returns (token ids, their log-probs, vLLM's finish reason) per request."""
    by_text = dict(stop=list(stop_strings), include_stop_str_in_output=True, detokenize=True) if stop_strings else {}
    params = [sampler.sampling_params(cfg, s, max_tokens=n, **by_text) for n, s in zip(budgets, seeds)]
    prompts = [sampler._TokensPrompt(prompt_token_ids=[int(t) for t in c]) for c in contexts]
    outputs = sampler.llm.generate(prompts, params, use_tqdm=False)
    if len(outputs) != len(contexts):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(contexts)} prompts")
    out = []
    for o in outputs:
        c = o.outputs[0]
        if c.logprobs is None:
            raise RuntimeError("vLLM returned no logprobs (SamplingParams.logprobs was 0)")
        ids = [int(t) for t in c.token_ids]
        out.append((ids, [float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)], c.finish_reason))
    return out


def answer_paused(rows: list[EpisodeRow], paused: list[tuple[int, bool]], episodes: Episodes, n_new: int) -> None:
    """One ``episodes.respond`` for every row that paused this turn (``(row, by_stop_token)`` pairs), with each
    row's policy segment; their answers appended (`add_observation`)."""
    if not paused:
        return
    which = [i for i, _ in paused]
    segments = [rows[i].ids[rows[i].segment_start:] for i in which]
    answers = episodes.respond(which, segments, [by_token for _, by_token in paused])
    for i, observation in zip(which, answers):
        add_observation(rows[i], observation, n_new)


def sample_episodes(sampler, prompt_ids: Sequence[Sequence[int]], cfg: SamplingConfig,
                    generator: torch.Generator | None, episodes: Episodes) -> RolloutBatch:
    """A multi-turn response per prompt through ``sampler``'s engine (a ``VLLMSampler``), one ``generate`` per
    turn (module docstring), as a ``RolloutBatch`` with ``env_mask``. Each turn draws one seed per row of
    the batch from ``generator`` (the live rows take theirs), so the draws do not depend on which rows run.
    The environment's stop strings are its ``stop_strings`` where it has them (``cispo.envs.tool_env``'
    ``Episodes``); without, vLLM runs each segment to a stop id or the budget and the scan cuts it where
    ``pauses`` says (right, but the dropped ids were computed for nothing)."""
    n_new, stops = cfg.max_new_tokens, set(sampler.stop_token_ids)
    stop_strings = tuple(getattr(episodes, "stop_strings", None) or ())
    rows = [EpisodeRow() for _ in prompt_ids]
    while live := [i for i, r in enumerate(rows) if r.reason is None]:
        seeds = draw_seeds(generator, len(rows))
        contexts = [[*prompt_ids[i], *rows[i].ids] for i in live]  # ids only: prompt + policy + observation ids
        sampled = engine_turn(sampler, contexts, [n_new - len(rows[i].ids) for i in live], [seeds[i] for i in live],
                              stop_strings, cfg)
        paused = []
        for i, (ids, logps, engine_reason) in zip(live, sampled):
            by_token = take_sampled(rows[i], ids, logps, engine_reason, n_new, stops, cfg,
                                    lambda segment, i=i: episodes.pauses(i, segment))
            if by_token is not None:
                paused.append((i, by_token))
        answer_paused(rows, paused, episodes, n_new)
    return pad_rollout(prompt_ids, [(r.ids, r.logps, r.reason) for r in rows], sampler.pad_token_id,
                       sampler.output_device, env_masks=[r.env for r in rows])


def pad_rollout(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[tuple[list[int], list[float], str]],
    pad_token_id: int,
    device: torch.device | str = "cpu",
    env_masks: Sequence[Sequence[float]] | None = None,
) -> RolloutBatch:
    """Left-pad the prompts, right-pad the responses (as ``TorchSampler`` does) into a ``RolloutBatch``;
    ``env_masks`` (one per response, its length): the ``env_mask`` of a multi-turn batch (None: none)."""
    B, P = len(prompts), max(len(p) for p in prompts)
    T = max(len(ids) for ids, _, _ in responses)
    prompt = torch.full((B, P), pad_token_id, dtype=torch.long)  # [B, P]
    prompt_mask = torch.zeros(B, P, dtype=torch.long)  # [B, P]
    response = torch.full((B, T), pad_token_id, dtype=torch.long)  # [B, T]
    response_mask = torch.zeros(B, T, dtype=torch.float32)  # [B, T]
    logp = torch.zeros(B, T, dtype=torch.float32)  # [B, T]
    env = None if env_masks is None else torch.zeros(B, T, dtype=torch.float32)  # [B, T]
    for i, (p, (ids, lps, _)) in enumerate(zip(prompts, responses)):
        prompt[i, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
        prompt_mask[i, P - len(p):] = 1
        response[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, : len(ids)] = 1.0
        logp[i, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        if env is not None:
            env[i, : len(ids)] = torch.tensor(list(env_masks[i]), dtype=torch.float32)
    return RolloutBatch(
        prompt_ids=prompt.to(device),
        prompt_mask=prompt_mask.to(device),
        response_ids=response.to(device),
        response_mask=response_mask.to(device),
        logp_rollout=logp.to(device),
        finish_reason=[r for _, _, r in responses],
        env_mask=None if env is None else env.to(device),
    )
