"""``wordmath_calc``: the ``wordmath`` word problems with an inline calculator.

The same problems as ``wordmath`` (its generator, seeds and split: a seed gives the same problems in
both tasks), with a prompt that tells the model about the calculator: ``<calc>2+3</calc>`` pauses
generation and the environment (``cispo.envs.tool_env``, inline format) inserts
``<result>5</result>``; generation goes on in the same turn. The task's tools are ``calculator``
(`TOOLS`, used where ``data.tools`` is None) in the inline format (`TOOL_FORMAT`: the prompt teaches
it, whatever the chat template can do). The fork diagnostics track the string ``<calc>`` (`FORK_TOKENS`):
the token where the policy decides to call the tool.

**The reward reads the policy's own text only.** The task declares ``scores_policy_text``: the trainer hands
the reward (and `extract_answer`) what the policy wrote — the response's tokens it sampled, ``env_mask`` 0,
decoded run by run (``cispo.training.sampling.policy_text``) — and the verifier is ``wordmath``'s
(`wordmath.reward`) on that. So the calculator is worth what it does to the policy's words and nothing else:
an answer that appears only in a result (``#### <calc>3+4</calc><result>7</result>``) states none, an echo of
a result without an answer marker states none, a result after the stated answer neither hedges it nor restates
it, and a wrong result the policy copies is the policy's wrong answer. (Scoring the transcript instead would
let a tool's output — a ``python`` program printing ``#### 7`` — state the answer for the policy.)

The environment's tokens are known by their mask, never guessed from the text: a ``<result>`` the policy writes
itself is its own text wherever it stands (a hedge inside it is a hedge), and so is ``</calc`` + a special
token + ``>``, which decodes to ``</calc>`` but made no call. (Reading the transcript and taking out each
``<result>...</result>`` after a ``</calc>`` let exactly that pass: the policy's own ``<result> or 8</result>``
after a forged ``</calc>`` was taken out, and ``#### 7 ... or 8`` was paid.)
"""

from __future__ import annotations

import random

from cispo.data.tasks import wordmath
from cispo.foundations.forks import used_any

NAME = "wordmath_calc"
LARGE_NAME = "wordmath_calc_large"
"""The same task on problems with 2-3 digit operands (`wordmath.samples`' ``numbers="large"``):
arithmetic the 135M model cannot do in its head."""
EXAMPLE_NAME = "wordmath_calc_example"
"""The same task with the calculator taught by a worked example in the system prompt (`samples`'
``prompt="system_example"``; studies/results/agents/search-plan.md)."""
TOOLS = ("calculator",)
"""The task's tools where ``data.tools`` is None."""
TOOL_FORMAT = "inline"
"""The task's tool format where ``data.tool_format`` is auto: the prompt teaches the inline calculator."""
FORK_TOKENS = ("<calc>",)
"""The fork diagnostics' string: the opening of a calculator call."""
CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE = "<calc>", "</calc>", "<result>", "</result>"
SYSTEM_PROMPT = wordmath.SYSTEM_PROMPT
INSTRUCTION = ("You have a calculator: write <calc>2+3</calc> and it gives <result>5</result>. Use it for the "
               "arithmetic, then write the final answer as: #### <number>")
"""Appended to each problem in the user turn (where SmolLM2-135M follows wordmath's instruction more often)."""
SYSTEM_EXAMPLE = (f"{SYSTEM_PROMPT} You have a calculator: write a sum between <calc> and </calc> and its "
                  "value appears between <result> and </result>. Example.\n"
                  "Question: A shelf holds 12 cups. Zoe puts 7 more cups on it. How many cups are on the shelf?\n"
                  "Answer: 12 + 7 = <calc>12+7</calc><result>19</result>\n#### 19")
"""``prompt="system_example"``'s system message: wordmath's, and the calculator shown on one worked problem
(not one of the task's: no template of `wordmath` has cups or a Zoe), so that the user turn can carry wordmath's
own instruction (`wordmath.INSTRUCTION`) instead of the calculator's, which the 135M model copies (stage 0)."""
PROMPTS = ("user", "system_example")
MAX_NEW_TOKENS = 160
"""wordmath's 96 and room for a few calls and their results (an observation counts against the length)."""


