"""``cispo sft`` (`cispo.training.sft`, `cispo.training.sft_data`): which tokens the loss counts (token by token,
both ways of finding them), that the loss falls, that a killed run resumes to the weights of an uninterrupted one,
that a bad row is one line naming it, and that the model written is one ``cispo train`` starts from."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cispo.cli import main
from cispo.config.engine import apply_overrides
from cispo.config.sft import SFTConfig
from cispo.data.tasks import wordmath_calc
from cispo.models.packaged import TOKENIZER_DIR, save_tiny_smollm2
from cispo.records.tracking import read_metrics
from cispo.training import sft as sft_module
from cispo.training.sft import sft
from cispo.training.sft_data import IGNORE, encode_chat, encode_parts, template_marks_assistant

pytestmark = pytest.mark.usefixtures("one_thread")

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A ChatML template with a tool format (SmolLM2's own has none), its assistant text marked ``{% generation %}``."""

ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}
CHAT = {"messages": [{"role": "user", "content": "What is 2+3?"},
                     {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": CALL}]},
                     {"role": "tool", "content": "5"},
                     {"role": "assistant", "content": "The answer is 5."}],
        "tools": [ADD]}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template."""
    return save_tiny_smollm2(tmp_path_factory.mktemp("sft") / "tiny-smollm2")


def _expected(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(ids, labels) of text pieces, each tokenized alone: trained pieces labelled with their ids."""
    ids, labels = [], []
    for text, trained in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    return ids, labels


@pytest.mark.parametrize("marked", [False, True], ids=["prefix-by-prefix", "generation-marks"])
def test_the_loss_counts_exactly_the_assistants_tokens(tokenizer, marked):
    """A user turn, a tool call, the tool's answer, the final answer: only the two assistant turns' text and their
    ``<|im_end|>`` are trained; the turns' openings, the tool's turn and ChatML's newline after each turn are context.
    The template's own ``{% generation %}`` mask and the prefix-by-prefix rule agree token for token."""
    tok = tokenizer.__class__.from_pretrained(str(TOKENIZER_DIR))
    tok.chat_template = TOOL_TEMPLATE if marked else TOOL_TEMPLATE.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    assert template_marks_assistant(tok) == marked
    pieces = [(f"<|im_start|>system\nTools: {json.dumps([ADD])}<|im_end|>\n"
               "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n", False),
              (f"<tool_call>{json.dumps(CALL)}</tool_call><|im_end|>", True),
              ("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", False),
              ("The answer is 5.<|im_end|>", True),
              ("\n", False)]
    assert tok.apply_chat_template(CHAT["messages"], tools=CHAT["tools"], tokenize=False) == "".join(
        t for t, _ in pieces)
    ids, labels = _expected(tok, pieces)
    example = encode_chat(tok, CHAT, tok.convert_tokens_to_ids("<|im_end|>"))
    assert example.ids == ids
    assert example.labels == labels  # token by token
    assert tok.decode([t for t in example.labels if t != IGNORE]) == (
        f"<tool_call>{json.dumps(CALL)}</tool_call><|im_end|>The answer is 5.<|im_end|>")


def test_a_worked_answer_trains_the_policys_pieces_and_the_turn_end_only(tokenizer):
    """The built-in task's demonstrations: the prompt and the environment's ``<result>`` are context."""
    demo = wordmath_calc.demonstrations(0, 1)[0]
    example = encode_parts(tokenizer, demo, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    trained = [i for i, label in zip(example.ids, example.labels) if label != IGNORE]
    assert [label for label in example.labels if label != IGNORE] == trained
    call, observed, answer = (text for text, _ in demo["parts"])
    assert tokenizer.decode(trained) == call + answer + "<|im_end|>"
    assert observed in tokenizer.decode(example.ids)


def _write_chats(path, n: int = 8) -> str:
    rows = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i} {i} {i}"}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _losses(run_dir) -> list[float]:
    """``sft/loss`` of each optimizer step of a run (step 0's row holds the data's size)."""
    return [r["sft/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]


def _config(tiny, out, *extra) -> SFTConfig:
    return apply_overrides(SFTConfig(), [f"model.path={tiny}", f"out_dir={out}", "model.device=cpu", "threads=1",
                                         "progress=false", "batch_size=4", "optim.lr=3e-3", *extra])


def test_the_loss_falls_on_a_toy_set_and_micro_batches_change_nothing(tiny, tmp_path):
    chats = _write_chats(tmp_path / "chats.jsonl")
    result = sft(_config(tiny, tmp_path, f"data.path={chats}", "epochs=6", "run_name=whole", "optim.lr=1e-2"))
    losses = _losses(result.run_dir)
    assert len(losses) == 12 and losses[-1] < losses[0] - 3.0  # a random model's ~10.8 nats (ln 49152) falls
    split = sft(_config(tiny, tmp_path, f"data.path={chats}", "epochs=6", "run_name=split", "micro_batch_size=1",
                        "optim.lr=1e-2"))
    assert _losses(split.run_dir) == pytest.approx(losses, abs=1e-4)


def test_a_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_weights(tiny, tmp_path, monkeypatch):
    settings = ("data.num_demonstrations=8", "epochs=2", "checkpoint_every=1", "model.lora_rank=0")
    whole = sft(_config(tiny, tmp_path, *settings, "run_name=whole"))
    real_step = sft_module.train_step

    def killed_at_3(run, step):
        if step == 3:
            raise KeyboardInterrupt("killed")
        return real_step(run, step)

    monkeypatch.setattr(sft_module, "train_step", killed_at_3)
    with pytest.raises(KeyboardInterrupt):
        sft(_config(tiny, tmp_path, *settings, "run_name=killed"))
    monkeypatch.setattr(sft_module, "train_step", real_step)
    resumed = sft(_config(tiny, tmp_path, *settings, "run_name=killed"), resume_run=True)
    a, b = load_file(whole.final / "model.safetensors"), load_file(resumed.final / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # the killed step logged once, by the resumed run
    assert rows[0]["sft/conversations"] == 8 and _losses(resumed.run_dir) == _losses(whole.run_dir)


@pytest.mark.parametrize("line, where", [
    ('{"prompt": "hi"}', "line 2: field 'messages': missing"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}',
     "line 2: field 'messages[1].role': expected one of system, developer, user, assistant, tool, got 'bot'"),
    ('{"messages": [{"role": "user", "content": "a"}', "line 2: invalid JSON"),
    ('{"messages": [{"role": "user", "content": "a"}]}', "line 2: field 'messages': no assistant turn"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": null, "tool_calls": '
     '[{"type": "function", "function": {"name": "add", "arguments": {}}}]}]}',
     "line 2: field 'messages[1].tool_calls': the chat template does not render the call to 'add'"),
])
def test_a_bad_row_is_one_line_naming_the_file_line_and_field(tiny, tmp_path, capsys, line, where):
    data = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    data.write_text(json.dumps(good) + "\n" + line + "\n")
    assert main(["sft", f"data.path={data}", f"model.path={tiny}", f"out_dir={tmp_path}", "threads=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"cispo sft: error: {data}: {where}"), err
    assert not any(line.startswith("Traceback") for line in err)
    assert not (tmp_path / f"sft__{data.stem}__seed0").exists()  # refused before the run folder is made


def test_the_final_model_is_what_cispo_train_starts_from_and_lora_is_merged(tiny, tmp_path):
    pytest.importorskip("peft")  # the lora extra
    result = sft(_config(tiny, tmp_path, "data.num_demonstrations=4", "model.lora_rank=4", "optim.lr=1e-2"))
    before, after = load_file(tiny / "model.safetensors"), load_file(result.final / "model.safetensors")
    assert after.keys() == before.keys()  # plain (merged) weights, no adapter names
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"],
                           after["model.layers.0.self_attn.q_proj.weight"])
    rc = main(["train", f"model.path={result.final}", "data.task=wordmath_calc", f"out_dir={tmp_path}", "steps=1",
               "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
               "rollout.dynamic_sampling=false", "algo.updates_per_batch=1", "data.num_train_prompts=4",
               "data.num_eval_prompts=2", "eval.every=0", "checkpoint_every=0", "model.device=cpu", "threads=1",
               "progress=false", "run_name=rl"])
    assert rc == 0
    assert max(r.get("optim/updates", 0) for r in read_metrics(tmp_path / "rl" / "metrics.jsonl")) == 1


def test_the_calculator_example_is_the_study_warm_starts_settings():
    """examples/calculator_sft.yaml gives only ``optim.lr``: the section keeps AdamW's plain defaults (torch's betas
    and eps, no clipping, no warm-up), as ``warm_start.py``'s ``torch.optim.AdamW(lr=5e-5, weight_decay=0)`` had,
    not ``cispo train``'s (a 16-update warm-up there made step 2's loss 1.46 instead of the study's 0.74)."""
    from pathlib import Path

    from cispo.config.engine import load_yaml

    cfg = load_yaml(SFTConfig, Path(__file__).resolve().parents[2] / "examples" / "calculator_sft.yaml")
    o = cfg.optim
    assert (o.lr, tuple(o.betas), o.eps, o.weight_decay, o.grad_clip, o.warmup_updates) == (
        5e-5, (0.9, 0.999), 1e-8, 0.0, 0.0, 0)
    d = cfg.data
    assert (d.task, d.num_demonstrations, d.seed, d.numbers, d.calculator, d.call_share) == (
        "wordmath_calc", 256, 1, "small", True, None)
    assert (cfg.epochs, cfg.batch_size, cfg.seed, cfg.model.path) == (1, 8, 0, "builtin:smollm2-135m")
