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


def save_tiny_qwen2(path, eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE):
    """A character-level tokenizer with Qwen's chat tokens and a 2-layer Qwen2, saved like
    any Hugging Face checkpoint (no pad token: the trainer must cope). ``eos_token``: Qwen2.5-Instruct's
    ``<|im_end|>``, or the base model's ``<|endoftext|>`` (the chat turn then ends with another token);
    ``chat_template`` None: a base model without one."""
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
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token,
                                        additional_special_tokens=specials)
    tokenizer.chat_template = chat_template
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


# --------------------------------------------------------------------------- chat prompts and stop tokens


CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 1 + 1?"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "What is 1 + 2?"}]
CONVERSATION_TEXT = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n"
                     "<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
                     "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def base_qwen_dir(tmp_path_factory):
    """The tiny Qwen2 without a chat template (a base model)."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2_base"), chat_template=None)


@pytest.fixture(scope="module")
def endoftext_qwen_dir(tmp_path_factory):
    """The tiny Qwen2 whose EOS is ``<|endoftext|>`` while its chat turns end with ``<|im_end|>``."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2_endoftext"), eos_token="<|endoftext|>")


@pytest.fixture
def chat_jsonl(tmp_path):
    """TRL's conversational format: each prompt a whole conversation (system, user, an earlier assistant turn)."""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": CONVERSATION, "answer": "3"}) + "\n" for _ in range(10)))
    return path


def read_config(model_dir, data, *overrides):
    """The config of a run on ``data``, resolved as the runner does once the data is read, and its prompt source."""
    from cispo.config.train import TrainConfig, apply_overrides
    from cispo.data.prompts import load_eval_sets, load_source
    from cispo.training.run_policy import resolve_chat_template

    cfg = apply_overrides(TrainConfig(), [f"model.path={model_dir}", f"data.path={data}", "data.reward=exact_match",
                                          "max_new_tokens=4", "model.device=cpu", "num_eval_prompts=2", *overrides])
    source = load_source(cfg.data, cfg.rollout.max_new_tokens)
    return resolve_chat_template(cfg, source, load_eval_sets(cfg.data)), source


def test_chat_prompts_are_templated_whole_by_default(qwen_dir, chat_jsonl):
    """model.chat_template defaults to auto, which turns the template on for message-list prompts; the
    whole conversation is templated (system, user, earlier assistant turn), not the last user message."""
    from cispo.config.train import TrainConfig
    from cispo.training.run_policy import load_policy_for

    assert TrainConfig().model.chat_template == "auto"
    cfg, source = read_config(qwen_dir, chat_jsonl)
    assert cfg.model.chat_template is True
    policy = load_policy_for(cfg, source, torch.device("cpu"))
    assert policy.tokenizer.decode(policy.encode(source.train[0])) == CONVERSATION_TEXT


def test_a_run_on_chat_data_records_the_templated_prompt(qwen_dir, chat_jsonl, tmp_path):
    """The symptom users met, through the CLI with no chat setting: samples.jsonl shows the templated
    conversation (it was ``templated_prompt: null``, the bare last user message), and config.yaml records
    the resolved ``chat_template: true``."""
    import yaml

    out = tmp_path / "runs"
    assert main(["train", f"model.path={qwen_dir}", "model.device=cpu", f"data.path={chat_jsonl}",
                 "data.reward=exact_match", "max_new_tokens=4", "steps=1", "prompts_per_step=2", "group_size=2",
                 "updates_per_batch=1", "dynamic_sampling=false", "num_eval_prompts=2", "eval.num_samples=1",
                 f"out_dir={out}", "progress=false", "run_name=chat", "log_samples_every=1"]) == 0
    rows = [json.loads(line) for line in (out / "chat" / "samples.jsonl").read_text().splitlines()]
    assert rows and all(r["templated_prompt"] == CONVERSATION_TEXT for r in rows)
    assert yaml.safe_load((out / "chat" / "config.yaml").read_text())["model"]["chat_template"] is True


def test_auto_leaves_text_prompts_bare_unless_a_system_prompt_is_set(qwen_dir, math_jsonl):
    cfg, source = read_config(qwen_dir, math_jsonl, "data.prompt_field=question", "data.answer_field=solution")
    assert cfg.model.chat_template is False
    cfg, _ = read_config(qwen_dir, math_jsonl, "data.prompt_field=question", "data.answer_field=solution",
                         "data.system_prompt=Be brief.")
    assert cfg.model.chat_template is True  # a system message exists only in a chat template


