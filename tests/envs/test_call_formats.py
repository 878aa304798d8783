"""The tool-call formats chat templates teach (cispo.envs.call_formats), through real templates (tests/envs/templates/:
Llama 3.1, Qwen3.5, Mistral v0.3; Qwen2.5's from test_environments.py) on SmolLM2's tokenizer (offline), each
template's special tokens added so that its stop token is one id, as in the model's own tokenizer:

* the format is the one the template itself writes (its rendering of a call read back), or the one named;
  a template whose calls no format reads is refused at set-up in one line;
* a Llama 3.1 call and a Qwen3.5 XML call run through `ToolEnvironment` with their arguments typed from the
  tool's schema ("2" + "3" -> 5), the observation the template's own rendering of the tool turn;
* an argument that does not cast (or is missing, or unknown) is an error observation naming it, the tool not called;
* every parser is bounded in depth and linear in length, and never raises on a policy's text."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cispo.config.data import DataConfig
from cispo.envs.call_formats import (
    CALL_FORMATS,
    call_format_for,
    cast_arguments,
    cast_value,
    parse_llama3_json,
    parse_mistral,
    parse_qwen_xml,
)
from cispo.envs.tool_calls import MAX_CALL_DEPTH
from cispo.envs.tool_env import ToolEnvironment, check_tools, resolve_tool_format
from cispo.envs.tools import ToolCall, ToolSpecError, calculator, tool_schema
from tests.envs.test_environments import QWEN_TOOL_TEMPLATE, TOKENIZER_DIR, CountingRunner, add, ids
from tests.envs.test_tool_boundaries import nested, with_stack_left

TEMPLATES = Path(__file__).resolve().parent / "templates"
SPECIAL_TOKENS = {
    "llama3_1": ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"],
    "qwen3_5_nothink": [],  # ChatML: SmolLM2's own <|im_start|> / <|im_end|>
    "mistral_v3": ["[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]",
                   "[/AVAILABLE_TOOLS]"],
}


def templated(name: str):
    """SmolLM2's tokenizer with the chat template ``name`` (a file of tests/envs/templates/, or ``qwen2_5``) and
    that template's special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    if name == "qwen2_5":
        tok.chat_template = QWEN_TOOL_TEMPLATE
        return tok
    if SPECIAL_TOKENS[name]:
        tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[name]})
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


@pytest.fixture(scope="module")
def llama():
    return templated("llama3_1")


@pytest.fixture(scope="module")
def qwen35():
    return templated("qwen3_5_nothink")


@pytest.fixture(scope="module")
def mistral():
    return templated("mistral_v3")


def env_for(tok, tools=(add, calculator), tool_format="auto") -> ToolEnvironment:
    return ToolEnvironment(tok, list(tools), tool_format, 3, CountingRunner(list(tools)))


def whole_conversation(tok, env, calls: list[dict], results: list[str]) -> str:
    """The template's rendering of: the prompt, an assistant turn making ``calls``, their results, the next
    assistant turn opened (ids as Mistral's template requires them)."""
    made = [{"type": "function", "id": f"call{i:05d}", "function": c} for i, c in enumerate(calls)]
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "", "tool_calls": made},
                *({"role": "tool", "name": c["name"], "content": r, "tool_call_id": f"call{i:05d}"}
                  for i, (c, r) in enumerate(zip(calls, results)))]
    return tok.apply_chat_template(messages, tools=env.schemas, tokenize=False, add_generation_prompt=True)


# --------------------------------------------------------------------------- which format


@pytest.mark.parametrize("template, name", [("llama3_1", "llama3_json"), ("qwen3_5_nothink", "qwen_xml"),
                                            ("mistral_v3", "mistral"), ("qwen2_5", "hermes")])
def test_the_format_is_the_one_the_template_writes(template, name):
    tok = templated(template)
    assert call_format_for(tok, "chat").name == name and call_format_for(tok, "auto").name == name
    assert resolve_tool_format(tok, "auto") == "chat" and resolve_tool_format(tok, name) == "chat"
    env = env_for(tok)
    assert env.tool_format == "chat" and env.call_format.name == name
    assert env_for(tok, tool_format="hermes").call_format.name == "hermes"  # a name forces its format


