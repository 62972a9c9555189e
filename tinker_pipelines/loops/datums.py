"""Turning episodes and supervised examples into `Datum`s."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import PreTrainedTokenizerBase

from tinker_pipelines.algorithms.advantages import ADVANTAGES
from tinker_pipelines.algorithms.gae import gae_over_weighted, token_rewards, whiten
from tinker_pipelines.models import encode_chat
from tinker_pipelines.types import CriticDatum, Datum, Message, Trajectory, TrajectoryGroup


def trajectory_to_datum(trajectory: Trajectory, advantage: float) -> Datum:
    """One datum over the whole episode; only the policy's sampled tokens carry weight."""
    last = trajectory.turns[-1]
    tokens = list(last.prompt_tokens) + list(last.sampled_tokens)
    T = len(tokens) - 1
    weights, logprobs, support = [0.0] * T, [0.0] * T, [0] * T
    for turn in trajectory.turns:
        start = len(turn.prompt_tokens)
        if tuple(tokens[:start]) != turn.prompt_tokens:
            raise ValueError(f"episode {trajectory.task_id}: turn contexts are not token prefixes")
        for j, lp in enumerate(turn.sampled_logprobs):
            weights[start - 1 + j] = 1.0  # position t predicts token t + 1
            logprobs[start - 1 + j] = lp
        for j, n in enumerate(turn.sampled_support):
            support[start - 1 + j] = n
    adv = [advantage * w for w in weights]
    return Datum(tuple(tokens[:-1]), tuple(tokens[1:]), tuple(weights), tuple(logprobs), tuple(adv),
                 tuple(support) if any(support) else ())


def _turn_ends(trajectory: Trajectory) -> list[int]:
    """Datum position of each turn's last sampled token (a turn that sampled nothing ends where
    the previous one did, so its reward still lands on an action)."""
    ends, last = [], -1
    for turn in trajectory.turns:
        if turn.sampled_tokens:
            last = len(turn.prompt_tokens) - 1 + len(turn.sampled_tokens) - 1
        ends.append(last)
    first = next((e for e in ends if e >= 0), -1)
    return [e if e >= 0 else first for e in ends]


ValuesFn = Callable[[list[Datum]], list[list[float]]]
"""The critic: per-position values of each datum (e.g. `Learner.compute_values`)."""


def with_reference_logprobs(datums: list[Datum], reference_fn: ValuesFn) -> list[Datum]:
    """`datums` carrying the reference policy's logprobs of their targets (`Datum.reference_logprobs`,
    from `reference_fn`, e.g. `Learner.compute_reference_logprobs`), so that every later pass over
    them skips the reference forward."""
    refs = reference_fn(datums)
    return [dataclasses.replace(d, reference_logprobs=tuple(r)) for d, r in zip(datums, refs)]


TERMINATED = "done"
"""`Trajectory.stop_reason` of an episode the environment ended. Any other ('max_turns',
'context_overflow') was cut by the runner: truncated, its future value is not 0. A turn cut at
max_new_tokens is still an action the environment judges: it is truncated only if the episode
then stops without the environment's `done`."""


def bootstrap_datum(datum: Datum) -> Datum:
    """`datum` with one more position, whose input is its last target (the last sampled token):
    the value head's output there is V(s_T), the value of the state the episode was cut in.

    >>> bootstrap_datum(Datum((1, 2), (2, 3), (0.0, 1.0))).input_tokens
    (1, 2, 3)
    """
    extra = (0.0,) if datum.behaviour_logprobs else ()
    return Datum(datum.input_tokens + datum.target_tokens[-1:], datum.target_tokens + datum.target_tokens[-1:],
                 datum.weights + (0.0,), datum.behaviour_logprobs + extra, datum.advantages + extra,
                 datum.support_sizes + (0,) if datum.support_sizes else ())


