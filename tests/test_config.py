"""The run's configuration as users meet it: YAML in and out, key=value overrides, --help,
errors that name the key, and every bad setting refused when the config is built."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cispo.cli import main
from cispo.config.train import (
                                AlgoConfig,
                                ConfigError,
                                TrainConfig,
                                apply_overrides,
                                field_docs,
                                format_help,
                                from_dict,
                                load_yaml,
                                save_yaml,
                                to_dict,
                                )
from cispo.foundations.suggest import did_you_mean
from cispo.objective.advantages import ESTIMATORS
from cispo.objective.loss import PRESETS

SECTIONS = ("model", "data", "rollout", "algo", "optim", "eval")


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        apply_overrides(TrainConfig(), overrides)
    return str(e.value)


# ---------------------------------------------------------------------------------------
# Defaults, dicts and YAML files
# ---------------------------------------------------------------------------------------


def test_defaults_round_trip_through_dict_and_yaml(tmp_path):
    d = to_dict(TrainConfig())
    assert d["optim"]["betas"] == [0.9, 0.95] and d["algo"]["objective"] == "cispo"
    assert json.loads(json.dumps(d)) == d  # plain data
    assert from_dict(TrainConfig, d) == TrainConfig() == from_dict(TrainConfig, None)
    save_yaml(TrainConfig(), tmp_path / "sub" / "config.yaml")
    back = load_yaml(TrainConfig, tmp_path / "sub" / "config.yaml")
    assert back == TrainConfig() and back.optim.betas == (0.9, 0.95)  # a tuple again


def test_changed_config_round_trips_through_yaml(tmp_path):
    cfg = apply_overrides(TrainConfig(), ["lr=3e-5", "run_name=2024", "trackers=[tensorboard]", "dtype=bfloat16",
                                          "objective_overrides.eps_high_is=2.0", "data.extra_fields=[a, b]"])
    save_yaml(cfg, tmp_path / "c.yaml")
    assert load_yaml(TrainConfig, tmp_path / "c.yaml") == cfg


def test_yaml_file_sets_some_fields(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 10\noptim:\n  lr: 1e-4\n  betas: [0.8, 0.9]\nrollout:\n")  # empty section: defaults
    cfg = load_yaml(TrainConfig, path)
    assert (cfg.steps, cfg.optim.lr, cfg.optim.betas, cfg.rollout) == (10, 1e-4, (0.8, 0.9), TrainConfig().rollout)
    (tmp_path / "empty.yaml").write_text("")
    assert load_yaml(TrainConfig, tmp_path / "empty.yaml") == TrainConfig()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("steps: 10\noptim:\n  lr: fast\n", ":3: optim.lr: expected float, got 'fast'"),
        ("optim:\n  betas: [0.9,\n    x]\n", ":3: optim.betas[1]:"),
        ("rollout:\n  temperatur: 1\n", ":2: rollout.temperatur: unknown key (did you mean 'rollout.temperature'?)"),
        ("lr: 0.1\n", ":1: lr: unknown key (did you mean 'optim.lr'?)"),
        ("algo:\n  objective: dapoo\n", ":2: algo.objective: expected one of 'cispo', "),
        ("steps: 0\n", ": steps must be >= 1"),
        ("steps: [1\n", ":2: invalid YAML"),
        ("- 1\n", ":1: expected a mapping of config keys"),
    ],
)
def test_yaml_errors_name_file_line_and_key(tmp_path, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_yaml(TrainConfig, path)
    assert f"{path}{expected}" in str(e.value)


def test_missing_yaml_file():
    with pytest.raises(ConfigError, match="nope.yaml: cannot read config file"):
        load_yaml(TrainConfig, "nope.yaml")


def test_from_dict_names_its_source():
    with pytest.raises(ConfigError, match=r"^cfg\.json: optim\.lrr: unknown key \(did you mean 'optim\.lr'\?\)$"):
        from_dict(TrainConfig, {"optim": {"lrr": 1}}, source="cfg.json")


# ---------------------------------------------------------------------------------------
# key=value overrides
# ---------------------------------------------------------------------------------------


def test_override_dotted_and_short_names():
    cfg = apply_overrides(TrainConfig(), ["optim.lr=5e-5", "group_size=4", "seed=3", "algo.objective=dapo"])
    assert (cfg.optim.lr, cfg.rollout.group_size, cfg.seed, cfg.data.seed) == (5e-5, 4, 3, 0)  # top level wins
    assert cfg.algo.objective == "dapo"
    assert apply_overrides(TrainConfig(), ["lr=5e-5"]).optim == apply_overrides(TrainConfig(), ["optim.lr=5e-5"]).optim


def test_override_ambiguous_short_name_lists_candidates():
    msg = _error(["temperature=0.5"])
    assert "ambiguous key 'temperature'" in msg and "rollout.temperature" in msg and "eval.temperature" in msg
    assert apply_overrides(TrainConfig(), ["eval.temperature=0.5"]).eval.temperature == 0.5


@pytest.mark.parametrize(
    "override, get, expected",
    [
        ("betas=[0.8, 0.99]", lambda c: c.optim.betas, (0.8, 0.99)),
        ("run_name=2024", lambda c: c.run_name, "2024"),  # a str field keeps the text
        ("run_name=007", lambda c: c.run_name, "007"),
        ("run_name=null", lambda c: c.run_name, None),
        ("max_new_tokens=None", lambda c: c.rollout.max_new_tokens, None),
        ("progress=false", lambda c: c.progress, False),
        ("lr=1E-3", lambda c: c.optim.lr, 1e-3),
        ("objective_overrides.eps_high_is=1e-1", lambda c: c.algo.objective_overrides, {"eps_high_is": 0.1}),
        ("algo.objective_overrides={eps_high_is: 2.0}", lambda c: c.algo.objective_overrides, {"eps_high_is": 2.0}),
        ("optim={eps: 1e-8}", lambda c: (c.optim.eps, c.optim.lr), (1e-8, 1e-4)),  # a section mapping merges
    ],
)
def test_override_values(override, get, expected):
    assert get(apply_overrides(TrainConfig(), [override])) == expected


def test_overrides_are_checked_together_not_one_by_one():
    # prompts_per_step=1 alone leaves 8 rows for K=16; with updates_per_batch=2 the whole is valid
    cfg = apply_overrides(TrainConfig(), ["prompts_per_step=1", "updates_per_batch=2"])
    assert (cfg.rollout.prompts_per_step, cfg.algo.updates_per_batch) == (1, 2)


def test_override_does_not_change_its_input():
    cfg = TrainConfig()
    apply_overrides(cfg, ["lr=1e-3", "objective_overrides.eps_high_is=2"])
    assert cfg == TrainConfig() and cfg.algo.objective_overrides == {}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["steps"], "override 'steps': expected key=value"),
        (["optim.lrr=1"], "override 'optim.lrr=1': optim.lrr: unknown key (did you mean 'optim.lr'?)"),
        (["lrr=1"], "lrr: unknown key (did you mean 'lr'?)"),
        (["learning_rate=1"], "learning_rate: unknown key"),
        (["lr=abc"], "override 'lr=abc': optim.lr: expected float, got 'abc'"),
        (["seed=1.5"], "seed: expected int, got 1.5"),
        (["steps=true"], "steps: expected int, got True"),  # not read as 1
        (["lr=false"], "optim.lr: expected float, got False"),
        (["lr.x=1"], "optim.lr is not a section"),
        (["objective=dapoo"], "algo.objective: expected one of 'cispo', 'ppo', 'grpo', 'dapo', 'gspo', 'reinforce', 'cispo_lowmask', 'cispo_highmask', "
                              "got 'dapoo' (did you mean 'dapo'?)"),
        (["advantage_estimator=rlo"], "(did you mean 'rloo'?)"),
        (["engine=vlm"], "rollout.engine: expected one of 'torch', 'vllm', got 'vlm' (did you mean 'vllm'?)"),
        (["dtype=bf16"], "model.dtype: expected one of 'float32', 'bfloat16', 'float16'"),
        (["trackers=[wandbb]"], "unknown tracking sink 'wandbb' (did you mean 'wandb'?)"),
        (["objective_overrides.eps_hihg_is=1"], "did you mean 'eps_high_is'"),
        (["seed=1", "steps=0"], "overrides 'seed=1', 'steps=0': steps must be >= 1"),
    ],
)
def test_override_errors_name_the_key(overrides, expected):
    assert expected in _error(overrides)


# ---------------------------------------------------------------------------------------
# Every bad setting is refused when the config is built (issue 17), before any work
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["objective_overrides.kl_coef=0.1", "model.lora_rank=4"],
         "algo.objective_overrides.kl_coef > 0 cannot be combined with model.lora_rank > 0"),
        (["rollout.temperature=0"], "rollout.temperature must be > 0"),
        (["model.dtype=float16", "model.fsdp=true"], "model.dtype float16 cannot be combined with model.fsdp"),
        (["rollout.temperature=-1"], "rollout.temperature must be > 0"),
        (["top_p=0"], "rollout.top_p must be in (0, 1]"),
        (["top_p=1.5"], "rollout.top_p must be in (0, 1]"),
        (["checkpoint_every=-1"], "checkpoint_every must be >= 0"),
        (["keep_checkpoints=-1"], "keep_checkpoints must be >= 0"),
        (["max_new_tokens=0"], "rollout.max_new_tokens must be >= 1 or None"),
        (["micro_batch_size=0"], "algo.micro_batch_size must be >= 1 or None"),
        (["threads=0"], "threads must be >= 1 or None"),
        (["updates_per_batch=1000"], "algo.updates_per_batch must be <= the rows of a batch, "
                                     "prompts_per_step * group_size = 256"),
        (["prompts_per_step=2", "group_size=4", "updates_per_batch=9"], "= 8"),
        (["data.path=p.jsonl", "data.reward=math", "max_new_tokens=8"], "model.path is required with data.path"),
        (["model.path=m", "data.path=p.jsonl", "max_new_tokens=8"], "data.reward is required with data.path"),
        (["model.path=m", "data.path=p.jsonl", "data.reward=math"], "rollout.max_new_tokens is required with data.path"),
        (["overlong_buffer=0"], "rollout.overlong_buffer must be >= 1 or None"),
        (["repetition_stop_tokens=-1"], "rollout.repetition_stop_tokens must be >= 0"),
        (["num_train_prompts=0"], "data.num_train_prompts must be >= 1"),
        (["reward_timeout_s=0"], "data.reward_timeout_s must be > 0 or None"),
        (["eval.every=-1"], "eval.every must be >= 0"),
        (["eval.temperature=-0.5"], "eval.temperature must be >= 0"),
        (["warmup_updates=-1"], "optim.warmup_updates must be >= 0"),
    ],
)
def test_bad_settings_are_config_errors(overrides, expected):
    assert expected in _error(overrides)


def test_zero_where_zero_has_a_meaning_is_accepted():
    cfg = apply_overrides(TrainConfig(), ["checkpoint_every=0", "eval.every=0", "repetition_stop_tokens=0",
                                          "num_eval_prompts=0", "keep_checkpoints=0", "eval.temperature=0"])
    assert cfg.checkpoint_every == 0 and cfg.eval.temperature == 0


def test_bad_setting_exits_2_with_one_line(capsys):
    assert main(["train", "rollout.temperature=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cispo train: error: override 'rollout.temperature=0': rollout.temperature must be > 0")
    assert "Traceback" not in err


def test_unavailable_cuda_device_is_a_config_error(monkeypatch):
    import torch

    from cispo.training.run_policy import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="model.device='cuda': CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="model.device='gpu': not a device"):
        resolve_device("gpu")
    assert resolve_device("auto").type == "cpu" and resolve_device("cpu").type == "cpu"


def test_data_file_too_small_for_a_held_out_set(tmp_path, capsys):
    from cispo.data.datasets import DataError
    from cispo.data.prompts import load_source

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    cfg = apply_overrides(TrainConfig(), ["model.path=m", f"data.path={data}", "data.reward=exact_match",
                                          "max_new_tokens=8"])
    with pytest.raises(DataError, match=r"p\.jsonl: 3 prompts: too few to hold out"):
        load_source(cfg.data, 8)
    assert len(load_source(dataclasses.replace(cfg.data, num_eval_prompts=0), 8).train) == 3
    # the CLI prints it on one line (exit 2), before loading any model
    assert main(["train", "model.path=missing", f"data.path={data}", "data.reward=exact_match",
                 "max_new_tokens=8", "model.device=cpu", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "too few to hold out" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------
# Closed choices are Literal types that match the code's own lists
# ---------------------------------------------------------------------------------------


def test_literal_choices_match_the_code():
    hints = typing.get_type_hints(AlgoConfig)
    assert typing.get_args(hints["objective"]) == tuple(PRESETS)
    assert typing.get_args(hints["advantage_estimator"]) == ESTIMATORS


# ---------------------------------------------------------------------------------------
# Help text and field docs
# ---------------------------------------------------------------------------------------


def test_help_lists_every_field_with_its_docstring():
    text = format_help(TrainConfig)
    sections = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig) if f.name in SECTIONS}
    for section, cls in [(None, TrainConfig)] + list(sections.items()):
        for name, doc in field_docs(cls).items():
            if name in SECTIONS:
                continue
            key = name if section is None else f"{section}.{name}"
            assert f"  {key}: " in text
            assert doc, f"{key} has no docstring"
            for line in doc.splitlines():
                assert line.strip() in text
    assert "  optim.lr: float = 0.0001\n      Peak learning rate.\n" in text
    assert "  optim.betas: tuple[float, float] = (0.9, 0.95)" in text
    assert "  rollout.max_new_tokens: int | None = None" in text
    assert "  algo.objective: Literal['cispo', 'ppo', 'grpo', 'dapo', 'gspo', 'reinforce', 'cispo_lowmask', 'cispo_highmask'] = 'cispo'" in text
    assert "\noptim (OptimConfig): AdamW, with MiniMax-M1's settings by default.\n" in text
    parser = argparse.ArgumentParser(epilog=text, formatter_class=argparse.RawDescriptionHelpFormatter)
    assert "      Peak learning rate." in parser.format_help()


def test_field_docs_of_a_subclass_and_of_a_field_without_one():
    @dataclass
    class Base:
        width: int = 1
        """Width."""

    @dataclass
    class Child(Base):
        depth: list[int] = field(default_factory=list)

    assert field_docs(Child) == {"width": "Width.", "depth": ""}
    with pytest.raises(TypeError):
        field_docs(int)


def test_did_you_mean():
    assert did_you_mean("dapoo", PRESETS) == " (did you mean 'dapo'?)"
    assert did_you_mean("zzz", PRESETS) == ""
    assert did_you_mean("cispoo", ["ppo", "cisp", "cispo"], n=2) == " (did you mean 'cispo' or 'cisp'?)"


# ---------------------------------------------------------------------------------------
# TRL's and verl's names (issue 30, item 7)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("beta=0.04", "beta: unknown key (did you mean 'algo.objective_overrides.kl_coef'? 'beta' in TRL:"),
        ("kl_coef=0.1", "(did you mean 'algo.objective_overrides.kl_coef'?"),
        ("num_generations=4", "(did you mean 'rollout.group_size'? 'num_generations' in TRL"),
        ("num_iterations=2", "(did you mean 'algo.epochs'?"),
        ("epsilon=0.2", "(did you mean 'algo.objective_overrides.eps_low'?"),
        ("epsilon_high=0.28", "(did you mean 'algo.objective_overrides.eps_high'?"),
        ("loss_type=dapo", "(did you mean 'algo.objective'?"),
        ("max_completion_length=64", "(did you mean 'rollout.max_new_tokens'?"),
        ("learning_rate=1e-5", "(did you mean 'optim.lr'?"),
        ("use_kl_loss=true", "(did you mean 'algo.objective_overrides.kl_coef'? 'use_kl_loss' in verl"),
        ("kl_loss_coef=0.001", "(did you mean 'algo.objective_overrides.kl_coef'?"),
        ("clip_ratio_low=0.2", "(did you mean 'algo.objective_overrides.eps_low'?"),
        ("clip_ratio_high=0.28", "(did you mean 'algo.objective_overrides.eps_high'?"),
        ("algo.beta=0.04", "algo.beta: unknown key (did you mean 'algo.objective_overrides.kl_coef'?"),
        ("objective_overrides.beta=0.04", "ObjectiveConfig has no field 'beta' (did you mean 'kl_coef'? 'beta' in TRL"),
    ],
)
def test_trl_and_verl_names_are_answered_with_cispos_key(override, expected):
    assert expected in _error([override])


def test_other_names_in_a_yaml_file_and_in_another_config(tmp_path):
    from cispo.models.pretrain import PretrainConfig

    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  num_generations: 4\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:2: rollout\.num_generations: unknown key \(did you mean "
                                          r"'rollout\.group_size'\?"):
        load_yaml(TrainConfig, path)
    with pytest.raises(ConfigError) as e:  # PretrainConfig has its own lr, and no KL
        apply_overrides(PretrainConfig(), ["learning_rate=1e-3"])
    assert "(did you mean 'lr'? 'learning_rate' in TRL" in str(e.value)
    with pytest.raises(ConfigError) as e:
        apply_overrides(PretrainConfig(), ["beta=0.1"])
    assert "kl_coef" not in str(e.value)


def test_the_integrations_doc_shows_the_names_table():
    """docs/integrations.md's table of TRL's and verl's names is `cispo.foundations.suggest.OTHER_NAMES`, row for row."""
    from pathlib import Path

    from cispo.foundations.suggest import OTHER_NAMES

    doc = (Path(__file__).resolve().parent.parent / "docs" / "integrations.md").read_text()
    section = doc.split("## TRL's and verl's names in `cispo train`", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    table = {name.strip("`"): (source, tuple(k.strip(" `") for k in keys.split(",")), what)
             for name, source, keys, what in rows}
    assert table == OTHER_NAMES


def _leaves(tree: dict, prefix: str = ""):
    """(dotted key, value) of every leaf of a nested YAML mapping."""
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load_with_every_value(path):
    """Every shipped example loads as a TrainConfig, and each value it sets is the value the run gets."""
    import yaml

    cfg = load_yaml(TrainConfig, path)
    for key, value in _leaves(yaml.safe_load(path.read_text())):
        got = cfg
        for part in key.split("."):
            got = getattr(got, part)
        assert got == value, key
