"""What a policy's text and a tool's return value can reach: nothing past the episode.

* A chat tool call nested ~1000 brackets deep (in its text, or a well-formed call whose argument is a list
  1000 deep) is an error observation, never a RecursionError that ends the run; nor does any other parser
  of policy text (the calculator, the word-problem verifiers, exact / math answer extraction) raise on deep
  nesting, even with little stack left.
* A tool's result crosses back to the trainer as plain text made in its worker: a ``str`` subclass whose
  ``__reduce__`` would run code in the trainer is copied without it, a raising ``__str__`` is one failed
  call, and nothing a worker sends is unpickled.
* A tool of the user's named ``calc`` beside the built-in calculator (both the inline tag ``<calc>``) is
  refused in one line naming both, instead of silently hiding the calculator."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from cispo.data.rewards import Outcome, exact
from cispo.data.rewards import math as math_rewards
from cispo.data.rewards.pool import from_wire, shutdown_pools, to_wire
from cispo.data.tasks import wordmath, wordmath_calc
from cispo.envs.tool_env import (
    MAX_CALL_DEPTH,
    ToolEnvironment,
    build_environment,
    inline_tags,
    json_depth,
    parse_tool_calls,
)
from cispo.envs.tools import ToolCall, ToolRunner, ToolSpecError, as_tool, calculator, load_tools


def depth(value) -> int:
    """How deep a list nests, counted without recursion."""
    n = 0
    while isinstance(value, list):
        value, n = (value[0] if value else None), n + 1
    return n


def nested(n: int) -> str:
    return "[" * n + "]" * n


def measure(items: list) -> str:
    """Say how deep a list nests.

    Args:
        items: A list, maybe of lists.
    """
    return str(depth(items))


def with_stack_left(frames: int, fn, *args):
    """``fn(*args)`` with only about ``frames`` Python frames of stack left (the recursion limit lowered), as
    where a parser is called deep inside a run."""
    used = 0
    frame = sys._getframe()
    while frame is not None:
        used, frame = used + 1, frame.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(used + frames)
    try:
        return fn(*args)
    finally:
        sys.setrecursionlimit(limit)


# --------------------------------------------------------------------------- deep nesting in policy text


def test_json_depth_counts_brackets_outside_strings():
    assert json_depth('{"a": "[[[{{", "b": [1, {"c": "\\"["}]}') == 3
    assert json_depth(nested(5)) == 5 and json_depth("[" * 1000) == 1000 and json_depth("]]]") == 0


@pytest.mark.parametrize("block", [
    "[" * 1000,                                                               # the call's text itself
    '{"name": "measure", "arguments": {"items": ' + nested(1000) + "}}",      # a well-formed call, 1000 deep
    '{"name": "measure", "arguments": {"items": ' + nested(950) + "}}",       # one json.loads still reads
    '{"name": "measure", "arguments": "{\\"items\\": ' + nested(1000) + '}"}',  # arguments given as a string
])
def test_a_deeply_nested_chat_call_is_an_error_observation(qwen, block):
    env = ToolEnvironment(qwen, [measure], "chat", 2, ToolRunner([measure], isolation="main"))
    episodes = env.start([{"prompt": "q"}])
    segment = qwen.encode(f"<tool_call>{block}</tool_call><|im_end|>", add_special_tokens=False)
    obs = episodes.respond([0], [segment], [True])[0]
    assert f"error: the tool call is not valid JSON of a call: it nests deeper than {MAX_CALL_DEPTH}" in \
        qwen.decode(obs)
    record = episodes.record(0)
    assert record["tool_errors"] == 1 and record["calls"][0]["arguments"] is None
    json.dumps(record)  # samples.jsonl can write it
    ok = qwen.encode('<tool_call>{"name": "measure", "arguments": {"items": ' + nested(MAX_CALL_DEPTH - 2) +
                     "}}</tool_call><|im_end|>", add_special_tokens=False)
    assert f"\n{MAX_CALL_DEPTH - 2}\n" in qwen.decode(episodes.respond([0], [ok], [True])[0])  # the run goes on


def test_a_call_at_the_depth_limit_is_read_and_one_past_it_is_not():
    def call(n: int) -> str:
        return '<tool_call>{"name": "f", "arguments": {"x": ' + nested(n) + "}}</tool_call>"

    at, past = parse_tool_calls(call(MAX_CALL_DEPTH - 2)), parse_tool_calls(call(MAX_CALL_DEPTH - 1))
    assert isinstance(at[0], ToolCall) and depth(at[0].arguments["x"]) == MAX_CALL_DEPTH - 2
    assert isinstance(past[0], str) and "nests deeper than" in past[0]


DEEP_TEXTS = {
    "parentheses": "(" * 1000 + "7" + ")" * 1000,
    "unary minus": "-" * 1000 + "7",
    "boxed": "\\boxed{" * 1000 + "7" + "}" * 1000,
    "brackets": nested(1000),
    "working": "1 - " + "-" * 190 + "1 = 2\n#### 2",  # a left side of 194 characters, 191 levels deep
    "calc call": "<calc>" + "-" * 290 + "7</calc><result>7</result>\n#### 7",
}
PARSERS = {
    "wordmath.reward": lambda t: wordmath.reward("q", t, answer="7"),
    "wordmath.extract_answer": wordmath.extract_answer,
    "wordmath.reward_working": lambda t: wordmath.reward_working("q", t, answer="7"),
    "wordmath_calc.reward": lambda t: wordmath_calc.reward("q", t, answer="7"),
    "wordmath_calc.extract_answer": wordmath_calc.extract_answer,
    "exact.exact_match": lambda t: exact.exact_match("q", t, answer="7"),
    "exact.extract_final_answer": exact.extract_final_answer,
    "math.marked_answer": math_rewards.marked_answer,
    "calculator": lambda t: ToolRunner([calculator], isolation="main").run(
        [ToolCall("calculator", {"expression": t[:300]})])[0],
}


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("text", DEEP_TEXTS)
def test_no_parser_of_policy_text_raises_on_deep_nesting(parser, text):
    PARSERS[parser](DEEP_TEXTS[text])
    with_stack_left(120, PARSERS[parser], DEEP_TEXTS[text])  # called deep in a run: still no RecursionError


def test_working_too_deep_to_read_is_not_checked():
    assert with_stack_left(120, wordmath.equations, DEEP_TEXTS["working"]) == [(None, 2)]
    assert with_stack_left(120, wordmath.shows_working, DEEP_TEXTS["working"]) is False


def test_the_calculator_says_an_expression_is_nested_too_deeply():
    result = with_stack_left(120, PARSERS["calculator"], "-" * 290 + "7")
    assert result.text == "error: ValueError: the expression is nested too deeply"


# --------------------------------------------------------------------------- a tool's return value


HOSTILE_RESULTS = '''
class Payload(str):
    """Text whose unpickling would write the marker file (anywhere it is unpickled)."""

    def __reduce__(self):
        return (open, (MARKER, "w"))


class Unreadable:
    def __str__(self):
        raise RuntimeError("no text here")


class LoudStr(str):
    def __str__(self):
        raise RuntimeError("no text here either")


class Disguised:
    def __str__(self):
        return Payload("disguised")


def result(how: str) -> str:
    """Returns a hostile result.

    Args:
        how: Which one.
    """
    return {"payload": lambda: Payload("plain words"), "unreadable": Unreadable, "loud": lambda: LoudStr("loud"),
            "disguised": Disguised}[how]()
'''


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile_results")
    marker = folder / "unpickled-in-the-trainer"
    (folder / "hostile_results.py").write_text(f"MARKER = {str(marker)!r}\n" + HOSTILE_RESULTS)
    yield folder, marker
    shutdown_pools()


@pytest.mark.parametrize("isolation", ["process", "main"])
def test_a_tools_result_crosses_as_plain_text_and_never_runs_code_in_the_trainer(hostile, isolation):
    folder, marker = hostile
    runner = ToolRunner(load_tools(f"{folder}/hostile_results.py:result"), timeout_s=20.0, workers=1,
                        isolation=isolation)
    hows = ["payload", "unreadable", "loud", "disguised"]
    try:
        results = dict(zip(hows, runner.run([ToolCall("result", {"how": h}) for h in hows])))
    finally:
        runner.close()
    assert not marker.exists()
    assert results["payload"].text == "plain words" and type(results["payload"].text) is str
    assert results["payload"].error is None
    assert results["unreadable"].text == ("error: ValueError: the tool returned a value whose text could not be "
                                          "read (RuntimeError: no text here)")
    assert results["loud"].text == "loud" and type(results["loud"].text) is str  # its own __str__ never runs
    assert results["disguised"].text == "disguised" and type(results["disguised"].text) is str
    assert all(type(r.error) in (str, type(None)) for r in results.values())


class Text(str):
    def __reduce__(self):
        raise AssertionError("pickled")


class Number(float):
    def __float__(self):
        raise AssertionError("its __float__ ran")


def test_a_workers_message_is_json_of_builtin_values():
    wire = to_wire(Outcome(Text("out"), Text("why"), ((Text("key"), Number(1.5)), ("bad", "not a number"))), 0.25)
    value, error, seconds, extras = from_wire(wire)
    assert (value, error, seconds, extras) == ("out", "why", 0.25, (("key", 1.5),))
    assert type(value) is str and type(error) is str and type(extras[0][0]) is str
    assert from_wire(to_wire(Outcome(None, None), 1.0)) == (None, None, 1.0, ())
    unsendable = from_wire(to_wire(Outcome(object(), None), 1.0, what="tool"))
    assert unsendable[:2] == (0.0, "the tool's result is neither a number nor text")
    for garbage in (pickle.dumps(("x", None, 1.0, ())), b"[1, 2]", b'["x", 3, 1.0, []]', b"[" * 100_000):
        with pytest.raises(ValueError, match="no call's result"):
            from_wire(garbage)


# --------------------------------------------------------------------------- a tool named calc


def calc(expression: str) -> str:
    """A tool of the user's that happens to be named calc.

    Args:
        expression: Anything.
    """
    return "mine"


def test_a_user_tool_named_calc_beside_the_calculator_is_refused_in_one_line(smol, qwen):
    with pytest.raises(ToolSpecError) as e:
        ToolEnvironment(smol, [calculator, calc], "inline", 2, ToolRunner([calculator, calc], isolation="main"))
    message = str(e.value)
    assert "\n" not in message and message.startswith("data.tools: tools 'calculator' (calculator) and 'calc' (")
    assert "both take the inline tag <calc>" in message and message.endswith("rename 'calc'")
    with pytest.raises(ToolSpecError, match="both take the inline tag <calc>"):
        build_environment(smol, ["calculator", calc], tool_format="inline", isolation="main")
    assert inline_tags([as_tool(calc)]) == {"calc": "calc"}  # alone it is called by its tag
    chat = ToolEnvironment(qwen, [calculator, calc], "chat", 2, ToolRunner([calculator, calc], isolation="main"))
    assert [s["function"]["name"] for s in chat.schemas] == ["calculator", "calc"]  # by name: no clash
