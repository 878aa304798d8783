"""What `cispo.data.rewards.sandbox` runs inside bwrap: ``python -I -S harness.py LIMITS RESULT_FD MODE``.

Standard library only; cispo imports only `signed_lines`. How it works: docs/code-sandbox.md ("The test
harness"). In ``tests`` mode two processes share the sandbox:

* the **judge** (this process) holds the nonce and the test cases and runs the cases itself; no code of
  the solution ever runs in it, and it is non-dumpable, so the solution can neither read nor write it;
* the **worker** (forked before the judge reads its input, so its memory holds nothing of it; given
  only the solution's source) runs the solution. The cases see
  the solution's names as proxies: a call crosses to the worker as plain data, its result comes back as
  plain data (or as a handle to an object that stays in the worker).

So the worker can only *answer calls*, each answer one that some Python solution could also have
given; it never sees an expected value nor holds anything that could sign a verdict.
"""

import builtins
import hmac
import json
import os
import sys

MAX_DEPTH = 100  # nesting of one encoded value
MAX_REPLY = 64 << 20  # bytes of one message from the worker


def signed_lines(nonce, n):
    """The verdict line ``k n HMAC-SHA256(nonce, "k n")`` for each count k of n cases (code.py checks it)."""
    return tuple(b"%d %d %s\n" % (k, n, hmac.new(nonce, b"%d %d" % (k, n), "sha256").hexdigest().encode())
                 for k in range(n + 1))


# ----------------------------------------------------------------------------------------- the wire


def encode(value, handle, depth=0):
    """A JSON-able tree for ``value``: plain data by type (``["i", hex]``, ``["l", [...]]``, ...); any
    other object as ``handle(value)``. Subclasses of plain types cross as the plain type."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply to cross the sandbox boundary")
    if value is None or value is True or value is False:
        return value
    for kind, tag, make in _PLAIN:
        if isinstance(value, kind):
            return [tag, make(value)] if make else [tag, [encode(v, handle, depth + 1) for v in value]]
    if isinstance(value, dict):
        return ["d", [[encode(k, handle, depth + 1), encode(v, handle, depth + 1)] for k, v in value.items()]]
    return ["h", handle(value)]


_PLAIN = ((int, "i", lambda v: hex(int(v))), (float, "f", lambda v: float.hex(float(v))),
          (complex, "c", lambda v: [float.hex(v.real), float.hex(v.imag)]), (str, "s", str),
          (bytes, "b", lambda v: bytes(v).hex()), (bytearray, "y", lambda v: bytes(v).hex()),
          (list, "l", None), (tuple, "t", None), (frozenset, "F", None), (set, "S", None))
_MAKE = {"i": lambda v: int(v, 16), "f": float.fromhex,
         "c": lambda v: complex(float.fromhex(v[0]), float.fromhex(v[1])), "s": str, "b": bytes.fromhex,
         "y": lambda v: bytearray.fromhex(v)}
_CONTAINERS = {"l": list, "t": tuple, "F": frozenset, "S": set}


def decode(tree, handle, depth=0):
    """The value ``encode`` made ``tree`` from; ``handle(id)`` gives the object for ``["h", id]``. Raises
    ValueError / TypeError on anything ``encode`` cannot have made (hostile input is never executed)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if tree is None or tree is True or tree is False:
        return tree
    if type(tree) is not list or len(tree) != 2 or type(tree[0]) is not str:
        raise ValueError("malformed value")
    tag, body = tree
    if tag in _MAKE:
        if tag != "c" and type(body) is not str or tag == "c" and not (type(body) is list and len(body) == 2):
            raise ValueError("malformed value")
        return _MAKE[tag](body)
    if tag == "h":
        if type(body) is not int:
            raise ValueError("malformed handle")
        return handle(body)
    if type(body) is not list:
        raise ValueError("malformed container")
    if tag == "d":
        return {decode(k, handle, depth + 1): decode(v, handle, depth + 1) for k, v in map(_pair, body)}
    if tag in _CONTAINERS:
        return _CONTAINERS[tag](decode(v, handle, depth + 1) for v in body)
    raise ValueError("unknown tag %r" % tag)


def _pair(item):
    if type(item) is not list or len(item) != 2:
        raise ValueError("malformed dict item")
    return item


