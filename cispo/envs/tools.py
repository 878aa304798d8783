"""Tools a policy calls in a multi-turn rollout: plain Python functions, loaded from specs and run
where they cannot hurt the run.

    >>> tools = load_tools("my_tools.py:add,multiply")        # or ["calculator", "pkg.mod:fn"]
    >>> runner = ToolRunner(tools, timeout_s=5.0)
    >>> runner.run([ToolCall("add", {"a": 2, "b": 3})])        # [ToolResult(text="5", error=None, seconds=...)]

**A tool is a plain function** (TRL's convention): typed arguments and a docstring whose ``Args:``
section describes each one; its JSON schema, which a chat template renders into the prompt, is
``transformers.utils.get_json_schema``'s (`tool_schema`). It returns text (anything else is shown
as its ``str``, as TRL shows it); an async function is run to completion.

**Specs** are the reward specs' (``cispo.data.rewards.loading``): a built-in name (`BUILTIN_TOOLS`:
``calculator``, ``python``), ``module:function`` or ``path/to/file.py:function``, and several
functions of one module as ``file.py:add,multiply`` (`split_specs`); ``data.tools`` takes one spec
or a list of them.

**Running** (`ToolRunner`): every call runs in a worker process of the reward workers' machinery
(``cispo.data.rewards.pool``: processes of their own that a hang, an exit or a crash cannot take
down, killed and replaced past ``timeout_s``, their output captured, at most
``OUTPUT_LIMIT_BYTES`` written to any file), each worker also capped at `TOOL_MEMORY_BYTES` of
address space. A call that raises, hangs, exits or crashes its worker gives a `ToolResult` whose
``error`` says so and whose ``text``, what the policy is shown, is a short ``error: ...``
(`policy_error`); an output longer than `TOOL_OUTPUT_CHARS` is cut with a note (`cap_output`). No
call ever raises in the trainer. What a tool returns is made plain text in its worker (`as_text`: a
``str`` subclass is copied without running its methods, a raising ``__str__`` is a failed call), and
only builtin values cross back to the trainer, as JSON, never as pickled objects (``pool``).

Built-ins: `calculator` (exact arithmetic over a parsed expression: no names, no calls, bounded
sizes) and `python` (a program run in the code sandbox, ``cispo.data.rewards.sandbox``).
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib
import inspect
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple

from cispo.data.rewards import Outcome, RewardSpecError, describe_error
from cispo.data.rewards.loading import _resolve, absolute_spec
from cispo.data.rewards.pool import pool_for
from cispo.foundations.suggest import did_you_mean
from cispo.foundations.text import plain_str, valid_text

__all__ = ["ToolCall", "ToolResult", "Tool", "ToolSpecError", "ToolRunner", "BUILTIN_TOOLS", "TOOL_OUTPUT_CHARS",
           "TOOL_MEMORY_BYTES", "limit_memory", "split_specs", "load_tool", "load_tools", "as_tool", "tool_schema",
           "cap_output", "policy_error", "as_text", "calculator", "evaluate", "format_number", "python",
           "check_python_tool"]

BUILTIN_TOOLS: dict[str, str] = {"calculator": "cispo.envs.tools:calculator", "python": "cispo.envs.tools:python"}
"""Built-in tool names -> ``module:function``."""
TOOL_OUTPUT_CHARS = 4000
"""The most characters of one call's output kept (in its worker, before it crosses the pipe); the rest is
cut with a note. The environment caps an observation's tokens on top (``max_observation_tokens``)."""
TOOL_MEMORY_BYTES = 4 << 30
"""Address space of a tool worker (``RLIMIT_AS``): a tool that builds a huge value fails with MemoryError."""
POLICY_ERROR_CHARS = 200
"""The most characters of an error message the policy is shown (the whole message is recorded)."""


class ToolSpecError(ValueError):
    """A ``data.tools`` spec that names no usable function."""


