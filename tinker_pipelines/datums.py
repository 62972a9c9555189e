"""Turning episodes and supervised examples into `Datum`s."""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedTokenizerBase

from tinker_pipelines.algorithms.advantages import ADVANTAGES
from tinker_pipelines.models import encode_chat
from tinker_pipelines.types import Datum, Message, Trajectory, TrajectoryGroup


def trajectory_to_datum(trajectory: Trajectory, advantage: float) -> Datum:
    """One datum over the whole episode; only the policy's sampled tokens carry weight."""
    last = trajectory.turns[-1]
    tokens = list(last.prompt_tokens) + list(last.sampled_tokens)
    T = len(tokens) - 1
    weights, logprobs = [0.0] * T, [0.0] * T
    for turn in trajectory.turns:
        start = len(turn.prompt_tokens)
        if tuple(tokens[:start]) != turn.prompt_tokens:
            raise ValueError(f"episode {trajectory.task_id}: turn contexts are not token prefixes")
        for j, lp in enumerate(turn.sampled_logprobs):
            weights[start - 1 + j] = 1.0  # position t predicts token t + 1
            logprobs[start - 1 + j] = lp
    adv = [advantage * w for w in weights]
    return Datum(tuple(tokens[:-1]), tuple(tokens[1:]), tuple(weights), tuple(logprobs), tuple(adv))


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
