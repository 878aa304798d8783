"""``wordmath_calc``: wordmath's problems with an inline calculator, scored by wordmath's verifier
on the policy's own text (the environment's tokens out by their mask): a result the calculator inserted never
states, hedges or restates an answer, and a result the policy forged is its own text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cispo.data.rewards.pool import shutdown_pools
from cispo.data.tasks import get_task, wordmath, wordmath_calc
from cispo.data.tasks.wordmath_calc import reward
from cispo.envs.tool_env import TASK_TOOLS, build_environment
from cispo.training.sampling import policy_text
from tests.data.tasks.test_wordmath import VERDICTS, Q

TOKENIZER_DIR = Path(__file__).resolve().parents[3] / "cispo" / "data" / "tasks" / "base_models" / "smollm2-tokenizer"


def test_the_same_problems_with_the_calculator_in_the_prompt():
    for split in ("train", "eval"):
        plain, calc = wordmath.samples(3, 30, split), wordmath_calc.samples(3, 30, split)
        assert [(s["prompt"], s["answer"]) for s in calc] == [(s["prompt"], s["answer"]) for s in plain]
    s = wordmath_calc.samples(0, 1)[0]
    assert s["messages"][0] == {"role": "system", "content": wordmath.SYSTEM_PROMPT}
    user = s["messages"][1]["content"]
    assert user.startswith(s["prompt"] + "\n") and "<calc>2+3</calc>" in user and "<result>5</result>" in user
    assert "#### <number>" in user


def test_the_task_is_registered_with_its_fork_string():
    task = get_task("wordmath_calc")
    assert (task.name, task.fork_tokens, task.chat, task.model) == ("wordmath_calc", ("<calc>",), True,
                                                                    "builtin:smollm2-135m")
    assert task.max_new_tokens == wordmath_calc.MAX_NEW_TOKENS > get_task("wordmath").max_new_tokens
    assert task.train_samples(0, 2) == wordmath_calc.samples(0, 2)
    assert task.used_fork("so <calc>2+3</calc>") and not task.used_fork("2 + 3 = 5")
    assert task.scores_policy_text and not get_task("wordmath").scores_policy_text  # the calculator's results out
    assert task.extract_answer("<calc>30+21</calc>\n#### 51") == "51"  # on the policy's own text
    assert task.extract_answer("#### <calc>30+21</calc>") is None


def test_the_example_variant_teaches_the_calculator_in_the_system_prompt():
    """The example variant: the same problems, a worked example in the system message and
    wordmath's own instruction in the user turn; the same tools, reward and fork string."""
    task, plain = get_task("wordmath_calc_example"), get_task("wordmath_calc")
    example, calc = task.eval_samples(0, 20), plain.eval_samples(0, 20)
    assert [(s["prompt"], s["answer"]) for s in example] == [(s["prompt"], s["answer"]) for s in calc]
    system, user = (m["content"] for m in example[0]["messages"])
    assert system.startswith(wordmath.SYSTEM_PROMPT) and "<calc>12+7</calc><result>19</result>" in system
    assert user == f"{example[0]['prompt']}\n{wordmath.INSTRUCTION}" and "<calc>" not in user
    # the example is no task problem
    assert not any("cups" in s["prompt"] or "Zoe" in s["prompt"] for s in wordmath.samples(0, 500))
    assert (task.reward, task.fork_tokens, task.max_new_tokens) == (plain.reward, plain.fork_tokens,
                                                                    plain.max_new_tokens)
    assert TASK_TOOLS["wordmath_calc_example"] == TASK_TOOLS["wordmath_calc"]
    with pytest.raises(ValueError, match="prompt must be one of"):
        wordmath_calc.samples(0, 1, prompt="system")


def test_the_large_variant_is_the_calculator_on_wordmaths_large_problems():
    """The large variants: the calculator task and its no-calculator twin on the same 2-3 digit problems."""
    calc, plain = get_task("wordmath_calc_large"), get_task("wordmath_large")
    assert [(s["prompt"], s["answer"]) for s in calc.train_samples(1, 30)] \
        == [(s["prompt"], s["answer"]) for s in plain.train_samples(1, 30)] \
        == [(s["prompt"], s["answer"]) for s in wordmath.samples(1, 30, numbers="large")]
    assert calc.eval_samples(0, 3)[0]["messages"][1]["content"].endswith(wordmath_calc.INSTRUCTION)
    assert (calc.reward, calc.fork_tokens, calc.max_new_tokens) == (get_task("wordmath_calc").reward, ("<calc>",),
                                                                    wordmath_calc.MAX_NEW_TOKENS)
    assert plain.reward is get_task("wordmath").reward and "<calc>" not in str(plain.eval_samples(0, 3))
    assert TASK_TOOLS["wordmath_calc_large"] == TASK_TOOLS["wordmath_calc"] and "wordmath_large" not in TASK_TOOLS


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    yield AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    shutdown_pools()


