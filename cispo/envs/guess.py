"""Guess the number: a built-in environment with state across turns and a reward on every turn.

The environment of the task ``guess_number`` (``cispo.data.tasks.guess_number``: the secret, the rules, the
reward). Each policy turn is one line: the episode's segment ends at the newline (`GuessEnv.stop_strings`), and
the environment answers, as text inside the same assistant turn (like the calculator's inline ``<result>``)::

    Guess: 8        <- the policy's segment (trained)
    higher          <- the observation (never trained): the secret is higher than 8
    Guess: 12
    lower
    Guess: 10       <- right: the episode ends here

What the policy sees next depends on what it wrote, and the environment's state (the secret, the guesses so far)
lives across the turns. Rewards: every turn that does not find the number earns `TURN_COST` (a wrong guess, an
unreadable line — answered with ``guess_number.UNREADABLE`` —, or a turn ended without a newline, which ends the
episode: no guess); the turn that finds it earns 0; the 1 for finding it is the task's reward (read back from the
policy's lines). So an episode's return is ``solved - 0.1 x wrong turns`` and, under
``algo.turn_credit=reward_to_go``, each turn is credited with the cost of the turns it leaves to come.

Inline text rather than chat turns: SmolLM2's ChatML would spend ~10 tokens of turn markers on each two-token
answer, and a warm start's demonstration is then one assistant turn (``cispo sft``'s parts), as the calculator's.
"""

from __future__ import annotations

from cispo.data.tasks import guess_number
from cispo.envs.base import Env, Segment, StepResult

__all__ = ["GuessEnv", "TURN_COST"]

TURN_COST = -0.1
"""The reward of a turn that does not find the number (the turn that finds it earns 0)."""


class GuessEnv(Env):
    """One game: the sample's ``secret``, the guesses read so far and whether the number was found."""

    stop_strings = ("\n",)

    def reset(self, sample: dict):
        """Start a game for ``sample["secret"]``; the prompt is the sample's own (None)."""
        self.secret, self.guesses, self.found = int(sample["secret"]), [], False
        return None

    def step(self, segment: Segment) -> StepResult:
        """Read the turn's line (`guess_number.read_guess`) and answer it: ``higher`` / ``lower`` (a wrong guess),
        the error line (unreadable), or the end of the episode (the number found, or a turn that ended without a
        newline: no guess)."""
        line, newline, _ = segment.text.partition("\n")
        if not newline:  # ended by EOS / the turn's end (or cut): a line never finished makes no guess
            return StepResult(None, TURN_COST, done=True, info={"guess": None, "answer": "ended"})
        guess = guess_number.read_guess(line)
        if guess is None:
            return StepResult(guess_number.UNREADABLE + "\n", TURN_COST, info={"guess": None, "answer": "unreadable"})
        self.guesses.append(guess)
        said = guess_number.answer(self.secret, guess)
        if said == guess_number.CORRECT:
            self.found = True
            return StepResult(None, 0.0, done=True, info={"guess": guess, "answer": said})
        return StepResult(said + "\n", TURN_COST, info={"guess": guess, "answer": said})

    def record(self) -> dict:
        """The game in ``samples.jsonl``: the secret, the readable guesses and whether the number was found."""
        return {"secret": self.secret, "guesses": list(self.guesses), "found": self.found}

