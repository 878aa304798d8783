"""A user's agent program as the run's environment (``data.agent=path/to/agent.py:run``).

The program is a function, plain or ``async``, that runs its own loop against an OpenAI-compatible endpoint
and returns the episode's reward::

    def run(sample, base_url, api_key):        # it may also take session_id; it is given only what it names
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...client.chat.completions.create(model="policy", messages=..., tools=...)...
        return reward                          # a number; None: the task's reward scores the transcript

or a command (``data.agent_command="python my_agent.py"``, any language): a process per episode, given the
same through ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` and its standard input, that prints its reward
(`cispo.envs.agent_command`: its time and memory limits).

**An agent program is an environment.** Each episode is an `AgentEnv`: `AgentEnvironments.start` starts every
episode's program at once, each in a thread of its own (an ``async`` one in its own event loop), with its
sample, the ``base_url`` of its session on the endpoint (`cispo.envs.endpoint`) and the endpoint's key.
`AgentEnv.reset` waits for the program's first request and returns its messages and tools rendered by the
chat template (token ids: the episode's prompt); the policy samples the completion in the environment
layer's turn loop (`cispo.envs.episodes`), so the calls of all the batch's episodes that wait together are
sampled together, by the torch sampler or vLLM alike; `AgentEnv.step` answers the waiting request with the
segment (its tool calls read in the template's format, `cispo.envs.call_formats`, as OpenAI ``tool_calls``)
and waits for the program's next request, or its end.

**Exact tokens.** A next request that repeats the conversation so far — the previous request's messages,
then the assistant message as the endpoint answered it, with the same tools — goes on in the same row: the
messages it adds (tool results, a user turn) are the observation, rendered by the chat template after the
policy's turn as a tool environment's are (`cispo.envs.observations.chat_observation`, cut to
``max_observation_tokens``); the policy's sampled ids are never re-encoded. A request that rewrites the
conversation (drops or edits a turn, changes the tools) is the episode's whole next context
(`StepResult.context`: its messages rendered): fed as an observation where its ids extend the row's token for
token, else the row ends and the episode goes on in a new training row whose prompt it is (counted in
``agent.rewritten``). Either way a call counts as a turn (``rollout.max_turns``).

**Failures are episodes.** A program that raises, makes no request, waits longer than ``timeout_s`` between
the endpoint's answers, or whose first request differs from those of its prompt's other episodes (they share
the prompt: seed any randomness from the sample) ends its episode, recorded in ``samples.jsonl``
(``agent.error``); the episode earns no reward of its own (the task's reward still scores it: 0 with
``data.reward=env``) and the run goes on. A program still running when the sampler ends its episode (the
response's ``max_new_tokens`` spent, ``rollout.max_turns`` reached) has its waiting request answered (the
completion so far, ``finish_reason="length"``; or 410) and may still return a reward. A program that hangs
is left running (a thread cannot be killed; it holds no session any more); a command
(`cispo.envs.agent_command`) is killed with its process group.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import queue
import threading
import time

from cispo.envs.agent_command import AgentCommand, AgentProcess
from cispo.envs.base import Env, Segment, StepResult
from cispo.envs.call_formats import CALL_FORMATS, assistant_message, call_format_for, call_id, cast_arguments
from cispo.envs.endpoint import AgentServer, ChatRequest, RequestError, completion_body, error_body, normal_message
from cispo.envs.episodes import EnvEpisodes, Environments, _is_number
from cispo.envs.observations import chat_observation, defuse, fit_observation, special_spellings
from cispo.envs.tools import ToolCall, ToolSpecError
from cispo.foundations.text import valid_text

__all__ = ["AgentEnvironments", "AgentEnv", "AgentEpisodes", "load_agent", "render_request", "AGENT_ARGUMENTS"]

AGENT_ARGUMENTS = ("sample", "base_url", "api_key", "session_id")
"""What an agent program may take (by name; a ``**kwargs`` takes them all)."""
_REAP_S = 5.0
"""How long a killed command's waiting thread is given to read its end."""
CALL_MARKERS = ("<tool_call>", "<function=", "[TOOL_CALLS]", "<|python_tag|>")
"""Where an assistant turn's calls begin: the reply's ``content`` is the text before the first."""


