"""Every script in benchmarks/<group>/ runs at its --tiny size and prints its table.

The scripts print ratios measured in the same run; nothing here asserts a time. The non-TRL
scripts run one after another in a single subprocess (one torch / transformers import, ~30 s
on 2 shared cores); the TRL one needs trl in this interpreter and is skipped otherwise.
"""

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cispo.models.packaged import save_tiny_smollm2

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
SCRIPTS = {  # script (under benchmarks/) -> the string(s) its --tiny output must contain
    "kernels/bench_logprobs.py": "time / naive",
    "kernels/bench_padding.py": "split-cost",
    "rollout/bench_rollout.py": ("HF generate", "self ms"),
    "kernels/bench_update.py": ("fraction of matmul rate", "update / bare Hugging Face loop"),
    "step/bench_step.py": "logp_old s (share)",
    "step/bench_rewards.py": "us / call",
    "kernels/bench_precision.py": "vs float32",
    "step/bench_first_step.py": ("first-call", "step 1 / main's step 1"),
    "rollout/bench_shared_prompt.py": ("update by group", "speed-up"),
    "step/bench_logp_old.py": "recompute / rollout",
    "rollout/bench_async.py": "sync / async",
    "rollout/bench_decode_floor.py": ("exponential / inverse-CDF by pair", "bandwidth floor"),
    "rollout/bench_observation_prefill.py": "prefilled / token by token",
    "vs_trl/bench_startup.py": ("start-up / floor", "largest top-level imports"),
}
TRL_SCRIPTS = {"vs_trl/bench_trl.py", "vs_trl/bench_trl_smollm2.py"}  # need trl: tested one by one below

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
                         cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    sections = dict(s.split("\n", 1) for s in out.stdout.split("=== ")[1:])
    for script, marker in SCRIPTS.items():
        text = sections.get(str(BENCH / script), "")
        for m in (marker,) if isinstance(marker, str) else marker:
            assert m in text, f"{script}:\n{text}"


def test_every_benchmark_is_covered():
    scripts = {p.relative_to(BENCH).as_posix() for p in BENCH.glob("*/bench_*.py")}
    assert scripts == set(SCRIPTS) | TRL_SCRIPTS
    assert not list(BENCH.glob("bench_*.py")), "a benchmark belongs in the folder of the question it answers"


def test_the_benchmarks_readme_lists_every_script():
    """benchmarks/README.md's table names every runnable script by the path it is run with."""
    readme = (BENCH / "README.md").read_text()
    runnable = [*SCRIPTS, *TRL_SCRIPTS, "gpu/gpu_check.py", "step/soak.py"]
    missing = [s for s in runnable if f"python benchmarks/{s}" not in readme]
    assert not missing, missing
    assert set(runnable) == {p.relative_to(BENCH).as_posix() for p in BENCH.glob("*/[!_]*.py")}


def _trl_importable() -> bool:
    if importlib.util.find_spec("trl") is None:
        return False
    try:
        import trl  # noqa: F401
    except Exception:  # noqa: BLE001 - installed but broken counts as missing
        return False
    return True


NO_TRL = "trl is not importable in this interpreter (pip install 'cispo[bench]')"


@pytest.mark.skipif(not _trl_importable(), reason=NO_TRL)
def test_bench_trl_tiny():
    out = subprocess.run([sys.executable, str(BENCH / "vs_trl" / "bench_trl.py"), "--tiny"], capture_output=True,
                         text=True, timeout=240, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ours / TRL" in out.stdout and "| TRL" in out.stdout, out.stdout


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text}"
    return float(found.group(1))


