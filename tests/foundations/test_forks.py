"""Reflective strings on a real vocabulary: the token ids and sequences that spell
each string in SmolLM2's tokenizer, where they start in a response, the same counts in text, and the
per-string diagnostics of a hand-built batch."""

from __future__ import annotations

import json

import pytest
import torch

from cispo.cli import main
from cispo.config.train import ConfigError, TrainConfig, apply_overrides, load_yaml
from cispo.data.prompts import load_source
from cispo.data.tasks import wordmath
from cispo.foundations.experience import Completion, collate
from cispo.foundations.forks import ForkTokens, count_in_text, normalise, slug, used_any
from cispo.models.packaged import TOKENIZER_DIR, save_tiny_smollm2
from cispo.objective.loss import policy_loss, preset
from cispo.records.tracking import read_metrics
from cispo.training.metrics import FORK_COLUMNS, fork_metrics, fork_rollout_metrics, fork_sums

pytestmark = pytest.mark.usefixtures("one_thread")

STRINGS = ["Wait", " wait", "Let me check", "double-check", "recheck", "Hmm", "However"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def forks(tokenizer):
    return ForkTokens.from_tokenizer(tokenizer, STRINGS)


def test_each_string_is_every_token_sequence_that_spells_it(forks, tokenizer):
    assert forks.names == ("Wait", "Let me check", "double-check", "recheck", "Hmm", "However")  # " wait" = "Wait"
    assert forks.slugs == ("wait", "let_me_check", "double_check", "recheck", "hmm", "however")
    spelled = {name: {tuple(tokenizer.convert_ids_to_tokens(list(ids))) for ids in forks.spellings(name)}
               for name in forks.names}
    # one token each: either case, with and without the leading space (Ġ)
    assert forks.spellings("Wait") == {(33359,), (22297,), (14006,), (5847,)}
    assert spelled["Wait"] == {("Wait",), ("ĠWait",), ("wait",), ("Ġwait",)}
    assert forks.spellings("However") == {(4460,), (1423,), (47382,), (2107,)}
    # phrases: whole sequences, whose first token differs by case and space
    assert forks.spellings("Let me check") == {(4239, 549, 2545), (2959, 549, 2545), (2016, 549, 2545),
                                               (1303, 549, 2545)}
    assert spelled["double-check"] == {("double", "-", "check"), ("Ġdouble", "-", "check"),
                                       ("Double", "-", "check"), ("ĠDouble", "-", "check")}
    # BPE spells the same word differently with a space or a capital: all four are tracked
    assert spelled["recheck"] == {("re", "check"), ("Ġrec", "he", "ck"), ("Rec", "he", "ck"), ("ĠRe", "check")}
    assert spelled["Hmm"] == {("H", "mm"), ("ĠHmm",), ("h", "mm"), ("Ġh", "mm")}
    assert forks.missing() == ()


def response(tokenizer, text):
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False))


TEXTS = [
    "So 3 + 4 = 7. Wait, let me check: 3 + 4 = 7.\n#### 7",
    "The Waiter said Hmmm, however. Hmm. I double-check. Recheck:\n#### 9",
    "Wait... wait. Let me check again. Let me check.\n#### 2",
    "Ben has 5 apples. 5 + 2 = 7.\n#### 7",
]


def test_matches_start_at_the_first_token_of_whole_words(forks, tokenizer):
    ids = response(tokenizer, TEXTS[0] + " " + TEXTS[1])
    index = forks.index(ids[None], torch.ones(1, len(ids)))[0]  # [T]
    found = [(tokenizer.decode([int(ids[t])]), forks.names[int(i)]) for t, i in enumerate(index) if i >= 0]
    # "Waiter" and "Hmmm" are other words; the first token of each phrase carries the label
    assert found == [(" Wait", "Wait"), (" let", "Let me check"), (" however", "However"), (" Hmm", "Hmm"),
                     (" double", "double-check"), (" Re", "recheck")]
    # a match must lie inside the response: cut before " check", "Let me check" is not matched
    cut = [t for t, tok in enumerate(ids.tolist()) if tokenizer.decode([tok]) == " check"][0]
    mask = (torch.arange(len(ids)) < cut).float()[None]
    assert forks.names.index("Let me check") not in forks.index(ids[None], mask)[0].tolist()


