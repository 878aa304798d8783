"""The per-row bookkeeping of one decode: what each row emitted, when it stops, and, in a multi-turn
rollout, the environment's tokens it is fed.

:class:`DecodeRows` holds the response being built (``[B, max_new_tokens]`` buffers written one column
per step) and applies the stopping rules after every token: a stop id ("eos"), the repetition early stop
("repetition"), ``max_new_tokens`` ("length"). With an environment (``episodes``, the protocol of
:class:`~cispo.rollout.base.Episodes`) a response is a sequence of segments:

* a **policy segment** ends when the row samples a stop id or its text ends with one of the
  environment's stop strings (``episodes.pauses``); the environment then answers every row that paused
  at this step at once (``episodes.respond``): observation token ids, or None (the episode ends and
  the row stops, reason "eos");
* the **observation** goes into the row's response as is (no decode / re-encode: the ids the
  environment returned are the ids in the response), with ``env_mask`` 1, log-prob 0, and through the
  row's KV cache like any other token (no re-prefill). Two schedules, same response layout:
  *token by token* (``record`` feeds one queued id per step in place of a sampled one: each step a row
  either samples or is fed, every row writes column ``t`` at step ``t``), or *in one chunk*
  (``take_observations`` after ``record``: the whole observation is written at once and the sampler runs
  it through the cache in one forward, so a row's next column ``col`` [B] runs ahead of the step).
  Rows at different turns share the batch either way.

Repetition counts only policy tokens (an observation neither extends nor resets the run of confident
tokens); ``max_new_tokens`` counts every token of the response, observations included, so an
observation that does not fit is cut and the row ends with "length".
"""

from __future__ import annotations

from collections import deque

import torch

from cispo.rollout.base import FINISH_REASONS, Episodes, SamplingConfig

_LENGTH, _EOS, _REPETITION = (FINISH_REASONS.index(r) for r in ("length", "eos", "repetition"))


