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
import yaml

from cispo.cli import main
from cispo.config.algo import ObjectiveSection
from cispo.config.describe import format_help
from cispo.config.recipes import recipe_overrides
from cispo.config.train import (
                                AlgoConfig,
                                ConfigError,
                                TrainConfig,
                                apply_overrides,
                                field_docs,
                                from_dict,
                                load_yaml,
                                save_yaml,
                                to_dict,
                                )
from cispo.foundations.suggest import did_you_mean
from cispo.objective.advantages import ESTIMATORS
from cispo.objective.loss import PRESETS, preset

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
    assert d["optim"]["betas"] == [0.9, 0.95] and d["algo"]["objective"]["name"] == "cispo"
    assert json.loads(json.dumps(d)) == d  # plain data
    assert from_dict(TrainConfig, d) == TrainConfig() == from_dict(TrainConfig, None)
    save_yaml(TrainConfig(), tmp_path / "sub" / "config.yaml")
    back = load_yaml(TrainConfig, tmp_path / "sub" / "config.yaml")
    assert back == TrainConfig() and back.optim.betas == (0.9, 0.95)  # a tuple again


def test_a_config_yaml_written_before_the_objective_section_still_loads(tmp_path):
    """A run folder's config.yaml from before ``algo.objective`` was a section (``objective: NAME`` and the
    untyped ``objective_overrides`` mapping) loads as the section; a field given under both names is refused."""
    path = tmp_path / "config.yaml"
    path.write_text("algo:\n  objective: dapo\n  objective_overrides:\n    eps_high_is: null\n    kl_coef: 0.1\n")
    objective = load_yaml(TrainConfig, path).algo.objective
    assert (objective.name, objective.overrides()) == ("dapo", {"eps_high_is": None, "kl_coef": 0.1})
    assert objective.resolve() == preset("dapo", eps_high_is=None, kl_coef=0.1)
    path.write_text("algo:\n  objective:\n    name: dapo\n    kl_coef: 0.2\n  objective_overrides:\n    kl_coef: 0.1\n")
    with pytest.raises(ConfigError, match=r"config.yaml:5: algo.objective_overrides is the old name of algo.objective, "
                                          r"and algo.objective.kl_coef is given under both: give only "):
        load_yaml(TrainConfig, path)


def test_the_objective_section_has_every_field_of_the_objective():
    """``algo.objective`` sets every field of ObjectiveConfig, with each closed choice its list in the code, and
    every default takes the preset's value."""
    from cispo.objective.presets import AGGREGATIONS, KL_ESTIMATORS, MASK_RULES, RATIO_LEVELS, ObjectiveConfig

    names = [f.name for f in dataclasses.fields(ObjectiveSection)]
    assert names == ["name"] + [f.name for f in dataclasses.fields(ObjectiveConfig)]
    assert all(getattr(ObjectiveSection(), n) == "preset" for n in names[1:])
    hints = typing.get_type_hints(ObjectiveSection)
    for name, choices in [("ratio_level", RATIO_LEVELS), ("mask_rule", MASK_RULES), ("aggregation", AGGREGATIONS),
                          ("kl_estimator", KL_ESTIMATORS)]:
        assert typing.get_args(hints[name]) == (*choices, "preset")
    for name in PRESETS:
        assert ObjectiveSection(name).resolve() == PRESETS[name]


def test_changed_config_round_trips_through_yaml(tmp_path):
    cfg = apply_overrides(TrainConfig(), ["lr=3e-5", "run_name=2024", "trackers=[tensorboard]", "dtype=bfloat16",
                                          "eps_high_is=null", "data.extra_fields=[a, b]"])
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
        ("algo:\n  objective: dapoo\n", ":2: algo.objective.name: expected one of 'cispo', "),
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
    assert cfg.algo.objective.name == "dapo"
    assert apply_overrides(TrainConfig(), ["lr=5e-5"]).optim == apply_overrides(TrainConfig(), ["optim.lr=5e-5"]).optim


def test_override_ambiguous_short_name_lists_candidates():
    msg = _error(["path=x"])
    assert "ambiguous key 'path'" in msg and "model.path" in msg and "data.path" in msg
    assert apply_overrides(TrainConfig(), ["eval.temperature=0.5"]).eval.temperature == 0.5


