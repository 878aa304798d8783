"""A batch of episodes driven through a sampler, token in, token out.

`Environments` is a run's family of environments (``Policy.environment``): `Environments.start` makes one
`cispo.envs.base.Env` per row of a ``generate`` batch and resets it, and returns the batch's `EnvEpisodes`,
which is the sampler's ``Episodes`` protocol (``cispo.rollout.base``): the sampler asks `EnvEpisodes.pauses`
after every sampled token and `EnvEpisodes.respond` when segments end, and feeds the observation ids it
returns into each row's context (the torch sampler in its KV cache, vLLM as the next call's prompt). The
environment decodes a segment's ids only to read them: the ids trained on are exactly the ids sampled, and an
observation is token ids (`cispo.envs.observations.observation_ids`), marked as the environment's
(``env_mask`` 1, never trained on).

The rows' `Env.step` calls of one ``respond`` run side by side in threads (a tool environment's calls then
run side by side in its worker processes). An episode ends where its step says so (`StepResult.ends`), after
``max_turns`` observations, or where the sampler cuts it (the response's length); its `Env.final_reward` is
read once, when its record is taken. A step that raises ends its episode with the error recorded (the run
goes on); the turn earns nothing.

A step may instead give the episode's whole next context (`StepResult.context`, a history that is not
append-only). `EnvEpisodes.begin` gives each row's prompt ids (and how chat messages render); each row's ids so
far (prompt, segments, observations fed) are kept, and the context's ids are compared with them: where they
extend them token for token, the extension is the observation (the row goes on); else the row's episode ends
in this ``generate`` and is **continued**: `EnvEpisodes.continuations` lists each such episode with the
context's ids, the prompt of its next training row, and `EnvEpisodes.rows_of` is the ``Episodes`` of a further
``generate`` over them (``cispo.envs.rows.sample_episode_rows`` runs the rounds). A context counts as a turn
(``max_turns``); a continued episode's record, rewards and state go on across its rows.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cispo.envs.base import Env, Segment, StepResult
from cispo.envs.observations import observation_ids
from cispo.foundations.text import valid_text

__all__ = ["Environments", "ClassEnvironments", "EnvEpisodes", "EpisodeRows", "context_ids", "opened_sample"]

STEP_THREADS = 16
"""The most `Env.step` calls of one ``respond`` that run at once."""


class Environments:
    """The family of a run's environments (``Policy.environment``): one `Env` per episode (`make`), and what
    every episode shares. Subclass it and implement `make`.

    Attributes:
        stop_strings: strings that pause a segment where the policy's text completes one (an inline tool's
            ``</calc>``); a segment also ends at a stop token (EOS, the chat template's turn end).
        schemas: the tools' JSON schemas the chat template renders into the prompt ([]: none).
        max_turns: observations per episode (``rollout.max_turns``); the episode ends at the next segment.
        max_observation_tokens: the longest observation; a longer one is cut (`fit_observation`).
        tokenizer: the policy's tokenizer (observations given as text or messages are tokenized with it).
    """

    stop_strings: tuple[str, ...] = ()
    schemas: list[dict] = []
    max_turns: int = 4
    max_observation_tokens: int = 256
    tokenizer: object = None

    def make(self, sample: dict) -> Env:
        """A fresh `Env` for one episode of ``sample``."""
        raise NotImplementedError(f"{type(self).__name__}.make")

    def start(self, samples: list[dict]):
        """The `EnvEpisodes` of one ``generate`` batch: row i is an episode of ``samples[i]``, reset now."""
        return EnvEpisodes(self, [self.make(s) for s in samples], samples)

    def may_end_stop(self, token_id: int) -> bool:
        """Whether token ``token_id``'s text holds the last character of a stop string (so it may complete one),
        remembered per token; always True for a stop string ending in a non-ASCII character (a byte-level token
        may hold part of it)."""
        cache = self.__dict__.setdefault("_may_end", {})
        hit = cache.get(token_id)
        if hit is None:
            ends = {s[-1] for s in self.stop_strings}
            text = self.tokenizer.decode([token_id])
            hit = cache[token_id] = any(c in text for c in ends) or not all(c.isascii() for c in ends)
        return hit

    def describe(self) -> str:
        """One line for the run's start (default: the class's name and ``max_turns``)."""
        return f"environment: {type(self).__name__} (at most {self.max_turns} turns per response)"

    def close(self) -> None:
        """Free what the family holds (worker processes); default nothing."""



class ClassEnvironments(Environments):
    """A cispo `Env` subclass as the run's environments: ``cls()`` per episode."""

    def __init__(self, cls: type, tokenizer, max_turns: int, max_observation_tokens: int = 256) -> None:
        self.cls, self.tokenizer = cls, tokenizer
        self.max_turns, self.max_observation_tokens = max_turns, max_observation_tokens
        self.stop_strings = tuple(getattr(cls, "stop_strings", ()) or ())
        self.schemas = []

    def make(self, sample: dict) -> Env:
        return self.cls()

    def describe(self) -> str:
        name = f"{self.cls.__module__}.{self.cls.__qualname__}"
        return f"environment: {name} (at most {self.max_turns} turns per response)"


