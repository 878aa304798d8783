"""The policy being trained and its forward pass: token log-probs of an ``Experience``.

``Policy`` bundles the model, its tokenizer and its sampler; ``policy_logprobs`` is the one
forward the trainer runs (logp_old and every update), through the chunked head of
``cispo.objective.logprobs``; ``head_mismatch`` checks at load that this head reproduces the model's
own distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cispo.foundations.distributed import sharded_call
from cispo.foundations.experience import Experience
from cispo.models.shared_prefix import shared_prefix_hidden, shared_prompts
from cispo.objective.fused_head import TokenLoss, fused_head_loss
from cispo.objective.logprobs import lm_logits, logit_transform, token_logprobs

if TYPE_CHECKING:  # cispo.rollout's torch sampler uses this module's decoder / lm_head
    from cispo.rollout.base import Sampler


@dataclass
class Policy:
    """The model being trained, its tokenizer and its sampler; with a KL penalty
    (``kl_coef > 0``) also the frozen reference policy pi_ref (eval mode, no gradients)."""

    model: torch.nn.Module
    tokenizer: object
    sampler: Sampler
    device: torch.device
    chat_template: bool = False
    system_prompt: str | None = None  # data.system_prompt: a system message before the chat messages
    autocast: torch.dtype | None = None  # mixed precision: compute dtype over FP32 master weights
    ref_model: torch.nn.Module | None = None  # pi_ref of the KL penalty, run under the same ``compute()``
    train_body: Callable | None = None  # the decoder of the trainer's passes (``model.compile``); None: decoder(model)
    grad_scaler: torch.amp.GradScaler | None = None  # float16 autocast: dynamic loss scaling (`loss_scaler`)
    environment: object | None = None  # multi-turn rollouts: ``start(samples) -> Episodes`` (cispo.envs)
    tools: list[dict] | None = None  # the tools' JSON schemas the chat template renders into the prompt
    share_prompts: bool = False  # the trainer's passes run each shared prompt once (cispo.models.shared_prefix)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on: times the loss scale S under float16 autocast (so
        small gradients survive float16's range; ``unscale`` divides them by S again), else as is."""
        return self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss

    def compute(self):
        """The context of every forward pass: ``torch.autocast`` in ``autocast``, or nothing."""
        return torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None)

    def encode(self, sample: dict) -> list[int]:
        """Prompt token ids. With ``chat_template``: the sample's whole chat message list (system, user
        and earlier assistant turns), or its text prompt as one user message, after a system message
        ``system_prompt`` unless the messages start with their own, rendered by the tokenizer's template
        with the assistant turn opened (``add_generation_prompt=True``) and the ``tools``' schemas
        where there are tools. Without: the text ``prompt``
        (for a chat-message row, its last user message: ``cispo.data.datasets``). A sample with ``prompt_ids``
        (an environment's opening as token ids) is those ids."""
        if sample.get("prompt_ids") is not None:  # an environment's opening given as ids (cispo.envs)
            return list(sample["prompt_ids"])
        if self.chat_template:
            messages = sample.get("messages") or [{"role": "user", "content": sample["prompt"]}]
            if self.system_prompt is not None and messages[0].get("role") != "system":
                messages = [{"role": "system", "content": self.system_prompt}, *messages]
            tools = {"tools": self.tools} if self.tools else {}
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **tools)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return self.tokenizer.encode(sample["prompt"], add_special_tokens=True)

    def prompt_lengths(self, samples: list[dict]) -> list[int]:
        """``len(self.encode(s))`` for each of ``samples``: in one call of the tokenizers library where that
        gives the same ids (`batch_encoder`: 20 000 prompts in ~0.1 s instead of ~0.4 s), else one by one."""
        encode_batch = None if self.chat_template else batch_encoder(self.tokenizer)
        if encode_batch is None:
            return [len(self.encode(s)) for s in samples]
        return [len(e) for e in encode_batch([s["prompt"] for s in samples], add_special_tokens=True)]

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id


PLAIN_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""transformers' own fast-tokenizer classes, whose ``encode(text)`` is the tokenizers library's ``encode_batch([text])``
once truncation and padding are off and special tokens set to split as the tokenizer says."""


def batch_encoder(tokenizer):
    """The tokenizers-library call that encodes a list of texts to the ids ``tokenizer.encode`` gives each
    (``encode_batch_fast``: no character offsets), or None where that is not certain: a class other than
    `PLAIN_FAST_TOKENIZERS` (a subclass may encode in its own way; a slow tokenizer has no backend), truncation
    or padding set on the backend (``encode`` turns them off first), or special tokens split otherwise than
    ``encode`` would set them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(tokenizer).__name__ not in PLAIN_FAST_TOKENIZERS:
        return None
    if not type(tokenizer).__module__.startswith("transformers."):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if getattr(backend, "encode_special_tokens", False) != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return getattr(backend, "encode_batch_fast", None) or backend.encode_batch