@pytest.mark.parametrize("key, text, get, expected", [
    ("temperature", "0.7", lambda c: (c.rollout.temperature, c.eval.temperature), (0.7, 1.0)),  # TRL's, not eval's
    ("scale_rewards", "none", lambda c: c.algo.advantage_estimator, "drgrpo"),  # TRL's documented spelling
    ("scale_rewards", "batch", lambda c: c.algo.advantage_estimator, "batch-raw-std"),
    ("report_to", "none", lambda c: c.trackers, []),
    ("run_name", "none", lambda c: c.run_name, None),  # a field that takes null: none is null, in both
    ("rollout.max_new_tokens", "None", lambda c: c.rollout.max_new_tokens, None),
])
def test_the_command_line_and_a_file_read_a_value_the_same_way(key, text, get, expected, tmp_path):
    """One parser: ``key=value`` on the command line is what ``key: value`` is at the top of a file."""
    path = tmp_path / "run.yaml"
    *sections, leaf = key.split(".")
    lines = [f"{'  ' * i}{part}:" for i, part in enumerate(sections)] + [f"{'  ' * len(sections)}{leaf}: {text}"]
    path.write_text("\n".join(lines) + "\n")
    assert get(load_yaml(TrainConfig, path)) == get(apply_overrides(TrainConfig(), [f"{key}={text}"])) == expected


def test_trls_weight_decay_is_refused_on_the_command_line_as_in_a_file(tmp_path):
    """TRL's weight_decay leaves biases and norm weights out; cispo's optim.weight_decay decays every parameter."""
    path = tmp_path / "run.yaml"
    path.write_text("weight_decay: 0.01\n")
    with pytest.raises(ConfigError) as in_file:
        load_yaml(TrainConfig, path)
    assert _error(["weight_decay=0.01"]) == str(in_file.value).replace(f"{path}:1", "override 'weight_decay=0.01'")
    assert "did you mean 'optim.weight_decay'?" in _error(["weight_decay=0.01"])


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
        ("eps_high_is=1e-1", lambda c: c.algo.objective.overrides(), {"eps_high_is": 0.1}),
        ("algo.objective.eps_high_is=null", lambda c: c.algo.objective.resolve().eps_high_is, None),  # no bound
        ("algo.objective={kl_coef: 0.1}", lambda c: (c.algo.objective.name, c.algo.objective.overrides()),
         ("cispo", {"kl_coef": 0.1})),
        ("objective=ppo", lambda c: (c.algo.objective.name, c.algo.objective.overrides()), ("ppo", {})),
        # the untyped mapping this section replaced: read as its fields
        ("objective_overrides.eps_high_is=1e-1", lambda c: c.algo.objective.overrides(), {"eps_high_is": 0.1}),
        ("algo.objective_overrides={eps_high_is: 2.0}", lambda c: c.algo.objective.overrides(), {"eps_high_is": 2.0}),
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
    apply_overrides(cfg, ["lr=1e-3", "algo.objective.eps_high_is=2"])
    assert cfg == TrainConfig() and cfg.algo.objective.overrides() == {}


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["steps"], "override 'steps': expected key=value"),
        (["optim.lrr=1"], "override 'optim.lrr=1': optim.lrr: unknown key (did you mean 'optim.lr'?)"),
        (["lrr=1"], "lrr: unknown key (did you mean 'lr'?)"),
        (["learning_rate=abc"], "override 'learning_rate=abc': optim.lr: expected float, got 'abc'"),  # TRL's name
        (["lr=abc"], "override 'lr=abc': optim.lr: expected float, got 'abc'"),
        (["seed=1.5"], "seed: expected int, got 1.5"),
        (["steps=true"], "steps: expected int, got True"),  # not read as 1
        (["lr=false"], "optim.lr: expected float, got False"),
        (["lr.x=1"], "optim.lr is not a section"),
        (["objective=dapoo"], "algo.objective.name: expected one of 'cispo', 'ppo', 'grpo', 'dapo', 'gspo', "
                              "'reinforce', 'cispo_lowmask', 'cispo_highmask', 'dppo_tv', 'dppo_kl', "
                              "got 'dapoo' (did you mean 'dapo'?)"),
        (["advantage_estimator=rlo"], "(did you mean 'rloo'?)"),
        (["engine=vlm"], "rollout.engine: expected one of 'torch', 'vllm', got 'vlm' (did you mean 'vllm'?)"),
        (["dtype=bf16"], "model.dtype: expected one of 'float32', 'bfloat16', 'float16'"),
        (["trackers=[wandbb]"], "unknown tracking sink 'wandbb' (did you mean 'wandb'?)"),
        (["algo.objective.eps_hihg_is=1"], "algo.objective.eps_hihg_is: unknown key (did you mean "
                                          "'algo.objective.eps_high_is'?)"),
        (["eps_high_is=-1"], "override 'eps_high_is=-1': algo.objective: eps_high_is must be a finite number >= 0"),
        (["aggregation=token_mean"], "algo.objective.aggregation: expected one of 'token-mean', "),
        (["kl_coef=abc"], "algo.objective.kl_coef: expected float | Literal['preset'], got 'abc'"),
        (["seed=1", "steps=0"], "overrides 'seed=1', 'steps=0': steps must be >= 1"),
    ],
)
def test_override_errors_name_the_key(overrides, expected):
    assert expected in _error(overrides)


