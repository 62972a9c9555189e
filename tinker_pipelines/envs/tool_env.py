"""Tool-using environments: the agent may call tools for several turns, then answers.

`ToolEnv` holds the mechanics (tool list in the system prompt, parsing calls from the reply,
running them, returning results as `tool` messages, a budget of calls); a subclass only says
what the task is and how an answer scores. `MultiplyEnv` asks for a multi-digit product, which
the calculator makes easy and a small model's mental arithmetic does not.

A reply that contains at least one `<tool_call>` tag is a tool turn (reward 0, the episode goes
on with the results); a reply without one is the final answer. With `tools=()` every reply is
the final answer: the same task without tools, for comparison.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

from tinker_pipelines.envs.base import Env
from tinker_pipelines.envs.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Tool,
    execute_tool_call,
    format_tool_call,
    get_tools,
    parse_tool_calls,
    tools_prompt,
)
from tinker_pipelines.types import Message, Observation, StepResult


class ToolEnv(Env):
    """Base class of tool-using tasks. Subclasses implement `make_task` (and may override `score`)."""

    instructions = "Answer with a single number and nothing else."
    """First line of the system prompt."""

    def __init__(self, tools: tuple[str, ...] | list[str] = ("calculator",), max_tool_calls: int = 3,
                 tool_role: str = "tool", prompt_style: str = "full", extra_tools: list[Tool] | None = None):
        """`tools`: built-in tool names (empty: no tools); `max_tool_calls`: tool turns before the
        episode ends with reward 0; `tool_role`: role of result messages ('tool' or 'user', for chat
        templates that know no 'tool' role); `prompt_style`: 'full' (JSON schemas) or 'short' (one
        line per tool, for small models and short contexts)."""
        if tool_role not in ("tool", "user"):
            raise ValueError(f"env.kwargs.tool_role must be 'tool' or 'user', got {tool_role!r}")
        if prompt_style not in ("full", "short"):
            raise ValueError(f"env.kwargs.prompt_style must be 'full' or 'short', got {prompt_style!r}")
        if max_tool_calls < 0:
            raise ValueError(f"env.kwargs.max_tool_calls must be >= 0, got {max_tool_calls}")
        self.tools = {**get_tools(list(tools)), **{t.name: t for t in extra_tools or []}}
        for t in self.tools.values():  # a tool this machine cannot run fails the build, before any episode
            if t.preflight is not None:
                t.preflight()
        self.max_tool_calls, self.tool_role, self.prompt_style = max_tool_calls, tool_role, prompt_style
        self._answer: str | None = None
        self._done = True
        self._tool_calls = self._tool_errors = 0

    # -- what a subclass provides -------------------------------------------------------------
    def make_task(self, rng: random.Random) -> tuple[str, str]:
        """(question, reference answer) for a seeded generator."""
        raise NotImplementedError

    def score(self, reply: str, answer: str) -> float:
        """Reward of a final reply: 1 for exactly the answer (stripped), else 0."""
        return 1.0 if reply.strip() == answer else 0.0

    # -- mechanics -----------------------------------------------------------------------------
    def system_prompt(self) -> str:
        if not self.tools:
            return self.instructions
        if self.prompt_style == "short":
            listing = "; ".join(f"{t.name}({', '.join(t.parameters['properties'])})" for t in self.tools.values())
            example = format_tool_call(next(iter(self.tools)), {"...": "..."})
            return f"{self.instructions}\nTools: {listing}. Call one as {example}"
        return f"{self.instructions}\n{tools_prompt(list(self.tools.values()))}"

    def reset(self, seed: int | None = None) -> Observation:
        self._seed = seed if seed is not None else random.randrange(2**31)
        question, self._answer = self.make_task(random.Random(self._seed))
        self._done, self._tool_calls, self._tool_errors = False, 0, 0
        return [{"role": "system", "content": self.system_prompt()}, {"role": "user", "content": question}]

    def _info(self, exact: float) -> dict[str, Any]:
        return {"answer": self._answer, "exact": exact, "tool_calls": self._tool_calls,
                "tool_errors": self._tool_errors}

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        if self._done:
            raise RuntimeError(f"{type(self).__name__}.step() called after the episode ended; call reset()")
        calls = parse_tool_calls(action) if self.tools else []
        if not calls:
            self._done = True
            reward = float(self.score(action, self._answer))
            return StepResult([], reward, True, self._info(reward))
        self._tool_calls += 1
        if self._tool_calls > self.max_tool_calls:
            self._done = True
            return StepResult([], 0.0, True, {**self._info(0.0), "stop": "tool_budget"})
        results = [execute_tool_call(c, self.tools) for c in calls[:4]]
        self._tool_errors += sum(not r.ok for r in results)
        observation: list[Message] = [{"role": self.tool_role, "content": r.content} for r in results]
        return StepResult(observation, 0.0, False, {"tool_results": [r.content for r in results]})


def in_split(a: int, b: int, split: str, test_fraction: float = 0.2) -> bool:
    """Whether `a * b` belongs to `split` ('train' or 'test'); fixed by a hash of the problem."""
    is_test = zlib.crc32(f"{a}*{b}".encode()) % 1000 < test_fraction * 1000
    return is_test == (split == "test")


class MultiplyEnv(ToolEnv):
    """'What is a * b?' with `min_digits`..`max_digits`-digit operands; reward 1 for the exact product."""

    def __init__(self, min_digits: int = 2, max_digits: int = 3, split: str = "train", **tool_kwargs: Any):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"env.kwargs: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if split not in ("train", "test"):
            raise ValueError(f"env.kwargs.split must be 'train' or 'test', got {split!r}")
        super().__init__(**tool_kwargs)
        self.min_digits, self.max_digits, self.split = min_digits, max_digits, split

    def operands(self, rng: random.Random) -> tuple[int, int]:
        while True:
            digits = [rng.randint(self.min_digits, self.max_digits) for _ in range(2)]
            a, b = (rng.randint(10 ** (d - 1), 10 ** d - 1) for d in digits)
            if in_split(a, b, self.split):
                return a, b

    def make_task(self, rng: random.Random) -> tuple[str, str]:
        a, b = self.operands(rng)
        return f"What is {a} * {b}?", str(a * b)

    @staticmethod
    def sft_examples(n: int, seed: int = 0, **env_kwargs: Any) -> list[tuple[list[Message], str]]:
        """Demonstrations from the training split: with tools, a calculator call and then the
        result copied as the answer (two (messages, reply) pairs per episode); without tools, the
        product directly. About `n` pairs."""
        env = MultiplyEnv(**{**env_kwargs, "split": "train"})
        rng = random.Random(seed)
        out: list[tuple[list[Message], str]] = []
        while len(out) < n:
            messages = env.reset(seed=rng.randrange(2**31))
            a, b = (int(x) for x in messages[-1]["content"][len("What is "):-1].split(" * "))
            if "calculator" not in env.tools:
                out.append((messages, env._answer))
                continue
            call = format_tool_call("calculator", {"expression": f"{a} * {b}"})
            result = env.step(call).observation
            out.append((messages, call))
            out.append((messages + [{"role": "assistant", "content": call}, *result], env._answer))
        return out[:n]


__all__ = ["MultiplyEnv", "ToolEnv", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE"]