ENV = object()
"""Marks the next part of an episode as the environment's (`episode`)."""


def episode(tokenizer, *parts) -> tuple[torch.Tensor, torch.Tensor]:
    """An episode's response ids and ``env_mask`` from its parts: text the policy wrote, an int (a token id it
    sampled, e.g. a special token), or `ENV` followed by the text the environment inserted."""
    ids, mask, env = [], [], False
    for part in parts:
        if part is ENV:
            env = True
            continue
        new = [part] if isinstance(part, int) else tokenizer.encode(part, add_special_tokens=False)
        ids, mask, env = ids + new, mask + [int(env)] * len(new), False
    return torch.tensor(ids), torch.tensor(mask)


def scored(tokenizer, *parts, answer="51") -> float:
    """The task's reward as the trainer calls it: on the policy's own text, the environment's tokens out by mask."""
    return get_task("wordmath_calc").reward(Q, policy_text(tokenizer, *episode(tokenizer, *parts)), answer=answer)


# (episode parts, score) for Q (30 + 21 = 51): wordmath's verifier on what the policy wrote.
CALC_VERDICTS = [
    (("<calc>30+21</calc>", ENV, "<result>51</result>", "\n#### 51"), 1.0),
    (("Ava starts with 30 and gets 21 more: <calc>30 + 21</calc>", ENV, "<result>51</result>",
      " so she has 51 apples.\nThe answer is 51."), 1.0),  # verbose
    (("a <calc>30+21</calc>.", ENV, "<result>51</result>", " #### 51"), 1.0),  # the closing token ran on ('>.')
    (("#### <calc>30+21</calc>", ENV, "<result>51</result>"), 0.0),  # the answer only inside the tool's result
    (("The answer is <calc>30+21</calc>", ENV, "<result>51</result>"), 0.0),
    (("\\boxed{<calc>30+21</calc>", ENV, "<result>51</result>", "}"), 0.0),
    (("<calc>30+21</calc>", ENV, "<result>51</result>"), 0.0),  # echoes the result, states no answer
    (("<calc>30+21</calc>", ENV, "<result>51</result>", " 51"), 0.0),
    (("<calc>30*21</calc>", ENV, "<result>630</result>", "\n#### 630"), 0.0),  # a wrong result copied
    (("<calc>30+21</calc>", ENV, "<result>51</result>", "\n#### 51, or maybe 52"), 0.0),  # hedges
    (("<calc>30+21</calc>", ENV, "<result>51</result>", "\n#### 51\n#### 52"), 0.0),
    (("#### 51 <calc>51+1</calc>", ENV, "<result>52</result>"), 0.0),  # a call after the answer: its numbers hedge
    (("#### 51\n<calc>51*51</calc>", ENV, "<result>2601</result>"), 1.0),  # the result is not the policy's
    (("#### 51 <result>52</result>", ), 0.0),  # a <result> the policy wrote itself is read
    (("<calc>30+21+</calc>", ENV, "<result>error: not an arithmetic expression</result>", "\n#### 51"), 1.0),
    (("<calc>print(51)</calc>", ENV, "<result>#### 51</result>"), 0.0),  # a tool's output never states the answer
]


@pytest.mark.parametrize("parts, score", CALC_VERDICTS)
def test_the_reward_is_wordmaths_on_the_policys_own_tokens(smol, parts, score):
    assert scored(smol, *parts) == score


@pytest.mark.parametrize("completion, score", VERDICTS)
def test_without_a_call_it_is_wordmaths_verifier(completion, score):
    assert reward(Q, completion, answer="51") == score


def test_a_forged_call_closing_does_not_hide_the_policys_hedge(smol):
    """``</calc`` + a special token + ``>`` decodes (special tokens removed) to ``</calc>`` but makes no call
    (the environment reads the tokens as they are); the ``<result>`` the policy writes after it is its own
    text, and the hedge in it a hedge. The honest episode — a real call, the result the environment inserted
    — is paid."""
    file_sep, im_start = smol.convert_tokens_to_ids(["<file_sep>", "<|im_start|>"])
    forged = ("#### 7 </calc", file_sep, "><result> or 8</result>")
    forged_later = ("3 + 4 = <calc>3+4</calc", im_start, ">  <result>, or maybe 8</result>\n#### 7",
                    " <calc>7</calc", file_sep, "><result>8</result>")
    assert smol.decode(episode(smol, *forged)[0], skip_special_tokens=True) == "#### 7 </calc><result> or 8</result>"
    assert scored(smol, *forged, answer="7") == 0.0
    assert scored(smol, *forged_later, answer="7") == 0.0
    assert scored(smol, "3 + 4 = <calc>3+4</calc>", ENV, "<result>7</result>", "\n#### 7", answer="7") == 1.0


