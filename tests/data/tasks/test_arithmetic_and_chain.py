"""Tests for cispo.data.tasks: the built-in addition task, its splits, verifier and corpus."""

import pytest

from cispo.data.tasks import Task, UnknownTaskError, get_task, list_tasks
from cispo.data.tasks import arithmetic as ar
from cispo.data.tasks import chain as ch


@pytest.fixture(scope="module")
def task() -> Task:
    return get_task("addition")


# --------------------------------------------------------------------------- registry


def test_registry(task):
    assert "addition" in list_tasks()
    assert task.name == "addition"
    assert task.fork_tokens == (ar.FORK_TOKEN,) and ar.FORK_TOKEN == "W"
    assert set(ar.FORK_TOKEN) <= set(task.alphabet)
    with pytest.raises(UnknownTaskError, match="addition, addition4, chain"):
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
            guess = ex.completion.split(ar.FORK_TOKEN)[0]
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
            trained_forks += ex.loss_mask[ex.completion.index(ar.FORK_TOKEN)]
        else:
            trained_stops += 1
    assert abs(trained_forks / (trained_forks + trained_stops) - 0.03) < 0.005


def test_plain_corpus_when_fractions_are_equal(task):
    c = task.corpus(0, 2000, fork_fraction=0.05, derivation_fraction=0.05, wrong_guess_fraction=0.0)
    for ex in c:
        assert all(ex.loss_mask[ex.completion.find(ar.FORK_TOKEN):])  # fork, derivation, answer
    with pytest.raises(ValueError):
        task.corpus(0, 10, fork_fraction=0.3, derivation_fraction=0.1)


