"""The tool-call formats chat templates teach, read from a policy's assistant turn, and the arguments typed
from the tool's JSON schema.

A chat template that renders tools also fixes how the model writes a call. Each format is a `CallFormat`
whose ``parse(text) -> list[ToolCall | str]`` reads one assistant turn (its stop token left out): a
`ToolCall` per call, in order, or the error message of a call that could not be read ([] where the turn
makes no call: the episode ends). `CALL_FORMATS`:

* ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or
  several (``cispo.envs.tool_calls.parse_tool_calls``).
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the turn is a bare JSON object ``{"name": ..., "parameters":
  {...}}`` (or ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;`` or white
  space (as vLLM's ``llama3_json`` parser reads them). A turn that starts with anything else makes no call.
* ``qwen_xml`` (Qwen3-Coder, Qwen3.5, Nemotron 3): ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue
  \\n</parameter>\\n</function>\\n</tool_call>``; every value is text, typed by `cast_arguments`.
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) or
  ``[TOOL_CALLS]NAME[ARGS]{...}`` (v11 on; a ``[CALL_ID]id`` before ``[ARGS]`` is skipped), each such call
  after its own ``[TOOL_CALLS]``.

Like every reader of policy text, each parser is linear in the text's length and bounded in depth (the JSON
of a call nests at most `MAX_CALL_DEPTH` levels, counted before it is parsed: `json_depth`), and never
raises on what a policy writes.

**Which format** (`call_format_for`): ``data.tool_format`` names one, or (``chat`` / ``auto``) the template
decides: an assistant turn calling a probe tool is rendered by the template itself, and the format whose
parser reads that call back is the one (the text the model was trained to write); only where the template
cannot render such a turn at all do markers in its text decide (`format_by_markers`). A template that
renders a call no format reads is refused at set-up, in one line (``data.tool_format=inline`` is the way
out), never left to end every episode silently.

**Typed arguments** (`cast_arguments`, the one home of it, for every format): each argument is cast to the
type the tool's JSON schema gives it (``cispo.envs.tools.tool_schema``): text ``"2"`` to 2 for an integer,
``"2.5"`` to 2.5 for a number, ``"true"`` / ``"false"`` for a boolean, JSON text for an array or an object;
a number or a boolean given for a string is its JSON text. A value that does not cast, a missing required
argument or an unknown one is an error message naming the argument: the policy is shown it and the tool is
not called.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from cispo.envs.tool_calls import (
    MAX_CALL_DEPTH,
    NOT_A_CALL,
    call_of,
    json_depth,
    parse_tool_calls,
    read_json,
    tool_call_blocks,
)
from cispo.envs.tools import ToolCall, ToolSpecError

PYTHON_TAG = "<|python_tag|>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
PROBE_NAME = "cispo_probe_tool"
"""The tool a probe of the chat template calls (`call_format_for`, ``tool_env.template_takes_tools``)."""
_LLAMA_CALL = re.compile(r'\{\s*"name"\s*:')
_XML_NAME = re.compile(r"[^\s<>=/]+")
_DECODER = json.JSONDecoder()
_TOO_DEEP = f"it nests deeper than {MAX_CALL_DEPTH} levels of [ and {{"


@dataclass(frozen=True)
class CallFormat:
    """One way of writing tool calls: its name (a value of ``data.tool_format``), its parser (module
    docstring) and its syntax in one line, for messages."""

    name: str
    parse: Callable[[str], list]
    syntax: str


# ---------------------------------------------------------------------------------------
# The parsers
# ---------------------------------------------------------------------------------------


def _decoded(text: str, start: int):
    """``(value, end)`` of the JSON value at ``text[start]`` (white space skipped first), the rest left
    unread; ValueError where there is none. The caller bounds the depth first (`json_depth`)."""
    while start < len(text) and text[start] in " \t\r\n":
        start += 1
    try:
        return _DECODER.raw_decode(text, start)
    except (RecursionError, MemoryError):
        raise ValueError("it nests too deeply to read") from None


def parse_llama3_json(text: str) -> list[ToolCall | str]:
    """The Llama 3.1 calls of an assistant turn (module docstring): JSON objects from its start on, after an
    optional ``<|python_tag|>``, separated by ``;`` or white space; the first that is not a call is an
    error message and ends the reading. [] where the turn does not start with ``{"name":`` or the tag."""
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    body = body[len(PYTHON_TAG):].lstrip() if tagged else body
    if not tagged and not _LLAMA_CALL.match(body):
        return []
    if not body.startswith("{"):
        return [f'{NOT_A_CALL}: expected {{"name": ..., "parameters": {{...}}}} after {PYTHON_TAG}']
    if json_depth(body) > MAX_CALL_DEPTH:
        return [f"{NOT_A_CALL}: {_TOO_DEEP}"]
    out: list[ToolCall | str] = []
    i = 0
    while i < len(body) and body[i] == "{":
        try:
            value, i = _decoded(body, i)
            out.append(call_of(value))
        except ValueError as e:
            out.append(f"{NOT_A_CALL}: {e}")
            break
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return out


def parse_qwen_xml(text: str) -> list[ToolCall | str]:
    """The Qwen3-Coder / Qwen3.5 calls in ``text`` (module docstring): per ``<tool_call>`` block, its
    ``<function=NAME>`` with each ``<parameter=P>`` as text (one newline after the tag and one before its
    closing dropped, as the template writes them), or the error message of a block that is no such call."""
    out: list[ToolCall | str] = []
    for block in tool_call_blocks(text):
        try:
            out.append(_xml_call(block))
        except ValueError as e:
            out.append(f"the tool call is not <function=NAME><parameter=P>value</parameter></function>: {e}")
    return out


def _xml_call(block: str) -> ToolCall:
    start = block.find(FUNCTION_OPEN)
    close = block.find(">", start) if start >= 0 else -1
    if close < 0:
        raise ValueError("it has no <function=NAME>")
    name = block[start + len(FUNCTION_OPEN): close].strip()
    if not _XML_NAME.fullmatch(name):
        raise ValueError(f"the function's name {name[:40]!r} is no name")
    end = block.find(FUNCTION_CLOSE, close)
    body = block[close + 1: end if end >= 0 else len(block)]
    arguments: dict[str, str] = {}
    i = 0
    while (p := body.find(PARAMETER_OPEN, i)) >= 0:
        q = body.find(">", p)
        key = body[p + len(PARAMETER_OPEN): q].strip() if q >= 0 else ""
        if not _XML_NAME.fullmatch(key):
            raise ValueError(f"a parameter's name {key[:40]!r} is no name")
        r = body.find(PARAMETER_CLOSE, q)
        if r < 0:
            raise ValueError(f"the parameter {key!r} has no {PARAMETER_CLOSE}")
        if key in arguments:
            raise ValueError(f"the parameter {key!r} is given twice")
        value = body[q + 1: r]
        value = value[1:] if value.startswith("\n") else value
        arguments[key] = value[:-1] if value.endswith("\n") else value
        i = r + len(PARAMETER_CLOSE)
    return ToolCall(name, arguments)


def parse_mistral(text: str) -> list[ToolCall | str]:
    """The Mistral calls in ``text`` (module docstring): after each ``[TOOL_CALLS]``, a JSON list of calls or
    one ``NAME[ARGS]{...}``; what follows a call's JSON is not read. [] without ``[TOOL_CALLS]``."""
    out: list[ToolCall | str] = []
    for part in text.split(TOOL_CALLS)[1:]:
        body = part.lstrip()
        if body.startswith("["):
            out.extend(_mistral_list(body))
        elif body:
            out.append(_mistral_named(body))
    return out


def _mistral_list(body: str) -> list[ToolCall | str]:
    if json_depth(body) > MAX_CALL_DEPTH + 1:  # the list around the calls is not counted
        return [f"{NOT_A_CALL}: {_TOO_DEEP}"]
    try:
        calls, _ = _decoded(body, 0)
    except ValueError as e:
        return [f"{NOT_A_CALL}: {e}"]
    if not isinstance(calls, list):
        return [f"{NOT_A_CALL}: expected a list of calls after {TOOL_CALLS}"]
    out: list[ToolCall | str] = []
    for value in calls:
        try:
            out.append(call_of(value))
        except ValueError as e:
            out.append(f"{NOT_A_CALL}: {e}")
    return out


def _mistral_named(body: str) -> ToolCall | str:
    at = body.find(ARGS)
    if at < 0:
        return f"{NOT_A_CALL}: expected NAME{ARGS}{{...}} or a JSON list after {TOOL_CALLS}"
    name = body[:at].split(CALL_ID, 1)[0].strip()
    if json_depth(body[at:]) > MAX_CALL_DEPTH - 1:  # the arguments: one level below the call
        return f"{NOT_A_CALL}: {_TOO_DEEP}"
    try:
        arguments, _ = _decoded(body, at + len(ARGS))
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments of {name[:40]!r} must be a JSON object")
        return call_of({"name": name, "arguments": arguments}) if name else f"{NOT_A_CALL}: the call has no name"
    except ValueError as e:
        return f"{NOT_A_CALL}: {e}"


HERMES = CallFormat("hermes", parse_tool_calls, '<tool_call>{"name": ..., "arguments": {...}}</tool_call>')
LLAMA3_JSON = CallFormat("llama3_json", parse_llama3_json, '{"name": ..., "parameters": {...}} as the whole turn')
QWEN_XML = CallFormat("qwen_xml", parse_qwen_xml,
                      "<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>")
MISTRAL = CallFormat("mistral", parse_mistral, '[TOOL_CALLS][{"name": ..., "arguments": {...}}] or '
                                               "[TOOL_CALLS]NAME[ARGS]{...}")
CALL_FORMATS = {f.name: f for f in (QWEN_XML, HERMES, MISTRAL, LLAMA3_JSON)}
"""The formats by name, in the order a rendered call is tried against them (`call_format_for`)."""


def text_before_calls(fmt: CallFormat, text: str) -> str:
    """What a turn says before its first call in ``fmt`` (its free text: an assistant message's ``content``
    beside its ``tool_calls``), stripped; the whole text stripped where no call's opening is found."""
    if fmt.name == "llama3_json":
        found = _LLAMA_CALL.search(text)
        at = found.start() if found else -1
    else:
        at = text.find(TOOL_CALLS if fmt.name == "mistral" else "<tool_call>")
    return (text if at < 0 else text[:at]).strip()


# ---------------------------------------------------------------------------------------
# Which format: the template's own rendering of a call
# ---------------------------------------------------------------------------------------


def call_id(index: int) -> str:
    """The id of the ``index``-th call of a turn as the template is given it: 9 letters and digits (Mistral's
    templates refuse any other; the others ignore it or show it)."""
    return f"call{index:05d}"


def assistant_message(content: str, calls: list[dict]) -> dict:
    """An assistant message making ``calls`` (each ``{"name", "arguments"}``), in the OpenAI form templates read."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "id": call_id(i), "function": c} for i, c in enumerate(calls)]
    return message


def tool_message(name: str, content: str, index: int = 0) -> dict:
    """The tool turn answering the ``index``-th call of the assistant turn before it."""
    return {"role": "tool", "name": name, "content": content, "tool_call_id": call_id(index)}


def rendered_calls(tokenizer) -> list[str]:
    """The text the chat template writes for an assistant turn calling `PROBE_NAME` with ``{"x": 1}`` (the
    arguments as an object, then as a JSON string, for templates that print them as given): what the
    rendering of the conversation adds past the rendering of its user turn with the generation prompt.
    [] where the template renders neither."""
    user = [{"role": "user", "content": "cispo probe"}]
    out = []
    for arguments in ({"x": 1}, '{"x": 1}'):
        try:
            opening = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            whole = tokenizer.apply_chat_template(
                [*user, assistant_message("", [{"name": PROBE_NAME, "arguments": arguments}])], tokenize=False)
        except Exception:  # noqa: BLE001 - a template that cannot render a call, for whatever reason
            continue
        out.append(whole[len(os.path.commonprefix([opening, whole])):])
    return out


def reads_probe(calls: list) -> bool:
    """Whether ``calls`` (a parser's) hold the probe call of `rendered_calls`."""
    return any(isinstance(c, ToolCall) and c.name == PROBE_NAME and isinstance(c.arguments, dict)
               and str(c.arguments.get("x")).strip() == "1" for c in calls)


def format_by_markers(template: str) -> CallFormat | None:
    """The format a chat template's text names (where it cannot render a call to try): ``<function=``
    (qwen_xml), ``<tool_call>`` (hermes), ``[TOOL_CALLS]`` (mistral), ``<|python_tag|>`` or ``"parameters"``
    beside ``ipython`` (llama3_json); None for none of them."""
    if FUNCTION_OPEN in template:
        return QWEN_XML
    if "<tool_call>" in template:
        return HERMES
    if TOOL_CALLS in template:
        return MISTRAL
    if PYTHON_TAG in template or '"parameters"' in template and "ipython" in template:
        return LLAMA3_JSON
    return None


def call_format_for(tokenizer, tool_format: str = "chat") -> CallFormat:
    """The `CallFormat` of a chat template that takes tools: the one ``tool_format`` names, else (``chat``,
    ``auto``) the first of `CALL_FORMATS` whose parser reads back the template's own rendering of a call
    (`rendered_calls`), else, where the template renders no call at all, the one its text names
    (`format_by_markers`). ToolSpecError, in one line showing the call as the template writes it, where
    none reads it: the run would find no call in any turn."""
    if tool_format in CALL_FORMATS:
        return CALL_FORMATS[tool_format]
    rendered = rendered_calls(tokenizer)
    for text in rendered:
        for fmt in CALL_FORMATS.values():
            if reads_probe(fmt.parse(text)):
                return fmt
    template = getattr(tokenizer, "chat_template", None)
    found = None if rendered else format_by_markers(template if isinstance(template, str) else str(template))
    if found is None:
        shown = f"it writes a call as {rendered[0][:100]!r}" if rendered else "it cannot render a call"
        raise ToolSpecError(f"data.tool_format={tool_format}: the chat template renders tools, but cispo reads its "
                            f"tool calls in no format it knows ({shown}): use data.tool_format=inline, or name the "
                            f"format the model writes ({', '.join(CALL_FORMATS)})")
    return found


# ---------------------------------------------------------------------------------------
# Typed arguments
# ---------------------------------------------------------------------------------------

_TYPE_NAMES = {"integer": "an integer", "number": "a number", "boolean": "true or false", "string": "a string",
               "array": "a JSON array", "object": "a JSON object", "null": "null"}
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_NO = object()


def cast_arguments(call: ToolCall, parameters: dict | None) -> ToolCall | str:
    """``call`` with each argument cast to its type in ``parameters`` (the tool's JSON schema's
    ``"parameters"``: `cast_value`), or the error message naming the argument that does not cast, the first
    required one missing or the first one the tool does not take. ``call`` as it is where there is no schema
    (a tool no one declared: the runner refuses its name) or its arguments are no object (refused there)."""
    if not isinstance(parameters, dict) or not isinstance(call.arguments, dict):
        return call
    properties = parameters.get("properties") or {}
    if not parameters.get("additionalProperties"):
        unknown = next((k for k in call.arguments if k not in properties), None)
        if unknown is not None:
            return (f"{call.name!r} takes no argument {str(unknown)[:40]!r}; its arguments: "
                    f"{', '.join(properties) or 'none'}")
    missing = next((k for k in parameters.get("required") or () if k not in call.arguments), None)
    if missing is not None:
        return f"the call of {call.name!r} lacks the required argument {missing!r}"
    typed = {}
    for key, value in call.arguments.items():
        try:
            typed[key] = cast_value(value, properties.get(key) or {})
        except ValueError as e:
            return f"the argument {key!r} of {call.name!r} must be {e}, got {_shown(value)}"
    return ToolCall(call.name, typed)


def cast_value(value, schema: dict):
    """``value`` as the JSON schema ``schema`` types it (module docstring): as it is where it has one of the
    schema's types (an integral float for an integer: the int), else cast from its text; a list's items and an
    object's declared properties too, each by its own schema. ValueError, its message what was expected,
    where it does not cast or is not one of the schema's ``enum``."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else [t for t in types or () if isinstance(t, str)]
    types += ["null"] if schema.get("nullable") else []
    if types:
        value = _as_type(value, types)
    enum = schema.get("enum")
    if isinstance(enum, list) and value not in enum:
        raise ValueError(f"one of {', '.join(json.dumps(v) for v in enum)[:120]}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [cast_value(v, schema["items"]) for v in value]
    properties = schema.get("properties")
    if isinstance(value, dict) and isinstance(properties, dict):
        value = {k: cast_value(v, properties[k]) if isinstance(properties.get(k), dict) else v
                 for k, v in value.items()}
    return value


def _as_type(value, types: list[str]):
    for t in types:
        if _has_type(value, t):
            return int(value) if t == "integer" and isinstance(value, float) else value
    if isinstance(value, str):
        for t in types:
            if (cast := _from_text(value.strip(), t)) is not _NO:
                return cast
    if "string" in types and isinstance(value, (bool, int, float)):
        return json.dumps(value)
    raise ValueError(" or ".join(_TYPE_NAMES.get(t, t) for t in types))


def _has_type(value, t: str) -> bool:
    if t == "integer":
        return type(value) is int or type(value) is float and value.is_integer()
    if t == "number":
        return type(value) in (int, float)
    return {"boolean": bool, "string": str, "array": list, "object": dict, "null": type(None)}.get(t) is type(value)


def _from_text(text: str, t: str):
    """``text`` read as type ``t``, or `_NO`."""
    if t == "integer" and _INTEGER.fullmatch(text) and len(text) <= 4000:
        return int(text)
    if t == "number" and _NUMBER.fullmatch(text) and len(text) <= 400:
        number = int(text) if _INTEGER.fullmatch(text) else float(text)
        return number if math.isfinite(number) else _NO
    if t == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if t == "null" and text.lower() in ("null", "none"):
        return None
    if t in ("array", "object") and text[:1] == ("[" if t == "array" else "{"):
        try:
            value = read_json(text, depth=3)  # a parameter's value: two levels below the call's object
        except ValueError:
            return _NO
        return value if _has_type(value, t) else _NO
    return _NO


def _shown(value) -> str:
    """A short, one-line rendering of a value the policy gave."""
    text = value if isinstance(value, str) else json.dumps(value)
    return repr(text[:40] + ("..." if len(text) > 40 else ""))
