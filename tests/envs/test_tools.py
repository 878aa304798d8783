"""Tools of a multi-turn rollout (cispo.envs.tools): TRL-style functions loaded from specs, their schemas,
the built-in calculator and python tool, and the runner: a tool that raises, hangs, floods, exits or
eats memory gives the policy a short error observation and the record its message, never a crash.

Timeouts are short so that the module stays fast; every pool is stopped at the end."""

from __future__ import annotations

import textwrap
import time

import pytest

from cispo.data.rewards.pool import shutdown_pools
from cispo.envs.tools import (
    BUILTIN_TOOLS,
    POLICY_ERROR_CHARS,
    TOOL_OUTPUT_CHARS,
    Tool,
    ToolCall,
    ToolRunner,
    ToolSpecError,
    as_tool,
    calculator,
    cap_output,
    evaluate,
    load_tool,
    load_tools,
    policy_error,
    python,
    split_specs,
    tool_schema,
)

TRL_TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b
'''

HOSTILE = '''
import os, sys, time

def act(how: str) -> str:
    """Misbehaves as told.

    Args:
        how: What to do.
    """
    if how == "raise":
        raise ValueError("bad input")
    if how == "hang":
        time.sleep(600)
    if how == "flood":
        return "x" * 10_000_000
    if how == "exit":
        sys.exit(3)
    if how == "die":
        os._exit(4)
    if how == "memory":
        return str(len(bytearray(16 << 30)))
    if how == "loud-fail":
        print("y" * 100_000 + "END")
        raise RuntimeError("failed after printing")
    if how == "dict":
        return {"value": 7}
    return "ok:" + how
