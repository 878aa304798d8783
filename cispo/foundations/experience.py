"""From sampled groups to training tensors: the data types and their collation.

One generation batch becomes an ``Experience``: B = groups x G rows, each the prompt
(left-padded) followed by the response (right-padded), with the sampler's log-probs, the
advantages and — filled in once before the K updates — ``logp_old``. The model's
log-probs of it are ``cispo.models.policy.policy_logprobs``; its micro-batches ``cispo.training.batching``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch


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
    reward_parts: dict = field(default_factory=dict)  # each data.reward's value by name (None: it abstained)
    reward_extras: tuple = ()  # (key, number) pairs the reward calls reported besides their rewards
    env_mask: torch.Tensor | None = None  # [T_i] 1 at the environment's tokens (multi-turn); None: all the policy's
    episode: dict | None = None  # the environment's record of the episode (segments, tool calls), for samples.jsonl
    scored_text: str | None = None  # what the reward read where it is not `text`: the policy's own tokens' text
    continuations: list = field(default_factory=list)  # an episode's further training rows (Completions), in order

    @property
    def rows(self) -> list[Completion]:
        """The episode's training rows: itself (its prompt and first response) then each `continuations` row
        (an environment's context rewrote the history: ``cispo.envs.rows``), each with its own prompt and
        response and no continuations; ``[self]`` for a one-row episode (every single-turn response)."""
        return [self] if not self.continuations else [replace(self, continuations=[]), *self.continuations]

    @property
    def answer_text(self) -> str:
        """The text the reward scored and the answer is read from (maj@k, ``parsed_answer``): `scored_text` where
        the task scores the policy's own text (``cispo.training.sampling.policy_text``), else `text`."""
        return self.text if self.scored_text is None else self.scored_text

    @property
    def turn_rewards(self) -> list[float]:
        """The environment's reward of each policy segment it stepped on, in order (``episode["turn_rewards"]``;
        [] without one: a single-turn response, or an environment that rewards only the whole episode)."""
        return [] if self.episode is None else [float(r) for r in self.episode.get("turn_rewards", ())]

    @property
    def scored(self) -> bool:
        """Whether some reward scored the response: False where every ``data.reward`` returned None (each
        abstained, `reward_parts` all None; TRL's "unscorable" completion), True otherwise (a built-in task's
        reward, a failed call: it scored 0)."""
        return not self.reward_parts or any(v is not None for v in self.reward_parts.values())

    @property
    def episode_return(self) -> float:
        """R_i = reward + sum_k turn_rewards[k]: the episode's return, what the group advantages (under
        ``algo.turn_credit=episode``), dynamic sampling and the reward metrics read; ``reward`` itself where
        there is no turn reward (bit for bit). NaN where no reward scored the response (`scored`): as in TRL, it
        is left out of its group's mean and std and gets advantage 0 (`cispo.objective.advantages`)."""
        if not self.scored:
            return math.nan
        turns = self.turn_rewards
        return self.reward if not turns else self.reward + sum(turns)

    @property
    def length(self) -> int:
        """Tokens of the response, the environment's observations included (every row's, `rows`)."""
        return int(self.response_ids.numel()) + sum(r.length for r in self.continuations)

    @property
    def policy_length(self) -> int:
        """Tokens the policy sampled (what the loss, the overlong penalty and the length metrics count; every
        row's, `rows`)."""
        own = int(self.response_ids.numel()) if self.env_mask is None else int((self.env_mask == 0).sum())
        return own + sum(r.policy_length for r in self.continuations)


Group = list[Completion]  # the G responses to one prompt


def is_informative(group: Group) -> bool:
    """A group whose returns (`Completion.episode_return`) are not all equal carries a non-zero advantage;
    an unscored response's (NaN) is no return: it neither differs from nor equals the others."""
    returns = [r for c in group if not math.isnan(r := c.episode_return)]
    return any(r != returns[0] for r in returns)


@dataclass
class Experience:
    """A padded batch of B rows = prompt (left-padded, P columns) + response (T columns).

    In a multi-turn rollout a response holds the environment's observations between the policy's
    segments: ``attention_mask`` is 1 at every real token (the model sees them all), ``response_mask``
    only at the policy's (the loss, ``logp_old``, the KL term, the token counts and every token
    statistic read it), so observations are context the gradient never flows from."""

    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T] 1 = a real token (prompt, policy or environment)
    response_mask: torch.Tensor  # [B, T] float, 1 = a token the policy generated
    logp_rollout: torch.Tensor  # [B, T] the sampler's log-probs
    advantages: torch.Tensor  # [B] one per response, or [B, T] one per token (per-turn credit)
    logp_old: torch.Tensor | None = None  # [B, T] the trainer's log-probs before the updates
    extras: dict = field(default_factory=dict)  # other per-row tensors [B, ...], sliced along

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, -self.response_mask.shape[1]:]  # [B, T]

    @property
    def response_spans(self) -> torch.Tensor:
        """LongTensor [B]: the columns each row's loss needs, up to its last policy token (the number of
        response tokens when every one is the policy's; observations before it included, those after it
        not: they predict nothing trained on)."""
        T = self.response_mask.shape[1]
        cols = torch.arange(1, T + 1, device=self.response_mask.device)  # [T]
        return (self.response_mask.gt(0) * cols).amax(-1) if T else self.response_mask.sum(-1).long()

    @property
    def token_advantages(self) -> torch.Tensor:
        """A_it   [B, T]: ``advantages`` itself when per token, else each row's broadcast over its columns."""
        A = self.advantages
        return A if A.dim() == 2 else A[:, None].expand_as(self.response_mask)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> Experience:
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

    def select(self, rows: torch.Tensor) -> Experience:
        """Rows ``rows``, trimmed to their own longest prompt and response."""
        T_full = self.response_mask.shape[1]
        mask = self.response_mask[rows]  # [b, T]
        T = max(int(self.response_spans[rows].max()), 1) if len(rows) else 1
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
            advantages=self.advantages[rows] if self.advantages.dim() == 1 else self.advantages[rows, :T],
            logp_old=None if self.logp_old is None else self.logp_old[rows, :T],
            extras={k: v[rows] for k, v in self.extras.items()},
        )


def collate(completions: list[Completion], advantages: torch.Tensor, pad_id: int, device=None) -> Experience:
    """Left-pad prompts, right-pad responses, stack (``response_mask`` 0 at the environment's tokens): one row
    per completion, which must be one row each (an episode's `Completion.rows`, expanded by the caller).
    ``advantages``: [B], or [B, T'] per token (right-padded with 0, or cut, to the batch's T columns)."""
    if any(c.continuations for c in completions):
        raise ValueError("collate takes training rows: expand each episode's Completion.rows first")
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
        response_mask[i, :n_r] = 1 if c.env_mask is None else 1 - c.env_mask.float()
        logp_rollout[i, :n_r] = c.logp_rollout
    if advantages.dim() == 2:  # A_it   [B, T]
        advantages = torch.nn.functional.pad(advantages, (0, T - advantages.shape[1]))[:, :T]
    exp = Experience(input_ids, attention_mask, response_mask, logp_rollout, advantages.float())
    return exp if device is None else exp.to(device)