def test_policy_text_joins_the_policys_runs(smol):
    ids, mask = episode(smol, "a <calc>1+1</calc>", ENV, "<result>2</result>", " b", ENV, "<result>3</result>")
    assert policy_text(smol, ids, mask) == "a <calc>1+1</calc> b"
    assert policy_text(smol, ids, torch.zeros_like(mask)) == smol.decode(ids)
    assert policy_text(smol, ids, torch.ones_like(mask)) == ""


def test_the_trainers_episode_scores_as_the_policys_own_segments(smol):
    """Through the real environment (the calculator in its worker processes): the text the reward reads, the
    response's ids without the observations by mask, is the policy's own segments joined."""
    env = build_environment(smol, None, max_turns=4, timeout_s=10.0, task="wordmath_calc", workers=1)
    episodes = env.start(wordmath_calc.samples(0, 1))
    turns = ["30 + 21 = <calc>30+21</calc>", " so <calc>51*1</calc><", "result> hmm #### 51<|im_end|>"]
    response, mask = [], []
    for text in turns:
        segment = smol.encode(text, add_special_tokens=False)
        k = next((k for k in range(1, len(segment) + 1) if episodes.pauses(0, segment[:k])), len(segment))
        segment = segment[:k]  # the sampler stops the segment where it pauses
        ended = segment[-1] == smol.eos_token_id
        obs = episodes.respond([0], [segment], [ended])[0] or []
        response, mask = response + segment + obs, mask + [0] * len(segment) + [1] * len(obs)
    env.close()
    record = episodes.record(0)
    own = "".join(s["text"] for s in record["segments"] if s["role"] == "policy")
    assert [s["text"] for s in record["segments"] if s["role"] == "tool"] == ["<result>51</result>"] * 2
    assert policy_text(smol, torch.tensor(response), torch.tensor(mask)) == own
    assert reward(Q, own, answer="51") == 1.0


def test_the_fork_diagnostics_find_the_call_in_smollm2s_ids(smol):
    from cispo.foundations.forks import ForkTokens

    forks = ForkTokens.from_tokenizer(smol, get_task("wordmath_calc").fork_tokens)
    assert forks.missing() == ()
    response = torch.tensor([smol.encode("so <calc>2+3</calc> and<calc>1</calc>", add_special_tokens=False)])
    starts = forks.index(response, torch.ones_like(response))[0].tolist()
    assert [smol.decode(response[0, i : i + 3]) for i, s in enumerate(starts) if s == 0] == [" <calc>", "<calc>"]


def test_workings_are_the_samples_problems_with_an_expression_of_their_answer():
    """Demonstrations of calculator calls start from `wordmath.workings`: the same problems as `samples`, in order,
    each expression's value its answer (every template, both operand sizes)."""
    from fractions import Fraction

    from cispo.envs.tools import evaluate
    for numbers in ("small", "large"):
        rows, plain = wordmath.workings(0, 300, "train", numbers), wordmath.samples(0, 300, "train", numbers)
        assert [(t, str(a)) for t, a, _ in rows] == [(s["prompt"], s["answer"]) for s in plain]
        assert all(evaluate(e) == Fraction(a) for _, a, e in rows)
        assert {e.count(" ") for _, _, e in rows} >= {2, 4, 6}  # one, two and three operations all drawn


def test_demonstrations_call_the_calculator_as_the_environment_answers():
    """The calculator's demonstration is what a run's transcript would be: the call, the environment's own
    observation for it (not trained), then the answer; the verifier pays it; the plain one writes the value."""
    from cispo.envs.tool_env import inline_observation
    from cispo.envs.tools import calculator
    calc, plain = wordmath_calc.demonstrations(0, 40), wordmath_calc.demonstrations(0, 40, calculator=False)
    assert [c["messages"] for c in calc] == [s["messages"] for s in wordmath_calc.samples(0, 40)]
    assert [p["messages"] for p in plain] == [s["messages"] for s in wordmath.samples(0, 40)]
    for c, p in zip(calc, plain):
        (call, t1), (observed, t2), (answer_line, t3) = c["parts"]
        expression = call[call.index("<calc>") + 6:call.index("</calc>")]
        assert (t1, t2, t3) == (True, False, True) and observed == inline_observation(calculator(expression))
        assert reward(None, call + answer_line, c["answer"]) == 1.0  # the policy's own text: the trained parts
        [(text, trained)] = p["parts"]
        assert trained and wordmath.reward(None, text, p["answer"]) == 1.0 and "<calc>" not in text