UNKNOWN_CALLS_TEMPLATE = (  # renders tools and tool turns, but writes a call as <|tool_call>call:NAME{...}<tool_call|>
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' }}{%- for t in tools %}{{- t.function.name + ' ' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- for c in m.tool_calls %}{{- '<|tool_call>call:' + c.function.name + (c.function.arguments | tojson) + "
    "'<tool_call|>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_whose_calls_no_format_reads_is_refused_at_set_up_in_one_line():
    """Was: the template took tools, so the chat format was chosen, and no Hermes call was ever found in what the
    model writes: every episode ended after its first turn, silently."""
    tok = templated("qwen2_5")
    tok.chat_template = UNKNOWN_CALLS_TEMPLATE
    for attempt in (lambda: resolve_tool_format(tok, "auto"), lambda: env_for(tok),
                    lambda: check_tools(DataConfig(tools=["calculator"], tool_format="chat"), tok)):
        with pytest.raises(ToolSpecError) as e:
            attempt()
        message = str(e.value)
        assert "\n" not in message and "use data.tool_format=inline" in message
        assert "the chat template renders tools, but cispo reads its tool calls in no format it knows" in message
        assert "<|tool_call>call:cispo_probe_tool" in message  # the template's problem, shown
    assert resolve_tool_format(tok, "inline") == "inline"  # the way out
    assert env_for(tok, tool_format="hermes").call_format.name == "hermes"  # or a format named by hand


def test_the_config_takes_a_formats_name():
    from cispo.config.train import TrainConfig, apply_overrides

    for name in CALL_FORMATS:
        assert apply_overrides(TrainConfig(), [f"data.tool_format={name}"]).data.tool_format == name
    tools = check_tools(DataConfig(tools=["calculator"], tool_format="qwen_xml"))  # no tokenizer: the schemas checked
    assert [t.name for t in tools] == ["calculator"]


# --------------------------------------------------------------------------- Llama 3.1


def test_a_llama_call_is_parsed_and_run_with_typed_arguments(llama):
    """Was: the Llama call ({"name": ..., "parameters": ...} as the whole turn) was no Hermes call: no call found,
    the episode ended; and "2" + "3" would have made "23"."""
    env = env_for(llama)
    sample = {"prompt": "What is 2 + 3?"}
    episodes = env.start([sample])
    segment = ids(llama, '{"name": "add", "parameters": {"a": "2", "b": "3"}}<|eot_id|>')
    assert segment[-1] == llama.convert_tokens_to_ids("<|eot_id|>")
    obs = episodes.respond([0], [segment], [True])[0]
    # the real template renders a tool turn (role "tool") as an ipython turn, its content as JSON ("5", quoted)
    assert llama.decode(obs) == ('<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
                                 "<|start_header_id|>assistant<|end_header_id|>\n\n")
    as_written = {"name": "add", "arguments": {"a": "2", "b": "3"}}  # the policy's text: the arguments as it wrote them
    whole = whole_conversation(llama, env, [as_written], ["5"])
    assert llama.decode(env.render_prompt(sample) + segment + obs) == whole
    record = episodes.record(0)
    assert record["calls"][0]["arguments"] == {"a": 2, "b": 3} and record["tool_errors"] == 0
    assert episodes.respond([0], [ids(llama, "It is 5.<|eot_id|>")], [True]) == [None]  # no call: the end


def test_llama_calls_after_the_python_tag_and_several_in_one_turn(llama):
    """Llama's template takes one call per turn (it raises on more): the tool turns of several calls are
    rendered after the first, one ipython turn each."""
    env = env_for(llama)
    segment = ids(llama, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 1}}; '
                         '{"name": "calculator", "arguments": {"expression": "2**5"}}<|eot_id|>')
    obs = llama.decode(env.start([{"prompt": "q"}]).respond([0], [segment], [True])[0])
    assert obs == ('<|start_header_id|>ipython<|end_header_id|>\n\n"2"<|eot_id|>'
                   '<|start_header_id|>ipython<|end_header_id|>\n\n"32"<|eot_id|>'
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("text, calls", [
    ('{"name": "add", "parameters": {"a": 2, "b": 3}}', [ToolCall("add", {"a": 2, "b": 3})]),
    (' {"name": "f", "arguments": {}}\n{"name": "g", "parameters": "{\\"x\\": 1}"}',
     [ToolCall("f", {}), ToolCall("g", {"x": 1})]),
    ("<|python_tag|>{\"name\": \"f\"}", [ToolCall("f", {})]),
    ("The answer is 5.", []),
    ('I will call {"name": "f", "parameters": {}}', []),  # a call is the whole turn, as the template teaches
    ('{"answer": 5}', []),
])
def test_llama_calls_are_read_from_the_turns_start(text, calls):
    assert parse_llama3_json(text) == calls


@pytest.mark.parametrize("text", ['{"name": "f", "parameters": {"a": 1}', "<|python_tag|>brave_search.call(q='x')",
                                  '{"name": 5}', '{"name": "f"}; {"name": '])
def test_an_unreadable_llama_call_is_an_error_message(text):
    out = parse_llama3_json(text)
    assert isinstance(out[-1], str) and out[-1].startswith("the tool call is not valid JSON of a call")


# --------------------------------------------------------------------------- Qwen3.5 / Qwen3-Coder XML


XML_ADD = ("<tool_call>\n<function=add>\n<parameter=a>\n{a}\n</parameter>\n<parameter=b>\n{b}\n</parameter>\n"
           "</function>\n</tool_call>")


def test_a_qwen_xml_call_is_parsed_and_run_with_typed_arguments(qwen35):
    """Was: the XML call was read as Hermes JSON, so every call was an error observation."""
    env = env_for(qwen35)
    sample = {"prompt": "What is 2 + 3?"}
    episodes = env.start([sample])
    segment = ids(qwen35, XML_ADD.format(a=2, b=3) + "<|im_end|>")
    obs = episodes.respond([0], [segment], [True])[0]
    assert qwen35.decode(obs) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                  "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    call = {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert qwen35.decode(env.render_prompt(sample) + segment + obs) == whole_conversation(qwen35, env, [call], ["5"])
    assert episodes.record(0)["calls"][0]["arguments"] == {"a": 2, "b": 3}


def test_qwen_xml_values_are_text_until_cast():
    text = ("Let me.\n<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\n\nprint(2)\n</parameter>\n"
            "</function>\n</tool_call>\n"
            "<tool_call><function=f><parameter=items>[1, 2]</parameter></function></tool_call>"
            "<tool_call><function=f><parameter=a>1</parameter><parameter=a>2</parameter></function></tool_call>"
            "<tool_call>{\"name\": \"f\"}</tool_call><tool_call><function=f><parameter=a>1</function></tool_call>")
    calls = parse_qwen_xml(text)
    assert calls[:2] == [ToolCall("python", {"code": "print(1)\n\nprint(2)"}), ToolCall("f", {"items": "[1, 2]"})]
    assert "the parameter 'a' is given twice" in calls[2]
    assert "it has no <function=NAME>" in calls[3] and "the parameter 'a' has no </parameter>" in calls[4]
    assert parse_qwen_xml("no call") == []


# --------------------------------------------------------------------------- Mistral


def test_mistral_calls_are_parsed():
    listed = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "abcdefghi"}, {"name": "f"}]</s>'
    assert parse_mistral(listed) == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("f", {})]
    assert parse_mistral('Sure. [TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS] {}</s>') \
        == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("f", {})]
    bad = parse_mistral('[TOOL_CALLS]add{"a": 1}[TOOL_CALLS][ARGS]{}[TOOL_CALLS]f[ARGS][1][TOOL_CALLS] [{"a": 1}]')
    assert len(bad) == 4 and all(isinstance(b, str) for b in bad)
    assert parse_mistral("The answer is 5.") == []


