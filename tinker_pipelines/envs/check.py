"""`check_env(env)`: does an environment keep the `Env` contract? Like Gymnasium's checker.

Run it on every new environment (the tests run it on every built-in). It plays short episodes
with probe replies (a number, prose, an empty reply, garbage, a malformed and a well-formed tool
call, ...) plus any `actions` you pass, and checks that:

- `reset(seed)` returns a non-empty list of chat messages ({'role': str, 'content': str}, known
  roles, ending with a message the assistant answers), and `task_id` is a string;
- the same seed gives the same observation and task, on the same instance and on a fresh copy;
  replaying the same replies gives the same step results (the env's randomness is seeded);
- `step` returns a `StepResult` with a finite float reward (not bool, not a tensor), a bool
  `done`, a dict `info`, and well-formed messages; a step that is not the last gives the agent a
  message to answer;
- no reply the model could write makes `step` raise (an env bug would look like a policy failure);
- `step` after the episode ended raises or returns `done=True` (it must not quietly go on);
- optionally, with a `tokenizer`, every conversation renders with its chat template as growing
  prefixes, which token-exact multi-turn rollouts need.

Problems raise `EnvCheckError` naming the env and the check; softer issues (an env that never
ends on its own, identical tasks for different seeds, a reward after the end, an env that cannot
be pickled for other processes) are reported with `warnings.warn` and returned.
"""

from __future__ import annotations

import copy
import math
import numbers
import pickle
import warnings
from typing import Any

from tinker_pipelines.envs.base import Env, EnvError
from tinker_pipelines.types import StepResult

ROLES = ("system", "user", "assistant", "tool")
"""Roles an observation may use."""

PROBE_ACTIONS = (
    "1", "42", "2", "3", "The answer is 7.", "", "   ", "-1", "1e309", "nan", "\x00\ufffd\U0001F600",
    "9" * 400, "<tool_call>{not json</tool_call>", "<tool_call>{\"name\": \"calculator\"",
    '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>',
)
"""Replies `check_env` plays: plausible, degenerate and adversarial."""


class EnvCheckError(EnvError):
    """An environment breaks the `Env` contract; the message names it and the check."""


def _fail(env: Env, what: str) -> EnvCheckError:
    return EnvCheckError(f"check_env({type(env).__name__}): {what}")


def _check_messages(env: Env, obs: Any, where: str, allow_empty: bool) -> None:
    if not isinstance(obs, list):
        raise _fail(env, f"{where} returned {type(obs).__name__}, expected a list of messages")
    if not obs and not allow_empty:
        raise _fail(env, f"{where} returned no messages")
    for m in obs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _fail(env, f"{where} returned a malformed message {m!r:.200}; expected "
                             "{'role': str, 'content': str}")
        if m["role"] not in ROLES:
            raise _fail(env, f"{where} returned a message with role {m['role']!r}, not one of {ROLES}")


def _check_result(env: Env, result: Any, where: str) -> StepResult:
    if not isinstance(result, StepResult):
        raise _fail(env, f"{where} returned {type(result).__name__}, not StepResult")
    r = result.reward
    if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(float(r)):
        raise _fail(env, f"{where} returned reward {r!r} ({type(r).__name__}); rewards must be finite floats")
    if not isinstance(result.done, bool):
        raise _fail(env, f"{where} returned done={result.done!r} ({type(result.done).__name__}), not a bool")
    if not isinstance(result.info, dict):
        raise _fail(env, f"{where} returned info of type {type(result.info).__name__}, not dict")
    _check_messages(env, result.observation, where, allow_empty=True)
    if not result.done and not result.observation:
        raise _fail(env, f"{where} did not end the episode but gave the agent no message to answer")
    return result


def _reset(env: Env, seed: int) -> list:
    try:
        obs = env.reset(seed=seed)
    except Exception as e:
        raise _fail(env, f"reset(seed={seed}) raised {type(e).__name__}: {e}") from e
    _check_messages(env, obs, f"reset(seed={seed})", allow_empty=False)
    if obs[-1]["role"] == "assistant":
        raise _fail(env, f"reset(seed={seed}) ends with an assistant message; the agent has nothing to answer")
    if not isinstance(env.task_id, str):
        raise _fail(env, f"task_id is {type(env.task_id).__name__}, not str")
    return obs


def _comparable(result: StepResult) -> tuple:
    return (result.observation, float(result.reward), result.done, repr(sorted(result.info.items(), key=str)))


