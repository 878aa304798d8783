"""Rule-based rewards (exact match, math-verify) and load_reward."""

from __future__ import annotations

import sys
import threading

import pytest

from cispo.rewards.exact import exact_match, extract_boxed, extract_final_answer, gold_answer
from cispo.rewards.loading import BUILTIN_REWARDS, RewardSpecError, load_reward

try:
    import math_verify  # noqa: F401

    HAVE_MATH_VERIFY = True
except ImportError:
    HAVE_MATH_VERIFY = False

needs_math_verify = pytest.mark.skipif(not HAVE_MATH_VERIFY, reason='math-verify not installed (pip install "cispo[math]")')


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
    from cispo.rewards.math import math_reward

    assert math_reward("prompt", completion, answer=answer, data_source="x") == reward


@needs_math_verify
@pytest.mark.parametrize("completion", ["", "   ", "}{{ \\frac{ \\boxed{", "\\boxed{", "$$$$", "\x00\x01", "∑∫√"])
def test_math_reward_garbage_is_zero(completion):
    from cispo.rewards.math import math_reward

    assert math_reward("p", completion, answer=r"\frac{1}{2}") == 0.0
    assert math_reward("p", r"\boxed{1}", answer="}{garbage\\") == 0.0  # a garbage gold never raises


@needs_math_verify
def test_math_reward_never_raises(monkeypatch):
    import cispo.rewards.math as m

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
    from cispo.rewards.math import math_reward

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
    import cispo.rewards.math as m

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
    assert set(BUILTIN_REWARDS) == {"math", "exact_match", "code"}
    if HAVE_MATH_VERIFY:
        from cispo.rewards.math import math_reward

        assert load_reward("math").fn is math_reward
    assert load_reward("cispo.rewards.exact:exact_match").fn is exact_match
    # the path rule: built-in names run in the main thread, everything else in worker processes
    assert not load_reward("exact_match").isolated
    assert load_reward("cispo.rewards.exact:exact_match").isolated
    assert load_reward("exact_match", isolation="process").isolated
    assert not load_reward("cispo.rewards.exact:exact_match", isolation="main").isolated
    with pytest.raises(RewardSpecError, match="data.reward_isolation must be one of auto, process, main"):
        load_reward("exact_match", isolation="thread")
    with pytest.raises(RewardSpecError, match="data.reward_workers must be a positive int"):
        load_reward("exact_match", workers=0)


def test_load_builtin_code_is_lazy(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("cispo.rewards.code") is None:
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
        ("maths", r"unknown reward 'maths' \(did you mean 'math'\?\); built-in rewards: code, exact_match, math"),
        ("exact", r"unknown reward 'exact'"),
        ("", r"non-empty string"),
    ],
)
def test_load_reward_unknown(spec, message):
    with pytest.raises(RewardSpecError, match=message):
        load_reward(spec)
