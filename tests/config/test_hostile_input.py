"""Hostile and careless config input: each is one line that names the file and
line (or the override) and the key, fast; never a traceback, a hang, or a message the size of the
input. The cases that hung before (``/dev/zero``, a FIFO, an alias bomb of 10^9 leaves) run
``cispo train`` in a subprocess with a timeout, so a regression fails instead of hanging."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time

import pytest

from cispo.config import engine
from cispo.config.engine import (
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    MAX_INT_CHARS,
    MAX_PROBLEMS,
    short_repr,
)
from cispo.config.train import (
    MAX_SEED,
    UPPER_BOUNDS,
    ConfigError,
    TrainConfig,
    apply_overrides,
    field_docs,
    from_dict,
    load_yaml,
)


def bomb(levels: int) -> str:
    """A YAML flow list whose last item expands to 10^levels leaves: 10 aliases of 10 aliases of ..."""
    items = ["&a0 [" + ", ".join(["x"] * 10) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def file_error(tmp_path, text: str, name: str = "run.yaml") -> str:
    """The one-line ConfigError of loading ``text`` as a config file."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_yaml(TrainConfig, path)
    return str(e.value)


def override_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        apply_overrides(TrainConfig(), list(overrides))
    return str(e.value)


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``cispo train ARGS`` in a subprocess, killed after ``timeout`` seconds (a hang fails the test)."""
    return subprocess.run([sys.executable, "-m", "cispo", "train", *args], check=False, capture_output=True, text=True,
                          timeout=timeout)


def one_line_exit_2(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    return proc.stderr


# ------------------------------------------------------------------------------- what is read


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_config_that_is_no_regular_file_is_refused_before_reading(tmp_path, kind):
    """Before: ``--config /dev/zero`` read forever (and a FIFO without a writer blocks at open)."""
    path = "/dev/zero" if kind == "dev-zero" else str(tmp_path / "fifo")
    if kind == "fifo":
        os.mkfifo(path)
    err = one_line_exit_2(cli("--config", path))
    assert f"{path}: cannot read config file: " in err and "not a regular file" in err


def test_a_folder_as_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r": cannot read config file: a folder, not a regular file"):
        load_yaml(TrainConfig, tmp_path)


def test_a_config_file_larger_than_the_cap_is_refused_unread(tmp_path):
    """Before: a 50 MB string took minutes (5 MB: 10 s). A file at the cap is still read."""
    path = tmp_path / "big.yaml"
    path.write_text("run_name: " + "a" * (MAX_CONFIG_BYTES + 1) + "\n")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"big.yaml: cannot read config file: larger than 1 MiB"):
        load_yaml(TrainConfig, path)
    assert time.perf_counter() - started < 1
    body = "steps: 3\n"
    path.write_text("#" * (MAX_CONFIG_BYTES - len(body) - 1) + "\n" + body)
    assert path.stat().st_size == MAX_CONFIG_BYTES and load_yaml(TrainConfig, path).steps == 3


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"steps: 3\nrun_name: \xff\n")
    with pytest.raises(ConfigError, match=r"run.yaml: cannot read config file: not UTF-8 \(byte 19"):
        load_yaml(TrainConfig, path)


def test_an_override_larger_than_the_cap_is_refused():
    err = override_error("data.system_prompt=" + "a" * MAX_CONFIG_BYTES)
    assert "longer than 1 MiB" in err and len(err) < 300


# ------------------------------------------------------------------------------- YAML itself


def test_an_alias_bomb_of_a_billion_leaves_is_refused_at_once(tmp_path):
    """Before: 10^7 leaves took 19.5 s and 244 MB (the error printed the whole value); 10^9 never returned."""
    path = tmp_path / "bomb.yaml"
    path.write_text(f"steps: {bomb(9)}\n")
    started = time.perf_counter()
    err = one_line_exit_2(cli("--config", str(path)))
    assert "bomb.yaml:1: YAML aliases expand to more than 10,000 nodes" in err
    assert time.perf_counter() - started < 30


@pytest.mark.parametrize("key", ["steps", "data.eval_sets", "data.fork_tokens", "algo.objective"])
def test_an_alias_bomb_under_any_key_is_one_short_line(tmp_path, key):
    """A small bomb (10^5 leaves: before, a 580 KB message), in a file and as an override."""
    section, _, field = key.rpartition(".")
    text = f"{section}:\n  {field}: {bomb(5)}\n" if section else f"{field}: {bomb(5)}\n"
    err = file_error(tmp_path, text)
    assert re.fullmatch(r".*run\.yaml:\d: YAML aliases expand to more than 10,000 nodes \(an alias bomb\?\); "
                        r"write the values out", err)
    err = override_error(f"{key}={bomb(5)}")
    assert err.startswith(f"override '{key}=[&a0") and "YAML aliases expand" in err and len(err) < 300


def test_anchors_and_merge_keys_within_the_budget_still_work(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  path: m\ndata:\n  path: t.jsonl\n  reward: math\n  eval_sets:\n"
                    "    a: &common {path: a.jsonl, prompt_field: q}\n    b:\n      <<: *common\n      path: b.jsonl\n"
                    "  fork_tokens: &words [Wait, However]\nrollout:\n  max_new_tokens: 8\n")
    cfg = load_yaml(TrainConfig, path)
    assert cfg.data.eval_sets["b"].path == "b.jsonl" and cfg.data.eval_sets["b"].prompt_field == "q"


def test_an_alias_inside_the_node_it_names_is_refused(tmp_path):
    err = file_error(tmp_path, "steps: 3\ndata:\n  fork_tokens: &a [x, *a]\n")
    assert err.endswith("run.yaml:3: alias *a is inside the node it names (a cycle)")


@pytest.mark.parametrize("text, line, key, first", [
    ("steps: 3\nseed: 1\nsteps: 5\n", 3, "steps", 1),
    ("rollout:\n  group_size: 4\n  temperature: 0.5\n  group_size: 8\n", 4, "group_size", 2),
    ("algo:\n  objective: {eps_high_is: 2, eps_high_is: 3}\n", 2, "eps_high_is", 2),
])
def test_a_duplicate_key_is_refused_with_its_line(tmp_path, text, line, key, first):
    """Before: the last value was taken silently."""
    assert file_error(tmp_path, text) == (f"{tmp_path}/run.yaml:{line}: duplicate key {key!r} (first on line "
                                          f"{first}): give each key once")


def test_a_duplicate_key_in_an_override_is_refused():
    err = override_error("algo.objective={eps_high_is: 2, eps_high_is: 3}")
    assert err == ("override 'algo.objective={eps_high_is: 2, eps_high_is: 3}': duplicate key 'eps_high_is' "
                   "(first on line 1): give each key once")


def test_nesting_deeper_than_the_limit_is_one_line(tmp_path):
    """Before: 20,000 levels were a RecursionError traceback."""
    deep = "[" * 20_000 + "]" * 20_000
    assert file_error(tmp_path, f"steps: {deep}\n").endswith(f"run.yaml:1: nested more than {MAX_DEPTH} levels deep")
    err = override_error(f"steps={deep}")
    assert err.endswith(f"nested more than {MAX_DEPTH} levels deep") and len(err) < 300
    assert override_error("a." * (MAX_DEPTH + 1) + "b=1").endswith(f"no setting is nested more than {MAX_DEPTH} deep")
    blocks = "".join(" " * i + f"k{i}:\n" for i in range(MAX_DEPTH + 5))  # block style, one level per line
    assert file_error(tmp_path, blocks).endswith(f"run.yaml:{MAX_DEPTH}: nested more than {MAX_DEPTH} levels deep")


@pytest.mark.parametrize("literal", ["9" * 5000, "1" + ":59" * 20_000])
def test_an_integer_too_long_to_convert_is_one_line(tmp_path, literal):
    """Before: a 5000-digit integer was a ValueError traceback (Python's 4300-digit limit); a
    sexagesimal one of 20,000 parts took a second of big-integer arithmetic and was accepted."""
    err = file_error(tmp_path, f"seed: 1\nsteps: {literal}\n")
    assert err.endswith(f"run.yaml:2: an integer of {len(literal):,} characters: no setting takes one longer than "
                        f"{MAX_INT_CHARS}")
    err = override_error(f"steps={literal}")
    assert "an integer of" in err and len(err) < 300


# ------------------------------------------------------------------------------- messages


def test_a_large_value_of_the_wrong_type_is_shown_short(tmp_path):
    """Before: the message held the value's whole repr."""
    err = file_error(tmp_path, "steps: [" + ", ".join(["1"] * 20_000) + "]\n")
    assert err.startswith(f"{tmp_path}/run.yaml:1: steps: expected int, got [1, 1, 1, 1, 1, 1, ...]") and len(err) < 300
    err = override_error("rollout.engine=" + "v" * 100_000)
    assert "rollout.engine: expected one of 'torch', 'vllm', got 'vvvv" in err and len(err) < 600


def test_many_problems_are_cut_to_a_count(tmp_path):
    """Before: one line per problem (and 200,000 unknown keys took more than 30 s)."""
    err = file_error(tmp_path, "".join(f"k{i}: 1\n" for i in range(2000)))
    lines = err.splitlines()
    assert len(lines) == MAX_PROBLEMS + 1 and lines[0].endswith("run.yaml:1: k0: unknown key")
    assert lines[-1] == f"… and {2000 - MAX_PROBLEMS:,} more problems"
    err = file_error(tmp_path, "data:\n  eval_sets: {" + ", ".join(f"s{i}: 1" for i in range(5000)) + "}\n")
    assert len(err.splitlines()) == MAX_PROBLEMS + 1 and err.endswith(f"… and {5000 - MAX_PROBLEMS:,} more problems")


def test_values_python_cannot_repr_are_shown_by_size():
    """``repr(10**5000)`` raises ValueError: it was a traceback from the error message itself."""
    with pytest.raises(ConfigError,
                       match=r"algo.objective.name: expected one of .*, got <an integer of about 5,000 digits>"):
        from_dict(TrainConfig, {"algo": {"objective": 10**5000}})
    assert short_repr(10**5000) == "<an integer of about 5,000 digits>"
    assert len(short_repr("a" * 10**6)) < 100 and len(short_repr([list(range(10**5))] * 10**3)) < 200


def test_a_check_that_quotes_a_long_value_is_cut():
    with pytest.raises(ConfigError) as e:
        from_dict(TrainConfig, {"trackers": ["x" * 100_000]})
    assert len(str(e.value)) < engine.MAX_LINE_CHARS + 100 and str(e.value).endswith("(100,074 characters)")


# ------------------------------------------------------------------------------- bounds


@pytest.mark.parametrize("value", [2**64, -1, MAX_SEED + 1])
@pytest.mark.parametrize("key", ["seed", "data.seed"])
def test_a_seed_out_of_range_is_one_line(key, value):
    """Before: seed=2**64 was accepted, then a traceback from torch.manual_seed ('Overflow when
    unpacking long long'); a negative or >= 2^32 seed fails in numpy.random.seed under vLLM."""
    assert override_error(f"{key}={value}") == (f"override '{key}={value}': {key} must be in [0, {MAX_SEED}] (2^31 - "
                                                f"1: "
                                                "numpy and vLLM take seeds below 2^32, and each rank and step adds to "
                                                "it)")


def test_the_largest_seed_works_where_seeds_are_used():
    cfg = apply_overrides(TrainConfig(), [f"seed={MAX_SEED}", f"data.seed={MAX_SEED}"])
    import numpy as np
    import torch

    torch.Generator().manual_seed(cfg.seed * 1_000_003 + 10**6)  # the prompt order of epoch 10^6
    np.random.seed(cfg.seed + 1000 * 1000 + 10**6)  # vLLM's seed of rank 1000, step 10^6... within 2^32
    torch.manual_seed(cfg.data.seed)


@pytest.mark.parametrize("key", sorted(UPPER_BOUNDS))
def test_sizes_and_counts_have_upper_bounds(key):
    """Before: prompts_per_step=10**12 was accepted. Each bound is accepted, one more is refused,
    and the field's docstring says it."""
    bound, why = UPPER_BOUNDS[key]
    assert override_error(f"{key}={bound + 1}") == f"override '{key}={bound + 1}': {key} must be <= {bound:,} ({why})"
    cfg = apply_overrides(TrainConfig(), [f"{key}={bound}"])
    section, _, name = key.rpartition(".")
    owner = getattr(cfg, section) if section else cfg
    assert getattr(owner, name) == bound
    doc = field_docs(type(owner))[name].replace("\n", " ")
    exponent = round(math.log10(bound))
    assert str(bound) in doc or f"10^{exponent}" in doc, doc


def test_out_of_range_and_huge_numbers_through_the_cli_are_one_line_each(capsys):
    from cispo.cli import main

    for args, expected in [(["prompts_per_step=1000000000000"], "rollout.prompts_per_step must be <= 1,000,000"),
                           ([f"seed={2**64}"], "seed must be in [0, 2147483647]"),
                           (["steps=" + "9" * 5000], "an integer of 5,000 characters")]:
        assert main(["train", *args]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1 and "Traceback" not in err


def test_more_built_in_prompts_than_memory_holds_is_one_line_before_they_are_built():
    """``data.num_train_prompts=10**7`` of a built-in task (within the documented bound) was built in memory and
    aborted an 8 GB machine: refused when the estimate passes half of the memory free, naming both sizes."""
    from cispo.data.tasks import get_task
    from cispo.training.setup import check_prompt_memory

    cfg = apply_overrides(TrainConfig(), ["data.num_train_prompts=10000000"])
    too_many = r"data\.num_train_prompts=10,000,000: .* GiB, more than half of the 4\.0 GiB"
    with pytest.raises(ConfigError, match=too_many):
        check_prompt_memory(get_task("addition"), cfg.data, available=4 << 30)
    default = apply_overrides(TrainConfig(), []).data  # 20,000 prompts: fine
    check_prompt_memory(get_task("addition"), default, available=4 << 30)