def test_cli_bad_task_name_is_a_clear_error_listing_the_tasks(capsys):
    from cispo.cli import main

    assert main(["train", "task=additon", "steps=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'additon'" in err and "addition, addition4, chain" in err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- chain


def test_chain_arithmetic_and_the_base_models_bug():
    assert ch.dropped_carry_sum(95, 91) == 86 and ch.dropped_carry_sum(186, 24) == 100
    assert ch.dropped_carry_sum(62, 48) == 0 and ch.dropped_carry_sum(123, 45) == 168
    assert ch.has_carry(95, 5) and ch.has_carry(186, 24) and not ch.has_carry(123, 45)
    assert not ch.has_carry(100, 9) and ch.has_carry(199, 1)


def test_chain_reflection_format():
    numbers = (23, 7, 4, 8, 9)
    assert ch.make_prompt(numbers) == "23+7+4+8+9=" and ch.parse_prompt("23+7+4+8+9=") == numbers
    assert ch.carry_steps(numbers) == [0, 2, 3]                 # 23+7, 34+8, 42+9 carry; 30+4 does not
    base = ch.completion(numbers)
    assert base == "23+7=20;20+4=24;24+8=22;22+9=21"            # the carry dropped, then propagated
    ref = ch.reference(numbers)
    assert ref == ("23+7=20W3+7+0=10,2+0+1=03=30;30+4=34;34+8=32W4+8+0=12,3+0+1=04=42;"
                   "42+9=41W2+9+0=11,4+0+1=05=51")
    steps = ch.parse_steps(ref)
    assert [(s.a, s.b, s.result, s.value) for s in steps] == [(23, 7, 20, 30), (30, 4, 34, 34), (34, 8, 32, 42),
                                                              (42, 9, 41, 51)]
    assert steps[0].derivation == "3+7+0=10,2+0+1=03" and steps[1].derivation is None
    assert len(ch.recheck(23, 7)) == 21 == ch.LENGTH_SLACK - 1    # every recheck derives two columns
    # a recheck after a correct step repeats its value
    assert ch.completion(numbers, recheck_after={1}).startswith("23+7=20;20+4=24W0+4+0=04,2+0+0=02=24;24+8=")
    assert ch.count_reflections(ref) == 3 and ch.used_fork(ref) and not ch.used_fork(base)
    assert ch.count_reflections(ref + "<eos>W") == 3            # nothing after EOS counts
    assert ch.parse_steps("23+7=20;8x") is None and ch.parse_steps(base + "<eos>junk") is not None
    with pytest.raises(ValueError):
        ch.parse_prompt("23+7")


def test_chain_verifier():
    numbers = (23, 7, 4, 8, 9)
    prompt, ref = ch.make_prompt(numbers), ch.reference(numbers)
    assert ch.reward(prompt, ref) == 1.0 and ch.reward(prompt, ref + "<eos>", answer="51") == 1.0
    assert ch.reward(prompt, ch.completion(numbers)) == 0.0    # the propagated error
    assert ch.reward(prompt, ch.completion(numbers, recheck_after={0, 2})) == 0.0   # one carrying step unchecked
    assert ch.extract_answer(ref) == "51" and ch.extract_answer(ref[:-1]) == "5"
    assert ch.reward(prompt, ref[:-1]) == 0.0                   # cut off
    assert ch.reward(prompt, ref[: ref.index("=05") + 3]) == 0.0  # stopped inside a derivation
    assert ch.extract_answer("23+7=20W3+7+0=10,2+0+1=03") is None   # leading zero
    # length budget: the reference plus one more recheck fits, a recheck after every step does not
    one_more = ch.completion(numbers, recheck_after={0, 1, 2, 3})
    assert ch.completion(numbers, recheck_after=range(4)) == one_more   # here that is every step
    n6 = (11, 9, 4, 8, 9, 3, 9)                                 # 6 steps, 4 carry
    assert ch.carry_steps(n6) == [0, 2, 3, 5]
    one_more, everywhere = ch.completion(n6, recheck_after={0, 1, 2, 3, 5}), ch.completion(n6, recheck_after=range(6))
    assert len(ch.reference(n6)) < len(one_more) <= ch.length_budget(n6) < len(everywhere)
    p6 = ch.make_prompt(n6)
    assert ch.reward(p6, one_more) == 1.0 and ch.reward(p6, everywhere) == 0.0
    assert ch.extract_answer(everywhere) == str(sum(n6))        # right answer, over budget
    # a stricter budget (slack 0): only the shortest correct completion earns the reward
    assert ch.reward(p6, ch.reference(n6), slack=0) == 1.0 and ch.reward(p6, one_more, slack=0) == 0.0


def test_chain_task_samples_and_splits():
    task = get_task("chain")
    assert task.fork_tokens == ("W",) and set(task.alphabet) >= set("0123456789+=,;W")
    train, ev = task.train_samples(0, 600), task.eval_samples(0, 300)
    assert train == task.train_samples(0, 600) and train != task.train_samples(1, 600)
    assert not {s["prompt"] for s in train} & {s["prompt"] for s in ev}
    n_steps, n_carry = [], []
    for s in train + ev:
        numbers = ch.parse_prompt(s["prompt"])
        assert s["answer"] == str(sum(numbers)) and len(numbers) - 1 in ch.STEPS
        assert 10 <= numbers[0] and all(1 <= b <= 9 for b in numbers[1:]) and sum(numbers) <= ch.MAX_SUM
        assert ch.is_heldout(numbers) == (s in ev)
        ref = ch.reference(numbers)
        assert task.reward(s["prompt"], ref, answer=s["answer"]) == 1.0
        assert len(ref) + 1 <= ch.length_budget(numbers) + 1 <= task.max_new_tokens
        assert len(task.alphabet) and set(s["prompt"] + ref) <= set(task.alphabet)
        n_steps.append(len(numbers) - 1)
        n_carry.append(len(ch.carry_steps(numbers)))
        assert n_carry[-1] < n_steps[-1]                          # never a recheck after every step
    mean_carry = sum(n_carry) / len(n_carry)
    assert 3.05 < mean_carry < 3.45, mean_carry                  # the optimal policy rechecks > 3 times
    assert sum(1 for k in n_carry if k == 1) >= 10               # some prompts need one recheck only
    assert sum(n_steps) / len(n_steps) >= 4.5


def test_chain_corpus_masks_and_reflection_rate():
    task = get_task("chain")
    c = task.corpus(0, 6000, fork_fraction=0.04, derivation_fraction=0.3, wrong_guess_fraction=1.0)
    w_kept = decisions = 0
    for ex in c:
        assert len(ex.loss_mask) == len(ex.completion) + 1 and ex.loss_mask[-1] == 1
        assert ex.forked == ("W" in ex.completion)
        steps = ch.parse_steps(ex.completion)
        assert steps is not None and ch.extract_answer(ex.completion) == str(steps[-1].value)
        for s in steps:
            assert s.result == (ch.dropped_carry_sum(s.a, s.b))     # the base model's bug, always
            assert s.corrected in (None, s.a + s.b)
        pos = 0
        for _i, part in enumerate(ex.completion.split(";")):
            step_end = pos + len(part.split("W")[0])                  # the decision after the result
            decisions += 1
            if "W" in part:
                w_kept += ex.loss_mask[step_end]
                assert all(ex.loss_mask[step_end + 1: pos + len(part)])  # derivation + correction
            else:
                assert ex.loss_mask[step_end] == 1                    # ";" or EOS: always trained
            pos += len(part) + 1
    # trained frequency of W at "recheck or go on": W kept / (W kept + go-on decisions)
    n_w = sum(ex.completion.count("W") for ex in c)
    rate = w_kept / (w_kept + decisions - n_w)
    assert abs(rate - 0.04) < 0.008, rate


# --------------------------------------------------------------------------- shipped base models


@pytest.mark.parametrize("name,prompt,params", [("addition", "12+34=", 335_712), ("chain", "12+34+5=", 335_904),
                                               ("chain_hidden", "12+34+5=", 335_904)])
def test_shipped_weights_load_and_match_their_checksums(name, prompt, params, tmp_path, monkeypatch):
    from cispo.models.builtin import SHIPPED_ROOT, ensure_builtin_model
    from cispo.models.cache import read_checksums, verify_checksums
    from cispo.models.loading import load_policy

    monkeypatch.setenv("CISPO_CACHE", str(tmp_path))           # an empty cache: nothing to fall back on
    folder = SHIPPED_ROOT / name
    recorded = read_checksums(folder)
    assert {"model.safetensors", "config.json", "tokenizer.json", "pretrain_config.json"} <= set(recorded)
    verify_checksums(folder)
    assert ensure_builtin_model(name) == folder                # the default config: no pretraining
    assert not (tmp_path / "models").exists()
    model, tok = load_policy(folder)
    assert tok.decode(tok(prompt)["input_ids"]) == prompt
    assert sum(p.numel() for p in model.parameters()) == params
    assert set(get_task(name).alphabet) <= set(tok.get_vocab())


def test_a_changed_shipped_file_fails_its_checksum(tmp_path):
    import shutil

    from cispo.models.builtin import SHIPPED_ROOT
    from cispo.models.cache import ChecksumError, verify_checksums

    copy = tmp_path / "addition"
    shutil.copytree(SHIPPED_ROOT / "addition", copy)
    verify_checksums(copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="model.safetensors"):
        verify_checksums(copy)
    (copy / "model.safetensors").unlink()
    with pytest.raises(ChecksumError, match="missing"):
        verify_checksums(copy)


def test_other_pretraining_configs_do_not_use_the_shipped_weights():
    from cispo.models.builtin import shipped_model_path
    from cispo.models.pretrain import PretrainConfig

    assert shipped_model_path("addition", PretrainConfig()) is not None
    assert shipped_model_path("addition", PretrainConfig(steps=1000)) is not None   # the same, resolved
    assert shipped_model_path("addition", PretrainConfig(seed=1)) is None
    assert shipped_model_path("addition", PretrainConfig(fork_fraction=0.05)) is None
    assert shipped_model_path("addition4", PretrainConfig(task="addition4")) is None


def test_a_chain_run_logs_reflective_tokens_per_response(tmp_path, one_thread):
    """`cispo train task=chain` runs, and each step logs the mean number of W per response."""
    import json

    from cispo.models.loading import build_model, build_tokenizer, save_policy
    from cispo.training.runner import train
    from tests.conftest import small_config

    tok = build_tokenizer(ch.ALPHABET, 384)
    save_policy(build_model(tok, size="tiny", seed=0, max_positions=384), tok, tmp_path / "m")
    cfg = small_config(tmp_path / "m", tmp_path / "runs", "task=chain", "max_new_tokens=40", "steps=2",
                       "eval.every=0", "dynamic_sampling=false")
    result = train(cfg)
    rows = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/fork_tokens_per_response" in r]
    assert len(steps) == 2
    for r in steps:   # an untrained model emits W at random, sometimes several per response
        assert r["rollout/fork_tokens_per_response"] >= r["rollout/fork_rate"] >= 0.0


def test_forced_recheck_policies_decide_only_right_after_a_direct_result():
    from cispo.models.pretrain import chain_recheck_policy

    numbers = (32, 7, 8, 2)
    carry = chain_recheck_policy(lambda i: numbers, "carry")
    never = chain_recheck_policy(lambda i: numbers, "never")
    always = chain_recheck_policy(lambda i: numbers, "always")
    assert carry(0, "32+7=39", ";") == ";" and carry(0, "32+7=39", "W") == ";"     # no carry: go on
    assert carry(0, "32+7=39;39+8=37", ";") == "W"                                # carry: recheck
    assert carry(0, "32+7=39;39+8=37", "<eos>") == "W"
    assert carry(0, "32+7=39;39+8=47;47+2=49", "W") == "<eos>"                    # last step: stop
    assert never(0, "32+7=39;39+8=37", "W") == ";" and always(0, "32+7=39", ";") == "W"
    inside = "32+7=39;39+8=37W9+8+0=17,3+0+1=04=47"                              # after a recheck
    for policy in (carry, never, always):
        assert policy(0, inside, ";") == ";" and policy(0, "32+", "W") == "W" and policy(0, "32+7=3", "9") == "9"


def test_pretrain_rebuilds_even_when_a_copy_exists(tmp_path, monkeypatch, one_thread):
    import cispo.models.pretrain
    from cispo.models.builtin import builtin_model_path, ensure_builtin_model, rebuild_builtin_model
    from cispo.models.pretrain import PretrainConfig

    monkeypatch.setenv("CISPO_CACHE", str(tmp_path))
    cfg = PretrainConfig(model_size="tiny", steps=2, batch_size=8, corpus_size=50, warmup_steps=1)
    calls, real = [], cispo.models.pretrain.pretrain
    monkeypatch.setattr(cispo.models.pretrain, "pretrain", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = ensure_builtin_model("addition", cfg=cfg, progress=False)
    assert ensure_builtin_model("addition", cfg=cfg, progress=False) == path and len(calls) == 1
    assert rebuild_builtin_model(cfg, progress=False) == path == builtin_model_path("addition", cfg=cfg)
    assert len(calls) == 2 and [p.name for p in path.parent.iterdir()] == [path.name]


# --------------------------------------------------------------------------- chain_sparse


def test_chain_prompts_are_unchanged_by_the_sparse_variant():
    """The carry bounds left chain's own prompt streams as they were (its study data depend on them)."""
    from cispo.data.tasks import get_task

    assert get_task("chain").train_samples(0, 3) == [{"prompt": "75+3+2+1+5+6=", "answer": "92"},
                                                     {"prompt": "14+6+2+4+6+1=", "answer": "33"},
                                                     {"prompt": "55+1+6+9+9=", "answer": "80"}]


def test_chain_sparse_carries_rarely_but_at_least_once_and_splits_disjointly():
    from cispo.data.tasks import chain, get_task

    task = get_task("chain_sparse")
    samples = task.train_samples(0, 2000)
    carries = [len(chain.carry_steps(chain.parse_prompt(s["prompt"]))) for s in samples]
    steps = [len(chain.parse_prompt(s["prompt"])) - 1 for s in samples]
    assert all(1 <= c < n for c, n in zip(carries, steps))
    assert 0.2 < sum(carries) / sum(steps) < 0.33  # ~27% of steps carry (chain: ~65%)
    assert all(s["answer"] == str(sum(chain.parse_prompt(s["prompt"]))) for s in samples)
    held_out = {s["prompt"] for s in task.eval_samples(0, 300)}
    assert not held_out & {s["prompt"] for s in task.train_samples(0, 5000)}
    assert task.reward is chain.reward and task.base_task == "chain"


def test_chain_sparse_starts_from_chains_shipped_base_model():
    from cispo.models.builtin import SHIPPED_ROOT, ensure_builtin_model

    assert ensure_builtin_model("chain_sparse", progress=False) == SHIPPED_ROOT / "chain"


# --------------------------------------------------------------------------- chain_hidden


def test_hidden_bug_set_is_24_of_the_72_carry_pairs_3_per_tens_digit():
    bugs = ch.HIDDEN_BUGS
    assert len(bugs) == 24 and bugs <= {(t, b) for t in range(1, 9) for b in range(1, 10)}
    assert all(sum(1 for t, _ in bugs if t == tens) == 3 for tens in range(1, 9))
    assert ch.TASK_BUGS["chain_hidden"] is bugs is ch.TASK_BUGS["chain_hidden_strict"]
    # a step is buggy when it carries and its (tens digit, addend) pair is in the set
    assert (1, 2) in bugs and ch.is_buggy(18, 2, bugs) and not ch.is_buggy(11, 2, bugs)   # 11+2 does not carry
    assert (2, 7) not in bugs and ch.has_carry(23, 7) and not ch.is_buggy(23, 7, bugs)     # carries, not buggy
    assert ch.is_buggy(23, 7) and not ch.is_buggy(30, 4)                                   # chain: every carry


def test_chain_hidden_reference_rechecks_only_the_buggy_steps():
    bugs, numbers = ch.HIDDEN_BUGS, (18, 2, 9, 7, 6)     # 18+2 (1,2) and 36+6 (3,6) buggy; 29+7 (2,7) carries, right
    assert ch.carry_steps(numbers) == [0, 2, 3] and ch.buggy_steps(numbers, bugs) == [0, 3]
    assert ch.buggy_steps(numbers) == ch.carry_steps(numbers)                             # chain's own bug
    # the base model: only buggy steps dropped, the error propagated (10+9=19, then 19+7: (1,7) buggy)
    assert ch.completion(numbers, bugs=bugs) == "18+2=10;10+9=19;19+7=16;16+6=22"
    ref = ch.reference(numbers, bugs)
    assert ref == "18+2=10W8+2+0=10,1+0+1=02=20;20+9=29;29+7=36;36+6=32W6+6+0=12,3+0+1=04=42"
    assert ch.length_budget(numbers, bugs=bugs) == len(ref) + ch.LENGTH_SLACK
    prompt = ch.make_prompt(numbers)
    hidden, strict = get_task("chain_hidden").reward, get_task("chain_hidden_strict").reward
    extra = ch.completion(numbers, recheck_after={0, 2, 3}, bugs=bugs)                  # one unneeded recheck
    assert hidden(prompt, ref) == strict(prompt, ref) == 1.0
    assert hidden(prompt, extra) == 1.0 and strict(prompt, extra) == 0.0                   # strict: no slack
    assert hidden(prompt, ch.completion(numbers, bugs=bugs)) == 0.0                         # the bug unchecked
    # a direct fix (no recheck, every sum right) is shorter than the reference, so it earns the reward:
    # the base model must never write it (test_chain_hidden_base_model_errs_on_exactly_the_bug_pairs)
    assert strict(prompt, ch.completion(numbers, base_bug=False)) == 1.0


def test_chain_hidden_tasks_prompts_bug_counts_splits_and_corpus():
    hidden, strict = get_task("chain_hidden"), get_task("chain_hidden_strict")
    assert hidden.base_task is None and strict.base_task == "chain_hidden"
    assert hidden.pretrain_defaults == get_task("chain").pretrain_defaults
    for task, lo, hi in ((hidden, 1, 6), (strict, 0, 1)):
        train, ev = task.train_samples(0, 1500), task.eval_samples(0, 300)
        assert train == task.train_samples(0, 1500) and not {s["prompt"] for s in train} & {s["prompt"] for s in ev}
        counts = [len(ch.buggy_steps(ch.parse_prompt(s["prompt"]), ch.HIDDEN_BUGS)) for s in train + ev]
        assert all(lo <= k <= hi for k in counts)
        assert all(ch.is_heldout(ch.parse_prompt(s["prompt"])) for s in ev)
        for s in ev[:50]:
            numbers = ch.parse_prompt(s["prompt"])
            assert task.reward(s["prompt"], ch.reference(numbers, ch.HIDDEN_BUGS), answer=s["answer"]) == 1.0
    assert 0.40 < sum(k == 0 for k in counts) / len(counts) < 0.52   # strict: ~46% of prompts need no recheck
    chains = ch.sample_chains(0, 3000, "train")                       # chain's own stream
    share = sum(len(ch.buggy_steps(n, ch.HIDDEN_BUGS)) for n in chains) / sum(len(ch.carry_steps(n)) for n in chains)
    assert 0.24 < share < 0.30                                        # 27% of the carrying steps are buggy
    for ex in hidden.corpus(0, 500, fork_fraction=0.04, derivation_fraction=0.5, wrong_guess_fraction=1.0):
        for s in ch.parse_steps(ex.completion):
            wrong = ch.dropped_carry_sum(s.a, s.b) if ch.is_buggy(s.a, s.b, ch.HIDDEN_BUGS) else s.a + s.b
            assert s.result == wrong and s.corrected in (None, s.a + s.b)


def test_chain_corpus_pair_weights_balance_the_carry_table_and_weigh_the_bugs():
    bugs = ch.HIDDEN_BUGS
    plain = ch.corpus(0, 3000, bugs=bugs)
    weighted = ch.corpus(0, 3000, bugs=bugs, pair_weight_cap=32.0, bug_weight=16.0)
    assert [e.completion for e in plain] == [e.completion for e in weighted]   # same text, other weights
    assert all(set(e.loss_mask) <= {0, 1} for e in plain)
    by_pair: dict = {}
    for ex, ref in zip(weighted, plain):
        pos = 0
        for part in ex.completion.split(";"):
            s = ch.parse_steps(part)[0]
            start = pos + part.index("=") + 1                       # the direct result's two digits
            w = ex.loss_mask[start: start + 2]
            if ch.has_carry(s.a, s.b):
                assert w[0] == w[1] >= (16.0 if ch.is_buggy(s.a, s.b, bugs) else 1.0)
                by_pair.setdefault((s.a // 10, s.b), set()).add(w[0])
            else:
                assert w == (1, 1)
            pos += len(part) + 1
        changed = [i for i, (a, b) in enumerate(zip(ex.loss_mask, ref.loss_mask)) if a != b]
        assert all(ref.loss_mask[i] == 1 for i in changed)           # only loss tokens are re-weighted
    assert all(len(ws) == 1 for ws in by_pair.values())             # one weight per pair
    w = {p: ws.pop() for p, ws in by_pair.items()}
    assert max(w.values()) <= 32.0 * 16.0 and w[(8, 2)] > w[(5, 8)] > w[(5, 9)]   # rare buggy > common buggy > plain
    assert w[(8, 1)] > 1.0 and (8, 1) not in bugs                   # a rare pair that adds right is balanced too


def test_pretraining_loss_weights_align_with_the_labels():
    from cispo.models.loading import build_tokenizer
    from cispo.models.pretrain import PretrainConfig, build_dataset

    task = get_task("chain_hidden_sharp")
    assert task.base_task is None and task.reward.keywords == {"slack": 0, "bugs": ch.HIDDEN_BUGS}
    tok = build_tokenizer(task.alphabet, task.max_positions)
    ids, labels, weights = build_dataset(PretrainConfig(task="chain_hidden_sharp", corpus_size=300).resolved(),
                                         tok)["all"]
    assert weights.shape == labels.shape and ((weights > 0) == (labels != -100)).all() and weights.max() > 16
    assert build_dataset(PretrainConfig(task="chain_hidden", corpus_size=50).resolved(), tok)["all"][2] is None
