"""Tests for `chain_hidden_graded`: the graded cost per unneeded recheck,
the cost that balances a context-blind recheck (checked against the measured base model in
studies/tests/test_chain_probe.py), and the task's reuse of chain_hidden_sharp's base model."""

import itertools

import pytest

from cispo.data.tasks import chain as ch
from cispo.data.tasks import get_task

BUGS = ch.HIDDEN_BUGS
ONE_BUG = (18, 2, 4, 3)        # 18+2 buggy ((1, 2) in the set); 20+4, 24+3 carry nowhere
NO_BUG = (12, 3, 4)


def graded(numbers, completion, cost=ch.GRADED_COST):
    return ch.graded_reward(ch.make_prompt(numbers), completion, cost=cost, bugs=BUGS)


def test_the_fixture_chains_have_the_bugs_the_tests_assume():
    assert ch.buggy_steps(ONE_BUG, BUGS) == [0] and ch.buggy_steps(NO_BUG, BUGS) == []
    assert ch.reference(ONE_BUG, BUGS) == "18+2=10W8+2+0=10,1+0+1=02=20;20+4=24;24+3=27"
    assert all(len(ch.recheck(a, b)) == ch.RECHECK_CHARS for a in range(10, 90) for b in range(1, 10))


def test_needed_recheck_is_free_and_each_unneeded_one_costs_a_fraction_of_the_reward():
    c = ch.GRADED_COST
    ref = ch.reference(ONE_BUG, BUGS)
    assert ch.unneeded_rechecks(ref) == 0 and graded(ONE_BUG, ref) == 1.0
    one = ch.completion(ONE_BUG, recheck_after={0, 1}, bugs=BUGS)         # + an unneeded recheck of 20+4
    two = ch.completion(ONE_BUG, recheck_after={0, 1, 2}, bugs=BUGS)
    assert ch.unneeded_rechecks(one) == 1 and graded(ONE_BUG, one) == pytest.approx(1 - c) == pytest.approx(0.775)
    assert ch.unneeded_rechecks(two) == 2 and graded(ONE_BUG, two) == pytest.approx(1 - 2 * c) == pytest.approx(0.55)
    assert graded(ONE_BUG, ch.completion(ONE_BUG, bugs=BUGS)) == 0.0      # the bug left unchecked
    assert graded(ONE_BUG, ch.completion(ONE_BUG, recheck_after={1, 2}, bugs=BUGS)) == 0.0   # rechecks elsewhere
    # no buggy step: every recheck is unneeded
    plain = ch.completion(NO_BUG, bugs=BUGS)
    assert plain == "12+3=15;15+4=19" and graded(NO_BUG, plain) == 1.0
    assert graded(NO_BUG, ch.completion(NO_BUG, recheck_after={0}, bugs=BUGS)) == pytest.approx(0.775)


def test_a_direct_fix_needs_no_recheck_and_rechecking_it_is_unneeded():
    fixed = ch.completion(ONE_BUG, base_bug=False)                      # 18+2=20 written right at once
    assert graded(ONE_BUG, fixed) == 1.0
    fixed_checked = ch.completion(ONE_BUG, recheck_after={0}, base_bug=False)
    assert ch.unneeded_rechecks(fixed_checked) == 1 and graded(ONE_BUG, fixed_checked) == pytest.approx(0.775)


def test_only_unneeded_rechecks_may_lengthen_the_completion():
    ref = ch.reference(ONE_BUG, BUGS)
    assert graded(ONE_BUG, ref + ";27+0=27") == 0.0                    # an extra step: over the budget
    one = ch.completion(ONE_BUG, recheck_after={0, 1}, bugs=BUGS)
    assert graded(ONE_BUG, one + ";27+0=27") == 0.0
    assert graded(ONE_BUG, ref[:-1] + "8") == 0.0                      # a wrong answer


