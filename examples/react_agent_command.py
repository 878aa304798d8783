"""The ReAct agent of examples/react_agent.py as a program of its own, trained as a command
(docs/agents.md, "A program as a command"): the same loop, started as a process; any language works the same way.

    pip install openai
    cispo train model.path=builtin:smollm2-135m data.task=wordmath_calc data.tools=[] \
        data.agent_command="python examples/react_agent_command.py" rollout.max_turns=4 max_new_tokens=128

The trainer starts it once per episode with the sample as JSON on standard input and OPENAI_BASE_URL /
OPENAI_API_KEY set, so `openai.OpenAI()` talks to the policy unchanged. It prints nothing on standard output,
so the task's reward scores the transcript; print a number last to reward the episode yourself.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from react_agent import run  # noqa: E402  (the same loop: only how it is started differs)

if __name__ == "__main__":
    run(json.load(sys.stdin), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])
