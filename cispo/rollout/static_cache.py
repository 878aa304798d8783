"""A lean decode step for Llama-family Hugging Face models: a static KV cache written in place.

``TorchSampler`` decodes through the model's ``forward`` with a ``DynamicCache`` by default. Each
step there concatenates every layer's keys and values onto the cache (``torch.cat``: a copy of the
whole cache per layer per step), rebuilds the rotary table and the 4-D attention mask, and walks
the Hugging Face module tree. :class:`StaticDecoder` does the same arithmetic with less around it:

* the prompt is prefilled by the model's own forward (one call); its keys and values are copied
  into buffers of the final length ``[B, kv_heads, P + max_new_tokens, head_dim]`` and every
  decoded token's key/value is written in place into its column (the cache is never copied);
* the rotary ``cos``/``sin`` of every position of the batch and the boolean padding mask are
  computed once per batch; a step takes a slice;
* rows that have stopped are dropped from the compute batch (the buffers are compacted when a
  quarter of the rows still computed have stopped), so a batch with early EOS gets cheaper;
* in a multi-turn rollout (:meth:`StaticDecoder.feed`) each row has its own next column: a row that
  gets an environment's observation runs it through its cache in one forward of several positions
  (its sampled token, then the observation's ids; the tokens of all rows packed for the projections
  and MLPs, attention masked per row to its own columns), while the other rows decode one token in
  the same call;
* a step calls the layers' own sub-modules (norms, projections, MLP — LoRA-wrapped ones too),
  the model's own ``apply_rotary_pos_emb`` and its SDPA attention function with the inputs
  Hugging Face would pass them, so the results are those of the ``forward`` path (equal up to
  floating-point reassociation inside batched kernels; tests check tokens and log-probs).

Supported: ``model_type`` ``llama`` / ``qwen2`` / ``mistral`` (the built-in model is a Llama),
SDPA attention, full attention in every layer (Mistral's sliding window only when the whole
sequence fits in it), a rotary embedding that does not depend on the sequence length. Anything
else returns a reason from :func:`unsupported_reason` and the sampler uses the ``forward`` path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from cispo.models.policy import decoder, lm_head
from cispo.objective.logprobs import lm_logits, logit_transform

LEAN_MODEL_TYPES = ("llama", "qwen2", "mistral")
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # their tables change with the sequence length
COMPACT_WHEN_STOPPED = 0.25  # compact the buffers once this fraction of the computed rows has stopped


def unsupported_reason(model: torch.nn.Module, total_len: int | None = None) -> str | None:
    """None if :class:`StaticDecoder` can decode ``model`` (sequences of ``total_len`` tokens; None: the
    length is checked later), else why not."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {LEAN_MODEL_TYPES}"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention implementation {config._attn_implementation!r} is not 'sdpa'"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return "some layers use sliding-window attention"
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral" and window is not None and total_len is not None and total_len > window:
        return f"the sequence ({total_len} tokens) exceeds Mistral's sliding window ({window})"
    try:
        body = decoder(model)
        layers = body.layers
        attn = layers[0].self_attn
        _ = (body.embed_tokens, body.norm, body.rotary_emb, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
             layers[0].mlp, layers[0].input_layernorm, layers[0].post_attention_layernorm)
    except (AttributeError, IndexError, TypeError) as e:
        return f"not a Llama-style module tree ({e})"
    rope = str(getattr(body.rotary_emb, "rope_type", "default"))
    if any(k in rope for k in _LENGTH_DEPENDENT_ROPE):
        return f"rope_type {rope!r} depends on the sequence length"
    return None


