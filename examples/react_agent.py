"""A ReAct agent written against the `openai` client, trained as it is (docs/agents.md, "Agent programs"):

    pip install openai
    cispo train model.path=builtin:smollm2-135m data.task=wordmath_calc data.tools=[] \
        data.agent=examples/react_agent.py:run rollout.max_turns=4 max_new_tokens=128

Each episode runs `run` once: it asks the policy (through the endpoint the trainer serves), runs the calculator
calls the reply makes, sends the results back, and stops when a reply calls no tool. It returns None, so the
task's reward scores the transcript; return a number to reward the episode yourself.
"""

import json

import openai

from cispo.envs.tools import calculator  # any tool of your own does as well

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
SYSTEM = "Solve the problem step by step. Use the calculator for arithmetic. End with 'The answer is N.'"


def run(sample, base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sample["prompt"]}]
    for _ in range(4):  # think -> act -> observe, at most four times
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as e:  # the policy is shown its mistake, as a tool environment would
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