# ---------------------------------------------------------------------------------------
# Every bad setting is refused when the config is built, before any work (not minutes into a run)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["kl_coef=0.1", "model.lora_rank=4"],
         "algo.objective.kl_coef > 0 cannot be combined with model.lora_rank > 0"),
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
        (["model.path=m", "data.path=p.jsonl", "data.reward=math"],
         "rollout.max_new_tokens is required with data.path"),
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
    assert typing.get_args(typing.get_type_hints(ObjectiveSection)["name"]) == tuple(PRESETS)
    assert typing.get_args(hints["advantage_estimator"]) == ESTIMATORS


# ---------------------------------------------------------------------------------------
# Help text and field docs
# ---------------------------------------------------------------------------------------


def test_help_lists_every_field_with_its_docstring():
    text = format_help(TrainConfig)
    sections = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig) if f.name in SECTIONS}
    for section, cls in [(None, TrainConfig)] + list(sections.items()) + [("algo.objective", ObjectiveSection)]:
        for name, doc in field_docs(cls).items():
            if name in SECTIONS or (section, name) == ("algo", "objective"):
                continue
            key = name if section is None else f"{section}.{name}"
            assert f"  {key}: " in text
            assert doc, f"{key} has no docstring"
            for line in doc.splitlines():
                assert line.strip() in text
    assert "  optim.lr: float = 0.0001\n      Peak learning rate.\n" in text
    assert "  optim.betas: tuple[float, float] = (0.9, 0.95)" in text
    assert "  rollout.max_new_tokens: int | None = None" in text
    assert ("  algo.objective.name: Literal['cispo', 'ppo', 'grpo', 'dapo', 'gspo', 'reinforce', 'cispo_lowmask', "
            "'cispo_highmask', 'dppo_tv', 'dppo_kl'] = 'cispo'") in text
    assert "  algo.objective.eps_high_is: float | None | Literal['preset'] = 'preset'\n      IS weight upper" in text
    assert "\nalgo.objective (ObjectiveSection): The objective, MiniMax-M1 eq. 6: a preset (name), each field" in text
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
# TRL's and verl's names: a user's habits from those frameworks point to cispo's name for the same setting
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("beta=0.04", "beta: unknown key (did you mean 'algo.objective.kl_coef'? 'beta' in TRL:"),
        ("algorithm.kl_ctrl.kl_coef=0.1",
         "(did you mean 'algo.objective.kl_coef'? 'algorithm.kl_ctrl.kl_coef' in verl"),
        ("epsilon=0.2", "(did you mean 'algo.objective.eps_low' and 'algo.objective.eps_high'?"),
        ("epsilon_high=0.28", "(did you mean 'algo.objective.eps_high' and "),
        ("use_kl_loss=true", "(did you mean 'algo.objective.kl_coef'? 'use_kl_loss' in verl"),
        ("kl_loss_coef=0.001", "(did you mean 'algo.objective.kl_coef'?"),
        ("clip_ratio_low=0.2", "(did you mean 'algo.objective.eps_low'?"),
        ("clip_ratio_high=0.28", "(did you mean 'algo.objective.eps_high'?"),
        ("algo.beta=0.04", "algo.beta: unknown key (did you mean 'algo.objective.kl_coef'?"),
        ("algo.objective.beta=0.04", "algo.objective.beta: unknown key (did you mean 'algo.objective.kl_coef'? 'beta' "
                                     "in TRL"),
        ("objective_overrides.loss_agg_mode=token-mean", "algo.objective.loss_agg_mode: unknown key (did you mean "
                                                          "'algo.objective.aggregation'? 'loss_agg_mode' in verl"),
        # a mapped name wins over the closest spelling, which misleads (was 'trackers', 'rollout', 'data.extra_fields',
        # 'max_bad_steps', 'steps', 'reward', 'data.reward_workers')
        ("trainer.total_epochs=3", "trainer.total_epochs: unknown key (did you mean 'steps'? 'trainer.total_epochs' in "
                                   "verl: cispo counts RL steps"),
        ("max_steps=100", "max_steps: unknown key (did you mean 'steps'? 'max_steps' in TRL: cispo counts RL steps"),
        ("save_steps=100", "(did you mean 'checkpoint_every'? 'save_steps' in TRL: cispo counts RL steps"),
        ("logging_steps=10", "logging_steps: unknown key ('logging_steps' in TRL: no cispo setting; cispo logs every"),
        ("trainer.foo=1", "trainer.foo: unknown key (below verl's trainer: cispo reads none of that name"),
    ],
)
def test_trl_and_verl_names_are_answered_with_cispos_key(override, expected):
    assert expected in _error([override])
    assert "\n" not in _error([override])


