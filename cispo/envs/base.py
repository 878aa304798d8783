"""The environment protocol: one `Env` per episode.

An episode alternates **policy segments** (what the policy samples, trained on) and **observations** (what the
environment inserts into the policy's context, never trained on)::

    opening = env.reset(sample)          # None | text appended to the last user message | messages | ids
    loop:    segment = <the policy samples until a stop token or one of the environments' stop strings>
             result = env.step(segment)  # StepResult(observation, reward, done, info, context)
             if result.done or both observation and context are None: the episode ends
             else the observation is fed into the context and the policy samples the next segment;
             or the context (the episode's whole next context) replaces the history: fed as an observation
             where it extends the row's ids token for token, else the row ends and a new row starts on it
    final = env.final_reward()           # once, when the episode ends (None: none)

This is the shape of tinker-cookbook's ``Env.initial_observation`` / ``step``, SkyRL-Gym's ``init`` / ``step``
and TRL's ``environment_factory`` (its ``reset`` and ``get_reward``; `cispo.envs.factory` runs such a class
unchanged). `cispo.envs.episodes.Environments` is the family a run holds (``Policy.environment``): it makes one
`Env` per episode and says what every episode shares (the stop strings that pause a segment, the tools' schemas
the prompt renders). `cispo.envs.episodes.EnvEpisodes` drives a batch of episodes through a sampler, token in,
token out, so that the ids trained on are exactly the ids sampled.

Histories need not be append-only: a step may return the episode's whole next ``context`` (an environment that
compacts or summarises its history). Where its ids extend the row's (its prompt, then everything sampled and
observed) token for token, the extension is fed as an observation and the row goes on (the torch sampler's KV
cache kept); where they do not, the row ends there, its response final and trained as sampled, and the episode
goes on in a **new training row** whose prompt is the context, sampled in a further ``generate`` round (TRL's
message mode, SkyRL's step-wise trajectories). Every row of an episode carries the episode's advantage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Segment", "StepResult", "Env", "Opening", "Observation", "Context"]

Opening = "None | str | list[dict] | list[int]"
"""What `Env.reset` returns: None (the sample's own prompt), text (appended to the last user message, as TRL's
``reset`` does), chat messages (the whole opening conversation) or token ids (the prompt itself)."""

Context = "None | list[dict] | list[int]"
"""A `StepResult.context`: None (none: the history is appended to), chat messages (the whole conversation,
rendered by the chat template as the prompt is, with the next assistant turn opened) or token ids (the whole
context itself)."""

Observation = "None | str | list[dict] | list[int]"
"""A `StepResult.observation`: None (the episode ends), text (tokenized as it is, without special tokens),
chat messages (rendered by the chat template as the turns after the policy's, with the next assistant turn
opened) or token ids (fed as they are)."""


@dataclass(frozen=True)
class Segment:
    """One policy turn: the ``ids`` it sampled since the opening or the last observation, newest last;
    ``text``, those ids decoded without special tokens (what the policy wrote); ``raw``, decoded with them
    (``<|im_end|>`` included: what a call parser reads); ``by_stop_token``: it ended with a stop id (EOS, a
    turn's end) rather than one of the environments' stop strings; ``turn``: 0 for the first segment."""

    ids: tuple[int, ...]
    text: str
    raw: str
    by_stop_token: bool
    turn: int


@dataclass
class StepResult:
    """What `Env.step` returns: the ``observation`` to feed (`Observation`; None ends the episode), the
    ``reward`` of the policy's turn just ended (None: none; counted as 0), ``done`` (the episode ends; an
    observation given with it is not fed), ``info`` (plain JSON data, kept in ``samples.jsonl``) and
    ``context`` (`Context`): instead of an observation, the episode's whole next context, replacing its history
    (module docstring: fed as an observation where it extends the row's ids, else a new training row).
    ValueError where both ``observation`` and ``context`` are given."""

    observation: object = None
    reward: float | None = None
    done: bool = False
    info: dict = field(default_factory=dict)
    context: object = None

    def __post_init__(self) -> None:
        if self.observation is not None and self.context is not None:
            raise ValueError("StepResult: give an observation (appended) or a context (the whole next context), "
                             "not both")

    @property
    def ends(self) -> bool:
        """Whether the episode ends with this step."""
        return self.done or (self.observation is None and self.context is None)


class Env:
    """One episode's environment. Subclass it and implement `step`; the rest has defaults."""

    def reset(self, sample: dict):
        """The episode's opening for ``sample`` (`Opening`); default None: the sample's own prompt. The G
        episodes of one prompt must open alike (their prompt is shared): seed any randomness from the sample."""
        return None

    def step(self, segment: Segment) -> StepResult:
        """The environment's answer to the policy's ``segment``."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def final_reward(self) -> float | None:
        """A reward read once when the episode ends, from the environment's state (TRL's ``get_reward``);
        it counts toward the last policy turn. Default None: none."""
        return None

    def record(self) -> dict:
        """What ``samples.jsonl`` keeps of the episode beside its segments (plain JSON data; default none)."""
        return {}
