"""``cispo train`` with a ``data.tools`` mistake or a missing optional package (peft, vLLM): one line on stderr
naming the spec or the extra to install, exit status 2, no traceback, said before any weights load (a tool file
that exits at import does not end cispo)."""

import json
import shutil
import sys

import pytest

import cispo.training.run
from cispo.cli import main

TOOLS = '''
CONST = 3


def f(x: str) -> str:
    """F.

    Args:
        x: X.
    """
    return x


def noarg() -> str:
    """Takes nothing."""
    return "1"
'''
FILES = {"good.py": TOOLS, "other.py": TOOLS, "syntax.py": "def f(x):\n    return x +\n",
         "names.py": "undefined_name\n", "exits.py": "import sys\nsys.exit(0)\n"}
PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MISTAKES = {
    "syntax.py:f": "SyntaxError", "names.py:f": "NameError: name 'undefined_name'",
    "exits.py:f": "exited with sys.exit(0)", "missing.py:f": "no such file", "good.py:nope": "has no attribute 'nope'",
    "good.py:CONST": "is not callable", "calculater": "did you mean 'calculator'",
    "good.py:f,,g": "functions separated",
    "123": "unknown tool '123'", "[good.py:f,other.py:f]": "two tools are named 'f'",
    "[good.py:f,good.py:f]": "is given twice", "good.py:noarg": "takes no argument",
}


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    """The tiny model with a chat template that renders no tools."""
    folder = tmp_path_factory.mktemp("chat_model") / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": PLAIN_TEMPLATE}))
    return folder


CHAT_ON_A_PLAIN_TEMPLATE = ("calculator data.tool_format=chat", "renders no tools")


@pytest.mark.parametrize("tools, message", [*MISTAKES.items(), CHAT_ON_A_PLAIN_TEMPLATE])
def test_a_tool_mistake_is_one_line_before_the_model_loads(tools, message, chat_model, tmp_path, monkeypatch, capsys):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the tools were checked")

    monkeypatch.setattr(cispo.training.run, "set_up_policy", no_model)
    args = ["train", "data.task=wordmath_calc", f"model.path={chat_model}", "model.device=cpu", "progress=false",
            f"out_dir={tmp_path / 'runs'}", "steps=1", *(f"data.tools={tools}".split(" "))]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("cispo train: error: data.tool")
    assert message in err


@pytest.mark.parametrize("setting, package", [("model.lora_rank=4", "peft"), ("rollout.engine=vllm", "vllm")])
def test_a_missing_extra_is_one_line_naming_it(setting, package, tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)  # as if it were not installed
    monkeypatch.setattr(cispo.training.run, "set_up_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    args = ["train", f"model.path={tiny_model}", "model.device=cpu", "progress=false", f"out_dir={tmp_path}",
            "steps=1", setting]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert f'needs {package}, which is not installed: pip install "cispo[' in err


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('no system role here') }}", "failed on the first prompt: TemplateError: no system role here"),
    ("{% for m in messages %}{{ m['role'] + 1 }}{% endfor %}", "failed on the first prompt"),
    ("{% if false %}x{% endif %}", "renders the first prompt as nothing"),
    ("{% for i in range(90000) %}{% for m in messages %}{{ m['content'] * 9 }}{% endfor %}{% endfor %}",
     "tokens, over ten times the context"),
])
def test_a_chat_template_that_fails_is_one_line_naming_its_folder(template, message, tiny_model, tmp_path, capsys):
    """A template that raises (Jinja's own error or the template's raise_exception) or renders nothing: one line
    naming the model folder's template, before any step (was: a traceback in the first step naming no template)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    args = ["train", f"model.path={folder}", "model.device=cpu", "progress=false", f"out_dir={tmp_path / 'runs'}",
            "steps=1", "model.chat_template=true", "eval.every=0", "data.num_eval_prompts=0"]
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("cispo train: error")]  # beside the progress lines
    assert "Traceback" not in err and len(errors) == 1
    assert f"the chat template of {folder}" in errors[0] and message in errors[0]


def test_a_chat_template_that_renders_for_too_long_is_refused_not_waited_on():
    """A template that loops would hang set-up (every prompt is rendered to fit the context): the first prompt's
    rendering gets `RENDER_TIMEOUT_S`, then one line, the rendering left behind in a daemon thread."""
    import threading
    import types

    from cispo.config.train import ConfigError
    from cispo.training.run_policy import check_chat_template

    release = threading.Event()
    policy = types.SimpleNamespace(chat_template=True, tokenizer=types.SimpleNamespace(name_or_path="MODEL"),
                                   encode=lambda sample: release.wait(60) and [1])
    try:
        with pytest.raises(ConfigError, match=r"the chat template of MODEL .* took over 0\.2 s to render"):
            check_chat_template(policy, {"prompt": "x"}, timeout_s=0.2)
    finally:
        release.set()