def _nested(dotted: str, value) -> dict:
    """{'a': {'b': value}} for 'a.b'."""
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def _merged(a: dict, b: dict) -> dict:
    return {**a, **{k: _merged(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                    for k, v in b.items()}}


def _value(cfg, dotted: str):
    """A config's value at dotted key (through dict fields too)."""
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


_FILE_RUN = {"model": {"path": "m"}, "data": {"reward": "math"}, "rollout": {"max_new_tokens": 8}}
_NEEDS = {  # what a key read needs beside it to make a valid config
    "data.path": _FILE_RUN,
    "data.eval_path": _merged(_FILE_RUN, {"data": {"path": "train.jsonl"}}),
    "data.reward_weights": _merged(_FILE_RUN, {"data": {"path": "train.jsonl", "reward": ["a.py:f", "b.py:g"]}}),
    "algo.rollout_is_upper": {"algo": {"rollout_is": "token"}},
    "algo.rollout_is_lower": {"algo": {"rollout_is": "token"}},
}


def _other_names():
    from cispo.config.foreign_names import OTHER_NAMES

    return OTHER_NAMES


def _forms(name: str):
    """``name`` and, for verl's dotted names, its last part where that alone finds the same row."""
    from cispo.config.engine import _own_leaves
    from cispo.config.foreign_names import lookup

    leaf = name.rsplit(".", 1)[-1]
    same = leaf != name and lookup((leaf,), _own_leaves(TrainConfig)) == (name, _other_names()[name])
    return [name, leaf] if same else [name]


@pytest.mark.parametrize("name", list(_other_names()))
def test_every_trl_and_verl_name_is_read_as_its_key_or_refused_naming_it(name, monkeypatch, capsys, tmp_path):
    """Each name of OTHER_NAMES, typed as TRL or verl users write it (and, for verl's, by its last
    part alone where that is unambiguous): read as cispo's key, with that key's value and one line on
    stderr; or refused in one line that names cispo's key (or says there is none) and the difference."""
    from cispo.config import engine
    from cispo.config.foreign_names import read_line

    other = _other_names()[name]
    for typed in _forms(name):
        monkeypatch.setattr(engine, "_ANNOUNCED", set())
        if other.read is not None:
            given, expected = other.example
            key = other.keys[0]
            cfg = from_dict(TrainConfig, _merged(_NEEDS.get(key, {}), _nested(typed, given)))
            assert _value(cfg, key) == expected
            said = capsys.readouterr().err
            assert said == ("" if typed == key else read_line(typed, other, given, other.read(given)) + "\n")
            # the same name and value on the command line, and in a YAML file: the same config
            assert from_dict(TrainConfig, _NEEDS.get(key, {}), overrides=[f"{typed}={_yamlish(given)}"]) == cfg
            path = tmp_path / "run.yaml"
            path.write_text(yaml.safe_dump(_merged(_NEEDS.get(key, {}), _nested(typed, given))))
            assert load_yaml(TrainConfig, path) == cfg
        else:
            with pytest.raises(ConfigError) as e:
                from_dict(TrainConfig, _nested(typed, 1))
            message = str(e.value)
            assert "\n" not in message and message.startswith(f"<dict>: {typed}: unknown key (")
            assert all(repr(k) in message for k in other.keys) and other.what in message
            assert other.keys or "no cispo setting" in message
            with pytest.raises(ConfigError) as e:  # as an override: the same words
                apply_overrides(TrainConfig(), [f"{typed}=1"])
            assert str(e.value) == message.replace("<dict>", f"override '{typed}=1'")


def test_the_read_line_shows_translated_values_once(monkeypatch, capsys):
    from cispo.config import engine

    monkeypatch.setattr(engine, "_ANNOUNCED", set())
    cfg = apply_overrides(TrainConfig(), ["loss_type=dapo", "use_vllm=true", "trainer.logger=[console, file, wandb]"])
    assert (cfg.algo.objective.name, cfg.rollout.engine, cfg.trackers) == ("ppo", "vllm", ["jsonl", "wandb"])
    apply_overrides(cfg, ["loss_type=dapo"])  # said once per process
    assert capsys.readouterr().err.splitlines() == [
        "cispo: reading TRL's loss_type=dapo as algo.objective.name=ppo",
        "cispo: reading TRL's use_vllm=true as rollout.engine=vllm",
        "cispo: reading verl's trainer.logger=['console', 'file', 'wandb'] as trackers=['jsonl', 'wandb']"]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("loss_type=cispo", "loss_type: 'cispo' is not read: TRL's cispo caps the IS weight at epsilon_high itself "
                            "(0.2 unless set); set algo.objective=cispo"),
        ("loss_type=bnpo", "loss_type: 'bnpo' is not read: TRL's bnpo divides by the tokens of the local micro-batch"),
        ("loss_type=sapo", "loss_type: 'sapo' is not read: no cispo value equals it ('loss_type' in TRL is read as "
                           "algo.objective.name: grpo -> grpo; dapo -> ppo"),
        ("scale_rewards=batch-std", "scale_rewards: 'batch-std' is not read: no cispo value equals it"),
        ("vllm_importance_sampling_correction=true", "is algo.rollout_is=seq-sum algo.rollout_is_mode=mask "
                                                     "algo.rollout_is_upper=3"),
        ("algorithm.rollout_correction.rollout_is_threshold=0.5_5.0",
         "is algo.rollout_is_mode=mask algo.rollout_is_lower=0.5 algo.rollout_is_upper=5.0"),
        ("report_to=all", "report_to: 'all' is not read: TRL's all (every installed integration) is not read"),
        ("report_to=comet_ml", "unknown tracking sink 'comet_ml'"),
        ("loss_agg_mode=seq-mean-token-sum", "loss_agg_mode: 'seq-mean-token-sum' is not read: set "
                                             "aggregation=seq-mean-token-sum-norm with token_sum_norm=1"),
        ("actor_rollout_ref.actor.loss_agg_mode=token-sum", "is not read: verl's token-sum is a sum"),
        ("trainer.save_freq=-1", "trainer.save_freq: -1 is not read: verl's -1 never saves; cispo always saves at the "
                                 "end (checkpoint_every=0: only then)"),
        ("data.train_files=[a.parquet, b.parquet]", "cispo reads one path: put several files in a folder"),
        ("actor_rollout_ref.rollout.name=sglang", "'sglang' is not read: cispo samples with torch or vllm"),
        ("algorithm.adv_estimator=gae", "algorithm.adv_estimator: 'gae' is not read: no cispo value equals it"),
        ("optim.clip_grad=0", "optim.clip_grad: 0 is not read: verl's 0 scales every gradient to 0"),
        ("kl_loss_type=abs", "kl_loss_type: 'abs' is not read"),
    ],
)
def test_a_value_with_no_exact_cispo_equivalent_is_refused_with_the_mapping(override, expected):
    assert expected in _error([override])
    assert "\n" not in _error([override])