def _dump(message):
    return json.dumps(message, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode() + b"\n"


# ----------------------------------------------------------------------------------------- the worker


def _harden():
    """Make the process non-dumpable and install an audit hook that refuses the routes to the process's
    state and to bytecode not made by the compiler. Defence in depth: the verdict does not rest on it."""
    import _thread
    import collections  # noqa: E401
    import ctypes
    import enum
    import logging
    import typing
    logging._srcfile = None  # log records without caller lookup (it needs frames, refused below)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0: no /proc/<pid>/mem, no ptrace
    for name in [n for n in sys.modules if n.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]
    # Code objects allowed to call sys._getframe (they only read the caller's module name).
    allowed = {getattr(fn, "__code__", None) for fn in (collections.namedtuple, getattr(typing, "_caller", None),
                                                         getattr(getattr(enum, "EnumType", None), "_create_", None))}
    unmarshal = sys.modules["_frozen_importlib_external"]._compile_bytecode.__code__  # the import system's
    trusted = tuple(os.path.realpath(p) + "/" for p in {"/usr", sys.prefix, sys.base_prefix})
    denied = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                        "sys._current_exceptions", "sys.settrace", "sys.setprofile", "sys.addaudithook", "os.symlink",
                        "code.__new__"})  # code.__new__: types.CodeType(...) and code.replace(...)
    denied_imports = frozenset({"ctypes", "_ctypes", "_testcapi", "_testinternalcapi", "_xxsubinterpreters"})
    frame_attrs = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
    busy = set()
    get_ident, getframe, basename, fsdecode, realpath = _thread.get_ident, sys._getframe, os.path.basename, \
        os.fsdecode, os.path.realpath

    def caller():
        busy.add(get_ident())  # the hook's own getframe call raises the event again
        try:
            return getframe(2)
        finally:
            busy.discard(get_ident())

    def hook(event, args):
        if event in denied or event.startswith("ctypes."):
            raise RuntimeError("%s is not allowed in the sandbox" % event)
        if event == "object.__getattr__" and args[1] in frame_attrs:
            raise RuntimeError("frame access (%s) is not allowed in the sandbox" % args[1])
        if event == "import" and args[0] in denied_imports:
            raise RuntimeError("importing %s is not allowed in the sandbox" % args[0])
        if event == "import" and isinstance(args[1], str) and not realpath(args[1]).startswith(trusted):
            raise RuntimeError("importing %s from %s is not allowed in the sandbox" % args[:2])
        if event == "open" and isinstance(args[0], (str, bytes)) and basename(fsdecode(args[0])) == "mem":
            raise RuntimeError("opening %r is not allowed in the sandbox" % (args[0],))
        if event in ("marshal.loads", "marshal.load") and get_ident() not in busy:
            frame = caller()
            path = frame.f_locals.get("bytecode_path") if frame.f_code is unmarshal else None
            if not (isinstance(path, str) and realpath(path).startswith(trusted)):
                raise RuntimeError("%s is not allowed in the sandbox" % event)
        if event == "sys._getframe" and get_ident() not in busy and caller().f_code not in allowed:
            raise RuntimeError("sys._getframe is not allowed in the sandbox")

    sys.addaudithook(hook)


def _worker(requests, replies):
    """Run the solution sent first, then answer the judge's requests until told to stop (or killed)."""
    import operator  # noqa: E401
    import types
    objects = {}

    def handle(value):
        objects[len(objects)] = value
        return len(objects) - 1

    def answer(message):
        verb = message[0]
        if verb == "code":
            ns = {"__name__": "solution", "__builtins__": builtins}
            exec(compile(message[1], "solution.py", "exec"), ns)
            shadow = vars(builtins)
            return {k: v for k, v in ns.items() if type(k) is str and not k.startswith("__") and k not in shadow
                    and not isinstance(v, types.ModuleType)}
        args = decode(message[2], objects.__getitem__) if len(message) > 2 else []
        target = objects[message[1]]
        if verb == "call":
            kwargs = decode(message[3], objects.__getitem__)
            result = target(*args, **kwargs)
            return [result, args, kwargs]  # the arguments after the call: mutations travel back
        if verb == "getattr":
            return getattr(target, *args)
        if verb == "setattr":
            return setattr(target, *args)
        if verb == "iter":
            return list(target)
        op = getattr(builtins, verb, None) if verb in ("bool", "len", "next", "str", "repr", "hash", "int",
                                                          "float") else getattr(operator, verb)
        return op(target, *args)

    for line in requests:
        message = json.loads(line)
        if message == ["exit"]:
            break
        try:
            reply = ["ok", encode(answer(message), handle)]
        except BaseException as exc:  # everything the solution raises is an answer too
            if message[0] == "code":
                sys.__excepthook__(type(exc), exc, exc.__traceback__)
            reply = ["err", type(exc).__name__, str(exc)[:2000]]
        try:
            replies.write(_dump(reply))
        except (TypeError, ValueError):  # an exception message or value JSON cannot carry
            replies.write(_dump(["err", "TypeError", "value cannot cross the sandbox boundary"]))
        sys.stdout.flush()  # what the solution printed, before the judge may kill this process
        sys.stderr.flush()
        replies.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------- the judge


