"""The environment of a multi-turn, tool-using rollout, token in, token out.

A response is a sequence of **policy segments** (what the policy samples) and **observations** (what
the environment inserts into its context, never trained on). The sampler (``cispo.rollout``) calls
an `Episodes` — one per ``generate`` batch, made by `ToolEnvironment.start` — with token ids only:
`Episodes.pauses` after every sampled token, `Episodes.respond` when segments end, and the trainer
reads `Episodes.record` for ``samples.jsonl``. The environment decodes a segment's ids only to read
them; the ids trained on are exactly the ids sampled, and an observation is returned as token ids
(the text the environment chose, tokenized with ``add_special_tokens=False``).

Two tool formats (``data.tool_format``; `resolve_tool_format`):

* ``chat`` (TRL's convention, for chat templates that render tools, e.g. Qwen2.5, Llama 3.1): the prompt
  carries the tools' JSON schemas (`render_prompt`); a segment that ends with a stop token (EOS,
  ``<|im_end|>``) is read for calls in the template's format (``cispo.envs.call_formats``: Hermes
  ``<tool_call>{...}</tool_call>``, Llama 3.1's bare JSON, Qwen3.5's XML, Mistral's ``[TOOL_CALLS]``, chosen
  from the template's own rendering of a call, or named by ``data.tool_format``; a template whose calls
  no format reads is refused at set-up; one call nesting deeper than `MAX_CALL_DEPTH` is an error
  observation, never parsed), each call's arguments cast to its tool's schema (`cast_arguments`: a value
  that does not cast is an error observation naming it). None: the episode ends. Else every call runs, and the
  observation is the chat template's own rendering of the tool turn(s) and of the next assistant
  turn's opening: the text by which rendering ``[user, assistant, tool...]`` with the generation
  prompt extends rendering ``[user, assistant]`` (TRL's minimal conversation), after the end of the
  assistant turn the policy sampled (``"\\n"`` after ``<|im_end|>`` in ChatML; `chat_observation`).
* ``inline`` (ToRL / ReTool, any template): generation pauses when a segment's text ends with a stop
  string ``</tag>`` — the stop string completed by the segment's last token, whose text may run on
  past it (SmolLM2 spells ``</calc>.`` as ``</``, ``calc``, ``>.``); the call is the text between the
  last ``<tag>`` and that ``</tag>``, passed as the tool's first argument (the calculator's tag is
  ``calc``: `INLINE_TAGS`; any other tool's is its name; two tools that take one tag, such as a tool of
  yours named ``calc`` beside the calculator, are refused: `inline_tags`). The observation is
  ``<result>OUTPUT</result>`` with every ``<`` of the output written ``&lt;`` (`inline_observation`),
  so an observation never holds a tag; a failed call's is ``<result>error: ...</result>``. A segment
  that ends with a stop token ends the episode.

Every observation is at most ``max_observation_tokens`` tokens: a longer output is cut (with a
``[cut]`` note) so the observation keeps its closing text (`fit_observation`). After ``max_turns``
observations (``rollout.max_turns``; a chat turn may carry several calls), the next call ends the
episode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from cispo.data.tasks import wordmath_calc
from cispo.envs.call_formats import (
    CALL_FORMATS,
    PROBE_NAME,
    assistant_message,
    call_format_for,
    cast_arguments,
    tool_message,
)
from cispo.envs.tool_calls import (
    INLINE_TAGS,
    MAX_CALL_DEPTH,
    inline_call,
    inline_observation,
    inline_tags,
    json_depth,
    parse_tool_calls,
    read_json,
)
from cispo.envs.tools import (
    Tool,
    ToolCall,
    ToolResult,
    ToolRunner,
    ToolSpecError,
    as_tool,
    check_python_tool,
    load_tools,
    policy_error,
    tool_schema,
)

__all__ = ["ToolEnvironment", "Episodes", "TOOL_FORMATS", "INLINE_TAGS", "TASK_TOOLS", "MAX_CALL_DEPTH", "read_json",
           "json_depth", "resolve_tool_format", "template_takes_tools", "render_prompt", "prompt_messages",
           "parse_tool_calls", "inline_tags", "inline_call", "inline_observation", "chat_observation",
           "fit_observation", "kept_results", "dropped_note", "build_environment", "task_tools",
           "check_tools", "environment_from_config"]

TOOL_FORMATS = ("auto", "chat", "inline", *CALL_FORMATS)
"""``data.tool_format``'s values: a named call format (`CALL_FORMATS`) is ``chat`` with that format forced."""
TASK_TOOLS = {name: (wordmath_calc.TOOLS, wordmath_calc.TOOL_FORMAT)
              for name in (wordmath_calc.NAME, wordmath_calc.EXAMPLE_NAME, wordmath_calc.LARGE_NAME)}