def test_token_and_text_counts_agree(forks, tokenizer):
    for text in TEXTS:
        ids = response(tokenizer, text)
        index = forks.index(ids[None], torch.ones(1, len(ids)))[0]
        by_tokens = [int((index == i).sum()) for i in range(len(forks.names))]
        assert by_tokens == count_in_text(forks.names, text), text
    assert count_in_text(forks.names, TEXTS[2]) == [2, 2, 0, 0, 0, 0]
    assert used_any(wordmath.FORK_TOKENS, "Hold on, 3 + 4 = 7") and not used_any(wordmath.FORK_TOKENS, "Waiting")
    assert wordmath.used_fork("Actually it is 7") and not wordmath.used_fork(TEXTS[3])


def test_the_per_string_counts_of_a_hand_built_batch(forks, tokenizer):
    """Four responses (rewards 1, 0, 1, 0: advantages +1, -1, +1, -1). Every fork token's p_old is
    0.05 and its ratio 1.5 after the first update; every other token has p_old 0.5 and ratio 1."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    completions = [Completion({}, [eos], torch.cat([response(tokenizer, t), torch.tensor([eos])]),
                              torch.zeros(len(response(tokenizer, t)) + 1), "stop", t) for t in TEXTS]
    exp = collate(completions, torch.tensor([1.0, -1.0, 1.0, -1.0]), eos)
    exp.extras["fork_index"] = forks.index(exp.response_ids, exp.response_mask)
    is_fork = exp.extras["fork_index"] >= 0  # [B, T]
    exp.logp_old = torch.where(is_fork, torch.tensor(0.05).log(), torch.tensor(0.5).log()) * exp.response_mask
    logp_new = exp.logp_old + torch.where(is_fork, torch.tensor(1.5).log(), torch.tensor(0.0))
    _, stats = policy_loss(logp_new, exp.logp_old, exp.advantages, exp.response_mask, preset("dapo"))
    sums = fork_sums(exp, stats, len(forks.names), preset("dapo").eps_high)
    col = {c: [int(v) for v in sums[:, i]] for i, c in enumerate(FORK_COLUMNS) if c not in ("mass", "mass_above")}
    #                   Wait  Let me check  double-check  recheck  Hmm  However  (other)
    assert col["tokens"][:-1] == [3, 3, 1, 1, 1, 1]
    assert col["pos"][:-1] == [3, 3, 0, 0, 0, 0]  # rows 0 and 2 have A > 0
    assert col["pos_above"][:-1] == col["pos_lowp_above"][:-1] == [3, 3, 0, 0, 0, 0]
    assert col["ppo_dropped"] == [3, 3, 0, 0, 0, 0, 0]  # A < 0 above the bound: the lower half does not act
    assert col["tokens"][-1] == int(exp.response_mask.sum()) - 10
    out = {**fork_rollout_metrics(exp, forks.slugs), **fork_metrics([sums], forks.slugs)}
    assert out["fork/wait/rate"] == 0.5 and out["fork/let_me_check/rate"] == 0.5 and out["fork/hmm/rate"] == 0.25
    assert out["fork/wait/count"] == 3.0 and out["fork/other/p_old"] == pytest.approx(0.5)
    assert out["fork/wait/p_old"] == pytest.approx(0.05) and out["fork/recheck/frac_lowp"] == 1.0
    assert out["fork/double_check/frac_ppo_dropped_k1"] == 0.0 and out["fork/wait/frac_ppo_dropped_k1"] == 1.0
    assert out["fork/let_me_check/pos_mass_above_k1"] == 1.0 and out["fork/other/pos_mass_above"] == 0.0


def test_bad_fork_strings_are_one_sentence_naming_the_field():
    assert normalise(["Wait", " wait", "wait "]) == ("Wait",)  # the same string: either case, any space
    with pytest.raises(ValueError, match="'Wait' and 'WAIT' would share"):  # only the first letter's case folds
        normalise(["Wait", "WAIT"])
    with pytest.raises(ConfigError, match=r"data\.fork_tokens is not usable: fork string ' - ' has no letter or digit"):
        apply_overrides(TrainConfig(), ["data.fork_tokens=[Wait, ' - ']"])
    with pytest.raises(ConfigError, match=r"'double-check' and 'double check' would share the metric name "
                                          r"fork/double_check/"):
        apply_overrides(TrainConfig(), ["data.fork_tokens=[double-check, double check]"])
    assert slug("Let me check") == "let_me_check"


def test_a_config_of_the_old_single_fork_token_still_loads(tmp_path):
    """Run folders written before data.fork_token became data.fork_tokens (a list): resume, eval."""
    old = tmp_path / "config.yaml"
    old.write_text("data:\n  task: wordmath\n  fork_token: Wait\n")
    assert load_yaml(TrainConfig, old).data.fork_tokens == ["Wait"]
    old.write_text("data:\n  fork_token: null\n")
    assert load_yaml(TrainConfig, old).data.fork_tokens is None
    old.write_text("data:\n  fork_tokens: [Hmm]\n  fork_token: Wait\n")
    with pytest.raises(ConfigError, match=r"config\.yaml:3: data\.fork_token is the old name of data\.fork_tokens"):
        load_yaml(TrainConfig, old)
    assert apply_overrides(TrainConfig(), ["data.fork_token=Wait"]).data.fork_tokens == ["Wait"]


def test_the_config_overrides_the_task_list():
    cfg = apply_overrides(TrainConfig(), ["data.task=wordmath", "data.fork_tokens=[Wait, 'Let me check']"])
    task = load_source(cfg.data, None)
    assert task.fork_tokens == ("Wait", "Let me check")
    assert task.used_fork("let me check") and not task.used_fork("Actually")
    assert load_source(apply_overrides(TrainConfig(), ["data.task=wordmath"]).data, None).fork_tokens == \
        wordmath.FORK_TOKENS


def test_a_wordmath_run_logs_every_string_per_update(tmp_path):
    """The tiny random Llama with SmolLM2's tokenizer, K = 2: a block of keys per default string."""
    model = save_tiny_smollm2(tmp_path / "tiny")
    args = [f"model.path={model}", f"out_dir={tmp_path}", "data.task=wordmath", "model.device=cpu", "progress=false",
            "steps=1", "prompts_per_step=2", "group_size=4", "updates_per_batch=2", "max_new_tokens=12",
            "num_train_prompts=64",  # not the default 20,000, each chat-templated at the start (~9 CPU-s)
            "num_eval_prompts=2", "eval.num_samples=1", "eval.every=0", "dynamic_sampling=false", "run_name=r"]
    assert main(["train", *args]) == 0
    row = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if r["step"] == 1][0]
    for name in (*map(slug, wordmath.FORK_TOKENS), "other"):
        assert f"fork/{name}/pos_above" in row and f"fork/{name}/p_old" in row
        sampled = row[f"fork/{name}/count"] > 0  # per-update keys only for a string the step sampled
        for k in (1, 2):
            assert (f"fork/{name}/tokens_k{k}" in row) == (f"fork/{name}/frac_ppo_dropped_k{k}" in row) == sampled
        assert row.get(f"fork/{name}/tokens_k1", 0) + row.get(f"fork/{name}/tokens_k2", 0) == row[f"fork/{name}/count"]
    assert "fork/other/tokens_k3" not in row and row["fork/other/count"] > 0
    records = [json.loads(line) for line in (tmp_path / "r" / "samples.jsonl").read_text().splitlines()]
    assert all(r["fork_tokens"] == sum(count_in_text(wordmath.FORK_TOKENS, r["completion"])) for r in records)
