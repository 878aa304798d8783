"""Rule-based rewards (exact match, math-verify) and load_reward."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from cispo.data.rewards.exact import exact_match, extract_boxed, extract_final_answer, gold_answer
from cispo.data.rewards.loading import BUILTIN_REWARDS, RewardSpecError, load_reward

try:
    import math_verify  # noqa: F401

    HAVE_MATH_VERIFY = True
except ImportError:
    HAVE_MATH_VERIFY = False

needs_math_verify = pytest.mark.skipif(not HAVE_MATH_VERIFY,
                                       reason='math-verify not installed (pip install "cispo[math]")')


# --------------------------------------------------------------------------- extraction / exact match


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{ 2 }", "2"),  # the last one, stripped
        (r"\boxed{3} and an unclosed \boxed{4", "3"),  # an unclosed box is ignored
        (r"\boxed{\text{a}{b}}", r"\text{a}{b}"),  # balanced braces
        ("Thus 6 * 7 = 42.\n#### 42", "42"),
        ("The answer is: 17 apples.\nDone.", "17 apples."),
        ("Final Answer:\n\n  x = 3", "x = 3"),  # marker at the end of its line: the next line
        ("3 + 4 = 7, then 7 * 2 = 14", "14"),  # the last number
        ("We get 1,250 in total", "1,250"),
        ("no digits here\nlast line", "last line"),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_extract_boxed_and_gold_answer():
    assert extract_boxed("none") is None
    assert gold_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert gold_answer(r"\boxed{\frac{3}{4}}") == r"\frac{3}{4}"
    assert gold_answer(42) == "42"


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),  # GSM8K style
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # raw GSM8K gold
        ("#### 71", "72", 0.0),
        (r"Therefore $\boxed{1,000}$", "1000", 1.0),  # commas in numbers
        ("The answer is $1,000.", "1000", 1.0),  # $ and trailing period
        ("The answer is 1,000,000", "1000000", 1.0),
        ("The answer is 42 dollars.", "42", 1.0),
        ("The answer is 42.0", "42", 1.0),  # numeric value
        ("the answer is 4200", "42", 0.0),
        ("The answer is 2 + 2 = 4", "2", 0.0),  # not a number followed by a word
        ("The answer is **Paris**.", "paris", 1.0),  # case-insensitive, markdown bold
        (r"\boxed{\text{B}}", "b", 1.0),
        ("I computed 6 + 36 = 42", "42", 1.0),  # the last number
        ("I have no idea", "42", 0.0),
        ("", "42", 0.0),
        (r"\boxed{5}", ["4", "5"], 1.0),  # a list of acceptable answers
    ],
)
def test_exact_match(completion, answer, reward):
    assert exact_match("prompt", completion, answer=answer, other_field=1) == reward


def test_exact_match_case_sensitive_and_missing_answer():
    assert exact_match("p", "The answer is Paris", answer="paris", ignore_case=False) == 0.0
    with pytest.raises(ValueError, match="needs the sample's 'answer'"):
        exact_match("p", "42")


# --------------------------------------------------------------------------- math-verify


@needs_math_verify
@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        (r"So the answer is $\boxed{0.5}$.", r"\frac{1}{2}", 1.0),
        (r"$\boxed{\sqrt{8}}$", r"2\sqrt{2}", 1.0),
        (r"$\boxed{\dfrac{3}{4}}$", "0.75", 1.0),
        (r"\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        ("The final answer is 72", "She sold 24.\n#### 72", 1.0),  # GSM8K gold
        (r"\boxed{\frac{1}{2}}", 0.5, 1.0),  # numeric gold
        (r"\boxed{0.333}", r"\frac{1}{3}", 0.0),
        (r"\boxed{2\sqrt{3}}", r"2\sqrt{2}", 0.0),
        (r"\boxed{5}", "6", 0.0),
        (r"\boxed{3} and then \boxed{7}", "3", 0.0),  # the last boxed answer counts
        (r"\boxed{7}", ["3", "7"], 1.0),
    ],
)
def test_math_reward_equivalence(completion, answer, reward):
    from cispo.data.rewards.math import math_reward

    assert math_reward("prompt", completion, answer=answer, data_source="x") == reward


@needs_math_verify
@pytest.mark.parametrize("completion", ["", "   ", "}{{ \\frac{ \\boxed{", "\\boxed{", "$$$$", "\x00\x01", "∑∫√"])
def test_math_reward_garbage_is_zero(completion):
    from cispo.data.rewards.math import math_reward

    assert math_reward("p", completion, answer=r"\frac{1}{2}") == 0.0
    assert math_reward("p", r"\boxed{1}", answer="}{garbage\\") == 0.0  # a garbage gold never raises


@needs_math_verify
def test_math_reward_never_raises(monkeypatch):
    import cispo.data.rewards.math as m

    parse, verify, cfg, Timeout = m.require_math_verify()

    def boom(*a, **k):
        raise RuntimeError("sympy exploded")

    def timeout(*a, **k):
        raise Timeout("timed out")

    try:
        for bad in (boom, timeout):
            monkeypatch.setattr(m, "require_math_verify", lambda bad=bad: (bad, verify, cfg, Timeout))
            m._parse_gold.cache_clear()
            assert m.math_reward("p", r"\boxed{\sqrt{8}}", answer=r"2\sqrt{2}") == 0.0
    finally:
        m._parse_gold.cache_clear()  # drop the golds parsed by the broken parser
    with pytest.raises(ValueError, match="answer"):
        m.math_reward("p", r"\boxed{1}")


@needs_math_verify
def test_math_reward_in_a_worker_thread():
    from cispo.data.rewards.math import math_reward

    out, errors = [], []

    def work():
        try:
            out.append(math_reward("p", r"\boxed{\sqrt{8}}", answer=r"2\sqrt{2}"))
            out.append(math_reward("p", r"\boxed{3}", answer="4"))
        except BaseException as e:  # pragma: no cover - the failure we test against
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors and out == [1.0, 0.0]


def test_math_reward_without_math_verify(monkeypatch):
    import cispo.data.rewards.math as m

    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify -> ImportError
    monkeypatch.setitem(sys.modules, "math_verify.errors", None)
    m.require_math_verify.cache_clear()
    try:
        with pytest.raises(ImportError, match=r'pip install "cispo\[math\]"'):
            m.math_reward("p", r"\boxed{1}", answer="1")
        with pytest.raises(ImportError, match=r'pip install "cispo\[math\]"'):
            load_reward("math")
    finally:
        m.require_math_verify.cache_clear()


# --------------------------------------------------------------------------- load_reward


def test_load_builtins():
    assert load_reward("exact_match").fn is exact_match
    assert load_reward(" exact_match ").fn is exact_match
    assert set(BUILTIN_REWARDS) == {"math", "math_lenient", "exact_match", "code", "env"}
    assert load_reward("env")("q", "anything", answer="7") == 0.0  # the environment's rewards alone
    if HAVE_MATH_VERIFY:
        from cispo.data.rewards.math import math_reward

        assert load_reward("math").fn is math_reward
    assert load_reward("cispo.data.rewards.exact:exact_match").fn is exact_match
    # the path rule: built-in names run in the main thread, everything else in worker processes
    assert not load_reward("exact_match").isolated
    assert load_reward("cispo.data.rewards.exact:exact_match").isolated
    assert load_reward("exact_match", isolation="process").isolated
    assert not load_reward("cispo.data.rewards.exact:exact_match", isolation="main").isolated
    with pytest.raises(RewardSpecError, match="data.reward_isolation must be one of auto, process, main"):
        load_reward("exact_match", isolation="thread")
    with pytest.raises(RewardSpecError, match="data.reward_workers must be a positive int"):
        load_reward("exact_match", workers=0)


def test_load_builtin_code_is_lazy(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("cispo.data.rewards.code") is None:
        with pytest.raises(RewardSpecError, match="built-in reward 'code' is not available"):
            load_reward("code")
    else:
        assert callable(load_reward("code"))


MODULE = '''
LIMIT = 3

def score(prompt, completion, **sample):
    return float(len(completion) <= LIMIT)

class Scorer:
    @staticmethod
    def strict(prompt, completion, **sample):
        return 0.0
'''


def test_load_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("my_rewards_mod:score")
    assert fn("p", "abc") == 1.0 and fn("p", "abcd") == 0.0
    assert load_reward("my_rewards_mod:Scorer.strict")("p", "x") == 0.0
    with pytest.raises(RewardSpecError, match=r"'my_rewards_mod' has no attribute 'scor' \(did you mean 'score'"):
        load_reward("my_rewards_mod:scor")
    with pytest.raises(RewardSpecError, match=r"'LIMIT' in 'my_rewards_mod' is not callable \(it is a int\)"):
        load_reward("my_rewards_mod:LIMIT")
    with pytest.raises(RewardSpecError, match=r"no module named 'no_such_reward_mod'"):
        load_reward("no_such_reward_mod:score")
    with pytest.raises(RewardSpecError, match=r"expected 'module:function'"):
        load_reward("my_rewards_mod:")


def test_load_module_with_broken_import(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("import not_installed_dep_xyz\ndef f(p, c): return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardSpecError, match=r"importing module 'broken_reward_mod' failed.*not_installed_dep_xyz"):
        load_reward("broken_reward_mod:f")


def test_load_file_function(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "reward_file.py"
    path.parent.mkdir()
    path.write_text(MODULE)
    assert load_reward(f"{path}:score")("p", "ab") == 1.0
    monkeypatch.chdir(tmp_path)
    assert load_reward("sub/reward_file.py:score")("p", "abcd") == 0.0  # relative to the cwd
    with pytest.raises(RewardSpecError, match=r"has no attribute 'scores' \(did you mean 'score'"):
        load_reward("sub/reward_file.py:scores")
    with pytest.raises(RewardSpecError, match=r"no such file 'sub/missing\.py'"):
        load_reward("sub/missing.py:score")
    (tmp_path / "bad.py").write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(RewardSpecError, match=r"importing .*bad\.py' failed: RuntimeError: boom at import"):
        load_reward("bad.py:f")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("maths", r"unknown reward 'maths' \(did you mean 'math'\?\); built-in rewards: code, env, exact_match, math"),
        ("exact", r"unknown reward 'exact'"),
        ("", r"non-empty string"),
    ],
)
def test_load_reward_unknown(spec, message):
    with pytest.raises(RewardSpecError, match=message):
        load_reward(spec)


# --------------------------------------------------------------------------- TRL and verl signatures

# Written exactly as TRL documents custom reward functions (docs/source/grpo_trainer.md,
# "Using a custom reward function", examples 1.1, 2 and 3), plus its async form.
TRL_REWARDS = r'''
import re

def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]

def reference_reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

def math_reward_func(prompts, completions, task, **kwargs):
    return [(1.0 if "4" in c else -1.0) if t == "math" else None for p, c, t in zip(prompts, completions, task)]

async def async_reward_func(prompts, completions, **kwargs):
    return [float(len(p) + len(c)) for p, c in zip(prompts, completions)]

def ids_reward_func(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]
'''

# Written as verl documents a custom reward function (custom_reward_function.path / name), a
# dict-returning one, and the signature of verl's own per-data-set scorers (gsm8k.compute_score).
VERL_REWARDS = r'''
def my_reward_fn(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 100

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip().endswith(str(ground_truth))
    return {"score": 1.0 if correct else 0.0, "acc": correct, "source": data_source,
            "split": (extra_info or {}).get("split")}

def gsm8k_style(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    return score if solution_str.endswith("#### " + ground_truth) else format_score
'''


@pytest.fixture
def trl_file(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_REWARDS)
    return path


@pytest.fixture
def verl_file(tmp_path):
    path = tmp_path / "verl_rewards.py"
    path.write_text(VERL_REWARDS)
    return path


def test_trl_rewards_load_unchanged(trl_file):
    r = load_reward(f"{trl_file}:reward_func")
    assert r.convention == "trl" and r("p", " in the sky.", answer="x") == 12.0
    fmt = load_reward(f"{trl_file}:format_reward_func")
    messages = [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}]
    good = "<think>The sum of 1 and 2 is 3.</think><answer>(1 + 2) * 4 = 12</answer>"
    assert fmt("What is ...", good, messages=messages) == 1.0  # chat data: TRL's conversational format
    assert fmt("What is ...", "12", messages=messages) == 0.0
    ref = load_reward(f"{trl_file}:reference_reward_func")
    assert ref.needs == [("ground_truth",)]
    assert ref("p", r" The solution is \boxed{2}.", ground_truth="2") == 1.0
    assert ref("p", r" The solution is \boxed{6}.", ground_truth="5") == 0.0
    multi = load_reward(f"{trl_file}:math_reward_func")
    assert multi.needs == [("task",)] and multi("2+2?", "4", task="math") == 1.0
    from cispo.data.rewards import safe_reward

    value, error = safe_reward(multi, "code?", "def f", {"task": "code"})  # TRL's "not applicable"
    assert value == 0.0 and "returned NoneType" in error  # with one reward, a counted error
    assert load_reward(f"{trl_file}:async_reward_func")("ab", "cde") == 5.0
    with pytest.raises(RewardSpecError, match="needs completion_ids: token ids are not passed"):
        load_reward(f"{trl_file}:ids_reward_func")


def test_verl_rewards_load_unchanged(verl_file):
    r = load_reward(f"{verl_file}:my_reward_fn")
    assert r.convention == "verl" and r.needs == [("ground_truth", "reward_model.ground_truth", "answer")]
    assert r("p", "x" * 50, answer="7") == 0.5
    score = load_reward(f"{verl_file}:compute_score")
    assert score("p", "so 72", answer="72", data_source="openai/gsm8k") == 1.0  # the dict's "score"
    assert score("p", "so 71", ground_truth="72") == 0.0  # ground_truth wins over answer
    assert score.fn(data_source="d", solution_str="1", ground_truth="1",
                    extra_info={"split": "train"})["split"] == "train"
    gsm8k = load_reward(f"{verl_file}:gsm8k_style")  # no data_source / extra_info parameters
    assert gsm8k("p", "... #### 72", answer="72", data_source="openai/gsm8k") == 1.0


def test_trl_and_verl_rewards_in_worker_processes(trl_file, verl_file):
    from cispo.data.rewards import score_rewards
    from cispo.data.rewards.pool import shutdown_pools

    try:
        trl = load_reward(f"{trl_file}:reference_reward_func", workers=1)
        verl = load_reward(f"{verl_file}:compute_score", workers=1)
        assert trl.isolated and verl.isolated
        calls = [("p", r"\boxed{2}", {"ground_truth": "2"}), ("p", r"\boxed{3}", {"ground_truth": "2"})]
        assert score_rewards(trl, calls, 30) == [(1.0, None), (0.0, None)]
        assert score_rewards(verl, [("p", "is 72", {"answer": "72"})], 30) == [(1.0, None)]
    finally:
        shutdown_pools()


@pytest.mark.slow
def test_verls_own_gsm8k_scorer():
    pytest.importorskip("verl")
    r = load_reward("verl.utils.reward_score.gsm8k:compute_score", isolation="main")
    assert r.convention == "verl"
    assert r("p", "48 + 24 = 72 #### 72", answer="72", data_source="openai/gsm8k") == 1.0


# --------------------------------------------------------------------------- fields checked at set-up


def _source(tmp_path, rows, reward, **data):
    from cispo.config.train import DataConfig
    from cispo.data.prompts import load_source

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(path), reward=reward, num_eval_prompts=2, **data)
    return load_source(cfg, 16), cfg


def test_a_reward_missing_its_field_fails_at_setup(tmp_path, trl_file):
    from cispo.data.rewards.loading import check_reward_fields

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    task, cfg = _source(tmp_path, rows, "code")
    with pytest.raises(RewardSpecError, match=r"prompts\.jsonl'?: training sample 0 has no field 'tests', which "
                                              r"reward 'code' needs \(the data set has no such column\)"):
        check_reward_fields(task, cfg)
    task, cfg = _source(tmp_path, rows, "code", extra_fields=None)  # columns passed only when named
    with pytest.raises(RewardSpecError, match=r"no field 'tests', which reward 'code' needs \(add it with "
                                              r"data.extra_fields=\[tests\], or data.extra_fields=all\)"):
        check_reward_fields(task, cfg)
    task, cfg = _source(tmp_path, rows, "exact_match", answer_field=None)
    with pytest.raises(RewardSpecError, match=r"no field 'answer', which reward 'exact_match' needs "
                                              r"\(set data.answer_field"):
        check_reward_fields(task, cfg)
    task, cfg = _source(tmp_path, rows, f"{trl_file}:reference_reward_func")
    with pytest.raises(RewardSpecError, match=r"no field 'ground_truth'.*no such column"):
        check_reward_fields(task, cfg)
    rows = [{**r, "ground_truth": r["answer"], "tests": "assert True"} for r in rows]
    for reward in ("code", "exact_match", f"{trl_file}:reference_reward_func"):
        for data in ({"extra_fields": ["ground_truth", "tests"]}, {}):  # named, or every column (the default)
            task, cfg = _source(tmp_path, rows, reward, **data)
            check_reward_fields(task, cfg)  # every field is there


def test_train_checks_the_fields_before_loading_a_model(tmp_path):
    from cispo.config.train import TrainConfig, apply_overrides
    from cispo.training.runner import train

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(20)))
    not_loadable = tmp_path / "not_loadable"  # a model folder whose loading would fail
    not_loadable.mkdir()
    (not_loadable / "config.json").write_text("{}")
    cfg = apply_overrides(TrainConfig(), [f"data.path={path}", "data.reward=code", "max_new_tokens=8",
                                          f"model.path={not_loadable}", f"out_dir={tmp_path}",
                                          "model.device=cpu", "progress=false"])
    with pytest.raises(RewardSpecError, match="has no field 'tests'"):
        train(cfg)


# --------------------------------------------------------------------------- reserved column names

RESERVED_REWARDS = """
def score(prompt, completion, **sample):
    return 1.0


