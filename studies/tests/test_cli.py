"""`python -m studies`: its help and a bad override answer without loading torch (the comparison's config
is plain data), from any working directory, and `cispo` no longer has the study commands."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "datasets", "pandas", "matplotlib", "safetensors", "scipy")

PROBE = """
import contextlib, io, json, sys
from studies.cli import main
out, codes = io.StringIO(), []
for argv in (["--help"], ["compare", "--help"], ["sweep", "--help"], ["data", "--help"], ["report", "--help"],
             ["compare", "algorithms=[grpo,cispo]"]):
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            codes.append(main(argv))
        except SystemExit as e:
            codes.append(e.code)
print(json.dumps({"codes": codes, "loaded": sorted({m.split(".")[0] for m in sys.modules}), "out": out.getvalue()}))
"""


def test_help_and_a_renamed_key_import_nothing_heavy():
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["codes"] == [0, 0, 0, 0, 0, 2]
    assert set(HEAVY) & set(result["loaded"]) == set()
    out = result["out"]
    assert "learning_rates" in out and "ks: list[int]" in out  # compare's and sweep's field help
    assert "--check-doc" in out and "studies/results/study.csv.gz" in out
    assert "studies compare: error: override 'algorithms=[grpo,cispo]': algorithms is now arms" in out


def test_python_m_studies_runs_from_the_repository_root():
    run = subprocess.run([sys.executable, "-m", "studies", "--help"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "{compare,sweep,data,report}" in run.stdout


@pytest.mark.parametrize("command", ["compare", "sweep", "study-data", "study-report"])
def test_the_library_cli_has_no_study_command(command, capsys):
    from cispo.cli import main

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_the_library_imports_nothing_of_the_studies():
    """``cispo/`` never imports ``studies`` (the studies use the library, never the reverse)."""
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "cispo").rglob("*.py")
                 if any(line.lstrip().startswith(("import studies", "from studies"))
                        for line in p.read_text().splitlines())]
    assert offenders == []