def critic_datums(groups: list[TrajectoryGroup], values_fn: ValuesFn, gamma: float, lam: float,
                  whiten_advantages: bool = True) -> list[CriticDatum]:
    """PPO datums for every episode: per-token rewards, the critic's values, GAE advantages and
    returns. No group baseline is used, so every group teaches (uniform rewards included).
    A terminated episode's last action bootstraps from 0; a truncated one's from the critic's
    value of the state after its last sampled token (one extra position in the values pass)."""
    trajs = [t for g in groups for t in g.trajectories]
    for t in trajs:
        if not all(math.isfinite(r) for r in (t.final_reward, *(x.reward for x in t.turns))):
            raise ValueError(f"non-finite reward in task {t.task_id}: {t.total_reward}")
    plain = [trajectory_to_datum(t, 0.0) for t in trajs]
    if not plain:
        return []
    truncated = [t.stop_reason != TERMINATED for t in trajs]
    values = values_fn([bootstrap_datum(d) if cut else d for d, cut in zip(plain, truncated)])
    bootstraps = [v[len(d.input_tokens)] if cut else 0.0 for d, v, cut in zip(plain, values, truncated)]
    values = [v[:len(d.input_tokens)] for d, v in zip(plain, values)]
    rewards = [token_rewards(list(d.weights), _turn_ends(t), [x.reward for x in t.turns], t.final_reward)
               for d, t in zip(plain, trajs)]
    weights_T = [torch.tensor(d.weights, dtype=torch.float64) for d in plain]
    scored = [gae_over_weighted(torch.tensor(r, dtype=torch.float64), torch.tensor(v, dtype=torch.float64) * (w != 0),
                                w, gamma, lam, bootstrap)
              for r, v, w, bootstrap in zip(rewards, values, weights_T, bootstraps)]
    advs = [a for a, _ in scored]
    if whiten_advantages:
        advs = whiten(advs, weights_T)
    return [CriticDatum(d.input_tokens, d.target_tokens, d.weights, d.behaviour_logprobs, tuple(a.tolist()),
                        d.support_sizes, rewards=tuple(r),
                        old_values=tuple((torch.tensor(v, dtype=torch.float64) * (w != 0)).tolist()),
                        returns=tuple(ret.tolist()))
            for d, a, r, v, w, (_, ret) in zip(plain, advs, rewards, values, weights_T, scored)]


def group_advantages(groups: list[TrajectoryGroup], estimator: str) -> list[list[float]]:
    """Per-episode advantages for each group; raises on a non-finite reward."""
    out = []
    for group in groups:
        rewards = group.rewards
        if not all(math.isfinite(r) for r in rewards):
            raise ValueError(f"non-finite reward in task {group.trajectories[0].task_id}: {rewards}")
        out.append(ADVANTAGES[estimator](torch.tensor(rewards, dtype=torch.float64)).tolist())
    return out


def rl_datums(groups: list[TrajectoryGroup], estimator: str, skip_uniform: bool = True) -> list[Datum]:
    """Datums for every episode; groups whose rewards are all equal teach nothing and are skipped."""
    if estimator not in ADVANTAGES:
        raise ValueError(f"advantage estimator {estimator!r} is not a group estimator ({', '.join(ADVANTAGES)}); "
                         "value-head algorithms (ppo) score with `critic_datums`")
    datums = []
    for group, advs in zip(groups, group_advantages(groups, estimator)):
        if skip_uniform and len(set(group.rewards)) == 1:
            continue
        datums += [trajectory_to_datum(t, a) for t, a in zip(group.trajectories, advs)]
    return datums


def sft_datum(tokenizer: PreTrainedTokenizerBase, messages: list[Message], completion: str) -> Datum:
    """Cross-entropy datum: the prompt has weight 0, the completion and end of turn weight 1."""
    prompt = encode_chat(tokenizer, messages, add_generation_prompt=True)
    reply = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = prompt + reply
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(reply)
    return Datum(tuple(tokens[:-1]), tuple(tokens[1:]), tuple(weights))