def lm_head(model) -> torch.nn.Module:
    """The output projection of a Hugging Face causal LM."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding layer with a weight")
    return head


def decoder(model) -> torch.nn.Module:
    """The body of a Hugging Face causal LM (returns ``last_hidden_state``, final norm applied)."""
    return getattr(model, model.base_model_prefix)


def policy_logprobs(
    model,
    exp: Experience,
    temperature: float = 1.0,
    fp32_head: bool = True,
    with_entropy: bool = False,
    chunk_size: int = 4096,
    body: Callable | None = None,
    share_prompts: bool = False,
):
    """log pi(o_it | q, o_i<t) / temperature-scaled, for every response token of ``exp``.

    One forward of the decoder over prompt + response (the last token is not needed: it
    predicts nothing), then the LM head in chunks (``cispo.objective.logprobs``), with the model's own
    logit post-processing (``logit_transform(model.config)``: Gemma's soft cap, Cohere's /
    Granite's scaling), so the result is ``log_softmax(model(...).logits / temperature)``
    of the response tokens. -> [B, T] (, [B, T])
    On a model sharded with FSDP2 it runs inside the root's forward hooks (``sharded_call``),
    which gather the embeddings and the LM head it uses. ``body``: the decoder to run
    (``Policy.train_body``, e.g. compiled by ``cispo.models.compile``); None: ``decoder(model)``.
    ``share_prompts``: each distinct prompt run once for the rows that share it (``cispo.models.shared_prefix``).
    """
    return sharded_call(model, lambda: _policy_logprobs(model, exp, temperature, fp32_head, with_entropy, chunk_size,
                                                        body, share_prompts))


def _response_hidden(model, exp: Experience, body: Callable | None = None, share_prompts: bool = False) -> torch.Tensor:
    """The decoder's states that predict the response tokens of ``exp`` (one forward over
    prompt + response, the last token left out: it predicts nothing), from ``body`` (None:
    ``decoder(model)``). ``share_prompts``: rows that share a prompt run it once
    (``cispo.models.shared_prefix``; the caller checked the model is covered).  -> [B, T, H]"""
    if share_prompts and (rows := shared_prompts(exp)) is not None:
        return shared_prefix_hidden(body or decoder(model), exp, rows)
    T = exp.response_mask.shape[1]
    P = exp.input_ids.shape[1] - T
    attention_mask = exp.attention_mask  # [B, P+T]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P+T]
    hidden = (body or decoder(model))(
        input_ids=exp.input_ids[:, :-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, :-1],
        use_cache=False,
    ).last_hidden_state  # [B, P+T-1, H]
    return hidden[:, P - 1 :]  # [B, T, H]


def _policy_logprobs(model, exp: Experience, temperature: float, fp32_head: bool, with_entropy: bool,
                     chunk_size: int, body: Callable | None = None, share_prompts: bool = False):
    hidden = _response_hidden(model, exp, body, share_prompts)  # [B, T, H]
    head = lm_head(model)
    return token_logprobs(
        hidden,
        head.weight,
        exp.response_ids,
        bias=getattr(head, "bias", None),
        temperature=temperature,
        fp32_head=fp32_head,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        transform=logit_transform(model.config),
    )


def policy_fused_loss(model, exp: Experience, token_loss: TokenLoss, temperature: float = 1.0,
                      fp32_head: bool = True, chunk_size: int = 4096, body: Callable | None = None,
                      share_prompts: bool = False, with_entropy: bool = False):
    """The decoder forward of ``policy_logprobs``, then the LM head and the objective
    ``token_loss`` (``cispo.objective.fused_head.token_objective``) in one chunked pass whose gradients
    are formed in the forward (``cispo.objective.fused_head.fused_head_loss``); ``body`` and ``share_prompts`` as there.
    -> (loss [], logp [B, T] detached, the log-probs ``policy_logprobs`` returns), and with ``with_entropy`` the
    entropy [B, T] detached as a third (the objective's entropy bonus is taken inside, with its gradient)"""
    def run():
        head = lm_head(model)
        hidden = _response_hidden(model, exp, body, share_prompts)
        loss, logp, ent = fused_head_loss(hidden, head.weight, exp.response_ids, token_loss,
                                          bias=getattr(head, "bias", None), temperature=temperature,
                                          fp32_head=fp32_head, chunk_size=chunk_size, with_entropy=with_entropy,
                                          transform=logit_transform(model.config))
        return (loss, logp, ent) if with_entropy else (loss, logp)

    return sharded_call(model, run)


@torch.no_grad()
def head_mismatch(model, num_tokens: int = 8) -> float:
    """Largest |log_softmax(our head) - log_softmax(model(...).logits)| (nats) over the whole
    vocabulary at ``num_tokens`` fixed positions, in eval mode. Our head is ``lm_logits`` (the
    function ``token_logprobs`` computes per chunk) with ``logit_transform(model.config)``: 0 up to
    rounding when it reproduces the model's own distribution, large when the model post-processes
    its logits in a way ``logit_transform`` does not know. For an unsharded model (check before
    ``shard_model``)."""
    head = lm_head(model)
    ids = ((torch.arange(num_tokens, device=head.weight.device) * 7919 + 3) % head.weight.shape[0])[None]  # [1, T]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        def both():
            hidden = decoder(model)(input_ids=ids, use_cache=False).last_hidden_state  # [1, T, H]
            ours = lm_logits(hidden, head.weight, bias=getattr(head, "bias", None),
                             transform=logit_transform(model.config))  # [1, T, V]
            return ours, model(input_ids=ids, use_cache=False).logits.float()  # [1, T, V]

        ours, ref = both()
        return float((torch.log_softmax(ours, -1) - torch.log_softmax(ref, -1)).abs().max())
    finally:
        for m, training in modes:
            m.training = training


def loss_scaler(autocast: torch.dtype | None, device: torch.device) -> torch.amp.GradScaler | None:
    """Dynamic loss scaling for float16 mixed precision (FP32 master weights, float16 autocast):
    gradients are computed for S * loss and divided by S before clipping and the step; an update
    whose gradient overflows is skipped and S halves, and S doubles after 2000 clean updates
    (``torch.amp.GradScaler``'s defaults, S0 = 2^16). float16's smallest normal number is 6e-5,
    so without it the small activation gradients of a token-normalised loss flush to zero.
    bfloat16 (float32's exponent range) and float32 need none: None."""
    return torch.amp.GradScaler(device.type) if autocast == torch.float16 else None
