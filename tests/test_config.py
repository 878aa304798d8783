"""The generic config machinery, on toy nested dataclasses (frozen and plain)."""

from __future__ import annotations

import argparse
import copy
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from cispo.config import (
    ConfigError,
    apply_overrides,
    field_docs,
    format_help,
    from_dict,
    load_yaml,
    save_yaml,
    to_dict,
)

# ---------------------------------------------------------------------------------------
# Toy configs. Names are chosen to exercise the leaf aliases: `seed` exists at top level
# and in `optim` (top level wins); `name` exists in `data` and `model` (ambiguous);
# `lr`, `betas`, `dropout` exist once (unique aliases).
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Optim:
    """The optimizer."""

    lr: float = 1e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate schedule."""
    seed: int = 1
    """Optimizer-local seed.

    A second paragraph, to test cleaning."""
    warmup: int = 10

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@dataclass(frozen=True)
class Head:
    """The output head."""

    dropout: float = 0.0
    """Dropout before the head."""


@dataclass
class Model:
    """The policy model."""

    name: str = "tiny"
    """Model name."""
    head: Head = field(default_factory=Head)
    """Head settings."""


@dataclass
class Data:
    """The data."""

    name: str = "arith"
    """Dataset name."""
    max_len: int | None = 64
    """Longest prompt; None for no limit."""
    weights: list[float] = field(default_factory=lambda: [1.0])
    """Mixture weights."""


@dataclass
class Run:
    """A toy run."""

    objective: str = "cispo"
    """Objective preset name."""
    seed: int = 0
    """Random seed."""
    steps: int = 100
    """Optimizer steps."""
    eval_every: int | None = 10
    """Evaluate every this many steps; None: never."""
    debug: bool = False
    """Extra checks."""
    mode: Literal["train", "eval"] = "train"
    """What to do."""
    objective_overrides: dict[str, Any] = field(default_factory=dict)
    """Objective fields to change."""
    optim: Optim = field(default_factory=Optim)
    """Optimizer settings."""
    data: Data = field(default_factory=Data)
    """Data settings."""
    model: Model = field(default_factory=Model)
    """Model settings."""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


@dataclass
class WithOptional:
    """A config with an optional section."""

    extra: Head | None = None
    """Optional head."""
    tags: dict[str, float] = field(default_factory=dict)
    """Typed dict."""


@dataclass
class Required:
    """A config with a required field."""

    n: int
    """No default."""


class Device(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


@dataclass
class Paths:
    """Enum and Path fields."""

    out: Path = Path("runs/x")
    """Output directory."""
    device: Device = Device.CPU
    """Where to run."""


def _msg(excinfo) -> str:
    return str(excinfo.value)


# ---------------------------------------------------------------------------------------
# field_docs
# ---------------------------------------------------------------------------------------


def test_field_docs_reads_attribute_docstrings():
    docs = field_docs(Optim)
    assert docs["lr"] == "Peak learning rate."
    assert docs["betas"] == "AdamW betas."
    assert docs["seed"] == "Optimizer-local seed.\n\nA second paragraph, to test cleaning."
    assert docs["warmup"] == ""  # no docstring
    assert list(docs) == ["lr", "betas", "schedule", "seed", "warmup"]
    assert field_docs(Run)["optim"] == "Optimizer settings."


def test_field_docs_is_cached_and_returns_a_copy():
    docs = field_docs(Optim)
    docs["lr"] = "changed"
    assert field_docs(Optim)["lr"] == "Peak learning rate."


def test_field_docs_includes_base_class_fields():
    @dataclass(frozen=True)
    class Child(Head):
        """A subclass."""

        width: int = 4
        """Width."""

    assert field_docs(Child) == {"dropout": "Dropout before the head.", "width": "Width."}


def test_field_docs_rejects_non_dataclass():
    with pytest.raises(TypeError):
        field_docs(int)


# ---------------------------------------------------------------------------------------
# to_dict / from_dict
# ---------------------------------------------------------------------------------------


def test_to_dict_is_nested_plain_data():
    d = to_dict(Run())
    assert d["optim"] == {"lr": 1e-4, "betas": [0.9, 0.95], "schedule": "cosine", "seed": 1, "warmup": 10}
    assert d["model"]["head"] == {"dropout": 0.0}
    assert d["objective_overrides"] == {}
    assert isinstance(d["optim"]["betas"], list)


def test_dict_round_trip():
    cfg = Run(
        seed=3,
        eval_every=None,
        objective_overrides={"eps_high_is": 2.0, "nested": {"a": [1, 2]}},
        optim=Optim(lr=3e-4, betas=(0.8, 0.9)),
        data=Data(weights=[0.5, 0.5]),
    )
    back = from_dict(Run, to_dict(cfg))
    assert back == cfg
    assert isinstance(back.optim.betas, tuple) and isinstance(back.optim, Optim)


def test_from_dict_missing_keys_take_defaults():
    cfg = from_dict(Run, {"optim": {"lr": 0.5}, "model": {"head": {}}})
    assert cfg == Run(optim=Optim(lr=0.5))
    assert from_dict(Run, {}) == Run() == from_dict(Run, None)
    assert from_dict(Run, {"optim": None}) == Run()  # an empty YAML section


def test_from_dict_coercions():
    cfg = from_dict(
        Run,
        {
            "optim": {"lr": 1, "betas": ["0.5", 0.6], "warmup": "20"},
            "steps": 1e3,
            "data": {"max_len": None, "weights": (1, 2)},
        },
    )
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.5, 0.6)
    assert cfg.optim.warmup == 20
    assert cfg.steps == 1000 and isinstance(cfg.steps, int)
    assert cfg.data.max_len is None
    assert cfg.data.weights == [1.0, 2.0]
    assert from_dict(Optim, {"lr": "1e-4"}).lr == 1e-4  # the PyYAML 1e-4 string


def test_from_dict_accepts_section_instances():
    assert from_dict(Run, {"optim": Optim(lr=0.2)}).optim == Optim(lr=0.2)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"optim": {"lr": "abc"}}, "<dict>: optim.lr: expected float, got 'abc'"),
        ({"steps": 1.5}, "<dict>: steps: expected int, got 1.5"),
        ({"steps": True}, "<dict>: steps: expected int, got True"),
        ({"optim": {"lr": True}}, "<dict>: optim.lr: expected float, got True"),
        ({"debug": "yes"}, "<dict>: debug: expected bool, got 'yes'"),
        ({"debug": 1}, "<dict>: debug: expected bool, got 1"),
        ({"objective": 3}, "<dict>: objective: expected str, got 3"),
        ({"eval_every": "x"}, "<dict>: eval_every: expected int | None, got 'x'"),
        ({"mode": "test"}, "<dict>: mode: expected one of 'train', 'eval', got 'test'"),
        ({"optim": {"schedule": "linear"}}, "optim.schedule: expected one of 'cosine', 'constant'"),
        ({"optim": {"betas": [0.9]}}, "<dict>: optim.betas: expected tuple[float, float] (2 items), got 1 items"),
        ({"optim": {"betas": 0.9}}, "<dict>: optim.betas: expected tuple[float, float], got 0.9"),
        ({"data": {"weights": [1.0, "x"]}}, "<dict>: data.weights[1]: expected float, got 'x'"),
        ({"objective_overrides": [1]}, "<dict>: objective_overrides: expected dict[str, Any], got [1]"),
        ({"optim": 3}, "<dict>: optim: expected a mapping for section Optim, got 3"),
    ],
)
def test_from_dict_type_errors(data, expected):
    with pytest.raises(ConfigError) as e:
        from_dict(Run, data)
    assert expected in _msg(e)


def test_from_dict_unknown_key_suggests_closest():
    with pytest.raises(ConfigError) as e:
        from_dict(Run, {"optim": {"lrr": 1.0}}, source="cfg.json")
    assert _msg(e) == "cfg.json: optim.lrr: unknown key; did you mean 'optim.lr'?"
    with pytest.raises(ConfigError) as e:  # a leaf at the wrong level
        from_dict(Run, {"lr": 1.0})
    assert "did you mean 'optim.lr'?" in _msg(e)
    with pytest.raises(ConfigError) as e:  # nothing close: list the section's keys
        from_dict(Run, {"optim": {"zzzzzz": 1}})
    assert "valid keys here: lr, betas, schedule, seed, warmup" in _msg(e)


def test_from_dict_post_init_error_names_source():
    with pytest.raises(ConfigError) as e:
        from_dict(Run, {"optim": {"lr": -1}}, source="run.yaml")
    assert _msg(e) == "run.yaml: optim: lr must be positive, got -1.0"
    with pytest.raises(ConfigError) as e:
        from_dict(Run, {"steps": 0}, source="run.yaml")
    assert _msg(e) == "run.yaml: steps must be >= 1, got 0"


def test_from_dict_missing_required_key():
    with pytest.raises(ConfigError, match="missing required key"):
        from_dict(Required, {})
    assert from_dict(Required, {"n": 2}).n == 2


def test_from_dict_optional_section_and_typed_dict():
    assert from_dict(WithOptional, {}).extra is None
    cfg = from_dict(WithOptional, {"extra": {"dropout": 0.1}, "tags": {"a": 1}})
    assert cfg.extra == Head(dropout=0.1) and cfg.tags == {"a": 1.0}
    with pytest.raises(ConfigError, match=r"tags\.a: expected float, got 'x'"):
        from_dict(WithOptional, {"tags": {"a": "x"}})
    with pytest.raises(ConfigError, match=r"extra\.dropout: expected float"):
        from_dict(WithOptional, {"extra": {"dropout": "x"}})


# ---------------------------------------------------------------------------------------
# YAML files
# ---------------------------------------------------------------------------------------


def _write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_round_trip(tmp_path):
    cfg = Run(
        objective="1e-4",  # a str that looks like a float must stay a str
        seed=7,
        eval_every=None,
        debug=True,
        mode="eval",
        objective_overrides={"eps_high_is": 2.0, "tiny": 1e-10, "s": "true", "l": [1, 2], "d": {"x": None}},
        optim=Optim(lr=3e-4, betas=(0.9, 0.99), schedule="constant"),
        data=Data(name="multi\nline: text", max_len=None, weights=[0.25, 0.75]),
        model=Model(head=Head(dropout=0.1)),
    )
    path = tmp_path / "sub" / "resolved.yaml"
    save_yaml(cfg, path)
    assert load_yaml(Run, path) == cfg
    text = path.read_text()
    assert text.startswith("# Run: the resolved configuration")
    assert "# Peak learning rate." in text  # docstrings as comments
    assert "lr: 0.0003" in text


def test_yaml_round_trip_defaults(tmp_path):
    path = tmp_path / "d.yaml"
    save_yaml(Run(), path)
    assert load_yaml(Run, path) == Run()


def test_yaml_empty_file_gives_defaults(tmp_path):
    assert load_yaml(Run, _write(tmp_path, "")) == Run()
    assert load_yaml(Run, _write(tmp_path, "# only a comment\n")) == Run()


def test_yaml_reads_exponent_floats(tmp_path):
    path = _write(tmp_path, "optim:\n  lr: 1e-4\nobjective_overrides:\n  eps: 2e-3\n")
    cfg = load_yaml(Run, path)
    assert cfg.optim.lr == 1e-4
    assert cfg.objective_overrides == {"eps": 2e-3}  # Any-typed: the loader itself reads floats


def test_yaml_wrong_type_names_file_line_and_key(tmp_path):
    path = _write(tmp_path, "seed: 1\noptim:\n  warmup: 3\n  lr: abc\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(Run, path)
    assert _msg(e) == f"{path}:4: optim.lr: expected float, got 'abc'"


def test_yaml_list_item_error_has_its_own_line(tmp_path):
    path = _write(tmp_path, "data:\n  weights:\n    - 1.0\n    - oops\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(Run, path)
    assert _msg(e) == f"{path}:4: data.weights[1]: expected float, got 'oops'"


def test_yaml_unknown_key_names_file_line_key_and_suggestion(tmp_path):
    path = _write(tmp_path, "seed: 1\n\noptim:\n  lr: 0.1\n  betass: [0.9, 0.9]\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(Run, path)
    assert _msg(e) == f"{path}:5: optim.betass: unknown key; did you mean 'optim.betas'?"


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = _write(tmp_path, "seed: 1\noptim:\n  lr: [0.1\n  betas: 2\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(Run, path)
    assert _msg(e).startswith(f"{path}:4: invalid YAML:")
    path = _write(tmp_path, "seed: 1\nsteps: 2: 3\n", "bad.yaml")
    with pytest.raises(ConfigError) as e:
        load_yaml(Run, path)
    assert _msg(e).startswith(f"{path}:2: invalid YAML: mapping values are not allowed here")


def test_yaml_duplicate_key(tmp_path):
    path = _write(tmp_path, "seed: 1\nsteps: 5\nseed: 2\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(Run, path)
    assert _msg(e) == f"{path}:3: seed: duplicate key (first set on line 1)"


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    text = "base: &b {x: 1, y: 2}\nobjective_overrides:\n  <<: *b\n  x: 3\n"
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=r":1: base: unknown key"):
        load_yaml(Run, path)
    path = _write(tmp_path, "objective_overrides: &b {x: 1}\ndata:\n  name: n\n", "ok.yaml")
    assert load_yaml(Run, path).objective_overrides == {"x": 1}


def test_yaml_post_init_error_names_file(tmp_path):
    path = _write(tmp_path, "steps: 0\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(Run, path)
    assert _msg(e) == f"{path}: steps must be >= 1, got 0"
    path = _write(tmp_path, "optim:\n  lr: -1.0\n", "neg.yaml")
    with pytest.raises(ConfigError) as e:
        load_yaml(Run, path)
    assert _msg(e) == f"{path}:1: optim: lr must be positive, got -1.0"


def test_yaml_top_level_must_be_mapping(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping of config keys at top level, got list"):
        load_yaml(Run, _write(tmp_path, "- 1\n- 2\n"))


def test_yaml_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_yaml(Run, tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------------------


def test_override_dotted_and_leaf_alias():
    cfg = apply_overrides(Run(), ["optim.lr=3e-4", "betas=[0.8, 0.99]", "dropout=0.25", "head.dropout=0.5"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.8, 0.99)
    assert cfg.model.head.dropout == 0.5
    assert apply_overrides(Run(), ["lr=1e-4"]).optim.lr == 1e-4


def test_override_top_level_wins_over_nested():
    cfg = apply_overrides(Run(), ["seed=5"])
    assert cfg.seed == 5 and cfg.optim.seed == 1
    assert apply_overrides(Run(), ["optim.seed=9"]).optim.seed == 9


def test_override_ambiguous_leaf_lists_candidates():
    with pytest.raises(ConfigError) as e:
        apply_overrides(Run(), ["name=x"])
    assert "ambiguous key 'name'" in _msg(e)
    assert "data.name" in _msg(e) and "model.name" in _msg(e)
    assert apply_overrides(Run(), ["data.name=x"]).data.name == "x"


@pytest.mark.parametrize(
    "override, getter, expected",
    [
        ("lr=1e-4", lambda c: c.optim.lr, 1e-4),  # PyYAML alone reads '1e-4' as a string
        ("lr=3E5", lambda c: c.optim.lr, 3e5),
        ("lr=2", lambda c: c.optim.lr, 2.0),  # an int for a float field
        ("steps=1e3", lambda c: c.steps, 1000),
        ("debug=true", lambda c: c.debug, True),
        ("debug=false", lambda c: c.debug, False),
        ("debug=True", lambda c: c.debug, True),
        ("eval_every=None", lambda c: c.eval_every, None),
        ("eval_every=null", lambda c: c.eval_every, None),
        ("max_len=~", lambda c: c.data.max_len, None),
        ("eval_every=5", lambda c: c.eval_every, 5),
        ("optim.betas=[0.9,0.99]", lambda c: c.optim.betas, (0.9, 0.99)),
        ("schedule=constant", lambda c: c.optim.schedule, "constant"),
        ("mode=eval", lambda c: c.mode, "eval"),
        ("objective=2024", lambda c: c.objective, "2024"),  # a str field keeps the text
        ("objective=true", lambda c: c.objective, "true"),
        ("objective='quoted'", lambda c: c.objective, "quoted"),
        ("objective=a=b", lambda c: c.objective, "a=b"),  # split at the first '='
        ("objective=", lambda c: c.objective, ""),
        ("data.weights=[1, 2]", lambda c: c.data.weights, [1.0, 2.0]),
        (" seed = 4 ", lambda c: c.seed, 4),
    ],
)
def test_override_values(override, getter, expected):
    value = getter(apply_overrides(Run(), [override]))
    assert value == expected and type(value) is type(expected)


def test_override_dict_entries_and_mapping():
    cfg = apply_overrides(Run(), ["objective_overrides.eps_high_is=2.0", "objective_overrides.eps_low_is=1e-1"])
    assert cfg.objective_overrides == {"eps_high_is": 2.0, "eps_low_is": 0.1}
    cfg = apply_overrides(cfg, ["objective_overrides.kl.coef=0.5"])  # nested entry
    assert cfg.objective_overrides["kl"] == {"coef": 0.5}
    cfg = apply_overrides(cfg, ["objective_overrides={eps_high_is: 3.0}"])  # a mapping replaces
    assert cfg.objective_overrides == {"eps_high_is": 3.0}
    assert apply_overrides(cfg, ["objective_overrides={}"]).objective_overrides == {}


def test_override_typed_dict_entry_and_optional_section():
    cfg = apply_overrides(WithOptional(), ["tags.a=1", "extra.dropout=0.3"])
    assert cfg.tags == {"a": 1.0} and cfg.extra == Head(dropout=0.3)
    with pytest.raises(ConfigError, match=r"tags\.b: expected float, got 'x'"):
        apply_overrides(WithOptional(), ["tags.b=x"])
    assert apply_overrides(cfg, ["extra=null"]).extra is None


def test_override_section_mapping_merges():
    cfg = apply_overrides(Run(optim=Optim(lr=0.5)), ["optim={warmup: 3, betas: [0.1, 0.2]}"])
    assert cfg.optim == Optim(lr=0.5, warmup=3, betas=(0.1, 0.2))
    with pytest.raises(ConfigError, match="optim.lrr: unknown key; did you mean 'optim.lr'"):
        apply_overrides(Run(), ["optim={lrr: 1}"])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("lr=abc", "override 'lr=abc': optim.lr: expected float, got 'abc'"),
        ("debug=maybe", "override 'debug=maybe': debug: expected bool, got 'maybe'"),
        ("debug=1", "debug: expected bool, got 1"),
        ("steps=None", "override 'steps=None': steps: expected int, got 'None'"),
        ("mode=test", "override 'mode=test': mode: expected one of 'train', 'eval', got 'test'"),
        ("schedule=linear", "optim.schedule: expected one of 'cosine', 'constant', got 'linear'"),
        ("betas=[0.9]", "optim.betas: expected tuple[float, float] (2 items), got 1 items"),
        ("betas=[0.9, x]", "optim.betas[1]: expected float, got 'x'"),
        ("optim.lrr=1", "override 'optim.lrr=1': unknown key 'optim.lrr'; did you mean 'optim.lr'?"),
        ("lrr=1", "unknown key 'lrr'; did you mean 'optim.lr'?"),
        ("optim.lr.x=1", "unknown key 'optim.lr.x' (optim.lr has type float, not a section)"),
        ("seed", "override 'seed': expected key=value"),
        ("=3", "malformed key ''"),
        ("optim..lr=1", "malformed key 'optim..lr'"),
        ("lr=[1", "lr: cannot parse '[1' as a YAML value"),
        ("lr=-1", "override 'lr=-1': optim: lr must be positive, got -1.0"),  # __post_init__
        ("steps=0", "override 'steps=0': steps must be >= 1, got 0"),
    ],
)
def test_override_errors(override, expected):
    with pytest.raises(ConfigError) as e:
        apply_overrides(Run(), [override])
    assert expected in _msg(e)


def test_override_does_not_mutate_input():
    cfg = Run(objective_overrides={"a": 1}, data=Data(weights=[1.0]))
    before = copy.deepcopy(cfg)
    out = apply_overrides(
        cfg, ["objective_overrides.b=2", "data.weights=[3]", "data.name=z", "lr=0.3", "seed=2", "dropout=0.1"]
    )
    assert cfg == before
    assert out.objective_overrides == {"a": 1, "b": 2} and cfg.objective_overrides == {"a": 1}
    assert out is not cfg and out.data is not cfg.data
    assert out.model.head.dropout == 0.1 and cfg.model.head.dropout == 0.0


def test_overrides_apply_in_order():
    assert apply_overrides(Run(), ["seed=1", "seed=2"]).seed == 2
    assert apply_overrides(Run(), []) == Run()


def test_enum_and_path_fields(tmp_path):
    cfg = from_dict(Paths, {"out": "a/b", "device": "cuda"})
    assert cfg == Paths(out=Path("a/b"), device=Device.CUDA)
    assert to_dict(cfg) == {"out": "a/b", "device": "cuda"}
    assert from_dict(Paths, {"device": "CUDA"}).device is Device.CUDA  # by member name too
    with pytest.raises(ConfigError, match=r"device: expected one of 'cpu', 'cuda' \(Device\), got 'tpu'"):
        from_dict(Paths, {"device": "tpu"})
    assert apply_overrides(Paths(), ["out=2024", "device=cuda"]) == Paths(out=Path("2024"), device=Device.CUDA)
    save_yaml(cfg, tmp_path / "p.yaml")
    assert load_yaml(Paths, tmp_path / "p.yaml") == cfg


def test_saved_multiline_string_stays_on_one_line(tmp_path):
    cfg = Run(data=Data(name="multi\nline: x"))
    save_yaml(cfg, tmp_path / "m.yaml")
    assert '  name: "multi\\nline: x"' in (tmp_path / "m.yaml").read_text()
    assert load_yaml(Run, tmp_path / "m.yaml") == cfg


# ---------------------------------------------------------------------------------------
# Help text
# ---------------------------------------------------------------------------------------


def test_format_help_lists_every_field():
    text = format_help(Run)
    for cls, prefix in [(Run, ""), (Optim, "optim."), (Data, "data."), (Model, "model."), (Head, "model.head.")]:
        for name, doc in field_docs(cls).items():
            if name in ("optim", "data", "model", "head"):
                continue
            assert f"  {prefix}{name}: " in text
            for line in doc.splitlines():
                assert line in text
    assert "  optim.lr: float = 0.0001" in text
    assert "  optim.betas: tuple[float, float] = (0.9, 0.95)" in text
    assert "  eval_every: int | None = 10" in text
    assert "  mode: Literal['train', 'eval'] = 'train'" in text
    assert "  objective_overrides: dict[str, Any] = {}" in text
    assert "  objective: str = 'cispo'" in text
    assert "optim (Optim): The optimizer." in text  # section headers with docstrings
    assert "model.head (Head): The output head." in text
    assert text.index("  seed: int") < text.index("optim (Optim)") < text.index("  optim.lr")


def test_format_help_optional_and_required():
    assert "extra (Head | None = None): The output head." in format_help(WithOptional)
    assert "  n: int (required)" in format_help(Required)


def test_format_help_fits_argparse_epilog():
    parser = argparse.ArgumentParser(epilog=format_help(Run), formatter_class=argparse.RawDescriptionHelpFormatter)
    assert "      Peak learning rate." in parser.format_help()
