"""`cispo --help`, `cispo train --help` (and pretrain's and sft's) and a config error answer without loading torch:
the command line imports each command's modules when it runs, not at start-up."""

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
for argv in (["--help"], ["train", "--help"], ["pretrain", "--help"], ["sft", "--help"], ["sft", "epochs=0"],
             ["train", "beta=0.04"], ["train", "steps=0"], ["train", "algo.objective.eps_high_is=-1"]):
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            codes.append(main(argv))
        except SystemExit as e:
            codes.append(e.code)
    if argv == ["train", "algo.objective.eps_high_is=-1"]:  # the last one: what has been imported so far
        loaded = sorted({m.split(".")[0] for m in sys.modules})
print(json.dumps({"codes": codes, "loaded": loaded, "out": out.getvalue()}))
"""


def test_help_and_config_errors_do_not_import_torch():
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["codes"] == [0, 0, 0, 0, 2, 2, 2, 2]
    assert set(HEAVY) & set(result["loaded"]) == set()  # pretrain's config is plain data too
    out = result["out"]
    assert "optim.lr: float" in out and "corpus_size: int" in out  # train's and pretrain's field help, built on demand
    assert "data.call_share: float | None" in out and "epochs must be in [1, 10^6]" in out  # sft's
    assert "steps must be >= 1" in out and "algo.objective: eps_high_is must be a finite number" in out


def test_help_alone_imports_nothing_heavy():
    probe = ("import sys\nfrom cispo.cli import main\nfor argv in (['--help'], ['train', '--help'], ['train', "
             "'beta=1']):\n"
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


# --------------------------------------------------------------------------- the toy run's start-up


def test_prompt_lengths_are_those_of_encode(tmp_path):
    """`Policy.prompt_lengths` (one call of the tokenizers library) counts what `Policy.encode` gives sample by
    sample; a tokenizer with truncation set on its backend takes the one-by-one path."""
    import torch

    from cispo.models.builtin import ensure_builtin_model
    from cispo.models.loading import load_policy
    from cispo.models.packaged import save_tiny_smollm2
    from cispo.models.policy import Policy, batch_encoder

    samples = [{"prompt": p} for p in ("12+34=", "", "Ünïcödé  spaces\n\ttabs", "<|endoftext|>a <|im_start|>",
                                       "9" * 300)]
    for path in (ensure_builtin_model("addition"), save_tiny_smollm2(tmp_path / "smollm2")):
        model, tokenizer = load_policy(path)
        policy = Policy(model, tokenizer, sampler=None, device=torch.device("cpu"))
        assert batch_encoder(tokenizer) is not None
        assert policy.prompt_lengths(samples) == [len(policy.encode(s)) for s in samples]
        tokenizer.backend_tokenizer.enable_truncation(3)
        assert batch_encoder(tokenizer) is None
        assert policy.prompt_lengths(samples) == [len(policy.encode(s)) for s in samples]


def run_probe(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; the words it printed."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split()


def test_a_model_without_lora_does_not_import_peft():
    probe = ("import sys, torch\nfrom cispo.models.lora import _unwrap, has_lora\nm = torch.nn.Linear(2, 2)\n"
             "print(has_lora(m), _unwrap(m) is m, 'peft' in sys.modules)")
    assert run_probe(probe) == ["False", "True", "False"]


def test_only_the_program_skips_the_exit_collection():
    """`cispo.cli.main()` on ``sys.argv`` (the program, about to exit) freezes the collector's objects;
    ``main([...])`` (a caller such as a test) leaves its collector alone."""
    probe = ("import gc, sys\nfrom cispo.cli import main\nmain(['train', 'steps=0'])\nbefore = gc.get_freeze_count()\n"
             "sys.argv = ['cispo', 'train', 'steps=0']\ncode = main()\nprint(before, gc.get_freeze_count() > 0, code)")
    assert run_probe(probe) == ["0", "True", "2"]


def test_the_program_imports_with_the_collector_paused():
    """`collector_paused`: for the program, the block runs with the collector off and what it made is frozen
    after it, the collector on again; for any other caller, a plain block."""
    probe = ("import gc\nfrom cispo.cli import collector_paused\nwith collector_paused(False):\n    import json\n"
             "print(gc.isenabled(), gc.get_freeze_count())\nwith collector_paused(True):\n    off = not "
             "gc.isenabled()\n"
             "    import email.parser\nprint(off, gc.isenabled(), gc.get_freeze_count() > 0)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "0", "True", "True", "True"]


def test_train_help_documents_recipes_and_lists_the_tasks(capsys):
    """Issue 59: `cispo train --help` said nothing of ``recipe=`` nor which ``data.task`` names exist."""
    import pytest

    from cispo.cli import main
    from cispo.config.data import BUILTIN_TASKS
    from cispo.config.recipes import RECIPES
    from cispo.data.tasks import list_tasks

    assert list(BUILTIN_TASKS) == list_tasks()  # the torch-free list the help prints
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "recipe=NAME stands for a paper's settings" in out and "{recipe}__{task}__seed{seed}" in out
    assert all(f"{name}: " in out for name in RECIPES)
    assert ", ".join(BUILTIN_TASKS) in out
