"""What `cispo.rewards.sandbox` runs inside bwrap: ``python -I -S harness.py LIMITS RESULT_FD``.

Standard library only; cispo imports only `signed_lines`. How it works: docs/code-sandbox.md ("The test harness").
"""

import hmac
import json
import os
import sys


def signed_lines(nonce, n):
    """The verdict line ``k n HMAC-SHA256(nonce, "k n")`` for each count k of n cases (code.py checks it)."""
    return tuple(b"%d %d %s\n" % (k, n, hmac.new(nonce, b"%d %d" % (k, n), "sha256").hexdigest().encode())
                 for k in range(n + 1))


def _harden():
    """Make the process non-dumpable and install an audit hook that refuses the routes to the worker's state."""
    import collections, ctypes, enum, logging, typing, _thread  # noqa: E401
    logging._srcfile = None  # log records without caller lookup (it needs frames, refused below)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0: no /proc/<pid>/mem, no ptrace
    for name in [n for n in sys.modules if n.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]
    # Code objects allowed to call sys._getframe (they only read the caller's module name).
    allowed = {getattr(fn, "__code__", None) for fn in (collections.namedtuple, getattr(typing, "_caller", None),
                                                         getattr(getattr(enum, "EnumType", None), "_create_", None))}
    denied = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                        "sys._current_exceptions", "sys.settrace", "sys.setprofile", "sys.addaudithook", "os.symlink"})
    denied_imports = frozenset({"ctypes", "_ctypes", "_testcapi", "_testinternalcapi", "_xxsubinterpreters"})
    frame_attrs = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
    busy = set()
    get_ident, getframe, basename, fsdecode = _thread.get_ident, sys._getframe, os.path.basename, os.fsdecode

    def hook(event, args):
        if event in denied or event.startswith("ctypes."):
            raise RuntimeError("%s is not allowed in the sandbox" % event)
        if event == "object.__getattr__" and args[1] in frame_attrs:
            raise RuntimeError("frame access (%s) is not allowed in the sandbox" % args[1])
        if event == "import" and args[0] in denied_imports:
            raise RuntimeError("importing %s is not allowed in the sandbox" % args[0])
        if event == "open" and isinstance(args[0], (str, bytes)) and basename(fsdecode(args[0])) == "mem":
            raise RuntimeError("opening %r is not allowed in the sandbox" % (args[0],))
        if event == "sys._getframe" and get_ident() not in busy:  # busy: the hook's own getframe call
            busy.add(get_ident())
            try:
                caller = getframe(1).f_code
            finally:
                busy.discard(get_ident())
            if caller not in allowed:
                raise RuntimeError("sys._getframe is not allowed in the sandbox")

    sys.addaudithook(hook)


def _runner(source, tests, safe, box, done):
    """The worker thread: run the solution, then each test case with the saved builtins ``safe``."""
    exec_, compile_, type_, str_ = safe["exec"], safe["compile"], safe["type"], safe["str"]
    base_exception = safe["BaseException"]
    excepthook, exc_info = sys.__excepthook__, sys.exc_info

    def failed():
        try:
            excepthook(*exc_info())
        except base_exception:
            pass

    passed = 0
    try:
        ns = {"__name__": "solution", "__builtins__": sys.modules["builtins"]}
        exec_(compile_(source, "solution.py", "exec"), ns)
        tests_ns = {k: v for k, v in ns.items() if type_(k) is str_ and k not in safe}  # shadowed builtins left out
        tests_ns["__builtins__"] = safe
        for i, test in enumerate(tests):
            try:
                exec_(compile_(test, "<test %d>" % i, "exec"), tests_ns)
                passed += 1
            except base_exception:
                failed()
    except base_exception:  # the solution raised: no case passes
        failed()
    finally:
        box[0] = passed
        done.release()


def _tests(payload, result_fd):
    """Run the solution and the cases in a worker thread; write the signed line for its count to ``result_fd``."""
    import builtins, signal, _thread  # noqa: E401
    nonce, tests, source = bytes.fromhex(payload["nonce"]), payload["tests"], payload["code"]
    markers = signed_lines(nonce, len(tests))  # the nonce itself is never written anywhere
    payload.clear()  # the caller's reference too: the nonce and the cases are nowhere but here
    del nonce
    write, exit_, flush_out, flush_err = os.write, os._exit, sys.stdout.flush, sys.stderr.flush
    safe = dict(builtins.__dict__)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # _thread.interrupt_main() then does nothing
    _harden()
    box, done = [0], _thread.allocate_lock()
    done.acquire()
    _thread.start_new_thread(_runner, (source, tests, safe, box, done))
    del source, tests, safe
    # From here the main thread only calls C functions: no code of the solution runs on this stack.
    done.acquire()
    flush_out()
    flush_err()
    write(result_fd, markers[box[0]])
    exit_(0)


def _main():
    """Set the rlimits, read the input and put /dev/null on stdin, then run the code or the tests."""
    import resource
    for name, value in json.loads(sys.argv[1]).items():
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value + 1 if name == "CPU" else value))
    payload = json.loads(sys.stdin.buffer.read())
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor: 0
    if payload["mode"] == "tests":
        _tests(payload, int(sys.argv[2]))
    os.close(int(sys.argv[2]))
    sys.argv = ["main.py"]
    code = compile(payload.pop("code"), "main.py", "exec")
    del payload
    exec(code, {"__name__": "__main__", "__builtins__": sys.modules["builtins"]})


if __name__ == "__main__":
    _main()
