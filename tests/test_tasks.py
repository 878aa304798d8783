"""Tests for cispo.tasks: the built-in addition task, its splits, verifier and corpus."""

import pytest

from cispo.tasks import Task, get_task, list_tasks
from cispo.tasks import arithmetic as ar


@pytest.fixture(scope="module")
def task() -> Task:
    return get_task("addition")


# --------------------------------------------------------------------------- registry


def test_registry(task):
    assert "addition" in list_tasks()
    assert task.name == "addition"
    assert task.fork_token == ar.FORK_TOKEN == "W"
    assert set(task.fork_token) <= set(task.alphabet)
    with pytest.raises(KeyError):
        get_task("nope")


def test_max_new_tokens_covers_the_longest_forked_completion(task):
    longest = ar.forked_completion(9999, 9999, guess="19998")
    assert len(longest) + 1 == task.max_new_tokens == 48   # + EOS
    assert len(ar.forked_completion(1000, 1000)) + 1 <= task.max_new_tokens


# --------------------------------------------------------------------------- splits


def _pairs(samples):
    return {frozenset(ar.parse_prompt(s["prompt"])) for s in samples}


def test_splits_are_seeded_reproducible_and_disjoint(task):
    a = task.train_samples(0, 500)
    assert a == task.train_samples(0, 500)
    assert a != task.train_samples(1, 500)
    ev = task.eval_samples(0, 500)
    assert ev == task.eval_samples(0, 500)
    # disjoint as unordered pairs, across seeds too
    train_pairs = _pairs(a) | _pairs(task.train_samples(1, 500))
    assert not train_pairs & (_pairs(ev) | _pairs(task.eval_samples(7, 500)))
    assert all(ar.is_heldout(*ar.parse_prompt(s["prompt"])) for s in ev)
    assert not any(ar.is_heldout(*ar.parse_prompt(s["prompt"])) for s in a)


def test_samples_are_well_formed_and_answered(task):
    s = task.train_samples(3, 3000)
    counts = {2: 0, 3: 0, 4: 0}
    for x in s:
        a, b = ar.parse_prompt(x["prompt"])
        n = len(str(a))
        assert len(str(b)) == n and n in counts                  # both operands n digits
        counts[n] += 1
        assert x["answer"] == str(a + b)
        assert len(x["prompt"]) == 2 * n + 2
    assert all(800 < c < 1200 for c in counts.values())         # uniform over (2, 3, 4)
    assert len(_pairs(s)) > 2000                                 # mostly distinct
    four = get_task("addition4").train_samples(0, 100)
    assert all(len(x["prompt"]) == 10 for x in four)


def test_heldout_is_symmetric_and_about_ten_percent():
    import random

    rng = random.Random(0)
    pairs = [(rng.randint(1000, 9999), rng.randint(1000, 9999)) for _ in range(20000)]
    assert all(ar.is_heldout(a, b) == ar.is_heldout(b, a) for a, b in pairs[:2000])
    frac = sum(ar.is_heldout(a, b) for a, b in pairs) / len(pairs)
    assert 0.08 < frac < 0.12


# --------------------------------------------------------------------------- formats and verifier


def test_derivation_by_hand():
    # 4821 + 1396: 1+6=7, 2+9=11 (carry), 8+3+1=12 (carry), 4+1+1=6
    assert ar.derivation(4821, 1396) == "1+6+0=07,2+9+0=11,8+3+1=12,4+1+1=06"
    assert ar.forked_completion(4821, 1396, "6207") == (
        "6207W1+6+0=07,2+9+0=11,8+3+1=12,4+1+1=06=6217")
    # a final carry makes a 5-digit answer
    assert ar.derivation(9999, 1) == "9+1+0=10,9+0+1=10,9+0+1=10,9+0+1=10"


P = "4821+1396="


