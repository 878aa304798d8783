"""Every script in benchmarks/ runs at its --tiny size and prints its table.

The scripts print ratios measured in the same run; nothing here asserts a time. The non-TRL
scripts run one after another in a single subprocess (one torch / transformers import, ~30 s
on 2 shared cores); the TRL one needs trl in this interpreter and is skipped otherwise.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = {  # script -> a string its --tiny output must contain
    "bench_logprobs.py": "time / naive",
    "bench_padding.py": "split-cost",
    "bench_rollout.py": "HF generate",
    "bench_update.py": "fraction of matmul rate",
    "bench_step.py": "logp_old s (share)",
    "bench_rewards.py": "us / call",
}

RUNNER = """
import contextlib, io, runpy, sys
for script in sys.argv[1:]:
    sys.argv = [script, "--tiny"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(script, run_name="__main__")
    print("=== " + script)
    print(out.getvalue())
"""


def test_benchmarks_tiny():
    paths = [str(BENCH / s) for s in SCRIPTS]
    out = subprocess.run([sys.executable, "-c", RUNNER, *paths], capture_output=True, text=True, timeout=240,
                         cwd=BENCH.parent, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    sections = dict(s.split("\n", 1) for s in out.stdout.split("=== ")[1:])
    for script, marker in SCRIPTS.items():
        text = sections.get(str(BENCH / script), "")
        assert marker in text, f"{script}:\n{text}"


def test_every_benchmark_is_covered():
    scripts = {p.name for p in BENCH.glob("bench_*.py")}
    assert scripts == set(SCRIPTS) | {"bench_trl.py"}


def _trl_importable() -> bool:
    if importlib.util.find_spec("trl") is None:
        return False
    try:
        import trl  # noqa: F401
    except Exception:  # noqa: BLE001 - installed but broken counts as missing
        return False
    return True


@pytest.mark.skipif(not _trl_importable(), reason="trl is not importable in this interpreter (pip install 'cispo[bench]')")
def test_bench_trl_tiny():
    out = subprocess.run([sys.executable, str(BENCH / "bench_trl.py"), "--tiny"], capture_output=True, text=True,
                         timeout=240, cwd=BENCH.parent, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ours / TRL" in out.stdout and "| TRL" in out.stdout, out.stdout