"""A built-in task's own tools and format, used where ``data.tools`` is None / ``data.tool_format`` auto."""
CUT_NOTE = " [cut]"


# ---------------------------------------------------------------------------------------
# Prompts and formats
# ---------------------------------------------------------------------------------------


def prompt_messages(sample: dict, system_prompt: str | None = None) -> list[dict]:
    """The sample's chat messages (its text prompt as one user message), after a system message
    ``system_prompt`` unless they start with their own: what ``Policy.encode`` renders."""
    messages = list(sample.get("messages") or [{"role": "user", "content": sample["prompt"]}])
    if system_prompt is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def render_prompt(tokenizer, sample: dict, tools: list[dict] | None = None,
                  system_prompt: str | None = None) -> list[int]:
    """A sample's prompt ids through the chat template, the assistant turn opened, with the tools' JSON
    schemas (`ToolEnvironment.schemas`) where there are any (``chat`` format)."""
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(prompt_messages(sample, system_prompt), add_generation_prompt=True,
                                        tokenize=True, **extra)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


_PROBE_SCHEMA = {"type": "function", "function": {"name": PROBE_NAME, "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools (a tool's name appears in the prompt) and
    a tool turn after an assistant turn that calls it."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[_PROBE_SCHEMA], tokenize=False,
                                             add_generation_prompt=True)
        chat_observation(tokenizer, [{"name": PROBE_NAME, "arguments": {}}], [tool_message(PROBE_NAME, "ok")], "")
    except Exception:  # noqa: BLE001 - a template that cannot render tools, for whatever reason
        return False
    return PROBE_NAME in text


def resolve_tool_format(tokenizer, tool_format: str = "auto", task: str | None = None) -> str:
    """``chat`` or ``inline`` for ``data.tool_format``: ``auto`` is a built-in task's own (`TASK_TOOLS`:
    ``wordmath_calc``'s prompt teaches the inline calculator), else ``chat`` where the template takes
    tools (`template_takes_tools`), else ``inline``; a call format's name (`CALL_FORMATS`) is ``chat``.
    ``chat`` (or a format's name) with a template that takes none is refused, and so is ``chat`` where no
    format reads the template's calls (`call_format_for`)."""
    if tool_format not in TOOL_FORMATS:
        raise ToolSpecError(f"data.tool_format must be one of {', '.join(TOOL_FORMATS)}, got {tool_format!r}")
    if tool_format == "auto" and task in TASK_TOOLS:
        return TASK_TOOLS[task][1]
    if tool_format == "inline":
        return "inline"
    takes_tools = template_takes_tools(tokenizer)
    if tool_format == "auto" and not takes_tools:
        return "inline"
    if not takes_tools:
        raise ToolSpecError(f"data.tool_format={tool_format}: the tokenizer's chat template renders no tools (or no "
                            f"tool turn): use data.tool_format=inline, or a model whose template takes tools "
                            f"(Qwen2.5, Llama 3.1)")
    call_format_for(tokenizer, tool_format)
    return "chat"


def chat_observation(tokenizer, calls: list[dict], tool_messages: list[dict], stop_text: str) -> str:
    """The observation text of a chat tool turn: what the template puts after the assistant turn's end
    (``stop_text``, the stop token the policy sampled: ``"\\n"`` after ``<|im_end|>``; nothing where
    ``stop_text`` is not in the rendering), then the tool turn(s) and the next assistant turn's opening
    — the text by which ``history + [assistant] + tool_messages`` rendered with the generation prompt
    extends ``history + [assistant]``, the assistant turn making ``calls`` (TRL's ``_get_tool_suffix_ids``:
    a minimal history, one user message, so that no template renders it differently once a tool turn
    follows). A template that takes one call per turn (Llama 3.1 raises on more) is given the first call
    only: the tool turns that follow it do not depend on the calls. ValueError where it does not extend it."""
    def render(made: list[dict]) -> tuple[str, str]:
        messages = [{"role": "user", "content": "dummy"}, assistant_message("", made)]
        return (tokenizer.apply_chat_template(messages, tokenize=False),
                tokenizer.apply_chat_template([*messages, *tool_messages], tokenize=False, add_generation_prompt=True))

    try:
        before, after = render(calls)
    except Exception:  # noqa: BLE001 - a template's own refusal of several calls in one turn
        if len(calls) < 2:
            raise
        before, after = render(calls[:1])
    if not after.startswith(before):
        raise ValueError("the chat template renders the assistant turn differently once a tool turn follows it")
    end = before.rfind(stop_text) if stop_text else -1
    closing = before[end + len(stop_text):] if end >= 0 else ""
    return closing + after[len(before):]


def fit_observation(tokenizer, render: Callable[[list[str]], str], contents: list[str], cap: int) -> list[int]:
    """The ids of ``render(contents)``, at most ``cap`` of them, the rendering's own text (a template's closing
    ``</tool_response>``, the next turn's opening) always whole where it fits at all. Where it is longer: the
    trailing results that leave no room are dropped whole (`kept_results`), the last kept one saying how many
    (`dropped_note`); each kept content is cut to an equal share of what the rendering's own text leaves (its
    first tokens, then `CUT_NOTE`; smaller where the rendering grows it). Only where the rendering of one
    result with nothing in it is itself longer than ``cap`` are the ids cut at ``cap``."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids = encode(render(contents))
    if len(ids) <= cap:
        return ids
    kept = kept_results(tokenizer, render, contents, cap)
    if kept == 0:
        return ids[:cap]
    note = dropped_note(len(contents) - kept)
    contents = contents[:kept]
    whole = encode(render([*contents[:-1], contents[-1] + note]))
    if len(whole) <= cap:  # the kept results fit whole
        return whole
    share = max(0, (cap - len(encode(render(_with_note([CUT_NOTE] * kept, note))))) // kept)
    for _ in range(8):  # the rendering may grow a content (escaping): shrink the share by what is over
        cut = [tokenizer.decode(encode(c)[:share]) + CUT_NOTE if len(encode(c)) > share else c for c in contents]
        ids = encode(render(_with_note(cut, note)))
        if len(ids) <= cap or share == 0:
            break
        share = max(0, share - max(1, math.ceil((len(ids) - cap) / kept)))
    return ids if len(ids) <= cap else ids[:cap]


MIN_RESULT_TOKENS = 8
"""The fewest tokens of a result `kept_results` keeps room for (a shorter result: all of it)."""


def dropped_note(n: int) -> str:
    """What the last kept result of an observation says of the ``n`` results dropped after it ("" for none)."""
    return "" if n == 0 else f" [{n} more tool result{'s' if n > 1 else ''} cut: the observation's limit]"


def _with_note(contents: list[str], note: str) -> list[str]:
    return [*contents[:-1], contents[-1] + note] if contents else contents


def kept_results(tokenizer, render: Callable[[list[str]], str], contents: list[str], cap: int) -> int:
    """How many leading results of ``contents`` an observation of ``cap`` ids keeps: the most whose rendering,
    each cut to `MIN_RESULT_TOKENS` tokens (then `CUT_NOTE`) and the last saying how many were dropped
    (`dropped_note`), fits ``cap`` (a binary search: a rendering grows with its results); 0 where not even one
    does (a template's own text longer than ``cap``)."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    heads = [encode(c) for c in contents]
    floor = [c if len(h) <= MIN_RESULT_TOKENS else tokenizer.decode(h[:MIN_RESULT_TOKENS]) + CUT_NOTE
             for c, h in zip(contents, heads)]
    lo, hi = 0, len(contents)
    while lo < hi:
        k = (lo + hi + 1) // 2
        if len(encode(render(_with_note(floor[:k], dropped_note(len(contents) - k))))) <= cap:
            lo = k
        else:
            hi = k - 1
    return lo


# ---------------------------------------------------------------------------------------
# The environment and its episodes
# ---------------------------------------------------------------------------------------


@dataclass
class _Row:
    """One episode: the record's segments and calls, turns taken, and the policy segment the sampler
    showed last (`Episodes.pauses`) that no `Episodes.respond` took yet."""

    segments: list[dict] = field(default_factory=list)
    observations: list[list[int]] = field(default_factory=list)  # each tool segment's ids, in order
    calls: list[dict] = field(default_factory=list)
    turns: int = 0
    pending: list[int] | None = None


@dataclass
class _Plan:
    """A paused row's turn: its calls (each a `ToolCall`, or the message of one that could not be read),
    the tool each names (None: unread), and (``chat``) the text of the stop token that ended it."""

    calls: list
    names: list
    stop_text: str = ""


class ToolEnvironment:
    """Tools as an environment (module docstring).

    Args:
        tokenizer: the policy's (Hugging Face) tokenizer. tools: `Tool` s or plain functions.
        tool_format: ``chat``, ``inline``, ``auto`` (`resolve_tool_format`) or a call format's name (``chat``
            in that format: `CALL_FORMATS`). max_turns: observations per response (``rollout.max_turns``).
            runner: the `ToolRunner` that runs the calls.
        max_observation_tokens: the longest observation (`fit_observation`). system_prompt: the system
            message ``Policy.encode`` puts first (`render_prompt`).
    """

    def __init__(self, tokenizer, tools: list, tool_format: str, max_turns: int, runner: ToolRunner,
                 max_observation_tokens: int = 256, system_prompt: str | None = None) -> None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ToolSpecError(f"rollout.max_turns must be an int >= 1, got {max_turns!r}")
        if max_observation_tokens < 8:
            raise ToolSpecError(f"max_observation_tokens must be >= 8, got {max_observation_tokens!r}")
        self.tokenizer, self.runner, self.max_turns = tokenizer, runner, max_turns
        self.tools: list[Tool] = [as_tool(t) for t in tools]
        self.tool_format = resolve_tool_format(tokenizer, tool_format)
        self.max_observation_tokens, self.system_prompt = max_observation_tokens, system_prompt
        self.tags = inline_tags(self.tools) if self.tool_format == "inline" else {}
        """Each tool's inline tag -> its name (``inline``; `inline_tags`); {} in ``chat``."""
        if self.tool_format == "inline":
            for tool in self.tools:
                tool.argument  # noqa: B018 - refuses a tool that takes no argument, now
        self._may_end: dict[int, bool] = {}
        self._specials = tuple(t for t in getattr(tokenizer, "all_special_tokens", ()) if len(t) > 1)
        self.schemas: list[dict] = [tool_schema(t) for t in self.tools] if self.tool_format == "chat" else []
        """The tools' JSON schemas the prompt renders (``chat``; `render_prompt`); [] inline."""
        self.parameters = {t.name: s["function"].get("parameters") for t, s in zip(self.tools, self.schemas)}
        """Each tool's name -> its schema's ``parameters``, to which a call's arguments are cast (`cast_arguments`)."""
        self.call_format = call_format_for(tokenizer, tool_format) if self.tool_format == "chat" else None
        """How the policy writes a call (``chat``: ``cispo.envs.call_formats``); None inline."""

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The strings that pause a segment (``inline``: each tool's ``</tag>``; ``chat``: none)."""
        return tuple(f"</{tag}>" for tag in self.tags) if self.tool_format == "inline" else ()

    def defuse(self, text: str) -> str:
        """``text`` with every special token's spelling (``<|im_end|>``) broken by a zero-width space after its
        first character, so that a tool's output cannot end a turn or open one when tokenized (``chat``; an
        inline observation has no ``<`` at all)."""
        for special in self._specials:
            if special in text:
                text = text.replace(special, f"{special[0]}\u200b{special[1:]}")
        return text

    def may_end_stop(self, token_id: int) -> bool:
        """Whether token ``token_id``'s text holds the last character of a stop string (so it may complete
        one), remembered per token; always True for a stop string ending in a non-ASCII character (a
        byte-level token may hold part of it)."""
        hit = self._may_end.get(token_id)
        if hit is None:
            ends = {s[-1] for s in self.stop_strings}
            text = self.tokenizer.decode([token_id])
            hit = self._may_end[token_id] = any(c in text for c in ends) or not all(c.isascii() for c in ends)
        return hit

    def start(self, samples: list[dict]) -> Episodes:
        """The `Episodes` of one ``generate`` batch: row i is ``samples[i]``'s episode."""
        return Episodes(self, samples)

    def render_prompt(self, sample: dict) -> list[int]:
        """The sample's prompt ids with this environment's tools (`render_prompt`)."""
        return render_prompt(self.tokenizer, sample, self.schemas or None, self.system_prompt)

    def close(self) -> None:
        """Stop the tools' worker processes."""
        self.runner.close()


class Episodes:
    """One ``generate`` batch's episodes; row i is ``samples[i]`` (the sampler's protocol,
    ``cispo.rollout.base.Episodes``). Not thread-safe: the sampler calls it from one thread."""

    def __init__(self, env: ToolEnvironment, samples: list[dict]) -> None:
        self.env, self.tokenizer = env, env.tokenizer
        self.stop_strings = env.stop_strings
        self._tail = max((len(s) for s in self.stop_strings), default=0) + 2  # tokens: each spells >= 1 character
        self._rows = [_Row() for _ in samples]

    def pauses(self, row: int, segment_ids: list[int]) -> bool:
        """True when the policy segment (the ids the policy sampled since the prompt or the last
        observation, newest last) now ends with one of the environment's stop strings (inline tools,
        e.g. ``</calc>``): the string completed by its last token, whose text may run on past it.
        Called after every sampled token of a live row, so it decodes only a tail of the ids (the
        longest stop string's length + 2 tokens), and only where the last token's text holds a stop
        string's last character (`ToolEnvironment.may_end_stop`). ``chat``: always False (its segments end
        with a stop token). Keeps the segment for `record`, where no `respond` takes it (a row cut by the length)."""
        self._rows[row].pending = segment_ids
        if not self.stop_strings or not segment_ids or not self.env.may_end_stop(segment_ids[-1]):
            return False
        tail = segment_ids[-self._tail:]
        text, before = self.tokenizer.decode(tail), self.tokenizer.decode(tail[:-1])
        return any(text.find(s, max(0, len(before) - len(s) + 1)) >= 0 for s in self.stop_strings)

    def respond(self, rows: list[int], segments: list[list[int]], by_stop_token: list[bool]) -> list[list[int] | None]:
        """For each paused row (its segment ended by a stop string, or by a stop token such as
        EOS / ``<|im_end|>`` when ``by_stop_token``), the observation's token ids to insert into its
        context (not trained on), or None: the episode ends and the row's response is final. Runs
        every tool call of this batch of rows at once, in parallel (`ToolRunner.run`). None once a row
        has had ``max_turns`` observations; an observation is at most ``max_observation_tokens`` ids."""
        plans = [self._plan(r, seg, tok) for r, seg, tok in zip(rows, segments, by_stop_token)]
        calls = [c for plan in plans if plan is not None for c in plan.calls if isinstance(c, ToolCall)]
        results = iter(self.env.runner.run(calls))
        out = []
        for r, plan in zip(rows, plans):
            if plan is None:
                out.append(None)
                continue
            done = [next(results) if isinstance(c, ToolCall) else ToolResult(policy_error(c), c, 0.0)
                    for c in plan.calls]
            out.append(self._observe(r, plan, done))
        return out

    def record(self, row: int, fed: int | None = None) -> dict:
        """What ``samples.jsonl`` shows of the row's episode: ``{"segments": [{"role": "policy" | "tool",
        "text": ...}, ...], "tool_calls": n, "tool_errors": n, "calls": [{"name", "arguments", "error",
        "seconds"}, ...]}`` (a segment's text decoded without special tokens; an observation's as inserted).
        ``fed``: the observation ids the sampler fed into the row's context in all (its ``env_mask``'s sum):
        where the response's length left room for fewer than the environment returned, the observations
        read as fed (the last one cut, ``"tokens_cut": n``; one never fed is left out)."""
        state = self._rows[row]
        segments = list(state.segments) if fed is None else self._fed_segments(state, fed)
        if state.pending:
            segments.append({"role": "policy", "text": self.tokenizer.decode(state.pending, skip_special_tokens=True)})
        return {"segments": segments, "tool_calls": len(state.calls),
                "tool_errors": sum(c["error"] is not None for c in state.calls), "calls": list(state.calls)}

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

    # -- one row ---------------------------------------------------------------------

    def _plan(self, row: int, segment: list[int], by_stop_token: bool) -> _Plan | None:
        """Record the row's segment; the `_Plan` of its observation, or None where its episode ends."""
        state = self._rows[row]
        state.pending = None
        text = self.tokenizer.decode(segment, skip_special_tokens=True)
        state.segments.append({"role": "policy", "text": text})
        if self.env.tool_format == "inline":
            plan = None if by_stop_token else self._inline_plan(text)
        else:
            plan = self._chat_plan(segment, by_stop_token)
        return None if plan is None or state.turns >= self.env.max_turns else plan

    def _inline_plan(self, text: str) -> _Plan | None:
        name, argument = inline_call(text, self.env.tags)
        if not name:
            return None
        if argument is None:
            tag = next(t for t, n in self.env.tags.items() if n == name)
            return _Plan([f"the call has no opening <{tag}>"], [name])
        tool = next(t for t in self.env.tools if t.name == name)
        return _Plan([ToolCall(name, {tool.argument: argument})], [name])

    def _chat_plan(self, segment: list[int], by_stop_token: bool) -> _Plan | None:
        raw = self.tokenizer.decode(segment)
        stop_text = self.tokenizer.decode(segment[-1:]) if by_stop_token else ""
        body = raw[: len(raw) - len(stop_text)] if stop_text and raw.endswith(stop_text) else raw
        parsed = self.env.call_format.parse(body)
        if not parsed:
            return None
        calls = [cast_arguments(c, self.env.parameters.get(c.name)) if isinstance(c, ToolCall) else c for c in parsed]
        return _Plan(calls, [c.name if isinstance(c, ToolCall) else None for c in parsed], stop_text)

    def _observe(self, row: int, plan: _Plan, results: list[ToolResult]) -> list[int]:
        """The row's observation ids for ``results``; the calls and the observation recorded."""
        state = self._rows[row]
        for call, name, result in zip(plan.calls, plan.names, results):
            state.calls.append({"name": name, "arguments": call.arguments if isinstance(call, ToolCall) else None,
                                "error": result.error, "seconds": round(result.seconds, 4)})
        texts = [r.text for r in results]
        if self.env.tool_format == "inline":
            ids = fit_observation(self.tokenizer, lambda t: inline_observation(t[0]), texts,
                                  self.env.max_observation_tokens)
        else:
            ids = self._chat_ids(plan, texts)
        state.turns += 1
        state.segments.append({"role": "tool", "text": self.tokenizer.decode(ids)})
        state.observations.append(list(ids))
        return ids

    def _chat_ids(self, plan: _Plan, texts: list[str]) -> list[int]:
        """The chat observation's ids (`chat_observation`, fitted)."""
        names = [n or "unknown" for n in plan.names]
        calls = [{"name": n, "arguments": c.arguments if isinstance(c, ToolCall) else {}}
                 for n, c in zip(names, plan.calls)]
        texts = [self.env.defuse(t) for t in texts]

        def render(contents: list[str]) -> str:
            answers = [tool_message(n, t, i) for i, (n, t) in enumerate(zip(names, contents))]
            return chat_observation(self.tokenizer, calls, answers, plan.stop_text)

        return fit_observation(self.tokenizer, render, texts, self.env.max_observation_tokens)


# ---------------------------------------------------------------------------------------
# From the config
# ---------------------------------------------------------------------------------------


def build_environment(tokenizer, tools=None, tool_format: str = "auto", max_turns: int = 4, timeout_s: float = 5.0,
                      task: str | None = None, system_prompt: str | None = None, workers: int | None = None,
                      isolation: str = "process", max_observation_tokens: int = 256) -> ToolEnvironment | None:
    """The run's `ToolEnvironment`, or None where it has no tools. ``tools``: ``data.tools`` (specs, or
    `Tool` s / functions); None: the built-in ``task``'s own (`TASK_TOOLS`: ``wordmath_calc``'s
    calculator), else none; ``[]``: none. The ``python`` tool is refused where the code sandbox does not run
    (`check_python_tool`). The tools' worker processes are started now (`ToolRunner.start`)."""
    loaded = task_tools(tools, task)
    if not loaded:
        return None
    fmt = resolve_tool_format(tokenizer, tool_format, task)
    runner = ToolRunner(loaded, timeout_s=timeout_s, workers=workers, isolation=isolation)
    env = ToolEnvironment(tokenizer, loaded, fmt, max_turns, runner, max_observation_tokens, system_prompt)
    runner.start()
    return env


def task_tools(tools, task: str | None = None) -> list[Tool]:
    """The `Tool` s of ``data.tools`` (specs, or `Tool` s / functions; None: the built-in ``task``'s own,
    `TASK_TOOLS`, else none), loaded (a user module imported first in a throw-away process: `load_tool`),
    the ``python`` tool refused where the code sandbox does not run (`check_python_tool`). ToolSpecError,
    in one line naming the spec, for any that names no usable function."""
    if tools is None:
        tools = list(TASK_TOOLS[task][0]) if task in TASK_TOOLS else []
    if not isinstance(tools, (str, list, tuple)):
        raise ToolSpecError(f"data.tools: expected a tool spec or a list of them, got {tools!r}")
    specs = [tools] if isinstance(tools, str) else list(tools)
    if all(isinstance(s, str) for s in specs):  # one list: two specs naming one tool are refused too
        loaded = load_tools(specs)
    else:
        loaded = [t for s in specs for t in (load_tools(s) if isinstance(s, str) else [as_tool(s)])]
    if any(t.builtin and t.name == "python" for t in loaded):
        check_python_tool()
    return loaded


def check_tools(data_cfg, tokenizer=None) -> list[Tool]:
    """``data.tools`` checked before any weights load, so that a mistake is one line, not a traceback after
    the model loaded: each spec loads (`task_tools`), no two tools share a name, and, in the format the run
    will use (``data.tool_format``; ``auto``: the task's own, else by ``tokenizer``'s chat template, where
    given), each tool can be called: inline, its tag is its own and it takes an argument (`inline_tags`);
    chat, it has a JSON schema (`tool_schema`) and the template renders tools (`resolve_tool_format`).
    Returns the tools ([] without any)."""
    task = data_cfg.task if data_cfg.path is None else None
    tools = task_tools(data_cfg.tools, task)
    if not tools:
        return tools
    fmt = data_cfg.tool_format
    if tokenizer is not None or fmt == "auto" and task in TASK_TOOLS:
        fmt = resolve_tool_format(tokenizer, fmt, task)
    if fmt == "inline":
        inline_tags(tools)
        for tool in tools:
            tool.argument  # noqa: B018 - refuses a tool that takes no argument
    elif fmt == "chat" or fmt in CALL_FORMATS:
        for tool in tools:
            tool_schema(tool)
    return tools


def environment_from_config(tokenizer, data_cfg, rollout_cfg) -> ToolEnvironment | None:
    """`build_environment` from ``data.tools``, ``data.tool_format``, ``data.tool_timeout_s``,
    ``data.task`` (a built-in task's own tools where ``data.path`` is None), ``data.system_prompt`` and
    ``rollout.max_turns``."""
    task = data_cfg.task if data_cfg.path is None else None
    return build_environment(tokenizer, data_cfg.tools, data_cfg.tool_format, rollout_cfg.max_turns,
                             data_cfg.tool_timeout_s, task=task, system_prompt=data_cfg.system_prompt)