def test_verl_names_in_a_yaml_file_and_a_name_given_twice(tmp_path, monkeypatch, capsys):
    from cispo.config import engine

    monkeypatch.setattr(engine, "_ANNOUNCED", set())
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-06\n    ppo_epochs: 2\n"
                    "    loss_agg_mode: seq-mean-token-mean\n  rollout:\n    n: 4\n"
                    "data:\n  train_batch_size: 16\ntrainer:\n  total_training_steps: 30\n  logger: [console]\n")
    cfg = load_yaml(TrainConfig, path)
    assert (cfg.optim.lr, cfg.algo.epochs, cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.steps,
            cfg.trackers) == (1e-6, 2, 4, 16, 30, [])
    assert cfg.algo.objective.overrides() == {"aggregation": "seq-mean-token-mean"}
    assert len(capsys.readouterr().err.splitlines()) == 7
    path.write_text("optim:\n  lr: 1.0e-4\ntrainer:\n  total_epochs: 3\nlearning_rate: 1.0e-5\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(TrainConfig, path)
    assert str(e.value).splitlines() == [
        f"{path}:4: trainer.total_epochs: unknown key (did you mean 'steps'? 'trainer.total_epochs' in verl: cispo "
        f"counts "
        "RL steps of rollout.prompts_per_step prompts each; verl's total_epochs counts passes over the data set: steps "
        "= total_epochs x prompts / data.train_batch_size)",
        f"{path}:5: learning_rate: TRL's name of optim.lr, which is given too: give only optim.lr"]
    # on the command line too: one key under two names is refused, as in a file (the same name twice: the last wins)
    for both in (["optim.lr=1e-4", "learning_rate=1e-5"], ["learning_rate=1e-5", "lr=1e-4"]):
        with pytest.raises(ConfigError, match="sets optim.lr, which override .* sets too .*give it once"):
            apply_overrides(TrainConfig(), both)
    assert apply_overrides(TrainConfig(), ["lr=1e-4", "optim.lr=2e-4"]).optim.lr == 2e-4


def test_trackers_takes_one_sink_as_a_string(tmp_path):
    """Was ``trackers: expected list[str], got 'tensorboard'`` (and TRL's report_to=tensorboard with it)."""
    assert apply_overrides(TrainConfig(), ["trackers=tensorboard"]).trackers == ["tensorboard"]
    assert apply_overrides(TrainConfig(), ["report_to=tensorboard"]).trackers == ["tensorboard"]
    assert dataclasses.replace(TrainConfig(), trackers="wandb").trackers == ["wandb"]
    path = tmp_path / "run.yaml"
    path.write_text("trackers: mlflow\n")
    cfg = load_yaml(TrainConfig, path)
    save_yaml(cfg, tmp_path / "saved.yaml")
    assert cfg.trackers == ["mlflow"] and load_yaml(TrainConfig, tmp_path / "saved.yaml") == cfg
    assert "unknown tracking sink 'tensorbord'" in _error(["trackers=tensorbord"])


def test_other_names_in_a_yaml_file_and_in_another_config(tmp_path):
    from cispo.models.pretrain import PretrainConfig

    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  num_generations: 4\n")  # TRL's names are read at the top level only
    with pytest.raises(ConfigError, match=r"run\.yaml:2: rollout\.num_generations: unknown key \(did you mean "
                                          r"'rollout\.group_size'\?"):
        load_yaml(TrainConfig, path)
    with pytest.raises(ConfigError) as e:  # PretrainConfig has its own lr, and no KL
        apply_overrides(PretrainConfig(), ["learning_rate=1e-3"])
    assert "(did you mean 'lr'? 'learning_rate' in TRL" in str(e.value)
    with pytest.raises(ConfigError) as e:
        apply_overrides(PretrainConfig(), ["beta=0.1"])
    assert "kl_coef" not in str(e.value)


def _yamlish(value) -> str:
    import yaml

    value = list(value) if isinstance(value, tuple) else value
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).removesuffix("\n...\n").strip()