class ToolCall(NamedTuple):
    """One call the policy made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict


class ToolResult(NamedTuple):
    """One call's outcome: ``text``, what the policy is shown (the output, or ``error: ...``); ``error``,
    the whole message when the call failed (raised, timed out, exited, crashed), else None;
    ``seconds`` the call took in its worker (one that timed out or ended its worker: from submitting it
    to its result)."""

    text: str
    error: str | None
    seconds: float


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A loaded tool: the function as written, the spec its workers load it from again (None: a function
    given in code that no worker can import), and the name the policy calls it by."""

    name: str
    fn: Callable = field(repr=False)
    spec: str | None = None
    builtin: bool = False

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    @property
    def argument(self) -> str:
        """The name of its first parameter: what an inline call's text is passed as."""
        params = list(inspect.signature(self.fn).parameters)
        if not params:
            raise ToolSpecError(f"data.tools: tool {self.name!r} takes no argument, so it cannot be called inline")
        return params[0]


def split_specs(value) -> list[str]:
    """``data.tools`` (one spec or a list) as one spec per function: ``file.py:add,multiply`` is
    ``file.py:add`` and ``file.py:multiply``. ToolSpecError for anything but non-empty strings."""
    items = [value] if isinstance(value, str) else list(value or [])
    out = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ToolSpecError(f"data.tools: each tool spec must be a non-empty string, got {item!r}")
        module, sep, names = item.strip().rpartition(":")
        if not sep:
            out.append(names)
            continue
        parts = [n.strip() for n in names.split(",")]
        if not module or not all(parts):
            raise ToolSpecError(f"data.tools: {item!r}: expected 'module:function', 'path/to/file.py:function' "
                                f"or 'file.py:f,g' (functions separated by commas)")
        out += [f"{module}:{n}" for n in parts]
    return out


def _as_tool_error(e: RewardSpecError, spec: str) -> ToolSpecError:
    """The reward loader's message about ``spec``, worded for a tool."""
    message = str(e).replace(f"reward {spec!r}", f"data.tools: tool {spec!r}", 1)
    message = message.replace("a reward module", "a tool module")
    return ToolSpecError(message)


def load_tool(spec: str, trial: bool = True) -> Tool:
    """The `Tool` named by one spec (a built-in name, ``module:function``, ``path/to/file.py:function``).
    ``trial``: a user module is first imported in a throw-away process (an exit at import is an error
    here, not the end of the trainer), as a reward's is. ToolSpecError naming the spec otherwise."""
    spec = spec.strip()
    if spec in BUILTIN_TOOLS:
        fn = _resolve(spec, BUILTIN_TOOLS[spec], trial=False)
        return Tool(fn.__name__, fn, spec, builtin=True)
    if ":" not in spec:
        raise ToolSpecError(f"data.tools: unknown tool {spec!r}{did_you_mean(spec, BUILTIN_TOOLS)}; built-in tools: "
                            f"{', '.join(BUILTIN_TOOLS)}; or give 'module:function' / 'path/to/file.py:function'")
    try:
        fn = _resolve(spec, spec, trial)
    except RewardSpecError as e:
        raise _as_tool_error(e, spec) from None
    name = getattr(fn, "__name__", None) or spec.rpartition(":")[2].split(".")[-1]
    return Tool(name, fn, absolute_spec(spec))


def load_tools(value, trial: bool = True) -> list[Tool]:
    """Every tool of ``data.tools`` (`split_specs`), in order; ToolSpecError when two share a name (the
    policy calls a tool by its name)."""
    tools = [load_tool(s, trial) for s in split_specs(value)]
    _check_names(tools)
    return tools


def _check_names(tools: list[Tool]) -> None:
    seen: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in seen and tool.spec is not None and seen[tool.name].spec == tool.spec:
            raise ToolSpecError(f"data.tools: tool {tool.spec!r} is given twice: give each tool once")
        if tool.name in seen:
            where = [t.spec or "given in code" for t in (seen[tool.name], tool)]
            raise ToolSpecError(f"data.tools: two tools are named {tool.name!r} ({where[0]} and {where[1]}): the "
                                f"policy calls a tool by its name")
        seen[tool.name] = tool


