"""Guess the number (cispo.envs.guess, cispo.data.tasks.guess_number): the verifier against hedged, echoing,
verbose and multiple-guess lines; scripted episodes through `EnvEpisodes` on SmolLM2's tokenizer (per-turn
rewards recorded exactly, the observation a function of the guess, the episode ended at the right guess or the
turn cap); the reward read back from the policy's lines agrees with the environment; the warm start's
demonstrations; and a short run with per-turn credit that writes the turn rewards."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cispo.config.train import TrainConfig, apply_overrides
from cispo.data.tasks import get_task, guess_number
from cispo.data.tasks.guess_number import read_guess, reward
from cispo.envs.episodes import ClassEnvironments
from cispo.envs.factory import run_environments
from cispo.envs.guess import TURN_COST, GuessEnv

TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "cispo" / "data" / "tasks" / "base_models" / "smollm2-tokenizer"


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("line, number", [
    ("Guess: 8", 8), ("guess:12", 12), ("  Guess : 3. ", 3), ("GUESS: 15", 15),
    ("Guess: 8 or 9", None),            # hedged
    ("higher", None), ("lower", None),  # an echo of the environment's answer
    ("I think it is 8. Guess: 8", None), ("Guess: 8, because it halves", None), ("My guess is 8", None),  # verbose
    ("Guess: 8 Guess: 9", None), ("Guess: 8, 9", None), ("Guess: 8/9", None),  # several guesses in one line
    ("Guess: eight", None), ("Guess: <number>", None), ("Guess: -3", None), ("", None),
])
def test_a_guess_line_is_exactly_one_number(line, number):
    assert read_guess(line) == number


@pytest.mark.parametrize("text, paid", [
    ("Guess: 8\nGuess: 12\n", 1.0),
    ("Guess: 8\nGuess: 12", 0.0),                  # the line with the secret never finished: no guess
    ("Guess: 11 or 12\n", 0.0),                    # a hedge pays nothing, even one that covers the secret
    ("higher\ncorrect\n", 0.0),                    # echoing the environment's words states no guess
    ("The number is 12.\n", 0.0),                  # verbose
    ("Guess: 12 Guess: 13\n", 0.0),                # two guesses on one line
    ("Guess: 8\n\n  Guess: 12\n", 1.0),            # a blank line (a token "\n\n") reads no guess, and stops nothing
])
def test_the_reward_reads_the_policys_finished_lines(text, paid):
    assert reward("p", text, secret=12) == paid


def play(env, tok, secret: int, lines: list[str], by_stop_token: list[bool] | None = None):
    """Drive one episode as the sampler does: each line a segment, its observation (ids or None) collected until
    the episode ends; returns (observations as text, the record)."""
    episodes = env.start([{"prompt": "p", "secret": secret}])
    seen = []
    for i, line in enumerate(lines):
        segment = ids(tok, line)
        if line.endswith("\n"):
            assert episodes.pauses(0, segment)  # the newline is the segment's stop string
        observation = episodes.respond([0], [segment], [bool(by_stop_token and by_stop_token[i])])[0]
        seen.append(None if observation is None else tok.decode(observation))
        if observation is None:
            break
    return seen, episodes.record(0)


def test_a_three_turn_game_records_each_turns_reward(smol):
    env = ClassEnvironments(GuessEnv, smol, max_turns=3)
    seen, record = play(env, smol, 10, ["Guess: 8\n", "Guess: 12\n", "Guess: 10\n"])
    assert seen == ["higher\n", "lower\n", None]  # the right guess ends the episode
    assert record["turn_rewards"] == [TURN_COST, TURN_COST, 0.0]
    assert [s["role"] for s in record["segments"]] == ["policy", "tool", "policy", "tool", "policy"]
    assert record["guesses"] == [8, 12, 10] and record["found"] is True and record["secret"] == 10
    assert [i["answer"] for i in record["turn_info"]] == ["higher", "lower", "correct"]
    own = "".join(s["text"] for s in record["segments"] if s["role"] == "policy")
    assert reward("p", own, secret=10) == 1.0


def test_the_observation_depends_on_the_guess(smol):
    env = ClassEnvironments(GuessEnv, smol, max_turns=3)
    assert play(env, smol, 10, ["Guess: 3\n"])[0] == ["higher\n", ]
    assert play(env, smol, 10, ["Guess: 13\n"])[0] == ["lower\n"]
    assert play(env, smol, 3, ["Guess: 13\n", "Guess: 2\n"])[0] == ["lower\n", "higher\n"]


def test_unreadable_lines_cost_a_turn_and_a_turn_end_ends_the_game(smol):
    env = ClassEnvironments(GuessEnv, smol, max_turns=3)
    seen, record = play(env, smol, 5, ["Guess: 4 or 5\n", "Guess: 5"], by_stop_token=[False, True])
    assert seen == [guess_number.UNREADABLE + "\n", None]  # the second line was ended by EOS: no guess
    assert record["turn_rewards"] == [TURN_COST, TURN_COST] and record["found"] is False


def test_the_turn_cap_ends_the_game_after_max_turns_plus_one_guesses(smol):
    env = ClassEnvironments(GuessEnv, smol, max_turns=3)
    seen, record = play(env, smol, 15, ["Guess: 1\n", "Guess: 2\n", "Guess: 3\n", "Guess: 4\n", "Guess: 15\n"])
    assert seen == ["higher\n"] * 3 + [None]
    assert record["turn_rewards"] == [TURN_COST] * 4 and record["guesses"] == [1, 2, 3, 4]


def test_the_reward_read_back_agrees_with_the_environment(smol):
    """Random games of readable, hedged, echoed and unfinished lines: the task's reward on the policy's own text
    is 1 exactly where the environment said correct."""
    pool = ["Guess: {n}\n", "Guess: {n}", "Guess: {n} or {m}\n", "higher\n", "guess:{n}.\n", "I say {n}\n",
            "Guess: {n}\n\n"]
    rng = random.Random(0)
    env = ClassEnvironments(GuessEnv, smol, max_turns=3)
    for _ in range(200):
        secret = rng.randint(1, 15)
        lines = [rng.choice(pool).format(n=rng.randint(1, 15), m=rng.randint(1, 15)) for _ in range(6)]
        stops = [not line.endswith("\n") for line in lines]
        _, record = play(env, smol, secret, lines, stops)
        own = "".join(s["text"] for s in record["segments"] if s["role"] == "policy")
        assert reward("p", own, secret=secret) == float(record["found"]), (secret, lines)


def test_demonstrations_play_by_the_rules_and_train_only_the_guesses(smol):
    from cispo.training.sft_data import encode_parts

    demos = guess_number.demonstrations(seed=1, n=32)
    for demo in demos:
        secret, lo, hi = int(demo["answer"]), 1, 15
        guesses = [read_guess(t.strip()) for t, trained in demo["parts"] if trained]
        answers = [t.strip() for t, trained in demo["parts"] if not trained]
        assert guesses[-1] == secret and answers[-1] == "correct"
        for g, said in zip(guesses, answers):
            assert lo <= g <= hi and said == guess_number.answer(secret, g)  # consistent with the answers so far
            lo, hi = (g + 1, hi) if said == "higher" else (lo, g - 1) if said == "lower" else (g, g)
    example = encode_parts(smol, demos[0], smol.convert_tokens_to_ids("<|im_end|>"))
    trained = smol.decode([i for i, label in zip(example.ids, example.labels) if label != -100])
    assert "higher" not in trained and "lower" not in trained and trained.count("Guess:") == len(guesses_of(demos[0]))


def guesses_of(demo: dict) -> list[str]:
    return [t for t, trained in demo["parts"] if trained]


def test_the_task_is_paired_with_its_environment(smol):
    cfg = apply_overrides(TrainConfig(), ["data.task=guess_number", "rollout.max_turns=3"])
    env = run_environments(smol, cfg.data, cfg.rollout)
    assert isinstance(env, ClassEnvironments) and env.cls is GuessEnv
    assert env.max_turns == 3 and env.stop_strings == ("\n",)
    task = get_task("guess_number")
    assert [s["secret"] for s in task.eval_samples(0, 16)] == [*range(1, 16), 1]  # every secret, in order
    assert task.train_samples(0, 8) == task.train_samples(0, 8) != task.train_samples(1, 8)


def newline_heavy_tiny_smollm2(folder: Path) -> Path:
    """The tiny random SmolLM2 with its head turned toward "\\n" at about half the positions (one hidden unit,
    read through the final norm), so that a 1-step run's episodes take turns."""
    import torch
    from transformers import AutoModelForCausalLM

    from cispo.models.packaged import save_tiny_smollm2

    save_tiny_smollm2(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.lm_head.weight[198, 0] += 40.0  # "\n"
    model.save_pretrained(folder)
    return folder


def test_a_run_with_per_turn_credit_writes_the_turn_rewards(tmp_path):
    from cispo.training.runner import train

    model = newline_heavy_tiny_smollm2(tmp_path / "tiny-smollm2")
    cfg = apply_overrides(TrainConfig(), [
        f"model.path={model}", f"out_dir={tmp_path}", "data.task=guess_number", "model.device=cpu", "progress=false",
        "steps=1", "prompts_per_step=2", "group_size=2", "updates_per_batch=1", "max_new_tokens=16",
        "num_train_prompts=8", "num_eval_prompts=2", "eval.every=0", "checkpoint_every=0", "threads=1",
        "rollout.max_turns=3", "algo.turn_credit=reward_to_go", "algo.advantage_estimator=rloo",
        "rollout.dynamic_sampling=false", "log_samples_every=1"])
    run = train(cfg)
    samples = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()]
    stepped = [s["turn_rewards"] for s in samples if s.get("turn_rewards")]
    assert stepped and {r for rewards in stepped for r in rewards} <= {TURN_COST, 0.0}, samples[:1]
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("rollout/turn_reward_mean" in r for r in rows)
