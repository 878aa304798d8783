"""The distribution a response token is drawn from: the model's logits processed as vLLM's V1 sampler
processes them, in vLLM's order (``vllm/v1/sample/sampler.py``), for both samplers::

    z   = penalise(logits, seen)          repetition_penalty rp on every token already in prompt + response:
                                          z_v = logits_v / rp where logits_v > 0, logits_v * rp otherwise
                                          (HF's RepetitionPenaltyLogitsProcessor, vLLM's apply_penalties)
    z   = z / T                           temperature (T = 0: greedy, argmax of the penalised logits)
    keep_v  p_v >= min_p * max_u p_u      min_p, p = softmax(z)        (vLLM's MinPLogitsProcessor)
    keep_v  z_v >= the k-th largest z     top_k (ties at the k-th value kept, as vLLM and HF)
    keep_v  sum_{u more likely than v} p'_u < top_p     top_p, p' = softmax of the z kept so far (the most
                                          likely token always kept)
    log pi_rollout(v) = log_softmax(z restricted to the kept tokens)_v      (-inf outside them)

``logp_rollout`` is this log pi_rollout of the sampled token: the log-prob of the distribution actually
sampled (vLLM's ``logprobs_mode="processed_logprobs"``), which sums to 1 over the kept tokens. Greedy
(T = 0): log_softmax of the penalised logits, untempered and untruncated (vLLM's greedy processed log-probs).

HF's ``generate`` applies min_p after top_k / top_p (vLLM before them): the two differ only when min_p and
top_p are both set. The trainer's log pi_theta and log pi_old are of the model's own distribution
softmax(logits / T), with no penalty or truncation (as TRL and verl): see docs/api.md, "what logp_rollout is".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cispo.config.rollout import processes

__all__ = ["penalise", "processed_logprobs", "processes", "seen_tokens", "sequence_processed_logprobs"]


def seen_tokens(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Which token ids occur in each row of ``ids`` [b, L] where ``mask`` [b, L] is nonzero  -> [b, V] bool
    (the set the repetition penalty reaches: prompt and response so far, padding left out)."""
    seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)  # [b, V + 1]
    seen.scatter_(1, ids.masked_fill(mask == 0, vocab), True)  # padding lands in the extra column
    return seen[:, :vocab]


def penalise(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty on logits [b, V] at the ``seen`` [b, V] tokens: a positive logit divided by
    ``penalty``, a negative one multiplied (HF's ``RepetitionPenaltyLogitsProcessor``)."""
    if penalty == 1.0:
        return logits
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def processed_logprobs(logits: torch.Tensor, cfg, seen: torch.Tensor | None = None) -> torch.Tensor:
    """log pi_rollout over the vocabulary from the model's logits [b, V] (see the module docstring): -inf at
    the tokens the truncation drops, the rest summing to 1 in probability.  -> [b, V] (float32 or float64)

    ``seen`` [b, V] bool: the tokens already in each row's prompt + response (`seen_tokens`); needed with a
    repetition penalty."""
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()  # half precision: to float32
    if cfg.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("a repetition penalty needs the tokens already seen (seen=...)")
        z = penalise(z, seen, cfg.repetition_penalty)
    if cfg.temperature == 0:  # greedy: the penalised distribution, untempered, untruncated
        return F.log_softmax(z, dim=-1)
    z = z / cfg.temperature  # [b, V]
    if cfg.min_p > 0:
        logp = F.log_softmax(z, dim=-1)
        z = z.masked_fill(logp < logp.amax(-1, keepdim=True) + math.log(cfg.min_p), -torch.inf)
    if 0 < cfg.top_k < z.shape[-1]:
        kth = z.topk(cfg.top_k, dim=-1).values[:, -1:]  # [b, 1]
        z = z.masked_fill(z < kth, -torch.inf)
    if cfg.top_p < 1.0:
        p, order = F.softmax(z, dim=-1).sort(dim=-1, descending=True)  # [b, V]
        drop = p.cumsum(-1) - p >= cfg.top_p  # the more likely tokens already reach top_p (the first never)
        z = z.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    return F.log_softmax(z, dim=-1)


def sequence_processed_logprobs(logits: torch.Tensor, response_ids: torch.Tensor, cfg, prompt_ids: torch.Tensor,
                                prompt_mask: torch.Tensor) -> torch.Tensor:
    """log pi_rollout of every response token from one forward's logits over the response [B, T, V] (position t
    predicts token t): what the sampler reported as ``logp_rollout``, recomputed, each position's repetition
    penalty reaching the prompt's real tokens and the response's before it.  -> [B, T]"""
    B, T, V = logits.shape
    seen = None
    if cfg.repetition_penalty != 1.0:
        earlier = F.one_hot(response_ids, V).cumsum(1) - F.one_hot(response_ids, V)  # [B, T, V] counts before t
        seen = (earlier > 0) | seen_tokens(prompt_ids, prompt_mask, V)[:, None]  # [B, T, V]
        seen = seen.reshape(B * T, V)
    logp = processed_logprobs(logits.reshape(B * T, V), cfg, seen)  # [B T, V]
    return logp.gather(-1, response_ids.reshape(B * T, 1)).reshape(B, T)