'''


@pytest.fixture(scope="module")
def tool_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "trl_tools.py").write_text(TRL_TOOLS)
    (folder / "hostile.py").write_text(HOSTILE)
    (folder / "exits.py").write_text("import sys\nsys.exit(0)\n")
    yield folder
    shutdown_pools()


# --------------------------------------------------------------------------- specs and schemas


def test_specs_name_one_function_each():
    assert split_specs("my_tools.py:add,multiply") == ["my_tools.py:add", "my_tools.py:multiply"]
    assert split_specs(["calculator", "pkg.mod:f", "a/b.py: g , h"]) == ["calculator", "pkg.mod:f", "a/b.py:g",
                                                                         "a/b.py:h"]
    assert split_specs(None) == [] and split_specs([]) == []
    for bad in (["", "calculator"], "x.py:add,", ":add", [3]):
        with pytest.raises(ToolSpecError, match="data.tools"):
            split_specs(bad)


def test_trl_tools_load_unchanged_with_their_schemas(tool_files):
    from transformers.utils import get_json_schema

    add, multiply = load_tools(f"{tool_files}/trl_tools.py:add,multiply")
    assert (add.name, multiply.name, add(2, 3), multiply(2, 3)) == ("add", "multiply", 5, 6)
    assert add.spec == f"{tool_files.resolve()}/trl_tools.py:add" and not add.builtin
    assert tool_schema(add) == get_json_schema(add.fn) and tool_schema(add.fn) == tool_schema(add)
    assert tool_schema(add)["function"]["parameters"]["required"] == ["a", "b"]
    calc = load_tool("calculator")
    assert calc.builtin and calc.name == "calculator" and tool_schema(calc)["function"]["name"] == "calculator"
    assert tool_schema(load_tool("python"))["function"]["parameters"]["required"] == ["code"]
    assert set(BUILTIN_TOOLS) == {"calculator", "python"}


def test_a_bad_spec_is_one_error_naming_the_field(tool_files):
    with pytest.raises(ToolSpecError, match=r"data.tools: unknown tool 'calculater' \(did you mean 'calculator'\?\)"):
        load_tool("calculater")
    with pytest.raises(ToolSpecError, match=r"data.tools: tool '.*missing.py:f': no such file"):
        load_tool(f"{tool_files}/missing.py:f")
    with pytest.raises(ToolSpecError, match=r"has no attribute 'divide'"):
        load_tool(f"{tool_files}/trl_tools.py:divide")
    with pytest.raises(ToolSpecError,
                       match=r"data.tools: tool .*exits.py:f': importing .* \(a tool module must import"):
        load_tool(f"{tool_files}/exits.py:f")  # the trial import: sys.exit at import is an error, not the end
    with pytest.raises(ToolSpecError, match="trl_tools.py:add' is given twice"):
        load_tools([f"{tool_files}/trl_tools.py:add", f"{tool_files}/trl_tools.py:add"])
    with pytest.raises(ToolSpecError, match="has no JSON schema"):
        tool_schema(lambda x: x)


def test_a_function_given_in_code_keeps_a_spec_only_where_a_worker_can_import_it():
    assert as_tool(calculator) == Tool("calculator", calculator, "calculator", builtin=True)
    assert as_tool(textwrap.dedent).spec == "textwrap:dedent"
    assert as_tool(lambda x: x).spec is None
    with pytest.raises(ToolSpecError, match="cannot be loaded in a worker process"):
        ToolRunner([lambda x: x])
    ToolRunner([lambda x: x], isolation="main")  # trusted: runs here


# --------------------------------------------------------------------------- the calculator

CALCULATIONS = [
    ("2+3", "5"), ("5 - 2 + 4", "7"), ("(3 + 4) * 2", "14"), ("-(-5)", "5"), ("7/2", "3.5"), ("1/8", "0.125"),
    ("10/3", "3.333333"), ("2/3", "0.666667"), ("-7/4", "-1.75"), ("0.1 + 0.2", "0.3"), ("7 // 2", "3"),
    ("7 % 3", "1"), ("2 ** 10", "1024"), ("2^10", "1024"), ("3 × 4", "12"), ("12 ÷ 4", "3"), ("5 − 7", "-2"),
    ("2 ** -2", "0.25"), ("4 ** 0.5", "2"), ("2 ** 0.5", "1.414213562"), ("1e3 + 1", "1001"), ("5-2+4=", "7"),
    ("(-1) ** (10 ** 9 + 1)", "-1"), ("1 ** (10 ** 12)", "1"), ("1/3e9", "3.33333e-10"), ("10**30", "1" + "0" * 30),
    ("(" * 140 + "1" + ")" * 140, "1"), ("-" * 298 + "1", "1"),
]


@pytest.mark.parametrize("expression, value", CALCULATIONS)
def test_the_calculator_is_exact_where_it_can_be(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('true')", "only numbers"), ("x + 1", "only numbers"), ("abs(-1)", "only numbers"),
    ("(1).real", "only numbers"), ("[1, 2]", "only numbers"), ("'a' * 3", "only numbers"), ("True + 1", "only numbers"),
    ("1 < 2", "only numbers"), ("2 ** 10 ** 10", "too large"), ("9 ** 9 ** 9", "too large"),
    ("1e1000000000", "too large"), ("1e-1000000000", "too small"), ("(10 ** 300) ** 5", "too large"),
    ("(-8) ** 0.5", "negative number"), ("2.5 ** 100000", "too large"), ("1 +", "not an arithmetic"),
    ("", "not an arithmetic"), ("1" * 301, "longer than"), ("(" * 250 + "1", "not an arithmetic"),
])
def test_the_calculator_refuses_all_but_bounded_arithmetic(expression, error):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=error):
        evaluate(expression)
    assert time.perf_counter() - started < 1.0  # refused before anything large is computed


def test_the_calculator_says_division_by_zero():
    for expression in ("1/0", "1 // 0", "5 % 0", "0 ** -1"):
        with pytest.raises(ZeroDivisionError, match="division by zero"):
            calculator(expression)


# --------------------------------------------------------------------------- running


def test_messages_the_policy_sees_are_short():
    assert cap_output("abc", 5) == "abc" and cap_output("x" * 12, 5) == "xxxxx [... 7 more characters cut]"
    message = "timed out after 2.0 s (its worker process was killed and replaced) | output (end): 'zzz'"
    assert policy_error(message) == "error: timed out after 2.0 s"
    assert len(policy_error("E" * 10_000)) == len("error: ") + POLICY_ERROR_CHARS


def test_tools_in_this_thread_fail_one_call_at_a_time():
    runner = ToolRunner([calculator], isolation="main")
    ok, unknown, bad_args, raised, wrong_type = runner.run([
        ToolCall("calculator", {"expression": "6*7"}), ToolCall("search", {"q": "x"}),
        ToolCall("calculator", {"nope": 1}), ToolCall("calculator", {"expression": "1/0"}),
        ToolCall("calculator", ["6*7"])])
    assert ok.text == "42" and ok.error is None and ok.seconds >= 0
    assert unknown.text == "error: unknown tool 'search'; the tools: calculator" and unknown.error
    assert bad_args.text.startswith("error: TypeError:") and "nope" in bad_args.error
    assert raised.text == "error: ZeroDivisionError: division by zero"
    assert wrong_type.text.startswith("error: the arguments of 'calculator' must be a JSON object")


def test_a_tool_that_raises_hangs_floods_exits_or_eats_memory_costs_one_call(tool_files):
    runner = ToolRunner(load_tools(f"{tool_files}/hostile.py:act"), timeout_s=2.0, workers=2)
    hows = ["fine", "raise", "hang", "flood", "exit", "die", "memory", "loud-fail", "dict"]
    started = time.monotonic()
    results = dict(zip(hows, runner.run([ToolCall("act", {"how": h}) for h in hows])))
    assert time.monotonic() - started < 60
    assert results["fine"] == ("ok:fine", None, results["fine"].seconds)
    assert results["raise"].text == "error: ValueError: bad input" and results["raise"].error == "ValueError: bad input"
    assert results["hang"].text == "error: timed out after 2.0 s"
    assert "killed and replaced" in results["hang"].error and results["hang"].seconds >= 2.0
    flood = results["flood"]
    assert flood.error is None and flood.text == "x" * TOOL_OUTPUT_CHARS + " [... 9996000 more characters cut]"
    assert results["exit"].text == "error: SystemExit: 3"
    assert results["die"].text == "error: the tool's worker process died (exit status 4); it was replaced"
    assert results["memory"].text == "error: MemoryError"  # the worker's address space is capped
    loud = results["loud-fail"]
    assert loud.text == "error: RuntimeError: failed after printing" and loud.error.endswith("END'")
    assert results["dict"].text == "{'value': 7}"  # its str, as TRL shows it
    assert runner.run([ToolCall("act", {"how": "again"})])[0].text == "ok:again"  # the pool lives on
    runner.close()


def test_the_python_tool_runs_in_the_sandbox(netns):
    assert python("print(6 * 7)") == "42\n"
    assert python("print('before')\n1 / 0") == "before\nerror: ZeroDivisionError: division by zero"
    assert python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)").startswith("error: ")
    assert python("while True: pass").endswith(("error: timed out after 3.0 s", "error: CPU time limit"))


SURROGATES = '''
def echo(text: str) -> str:
    """Returns text that is not valid Unicode, or raises with such a message.

    Args:
        text: What to do.
    """
    if text == "raise":
        raise ValueError("bad \\udcff input")
    return "half a pair: \\ud800."
'''


@pytest.mark.parametrize("isolation", ["main", "process"])
def test_a_tools_text_that_is_not_valid_unicode_is_replaced(tmp_path, isolation):
    """Was: a tool's output or error message with a lone surrogate reached the tokenizer as it was (a
    TypeError that ended the run) and samples.jsonl (a UnicodeEncodeError). Now each lone surrogate is
    U+FFFD where the result enters the trainer: the call's text and its error encode as UTF-8."""
    (tmp_path / "surrogates.py").write_text(SURROGATES)
    runner = ToolRunner(load_tools(f"{tmp_path}/surrogates.py:echo"), timeout_s=30.0, workers=1, isolation=isolation)
    try:
        output, raised = runner.run([ToolCall("echo", {"text": "x"}), ToolCall("echo", {"text": "raise"})])
    finally:
        runner.close()
    assert output == ("half a pair: \ufffd.", None, output.seconds)
    assert raised.text == "error: ValueError: bad \ufffd input" and raised.error == "ValueError: bad \ufffd input"
    for text in (output.text, raised.text, raised.error):
        text.encode("utf-8")