def test_a_mistral_call_runs_through_mistrals_template(mistral):
    env = env_for(mistral)
    sample = {"prompt": "What is 2 + 3?"}
    episodes = env.start([sample])
    segment = ids(mistral, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": "2", "b": 3}}]<|im_end|>')
    obs = episodes.respond([0], [segment], [True])[0]
    assert mistral.decode(obs) == '[TOOL_RESULTS] {"content": 5, "call_id": "call00000"}[/TOOL_RESULTS]'
    assert episodes.record(0)["calls"][0]["arguments"] == {"a": 2, "b": 3}


# --------------------------------------------------------------------------- typed arguments


ADD = tool_schema(add)["function"]["parameters"]


@pytest.mark.parametrize("arguments, message", [
    ({"a": "two", "b": "3"}, "the argument 'a' of 'add' must be an integer, got 'two'"),
    ({"a": "2.5", "b": 3}, "the argument 'a' of 'add' must be an integer, got '2.5'"),
    ({"a": 2}, "the call of 'add' lacks the required argument 'b'"),
    ({"a": 2, "b": 3, "c": 4}, "'add' takes no argument 'c'; its arguments: a, b"),
])
def test_an_argument_that_does_not_cast_is_an_error_observation_naming_it(qwen35, arguments, message):
    assert cast_arguments(ToolCall("add", arguments), ADD) == message
    env = env_for(qwen35)
    episodes = env.start([{"prompt": "q"}])
    xml = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    segment = ids(qwen35, f"<tool_call>\n<function=add>\n{xml}</function>\n</tool_call><|im_end|>")
    obs = qwen35.decode(episodes.respond([0], [segment], [True])[0])
    assert f"<tool_response>\nerror: {message}\n</tool_response>" in obs
    assert env.runner.batches == [[]]  # the tool was not called
    record = episodes.record(0)
    assert (record["tool_errors"], record["calls"][0]["name"], record["calls"][0]["arguments"]) == (1, "add", None)


@pytest.mark.parametrize("value, schema, typed", [
    ("2", {"type": "integer"}, 2), (" -7 ", {"type": "integer"}, -7), (2.0, {"type": "integer"}, 2),
    ("2.5", {"type": "number"}, 2.5), ("2", {"type": "number"}, 2), (3, {"type": "number"}, 3),
    ("true", {"type": "boolean"}, True), ("False", {"type": "boolean"}, False),
    ("[1, 2]", {"type": "array", "items": {"type": "integer"}}, [1, 2]),
    (["1", "2"], {"type": "array", "items": {"type": "integer"}}, [1, 2]),
    ('{"k": "v"}', {"type": "object"}, {"k": "v"}),
    (5, {"type": "string"}, "5"), (True, {"type": "string"}, "true"), ("2", {"type": "string"}, "2"),
    ("2", {"type": ["integer", "string"]}, "2"), ("null", {"type": "integer", "nullable": True}, None),
    ("b", {"type": "string", "enum": ["a", "b"]}, "b"), ({"x": [1]}, {}, {"x": [1]}),
])
def test_values_are_cast_to_the_schemas_type(value, schema, typed):
    out = cast_value(value, schema)
    assert out == typed and type(out) is type(typed)


@pytest.mark.parametrize("value, schema, expected", [
    ("2.5", {"type": "integer"}, "an integer"), ("nan", {"type": "number"}, "a number"),
    ("1e999", {"type": "number"}, "a number"), ("yes", {"type": "boolean"}, "true or false"),
    ("[1,", {"type": "array"}, "a JSON array"), ("[1]", {"type": "object"}, "a JSON object"),
    ([1], {"type": "string"}, "a string"), ("c", {"type": "string", "enum": ["a", "b"]}, 'one of "a", "b"'),
    ("9" * 5000, {"type": "integer"}, "an integer"), (nested(1000), {"type": "array"}, "a JSON array"),
])
def test_a_value_that_does_not_cast_says_what_was_expected(value, schema, expected):
    with pytest.raises(ValueError) as e:
        with_stack_left(120, cast_value, value, schema)
    assert str(e.value) == expected


def test_a_hermes_call_is_typed_too():
    """Was: {"a": "2", "b": "3"} reached add as text and the policy was shown "23"."""
    tok = templated("qwen2_5")
    env = env_for(tok)
    segment = ids(tok, '<tool_call>{"name": "add", "arguments": {"a": "2", "b": "3"}}</tool_call><|im_end|>')
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(env.start([{"prompt": "q"}]).respond([0], [segment],
                                                                                                      [True])[0])


# --------------------------------------------------------------------------- bounds


def call_text(fmt: str, inner: str) -> str:
    """A call of ``f`` whose argument ``x`` is ``inner`` (JSON text), in format ``fmt``."""
    return {"hermes": '<tool_call>{"name": "f", "arguments": {"x": ' + inner + "}}</tool_call>",
            "llama3_json": '{"name": "f", "parameters": {"x": ' + inner + "}}",
            "qwen_xml": f"<tool_call><function=f><parameter=x>{inner}</parameter></function></tool_call>",
            "mistral": '[TOOL_CALLS] [{"name": "f", "arguments": {"x": ' + inner + "}}]",
            "mistral_args": '[TOOL_CALLS]f[ARGS]{"x": ' + inner + "}"}[fmt]


def read_x(fmt: str, inner: str):
    """The argument ``x`` as read (and, for XML's text, cast to an array), or the error message."""
    parse = CALL_FORMATS["mistral" if fmt == "mistral_args" else fmt].parse
    (call,) = with_stack_left(120, parse, call_text(fmt, inner))
    if isinstance(call, str):
        return call
    typed = cast_arguments(call, {"type": "object", "properties": {"x": {"type": "array"}}})
    return typed if isinstance(typed, str) else typed.arguments["x"]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "qwen_xml", "mistral", "mistral_args"])
