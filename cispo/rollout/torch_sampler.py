"""A batched sampler with a KV cache for any Hugging Face causal LM, in plain PyTorch.

Prompts are left-padded so every row's next token sits in the last column; positions count only real
tokens (``cumsum(attention_mask) - 1``), so a row's result does not depend on how much padding the
other rows forced on it. The prompt is run once (prefill), then one token per step is decoded against
the model's KV cache, with the attention mask grown by one column per step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

from cispo.foundations.distributed import sharded_call
from cispo.models.policy import decoder, lm_head
from cispo.objective.logprobs import lm_logits, logit_transform
from cispo.rollout.base import FINISH_REASONS, Episodes, RolloutBatch, Sampler, SamplingConfig, stop_ids
from cispo.rollout.decoding import DecodeRows
from cispo.rollout.processing import processed_logprobs, seen_tokens
from cispo.rollout.static_cache import StaticDecoder, layer_stack, matmul_attention, unsupported_reason

DECODE_MODES = ("auto", "static", "hf")


def _multinomial(probs: torch.Tensor, generator: torch.Generator | None, rows: torch.Tensor | None = None,
                 batch: int | None = None) -> torch.Tensor:
    """One draw per row of probs [b, V] -> [b], by inverse transform (`inverse_cdf`) of one uniform per row.

    ``torch.multinomial`` draws a token as ``argmax(p / q)`` with ``q ~ Exp(1)`` of probs' whole shape: on a CPU
    those V exponentials per row were 13 % of sampling SmolLM2 (49k tokens; docs/performance.md). One uniform per
    row draws from the same distribution. The uniforms are drawn for all ``batch`` rows and ``rows`` kept, so a
    sub-batch gets the tokens the whole batch would, with the same generator state afterwards (tested)."""
    n = probs.shape[0] if rows is None else batch
    u = torch.rand(n, dtype=torch.float64, device=probs.device, generator=generator)  # [B]
    return inverse_cdf(probs, u if rows is None else u.index_select(0, rows))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative-probability interval holds ``u`` [b] (in [0, 1)) of the row's total:
    the first i with F_i > u F_V, F = cumsum(probs) [b, V] in float64 (float32's cumsum over 49k tokens errs by
    ~1e-5, the size of the rare tokens' own probabilities). A token of probability 0 is never drawn."""
    cdf = probs.double().cumsum(-1)  # [b, V]
    total = cdf[:, -1:]  # [b, 1]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # [b, 1] < total
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [b]