class StaticDecoder:
    """Decodes one batch against a preallocated KV cache; one instance per ``generate`` call.

    Args:
        model: a supported causal LM (:func:`unsupported_reason` is None).
        cache: the model's cache after the prefill of the left-padded prompt [B, P].
        prompt_mask: [B, P] 1 at real prompt tokens.
        positions: [B, P + max_new_tokens] the position of every column (prompt and response).
        max_new_tokens: the response columns to reserve.
        fp32_head: logits from ``cispo.objective.logprobs.lm_logits`` (as ``TorchSampler(fp32_head=True)``),
            else from the model's ``lm_head`` cast to float32.
        layer_stack: runs :func:`layer_stack` (same arguments; e.g. ``cispo.models.compile.CompiledLayerStack``,
            which compiles it); None: :func:`layer_stack` itself, eager.
        cache_rows: [B] the cache row each batch row starts from, when the prefill ran each distinct prompt
            once (``cispo.rollout.torch_sampler.shared_rows``); None: the cache has the B rows.
    """

    def __init__(self, model: torch.nn.Module, cache, prompt_mask: torch.Tensor, positions: torch.Tensor,
                 max_new_tokens: int, fp32_head: bool, layer_stack: Callable | None = None,
                 cache_rows: torch.Tensor | None = None) -> None:
        self.model, self.fp32_head = model, fp32_head
        self.layer_stack = layer_stack
        self.body = decoder(model)
        self.layers = list(self.body.layers)
        modeling = sys.modules[type(self.layers[0].self_attn).__module__]
        self._rotary = modeling.apply_rotary_pos_emb
        self._attention = modeling.ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", modeling.eager_attention_forward)
        self.head = lm_head(model)
        self.transform = logit_transform(model.config)
        B, P = prompt_mask.shape
        self.P, L = P, P + max_new_tokens
        self.keys, self.values = [], []  # per layer [b, kv_heads, L, head_dim], written in place
        for layer in cache.layers:
            k, v = layer.keys, layer.values  # [B, kv_heads, P, head_dim] ([U, ...] with cache_rows)
            if cache_rows is not None:
                k, v = k.index_select(0, cache_rows), v.index_select(0, cache_rows)  # [B, kv_heads, P, head_dim]
            # zeros, not empty: `feed` attends to columns another row wrote but this one has not (masked; a
            # NaN left in freed memory would survive the mask)
            kb = k.new_zeros(B, k.shape[1], L, k.shape[3])
            vb = v.new_zeros(B, v.shape[1], L, v.shape[3])
            kb[:, :, :P], vb[:, :, :P] = k, v
            self.keys.append(kb)
            self.values.append(vb)
        weight = self.body.embed_tokens.weight
        # cos, sin [B, L, head_dim]: computed once, in the dtype the model's own forward uses (the embeddings').
        self.cos, self.sin = self.body.rotary_emb(weight.new_empty(0), positions)
        # Every response column is attended (a stopped row's pads come after its real tokens).
        self.mask = torch.cat([prompt_mask.bool(), prompt_mask.new_ones(B, L - P, dtype=torch.bool)], 1)  # [B, L]
        self.rows = torch.arange(B, device=prompt_mask.device)  # [b] original rows still computed
        self._set_padded()

    def _set_padded(self) -> None:
        # Hugging Face passes no mask at all when no row is padded; do the same (same kernel).
        self.padded = not bool(self.mask[:, : self.P].all())

    def _compact(self, keep: torch.Tensor) -> None:
        """Keep only the computed rows at positions ``keep`` [b'] (of the current compute batch)."""
        self.keys = [k.index_select(0, keep) for k in self.keys]
        self.values = [v.index_select(0, keep) for v in self.values]
        self.cos, self.sin = self.cos.index_select(0, keep), self.sin.index_select(0, keep)
        self.mask = self.mask.index_select(0, keep)
        self.rows = self.rows.index_select(0, keep)
        self._set_padded()

    def _drop_stopped(self, finished: torch.Tensor) -> torch.Tensor:
        """Compact when enough computed rows have stopped (``finished`` [B]); returns the computed rows'
        liveness [b]."""
        alive = ~finished.index_select(0, self.rows)  # [b]
        if int(alive.sum()) <= (1 - COMPACT_WHEN_STOPPED) * len(self.rows):
            self._compact(alive.nonzero().squeeze(1))
            alive = ~finished.index_select(0, self.rows)
        return alive

    def step(self, tokens: torch.Tensor, finished: torch.Tensor, t: int) -> torch.Tensor:
        """Feed response token ``t`` (``tokens`` [B], over all rows; ``finished`` [B] rows already stopped).

        Returns the float32 next-token logits [b, V] of the rows in ``self.rows`` [b] (a subset of the
        unfinished ones may be dropped only when stopped: every unfinished row is in ``self.rows``)."""
        self._drop_stopped(finished)
        return self._one_column(tokens.index_select(0, self.rows), self.P + t)

    def _one_column(self, tokens: torch.Tensor, col: int) -> torch.Tensor:
        """One token per computed row (``tokens`` [b]) at cache column ``col`` -> next-token logits [b, V]."""
        seen = col + 1
        x = self.body.embed_tokens(tokens[:, None])  # [b, 1, H]
        cos, sin = self.cos[:, col : col + 1], self.sin[:, col : col + 1]  # [b, 1, head_dim]
        mask = self.mask[:, None, None, :seen]  # [b, 1, 1, seen]
        args = (self.layers, self.body.norm, self._rotary, x, cos, sin, mask, self.keys, self.values, col)
        h = (self.layer_stack or layer_stack)(*args, attention=self._attention, padded=self.padded)  # [b, H]
        return self._logits(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The float32 next-token logits [b, V] of final hidden states h [b, H]."""
        if self.fp32_head:
            return lm_logits(h, self.head.weight, bias=getattr(self.head, "bias", None), transform=self.transform)
        return self.head(h).float()  # [b, V]

    def feed(self, response: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, finished: torch.Tensor,
             pad: int) -> torch.Tensor:
        """Run every computed row's new response columns ``start[i] .. stop[i] - 1`` (``response`` [B, T]; its
        sampled token, then the observation it was given, if any) through its cache in one forward, each row
        at its own columns; ``finished`` [B] rows already stopped (they run one pad token, its logits unused).

        Returns the next-token logits [b, V] at each computed row's last new column (rows ``self.rows``). When
        every live row adds one token at one column this is :meth:`step` (same kernels)."""
        alive = self._drop_stopped(finished)  # [b]
        start, n = start.index_select(0, self.rows), (stop - start).index_select(0, self.rows)  # [b], [b]
        live_start, live_n = start[alive], n[alive]
        if bool((live_n == 1).all()) and bool((live_start == live_start[:1]).all()):
            c = int(live_start[0]) if len(live_start) else 0
            tokens = response.index_select(0, self.rows)[:, c].masked_fill(~alive, pad)  # [b]
            return self._one_column(tokens, self.P + c)
        width = self.mask.shape[1] - self.P  # response columns
        start = torch.where(alive, start, start.clamp(max=width - 1))  # [b]
        n = torch.where(alive, n, 1)  # [b] a stopped row: one pad token, written to its own cache, never read
        m = int(n.max())
        j = torch.arange(m, device=n.device)  # [m]
        real = j < n[:, None]  # [b, m] a new token, not padding
        cols = self.P + start[:, None] + j * real  # [b, m] each new token's cache column (padding: the row's first)
        row, slot = real.nonzero(as_tuple=True)  # [N], [N] the new tokens, packed: their row and place in it
        col = cols[row, slot]  # [N]
        ids = response.index_select(0, self.rows)[row, col - self.P].masked_fill(~alive[row], pad)  # [N]
        S = int(col.max()) + 1  # columns any new token attends to
        mask = chunk_mask(self.mask[:, :S], cols)  # [b, 1, m, S]
        cos, sin = self.cos[row, col], self.sin[row, col]  # [N, head_dim]
        x = self.body.embed_tokens(ids)  # [N, H]
        h = packed_layer_stack(self.layers, self.body.norm, self._rotary, x, cos, sin, mask, self.keys, self.values,
                               row, col, None if m == 1 else slot, attention=self._attention)  # [N, H]
        if m == 1:  # one token per row, in row order: N = b
            return self._logits(h)  # [b, V]
        return self._logits(h[slot == n[row] - 1])  # [b, V] each row's last new token


def layer_stack(layers, norm, rotary, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor], col: int, attention: Callable,
                padded: bool = True) -> torch.Tensor:
    """One new token per row through every decoder layer, as the model's own layers compute it:
    x [b, 1, H] -> the final norm's hidden state [b, H]. Writes each layer's new key and value into
    column ``col`` of ``keys`` / ``values`` ([b, kv_heads, L, head_dim] each) and attends to columns
    ``0..col``. ``mask`` [b, 1, 1, col + 1] (True: attend) is passed to ``attention`` only when
    ``padded`` (Hugging Face passes no mask when no prompt is padded; the same kernel then runs)."""
    for layer, kc, vc in zip(layers, keys, values):
        x = x + _attend(layer.self_attn, rotary, attention, layer.input_layernorm(x), kc, vc, cos, sin,
                        mask if padded else None, col)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return norm(x)[:, -1]  # [b, H]


def _attend(attn, rotary, attention, h, kc, vc, cos, sin, mask, col: int) -> torch.Tensor:
    """Self-attention of one new token per row, as the model's attention module computes it."""
    shape = (h.shape[0], 1, -1, attn.head_dim)
    q = attn.q_proj(h).view(shape).transpose(1, 2)  # [b, heads, 1, head_dim]
    k = attn.k_proj(h).view(shape).transpose(1, 2)  # [b, kv_heads, 1, head_dim]
    v = attn.v_proj(h).view(shape).transpose(1, 2)  # [b, kv_heads, 1, head_dim]
    q, k = rotary(q, k, cos, sin)
    kc[:, :, col : col + 1] = k
    vc[:, :, col : col + 1] = v
    out, _ = attention(attn, q, kc[:, :, : col + 1], vc[:, :, : col + 1], mask, dropout=0.0,
                       scaling=attn.scaling)  # [b, 1, heads, head_dim]
    return attn.o_proj(out.reshape(h.shape[0], 1, -1).contiguous())  # [b, 1, H]


