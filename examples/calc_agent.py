"""The inline calculator as an agent program against the `openai` client (docs/agents.md, "Demonstration"):

    pip install openai
    cispo train --config examples/smollm2-wordmath-calc-agent.yaml

Each episode runs `run` once: a text completion of the problem's chat prompt (SmolLM2's ChatML) that stops at
``</calc>``; the calculator runs on what follows the last ``<calc>``; ``<result>VALUE</result>`` is appended and
the completion goes on, at most MAX_TURNS results, as the built-in environment does (data.task=wordmath_calc
without data.agent, cispo.envs.tool_env's inline format). ``include_stop_str_in_output`` gives back the text as
sampled, ``</calc>`` and what its last token ran on past it, so each next prompt extends the row token for token:
the same tokens, log-probs and rewards as the built-in environment's (tests/envs/test_calc_agent.py). It returns
None: the task's reward scores the transcript.
"""

import openai

from cispo.data.rewards import describe_error
from cispo.envs.tools import calculator, policy_error

MAX_TURNS = 4  # results per answer: rollout.max_turns


def chatml(messages):
    """SmolLM2's chat template (ChatML), the assistant turn opened."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def result(segment):
    """What the calculator says of the call ``segment`` ends with, as the built-in environment shows it."""
    body = segment[: segment.rfind("</calc>")]
    if "<calc>" not in body:
        return "error: the call has no opening <calc>"
    try:
        return calculator(body[body.rfind("<calc>") + len("<calc>"):].strip())
    except Exception as e:  # the policy is shown its mistake
        return policy_error(describe_error(e))


def run(sample, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = chatml(sample["messages"])
    for turn in range(MAX_TURNS + 1):
        choice = client.completions.create(model="policy", prompt=prompt, stop=["</calc>"],
                                           extra_body={"include_stop_str_in_output": True}).choices[0]
        if choice.finish_reason != "stop" or "</calc>" not in choice.text or turn == MAX_TURNS:
            return None  # an end of turn, the budget spent, or no result left: the episode is over
        prompt += choice.text + "<result>" + result(choice.text).replace("<", "&lt;") + "</result>"
    return None