def shared_rows(prompts: Sequence[Sequence[int]], device=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The distinct prompts of a batch, for a prefill that runs each once (a group's G rows share
    their prompt): ``(first, copies)`` with ``first`` [U] the first row of each distinct prompt, in
    order, and ``copies`` [B] the position in ``first`` of every row's prompt, so that
    ``x[first][copies]`` is ``x`` for any per-row tensor of the prompt. ``(None, None)`` when every
    prompt is distinct (nothing to share)."""
    index: dict[tuple[int, ...], int] = {}
    copies = [index.setdefault(tuple(p), len(index)) for p in prompts]  # [B]
    if len(index) == len(prompts):
        return None, None
    first = [0] * len(index)
    for row, u in reversed(list(enumerate(copies))):
        first[u] = row
    return torch.tensor(first, device=device), torch.tensor(copies, device=device)


def left_aligned(prompt: torch.Tensor, prompt_mask: torch.Tensor, response: torch.Tensor, lengths: torch.Tensor,
                 pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's context — its real prompt ids (prompt [B, P], prompt_mask [B, P]), then the first
    ``lengths[i]`` ids of its response [B, T] — left-padded to the longest: ids, attention mask [B, S]."""
    ids = torch.cat([prompt, response], 1)  # [B, P + T]
    cols = torch.arange(response.shape[1], device=response.device)  # [T]
    keep = torch.cat([prompt_mask.bool(), cols < lengths[:, None]], 1)  # [B, P + T]
    n_keep = keep.sum(1)  # [B]
    S = int(n_keep.max())
    dest = keep.long().cumsum(1) - 1 + (S - n_keep)[:, None]  # [B, P + T] where each kept id goes
    r, c = keep.nonzero(as_tuple=True)
    out = ids.new_full((len(ids), S), pad)
    mask = torch.zeros_like(out)
    out[r, dest[r, c]] = ids[r, c]
    mask[r, dest[r, c]] = 1
    return out, mask  # [B, S], [B, S]


def mark_seen(context: torch.Tensor, response: torch.Tensor, start: torch.Tensor, stop: torch.Tensor) -> None:
    """Put the response ids of columns ``start[i] .. stop[i] - 1`` (response [B, T]) into ``context`` [B, V]
    (bool: the ids the repetition penalty reaches), in place."""
    cols = torch.arange(response.shape[1], device=response.device)  # [T]
    r, c = ((cols >= start[:, None]) & (cols < stop[:, None])).nonzero(as_tuple=True)
    context[r, response[r, c]] = True


class TorchSampler(Sampler):
    """Samples from a ``transformers`` causal LM (anything whose ``forward`` takes ``input_ids``,
    ``attention_mask``, ``position_ids``, ``use_cache`` and a KV cache, and returns ``.logits``).

    Args:
        model: the policy. It is put in eval mode while sampling; every submodule's train/eval mode is
            restored afterwards.
        eos_token_id: the token that ends a response, or a list of them (``cispo.rollout.base.stop_ids``:
            a model's generation-config EOS ids and its chat template's end of turn,
            ``cispo.models.loading.stop_token_ids``); a row stops at the first it samples, which is kept
            in the response with mask 1.
        pad_token_id: fills the left of short prompts and the right of short responses. It may equal
            a stop id.
        autocast: None, or the low-precision dtype to compute in under ``torch.autocast`` (mixed
            precision with FP32 master weights, ``cispo.models.loading.precision``).
        fp32_head: compute the next-token logits with the trainer's head (``cispo.objective.logprobs.lm_logits``
            on the decoder's last hidden state, FP32, with the model's own logit post-processing) rather
            than ``model(...).logits``: the sampler's and the trainer's log-probs then come from one
            definition, also in low precision (MiniMax-M1's FP32 head on both sides). Needs a Hugging
            Face causal LM (``cispo.models.policy.decoder`` / ``lm_head``).
        decode: how the tokens after the prompt are decoded. ``"static"``: the lean loop of
            :mod:`cispo.rollout.static_cache` (a KV cache preallocated and written in place, rotary
            table and mask computed once per batch, stopped rows dropped) — Llama / Qwen2 / Mistral
            only, ValueError for other models; ``"hf"``: the model's ``forward`` with its
            ``DynamicCache`` every step; ``"auto"``: static where supported, else hf. The prompt is
            always prefilled by the model's forward. Same tokens and log-probs either way (tested).
        compile_step: with the static decode, run its per-token layer stack compiled
            (``cispo.models.compile.CompiledLayerStack``: compiled in the first decode step, reused by every
            later ``generate``; eager after a compile error). Log-probs within float32 rounding of
            the eager decode's (tested); ignored where the forward path decodes.
        prefill_observations: in a multi-turn rollout, run a row's whole observation through its KV cache in
            one forward (with the token that ended its turn; the other rows decode one token in the same
            step), so the row samples again at the next step: the batch takes one step per turn, not one
            per observation token. Same response layout, log-probs equal to a full recompute (tested);
            the tokens drawn differ from the token-by-token schedule's under sampling (the random
            numbers are drawn per step), equal when greedy. Applies to the static decode and the
            reference (``use_cache=False``); the ``hf`` decode feeds observations token by token. False:
            token by token everywhere.
        share_prefill: prefill each distinct prompt of a batch once and give its logits and KV cache to
            every row that has it (a group's G rows; ``shared_rows``): the prefill costs ~1/G of one
            per row, with the same tokens and log-probs up to float rounding (tested). False: one
            prefill row per batch row (the reference).

    Of the optional capabilities of :class:`Sampler` it has ``lock_step``: under it the decode loop
    runs until every rank's rows have stopped (stopped rows only get padding), and sampling runs
    under ``no_grad`` instead of ``inference_mode`` (FSDP's gathered weights must stay usable for
    training). It samples from the trained model itself, so it needs no weight sync.
    """

    def __init__(self, model: torch.nn.Module, eos_token_id: int | Sequence[int], pad_token_id: int,
                 autocast: torch.dtype | None = None, fp32_head: bool = False, decode: str = "auto",
                 compile_step: bool = False, share_prefill: bool = True, prefill_observations: bool = True) -> None:
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        if decode == "static" and (why := unsupported_reason(model)) is not None:
            raise ValueError(f"decode='static' cannot decode {type(model).__name__}: {why}; use decode='hf'")
        self.decode = decode
        self.compile_step = compile_step
        self.share_prefill = share_prefill
        self.prefill_observations = prefill_observations
        self._layer_stack = None  # the compiled decode step, built at the first static decode
        self.model = model
        self.autocast = autocast
        self.fp32_head = fp32_head
        self.stop_token_ids = stop_ids(eos_token_id)
        self.eos_token_id = self.stop_token_ids[0]  # the first stop id (the tokenizer's EOS in a run)
        self.pad_token_id = int(pad_token_id)
        self._all_ranks_done: Callable[[bool], bool] | None = None
        params = inspect.signature((decoder(model) if fp32_head else model).forward).parameters
        # transformers >= 5.x names the KV cache `cache` (in and out); older versions `past_key_values`.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Only the last position's logits are needed: skip the LM head elsewhere when the model allows.
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)

    def for_model(self, model: torch.nn.Module) -> TorchSampler:
        """A sampler with these settings over another module (`cispo.training.prefetch`: the asynchronous
        sampler's own copy of the weights)."""
        return TorchSampler(model, self.stop_token_ids, self.pad_token_id, autocast=self.autocast,
                            fp32_head=self.fp32_head, decode=self.decode, compile_step=self.compile_step,
                            share_prefill=self.share_prefill, prefill_observations=self.prefill_observations)

    def lock_step(self, all_ranks_done: Callable[[bool], bool] | None) -> None:
        """Decode until ``all_ranks_done(done)`` says every rank's rows have stopped (None: alone)."""
        self._all_ranks_done = all_ranks_done

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        cfg: SamplingConfig,
        generator: torch.Generator | None = None,
        episodes: Episodes | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt; see :class:`RolloutBatch` for the result's layout.

        Rows stop at a stop id ("eos"; ``stop_token_ids``), at ``cfg.max_new_tokens`` ("length") or at the
        repetition early stop ("repetition"); a stopped row gets pad tokens with mask 0, and the loop ends when
        every row has stopped. ``generator`` (on the model's device) makes sampling reproducible; greedy decoding
        (temperature 0) draws no random numbers. ``episodes``: a multi-turn rollout, each row's
        observations fed through its KV cache (:mod:`cispo.rollout.decoding`).
        """
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty: need at least one prompt")
        for i, p in enumerate(prompt_ids):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            with (torch.inference_mode() if self._all_ranks_done is None else torch.no_grad(),
                  torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None)):
                *tensors, reasons = self._sample(prompt_ids, cfg, generator, episodes)
        finally:
            for m, training in modes:
                m.training = training
        # Clone outside inference mode: inference tensors cannot be saved for backward by the trainer.
        prompt, prompt_mask, response, response_mask, logp, env_mask = (t.clone() for t in tensors)
        return RolloutBatch(
            prompt_ids=prompt,
            prompt_mask=prompt_mask,
            response_ids=response,
            response_mask=response_mask,
            logp_rollout=logp,
            finish_reason=[FINISH_REASONS[r] for r in reasons.tolist()],
            env_mask=None if episodes is None else env_mask,
        )

    def _lean(self, total_len: int) -> bool:
        """Whether this batch is decoded by :class:`StaticDecoder` (never for a sharded model)."""
        if self.decode == "hf" or self._all_ranks_done is not None:
            return False
        if getattr(self.model, "cispo_sharded_call", None) is not None:
            return False
        why = unsupported_reason(self.model, total_len)
        if why is not None and self.decode == "static":
            raise ValueError(f"decode='static' cannot decode this batch: {why}")
        return why is None

    def _forward(self, ids, mask, pos, cache, use_cache: bool):
        """One model call; returns the float32 logits of the last position [B, V] and the new cache."""
        kwargs = {self._keep_kw: 1} if self._keep_kw and not self.fp32_head else {}
        if use_cache:
            kwargs[self._cache_kw] = cache
        if self.fp32_head:
            return sharded_call(self.model, lambda: self._head_forward(ids, mask, pos, use_cache, kwargs))
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=use_cache, **kwargs)
        return out.logits[:, -1].float(), (getattr(out, self._cache_kw) if use_cache else None)

    def _head_forward(self, ids, mask, pos, use_cache: bool, kwargs):
        """The decoder, then the trainer's FP32 head on the last position: logits [B, V], cache."""
        out = decoder(self.model)(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=use_cache, **kwargs)
        head = lm_head(self.model)
        logits = lm_logits(out.last_hidden_state[:, -1], head.weight, bias=getattr(head, "bias", None),
                           transform=logit_transform(self.model.config))  # [B, V]
        return logits.float(), (getattr(out, self._cache_kw) if use_cache else None)

    @staticmethod
    def _pick(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
              rows: torch.Tensor | None = None, batch: int | None = None, seen: torch.Tensor | None = None):
        """Choose one token per row from logits [b, V]; returns (tokens [b], their log-probs [b]) under the
        distribution sampled (`cispo.rollout.processing.processed_logprobs`; ``seen`` [b, V]: the tokens the
        repetition penalty reaches).

        ``rows`` [b]: which of ``batch`` rows the logits belong to (None: all of them, b = batch). The
        random numbers drawn do not depend on ``rows``: the same ones as for the whole batch."""
        logp = processed_logprobs(logits, cfg, seen)  # [b, V]
        if cfg.temperature == 0:  # greedy: draws no random numbers
            tok = logp.argmax(-1)  # [b]
        else:
            tok = _multinomial(logp.exp(), generator, rows, batch)  # [b]
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

    def _sample(self, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, generator, episodes: Episodes | None):
        dev, pad, n_new = self.device, self.pad_token_id, cfg.max_new_tokens
        B, P = len(prompts), max(len(p) for p in prompts)
        prompt = torch.tensor([[pad] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long, device=dev)  # [B, P]
        lens = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
        prompt_mask = (torch.arange(P, device=dev) >= P - lens[:, None]).long()  # [B, P]
        # Every generated column is attended: a stopped row's trailing pads come after all its real tokens.
        attn = torch.cat([prompt_mask, prompt_mask.new_ones(B, n_new)], dim=1)  # [B, P + n_new]
        stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=dev)  # [S]
        out = DecodeRows(B, n_new, pad, stops, cfg, episodes, dev)
        pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        logits, cache, lean = self._prefill(prompts, prompt, prompt_mask, pos, cfg)  # [B, V]
        next_pos = pos[:, -1:] + 1  # [B, 1]
        rows = None  # [b] the rows the logits belong to (None: all B)
        penalised = cfg.repetition_penalty != 1.0
        context = seen_tokens(prompt, prompt_mask, logits.shape[-1]) if penalised else None  # [B, V] in the context
        chunked = episodes is not None and self.prefill_observations and (lean is not None or not cfg.use_cache)
        told = 0  # rows said stopped to `rows_done`
        for t in range(n_new):
            in_context = context if context is None or rows is None else context.index_select(0, rows)  # [b, V]
            tok, tok_logp = self._pick(logits, cfg, generator, rows, B, in_context)  # [b], [b]
            if rows is not None:  # back to [B]; dropped rows have stopped, their values are masked below
                tok = torch.full((B,), pad, dtype=tok.dtype, device=dev).index_copy_(0, rows, tok)  # [B]
                tok_logp = torch.zeros(B, dtype=tok_logp.dtype, device=dev).index_copy_(0, rows, tok_logp)  # [B]
            start = out.col.clone()  # [B] the column each row writes this step
            out.record(t, tok, tok_logp)
            if chunked:
                out.take_observations()  # whole observations, after the token that ended the turn
            if context is not None:  # the tokens just written (sampled or fed) are in the context from now on
                mark_seen(context, out.response, start, out.col)
            if self.rows_done is not None:  # a progress bar: the rows that stopped at this step
                stopped = B if t == n_new - 1 else int(out.finished.sum())
                if stopped > told:
                    self.rows_done(stopped - told)
                    told = stopped
            done = bool(out.finished.all())
            if self._all_ranks_done is not None:
                done = self._all_ranks_done(done)
            if t == n_new - 1 or done:
                break
            seen = P + t + 1  # tokens so far, incl. the one just sampled (token-by-token schedule)
            if lean is not None:
                logits = (lean.feed(out.response, start, out.col, out.finished, pad) if chunked
                          else lean.step(out.response[:, t], out.finished, t))  # [b, V]
                rows = None if len(lean.rows) == B else lean.rows
            elif cfg.use_cache:
                logits, cache = self._forward(out.response[:, t : t + 1], attn[:, :seen], next_pos, cache, True)
            else:  # reference: recompute each row's whole context
                ids, mask = ((left_aligned(prompt, prompt_mask, out.response, out.col, pad)) if chunked else
                             (torch.cat([prompt, out.response[:, : t + 1]], dim=1), attn[:, :seen]))  # [B, S]
                logits, _ = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), None, False)
            next_pos = next_pos + 1
        return prompt, prompt_mask, *out.outputs(t + 1)

    def _prefill(self, prompts, prompt: torch.Tensor, prompt_mask: torch.Tensor, pos: torch.Tensor,
                 cfg: SamplingConfig):
        """Run the left-padded prompts [B, P] (each distinct one once, ``share_prefill``): the logits of
        their last position [B, V], and either the model's cache over the B rows or a
        :class:`StaticDecoder` holding it (``(logits, None, decoder)``) where the lean decode applies."""
        dev, n_new = prompt.device, cfg.max_new_tokens
        first, copies = shared_rows(prompts, dev) if cfg.use_cache and self.share_prefill else (None, None)  # [U], [B]
        if first is None:
            logits, cache = self._forward(prompt, prompt_mask, pos, None, cfg.use_cache)  # [B, V]
        else:  # each distinct prompt prefilled once; its rows share the logits and the cache
            logits, cache = self._forward(prompt[first], prompt_mask[first], pos[first], None, True)  # [U, V]
            logits = logits.index_select(0, copies)  # [B, V]
        if cfg.use_cache and n_new > 1 and self._lean(prompt.shape[1] + n_new):
            positions = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(n_new, device=dev)], dim=1)  # [B, P + n_new]
            if self.compile_step and self._layer_stack is None:
                from cispo.models.compile import CompiledLayerStack

                self._layer_stack = CompiledLayerStack(layer_stack, matmul_attention)
            lean = StaticDecoder(self.model, cache, prompt_mask, positions, n_new, self.fp32_head, self._layer_stack,
                                 cache_rows=copies)
            return logits, None, lean
        if copies is not None and not hasattr(cache, "reorder_cache"):  # a cache we cannot expand: one row each
            self.share_prefill = False
            logits, cache = self._forward(prompt, prompt_mask, pos, None, True)  # [B, V]
        elif copies is not None:
            cache.reorder_cache(copies)  # every layer's keys and values index_select-ed: [U, ...] -> [B, ...]
        return logits, cache, None
