"""`arithmetic`: single-turn addition with a verifiable, exact-answer reward."""

from __future__ import annotations

import random
import re
import zlib
from typing import Any

from tinker_pipelines.envs.base import Env
from tinker_pipelines.types import Message, Observation, StepResult

SYSTEM_PROMPT = "Answer with a single number and nothing else."


def exact_answer(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1.0 where the reply, stripped, is exactly the answer, else 0.0.

    >>> exact_answer(["16", " 16\\n", "The answer is 16.", "61"], answer=["16"] * 4)
    [1.0, 1.0, 0.0, 0.0]
    """
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def contains_answer(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1.0 where the reply contains the answer as a whole number, else 0.0.

    >>> contains_answer(["16", "The answer is 16.", "160"], answer=["16"] * 3)
    [1.0, 1.0, 0.0]
    """
    return [
        1.0 if re.search(rf"(?<!\d){re.escape(a)}(?!\d)", c) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


def in_split(a: int, b: int, split: str, test_fraction: float = 0.2) -> bool:
    """Whether the problem `a + b` belongs to `split` ('train' or 'test'); fixed by a hash."""
    is_test = zlib.crc32(f"{a}+{b}".encode()) % 1000 < test_fraction * 1000
    return is_test == (split == "test")


def sample_problem(seed: int, max_operand: int, split: str) -> tuple[int, int]:
    """The problem a seed selects, drawn from `split` only."""
    rng = random.Random(seed)
    while True:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if in_split(a, b, split):
            return a, b


class ArithmeticEnv(Env):
    """Ask `a + b`; reward 1 for exactly the sum (stripped). A reply that merely contains the sum
    earns `partial_credit` times the sum's share of the reply's characters (0 by default)."""

    def __init__(self, max_operand: int = 9, split: str = "train", partial_credit: float = 0.0,
                 question: str = "{a} + {b} = ?"):
        if split not in ("train", "test"):
            raise ValueError(f"env.kwargs.split must be 'train' or 'test', got {split!r}")
        if max_operand < 1:
            raise ValueError(f"env.kwargs.max_operand must be >= 1, got {max_operand}")
        self.max_operand, self.split = max_operand, split
        self.partial_credit, self.question = partial_credit, question
        self._answer: str | None = None

    def reset(self, seed: int | None = None) -> Observation:
        self._seed = seed if seed is not None else random.randrange(2**31)
        a, b = sample_problem(self._seed, self.max_operand, self.split)
        self._answer = str(a + b)
        return prompt_messages(self.question.format(a=a, b=b))

    @staticmethod
    def sft_examples(n: int, seed: int = 0, verbose_fraction: float = 0.0,
                     **env_kwargs: Any) -> list[tuple[list[Message], str]]:
        """Supervised warm-start pairs from the training split (see `sft_examples`)."""
        return sft_examples(n, seed, verbose_fraction, **env_kwargs)

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise RuntimeError("step() called before reset()")
        return score_reply(action, self._answer, self.partial_credit)


def score_reply(action: str, answer: str, partial_credit: float) -> StepResult:
    """The final step of a bare-answer task: 1 for exactly `answer`, else partial credit.

    Shaping for models that answer in sentences: a reply containing the answer earns
    `partial_credit` scaled by the answer's share of the reply, so shorter replies earn more and
    uniform groups ("The answer is 16." everywhere) still carry a gradient toward the bare answer.
    """
    exact = exact_answer([action], answer=[answer])[0]
    contains = contains_answer([action], answer=[answer])[0]
    reward = exact or partial_credit * contains * len(answer) / max(len(action.strip()), 1)
    return StepResult([], reward, True, {"answer": answer, "exact": exact, "contains": contains})


def prompt_messages(question: str) -> list[Message]:
    """The opening messages of a problem."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


VERBOSE_REPLIES = ("The answer is {}.", "{} is the answer.", "It is {}.")
"""Chatty phrasings, as instruct models answer when asked for a bare number."""


def sft_examples(n: int, seed: int = 0, verbose_fraction: float = 0.0,
                 **env_kwargs: Any) -> list[tuple[list[Message], str]]:
    """`n` (messages, reply) pairs from the training split, for an SFT warm start.

    A `verbose_fraction` of the replies wrap the right number in a sentence, like demonstrations
    scraped from a chatty model: correct content, wrong format for the exact-answer reward.
    """
    env = ArithmeticEnv(**{**env_kwargs, "split": "train"})
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = env.reset(seed=rng.randrange(2**31))
        reply = env._answer
        if rng.random() < verbose_fraction:
            reply = rng.choice(VERBOSE_REPLIES).format(reply)
        out.append((messages, reply))
    return out