def test_chat_prompts_on_a_model_without_a_template_are_one_line(base_qwen_dir, chat_jsonl, math_jsonl, tmp_path,
                                                                  capsys):
    assert main(["train", f"model.path={base_qwen_dir}", "model.device=cpu", f"data.path={chat_jsonl}",
                 "data.reward=exact_match", "max_new_tokens=4", f"out_dir={tmp_path}", "progress=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"the prompts of {chat_jsonl} are chat messages" in err and f"tokenizer of {base_qwen_dir}" in err
    assert "no chat template" in err and "model.chat_template=false" in err
    cfg, _ = read_config(base_qwen_dir, math_jsonl, "data.prompt_field=question", "data.answer_field=solution")
    assert cfg.model.chat_template is False  # text prompts on a base model: nothing to template


def test_chat_template_false_is_the_last_user_message_with_a_warning(qwen_dir, chat_jsonl, capsys):
    from cispo.training.run_policy import load_policy_for

    cfg, source = read_config(qwen_dir, chat_jsonl, "model.chat_template=false")
    err = capsys.readouterr().err
    assert cfg.model.chat_template is False
    assert f"10 of the chat-message prompts of {chat_jsonl} hold more than their last user message" in err
    policy = load_policy_for(cfg, source, torch.device("cpu"))
    assert policy.encode(source.train[0]) == policy.tokenizer.encode("What is 1 + 2?")


def test_sampling_stops_at_the_chat_turn_end_when_eos_differs(endoftext_qwen_dir, chat_jsonl):
    """EOS <|endoftext|>, turns closed by <|im_end|>: a templated run stops at <|im_end|> too (kept in
    the response, as EOS is). The model is made to say <|im_end|> first (a bias on its logits)."""
    from cispo.rollout import SamplingConfig
    from cispo.training.run_policy import load_policy_for

    cfg, source = read_config(endoftext_qwen_dir, chat_jsonl, "model.fp32_lm_head=false", "rollout.decode=hf")
    policy = load_policy_for(cfg, source, torch.device("cpu"))
    tok = policy.tokenizer
    eos, im_end = tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")
    assert eos != im_end and policy.sampler.stop_token_ids == (eos, im_end)
    bias = torch.zeros(len(tok))
    bias[im_end] = 100.0
    policy.model.lm_head.register_forward_hook(lambda module, args, logits: logits + bias)
    b = policy.sampler.generate([policy.encode(source.train[0])] * 2, SamplingConfig(max_new_tokens=6, temperature=0))
    assert b.response_ids.tolist() == [[im_end]] * 2 and b.finish_reason == ["eos"] * 2
    assert b.response_mask.tolist() == [[1.0]] * 2
    text_cfg, text_source = read_config(endoftext_qwen_dir, chat_jsonl, "model.chat_template=false")
    assert load_policy_for(text_cfg, text_source, torch.device("cpu")).sampler.stop_token_ids == (eos,)


def test_every_eos_id_of_the_generation_config_stops(endoftext_qwen_dir, tmp_path):
    """generation_config.json's eos_token_id may be a list (Llama-3-Instruct's): each id is a stop id."""
    import shutil

    from cispo.models.loading import load_policy, stop_token_ids

    folder = shutil.copytree(endoftext_qwen_dir, tmp_path / "model")
    model, tok = load_policy(folder)
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    meta = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**meta, "eos_token_id": [im_start, tok.eos_token_id]}))
    model, tok = load_policy(folder)
    assert stop_token_ids(model, tok, templated=False) == [tok.eos_token_id, im_start]
    assert stop_token_ids(model, tok, templated=True) == [tok.eos_token_id, im_start, im_end]


@pytest.mark.parametrize("template,turn_end", [
    (CHAT_TEMPLATE, "<|im_end|>"),  # ChatML
    ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
     "{% endfor %}", "<|eot_id|>"),  # Llama-3
    ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}", None),  # plain text: no token
    ("{{ raise_exception('roles must alternate') }}", None),  # a template that refuses the probe
])
def test_turn_end_is_read_from_the_template(qwen_dir, template, turn_end):
    from transformers import AutoTokenizer

    from cispo.models.loading import turn_end_id

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = template
    assert turn_end_id(tok) == (None if turn_end is None else tok.convert_tokens_to_ids(turn_end))
