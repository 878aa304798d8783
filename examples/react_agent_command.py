"""The ReAct agent of examples/react_agent.py as a program of its own, trained as a command
(docs/agents.md, "A program as a command"): any language works the same way.

    pip install openai
    cispo train model.path=builtin:smollm2-135m data.task=wordmath_calc data.tools=[] \
        data.agent_command="python examples/react_agent_command.py" rollout.max_turns=4 max_new_tokens=128

The trainer starts it once per episode with the sample as JSON on standard input and OPENAI_BASE_URL /
OPENAI_API_KEY set, so `openai.OpenAI()` talks to the policy unchanged. It prints nothing on standard output,
so the task's reward scores the transcript; print a number last to reward the episode yourself.
"""

import json
import sys

import openai

from cispo.envs.tools import calculator  # any tool of your own does as well

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
SYSTEM = "Solve the problem step by step. Use the calculator for arithmetic. End with 'The answer is N.'"

if __name__ == "__main__":
    sample = json.load(sys.stdin)
    client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the trainer
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
