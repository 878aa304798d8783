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
  A template that renders an assistant turn differently once a tool turn follows it (past turns' thinking
  stripped: `appends_tool_turns` False) is not refused: its episodes re-render the whole conversation each
  turn (`ToolEnvironment.rerenders`; the policy's turn as an assistant message of its text before the first
  call and its calls), given as the step's ``context``: where it no longer extends the row, the episode goes on
  in a new training row whose prompt is that rendering (``cispo.envs.episodes``).
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

from dataclasses import dataclass

from cispo.data.tasks import wordmath_calc
from cispo.envs.base import Env, Segment, StepResult
from cispo.envs.call_formats import (
    CALL_FORMATS,
    PROBE_NAME,
    assistant_message,
    call_format_for,
    cast_arguments,
    text_before_calls,
    tool_message,
)
from cispo.envs.episodes import Environments
from cispo.envs.observations import (
    CUT_NOTE,
    chat_observation,
    defuse,
    fit_observation,
    special_spellings,
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

__all__ = ["ToolEnvironment", "ToolEpisode", "TOOL_FORMATS", "INLINE_TAGS", "TASK_TOOLS", "MAX_CALL_DEPTH", "read_json",
           "json_depth", "resolve_tool_format", "template_takes_tools", "render_prompt", "prompt_messages",
           "parse_tool_calls", "inline_tags", "inline_call", "inline_observation", "build_environment", "task_tools",
           "appends_tool_turns", "check_tools", "environment_from_config"]

TOOL_FORMATS = ("auto", "chat", "inline", *CALL_FORMATS)
"""``data.tool_format``'s values: a named call format (`CALL_FORMATS`) is ``chat`` with that format forced."""
TASK_TOOLS = {name: (wordmath_calc.TOOLS, wordmath_calc.TOOL_FORMAT)
              for name in (wordmath_calc.NAME, wordmath_calc.EXAMPLE_NAME, wordmath_calc.LARGE_NAME)}
"""A built-in task's own tools and format, used where ``data.tools`` is None / ``data.tool_format`` auto."""


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
    call = assistant_message("", [{"name": PROBE_NAME, "arguments": {}}])
    try:
        text = tokenizer.apply_chat_template(messages, tools=[_PROBE_SCHEMA], tokenize=False,
                                             add_generation_prompt=True)
        tokenizer.apply_chat_template([*messages, call, tool_message(PROBE_NAME, "ok")], tools=[_PROBE_SCHEMA],
                                      tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render tools, for whatever reason
        return False
    return PROBE_NAME in text


THINKING_WORDS = "cispo thinking probe"
THINKING_PROBE = f"<think>{THINKING_WORDS}</think>"
"""An assistant turn's text with thinking in it: a template that drops the words renders the policy's turns
otherwise than it sampled them (one that only lays them out anew, Qwen3's ``<think>\\n...\\n</think>``, keeps them)."""


def appends_tool_turns(tokenizer) -> bool:
    """Whether the template renders a tool turn as text appended to the conversation before it
    (`chat_observation` reads it) and shows an assistant turn's thinking as sampled; False for one that renders
    the assistant turn differently once a tool turn follows it (with or without thinking in it), or that drops
    the thinking of an assistant turn (one without calls) even as the last message (`ToolEnvironment.rerenders`:
    the conversation re-rendered each turn, as the template would show it)."""
    call, tool = [{"name": PROBE_NAME, "arguments": {}}], [tool_message(PROBE_NAME, "ok")]
    try:
        for content in ("", THINKING_PROBE):
            chat_observation(tokenizer, call, tool, "", content)
        shown = tokenizer.apply_chat_template([{"role": "user", "content": "dummy"},
                                               assistant_message(THINKING_PROBE, [])], tokenize=False)
    except Exception:  # noqa: BLE001 - the template's own refusal, or the rendering's mismatch
        return False
    return THINKING_WORDS in shown


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


# ---------------------------------------------------------------------------------------
# The environment and its episodes
# ---------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """A turn's calls (each a `ToolCall`, or the message of one that could not be read), the tool each names
    (None: unread), and (``chat``) the text of the stop token that ended the turn."""

    calls: list
    names: list
    stop_text: str = ""


class ToolEnvironment(Environments):
    """Tools as an environment (module docstring): one `ToolEpisode` per episode.

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
        self._specials = special_spellings(tokenizer)
        self.schemas: list[dict] = [tool_schema(t) for t in self.tools] if self.tool_format == "chat" else []
        """The tools' JSON schemas the prompt renders (``chat``; `render_prompt`); [] inline."""
        self.parameters = {t.name: s["function"].get("parameters") for t, s in zip(self.tools, self.schemas)}
        """Each tool's name -> its schema's ``parameters``, to which a call's arguments are cast (`cast_arguments`)."""
        self.call_format = call_format_for(tokenizer, tool_format) if self.tool_format == "chat" else None
        """How the policy writes a call (``chat``: ``cispo.envs.call_formats``); None inline."""
        self.stop_strings = tuple(f"</{tag}>" for tag in self.tags) if self.tool_format == "inline" else ()
        """The strings that pause a segment (``inline``: each tool's ``</tag>``; ``chat``: none)."""
        self.rerenders = self.tool_format == "chat" and not appends_tool_turns(tokenizer)
        """``chat`` with a template that renders an assistant turn differently once a tool turn follows it: each
        tool turn gives the whole conversation re-rendered (`StepResult.context`), a new training row where
        its ids do not extend the row's (``cispo.envs.episodes``)."""

    def defuse(self, text: str) -> str:
        """``text`` with every special token's spelling broken (`defuse`), so that a tool's output cannot end a
        turn or open one when tokenized (``chat``; an inline observation has no ``<`` at all)."""
        return defuse(text, self._specials)

    def make(self, sample: dict) -> ToolEpisode:
        """One episode's `ToolEpisode`."""
        return ToolEpisode(self, sample)

    def describe(self) -> str:
        return (f"tools: {', '.join(t.name for t in self.tools)} ({self.tool_format} format, at most {self.max_turns} "
                f"turns per response)")

    def render_prompt(self, sample: dict) -> list[int]:
        """The sample's prompt ids with this environment's tools (`render_prompt`)."""
        return render_prompt(self.tokenizer, sample, self.schemas or None, self.system_prompt)

    def close(self) -> None:
        """Stop the tools' worker processes."""
        self.runner.close()


class ToolEpisode(Env):
    """One episode of a `ToolEnvironment`: each policy segment is read for calls (``chat``: a segment ended
    by a stop token; ``inline``: one ended by a tool's ``</tag>``); none, or ``max_turns`` observations
    already, ends the episode; else every call runs (`ToolRunner.run`) and the observation is their results
    (``inline``: `inline_observation`; ``chat``: the chat template's tool turn, `chat_observation`)."""

    def __init__(self, env: ToolEnvironment, sample: dict | None = None) -> None:
        self.env, self.tokenizer, self.runner = env, env.tokenizer, env.runner
        self.calls: list[dict] = []
        self.turns = 0
        self.messages = prompt_messages(sample, env.system_prompt) if env.rerenders and sample else None
        """The conversation so far (`ToolEnvironment.rerenders`; None otherwise)."""

    def step(self, segment: Segment) -> StepResult:
        plan = self._plan(segment)
        if plan is None:
            return StepResult(None)
        done = iter(self.runner.run([c for c in plan.calls if isinstance(c, ToolCall)]))
        results = [next(done) if isinstance(c, ToolCall) else ToolResult(policy_error(c), c, 0.0) for c in plan.calls]
        if self.messages is not None:
            return StepResult(context=self._conversation(plan, results, segment.raw))
        return StepResult(self._observe(plan, results))

    def record(self) -> dict:
        """``{"tool_calls": n, "tool_errors": n, "calls": [{"name", "arguments", "error", "seconds"}, ...]}``."""
        return {"tool_calls": len(self.calls), "tool_errors": sum(c["error"] is not None for c in self.calls),
                "calls": list(self.calls)}

    def _plan(self, segment: Segment) -> _Plan | None:
        """The `_Plan` of the segment's observation, or None where its episode ends."""
        if self.env.tool_format == "inline":
            plan = None if segment.by_stop_token else self._inline_plan(segment.text)
        else:
            plan = self._chat_plan(list(segment.ids), segment.by_stop_token)
        return None if plan is None or self.turns >= self.env.max_turns else plan

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

    def _record(self, plan: _Plan, results: list[ToolResult]) -> None:
        """The turn's calls recorded."""
        for call, name, result in zip(plan.calls, plan.names, results):
            self.calls.append({"name": name, "arguments": call.arguments if isinstance(call, ToolCall) else None,
                               "error": result.error, "seconds": round(result.seconds, 4)})
        self.turns += 1

    def _conversation(self, plan: _Plan, results: list[ToolResult], raw: str) -> list[dict]:
        """The whole conversation after this turn (`ToolEnvironment.rerenders`): the policy's turn as an
        assistant message (its text before its first call, `text_before_calls`, and its calls) and the tool
        turns, each result defused and cut to ``max_observation_tokens`` tokens (then `CUT_NOTE`)."""
        self._record(plan, results)
        names = [n or "unknown" for n in plan.names]
        calls = [{"name": n, "arguments": c.arguments if isinstance(c, ToolCall) else {}}
                 for n, c in zip(names, plan.calls)]
        body = raw[: len(raw) - len(plan.stop_text)] if plan.stop_text and raw.endswith(plan.stop_text) else raw
        cap = self.env.max_observation_tokens
        texts = []
        for r in results:
            text = self.env.defuse(r.text)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            texts.append(text if len(ids) <= cap else self.tokenizer.decode(ids[:cap]) + CUT_NOTE)
        self.messages += [assistant_message(text_before_calls(self.env.call_format, body), calls),
                          *(tool_message(n, t, i) for i, (n, t) in enumerate(zip(names, texts)))]
        return list(self.messages)

    def _observe(self, plan: _Plan, results: list[ToolResult]) -> list[int]:
        """The observation ids for ``results``; the calls recorded."""
        self._record(plan, results)
        texts = [r.text for r in results]
        if self.env.tool_format == "inline":
            return fit_observation(self.tokenizer, lambda t: inline_observation(t[0]), texts,
                                   self.env.max_observation_tokens)
        return self._chat_ids(plan, texts)

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
