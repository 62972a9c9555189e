"""`repeat`: copy a number back, bare. Chat models know the number but wrap it in a sentence, so
the exact-answer rate starts low and RL has a format to teach."""

from __future__ import annotations

import random
import zlib

from tinker_pipelines.envs.arithmetic import SYSTEM_PROMPT, contains_answer, exact_answer, prompt_messages
from tinker_pipelines.envs.base import Env
from tinker_pipelines.types import Observation, StepResult


class RepeatEnv(Env):
    """Ask to repeat a `digits`-digit number; reward 1 for exactly it, partial credit as in `arithmetic`."""

    def __init__(self, digits: int = 4, split: str = "train", partial_credit: float = 0.0):
        if split not in ("train", "test"):
            raise ValueError(f"env.kwargs.split must be 'train' or 'test', got {split!r}")
        self.digits, self.split, self.partial_credit = digits, split, partial_credit
        self._answer: str | None = None

    def reset(self, seed: int | None = None) -> Observation:
        self._seed = seed if seed is not None else random.randrange(2**31)
        rng = random.Random(self._seed)
        while True:  # 20% of the numbers are held out for evaluation
            n = str(rng.randrange(10 ** (self.digits - 1), 10 ** self.digits))
            if (zlib.crc32(n.encode()) % 5 == 0) == (self.split == "test"):
                break
        self._answer = n
        return prompt_messages(f"Repeat this number: {n}")

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise RuntimeError("step() called before reset()")
        exact = exact_answer([action], answer=[self._answer])[0]
        contains = contains_answer([action], answer=[self._answer])[0]
        reward = exact or self.partial_credit * contains * len(self._answer) / max(len(action.strip()), 1)
        self._answer, answer = None, self._answer
        return StepResult([], reward, True, {"answer": answer, "exact": exact, "contains": contains})


__all__ = ["RepeatEnv", "SYSTEM_PROMPT"]
