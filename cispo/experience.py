"""From sampled groups to training tensors, and the policy's log-probs of them.

One generation batch becomes an ``Experience``: B = groups x G rows, each the prompt
(left-padded) followed by the response (right-padded), with the sampler's log-probs, the
advantages and — filled in once before the K updates — ``logp_old``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from cispo.distributed import sharded_call
from cispo.logprobs import lm_logits, logit_transform, token_logprobs


@dataclass
class Completion:
    """One sampled response to one prompt, with its reward."""

    sample: dict  # the data set row: {"prompt", "answer", ...}
    prompt_ids: list[int]
    response_ids: torch.Tensor  # [T_i] generated tokens (EOS included when emitted)
    logp_rollout: torch.Tensor  # [T_i] the sampler's log-probs of them
    finish_reason: str  # "eos" | "length" | "repetition"
    text: str  # decoded response, special tokens removed
    task_reward: float = 0.0  # the verifier's score (accuracy when 0/1)
    reward: float = 0.0  # task_reward + shaping
    reward_error: str | None = None  # why the reward failed (then task_reward = 0)

    @property
    def length(self) -> int:
        return int(self.response_ids.numel())


Group = list[Completion]  # the G responses to one prompt


def is_informative(group: Group) -> bool:
    """A group whose rewards are not all equal carries a non-zero advantage."""
    return any(c.reward != group[0].reward for c in group)


@dataclass
class Experience:
    """A padded batch of B rows = prompt (left-padded, P columns) + response (T columns)."""

    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T]
    response_mask: torch.Tensor  # [B, T] float, 1 = generated token
    logp_rollout: torch.Tensor  # [B, T] the sampler's log-probs
    advantages: torch.Tensor  # [B]
    logp_old: torch.Tensor | None = None  # [B, T] the trainer's log-probs before the updates
    extras: dict = field(default_factory=dict)  # other per-row tensors [B, ...], sliced along

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, -self.response_mask.shape[1]:]  # [B, T]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> "Experience":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(
            self,
            input_ids=move(self.input_ids),
            attention_mask=move(self.attention_mask),
            response_mask=move(self.response_mask),
            logp_rollout=move(self.logp_rollout),
            advantages=move(self.advantages),
            logp_old=move(self.logp_old),
            extras={k: move(v) for k, v in self.extras.items()},
        )

    def select(self, rows: torch.Tensor) -> "Experience":
        """Rows ``rows``, trimmed to their own longest prompt and response."""
        T_full = self.response_mask.shape[1]
        mask = self.response_mask[rows]  # [b, T]
        T = max(int(mask.sum(-1).max()), 1) if len(rows) else 1
        prompt_mask = self.attention_mask[rows, : -T_full]  # [b, P]
        live = prompt_mask.any(0).nonzero()
        p0 = int(live[0]) if len(live) else 0
        keep = list(range(p0, prompt_mask.shape[1])) + list(range(prompt_mask.shape[1], prompt_mask.shape[1] + T))
        cols = torch.tensor(keep, device=self.input_ids.device)
        return replace(
            self,
            input_ids=self.input_ids[rows][:, cols],
            attention_mask=self.attention_mask[rows][:, cols],
            response_mask=mask[:, :T],
            logp_rollout=self.logp_rollout[rows, :T],
            advantages=self.advantages[rows],
            logp_old=None if self.logp_old is None else self.logp_old[rows, :T],
            extras={k: v[rows] for k, v in self.extras.items()},
        )


MAX_CUT_POINTS = 128  # candidate cuts considered by ``length_micro_batches``: bounds its time


def length_micro_batches(exp: Experience, rows: torch.Tensor, max_rows: int | None = None,
                         split_cost: float = 0.0) -> list[torch.Tensor]:
    """``rows`` of ``exp`` sorted by length and cut into micro-batches of similar lengths.

    Rows are sorted by response length, then prompt length (a stable sort: ties keep the order
    of ``rows``). A micro-batch of n rows whose longest prompt and response are P and T costs
    n x (P + T - 1) decoder positions once ``Experience.select`` has trimmed it, plus
    ``split_cost`` positions for the call itself (the fixed cost of one more forward/backward).
    The cuts minimise the total over the places where the response length changes (at most
    ``MAX_CUT_POINTS`` of them, spread evenly over the rows when there are more), by dynamic
    programming; a part of more than ``max_rows`` rows (None: no limit) is then cut into
    near-equal consecutive chunks, each costed at the part's widest. Every row is in exactly
    one micro-batch; none when ``rows`` is empty.
    """
    if len(rows) == 0:
        return []
    T_full = exp.response_mask.shape[1]
    resp = exp.response_mask.sum(-1)[rows].long().cpu()  # [b]
    prompt = exp.attention_mask[:, :-T_full].sum(-1)[rows].long().cpu()  # [b]
    order = torch.argsort(resp * (int(prompt.max()) + 1) + prompt, stable=True)
    rows = rows[order.to(rows.device)]
    t, p = resp[order].clamp(min=1), prompt[order]  # select keeps >= 1 response column
    m = len(rows)
    bounds = [0] + ((t.diff() != 0).nonzero().flatten() + 1).tolist() + [m]  # blocks of equal response length
    if len(bounds) > MAX_CUT_POINTS + 1:
        bounds = sorted({bounds[round(k * (len(bounds) - 1) / MAX_CUT_POINTS)] for k in range(MAX_CUT_POINTS + 1)})
    longest_response = [int(t[b - 1]) for b in bounds[1:]]  # of each block (t is sorted)
    longest_prompt = [int(p[a:b].max()) for a, b in zip(bounds, bounds[1:])]
    d = len(bounds) - 1
    best, start = [0.0] + [math.inf] * d, [0] * (d + 1)  # cost of blocks 0..j-1; where its last part starts
    for j in range(1, d + 1):
        width = 0
        for i in range(j - 1, -1, -1):  # the last part: blocks i .. j-1
            width = max(width, longest_prompt[i] + longest_response[j - 1] - 1)
            n = bounds[j] - bounds[i]
            part = (-(-n // max_rows) if max_rows else 1) * split_cost + n * width
            if part >= best[j]:  # best[i] >= 0 and part only grows as i decreases
                break
            if best[i] + part < best[j]:
                best[j], start[j] = best[i] + part, i
    parts, j = [], d
    while j > 0:
        a, b = bounds[start[j]], bounds[j]
        chunks = -(-(b - a) // max_rows) if max_rows else 1
        parts = list(rows[a:b].tensor_split(chunks)) + parts
        j = start[j]
    return parts


def collate(completions: list[Completion], advantages: torch.Tensor, pad_id: int, device=None) -> Experience:
    """Left-pad prompts, right-pad responses, stack."""
    B = len(completions)
    P = max(len(c.prompt_ids) for c in completions)
    T = max(max(c.length for c in completions), 1)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, P + T, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.float32)
    logp_rollout = torch.zeros(B, T, dtype=torch.float32)
    for i, c in enumerate(completions):
        n_p, n_r = len(c.prompt_ids), c.length
        input_ids[i, P - n_p : P] = torch.tensor(c.prompt_ids, dtype=torch.long)
        input_ids[i, P : P + n_r] = c.response_ids
        attention_mask[i, P - n_p : P + n_r] = 1
        response_mask[i, :n_r] = 1
        logp_rollout[i, :n_r] = c.logp_rollout
    exp = Experience(input_ids, attention_mask, response_mask, logp_rollout, advantages.float())
    return exp if device is None else exp.to(device)


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
):
    """log pi(o_it | q, o_i<t) / temperature-scaled, for every response token of ``exp``.

    One forward of the decoder over prompt + response (the last token is not needed: it
    predicts nothing), then the LM head in chunks (``cispo.logprobs``), with the model's own
    logit post-processing (``logit_transform(model.config)``: Gemma's soft cap, Cohere's /
    Granite's scaling), so the result is ``log_softmax(model(...).logits / temperature)``
    of the response tokens. -> [B, T] (, [B, T])
    On a model sharded with FSDP2 it runs inside the root's forward hooks (``sharded_call``),
    which gather the embeddings and the LM head it uses.
    """
    return sharded_call(model, lambda: _policy_logprobs(model, exp, temperature, fp32_head, with_entropy, chunk_size))


def _policy_logprobs(model, exp: Experience, temperature: float, fp32_head: bool, with_entropy: bool,
                     chunk_size: int):
    T = exp.response_mask.shape[1]
    P = exp.input_ids.shape[1] - T
    attention_mask = exp.attention_mask  # [B, P+T]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P+T]
    hidden = decoder(model)(
        input_ids=exp.input_ids[:, :-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, :-1],
        use_cache=False,
    ).last_hidden_state  # [B, P+T-1, H]
    hidden = hidden[:, P - 1 :]  # states that predict the response tokens   [B, T, H]
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


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-D tensors (nan when either is constant)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = (x.square().sum() * y.square().sum()).sqrt()
    return float((x * y).sum() / denom) if denom > 0 else float("nan")



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