@dataclass
class _Row:
    """One episode's record: its segments (policy and observation texts), the observation ids fed, each
    turn's reward and info, the policy segment the sampler showed last that no step took (`EnvEpisodes.pauses`),
    and whether it ended."""

    segments: list[dict] = field(default_factory=list)
    observations: list[list[int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    info: list[dict] = field(default_factory=list)
    pending: list[int] | None = None
    rewarded: bool = False  # some step gave a reward
    ended: bool = False
    error: str | None = None
    ids: list[int] | None = None  # the current row's prompt + response ids so far (None: `begin` not called)
    next_prompt: list[int] | None = None  # a context that did not extend `ids`: the next row's prompt
    contexts: int = 0  # steps that gave a context
    rewrites: int = 0  # of them, those that started a new row


class EnvEpisodes:
    """One ``generate`` batch's episodes (the sampler's ``Episodes`` protocol; module docstring); row i is
    ``envs[i]``'s episode of ``samples[i]``. Not thread-safe: the sampler calls it from one thread."""

    def __init__(self, family: Environments, envs: list[Env], samples: list[dict]) -> None:
        self.family, self.envs, self.tokenizer = family, list(envs), family.tokenizer
        self.stop_strings = tuple(family.stop_strings)
        self._tail = max((len(s) for s in self.stop_strings), default=0) + 2  # tokens: each spells >= 1 character
        self._rows = [_Row() for _ in self.envs]
        self.openings = [env.reset(dict(s)) for env, s in zip(self.envs, samples)]
        """Each row's `Env.reset` (``cispo.envs.base.Opening``), in row order: `opened_sample` reads it."""
        self.encode = None
        """How a context given as chat messages becomes ids (`begin`; None: the chat template, the schemas)."""

    def begin(self, prompt_ids: list[list[int]], encode=None) -> None:
        """Each row's prompt ids, before the first ``generate`` (needed to tell a context that extends a row's
        ids from one that rewrites them); ``encode``: chat messages -> the prompt's ids, rendered as the run
        renders its prompts (``Policy.encode``; None: the tokenizer's chat template with the tools' schemas and
        the assistant turn opened)."""
        for state, ids in zip(self._rows, prompt_ids):
            state.ids = [int(t) for t in ids]
        self.encode = encode

    def continuations(self) -> list[tuple[int, list[int]]]:
        """The episodes a context rewrote in the last ``generate`` (their row ended there), each with its next
        row's prompt ids, in row order; taken: each is listed once. The row of each is now its prompt."""
        out = []
        for row, state in enumerate(self._rows):
            if state.next_prompt is not None:
                out.append((row, state.next_prompt))
                state.ids, state.next_prompt = list(state.next_prompt), None
        return out

    def rows_of(self, episodes: list[int]):
        """The ``Episodes`` of a further ``generate`` whose row j continues episode ``episodes[j]``."""
        return EpisodeRows(self, list(episodes))

    def pauses(self, row: int, segment_ids: list[int]) -> bool:
        """True when the policy segment (the ids the policy sampled since the prompt or the last
        observation, newest last) now ends with one of the environments' stop strings (an inline tool's
        ``</calc>``): the string completed by its last token, whose text may run on past it. Called after
        every sampled token of a live row, so it decodes only a tail of the ids (the longest stop string's
        length + 2 tokens), and only where the last token's text holds a stop string's last character
        (`Environments.may_end_stop`). Keeps the segment for `record`, where no `respond` takes it (a row
        cut by the length)."""
        self._rows[row].pending = segment_ids
        if not self.stop_strings or not segment_ids or not self.family.may_end_stop(segment_ids[-1]):
            return False
        tail = segment_ids[-self._tail:]
        text, before = self.tokenizer.decode(tail), self.tokenizer.decode(tail[:-1])
        return any(text.find(s, max(0, len(before) - len(s) + 1)) >= 0 for s in self.stop_strings)

    def respond(self, rows: list[int], segments: list[list[int]], by_stop_token: list[bool]) -> list[list[int] | None]:
        """For each paused row (its segment ended by a stop string, or by a stop token such as EOS /
        ``<|im_end|>`` when ``by_stop_token``), the observation's token ids to insert into its context (not
        trained on), or None: the episode ends and the row's response is final. Each row's `Env.step` runs
        (side by side in threads); None once a row has had ``max_turns`` observations (contexts that began a
        new row counted), and None where a step's context does not extend the row (`_context`: the episode goes
        on in a new row, `continuations`); an observation is at most ``max_observation_tokens`` ids."""
        stepped = [self._segment(r, seg, tok) for r, seg, tok in zip(rows, segments, by_stop_token)]
        for r, seg in zip(rows, segments):
            if self._rows[r].ids is not None:
                self._rows[r].ids += [int(t) for t in seg]
        if len(rows) > 1:
            with ThreadPoolExecutor(min(len(rows), STEP_THREADS)) as pool:
                results = list(pool.map(self._step, rows, stepped))
        else:
            results = [self._step(r, s) for r, s in zip(rows, stepped)]
        return [self._observe(r, seg, result) for r, seg, result in zip(rows, stepped, results)]

    def record(self, row: int, fed: int | None = None) -> dict:
        """What ``samples.jsonl`` shows of the row's episode: ``{"segments": [{"role": "policy" | "tool" | "context",
        "text": ...}, ...], ...}`` (``context``: a context that began a new row, its whole text; then
        ``"contexts"`` / ``"rewrites"``: the steps that gave one / began a row), ``"turn_rewards": [r_0, ...]``
        where a step or the final reward gave one, and what the `Env` records itself (`Env.record`: a tool
        environment's calls). A segment's text is decoded without
        special tokens; an observation's as inserted. ``turn_rewards``: each stepped policy segment's reward
        (0 where none), `Env.final_reward` added to the last segment's (a segment of its own where the
        sampler cut the last one before any step). ``fed``: the observation ids the sampler fed into the
        row's context in all (its ``env_mask``'s sum): where the response's length left room for fewer than
        the environment returned, the observations read as fed (the last one cut, ``"tokens_cut": n``; one
        never fed is left out)."""
        state, env = self._rows[row], self.envs[row]
        segments = list(state.segments) if fed is None else self._fed_segments(state, fed)
        if state.pending:
            segments.append({"role": "policy", "text": self.tokenizer.decode(state.pending, skip_special_tokens=True)})
        out = {"segments": segments, **plain_json(_call_quietly(env.record) or {})}
        rewards = list(state.turn_rewards)
        final = _call_quietly(env.final_reward)
        if _is_number(final):
            if state.pending or not rewards:
                rewards.append(0.0)
            rewards[-1] += float(final)
        if state.rewarded or _is_number(final):
            out["turn_rewards"] = rewards
        if any(state.info):
            out["turn_info"] = [plain_json(i) for i in state.info]
        if state.contexts:
            out.update(contexts=state.contexts, rewrites=state.rewrites)
        if state.error is not None:
            out["env_error"] = state.error
        return out

    # -- one row ---------------------------------------------------------------------

    def _segment(self, row: int, ids: list[int], by_stop_token: bool) -> Segment:
        """The row's ended segment, recorded."""
        state = self._rows[row]
        state.pending = None
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        state.segments.append({"role": "policy", "text": text})
        return Segment(tuple(ids), text, self.tokenizer.decode(ids), by_stop_token, len(state.turn_rewards))

    def _step(self, row: int, segment: Segment) -> StepResult:
        """The row's `Env.step`; a step that raises ends the episode, its error recorded."""
        try:
            result = self.envs[row].step(segment)
            if not isinstance(result, StepResult):
                raise TypeError(f"step returned {type(result).__name__}, not a StepResult")
            return result
        except Exception as e:  # noqa: BLE001 - an environment's failure ends its episode, never the run
            self._rows[row].error = valid_text(f"{type(e).__name__}: {e}")[:500]
            return StepResult(None)

    def _observe(self, row: int, segment: Segment, result: StepResult) -> list[int] | None:
        """The row's observation ids (None: its episode ends), its turn's reward and info recorded."""
        state = self._rows[row]
        state.rewarded |= _is_number(result.reward)
        state.turn_rewards.append(float(result.reward) if _is_number(result.reward) else 0.0)
        state.info.append(dict(result.info or {}))
        if result.ends or len(state.observations) + state.rewrites >= self.family.max_turns:
            state.ended = True
            return None
        stop_text = self.tokenizer.decode(list(segment.ids[-1:])) if segment.by_stop_token else ""
        try:
            if result.context is not None:
                return self._context(state, result.context)
            ids = observation_ids(self.tokenizer, result.observation, stop_text, self.family.max_observation_tokens)
        except (TypeError, ValueError) as e:
            state.error, state.ended = valid_text(str(e))[:500], True
            return None
        return self._fed(state, ids)

    def _fed(self, state: _Row, ids: list[int]) -> list[int]:
        """Observation ``ids`` recorded as fed into the row."""
        state.segments.append({"role": "tool", "text": self.tokenizer.decode(ids)})
        state.observations.append(list(ids))
        if state.ids is not None:
            state.ids += list(ids)
        return ids

    def _context(self, state: _Row, context) -> list[int] | None:
        """A step's whole next ``context`` (``cispo.envs.base.Context``): the ids by which it extends the row's
        ids (prompt + response so far), fed as an observation (at most ``max_observation_tokens``); or, where
        it does not extend them (or there is nothing to feed), None: the row ends, and the context's ids are the
        prompt of the episode's next row (`continuations`). ValueError / TypeError for a context of no kind."""
        try:
            ids = context_ids(self.tokenizer, context, self.encode, self.family.schemas)
        except TypeError:
            raise
        except Exception as e:  # noqa: BLE001 - a template's failure to render the messages ends the episode only
            raise ValueError(f"the context could not be rendered: {type(e).__name__}: {e}") from None
        state.contexts += 1
        now = state.ids
        if now is not None and len(ids) > len(now) and ids[: len(now)] == now:
            return self._fed(state, ids[len(now):][: self.family.max_observation_tokens])
        if now is None:
            raise ValueError("a step gave a context, but the driver gave no prompt ids (EnvEpisodes.begin)")
        state.rewrites += 1
        state.next_prompt = ids
        state.segments.append({"role": "context", "text": self.tokenizer.decode(ids)})
        return None

    def _fed_segments(self, state: _Row, fed: int) -> list[dict]:
        """The row's segments with each observation as far as ``fed`` ids in all reached (`record`)."""
        out, observations, left = [], iter(state.observations), fed
        for segment in state.segments:
            if segment["role"] != "tool":
                out.append(segment)
                continue
            ids = next(observations)
            if len(ids) <= left:
                out.append(segment)
            elif left > 0:
                out.append({**segment, "text": self.tokenizer.decode(ids[:left]), "tokens_cut": len(ids) - left})
            left = max(0, left - len(ids))
        return out


class EpisodeRows:
    """The ``Episodes`` of a further ``generate`` round (`EnvEpisodes.rows_of`): its row j is episode
    ``episodes[j]`` of ``parent``, whose state, record and rewards go on."""

    def __init__(self, parent: EnvEpisodes, episodes: list[int]) -> None:
        self.parent, self.episodes = parent, episodes
        self.stop_strings = parent.stop_strings

    def pauses(self, row: int, segment_ids: list[int]) -> bool:
        return self.parent.pauses(self.episodes[row], segment_ids)

    def respond(self, rows: list[int], segments: list[list[int]], by_stop_token: list[bool]) -> list[list[int] | None]:
        return self.parent.respond([self.episodes[r] for r in rows], segments, by_stop_token)


def context_ids(tokenizer, context, encode=None, schemas=()) -> list[int]:
    """A `StepResult.context`'s ids: token ids as they are; chat messages through ``encode`` (the run's prompt
    rendering, ``Policy.encode``), or without one the chat template with ``schemas`` and the assistant turn
    opened. TypeError for anything else."""
    if isinstance(context, (list, tuple)) and context and all(isinstance(i, int) and not isinstance(i, bool)
                                                              for i in context):
        return [int(i) for i in context]
    if isinstance(context, (list, tuple)) and context and all(isinstance(m, dict) and "role" in m for m in context):
        if encode is not None:
            return [int(i) for i in encode(list(context))]
        tools = {"tools": list(schemas)} if schemas else {}
        out = tokenizer.apply_chat_template(list(context), add_generation_prompt=True, tokenize=True, **tools)
        return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]
    raise TypeError(f"a context must be chat messages or token ids, got {type(context).__name__}")


def _is_number(value) -> bool:
    """A finite int or float (not a bool): a reward that counts."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _call_quietly(fn):
    """``fn()``, or None where it raises (a record or a final reward must never end the run)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def plain_json(value):
    """``value`` as plain JSON data (what ``json`` cannot write becomes its ``str``; text made valid Unicode)."""
    try:
        return json.loads(json.dumps(value, default=str, ensure_ascii=False).encode("utf-8", "replace"))
    except (TypeError, ValueError, RecursionError):
        return {"unreadable": valid_text(str(type(value).__name__))}


def opened_sample(sample: dict, opening) -> dict:
    """The sample an episode's prompt is rendered from, after `Env.reset` gave ``opening``: None, the sample
    as it is; text, appended to the last user message (TRL's ``reset``); chat messages, the whole opening
    conversation; token ids, the prompt's ids themselves (``prompt_ids``). TypeError for anything else."""
    if opening is None:
        return sample
    if isinstance(opening, str):
        messages = list(sample.get("messages") or [{"role": "user", "content": sample["prompt"]}])
        last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
        if last is None:
            raise TypeError("reset returned text to append to the last user message, but the prompt has none")
        messages[last] = {**messages[last], "content": str(messages[last].get("content") or "") + opening}
        prompt = sample.get("prompt", "") + opening if "messages" not in sample else sample.get("prompt")
        return {**sample, "messages": messages, "prompt": prompt}
    if isinstance(opening, (list, tuple)) and opening and all(isinstance(i, int) and not isinstance(i, bool)
                                                              for i in opening):
        return {**sample, "prompt_ids": list(opening)}
    if isinstance(opening, (list, tuple)) and opening and all(isinstance(m, dict) and "role" in m for m in opening):
        return {**sample, "messages": list(opening)}
    raise TypeError(f"reset must return None, text, chat messages or token ids, got {type(opening).__name__}")
