"""`guess_number`: a multi-turn dialogue. The agent guesses a hidden number and is told
"higher" or "lower" until it is right or runs out of guesses."""

from __future__ import annotations

import random
import re

from tinker_pipelines.envs.base import Env
from tinker_pipelines.types import Observation, StepResult


class GuessNumberEnv(Env):
    """Reward 1 for finding the number, minus `step_penalty` per wrong guess; 0 if never found."""

    def __init__(self, low: int = 1, high: int = 16, max_guesses: int = 5, step_penalty: float = 0.05):
        if not low < high:
            raise ValueError(f"env.kwargs.low ({low}) must be below env.kwargs.high ({high})")
        self.low, self.high, self.max_guesses, self.step_penalty = low, high, max_guesses, step_penalty
        self._target: int | None = None
        self._guesses = 0

    def reset(self, seed: int | None = None) -> Observation:
        self._seed = seed if seed is not None else random.randrange(2**31)
        self._target = random.Random(self._seed).randint(self.low, self.high)
        self._guesses = 0
        self._done = False
        return [
            {"role": "system", "content": "Guess the number. Reply with a single number."},
            {"role": "user", "content": f"I think of a number between {self.low} and {self.high}. Your guess?"},
        ]

    def step(self, action: str) -> StepResult:
        if self._target is None:
            raise RuntimeError("step() called before reset()")
        if self._done:  # found by check_env: a step after the end must not continue the episode
            raise RuntimeError("step() called after the episode ended; call reset()")
        self._guesses += 1
        match = re.search(r"-?\d+", action)
        out_of_guesses = self._guesses >= self.max_guesses
        if match is None:
            reply = "Please reply with a number."
        elif int(match.group()) == self._target:
            self._done = True
            return StepResult([], 1.0, True, {"exact": 1.0, "guesses": self._guesses})
        else:
            reply = "Higher." if int(match.group()) < self._target else "Lower."
        if out_of_guesses:
            self._done = True
            return StepResult([], 0.0, True, {"exact": 0.0, "guesses": self._guesses})
        return StepResult([{"role": "user", "content": reply}], -self.step_penalty, False, {})
