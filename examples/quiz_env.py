"""A stateful environment with a reward per turn (docs/api.md, "Environments"):

    cispo train model.path=builtin:smollm2-135m model.chat_template=true data.path=examples/quiz_prompts.jsonl \
        data.reward=env data.environment=examples/quiz_env.py:Quiz rollout.max_turns=6 max_new_tokens=96 \
        algo.turn_credit=reward_to_go algo.advantage_estimator=rloo
"""

import random
import re

from cispo.envs.base import Env, StepResult


class Quiz(Env):
    """Three sums, one a turn: a right answer earns 1 and brings the next sum, a wrong one the same sum again."""

    def reset(self, sample):
        rng = random.Random(sample["prompt"])  # the G episodes of a prompt must open alike: seed from the sample
        self.sums, self.asked = [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(3)], 0
        return f" First: {self.question()}"  # text: appended to the prompt's last user message

    def question(self):
        a, b = self.sums[self.asked]
        return f"What is {a} + {b}?"

    def step(self, segment):
        said = re.findall(r"-?\d+", segment.text)  # segment.text: what the policy wrote this turn
        if not said or int(said[-1]) != sum(self.sums[self.asked]):
            return StepResult([{"role": "user", "content": f"No. {self.question()}"}], reward=0.0)
        self.asked += 1
        if self.asked == len(self.sums):
            return StepResult(None, reward=1.0)  # None: the episode ends
        return StepResult([{"role": "user", "content": f"Yes. Next: {self.question()}"}], reward=1.0)
