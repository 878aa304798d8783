"""Bad models and settings that reach `cispo train` get one line and exit status 2, not a traceback."""

import json
import shutil

import pytest
import torch

from cispo.cli import main
from cispo.models.loading import load_policy, save_policy

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = ["model.device=cpu", "progress=false", "steps=1", "prompts_per_step=2", "group_size=2", "updates_per_batch=1",
       "num_train_prompts=8", "num_eval_prompts=2", "eval.every=0", "threads=1"]


def error_lines(err: str) -> str:
    """stderr less the lines that say the model's phase (``cispo: model: loading ...``, said before it loads)."""
    return "\n".join(line for line in err.strip().splitlines() if not line.startswith("cispo: model: "))


def train_error(tmp_path, capsys, *overrides) -> str:
    """`cispo train` with ``overrides``: its one error line (exit status 2 asserted)."""
    code = main(["train", *RUN, f"out_dir={tmp_path / 'runs'}", *overrides])
    err = error_lines(capsys.readouterr().err)
    assert code == 2, err[-2000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    return err


def copy_model(src, dest, tokenizer_config=None):
    shutil.copytree(src, dest)
    if tokenizer_config is not None:
        path = dest / "tokenizer_config.json"
        path.write_text(json.dumps(tokenizer_config(json.loads(path.read_text()))))
    return dest


def test_a_tokenizer_without_eos(tiny_model, tmp_path, capsys):
    def drop_eos(cfg):
        cfg.pop("eos_token", None)
        return cfg

    model = copy_model(tiny_model, tmp_path / "no_eos", drop_eos)
    assert "has no EOS token" in train_error(tmp_path, capsys, f"model.path={model}")


def test_non_finite_initial_weights_are_named_not_reported_as_a_bug(tiny_model, tmp_path, capsys):
    model, tokenizer = load_policy(tiny_model)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    save_policy(model, tokenizer, tmp_path / "nan")
    err = train_error(tmp_path, capsys, f"model.path={tmp_path / 'nan'}")
    assert "model.norm.weight holds NaN or inf" in err and "please report" not in err


def test_max_new_tokens_past_the_context(tiny_model, tmp_path, capsys):
    err = train_error(tmp_path, capsys, f"model.path={tiny_model}", "max_new_tokens=500")
    assert "nothing left to train on" in err and "max_new_tokens=500" in err


@pytest.mark.parametrize("value, expected", [
    ("nan", "algo.objective: max_log_ratio must be a finite number > 0 or None, got nan"),
    ("inf", "algo.objective: max_log_ratio must be a finite number > 0 or None, got inf"),
    ("'x'", "algo.objective.max_log_ratio: expected float | None | Literal['preset'], got 'x'"),
    ("true", "algo.objective.max_log_ratio: expected float | None | Literal['preset'], got 'true'"),
])
def test_an_objective_override_that_is_not_a_number(tiny_model, tmp_path, capsys, value, expected):
    err = train_error(tmp_path, capsys, f"model.path={tiny_model}", f"algo.objective.max_log_ratio={value}")
    assert expected in err


def test_a_chat_task_on_a_model_without_a_chat_template(tiny_model, tmp_path, capsys):
    err = train_error(tmp_path, capsys, f"model.path={tiny_model}", "data.task=wordmath")
    assert "data.task=wordmath writes its prompts as chat messages" in err and "no chat template" in err


def test_a_damaged_shipped_model_is_one_line(tmp_path, capsys, monkeypatch):
    """A shipped base model that fails its SHA256SUMS (a damaged install): exit 1, one line naming the file."""
    import cispo.models.builtin as builtin

    shipped = tmp_path / "base_models"
    shutil.copytree(builtin.SHIPPED_ROOT / "addition", shipped / "addition")
    with open(shipped / "addition" / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    monkeypatch.setattr(builtin, "SHIPPED_ROOT", shipped)
    monkeypatch.setenv("CISPO_CACHE", str(tmp_path / "cache"))
    code = main(["train", *RUN, f"out_dir={tmp_path / 'runs'}"])
    err = error_lines(capsys.readouterr().err)
    assert code == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    assert "model.safetensors" in err


def test_a_truncated_model_file_is_one_line_for_train_and_eval(tiny_model, tmp_path, capsys):
    """A model folder whose model.safetensors was cut short (a copy interrupted): one line naming the file,
    before anything loads (was: safetensors' error from inside from_pretrained, a traceback)."""
    model = copy_model(tiny_model, tmp_path / "cut")
    with open(model / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    err = train_error(tmp_path, capsys, f"model.path={model}")
    assert "model.safetensors cannot be read" in err and "the model folder is damaged" in err
    assert main(["eval", "--model", str(model), "data.task=addition", "num_eval_prompts=2"]) == 2
    assert "model.safetensors cannot be read" in capsys.readouterr().err
