"""`cispo --help`, `cispo train --help` (and pretrain's, compare's) and a config error answer without loading torch (issue 30,
item 9): the command line imports each command's modules when it runs, not at start-up."""

import importlib
import json
import subprocess
import sys

from cispo.cli import INPUT_ERRORS, RUN_ERRORS, is_one_of

HEAVY = ("torch", "transformers", "datasets", "pandas", "matplotlib", "safetensors")

PROBE = """
import contextlib, io, json, sys
from cispo.cli import main
out, codes = io.StringIO(), []
for argv in (["--help"], ["train", "--help"], ["pretrain", "--help"], ["compare", "--help"], ["train", "beta=0.04"], ["train", "steps=0"],
             ["train", "objective_overrides.eps_high_is=-1"]):
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            codes.append(main(argv))
        except SystemExit as e:
            codes.append(e.code)
    if argv == ["train", "objective_overrides.eps_high_is=-1"]:  # the last one: what has been imported so far
        loaded = sorted({m.split(".")[0] for m in sys.modules})
print(json.dumps({"codes": codes, "loaded": loaded, "out": out.getvalue()}))
"""


def test_help_and_config_errors_do_not_import_torch():
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["codes"] == [0, 0, 0, 0, 2, 2, 2]
    assert set(HEAVY) & set(result["loaded"]) == set()  # pretrain's and compare's configs are plain data too
    out = result["out"]
    assert "optim.lr: float" in out and "corpus_size: int" in out  # train's and pretrain's field help, built on demand
    assert "learning_rates" in out  # compare's
    assert "steps must be >= 1" in out and "ObjectiveConfig.eps_high_is must be a finite number" in out


def test_help_alone_imports_nothing_heavy():
    probe = ("import sys\nfrom cispo.cli import main\nfor argv in (['--help'], ['train', '--help'], ['train', 'beta=1']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print(sorted({m.split('.')[0] for m in sys.modules}))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not set(HEAVY) & set(eval(run.stdout.splitlines()[-1]))


def test_the_errors_caught_by_name_exist():
    """The command line catches its errors by qualified name (importing nothing): each names a class."""
    for name in INPUT_ERRORS + RUN_ERRORS:
        module, _, cls = name.rpartition(".")
        error = getattr(importlib.import_module(module), cls)
        assert issubclass(error, Exception) and f"{error.__module__}.{error.__qualname__}" == name
    from cispo.config.train import ConfigError

    class Sub(ConfigError): ...

    assert is_one_of(Sub("x"), INPUT_ERRORS) and not is_one_of(ValueError("x"), INPUT_ERRORS)