@pytest.mark.parametrize("completion, expected", [
    ("6217", 1.0),                                                   # direct, right
    ("6217<eos>", 1.0),                                              # EOS kept in the text
    ("6217<eos><pad><pad>", 1.0),
    ("6207", 0.0),                                                   # direct, wrong
    ("6207W1+6+0=07,2+9+0=11,8+3+1=12,4+1+1=06=6217", 1.0),          # fork corrects it
    ("6217W1+6+0=07,2+9+0=11,8+3+1=12,4+1+1=06=6217<eos>", 1.0),
    ("6217W1+6+0=07,2+9+0=11,8+3+1=12,4+1+1=06=6207", 0.0),          # fork breaks it
    ("6217W1+6+0=07,2+9+0=11,8+3+1=12,4+1+1=06", 0.0),               # cut after a step
    ("6217W1+6+0=07,2+9", 0.0),                                      # truncated
    ("6217W", 0.0),
    ("", 0.0),
    ("06217", 0.0),                                                  # leading zero
    ("6217 ", 0.0),
    ("62 17", 0.0),
    ("+6217", 0.0),
    ("6217=", 0.0),
    ("6217<eos>W=9999", 1.0),                                        # after EOS is ignored
])
def test_reward(task, completion, expected):
    assert task.reward(P, completion, answer="6217") == expected
    assert task.reward(P, completion) == expected                    # answer from the prompt
    assert task.reward(P, completion, answer="6217", extra="ignored") == expected


def test_extract_answer_and_fork_detection(task):
    assert task.extract_answer("6207W1+6+0=07,2+9+0=11,8+3+1=12,4+1+1=06=6217") == "6217"
    assert task.extract_answer("6217") == "6217"
    assert task.extract_answer("6217W") is None
    assert task.extract_answer("0") == "0"
    assert task.used_fork("6207W1+6")
    assert not task.used_fork("6217")
    assert not task.used_fork("6217<eos>W")


def test_reward_sample_dict_protocol(task):
    for s in task.train_samples(0, 20):
        rest = {k: v for k, v in s.items() if k != "prompt"}
        assert task.reward(s["prompt"], s["answer"], **rest) == 1.0
        assert task.reward(s["prompt"], "1", **rest) == 0.0


def test_parse_prompt_rejects_garbage():
    with pytest.raises(ValueError):
        ar.parse_prompt("12+3")


# --------------------------------------------------------------------------- corpus


def test_corpus_is_seeded_and_verifies(task):
    c = task.corpus(0, 3000, fork_fraction=0.03, derivation_fraction=0.3)
    assert c == task.corpus(0, 3000, fork_fraction=0.03, derivation_fraction=0.3)
    assert c != task.corpus(1, 3000, fork_fraction=0.03, derivation_fraction=0.3)
    n_wrong_guess = 0
    for ex in c:
        assert len(ex.loss_mask) == len(ex.completion) + 1          # + EOS
        assert task.reward(ex.prompt, ex.completion) == 1.0          # the final answer is right
        assert not ar.is_heldout(*ar.parse_prompt(ex.prompt))
        assert ex.forked == task.used_fork(ex.completion)
        if ex.forked:
            guess = ex.completion.split(task.fork_token)[0]
            n_wrong_guess += guess != ex.answer                      # an intended wrong guess,
            assert not any(ex.loss_mask[: len(guess)])               # never trained on
            assert all(ex.loss_mask[len(guess) + 1:])                 # derivation + answer + EOS
        else:
            assert all(ex.loss_mask)
    n_forked = sum(ex.forked for ex in c)
    assert 0.25 < n_forked / len(c) < 0.35
    assert 0.35 < n_wrong_guess / n_forked < 0.65


def test_corpus_fork_decision_frequency(task):
    """The fork token carries loss often enough that its trained frequency is fork_fraction."""
    c = task.corpus(0, 40000, fork_fraction=0.03, derivation_fraction=0.3)
    trained_forks = trained_stops = 0
    for ex in c:
        if ex.forked:
            trained_forks += ex.loss_mask[ex.completion.index(task.fork_token)]
        else:
            trained_stops += 1
    assert abs(trained_forks / (trained_forks + trained_stops) - 0.03) < 0.005


def test_plain_corpus_when_fractions_are_equal(task):
    c = task.corpus(0, 2000, fork_fraction=0.05, derivation_fraction=0.05, wrong_guess_fraction=0.0)
    for ex in c:
        assert all(ex.loss_mask[ex.completion.find(task.fork_token):])  # fork, derivation, answer
    with pytest.raises(ValueError):
        task.corpus(0, 10, fork_fraction=0.3, derivation_fraction=0.1)