def samples(seed: int, n: int, split: str = "train", prompt: str = "user", numbers: str = "small") -> list[dict]:
    """``wordmath.samples`` (the same problems, answers and split) with the calculator's prompt:
    ``{"prompt", "messages", "answer", "solution"}``. ``prompt="user"``: wordmath's system message and the
    problem followed by `INSTRUCTION`; ``"system_example"``: `SYSTEM_EXAMPLE` and the problem followed by
    wordmath's own instruction. ``numbers``: `wordmath.samples`' operand size (``large``: 2-3 digits)."""
    if prompt not in PROMPTS:
        raise ValueError(f"prompt must be one of {PROMPTS}, got {prompt!r}")
    system, instruction = ((SYSTEM_PROMPT, INSTRUCTION) if prompt == "user"
                           else (SYSTEM_EXAMPLE, wordmath.INSTRUCTION))
    out = []
    for s in wordmath.samples(seed, n, split, numbers):
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"{s['prompt']}\n{instruction}"}]
        out.append({**s, "messages": messages})
    return out


def demonstrations(seed: int, n: int, numbers: str = "small", calculator: bool = True) -> list[dict]:
    """Worked answers to ``n`` train problems (``wordmath.workings``) for a supervised warm start (as ReTool's
    cold start): ``{"messages", "answer", "parts"}``, ``parts`` the
    assistant's text as ``(text, trained)`` pieces. With the calculator (this task's prompt)::

        "539 / 11 = <calc>539/11</calc>" (trained)  "<result>49</result>" (not: the environment's)  "\n#### 49"

    without it (wordmath's prompt), the same working with the value written by hand:
    ``"539 / 11 = 49\n#### 49"``."""
    prompts = samples(seed, n, "train", numbers=numbers) if calculator else wordmath.samples(seed, n, "train", numbers)
    out = []
    for sample, (_, answer, expression) in zip(prompts, wordmath.workings(seed, n, "train", numbers)):
        if calculator:
            call = f"{expression} = {CALL_OPEN}{expression.replace(' ', '')}{CALL_CLOSE}"
            parts = [(call, True), (f"{RESULT_OPEN}{answer}{RESULT_CLOSE}", False), (f"\n#### {answer}", True)]
        else:
            parts = [(f"{expression} = {answer}\n#### {answer}", True)]
        out.append({"messages": sample["messages"], "answer": sample["answer"], "parts": parts})
    return out


def mixed_demonstrations(seed: int, n: int, numbers: str, call_share: float) -> list[dict]:
    """`demonstrations` with the calculator where a seeded draw falls below ``call_share``, elsewhere the plain one
    under the calculator's prompt (the same problems, the same messages, the value written by hand): a warm start
    that leaves the call rare but rewarded (studies/results/agents/search-plan.md, the rare call)."""
    rng = random.Random(f"call-share/{seed}/{n}/{numbers}")
    calc = demonstrations(seed, n, numbers, True)
    plain = demonstrations(seed, n, numbers, False)
    return [c if rng.random() < call_share else {**p, "messages": c["messages"]} for c, p in zip(calc, plain)]


def reward(prompt, completion: str, answer=None, **sample) -> float:
    """``wordmath.reward`` on ``completion``, the policy's own text (module docstring: the trainer takes the
    environment's observations out by their mask): 1.0 iff its stated final answer equals ``answer`` and no
    other number follows it."""
    return wordmath.reward(prompt, completion, answer)


def extract_answer(completion: str) -> str | None:
    """``wordmath.extract_answer`` on the policy's own text (what maj@k votes on)."""
    return wordmath.extract_answer(completion)


def used_fork(completion: str) -> bool:
    """Whether the policy called the calculator (``<calc>``)."""
    return used_any(FORK_TOKENS, completion)