def test_reward_bounds_and_equality_with_the_strict_reward_without_unneeded_rechecks():
    strict = get_task("chain_hidden_strict").reward
    seen = set()
    for numbers in ch.sample_chains(0, 200, "train", bugs=BUGS, bug_range=(0, 1)):
        n = len(numbers) - 1
        for k in range(n + 1):
            for subset in itertools.combinations(range(n), k):
                for base_bug in (True, False):
                    text = ch.completion(numbers, recheck_after=set(subset), base_bug=base_bug, bugs=BUGS)
                    for cost in (ch.GRADED_COST, 0.5):
                        r = graded(numbers, text, cost)
                        u = ch.unneeded_rechecks(text)
                        assert 0.0 <= r <= 1.0
                        assert r in (0.0, pytest.approx(max(0.0, 1 - cost * u)))
                        seen.add((cost, u, r > 0))
                    if ch.unneeded_rechecks(text) == 0:
                        assert graded(numbers, text) == strict(ch.make_prompt(numbers), text)
    assert (0.5, 3, False) in seen and (0.5, 2, False) in seen        # 1 - 0.5 * u clamped at 0
    assert (ch.GRADED_COST, 4, True) in seen                           # 1 - 4 * 0.225 = 0.1


def _expected_reward_change(numbers, w, cost):
    """E[R | W after step i] - E[R | no W after step i] over the steps i of `numbers`, the
    other steps rechecked independently with probability `w` and buggy steps written as the base
    model writes them: enumerated exactly with the real `graded_reward` at `cost`, summed over i."""
    n, total = len(numbers) - 1, 0.0
    for i in range(n):
        others = [j for j in range(n) if j != i]
        for k in range(len(others) + 1):
            for subset in itertools.combinations(others, k):
                p = w ** k * (1 - w) ** (len(others) - k)
                with_w = graded(numbers, ch.completion(numbers, recheck_after={i, *subset}, bugs=BUGS), cost)
                without = graded(numbers, ch.completion(numbers, recheck_after=set(subset), bugs=BUGS), cost)
                total += p * (with_w - without)
    return total


def test_the_balanced_cost_makes_a_random_recheck_worth_nothing_on_average():
    chains = ch.sample_chains(0, 100, "train", bugs=BUGS, bug_range=(0, 1))
    w = 0.0364
    c = ch.balanced_recheck_cost(chains, w, BUGS)
    # the closed form by hand on two chains: P(k=1) = 1/2, E[(1-k) n] = 2/2, E[k (n-1)] = 2/2
    assert ch.balanced_recheck_cost([ONE_BUG, NO_BUG], w, BUGS) == pytest.approx(0.5 / (1.0 + 2 * w * 1.0))
    steps = sum(len(ns) - 1 for ns in chains)

    def mean_change(cost):
        return sum(_expected_reward_change(ns, w, cost) for ns in chains) / steps

    assert abs(mean_change(c)) < 1e-4                                   # the closed form, by enumeration
    assert mean_change(c - 0.05) > 0.005 and mean_change(c + 0.05) < -0.005
    with pytest.raises(ValueError, match="0 or 1 buggy step"):
        ch.balanced_recheck_cost([(18, 2, 9, 7, 6)], w, BUGS)           # two buggy steps


def test_graded_task_is_chain_hidden_sharp_with_another_reward_and_the_same_base_model():
    from cispo.models.builtin import SHIPPED_ROOT, ensure_builtin_model

    graded_task, sharp = get_task("chain_hidden_graded"), get_task("chain_hidden_sharp")
    assert graded_task.train_samples(0, 500) == sharp.train_samples(0, 500)       # the same prompt stream
    assert graded_task.eval_samples(0, 100) == sharp.eval_samples(0, 100)
    assert graded_task.base_task == "chain_hidden_sharp" and ch.TASK_BUGS["chain_hidden_graded"] is BUGS
    assert graded_task.reward.func is ch.graded_reward
    assert graded_task.reward.keywords == {"cost": ch.GRADED_COST, "bugs": BUGS}
    assert ensure_builtin_model("chain_hidden_graded", progress=False) == SHIPPED_ROOT / "chain_hidden_sharp"
    s = graded_task.eval_samples(0, 1)[0]
    numbers = ch.parse_prompt(s["prompt"])
    assert graded_task.reward(s["prompt"], ch.reference(numbers, BUGS), answer=s["answer"]) == 1.0