def names_table() -> str:
    """docs/integrations.md's table of TRL's and verl's names, from `cispo.config.foreign_names.OTHER_NAMES`."""
    rows = ["| name | in | cispo's key | read | note |", "|---|---|---|---|---|"]
    for name, o in _other_names().items():
        keys = ", ".join(f"`{k}`" for k in o.keys) or "—"
        given, read = (_yamlish(v) for v in o.example) if o.read else ("", "")
        read = "no" if o.read is None else "yes" if given == read else f"yes: `{given}` → `{read}`"
        rows.append(f"| `{name}` | {o.source} | {keys} | {read} | {o.what} |")
    return "\n".join(rows)


def test_the_integrations_doc_shows_the_names_table():
    """docs/integrations.md's table of TRL's and verl's names is `cispo.config.foreign_names.OTHER_NAMES`,
    row for row (on failure, the expected table is printed: paste it in)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = doc.split("## TRL's and verl's names in `cispo train`", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    assert table == names_table(), names_table()


def _leaves(tree: dict, prefix: str = ""):
    """(dotted key, value) of every leaf of a nested YAML mapping."""
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_example_configs_load_with_every_value(path):
    """Every shipped example loads as its command's config (a TrainConfig, an SFTConfig for ``*_sft.yaml``), and each
    value it sets is the value the run gets."""
    import yaml

    from cispo.config.sft import SFTConfig
    from tests.conftest import example_command

    cfg = load_yaml(SFTConfig if example_command(path.name) == "sft" else TrainConfig, path)
    for key, value in _leaves(yaml.safe_load(path.read_text())):
        got = cfg
        for part in key.split("."):
            got = getattr(got, part)
        if dataclasses.is_dataclass(got) and not isinstance(value, dict):  # objective: cispo, the section's name
            got = got.name
        assert to_dict(got) == value, key  # a tuple as YAML's list


def test_the_committed_defaults_are_what_print_config_prints(capsys):
    """examples/defaults.yaml is ``cispo train --print-config`` now (regenerate it with that command when a
    field or its docstring changes), and it loads back as the defaults."""
    path = Path(__file__).resolve().parents[2] / "examples" / "defaults.yaml"
    assert main(["train", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert path.read_text() == printed, "run: cispo train --print-config > examples/defaults.yaml"
    assert load_yaml(TrainConfig, path) == TrainConfig()
    assert "\n    # IS weight upper bound 1 + eps_high_is (eq. 5)" in printed
    assert "\n    eps_high_is: preset\n" in printed


def test_print_config_shows_the_config_the_overrides_make(tmp_path, capsys):
    assert main(["train", "--print-config", "recipe=scalerl", "lr=3e-6"]) == 0
    path = tmp_path / "run.yaml"
    path.write_text(capsys.readouterr().out)
    assert load_yaml(TrainConfig, path) == apply_overrides(TrainConfig(), [*recipe_overrides("scalerl"), "lr=3e-6",
                                                                           "run_name=scalerl__addition__seed0"])


@pytest.mark.parametrize("file_text,overrides", [
    ("data:\n  path: p.jsonl\n", ["model.path=m", "data.reward=math", "max_new_tokens=8"]),
    ("rollout:\n  prompts_per_step: 1\n  group_size: 2\n", ["updates_per_batch=1"]),
    ("data:\n  train_files: [a.parquet]\n", ["data.reward=math", "model.path=m", "max_new_tokens=8"]),
])
def test_a_config_file_and_the_command_line_are_one_configuration(tmp_path, file_text, overrides):
    """A file that needs a key the command line gives (``data.path`` in the file, ``model.path`` and the reward
    on the command line) is checked with it, not refused on its own first; `cispo train --config` does the same."""
    from cispo.cli import _build_config

    path = tmp_path / "run.yaml"
    path.write_text(file_text)
    with pytest.raises(ConfigError):  # the file alone is incomplete (the way it was refused before)
        load_yaml(TrainConfig, path)
    cfg = _build_config(TrainConfig, str(path), overrides)
    assert cfg == load_yaml(TrainConfig, path, overrides)
    assert apply_overrides(cfg, []) == cfg


def test_a_file_and_override_problem_names_its_source(tmp_path):
    """A wrong value from the command line names its override, one from the file its line, once both are read."""
    path = tmp_path / "run.yaml"
    path.write_text("seed: 1\noptim:\n  lr: abc\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:3: optim\.lr"):
        load_yaml(TrainConfig, path, ["seed=2"])
    path.write_text("seed: 1\n")
    with pytest.raises(ConfigError, match=r"override 'optim\.lr=abc': optim\.lr"):
        load_yaml(TrainConfig, path, ["optim.lr=abc"])
    assert load_yaml(TrainConfig, path, ["objective=ppo", "algo.objective.eps_high=0.3"]).algo.objective.name == "ppo"


@pytest.mark.parametrize("override,message", [
    ("data.reward_weights=[true, false]", r"data\.reward_weights: expected list\[float\] \| None, got \[True, False\]"),
    ("rollout.async_steps=true", r"rollout\.async_steps: expected Literal\[0, 1\], got True"),
    ("algo.rollout_is_upper=3", r"algo\.rollout_is is off, so algo\.rollout_is_upper would be ignored"),
    ("algo.rollout_is_mode=mask", r"algo\.rollout_is is off, so algo\.rollout_is_mode would be ignored"),
])
def test_values_that_would_be_misread_or_ignored_are_refused(override, message):
    """A boolean where numbers are due (also inside a list: pydantic reads true as 1) and a rollout correction's
    settings with no correction to read them are refused in one line, not taken silently."""
    with pytest.raises(ConfigError, match=message):
        apply_overrides(TrainConfig(), [override])


def test_trl_report_to_none_on_the_command_line_means_no_trackers():
    """``report_to=none`` (TRL's spelling; the command line reads none as null) is no trackers, as in a file."""
    assert apply_overrides(TrainConfig(), ["report_to=none"]).trackers == []


@pytest.mark.parametrize("override, says", [
    ("vllm_importance_sampling_mode=sequence_mask", "did you mean 'algo.rollout_is' and 'algo.rollout_is_mode'?"),
    ("multi_objective_aggregation=sum_then_normalize", "TRL's default: cispo sums the rewards with"),
    ("top_entropy_quantile=0.2", "'top_entropy_quantile' in TRL: no cispo setting"),
    ("warmup_steps=0.1", "TRL reads a warmup_steps below 1 as a share of the run's steps: give it as "
                         "optim.warmup_ratio"),
    ("lr_scheduler_type=polynomial", "'polynomial' is not read: cispo's schedules are linear, cosine, constant and "
                                     "constant_with_warmup"),
    ("algorithm.rollout_correction.rollout_rs=token_k1", "did you mean 'algo.rollout_is' and 'algo.rollout_is_mode' "
                                                         "and 'algo.rollout_is_lower' and 'algo.rollout_is_upper'?"),
    ("algorithm.rollout_correction.rollout_rs_threshold=0.5_5.0",
     "algo.rollout_is_lower=1/U algo.rollout_is_upper=1/L"),
])
def test_trl_and_verl_names_users_reach_for_point_to_cispos_keys(override, says):
    msg = _error([override])
    assert says in msg and "\n" not in msg
    assert "repetition_stop_tokens'?" not in msg  # no spelling suggestion for a name of the table


@pytest.mark.parametrize("override, get, expected", [
    ("vllm_importance_sampling_clip_min=0.5", lambda c: c.algo.rollout_is_lower, 0.5),
    ("vllm_importance_sampling_clip_max=3.0", lambda c: c.algo.rollout_is_upper, 3.0),
    ("vllm_importance_sampling_correction=false", lambda c: c.algo.rollout_is, None),
    ("num_generations_eval=8", lambda c: c.eval.num_samples, 8),
    ("algorithm.rollout_correction.rollout_is=sequence", lambda c: c.algo.rollout_is, "seq-sum"),
    ("algorithm.rollout_correction.rollout_is_threshold=3.0", lambda c: c.algo.rollout_is_upper, 3.0),
])
def test_trl_and_verl_correction_names_are_read(override, get, expected):
    sets_level = "rollout_is=" in override or "correction=" in override
    overrides = ([] if sets_level else ["algo.rollout_is=token"]) + [override]
    assert get(apply_overrides(TrainConfig(), overrides)) == expected


NEW_KNOBS = [
    ("top_k: 50", lambda c: c.rollout.top_k, 50),
    ("min_p: 0.05", lambda c: c.rollout.min_p, 0.05),
    ("min_p: null", lambda c: c.rollout.min_p, 0.0),
    ("repetition_penalty: 1.1", lambda c: c.rollout.repetition_penalty, 1.1),
    ("mask_truncated_completions: true", lambda c: c.algo.mask_truncated_completions, True),
    ("lr_scheduler_type: cosine", lambda c: c.optim.lr_scheduler_type, "cosine"),
    ("warmup_ratio: 0.1", lambda c: c.optim.warmup_ratio, 0.1),
    ("warmup_steps: 0", lambda c: c.optim.warmup_updates, 0),
    ("actor_rollout_ref.rollout.top_k: -1", lambda c: c.rollout.top_k, 0),
    ("actor_rollout_ref.rollout.top_k: 20", lambda c: c.rollout.top_k, 20),
    ("actor_rollout_ref.actor.optim.lr_scheduler_type: constant", lambda c: c.optim.lr_scheduler_type,
     "constant_with_warmup"),
    ("actor_rollout_ref.actor.optim.warmup_style: cosine", lambda c: c.optim.lr_scheduler_type, "cosine"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio: 0.05", lambda c: c.optim.warmup_ratio, 0.05),
]


@pytest.mark.parametrize("line, get, expected", NEW_KNOBS, ids=[k[0] for k in NEW_KNOBS])
def test_trl_and_verl_names_of_the_sampling_schedule_and_masking_knobs_are_read_alike(line, get, expected, tmp_path):
    """TRL's top_k, min_p, repetition_penalty, mask_truncated_completions, lr_scheduler_type, warmup_ratio and verl's
    rollout.top_k, optim.lr_scheduler_type / warmup_style / lr_warmup_steps_ratio: read as cispo's keys, the same
    on the command line and in YAML (a dotted verl name written as YAML's nesting)."""
    key, value = (x.strip() for x in line.split(":", 1))
    assert get(apply_overrides(TrainConfig(), [f"{key}={value}"])) == expected
    nested = value
    for part in reversed(key.split(".")):
        nested = f"{{{part}: {nested}}}"
    path = tmp_path / "run.yaml"
    path.write_text(nested + "\n")
    assert get(load_yaml(TrainConfig, path)) == expected


def test_train_help_points_to_the_names_table():
    from cispo.config.describe import format_help
    from cispo.config.foreign_names import OTHER_NAMES

    text = format_help(TrainConfig)
    assert "docs/integrations.md" in text and f"{len(OTHER_NAMES)} of them" in text