def chunk_mask(columns: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Which cache columns each new token attends to: mask[i, 0, j, c] = columns[i, c] and c <= cols[i, j]
    (a real column of row i's context, at or before token j's own column). columns [b, S] bool (True: a real
    token, not padding), cols [b, m] -> [b, 1, m, S]."""
    c = torch.arange(columns.shape[1], device=cols.device)  # [S]
    return columns[:, None, None, :] & (c <= cols[:, None, :, None])  # [b, 1, m, S]


def packed_layer_stack(layers, norm, rotary, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       mask: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], row: torch.Tensor,
                       col: torch.Tensor, slot: torch.Tensor | None, attention: Callable) -> torch.Tensor:
    """N new tokens, packed (each row's own, in order; rows add different counts), through every decoder
    layer as the model's own layers compute them: x [N, H] -> the final norm's hidden states [N, H]. The
    projections and MLPs run on the N tokens alone (no padding); token n's key and value go into column
    ``col[n]`` of row ``row[n]`` of ``keys`` / ``values`` ([b, kv_heads, L, head_dim] each), and its query
    attends, as place ``slot[n]`` of its row's m, to the first S columns where ``mask`` [b, 1, m, S] is
    True (``chunk_mask``). ``slot`` None: one token per row, in row order (N = b, m = 1)."""
    for layer, kc, vc in zip(layers, keys, values):
        x = x + _attend_packed(layer.self_attn, rotary, attention, layer.input_layernorm(x), kc, vc, cos, sin, mask,
                               row, col, slot)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return norm(x)  # [N, H]


def _attend_packed(attn, rotary, attention, h, kc, vc, cos, sin, mask, row, col, slot) -> torch.Tensor:
    """Self-attention of N packed new tokens (``packed_layer_stack``); the queries are laid out per row
    [b, heads, m, head_dim] (zeros at the padding) for the attention function alone."""
    N, d = h.shape[0], attn.head_dim
    q = attn.q_proj(h).view(N, -1, d)  # [N, heads, head_dim]
    k = attn.k_proj(h).view(N, -1, d)  # [N, kv_heads, head_dim]
    v = attn.v_proj(h).view(N, -1, d)  # [N, kv_heads, head_dim]
    q, k = rotary(q, k, cos, sin)  # cos, sin [N, head_dim] -> [N, 1, head_dim] over the heads
    kc[row, :, col] = k.to(kc.dtype)  # into each token's row and column
    vc[row, :, col] = v.to(vc.dtype)
    b, _, m, S = mask.shape
    if slot is None:  # one token per row, in row order
        qp = q[:, None]  # [b, 1, heads, head_dim]
    else:
        qp = q.new_zeros(b, m, q.shape[1], d)  # [b, m, heads, head_dim]
        qp[row, slot] = q
    out, _ = attention(attn, qp.transpose(1, 2), kc[:, :, :S], vc[:, :, :S], mask, dropout=0.0,
                       scaling=attn.scaling)  # [b, m, heads, head_dim]
    out = out[:, 0] if slot is None else out[row, slot]  # [N, heads, head_dim]
    return attn.o_proj(out.reshape(N, -1))  # [N, H]


def matmul_attention(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, **_) -> tuple[torch.Tensor, None]:
    """``softmax(q kᵀ · scaling) v`` in plain matmuls, with the signature and result layout of
    Hugging Face's attention functions: q [b, heads, 1, d], k / v [b, kv_heads, S, d] (each kv head
    serves ``heads / kv_heads`` query heads), mask [b, 1, 1, S] True where attended, or None ->
    ([b, 1, heads, d], None). Under ``torch.compile`` inductor fuses it into the layer's kernels,
    where SDPA's CPU kernel stays an opaque call (docs/performance.md); eager it is no faster."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [b, heads, S, d]
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling  # SDPA's default
    scores = (q @ k.transpose(-1, -2)) * scaling  # [b, heads, 1, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2), None  # [b, 1, heads, d]