@pytest.mark.skipif(not _trl_importable(), reason=NO_TRL)
def test_bench_trl_smollm2_end_to_end(tmp_path):
    """The SmolLM2 benchmark's whole path on a tiny random Llama with SmolLM2's tokenizer and chat template
    (every worker in one process, a small matmul): both trainers take the same prompts, cispo samples
    on the static-cache decode, and the ratio and every FLOP share are printed as finite numbers."""
    model = save_tiny_smollm2(tmp_path / "tiny_smollm")
    out = subprocess.run([sys.executable, str(BENCH / "vs_trl" / "bench_trl_smollm2.py"), "--model", str(model),
                          "--pairs", "1", "--steps", "1", "--prompts", "2", "--group", "2", "--max-new-tokens", "4",
                          "--updates", "1",
                          "--threads", "1", "--in-process", "--bf16-steps", "1", "--mm-repeats", "1",
                          "--mm-shape", "64,64,64"], capture_output=True, text=True, timeout=240, cwd=REPO,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "cispo sampling: static-cache decode" in text, text
    tokens = dict(re.findall(r"(TRL|cispo|cispo-bf16) (\d+)", text.split("prompt tokens per step (median): ")[1]
                             .split("\n")[0]))
    assert set(tokens) == {"TRL", "cispo", "cispo-bf16"} and len(set(tokens.values())) == 1, tokens
    for pattern in (r"steps/s by pair .*?: ([\d.]+); median", r"; median ([\d.]+)", r"steps/s x([\d.]+)",
                    r"bf16 autocast / fp32 time .*?step x([\d.]+)", r"log-prob gap.*?fp32 ([\d.e+-]+)"):
        assert math.isfinite(_number(pattern, text)) and _number(pattern, text) >= 0, pattern
    flop_table = text.split("useful FLOP rate")[1]
    for side in ("TRL", "cispo", "cispo-bf16"):
        row = next(line for line in flop_table.splitlines() if line.startswith(f"| {side} "))
        shares = [float(x) for x in re.findall(r"([\d.]+)%", row)]
        assert len(shares) == 4 and all(math.isfinite(x) and x > 0 for x in shares), row
        assert shares[3] <= shares[2], row  # each prompt counted once per group: no more useful work in the same time
    phases = text.split("each phase against its floor")[1]
    for side in ("TRL", "cispo", "cispo-bf16"):
        for phase in ("sample", "update"):
            row = next(line for line in phases.splitlines() if line.startswith(f"| {side} ") and f"| {phase} " in line)
            share = re.findall(r"([\d.]+)%", row)
            assert len(share) == 1 and 0 < float(share[0]) and math.isfinite(float(share[0])), row
    # K = 1 and logp_old from the update: cispo's no-grad pass computes no row, and the table says so
    row = next(line for line in phases.splitlines() if line.startswith("| cispo ") and "| logp_old " in line)
    assert "%" not in row and "| -" in row, row


def test_update_flops_counts_a_shared_prompt_once_per_group():
    """``group=1`` is the per-row formula (S = P + T - 1 positions a row); ``group=G`` counts the prompt's P
    positions once per G rows, each row keeping its T - 1 response positions and their attention over the prompt."""
    sys.path.insert(0, str(REPO))
    from benchmarks._common import update_flops
    from cispo.data.tasks.arithmetic import ALPHABET
    from cispo.models.loading import build_model, build_tokenizer

    model = build_model(build_tokenizer(ALPHABET), size="tiny", seed=0)
    c, rows, P, T = model.config, 8, 10.0, 5.0
    one, shared = update_flops(model, rows, P, T), update_flops(model, rows, P, T, group=rows)
    S = P + T - 1
    assert one["attention"] == 12 * c.num_hidden_layers * c.hidden_size * S * S * rows
    assert one["head"] == shared["head"]
    assert shared["linear"] / one["linear"] == (P + rows * (T - 1)) / (rows * S)
    assert shared["attention"] == 12 * c.num_hidden_layers * c.hidden_size * (P * P + rows * (T - 1) * (2 * P + T - 1))


@pytest.mark.skipif(not _trl_importable(), reason=NO_TRL)
def test_bench_startup_against_trl_tiny():
    """The toy workload end to end through TRL's GRPOTrainer as a third arm: it runs and the pair ratio prints."""
    script = BENCH / "vs_trl" / "bench_startup.py"
    out = subprocess.run([sys.executable, str(script), "--tiny", "--trl", "--imports", "0"], capture_output=True,
                         text=True, timeout=240, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| trl " in out.stdout and math.isfinite(_number(r"TRL / cispo whole process x([\d.]+)", out.stdout))


# --------------------------------------------------------------------------- gpu/gpu_check.py

GPU_CHECK = BENCH / "gpu" / "gpu_check.py"
BARE_IMAGE = BENCH / "gpu" / "_bare_image.py"  # runs a script with pydantic & co. hidden, as on a bare CUDA image
ALL_SECTIONS = ("environment", "lm_head", "precision", "logprob_agreement", "rl_eager", "rl_compiled", "head_share",
                "long_responses", "decode_batch", "checkpoint")
FAST_SECTIONS = tuple(n for n in ALL_SECTIONS if n != "rl_compiled")
LOADED_CPU = ("--cap-scale", "10", "--budget-s", "1200")
"""The caps are sized for a GPU (15-45 s a section); the tiny sizes take ~30 s in all on 2 idle cores,
but a shared, loaded machine can take several times that, and a cap firing would fail a test that
checks numbers, not time. The cap tests below set their own."""


def _gpu_check(out: Path, *args: str, bare: bool = False) -> dict:
    cmd = [sys.executable, *([str(BARE_IMAGE)] if bare else []), str(GPU_CHECK), "--tiny", "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


def _leaves(x, path=""):
    """(dotted path, value) of every scalar in a JSON tree."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}.{i}" if path else str(i))
    else:
        yield path, x


def _check_sections(report: dict, names, tmp_path: Path) -> None:
    assert list(report["sections"]) == list(names)
    for name, sec in report["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"), sec.get("traceback"))
        nulls = sec["null_reasons"]
        for path, value in _leaves(sec["results"]):
            if value is None:  # only where the section says why (e.g. CUDA memory on a CPU)
                assert any(path == k or path.startswith(k + ".") for k in nulls), \
                    f"{name}.{path} is null without a reason"
            elif isinstance(value, float):
                assert math.isfinite(value), f"{name}.{path} = {value}"
        assert all(isinstance(r, str) and r for r in nulls.values())
    md = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {n}: ok" in md for n in names), md


def _check_figures(report: dict, tmp_path: Path) -> None:
    """Numbers that must hold on any device, at any size (no timing)."""
    s = report["sections"]
    rows = s["lm_head"]["results"]["rows"]
    assert len(rows) == 8 and all(r["seconds"] > 0 for r in rows)
    err = {(r["mode"], r["variant"]): r["max_abs_err_vs_fp64"] for r in rows}
    assert err[("fwd", "chunked fp32 head")] < 1e-3 < err[("fwd", "chunked bf16 head")]
    if report["meta"]["device"] == "cpu":  # CUDA memory: explicit nulls with a reason
        assert all(r["peak_extra_gib"] is None for r in rows)
        assert "CUDA" in s["lm_head"]["null_reasons"]["rows.0.peak_extra_gib"]
    prec = s["precision"]["results"]
    master, bf16 = prec["fp32 master + bf16 autocast"], prec["pure bf16"]
    assert master["frac_changed_after_step"][0] > 0.9  # lr 1e-6 moves fp32 weights...
    assert bf16["frac_changed_after_step"][0] < 0.5 * master["frac_changed_after_step"][0]  # ...most bf16 ones not
    assert bf16["param_gib"] == pytest.approx(master["param_gib"] / 2)
    agree = s["logprob_agreement"]["results"]
    assert agree["sampler"].startswith("torch") and "vllm" in s["logprob_agreement"]["null_reasons"]  # no vLLM here
    both_bf16 = agree["pairs"]["sampler bf16 head / trainer bf16 head"]
    both_fp32 = agree["pairs"]["sampler fp32 head / trainer fp32 head"]
    assert both_fp32["mean_abs_dlogp"] < both_bf16["mean_abs_dlogp"]
    assert -1 <= both_bf16["prob_pearson"] <= 1 and both_fp32["prob_pearson"] > 0.99
    assert (tmp_path / "figure3.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rl = s["rl_eager"]["results"]
    assert rl["precision"].startswith("FP32 master weights") and not rl["compiled"]
    assert rl["sampling_tokens_per_s"] > 0 and rl["update_tokens_per_s"] > 0
    assert 0 < rl["response_tokens"] <= rl["rows"] * rl["max_new_tokens"]  # EOS can be sampled
    assert rl["eos"]["swapped_with"] > 2
    share = s["head_share"]["results"]
    assert set(share["fp32_head_share"]) == {"tf32 off", "tf32 on"} and len(share["seconds"]) == 4
    runs = s["long_responses"]["results"]["runs"]
    assert set(runs) == {"gradient checkpointing off", "gradient checkpointing on"}
    assert all(r["update_s"] > 0 for r in runs.values())
    decode = s["decode_batch"]["results"]["rows"]
    assert [r["batch"] for r in decode] == [1, 2, 4] and all(r["tokens_per_s"] > 0 for r in decode)
    ckpt = s["checkpoint"]["results"]
    assert ckpt["save_s"] > 0 and ckpt["load_s"] > 0 and ckpt["gib_on_disk"] > 0


@pytest.mark.slow
def test_gpu_check_tiny(tmp_path):
    """Every section but the compiled RL step (~30 s on 2 shared cores): numbers, a report, a plot.
    Slow: the bare-image test below runs the same sections and checks the same numbers with fewer
    packages importable; this one adds only the full environment, which the rest of the suite uses."""
    report = _gpu_check(tmp_path, *LOADED_CPU, "--sections", ",".join(FAST_SECTIONS))
    _check_sections(report, FAST_SECTIONS, tmp_path)
    _check_figures(report, tmp_path)


def test_gpu_check_tiny_on_a_bare_image(tmp_path):
    """The same with pydantic, scipy, ... not importable (a CUDA image with torch and
    transformers only): every section still runs."""
    report = _gpu_check(tmp_path, *LOADED_CPU, "--sections", ",".join(FAST_SECTIONS), bare=True)
    _check_sections(report, FAST_SECTIONS, tmp_path)
    _check_figures(report, tmp_path)  # the same numbers, report and plot as test_gpu_check_tiny's
    versions = report["sections"]["environment"]["results"]["versions"]
    assert versions["pydantic"] is None and "hidden" not in str(versions)


@pytest.mark.slow
def test_gpu_check_tiny_all_sections(tmp_path):
    """The whole --tiny run on a bare image, ``model.compile=on`` (cispo.models.compile, inductor) included:
    minutes on a CPU, so the caps are raised."""
    report = _gpu_check(tmp_path, *LOADED_CPU, bare=True)
    _check_sections(report, ALL_SECTIONS, tmp_path)
    assert report["sections"]["rl_compiled"]["results"]["compiled"] is True


def test_gpu_check_budget_skips_sections(tmp_path):
    """A spent budget skips the sections still to come, and the report says so."""
    report = _gpu_check(tmp_path, "--budget-s", "0", "--sections", "lm_head,precision")
    assert [s["status"] for s in report["sections"].values()] == ["skipped", "skipped"]
    assert "budget" in report["sections"]["lm_head"]["error"]
    assert "## lm_head: skipped" in (tmp_path / "gpu_check.md").read_text()


STALLED_RL_STEP = """import runpy, sys, time
from cispo.training.rl_step import RLStep
step = RLStep.__call__
def stalled(*a, **k):  # a training step far past any cap: the stop no longer depends on how fast compiling is
    time.sleep(600)
    return step(*a, **k)
RLStep.__call__ = stalled
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpu_check_a_section_past_its_cap_stops_and_keeps_what_it_measured(tmp_path):
    """``--cap-scale`` shrinks each section's cap: rl_compiled, whose training step is made to stall, is
    stopped at 21 s with its partial results (the EOS calibration) in the report; the next section runs."""
    cmd = [sys.executable, "-c", STALLED_RL_STEP, str(GPU_CHECK), "--tiny", "--out", str(tmp_path),
           "--cap-scale", "0.3", "--sections", "rl_compiled,environment"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    stopped, env = report["sections"]["rl_compiled"], report["sections"]["environment"]
    assert stopped["status"] == "stopped" and "time limit" in stopped["error"]
    assert 20 <= stopped["seconds"] < 60
    assert stopped["results"]["eos"]["swapped_with"] > 2 and env["status"] == "ok"
    assert "## rl_compiled: stopped" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_sigterm_keeps_the_report(tmp_path):
    """`timeout` sends SIGTERM: the running section is recorded as stopped, the rest skipped, and the
    report is still written (the compile of rl_compiled takes >= 10 s on a CPU)."""
    proc = subprocess.Popen([sys.executable, "-u", str(GPU_CHECK), "--tiny", "--out", str(tmp_path), "--sections",
                             "rl_compiled,lm_head"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:
            if "rl_compiled: start" in line:
                time.sleep(1.0)
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, rest[-3000:]
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["rl_compiled"]["status"] == "stopped" and "signal" in sections["rl_compiled"]["error"]
    assert sections["lm_head"]["status"] == "skipped" and "signal" in sections["lm_head"]["error"]


def test_gpu_check_bad_set_names_the_field():
    proc = subprocess.run([sys.executable, str(GPU_CHECK), "--out", "unused", "--set", "max_new_tokns=3"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert proc.returncode == 2 and "max_new_tokns=3" in proc.stderr and "max_new_tokens" in proc.stderr