class WorkerLost(BaseException):
    """The worker died or sent what no honest worker sends: this and every later case fail
    (a BaseException, so a case's ``except Exception`` cannot swallow it)."""


class SolutionError(Exception):
    """An exception of the solution's own type, raised again in the judge as ``Type: message``."""


class Link:
    """The judge's end of the pipes to the worker."""

    def __init__(self, requests, replies):
        self.requests, self.replies, self.lost = requests, replies, False

    def send(self, message):
        self.requests.write(_dump(message))
        self.requests.flush()

    def ask(self, *message):
        """Send one request; the decoded answer, or the solution's exception raised here."""
        if self.lost:
            raise WorkerLost("the solution's process is gone")
        try:
            self.send(list(message))
            reply = json.loads(self.replies.readline(MAX_REPLY))
            if reply[0] == "ok" and len(reply) == 2:
                return decode(reply[1], lambda i: Remote(self, i))
            kind, text = reply[1], reply[2]
            if type(kind) is not str or type(text) is not str or reply[0] != "err" or len(reply) != 3:
                raise ValueError("malformed reply")
        except (OSError, ValueError, TypeError, LookupError, RecursionError, MemoryError) as exc:
            self.lost = True
            raise WorkerLost("the solution's process is gone or answered out of protocol (%s)" % exc) from None
        builtin = getattr(builtins, kind, None)
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            raise builtin(text)
        raise SolutionError("%s: %s" % (kind, text))


def _wrap(value):
    """``value`` as a message: plain data and handles of the worker's objects; nothing else of the
    judge's (a function of the tests, say) crosses."""
    def handle(v):
        if isinstance(v, Remote):
            return object.__getattribute__(v, "_id")
        raise TypeError("a %s cannot be passed to the solution across the sandbox boundary" % type(v).__name__)
    return encode(value, handle)


def _write_back(before, after):
    """Copy the worker's post-call state of the mutable arguments into the judge's objects."""
    for mine, theirs in zip(before, after):
        if isinstance(mine, (list, bytearray)) and isinstance(theirs, type(mine)):
            mine[:] = theirs
        elif isinstance(mine, (dict, set)) and isinstance(theirs, type(mine)):
            mine.clear()
            mine.update(theirs)


class Remote:
    """A handle to an object of the solution's: calls and attribute access go to the worker. Compared
    (``==``, ``<``, ``in``) with plain data it is never equal and has no order: the value an object
    claims to equal would otherwise be read off the test (the always-equal hack)."""

    __slots__ = ("_link", "_id")

    def __init__(self, link, id_):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_id", id_)

    def _op(self, verb, *args):
        return object.__getattribute__(self, "_link").ask(verb, object.__getattribute__(self, "_id"),
                                                          _wrap(list(args)))

    def __call__(self, *args, **kwargs):
        link, id_ = object.__getattribute__(self, "_link"), object.__getattribute__(self, "_id")
        result, args_after, kwargs_after = link.ask("call", id_, _wrap(list(args)), _wrap(kwargs))
        _write_back(list(args) + list(kwargs.values()), list(args_after) + list(kwargs_after.values()))
        return result

    def __getattr__(self, name):
        return self._op("getattr", name)

    def __setattr__(self, name, value):
        self._op("setattr", name, value)

    def __iter__(self):
        return iter(self._op("iter"))

    def __next__(self):
        return self._op("next")

    def __contains__(self, item):
        raise TypeError("'in' on an object of the solution is not supported across the sandbox boundary")


