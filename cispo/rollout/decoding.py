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
* the **observation** is fed to the row one token per step, as if sampled but never drawn: the row's
  KV cache takes it like any other token (no re-prefill, no decode / re-encode: the ids the
  environment returned are the ids in the response), with ``env_mask`` 1, log-prob 0. Rows at
  different turns share the batch: each step a row either samples or is fed.

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
    """The response of B rows, built one column per step (``record``) — see the module docstring.

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

    def record(self, t: int, tok: torch.Tensor, tok_logp: torch.Tensor) -> None:
        """Column ``t``: the sampled ``tok`` [B] with log-probs ``tok_logp`` [B] (any value on stopped
        rows), or the next observation token where a row is being fed; then the stopping rules."""
        fed = self._feed(tok, tok_logp, t) if self.episodes is not None else None  # [B] bool
        alive = ~self.finished  # [B]
        self.response[:, t] = tok.masked_fill(self.finished, self.pad)
        self.logp[:, t] = tok_logp.masked_fill(self.finished, 0.0)
        self.response_mask[:, t] = alive.float()
        sampled = alive if fed is None else alive & ~fed  # [B] rows whose token the policy chose
        stop_eos = sampled & torch.isin(tok, self.stops)  # [B]
        stop_rep = torch.zeros_like(stop_eos)
        if self.cfg.repetition_stop_tokens is not None:
            confident = tok_logp.exp() > self.cfg.repetition_stop_prob  # [B]
            run = torch.where(confident, self.confident_run + 1, 0)  # [B]
            self.confident_run = run if fed is None else torch.where(fed, self.confident_run, run)
            stop_rep = sampled & ~stop_eos & (self.confident_run >= self.cfg.repetition_stop_tokens)  # [B]
        if self.episodes is not None:
            stop_eos = self._turns(t, sampled & ~stop_rep, stop_eos)  # a stop id the environment answered goes on
        self.reason = self.reason.masked_fill(stop_rep, _REPETITION).masked_fill(stop_eos, _EOS)
        self.finished = self.finished | stop_eos | stop_rep

    def _feed(self, tok: torch.Tensor, tok_logp: torch.Tensor, t: int) -> torch.Tensor:
        """Put the next observation token in ``tok`` (log-prob 0) where a live row has one queued, in place;
        returns which rows were fed [B]."""
        fed = torch.zeros_like(self.finished)
        for i, queue in enumerate(self.feed):
            if queue and not self.finished[i]:
                tok[i], tok_logp[i], fed[i] = queue.popleft(), 0.0, True
                if not queue:
                    self.segment_start[i] = t + 1  # the next policy segment starts after the observation
        self.env_mask[:, t] = fed.float()
        return fed

    def _turns(self, t: int, sampled: torch.Tensor, stop_eos: torch.Tensor) -> torch.Tensor:
        """Pause the rows whose policy segment ended at column ``t`` (a stop id, or a stop string through
        ``episodes.pauses``), ask the environment for their observations, queue them. Returns the rows
        that stop with "eos" [B]: those whose episode the environment ended."""
        by_token = stop_eos.tolist()
        paused, segments, tokens = [], [], []
        for i in sampled.nonzero().flatten().tolist():
            segment = self.response[i, self.segment_start[i] : t + 1].tolist()  # the policy's ids since the last turn
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

    def outputs(self, T: int) -> tuple[torch.Tensor, ...]:
        """The first ``T`` columns: response ids, response mask, log-probs, env mask [B, T]; reasons [B]."""
        return (self.response[:, :T], self.response_mask[:, :T], self.logp[:, :T], self.env_mask[:, :T],
                self.reason)