class DecodeRows:
    """The response of B rows, built one token per row per step (``record``, at each row's next column
    ``col``), plus whole observations (``take_observations``) — see the module docstring.

    Args:
        B: rows. n_new: columns (``cfg.max_new_tokens``). pad: the pad id. stops: LongTensor [S] stop ids.
        cfg: the sampling settings (repetition stop). episodes: the environment of a multi-turn
            rollout (None: one policy segment per row). device: where the buffers live.
    """

    def __init__(self, B: int, n_new: int, pad: int, stops: torch.Tensor, cfg: SamplingConfig,
                 episodes: Episodes | None, device) -> None:
        self.pad, self.stops, self.cfg, self.episodes = pad, stops, cfg, episodes
        self.response = torch.full((B, n_new), pad, dtype=torch.long, device=device)  # [B, n_new]
        self.response_mask = torch.zeros(B, n_new, dtype=torch.float32, device=device)  # [B, n_new]
        self.logp = torch.zeros(B, n_new, dtype=torch.float32, device=device)  # [B, n_new]
        self.env_mask = torch.zeros(B, n_new, dtype=torch.float32, device=device)  # [B, n_new] 1: fed, not sampled
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)  # [B]
        self.reason = torch.full((B,), _LENGTH, dtype=torch.long, device=device)  # [B]
        self.confident_run = torch.zeros(B, dtype=torch.long, device=device)  # [B] consecutive p > threshold
        self.feed: list[deque[int]] = [deque() for _ in range(B)]  # observation ids still to feed, per row
        self.segment_start = [0] * B  # the column the row's current policy segment starts at
        self.col = torch.zeros(B, dtype=torch.long, device=device)  # [B] the next column each row writes
        self.n_new = n_new

    def record(self, t: int, tok: torch.Tensor, tok_logp: torch.Tensor) -> None:
        """Step ``t``: each live row's column ``col`` takes the sampled ``tok`` [B] with log-probs ``tok_logp``
        [B] (any value on stopped rows), or the next queued observation token (token-by-token schedule);
        then the stopping rules. A row whose response is full stops ("length" unless a rule said otherwise)."""
        alive = ~self.finished  # [B]
        fed = self._feed(tok, tok_logp, alive) if self.episodes is not None else None  # [B] bool
        rows = alive.nonzero().squeeze(1)  # [a]
        cols = self.col.index_select(0, rows)  # [a]
        self.response[rows, cols] = tok.index_select(0, rows)
        self.logp[rows, cols] = tok_logp.index_select(0, rows).to(self.logp.dtype)
        self.response_mask[rows, cols] = 1.0
        if fed is not None:
            self.env_mask[rows, cols] = fed.index_select(0, rows).float()
        sampled = alive if fed is None else alive & ~fed  # [B] rows whose token the policy chose
        stop_eos = sampled & torch.isin(tok, self.stops)  # [B]
        stop_rep = torch.zeros_like(stop_eos)
        if self.cfg.repetition_stop_tokens is not None:
            confident = tok_logp.exp() > self.cfg.repetition_stop_prob  # [B]
            run = torch.where(confident, self.confident_run + 1, 0)  # [B]
            self.confident_run = run if fed is None else torch.where(fed, self.confident_run, run)
            stop_rep = sampled & ~stop_eos & (self.confident_run >= self.cfg.repetition_stop_tokens)  # [B]
        if self.episodes is not None:
            stop_eos = self._turns(sampled & ~stop_rep, stop_eos)  # a stop id the environment answered goes on
        self.reason = self.reason.masked_fill(stop_rep, _REPETITION).masked_fill(stop_eos, _EOS)
        self.col = self.col + alive.long()
        self.finished = self.finished | stop_eos | stop_rep | (self.col >= self.n_new)

    def take_observations(self) -> dict[int, list[int]]:
        """Write every live row's queued observation whole, after its last token (chunk schedule): ids at
        columns ``col .. col + k - 1`` with ``env_mask`` 1 and log-prob 0, cut where the response is full
        (the row then stops, "length"). Returns {row: the ids written} for the rows that got some."""
        taken = {}
        for i, queue in enumerate(self.feed):
            if not queue or self.finished[i]:
                continue
            c = int(self.col[i])
            ids = list(queue)[: self.n_new - c]
            queue.clear()
            cols = slice(c, c + len(ids))
            self.response[i, cols] = torch.tensor(ids, dtype=torch.long, device=self.response.device)
            self.response_mask[i, cols], self.env_mask[i, cols], self.logp[i, cols] = 1.0, 1.0, 0.0
            self.col[i] = c + len(ids)
            self.segment_start[i] = c + len(ids)  # the next policy segment starts after the observation
            self.finished[i] = bool(self.col[i] >= self.n_new)
            taken[i] = ids
        return taken

    def _feed(self, tok: torch.Tensor, tok_logp: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """Put the next observation token in ``tok`` (log-prob 0) where a live row has one queued, in place;
        returns which rows were fed [B] (token-by-token schedule)."""
        fed = torch.zeros_like(self.finished)
        for i, queue in enumerate(self.feed):
            if queue and alive[i]:
                tok[i], tok_logp[i], fed[i] = queue.popleft(), 0.0, True
                if not queue:
                    self.segment_start[i] = int(self.col[i]) + 1  # the next policy segment starts after it
        return fed

    def _turns(self, sampled: torch.Tensor, stop_eos: torch.Tensor) -> torch.Tensor:
        """Pause the rows whose policy segment ended at their column ``col`` (a stop id, or a stop string
        through ``episodes.pauses``), ask the environment for their observations, queue them. Returns the
        rows that stop with "eos" [B]: those whose episode the environment ended."""
        by_token = stop_eos.tolist()
        paused, segments, tokens = [], [], []
        for i in sampled.nonzero().flatten().tolist():
            end = int(self.col[i]) + 1
            segment = self.response[i, self.segment_start[i] : end].tolist()  # the policy's ids since the last turn
            if by_token[i] or self.episodes.pauses(i, segment):
                paused.append(i)
                segments.append(segment)
                tokens.append(by_token[i])
        ends = torch.zeros_like(stop_eos)
        if not paused:
            return ends
        for i, obs in zip(paused, self.episodes.respond(paused, segments, tokens)):
            if obs is None or len(obs) == 0:
                ends[i] = True
            else:
                self.feed[i].extend(int(x) for x in obs)
        return ends

    def outputs(self, steps: int) -> tuple[torch.Tensor, ...]:
        """The first ``T`` columns: response ids, response mask, log-probs, env mask [B, T]; reasons [B].
        ``T`` = the longest row's length, or the ``steps`` taken where more (lock-step padding)."""
        T = max(steps, int(self.col.max()))
        return (self.response[:, :T], self.response_mask[:, :T], self.logp[:, :T], self.env_mask[:, :T],
                self.reason)