def test_each_format_reads_a_call_at_the_depth_limit_and_not_one_past_it(fmt):
    """The call's own object counted, as for Hermes calls (MAX_CALL_DEPTH): an argument nested to depth
    MAX_CALL_DEPTH - 2 is read, one deeper is an error message, and 1000 deep never a RecursionError."""
    assert read_x(fmt, nested(MAX_CALL_DEPTH - 2)) == json.loads(nested(MAX_CALL_DEPTH - 2))
    for depth in (MAX_CALL_DEPTH - 1, 1000):
        out = read_x(fmt, nested(depth))
        assert isinstance(out, str) and ("nests deeper than" in out or "must be a JSON array" in out)


@pytest.mark.parametrize("parse, text", [
    (parse_llama3_json, "{" * 1000), (parse_llama3_json, "<|python_tag|>" + "[" * 1000),
    (parse_llama3_json, '{"name": "f"};' * 20000), (parse_mistral, "[TOOL_CALLS]" * 50000),
    (parse_mistral, "[TOOL_CALLS][" + "[" * 100000), (parse_mistral, "[TOOL_CALLS]f[ARGS]{" * 20000),
    (parse_qwen_xml, "<tool_call><function=f>" + "<parameter=" * 50000 + "</tool_call>"),
    (parse_qwen_xml, ("<tool_call><function=f>" + "<parameter=a>1</parameter>" * 20000 + "</tool_call>")),
    (parse_qwen_xml, "<tool_call>" * 50000 + "</tool_call>"),
])
def test_no_parser_raises_or_slows_down_on_hostile_text(parse, text):
    started = time.perf_counter()
    out = with_stack_left(120, parse, text)
    assert time.perf_counter() - started < 5  # linear: a few hundred thousand characters in well under a second
    assert all(isinstance(c, (ToolCall, str)) for c in out)