def _play(env: Env, seed: int, actions: list[str], max_steps: int, tokenizer: Any, warn: Any) -> list[tuple]:
    """Reset with `seed` and play `actions` in a cycle until done or `max_steps`; the trace."""
    messages = list(_reset(env, seed))
    trace: list[tuple] = [("reset", repr(messages))]
    for i in range(max_steps):
        action = actions[i % len(actions)]
        where = f"step({action[:40]!r}) (seed {seed}, step {i})"
        try:
            result = env.step(action)
        except Exception as e:
            raise _fail(env, f"{where} raised {type(e).__name__}: {e}; an env must turn any reply "
                             "into an observation or a reward, never an exception") from e
        _check_result(env, result, where)
        trace.append(_comparable(result))
        if tokenizer is not None:
            _check_rendering(env, tokenizer, messages, action, result.observation, where)
        messages += [{"role": "assistant", "content": action}, *result.observation]
        if result.done:
            _check_after_done(env, where, action, warn)
            return trace
    trace.append(("not done",))
    return trace


def _check_after_done(env: Env, where: str, last_action: str, warn: Any) -> None:
    for action in dict.fromkeys((last_action, "1", "7", "")):
        try:
            after = env.step(action)
        except Exception:
            continue  # raising is a fine way to refuse
        if not isinstance(after, StepResult) or not after.done:
            raise _fail(env, f"step({action[:40]!r}) after the episode ended (after {where}) did not raise "
                             "and did not return done=True: the episode silently went on")
        if after.reward:
            warn(f"step() after the end returned reward {after.reward}")


def _check_rendering(env: Env, tokenizer: Any, messages: list, action: str, new: list, where: str) -> None:
    from tinker_pipelines.models import render_chat

    with_reply = messages + [{"role": "assistant", "content": action}]
    try:
        prompt = render_chat(tokenizer, messages, add_generation_prompt=True)
        reply = render_chat(tokenizer, with_reply, add_generation_prompt=False)
        full = render_chat(tokenizer, with_reply + list(new), add_generation_prompt=True)
    except Exception as e:
        raise _fail(env, f"the chat template cannot render the conversation after {where}: {e}") from e
    if not (reply.startswith(prompt) and full.startswith(reply)):
        raise _fail(env, f"the chat template does not render the conversation after {where} as growing prefixes")
    for m in new:
        if m["content"] and m["content"] not in full:
            raise _fail(env, f"the chat template drops a {m['role']!r} message after {where}")


def check_env(env: Env, seeds: tuple[int, ...] = (0, 1, 2), actions: list[str] | None = None,
              max_steps: int = 20, tokenizer: Any = None) -> list[str]:
    """Check `env` against the `Env` contract; raises `EnvCheckError`, returns the warnings.

    `actions`: good replies for this env (played first, so episodes get past the first turn);
    `tokenizer`: also check that its chat template renders every conversation.
    """
    if not isinstance(env, Env):
        raise EnvCheckError(f"check_env: {type(env).__name__} is not a subclass of tinker_pipelines.envs.Env")
    found: list[str] = []

    def warn(msg: str) -> None:
        if msg not in found:
            found.append(msg)
            warnings.warn(f"check_env({type(env).__name__}): {msg}", stacklevel=3)

    fresh = copy.deepcopy(env)
    try:
        pickle.dumps(env)
    except Exception as e:
        warn(f"the env cannot be pickled ({type(e).__name__}: {e}); build it from an EnvSpec in other processes")
    try:
        env.step("1")
    except Exception:
        pass
    else:
        warn("step() before reset() did not raise")

    first = [_reset(env, s) for s in seeds]
    for s, obs in zip(seeds, first):
        if _reset(env, s) != obs:
            raise _fail(env, f"reset(seed={s}) twice gave different observations; seed the env's randomness")
    if _reset(fresh, seeds[0]) != first[0]:
        raise _fail(env, f"reset(seed={seeds[0]}) differs between two instances; the env depends on hidden state")
    task_ids = set()
    for s in seeds:
        _reset(env, s)
        task_ids.add(env.task_id)
    if len(seeds) > 1 and len({repr(o) for o in first}) == 1 and len(task_ids) == 1:
        warn(f"seeds {list(seeds)} all give the same task")

    plans = ([list(actions)] if actions else []) + [[a] for a in PROBE_ACTIONS]
    ended = False
    for plan in plans:
        for s in seeds[:1] if plan is not plans[0] else seeds:
            trace = _play(env, s, plan, max_steps, tokenizer, warn)
            ended |= trace[-1] != ("not done",)
            if plan is plans[0] and _play(env, s, plan, max_steps, None, warn) != trace:
                raise _fail(env, f"replaying the same replies after reset(seed={s}) gave different results; "
                                 "seed the env's randomness from the reset seed")
    if not ended:
        warn(f"no probe episode ended within {max_steps} steps; the env relies on the runner's max_turns")
    return found