def as_tool(fn) -> Tool:
    """A `Tool` for a function given in code (a `Tool` as it is): its spec is ``module:qualname`` where that
    imports back to it (a worker can load it), else None (a lambda, a nested function, one of ``__main__``)."""
    if isinstance(fn, Tool):
        return fn
    if not callable(fn):
        raise ToolSpecError(f"data.tools: a tool must be a function, got {type(fn).__name__}")
    name = getattr(fn, "__name__", type(fn).__name__)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    for builtin, target in BUILTIN_TOOLS.items():
        if target == f"{module}:{qualname}":
            return Tool(name, fn, builtin, builtin=True)
    spec = None
    if module and module != "__main__" and "<" not in qualname:
        try:
            found = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
            spec = f"{module}:{qualname}" if found is fn else None
        except (ImportError, AttributeError):
            spec = None
    return Tool(name, fn, spec)


def tool_schema(fn) -> dict:
    """The tool's JSON schema, ``{"type": "function", "function": {"name", "description", "parameters"}}``
    (``transformers.utils.get_json_schema``: type hints and the docstring's ``Args:``). ToolSpecError
    naming the tool and what to add when it has none."""
    from transformers.utils import get_json_schema

    tool = as_tool(fn)
    try:
        return get_json_schema(tool.fn)
    except Exception as e:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException
        raise ToolSpecError(f"data.tools: tool {tool.name!r} has no JSON schema ({describe_error(e)}): give each "
                            f"argument a type hint and a line under 'Args:' in its docstring, as TRL requires"
                            ) from None


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------


def as_text(value) -> str:
    """A tool's return value as the text the policy is shown: its ``str``, as TRL shows it (``7``,
    ``{'a': 1}``), always a builtin ``str`` (`plain_str`): a ``str`` subclass is copied without running any
    method of its class, and what another value's ``str`` returns is copied so. ValueError, saying so, where
    that ``str`` raises (in a worker, where it runs: one failed call)."""
    if issubclass(type(value), str):
        return plain_str(value)
    try:
        return plain_str(str(value))
    except Exception as e:  # noqa: BLE001 - a hostile or broken __str__ / __repr__
        raise ValueError(f"the tool returned a value whose text could not be read ({describe_error(e)})") from None


def cap_output(text: str, limit: int = TOOL_OUTPUT_CHARS) -> str:
    """``text``, or its first ``limit`` characters with a note of how many were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]} [... {len(text) - limit} more characters cut]"


def policy_error(message: str) -> str:
    """What the policy is shown of a failed call's ``message``: ``error: <the message>``, without the
    output tail and the note about the worker's replacement that the record keeps, at most
    `POLICY_ERROR_CHARS` characters."""
    short = message.split(" | output (end):", 1)[0].split(" (its worker process was killed", 1)[0].strip()
    short = short if len(short) <= POLICY_ERROR_CHARS else short[: POLICY_ERROR_CHARS - 3] + "..."
    return f"error: {short}"


def limit_memory(limit: int) -> None:
    """``RLIMIT_AS`` of this process at most ``limit`` bytes (POSIX; nothing elsewhere)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY or soft > limit:
            soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except (ImportError, ValueError, OSError):
        pass


def call_tool(tool: Tool, arguments: dict) -> Outcome:
    """One call, here: ``Outcome(text, None)`` (the output `as_text`, capped: `cap_output`). What the
    function raises passes (the worker catches it: one failed call)."""
    value = tool.fn(**arguments)
    if inspect.isawaitable(value):
        value = asyncio.run(_awaited(value))
    return Outcome(cap_output(as_text(value)), None)


async def _awaited(value):
    return await value


