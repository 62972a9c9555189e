"""`repeat`: copy a number back, bare. Chat models know the number but wrap it in a sentence, so
the exact-answer rate starts low and RL has a format to teach."""

from __future__ import annotations

import random
import zlib

from tinker_pipelines.envs.arithmetic import SYSTEM_PROMPT, prompt_messages, score_reply
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
        self._answer, answer = None, self._answer
        return score_reply(action, answer, self.partial_credit)


__all__ = ["RepeatEnv", "SYSTEM_PROMPT"]