def _forward(verb):
    """``Remote.__verb__``: the operator evaluated in the worker (a comparison only with another handle)."""
    if verb in ("eq", "ne", "lt", "le", "gt", "ge"):
        return lambda self, other: self._op(verb, other) if isinstance(other, Remote) else NotImplemented
    return lambda self, *args: self._op(verb, *args)


for _verb in ("bool", "len", "str", "repr", "hash", "int", "float", "index", "getitem", "setitem", "delitem", "eq",
              "ne", "lt", "le", "gt", "ge"):
    setattr(Remote, "__%s__" % _verb, _forward(_verb))
del _verb


def _fork_worker(result_fd):
    """Fork the worker before the judge has read its input (so the worker's memory holds nothing of it):
    in the child, the result file and stdin are closed, the pipes are descriptors 3 (requests) and 4
    (answers), and it serves the judge; the judge gets the child's pid and its ends of the pipes."""
    (worker_in, judge_out), (judge_in, worker_out) = os.pipe(), os.pipe()
    pid = os.fork()
    if pid:
        os.close(worker_in)
        os.close(worker_out)
        return pid, os.fdopen(judge_out, "wb"), os.fdopen(judge_in, "rb")
    try:
        for fd in (result_fd, judge_out, judge_in, 0):
            os.close(fd)
        os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor: 0
        for fd, want in ((worker_in, 200), (worker_out, 201), (200, 3), (201, 4)):  # via free numbers:
            os.dup2(fd, want, inheritable=False)  # neither pipe's number may be the other's target
        os.closerange(5, 1 << 16)
        sys.argv = ["solution.py"]
        _harden()
        _worker(os.fdopen(3, "rb"), os.fdopen(4, "wb"))
    finally:
        os._exit(1)


def _judge(payload, result_fd, worker):
    """Send the worker the solution, run each case here; write the signed line for the count."""
    import traceback
    pid, requests, replies = worker
    nonce, tests, source = bytes.fromhex(payload.pop("nonce")), payload.pop("tests"), payload.pop("code")
    markers = signed_lines(nonce, len(tests))  # the nonce itself is never written anywhere
    del nonce
    link, passed, failures = Link(requests, replies), 0, []
    try:
        names = link.ask("code", source)
    except BaseException as exc:  # the solution raised (its traceback is on stderr): no case passes
        names, tests = None, ()
        failures.append("the solution did not run: %s" % "".join(traceback.format_exception_only(type(exc), exc)))
    del source
    ns = dict(names or {}, __builtins__=builtins)
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), ns)
            passed += 1
        except BaseException as exc:
            failures.append("".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000])
    if not link.lost:  # let the worker flush what the solution printed
        with _suppress(OSError):
            link.send(["exit"])
            _wait(pid, 1.0)
    with _suppress(OSError):
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    for text in failures:  # written once the worker is gone: it never reads the judge's words
        sys.stderr.write("case failed: %s\n" % text.strip())
    sys.stderr.flush()
    os.write(result_fd, markers[passed])
    os._exit(0)


class _suppress:
    def __init__(self, *kinds):
        self.kinds = kinds

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, self.kinds)


def _wait(pid, timeout):
    """Wait up to ``timeout`` seconds for the child ``pid`` to exit."""
    import time
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.002)


def _main():
    """Set the rlimits; for tests, fork the worker and make the judge non-dumpable; read the input and
    put /dev/null on stdin; then run the code or the tests."""
    import resource
    for name, value in json.loads(sys.argv[1]).items():
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value + 1 if name == "CPU" else value))
    result_fd = int(sys.argv[2])
    if sys.argv[3] == "tests":
        import ctypes  # noqa: E401,F401  (the worker's, imported once)
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0: the worker cannot read the judge
        worker = _fork_worker(result_fd)
    payload = json.loads(sys.stdin.buffer.read())
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor: 0
    if payload["mode"] == "tests":
        _judge(payload, result_fd, worker)
    os.close(result_fd)
    sys.argv = ["main.py"]
    code = compile(payload.pop("code"), "main.py", "exec")
    del payload
    exec(code, {"__name__": "__main__", "__builtins__": sys.modules["builtins"]})


if __name__ == "__main__":
    _main()