def tool_job(spec: str):
    """A tool worker's job (``cispo.data.rewards.pool.RewardPool``'s ``job``): its address space capped
    (`TOOL_MEMORY_BYTES`), the tools of ``spec`` (specs joined by newlines) loaded once, and
    ``call(name, arguments) -> Outcome`` (`call_tool`)."""
    limit_memory(TOOL_MEMORY_BYTES)
    tools = {t.name: t for t in (load_tool(s, trial=False) for s in spec.split("\n"))}
    return functools.partial(_timed_call, tools)


def _timed_call(tools: dict[str, Tool], name: str, arguments: dict) -> Outcome:
    """`call_tool` in a worker, its seconds reported in the extras (``("seconds", s)``); what it raises
    (``SystemExit`` too) is one failed call."""
    started = time.perf_counter()
    try:
        outcome = call_tool(tools[name], arguments)
    except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, ...: one failed call
        outcome = Outcome(0.0, describe_error(e))
    return outcome._replace(extras=(("seconds", time.perf_counter() - started),))


class ToolRunner:
    """Runs a batch of tool calls at once, each in a worker process (module docstring), or, with
    ``isolation="main"``, here in this thread one after another (trusted functions; no timeout; an
    ``Exception`` is still one failed call).

    Args:
        tools: `Tool` s or functions (`as_tool`); with ``isolation="process"`` each must have a spec a
            worker can load. timeout_s: a call's time limit in its worker (``data.tool_timeout_s``).
        workers: worker processes (None: min(8, CPUs)). isolation: ``process`` or ``main``.
    """

    def __init__(self, tools, timeout_s: float | None = 5.0, workers: int | None = None,
                 isolation: str = "process") -> None:
        if isolation not in ("process", "main"):
            raise ToolSpecError(f"tool isolation must be 'process' or 'main', got {isolation!r}")
        tools = [as_tool(t) for t in tools]
        _check_names(tools)
        self.tools = {t.name: t for t in tools}
        self.timeout_s, self.isolation = timeout_s, isolation
        unloadable = [t.name for t in self.tools.values() if t.spec is None]
        if isolation == "process" and unloadable:
            raise ToolSpecError(f"data.tools: tool(s) {', '.join(map(repr, unloadable))} cannot be loaded in a worker "
                                f"process (a lambda, a nested function or one of __main__): define each in a module or "
                                f"a file and give it as 'path/to/file.py:function'")
        self._pool = None
        if isolation == "process" and self.tools:
            spec = "\n".join(t.spec for t in self.tools.values())
            self._pool = pool_for(spec, workers or min(8, os.cpu_count() or 1), job=tool_job, what="tool")

    def start(self) -> None:
        """Start the worker processes now, without waiting (each loads the tools as it starts)."""
        if self._pool is not None:
            self._pool.start()

    def close(self) -> None:
        """Stop the workers (a later `run` starts them again)."""
        if self._pool is not None:
            self._pool.close()

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Each call's `ToolResult`, in order; the calls run side by side in the workers. A call of an
        unknown tool, or with arguments that are no JSON object, fails without running."""
        results: list[ToolResult | None] = [self._refused(c) for c in calls]
        todo = [i for i, r in enumerate(results) if r is None]
        if self.isolation == "main":
            for i in todo:
                results[i] = self._run_here(calls[i])
            return results
        started = time.monotonic()
        done: dict[int, float] = {}
        futures = self._pool.submit([(calls[i].name, calls[i].arguments) for i in todo], self.timeout_s) if todo else []
        for i, future in zip(todo, futures):
            future.add_done_callback(lambda f, i=i: done.setdefault(i, time.monotonic()))
        for i, future in zip(todo, futures):
            outcome = future.result()
            seconds = dict(outcome.extras).get("seconds", done.get(i, time.monotonic()) - started)
            results[i] = _result(outcome, seconds)
        return results

    def _refused(self, call: ToolCall) -> ToolResult | None:
        if call.name not in self.tools:
            message = f"unknown tool {call.name!r}; the tools: {', '.join(self.tools) or 'none'}"
            return ToolResult(policy_error(message), message, 0.0)
        if not isinstance(call.arguments, dict):
            message = f"the arguments of {call.name!r} must be a JSON object, got a {type(call.arguments).__name__}"
            return ToolResult(policy_error(message), message, 0.0)
        return None

    def _run_here(self, call: ToolCall) -> ToolResult:
        started = time.monotonic()
        try:
            outcome = call_tool(self.tools[call.name], call.arguments)
        except Exception as e:  # noqa: BLE001 - a tool must never take the run down
            outcome = Outcome(0.0, describe_error(e))
        return _result(outcome, time.monotonic() - started)


def _result(outcome: Outcome, seconds: float) -> ToolResult:
    """The `ToolResult` of a call's `Outcome` (its value, plain text made where the call ran: `call_tool`), its
    text and error valid Unicode (`valid_text`: a lone surrogate in a tool's output or message, which no
    tokenizer encodes, is replaced; the run goes on)."""
    if outcome.error is not None:
        error = valid_text(outcome.error)
        return ToolResult(policy_error(error), error, seconds)
    if type(outcome.value) is not str:
        message = f"the tool's result is no text ({type(outcome.value).__name__})"
        return ToolResult(policy_error(message), message, seconds)
    return ToolResult(valid_text(outcome.value), None, seconds)


# ---------------------------------------------------------------------------------------
# Built-in: calculator
# ---------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 300
"""The longest expression the calculator reads."""
MAX_BITS = 4096
"""The largest numerator or denominator (in bits, ~1233 decimal digits) of any value the calculator computes."""
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_SPELLINGS = {ord("×"): "*", ord("÷"): "/", ord("−"): "-", ord("^"): "**"}
MAX_LITERAL_EXPONENT = 1000
"""The largest power of ten a number may be written with (``1e1000``): ``1e-1000000000`` is refused unread."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses, for example "(12 + 30) / 4".
    """
    return format_number(evaluate(expression))


def evaluate(expression: str) -> Fraction | float:
    """The value of ``expression``: numbers (ints, decimals, ``1e3``), ``+ - * / // % **`` (``^`` also
    means ``**``; ``×`` ``÷`` ``−`` read as ``* / -``), unary ``+``/``-`` and parentheses, nothing else
    (no names, no calls, no attributes). Exact (a Fraction) unless a power has a non-integer exponent
    (then a float). ValueError for anything else, for a value past `MAX_BITS`, and for an expression
    longer than `MAX_EXPRESSION_CHARS`; ZeroDivisionError for a division by zero."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be text, got {type(expression).__name__}")
    source = expression.translate(_SPELLINGS).strip().rstrip("=").strip()
    if len(source) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError("not an arithmetic expression") from None
    try:
        return _evaluate(tree, source)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def _evaluate(node: ast.AST, source: str) -> Fraction | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _literal(ast.get_source_segment(source, node) or repr(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and (type(node.op) in _OPS or isinstance(node.op, ast.Pow)):
        a, b = _evaluate(node.left, source), _evaluate(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _power(a, b)
        if b == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise ZeroDivisionError("division by zero")
        return _checked(_OPS[type(node.op)](a, b))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def _literal(text: str) -> Fraction:
    """A number as written ("0.1" is exactly 1/10), its power of ten bounded first (`MAX_LITERAL_EXPONENT`)."""
    mantissa, e, power = text.lower().replace("_", "").partition("e")
    if e and abs(int(power or 0)) > MAX_LITERAL_EXPONENT:
        raise ValueError("the number is too large" if not power.startswith("-") else "the number is too small")
    return _checked(Fraction(f"{mantissa}e{power}" if e else mantissa))


def _checked(value: Fraction | float) -> Fraction | float:
    """``value``, or ValueError when it is past `MAX_BITS` (or, a float, not finite)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is too large")
        return value
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise ValueError("the result is too large")
    return value


def _power(base: Fraction | float, exponent: Fraction | float) -> Fraction | float:
    """``base ** exponent``: exact for an integer exponent (its size checked before it is computed),
    a float otherwise (ValueError for a negative base)."""
    integral = isinstance(exponent, Fraction) and exponent.denominator == 1
    if integral and isinstance(base, Fraction):
        n = int(exponent)
        if base == 0 and n < 0:
            raise ZeroDivisionError("division by zero")
        if abs(base) == 1:  # 1 ** n, (-1) ** n: any n, by its parity
            return base ** (n % 2)
        bits = max(base.numerator.bit_length(), base.denominator.bit_length())
        if base != 0 and (bits - 1) * abs(n) > MAX_BITS:  # checked before it is computed
            raise ValueError("the result is too large")
        return _checked(base ** n)
    if base < 0 and not integral:
        raise ValueError("a negative number to a fractional power")
    try:
        return _checked(float(base) ** (int(exponent) if integral else float(exponent)))
    except OverflowError:
        raise ValueError("the result is too large") from None


def format_number(value: Fraction | float) -> str:
    """A value as the calculator writes it: an integer in full ("42", "-7"); a fraction whose decimal
    ends within 12 places exactly ("3.5", "0.125"); any other rounded to 6 decimal places ("3.333333",
    "0.666667"; one closer to 0 than that in 6 significant digits, "1.5e-07"); a float (a fractional
    power) in up to 10 significant digits ("1.414213562")."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.10g}"
    if value.denominator == 1:
        return str(value.numerator)
    rest, places = value.denominator, 0
    for p in (2, 5):
        count = 0
        while rest % p == 0:
            rest, count = rest // p, count + 1
        places = max(places, count)
    if rest == 1 and places <= 12:
        return _decimal(value, places)
    if abs(value) < Fraction(1, 10**6):
        return f"{float(value):.6g}"
    return _decimal(round(value, 6), 6)


def _decimal(value: Fraction, places: int) -> str:
    """``value`` (a multiple of 10^-places) written exactly, trailing zeros dropped."""
    scaled = abs(value.numerator * 10**places // value.denominator)
    digits = str(scaled).rjust(places + 1, "0")
    text = f"{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".") if places else digits
    return f"-{text}" if value < 0 and text != "0" else text


# ---------------------------------------------------------------------------------------
# Built-in: python, in the code sandbox
# ---------------------------------------------------------------------------------------

PYTHON_TIMEOUT_S = 3.0
"""The sandbox's wall-clock limit of one ``python`` call (keep ``data.tool_timeout_s`` above it)."""


def python_sandbox():
    """The code sandbox's limits for one ``python`` call (`PYTHON_TIMEOUT_S`; output kept up to 4 x
    `TOOL_OUTPUT_CHARS` bytes, then cut by `cap_output`)."""
    from cispo.data.rewards.sandbox import SandboxConfig

    return SandboxConfig(timeout_s=PYTHON_TIMEOUT_S, cpu_s=int(PYTHON_TIMEOUT_S),
                         max_output_bytes=TOOL_OUTPUT_CHARS * 4)


def check_python_tool() -> None:
    """ToolSpecError, with the reason, unless the code sandbox runs here (the ``python`` tool needs it):
    said once before the run, not as an error observation on every call."""
    from cispo.data.rewards.sandbox import SandboxUnavailable, check_sandbox

    try:
        check_sandbox(python_sandbox())
    except SandboxUnavailable as e:
        raise ToolSpecError(f"data.tools: the python tool needs the code sandbox (docs/code-sandbox.md): {e}") from None


def python(code: str) -> str:
    """Run a Python program and return what it prints (its error, if it fails).

    Args:
        code: The program; print() the values you want to see.
    """
    from cispo.data.rewards.sandbox import run_sandboxed

    result = run_sandboxed(code, python_sandbox())
    if result.ok:
        return result.stdout
    if result.killed_reason is not None and result.killed_reason != "output_limit":
        why = {"timeout": f"timed out after {PYTHON_TIMEOUT_S} s", "cpu_limit": "CPU time limit"}.get(
            result.killed_reason, result.killed_reason)
    else:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"exit status {result.returncode}"
    return f"{result.stdout}error: {why}"
