"""The environment contract and the picklable spec that builds environments by import path."""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from tinker_pipelines.types import Observation, StepResult

BUILTIN_ENVS = {
    "arithmetic": "tinker_pipelines.envs.arithmetic:ArithmeticEnv",
    "repeat": "tinker_pipelines.envs.repeat:RepeatEnv",
    "guess_number": "tinker_pipelines.envs.guess_number:GuessNumberEnv",
    "multiply_tools": "tinker_pipelines.envs.tool_env:MultiplyEnv",
    "race": "tinker_pipelines.envs.two_agent:RaceEnv",
}
"""Short names for the built-in environments; any `package.module:ClassName` works too."""


class EnvError(RuntimeError):
    """An environment crashed or broke its contract; the message names the environment."""


class Env(ABC):
    """One episode per instance, Gym-like.

    `reset(seed)` chooses the task (the same seed always gives the same task) and returns the
    first observation as chat messages; `step(action)` takes the assistant's reply text.
    """

    @abstractmethod
    def reset(self, seed: int | None = None) -> Observation:
        """Start the episode and return the opening messages (system and user)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the assistant's reply; return the new messages, reward and whether it is done."""

    @property
    def task_id(self) -> str:
        """Names the task chosen by `reset`; episodes of one task are grouped."""
        return str(getattr(self, "_seed", ""))


@dataclass(frozen=True)
class EnvSpec:
    """Picklable recipe for an environment: an import path plus keyword arguments."""

    path: str
    """A built-in name (see `BUILTIN_ENVS`) or `package.module:ClassName`."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to the class's constructor."""

    def resolve(self) -> type[Env]:
        """Import the class; raise `ValueError` naming the path when it is not an `Env`."""
        target = BUILTIN_ENVS.get(self.path, self.path)
        module_name, sep, attr = target.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(
                f"env.path {self.path!r} must be a built-in name ({', '.join(BUILTIN_ENVS)}) "
                "or 'package.module:ClassName'"
            )
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"env.path {self.path!r} cannot be imported: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, Env)):
            raise ValueError(f"env.path {self.path!r} is not a subclass of tinker_pipelines.envs.Env")
        return cls

    def check_kwargs(self, field: str = "env.kwargs") -> type[Env]:
        """Resolve the class and bind `kwargs` to its constructor without calling it; raise
        `ValueError` naming `field` when they do not fit. Returns the class."""
        cls = self.resolve()
        try:
            inspect.signature(cls).bind(**self.kwargs)
        except TypeError as e:
            raise ValueError(f"{field} {self.kwargs!r} do not fit the constructor of {self.path!r}: {e}") from None
        except ValueError:  # no signature to check (a builtin): calling it will tell
            pass
        return cls

    def build(self) -> Env:
        """A fresh environment instance; `ValueError` when `kwargs` do not fit the constructor (or
        the constructor refuses them with a `ValueError`), `EnvError` naming the env when the
        constructor fails in any other way."""
        cls = self.check_kwargs()
        try:
            return cls(**self.kwargs)
        except ValueError:  # how an env refuses its arguments; its message names them
            raise
        except Exception as e:
            raise EnvError(f"environment {cls.__name__} ({self.path!r}) raised in its constructor: "
                           f"{type(e).__name__}: {e}") from e


FLOAT32_MAX = 3.4028234663852886e38
"""The largest reward magnitude accepted (rewards become float32 advantages)."""


def checked_step(env: Env, action: str) -> StepResult:
    """`env.step`, with crashes and broken results reported as `EnvError` naming the env."""
    name = type(env).__name__
    try:
        result = env.step(action)
    except (Exception, SystemExit) as e:  # an env bug must not look like a policy failure, nor end the run mutely
        raise EnvError(f"environment {name} raised in step(): {type(e).__name__}: {e}") from e
    if not isinstance(result, StepResult):
        hint = " (a Gym-style tuple? return StepResult(observation, reward, done, info))" \
            if isinstance(result, tuple) else ""
        raise EnvError(f"environment {name}.step() returned {type(result).__name__} {result!r:.100}, "
                       f"not StepResult{hint}")
    r = result.reward
    if not isinstance(r, numbers.Real):  # a str, None or a tensor would fail far from here, in the loss
        raise EnvError(f"environment {name}.step() returned reward {r!r:.100} of type {type(r).__name__}; "
                       "a reward must be a float")
    if not math.isfinite(r):
        raise EnvError(f"environment {name} returned a non-finite reward {r!r}")
    if abs(r) > FLOAT32_MAX:  # trained on in float32: it would be inf there
        raise EnvError(f"environment {name} returned reward {r!r}, outside the float32 range the loss uses")
    if type(result.done).__name__ not in ("bool", "bool_"):  # a bool or a numpy bool; "no" or None would mislead
        raise EnvError(f"environment {name}.step() returned done={result.done!r:.100} of type "
                       f"{type(result.done).__name__}; done must be a bool")
    if not isinstance(result.info, dict):
        raise EnvError(f"environment {name}.step() returned info of type {type(result.info).__name__}, not a dict")
    if not isinstance(result.observation, list):
        raise EnvError(f"environment {name}.step() returned an observation of type "
                       f"{type(result.observation).__name__}, not a list of messages: {result.observation!r:.100}")
    _check_messages(env, result.observation)
    return result


def checked_reset(env: Env, seed: int | None) -> Observation:
    """`env.reset`, with crashes reported as `EnvError` naming the env."""
    try:
        obs = env.reset(seed=seed)
    except (Exception, SystemExit) as e:
        raise EnvError(f"environment {type(env).__name__} raised in reset(): {type(e).__name__}: {e}") from e
    if not isinstance(obs, list) or not obs:
        raise EnvError(f"environment {type(env).__name__}.reset() returned {type(obs).__name__} {obs!r:.100}, "
                       "expected a non-empty list of {'role': str, 'content': str} messages")
    _check_messages(env, obs)
    return obs


def _check_messages(env: Env, obs: Any) -> None:
    ok = isinstance(obs, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in obs
    )
    if not ok:
        raise EnvError(f"environment {type(env).__name__} returned a malformed observation: {obs!r:.200}")
