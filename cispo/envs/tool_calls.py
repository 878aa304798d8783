"""Reading the tool calls in a policy's text: Hermes-style chat calls (``<tool_call>{...}</tool_call>``,
`parse_tool_calls`; the other chat formats, built on `call_of` and `read_json`, are in
``cispo.envs.call_formats``) and inline calls (``<calc>2+3</calc>``, `inline_call`), and the inline observation
(`inline_observation`). A policy's text is hostile input: every reader here is linear in its length and
bounded in depth, and a call it cannot read is an error message for the policy, never an exception that ends
the episode (`cispo.envs.tool_env` runs the calls and feeds the observations)."""

from __future__ import annotations

import json
import re

from cispo.envs.tools import Tool, ToolCall, ToolSpecError

INLINE_TAGS = {"calculator": "calc"}
"""A tool's inline tag where it is not the tool's name (``<calc>2+3</calc>`` calls ``calculator``)."""
MAX_CALL_DEPTH = 32
"""The deepest a chat tool call's JSON may nest (``[`` and ``{``, the call's own object counted): a deeper call
is an error observation, never parsed (`read_json`). Real calls nest a few levels."""
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
NOT_A_CALL = "the tool call is not valid JSON of a call"
"""How the error message of a JSON call that could not be read starts (`parse_tool_calls`, and the JSON
formats of ``cispo.envs.call_formats``)."""


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """The Hermes / Qwen2.5 tool calls in ``text``, in order: each ``<tool_call>`` block's JSON object as a
    `ToolCall` (``arguments``, or ``parameters``; a JSON string of them is read too), or, where a block
    is no such object, the error message saying why. [] when there is no block. A block (or a string of
    arguments) nesting deeper than `MAX_CALL_DEPTH` is such an error, never parsed (`read_json`)."""
    out: list[ToolCall | str] = []
    for block in tool_call_blocks(text):
        try:
            out.append(call_of(read_json(block.strip())))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            out.append(f"{NOT_A_CALL}: {e}")
    return out


def call_of(value) -> ToolCall:
    """The `ToolCall` of a decoded JSON call, ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``, as
    Llama 3.1 writes; a JSON string of them is read too, within `MAX_CALL_DEPTH`). ValueError saying what
    is wrong where ``value`` is no such object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError('expected {"name": ..., "arguments": {...}}')
    arguments = value.get("arguments", value.get("parameters", {}))
    arguments = read_json(arguments, depth=2) if isinstance(arguments, str) else arguments
    return ToolCall(value["name"], arguments if arguments is not None else {})


def json_depth(text: str) -> int:
    """The deepest nesting of ``[`` / ``{`` in JSON text, strings left out (an unbalanced text's too: each
    opening counts until it is closed). Linear in the length, no recursion."""
    depth = deepest = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub('""', text)):
        depth = depth + 1 if m.group() in "[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    return deepest


def read_json(text: str, depth: int = 1):
    """``json.loads(text)`` of a policy's text, ``depth`` levels below the call's own object: ValueError
    where it would nest deeper than `MAX_CALL_DEPTH` in all (checked before it is parsed: Python's JSON
    reader, the record's writer, pickling and a template's ``tojson`` all recurse, and ~1000 levels end
    the process's stack), and where parsing runs out of stack or memory anyway."""
    if json_depth(text) + depth - 1 > MAX_CALL_DEPTH:
        raise ValueError(f"it nests deeper than {MAX_CALL_DEPTH} levels of [ and {{")
    try:
        return json.loads(text)
    except (RecursionError, MemoryError):
        raise ValueError("it nests too deeply to read") from None


def tool_call_blocks(text: str) -> list[str]:
    """The text inside each ``<tool_call>...</tool_call>``, in order (linear in the length: an opening
    without a closing ends the scan)."""
    blocks, i = [], 0
    while (start := text.find(TOOL_CALL_OPEN, i)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end < 0:
            break
        blocks.append(text[start + len(TOOL_CALL_OPEN) : end])
        i = end + len(TOOL_CALL_CLOSE)
    return blocks


def inline_tags(tools: list[Tool]) -> dict[str, str]:
    """Each tool's inline tag (`INLINE_TAGS`, else its name) -> the tool's name. ToolSpecError, in one line
    naming both, where two tools take one tag (a tool named ``calc`` beside the built-in calculator): one
    of them could never be called, so the run is refused rather than one silently dropped."""
    tags: dict[str, Tool] = {}
    for tool in tools:
        tag = INLINE_TAGS.get(tool.name, tool.name)
        if tag in tags:
            first, mine = (tags[tag], tool) if not tool.builtin else (tool, tags[tag])
            where = [t.spec or "given in code" for t in (first, mine)]
            raise ToolSpecError(f"data.tools: tools {first.name!r} ({where[0]}) and {mine.name!r} ({where[1]}) both "
                                f"take the inline tag <{tag}>, so one of them could never be called: "
                                f"rename {mine.name!r}")
        tags[tag] = tool
    return {tag: tool.name for tag, tool in tags.items()}


def inline_call(text: str, tags: dict[str, str]) -> tuple[str, str | None]:
    """``(tool name, argument text)`` of the inline call that ``text`` ends with (the ``</tag>`` that ends
    last, the text after the last ``<tag>`` before it; ``tags``: tag -> tool name), the argument None
    where no ``<tag>`` opens it. ``("", None)`` where no ``</tag>`` is in ``text``."""
    best = ("", -1, "")
    for tag, name in tags.items():
        end = text.rfind(f"</{tag}>")
        if end > best[1]:
            best = (name, end, tag)
    name, end, tag = best
    if end < 0:
        return "", None
    start = text.rfind(f"<{tag}>", 0, end)
    return name, None if start < 0 else text[start + len(tag) + 2 : end].strip()


def inline_observation(text: str) -> str:
    """``<result>text</result>``, every ``<`` of ``text`` written ``&lt;`` (an observation holds no tag)."""
    return f"<result>{text.replace('<', '&lt;')}</result>"