def named(question, response, **sample):
    return 1.0


def by_position(question, response, /, **sample):
    return 1.0


class Scorer:
    def score(self, prompt, completion, **sample):
        return 1.0


scorer = Scorer()
"""


@pytest.mark.parametrize("column, spec, what", [
    ("self", "exact_match", "argument 'self'"),  # every call: "Reward.__call__() got multiple values for 'self'"
    ("self", "{file}:score", "argument 'self'"),
    ("self", "{file}:scorer.score", "argument 'self'"),  # a method: its own self
    ("question", "{file}:named", "parameter 'question', which receives the prompt"),
    ("response", "{file}:named", "parameter 'response', which receives the completion"),
])
def test_a_column_named_like_an_argument_the_reward_gets_fails_at_setup(tmp_path, column, spec, what):
    """Before, a column ``self`` made every reward call fail ("got multiple values for argument 'self'")
    and the run went on with every reward 0; no set-up check named the column."""
    from cispo.data.rewards.loading import check_reward_fields

    file = tmp_path / "reserved_rewards.py"
    file.write_text(RESERVED_REWARDS)
    rows = [{"prompt": f"q{i}", "answer": str(i), column: "x"} for i in range(20)]
    task, cfg = _source(tmp_path, rows, spec.format(file=file), reward_isolation="main")
    with pytest.raises(RewardSpecError, match=rf"^data file '.*prompts\.jsonl': training sample 0 has a column "
                                              rf"'{column}', which would meet its {what}") as e:
        check_reward_fields(task, cfg)
    assert "\n" not in str(e.value)


def test_columns_a_reward_does_not_bind_pass_the_check(tmp_path):
    from cispo.data.rewards.loading import check_reward_fields

    file = tmp_path / "reserved_rewards.py"
    file.write_text(RESERVED_REWARDS)
    rows = [{"prompt": f"q{i}", "answer": str(i), "question": "x", "response": "y"} for i in range(20)]
    for spec in ("exact_match", f"{file}:score", f"{file}:by_position"):  # positional-only: no clash
        task, cfg = _source(tmp_path, rows, spec, reward_isolation="main")
        check_reward_fields(task, cfg)
        sample = {k: v for k, v in task.train_samples(0, 1)[0].items() if k != "prompt"}
        assert task.reward("q", "#### 0", **sample) in (0.0, 1.0)
    assert load_reward("exact_match")("q", "#### 1", answer="1", self="x") == 1.0  # a Reward's own self is positional


def test_named_eval_sets_are_checked_when_given(tmp_path):
    from cispo.config.data import EvalSetConfig
    from cispo.data.rewards.loading import check_reward_fields

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    task, cfg = _source(tmp_path, rows, "exact_match", eval_sets={"extra": EvalSetConfig(path="extra.jsonl")})
    check_reward_fields(task, cfg, {"extra": [{"prompt": "q", "answer": "1"}]})
    with pytest.raises(RewardSpecError, match=r"^data file 'extra\.jsonl': evaluation set 'extra' sample 1 has a "
                                              r"column 'self'"):
        check_reward_fields(task, cfg, {"extra": [{"prompt": "q", "answer": "1"}, {"prompt": "q", "self": 1}]})
    with pytest.raises(RewardSpecError, match=r"evaluation set 'extra' sample 0 has no field 'answer'"):
        check_reward_fields(task, cfg, {"extra": [{"prompt": "q"}]})


def test_train_names_a_reserved_column_before_loading_a_model(tmp_path):
    from cispo.config.train import TrainConfig, apply_overrides
    from cispo.training.runner import train

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i), "self": i}) + "\n" for i in range(20)))
    not_loadable = tmp_path / "not_loadable"  # a model folder whose loading would fail
    not_loadable.mkdir()
    (not_loadable / "config.json").write_text("{}")
    cfg = apply_overrides(TrainConfig(), [f"data.path={path}", "data.reward=exact_match", "max_new_tokens=8",
                                          f"model.path={not_loadable}", f"out_dir={tmp_path}",
                                          "model.device=cpu", "progress=false"])
    with pytest.raises(RewardSpecError, match="prompts.jsonl': training sample 0 has a column 'self'"):
        train(cfg)


# --------------------------------------------------------------------------- stated answers


@needs_math_verify
@pytest.mark.parametrize(
    "completion, strict, lenient",
    [
        ("we walk along the road in 20", 0.0, 1.0),  # the hack: a number it happens to end on
        ("x7 qq 3 ,, 20", 0.0, 1.0),  # random text
        ("$20$", 0.0, 1.0),  # a bare expression is not a stated answer
        ("so 4 * 5 = 20", 0.0, 1.0),
        ("4 * 5 = 20.\nAnswer: 20", 1.0, 1.0),  # DAPO-Math's format
        ("Answer: $20$", 1.0, 1.0),
        ("The answer is 20.", 1.0, 1.0),
        ("#### 20", 1.0, 1.0),
        (r"so $\boxed{20}$ in 3", 1.0, 1.0),
        ("Answer: 21, not 20", 0.0, 0.0),
        ("Answer:", 0.0, 0.0),  # a marker with nothing after it
    ],
)
def test_math_reward_scores_only_a_stated_answer(completion, strict, lenient):
    from cispo.data.rewards.math import math_reward, math_reward_lenient

    assert math_reward("p", completion, answer="20") == strict
    assert math_reward("p", completion, answer="20", mode="lenient") == lenient
    assert math_reward_lenient("p", completion, answer="20") == lenient


@needs_math_verify
def test_math_reward_boxed_only_and_custom_pattern():
    from cispo.data.rewards.math import make_math_reward, math_reward_boxed

    assert math_reward_boxed("p", "Answer: 20", answer="20") == 0.0
    assert math_reward_boxed("p", r"\boxed{20}", answer="20") == 1.0
    final = make_math_reward(answer_pattern=r"FINAL\s*=")
    assert final("p", "blah\nfinal = 1/2", answer=r"\frac{1}{2}") == 1.0
    assert final("p", "Answer: 1/2", answer=r"\frac{1}{2}") == 0.0  # only the configured pattern
    with pytest.raises(ValueError, match="mode"):
        make_math_reward("last_number")


@needs_math_verify
def test_math_lenient_is_a_builtin_name():
    assert load_reward("math_lenient")("p", "in 20", answer="20") == 1.0
    assert load_reward("math")("p", "in 20", answer="20") == 0.0


# --------------------------------------------------------------------------- exits and crashes at import

IMPORT_EXITS = {  # file body -> what the error says it did
    "import sys\ndef main():\n    print('usage: score.py FILE')\n    return 0\ndef f(p, c): return "
    "1.0\nsys.exit(main())\n":
        "exited with sys.exit(0); its output (end): 'usage: score.py FILE'",
    "import sys\nsys.exit(3)\n": "exited with sys.exit(3)",
    "import sys\nsys.exit('no config found')\n": "exited with sys.exit('no config found')",
    "import os\nos._exit(0)\n": "ended its process (exit status 0: os._exit, or exit() in C code)",
    "import os\nos._exit(5)\n": "ended its process (exit status 5",
    "raise KeyboardInterrupt\n": "raised KeyboardInterrupt",
    "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n": "was killed by SIGSEGV",
    "raise RuntimeError('boom at import')\n": "failed: RuntimeError: boom at import",
}


def test_any_exit_or_crash_at_import_is_an_error_naming_the_file(tmp_path):
    """Run in a subprocess: before, ``os._exit`` at import ended the process with status 0 and
    ``sys.exit`` / ``KeyboardInterrupt`` escaped ``load_reward``."""
    import os
    import subprocess
    import textwrap

    paths = []
    for i, body in enumerate(IMPORT_EXITS):
        paths.append(tmp_path / f"reward_{i}.py")
        paths[-1].write_text(body)
    code = textwrap.dedent(f"""
        from cispo.data.rewards.loading import RewardSpecError, load_reward
        for path in {[str(p) for p in paths]!r}:
            try:
                load_reward(path + ":f")
                print("loaded")
            except RewardSpecError as e:
                print(str(e).replace("\\n", " "))
        print("still here")
    """)
    repo = str(Path(__file__).resolve().parents[3])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=repo,
                         env={**os.environ, "PYTHONPATH": repo})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "still here" and len(lines) == len(paths) + 1, out.stdout
    for path, line, said in zip(paths, lines, IMPORT_EXITS.values()):
        assert line.startswith(f"reward '{path}:f': importing '{path}' {said}"), line
        assert "if __name__" in line or "boom at import" in line


@pytest.mark.parametrize("body", ["import sys\ndef main():\n    return 0\ndef f(p, c): return 1.0\nsys.exit(main())\n",
                                  "import os\ndef f(p, c): return 1.0\nos._exit(0)\n"])
def test_cispo_train_with_a_reward_that_exits_at_import_exits_2_naming_it(tiny_model, tmp_path, body):
    """Before: exit code 0, no run, no message."""
    import os
    import subprocess

    data, reward = tmp_path / "train.jsonl", tmp_path / "exits.py"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(10)))
    reward.write_text(body)
    out = subprocess.run([sys.executable, "-m", "cispo", "train", f"model.path={tiny_model}", f"data.path={data}",
                          f"data.reward={reward}:f", "max_new_tokens=8", f"out_dir={tmp_path / 'runs'}"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cispo train: error: reward '{reward}:f': importing '{reward}' ")
    assert not (tmp_path / "runs" / "cispo__train__seed0").exists()  # no run folder (only the lock file in out_dir)