def load_agent(spec: str, trial: bool = True):
    """The function ``data.agent`` names (``module:function``, ``path/to/file.py:function``), its module first
    imported in a throw-away process where ``trial``. ToolSpecError naming the spec otherwise."""
    from cispo.data.rewards import RewardSpecError
    from cispo.data.rewards.loading import _resolve

    try:
        fn = _resolve(spec, spec, trial)
    except RewardSpecError as e:
        message = str(e).replace(f"reward {spec!r}", f"data.agent {spec!r}", 1)
        raise ToolSpecError(message.replace("a reward module", "an agent module")) from None
    if isinstance(fn, type):
        raise ToolSpecError(f"data.agent {spec!r} is a class: give the agent's function (data.environment takes "
                            f"classes)")
    return fn


def render_request(tokenizer, request: ChatRequest) -> list[int]:
    """A request's prompt ids: its messages and tools through the chat template, the assistant turn opened (a
    text completion's prompt: tokenized as it is). RequestError (400) where the template cannot render them."""
    if request.prompt is not None:
        return list(tokenizer.encode(request.prompt, add_special_tokens=True))
    extra = {"tools": request.tools} if request.tools else {}
    try:
        ids = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True, **extra)
    except Exception as e:  # noqa: BLE001 - a template's refusal is the request's error
        raise RequestError(400, f"the chat template cannot render these messages: {valid_text(str(e))[:300]}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _message_key(message: dict) -> str:
    """What two messages must share to be the same turn: role, content, calls (names and arguments), the
    answered call's id."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]
    return json.dumps([message["role"], message.get("content") or "", calls, message.get("tool_call_id")],
                      sort_keys=True, default=str)


def turn_closing(tokenizer) -> str:
    """The text the chat template ends an assistant turn with (``<|im_end|>\\n``): what the rendering of an
    assistant message puts after its content."""
    mark = "\x00cispo-mark\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}],
                                         tokenize=False)
    return text[text.index(mark) + len(mark):] if mark in text else ""


class AgentEnvironments(Environments):
    """An agent program as the run's environments (module docstring): one `AgentEnv` per episode, all of a
    batch started at once; the endpoint (`AgentServer`) runs while the family lives (`close`).

    Args:
        agent: the program: a function, or an `AgentCommand` (``data.agent_command``: one process per
            episode, `cispo.envs.agent_command`). tokenizer: the policy's, with a chat template.
        max_turns: observations per episode (``rollout.max_turns``): the program's calls less one.
        timeout_s: the longest the program may run between the endpoint's answers (``data.agent_timeout_s``).
        tool_format: ``data.tool_format``: the format the policy's calls are read in (``auto`` / ``chat``:
            the template's own; ``inline``: none read); calls are read only where the template takes tools.
    """

    def __init__(self, agent, tokenizer, max_turns: int, timeout_s: float = 60.0, tool_format: str = "auto",
                 max_observation_tokens: int = 256) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ToolSpecError("data.agent: the tokenizer has no chat template, and an agent's requests are chat "
                                "messages: use a chat model (or model.chat_template with a template)")
        from cispo.envs.tool_env import template_takes_tools

        self.agent, self.tokenizer, self.max_turns, self.timeout_s = agent, tokenizer, max_turns, float(timeout_s)
        self.max_observation_tokens = max_observation_tokens
        self.stop_strings, self.schemas = (), []
        reads = tool_format in CALL_FORMATS or tool_format in ("auto", "chat") and template_takes_tools(tokenizer)
        self.call_format = call_format_for(tokenizer, tool_format) if reads else None
        """How a reply's tool calls are read (`cispo.envs.call_formats`); None: none are."""
        self.closing = turn_closing(tokenizer)
        self.specials = special_spellings(tokenizer)
        self.server = AgentServer()
        self.processes: set[AgentProcess] = set()
        """The commands' processes not yet reaped: killed by `close`."""

    def make(self, sample: dict) -> AgentEnv:
        return AgentEnv(self, sample)

    def start(self, samples: list[dict]) -> AgentEpisodes:
        """Every episode's program started at once, then each reset (its first request), the openings of one
        prompt's episodes made alike (`align_openings`)."""
        envs = [self.make(s) for s in samples]
        for env in envs:
            env.launch()
        episodes = AgentEpisodes(self, envs, samples)
        align_openings(episodes, samples)
        return episodes

    def describe(self) -> str:
        name = self.agent.describe() if isinstance(self.agent, AgentCommand) else \
            f"{getattr(self.agent, '__module__', '?')}.{getattr(self.agent, '__qualname__', '?')}"
        calls = f"calls read as {self.call_format.name}" if self.call_format else "no tool calls read"
        return (f"agent: {name} on {self.server.url} ({calls}; at most {self.max_turns + 1} calls per episode, "
                f"{self.timeout_s:g} s between answers)")

    def close(self) -> None:
        for process in list(self.processes):
            process.kill()
        self.server.close()


def align_openings(episodes: EnvEpisodes, samples: list[dict]) -> None:
    """Each run of equal samples (a prompt's G episodes) opens alike: an episode whose program made no first
    request takes its group's opening; one whose first request differs from the group's first is ended
    (recorded) and takes the group's opening too."""
    i = 0
    while i < len(samples):
        j = i
        while j < len(samples) and samples[j] == samples[i]:
            j += 1
        ref = next((o for o in episodes.openings[i:j] if o is not None), None)
        for k in range(i, j):
            if episodes.openings[k] is not None and episodes.openings[k] != ref:
                episodes.envs[k].end("failed", "its first request differs from its prompt's other episodes' (they "
                                               "share the prompt: seed the agent's randomness from the sample)")
            episodes.openings[k] = ref
        i = j


class AgentEnv(Env):
    """One episode of an agent program (module docstring)."""

    def __init__(self, family: AgentEnvironments, sample: dict) -> None:
        self.family, self.tokenizer, self.sample = family, family.tokenizer, sample
        self.session = family.server.open_session()
        self.pending = None  # the request waiting for the policy's answer (endpoint.Pending)
        self.messages: list[dict] = []  # the conversation so far: the last request's messages + the answer
        self.text: str | None = None  # a text completion's: the last prompt + the answer (None: chat)
        self.held = ""  # a text completion's: what the row holds past the answer (the stop string the answer omits)
        self.tools_key = ""
        self.calls, self.context_tokens, self.rewrites = 0, 0, 0
        self.ended: str | None = None  # "returned", "failed", "cut"
        self.error: str | None = None
        self.reward = None
        self.pause_reason: str | None = None  # why the sampler's segment paused: "length" | "stop" | None
        self._thread: threading.Thread | None = None
        self._process: AgentProcess | None = None  # a command's (`AgentCommand`)
        self._deadline: float | None = None

    # -- the program ------------------------------------------------------------------

    def launch(self) -> None:
        """Start the program in a daemon thread (a command: its process, here, and a thread that waits for
        it); its first request is due within ``timeout_s`` from now."""
        self._deadline = time.monotonic() + self.family.timeout_s
        target = self._run
        if isinstance(self.family.agent, AgentCommand):
            given = self._given()
            try:
                self._process = AgentProcess(self.family.agent, given["sample"], given["base_url"],
                                             given["api_key"], given["session_id"])
                self.family.processes.add(self._process)
                target = self._wait_process
            except OSError as e:  # the program could not be started: a failed episode
                self.session.events.put(("error", f"the agent command could not start: {valid_text(str(e))[:300]}"))
                return
        self._thread = threading.Thread(target=target, name=f"cispo-agent-{self.session.id}", daemon=True)
        self._thread.start()

    def _given(self) -> dict:
        server = self.family.server
        return {"sample": dict(self.sample), "base_url": server.base_url(self.session), "api_key": server.api_key,
                "session_id": self.session.id}

    def _arguments(self) -> dict:
        given = self._given()
        try:
            params = inspect.signature(self.family.agent).parameters.values()
        except (TypeError, ValueError):
            return given
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return given
        return {p.name: given[p.name] for p in params if p.name in given}

    def _run(self) -> None:
        try:
            result = self.family.agent(**self._arguments())
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            self.session.events.put(("end", result))
        except BaseException as e:  # noqa: BLE001 - the program's failure is its episode's, never the run's
            self.session.events.put(("error", valid_text(f"{type(e).__name__}: {e}")[:500]))

    def _wait_process(self) -> None:
        try:
            self.session.events.put(("end", self._process.result()))
        except Exception as e:  # noqa: BLE001 - the command's failure is its episode's, never the run's
            self.session.events.put(("error", valid_text(str(e))[:1000]))
        finally:
            self.family.processes.discard(self._process)

    def _stop_process(self) -> None:
        """A command's process group killed (its episode is over)."""
        if self._process is not None:
            self._process.kill()

    def _next(self, deadline: float | None = None):
        """The program's next event: ``("request", (Pending, its ids))``, ``("end", value)`` or ``("error",
        message)``, within ``timeout_s`` (or by ``deadline``, a ``time.monotonic()``); a request the template
        cannot render is answered 400 and the next event read."""
        deadline = time.monotonic() + self.family.timeout_s if deadline is None else deadline
        while True:
            try:
                kind, value = self.session.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return "error", f"the agent made no request and did not return within {self.family.timeout_s:g} s"
            if kind != "request":
                return kind, value
            try:
                return kind, (value, render_request(self.tokenizer, value.request))
            except RequestError as e:
                value.answer(e.status, error_body(e.message))

    def end(self, how: str, error: str | None = None, value=None) -> None:
        """End the episode (``how``: returned / failed / cut): the session closed, its waiting
        request refused; the program's returned value kept as its reward where it is a number."""
        if self.ended is None:
            self.ended, self.error = how, error
        if how == "returned":
            if _is_number(value):
                self.reward = float(value)
            elif value is not None:
                self.error = f"the agent returned {type(value).__name__}, not a number or None: no reward"
        self.family.server.drop_session(self.session, error or how)
        self._stop_process()

    # -- the Env protocol -------------------------------------------------------------

    def reset(self, sample: dict):
        kind, value = self._next(self._deadline)  # the batch's programs started together: one deadline
        if kind == "request":
            return self._take(*value)
        self.end("failed", "the agent returned before its first request" if kind == "end" else value)
        return None

    def step(self, segment: Segment) -> StepResult:
        if self.ended is not None or self.pending is None:
            return StepResult(None, done=True, info=self._info())
        reply, finish = self._reply(segment)
        self.pending.answer(200, completion_body(reply, finish, self.context_tokens, len(segment.ids)))
        self.pending, previous = None, self.messages
        if self.text is not None:
            self.text += reply["text"]
        else:
            self.messages = [*previous, normal_message(reply)]
        self.context_tokens += len(segment.ids)
        kind, value = self._next()
        if kind != "request":
            self.end("returned" if kind == "end" else "failed", None if kind == "end" else value,
                     value if kind == "end" else None)
            return StepResult(None, done=True, info=self._info())
        pending, ids = value
        added = self._added(pending.request)
        self._take(pending, ids)
        if added is None:  # a rewritten conversation: the whole context, a new training row where it does not extend
            self.rewrites += 1
            self.context_tokens = len(ids)
            return StepResult(context=ids, info=self._info())
        observation = self._observation(reply, added, segment)
        self.context_tokens += len(observation)
        return StepResult(observation, info=self._info())

    def final_reward(self) -> float | None:
        return self.reward

    def record(self) -> dict:
        return {"agent": {"calls": self.calls, "ended": self.ended or "running", "reward": self.reward,
                          "error": self.error, "rewritten": self.rewrites, "session": self.session.id}}

    # -- the episode's end after the sampler's --------------------------------------------

    def cut(self, segment_ids: list[int] | None) -> None:
        """The sampler ended the episode while the program runs: its waiting request is answered with the
        completion so far (``finish_reason="length"``) where there is one, and the session closed."""
        if self.ended is not None:
            return
        if self.pending is not None and segment_ids:
            segment = Segment(tuple(segment_ids), "", self.tokenizer.decode(segment_ids), False, 0)
            self.pause_reason = "length"
            reply, finish = self._reply(segment)
            self.pending.answer(200, completion_body(reply, finish, self.context_tokens, len(segment_ids)))
        self.ended = "cut"
        self.family.server.drop_session(self.session, "the episode's turns or tokens are spent")

    def finish(self, deadline: float | None = None) -> None:
        """Wait (until ``deadline``, a ``time.monotonic()``; else ``timeout_s``) for a cut program's return, its
        reward kept."""
        if self.ended != "cut" or self._thread is None:
            return
        self._thread.join(self.family.timeout_s if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() and self._process is not None:  # a command past its time: killed, its end read
            self._stop_process()
            self._thread.join(_REAP_S)
        while True:
            try:
                kind, value = self.session.events.get_nowait()
            except queue.Empty:
                return
            if kind == "end":
                self.reward = float(value) if _is_number(value) else None
            elif kind == "error":
                self.error = value

    # -- one call -----------------------------------------------------------------------

    def _take(self, pending, ids: list[int]) -> list[int]:
        """``pending`` becomes the request to answer; its rendered ids the episode's context."""
        self.pending, self.calls = pending, self.calls + 1
        self.messages, self.text = list(pending.request.messages), pending.request.prompt
        self.tools_key = json.dumps(pending.request.tools, sort_keys=True, default=str)
        if self.calls == 1:
            self.context_tokens = len(ids)
        return ids

    def _added(self, request: ChatRequest) -> list[dict] | str | None:
        """The messages ``request`` adds to the conversation so far (a text completion: the text it adds to the
        last prompt and its answer); None where it does not repeat it."""
        if (request.prompt is None) != (self.text is None):
            return None
        if self.text is not None:  # what it adds past the answer, less the stop string the row holds already
            rest = request.prompt[len(self.text):] if request.prompt.startswith(self.text) else None
            return None if rest is None or not rest.startswith(self.held) else rest[len(self.held):]
        n = len(self.messages)
        if json.dumps(request.tools, sort_keys=True, default=str) != self.tools_key or len(request.messages) < n:
            return None
        if [_message_key(m) for m in request.messages[:n]] != [_message_key(m) for m in self.messages]:
            return None
        return request.messages[n:]

    def _reply(self, segment: Segment) -> tuple[dict, str]:
        """The assistant message answering the waiting request, and its finish reason."""
        request, ids = self.pending.request, list(segment.ids)
        stop_id = ids[-1:] if segment.by_stop_token else []
        body_ids = ids[: len(ids) - len(stop_id)]
        text = self.tokenizer.decode(body_ids, skip_special_tokens=True)
        finish = "stop" if segment.by_stop_token or self.pause_reason == "stop" else "length"
        if request.prompt is not None:  # a text completion: the text as sampled, special tokens spelled out
            text = self.tokenizer.decode(body_ids)
        whole = text
        if self.pause_reason == "stop" and not request.include_stop:
            text = text[: min((text.find(s) for s in request.stop if s in text), default=len(text))]
        if request.prompt is not None:
            self.pause_reason, self.held = None, whole[len(text):]
            return {"text": text}, finish
        calls = self._calls(self.tokenizer.decode(body_ids)) if finish == "stop" and request.read_calls else []
        self.pause_reason = None
        if not calls:
            return {"role": "assistant", "content": text}, finish
        cut = min((text.find(m) for m in CALL_MARKERS if m in text), default=0)
        message = assistant_message(text[:cut].strip(), [])
        message["tool_calls"] = [{"id": call_id(i), "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for i, c in enumerate(calls)]
        return message, "tool_calls"

    def _calls(self, raw: str) -> list[ToolCall]:
        """The calls of a reply's text in the template's format, cast to the request's tools' schemas; [] where
        there are none, or one of them cannot be read (the text is then the reply's content)."""
        if self.family.call_format is None:
            return []
        parameters = {t["function"].get("name"): t["function"].get("parameters") for t in self.pending.request.tools}
        parsed = self.family.call_format.parse(raw)
        calls = [cast_arguments(c, parameters.get(c.name)) if isinstance(c, ToolCall) else c for c in parsed]
        return calls if all(isinstance(c, ToolCall) for c in calls) else []

    def _observation(self, reply: dict, added: list[dict], segment: Segment) -> list[int]:
        """The ids of the messages the next request adds, rendered after the policy's turn (a turn the policy
        did not end with its stop token closed first, as the template closes it), cut to fit."""
        if isinstance(added, str):  # a text completion's: the text as the program wrote it
            return list(self.tokenizer.encode(added, add_special_tokens=False))[: self.family.max_observation_tokens]
        stop_text = self.tokenizer.decode(list(segment.ids[-1:])) if segment.by_stop_token else ""
        closing = "" if stop_text else self.family.closing
        calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                 for c in reply.get("tool_calls") or ()]
        contents = [defuse(m.get("content") or "", self.family.specials) for m in added]

        def render(texts: list[str]) -> str:
            messages = [{**m, "content": t} for m, t in zip(added, texts)]
            return closing + chat_observation(self.tokenizer, calls, messages, stop_text)

        return fit_observation(self.tokenizer, render, contents, self.family.max_observation_tokens)

    def _info(self) -> dict:
        return {"agent_error": self.error} if self.error else {}


class AgentEpisodes(EnvEpisodes):
    """The `EnvEpisodes` of an agent batch: a segment also pauses at its request's ``max_tokens`` and ``stop``
    strings (in its text as the answer gives it: a text completion's with special tokens spelled out, so that
    ``</calc`` + a special token + ``>`` stops no completion, as it makes no call of the built-in calculator's);
    the first `record` cuts every episode the sampler ended while its program runs (`AgentEnv.cut`)."""

    def __init__(self, family: AgentEnvironments, envs: list[AgentEnv], samples: list[dict]) -> None:
        super().__init__(family, envs, samples)
        self._cut: float | None = None  # when the first record cut the running programs: their deadline

    def pauses(self, row: int, segment_ids: list[int]) -> bool:
        super().pauses(row, segment_ids)
        env = self.envs[row]
        request = None if env.pending is None else env.pending.request
        if request is None or not segment_ids:
            return False
        if request.stop:
            tail = self.tokenizer.decode(segment_ids[-(max(map(len, request.stop)) + 2):],
                                         skip_special_tokens=request.prompt is None)  # as the answer's text reads
            if any(s in tail for s in request.stop):
                env.pause_reason = "stop"
                return True
        if request.max_tokens is not None and len(segment_ids) >= request.max_tokens:
            env.pause_reason = "length"
            return True
        return False

    def record(self, row: int, fed: int | None = None) -> dict:
        if self._cut is None:
            self._cut = time.monotonic() + self.family.timeout_s  # one deadline: the programs end side by side
            for r, env in enumerate(self.envs):
                env.cut(self._rows[r].pending)
        self.envs[row].finish(self._cut)
        return super().record(row, fed)


async def _awaited(awaitable):
    return await awaitable
