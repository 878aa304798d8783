"""The training forward with each prompt computed once per group ("Prefix Grouper",
arXiv 2506.05433).

A group's G rows share their prompt. The plain forward runs ``[prompt, response]`` for every row, so
the prompt's tokens go through every layer G times, forward and backward. Here:

1. the distinct prompts of the batch (``shared_prompts``) run once, with the model's KV cache on
   (gradients kept: its keys and values are ordinary tensors of the graph);
2. the cache is expanded to the B rows (``reorder_cache``: an ``index_select`` per layer), and the
   responses run against it: each row attends to its prompt's keys and values and to its own
   tokens, at positions that continue the prompt's, exactly as in the plain forward;
3. the hidden state that predicts each row's first response token is its prompt's last one.

The hidden states are those of the plain forward up to float rounding, and so is the gradient:
autograd sums the G uses of the prompt's keys and values (``index_select``'s backward), which is the
sum over the G rows' copies that the plain forward computes (tests: a tiny Llama and Qwen2, LoRA, the
FP32 head). The saving is the prompt's share of the compute, times (G - 1) / G, on the rows of one
call that share a prompt: the trainer's micro-batches decide how many do (docs/performance.md).

Covered: the decoders whose cache this reproduces exactly — ``SHARED_PREFIX_MODEL_TYPES`` with full
attention in every layer; anything else runs the plain forward (``unsupported_reason`` says why).
"""

from __future__ import annotations

import inspect

import torch

from cispo.foundations.experience import Experience

SHARED_PREFIX_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def unsupported_reason(model) -> str | None:
    """None if ``shared_prefix_hidden`` can run ``model``, else why not (one line)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # transformers renamed it
    if getattr(model, name, False):
        return "gradient checkpointing keeps no KV cache"
    if model_type not in SHARED_PREFIX_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SHARED_PREFIX_MODEL_TYPES}"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return "some layers use sliding-window attention"
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "Mistral's sliding window"
    return None


MIN_SAVING = 0.25
"""A call shares its prompts only where that saves at least this share of its decoder positions:
(B - U) x P of B x (P + T - 1). Below it, one call more (the prompt's) costs about what it saves, and
the plain forward keeps the result bitwise as it was (the built-in tasks' prompts are a few tokens)."""


def shared_prompts(exp: Experience, min_saving: float | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first, copies)`` for the rows of ``exp`` that share a prompt (the same ids in the same
    left-padded columns): ``first`` [U] one row per distinct prompt, ``copies`` [B] the position in
    ``first`` of each row's prompt. None when every prompt is distinct, or when running each once
    saves less than ``min_saving`` of the call's decoder positions (None: ``MIN_SAVING``)."""
    T = exp.response_mask.shape[1]
    P = exp.input_ids.shape[1] - T
    prompts = exp.input_ids[:, :P].masked_fill(exp.attention_mask[:, :P] == 0, -1)  # [B, P] pads as -1
    unique, copies = torch.unique(prompts, dim=0, return_inverse=True)  # [U, P], [B]
    B, U = len(prompts), len(unique)
    if U == B or (B - U) * P < (MIN_SAVING if min_saving is None else min_saving) * B * (P + T - 1):
        return None
    first = torch.full((len(unique),), len(prompts), dtype=torch.long, device=copies.device)
    first = first.scatter_reduce(0, copies, torch.arange(len(prompts), device=copies.device), "amin")  # [U]
    return first, copies


def _cache_kw(body) -> str:
    """The name the decoder's forward gives its KV cache (transformers >= 5.x: ``cache``)."""
    params = inspect.signature(body.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def shared_prefix_hidden(body, exp: Experience, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The decoder states that predict the response tokens of ``exp`` [B, T, H], each distinct prompt
    run once (``rows``: ``shared_prompts(exp)``). ``body``: the Hugging Face decoder (``decoder(model)``)."""
    first, copies = rows
    T = exp.response_mask.shape[1]
    P = exp.input_ids.shape[1] - T
    mask = exp.attention_mask  # [B, P + T]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P + T]
    kw = _cache_kw(body)
    out = body(input_ids=exp.input_ids[first, :P], attention_mask=mask[first, :P], position_ids=positions[first, :P],
               use_cache=True)
    last = out.last_hidden_state[:, -1:].index_select(0, copies)  # [B, 1, H]: predicts response token 0
    if T == 1:
        return last
    cache = getattr(out, kw)
    cache.reorder_cache(copies)  # each layer's keys / values: [U, kv, P, d] -> [B, kv, P, d]
    rest = body(input_ids=exp.input_ids[:, P:-1], attention_mask=mask[:, :-1], position_ids=positions[:, P:-1],
                use_cache=True, **{kw: cache}).last_hidden_state  # [B, T - 1, H]
    return torch.cat([last, rest], dim=1)  # [B, T, H]
