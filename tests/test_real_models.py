"""The trainer on a "real" Hugging Face checkpoint: a tiny Qwen2 with a chat template saved
to a folder, prompts from a JSONL file, the math reward, through the CLI."""

import json
import string

import pytest
import torch

from cispo.cli import main
from cispo.records.tracking import read_metrics

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_qwen2(path):
    """A character-level tokenizer with Qwen's chat tokens and a 2-layer Qwen2, saved like
    any Hugging Face checkpoint (no pad token: the trainer must cope)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # a byte-level BPE like Qwen's (transformers rebuilds qwen2 tokenizers as byte-level BPE)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([string.printable, "What is 1 + 2?\n\\boxed{3} user assistant system"], trainer)
    vocab = tok.get_vocab()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                        additional_special_tokens=specials)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture
def math_jsonl(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"question": f"What is {a} + {b}?", "solution": f"\\boxed{{{a + b}}}"} for a in range(6) for b in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_tiny_qwen2_trains_from_jsonl_with_math_reward(qwen_dir, math_jsonl, tmp_path):
    pytest.importorskip("math_verify")
    out = tmp_path / "runs"
    rc = main([
        "train", f"model.path={qwen_dir}", "model.chat_template=true", "model.device=cpu",
        f"data.path={math_jsonl}", "data.prompt_field=question", "data.answer_field=solution", "data.reward=math",
        "max_new_tokens=12", "steps=2", "prompts_per_step=4", "group_size=2", "updates_per_batch=2",
        "dynamic_sampling=false", "num_eval_prompts=4", "eval.num_samples=1", f"out_dir={out}", "progress=false",
        "run_name=qwen",
    ])
    assert rc == 0
    rows = read_metrics(out / "qwen" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["optim/updates"] == 4
    assert rows[-1]["rollout/logp_corr"] > 0.99
    # the checkpoint is a loadable Hugging Face folder with the chat template kept
    from cispo.models.loading import load_policy

    model, tok = load_policy(out / "qwen" / "checkpoints" / "step_000002" / "model")
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok.chat_template == CHAT_TEMPLATE


def test_chat_template_is_applied_to_prompts(qwen_dir):
    from cispo.models.loading import load_policy
    from cispo.models.policy import Policy
    from cispo.rollout import TorchSampler

    model, tok = load_policy(qwen_dir)
    policy = Policy(model, tok, TorchSampler(model, tok.eos_token_id, tok.eos_token_id), torch.device("cpu"),
                    chat_template=True)
    ids = policy.encode({"prompt": "hi"})
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.decode(policy.encode({"prompt": "hi", "messages": messages})).startswith("<|im_start|>system")


def test_bad_data_file_names_file_line_and_field(qwen_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "solution": "2"}\n{"questoin": "2+2?", "solution": "4"}\n')
    assert main(["train", f"model.path={qwen_dir}", f"data.path={bad}", "data.prompt_field=question",
                 "data.answer_field=solution", "data.reward=exact_match", "max_new_tokens=8", f"out_dir={tmp_path}",
                 "progress=false"]) == 2  # one line on stderr, no traceback
    err = capsys.readouterr().err
    assert "bad.jsonl: line 2: field 'question': missing prompt field" in err and "Traceback" not in err


def test_shards_eval_sets_and_system_prompt_in_a_run(qwen_dir, tmp_path, monkeypatch, capsys):
    """data.path a folder of shards, two named eval sets with their own fields (eval/<name>/...
    next to the held-out eval/...), and a system prompt, through the CLI."""
    from cispo.models.policy import Policy

    encoded, encode = [], Policy.encode
    monkeypatch.setattr(Policy, "encode", lambda self, s: encoded.append(self.tokenizer.decode(encode(self, s)))
                        or encode(self, s))
    rows = [{"question": f"What is {a} + {b}?", "solution": str(a + b)} for a in range(5) for b in range(4)]
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        (shards / f"part-{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[i::2]))
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"q": f"{i} + 1 =", "a": str(i + 1)}) + "\n"
                                                  for i in range(3)))
    out = tmp_path / "runs"
    rc = main([
        "train", f"model.path={qwen_dir}", "model.chat_template=true", "model.device=cpu",
        f"data.path={shards}", "data.prompt_field=question", "data.answer_field=solution", "data.reward=exact_match",
        "data.system_prompt=Answer with a number.", f"data.eval_sets.same={{path: {shards}, prompt_field: question, "
        "answer_field: solution, num_prompts: 2}", f"data.eval_sets.other.path={tmp_path / 'other.jsonl'}",
        "data.eval_sets.other.prompt_field=q", "data.eval_sets.other.answer_field=a",
        "max_new_tokens=4", "steps=1", "prompts_per_step=2", "group_size=2", "updates_per_batch=1",
        "dynamic_sampling=false", "num_eval_prompts=2", "eval.num_samples=1", "eval.every=1", f"out_dir={out}",
        "progress=false", "run_name=sets",
    ])
    assert rc == 0
    rows0 = read_metrics(out / "sets" / "metrics.jsonl")[0]
    for prefix in ("eval/", "eval/same/", "eval/other/"):
        assert 0.0 <= rows0[prefix + "accuracy_greedy"] <= 1.0
        assert rows0[prefix + "reward_errors"] == 0.0
    assert encoded and all(t.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n") for t in encoded)
    assert not [k for k in rows0 if k.startswith("eval/") and k.count("/") == 2
                and k.split("/")[1] not in ("same", "other")]
    # cispo eval on the checkpoint (the run's config: its eval sets) reports them too
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "sets" / "checkpoints" / "step_000001" / "model")]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert {"eval/accuracy_greedy", "eval/same/accuracy_greedy", "eval/other/accuracy_greedy"} <= set(metrics)
