"""Preference pairs from scored rollouts: DPO data for any environment with a reward.

Sample G replies per task from the current policy, score them with the environment's reward,
and keep the tasks whose best and worst replies differ: chosen = a best episode, rejected = a
worst one. Both are the sampled trajectories themselves, so the training tokens are exactly the
tokens the policy produced (never re-tokenized from text), multi-turn episodes included.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from tinker_pipelines.loops.datums import trajectory_to_datum
from tinker_pipelines.envs.base import EnvSpec
from tinker_pipelines.rollout.episodes import RolloutConfig, run_groups
from tinker_pipelines.rollout.sampler import Sampler
from tinker_pipelines.types import Datum, PreferencePair, Trajectory, TrajectoryGroup

TASK_SEED_RANGE = 10_000_000
"""Training task seeds are drawn below this (evaluation uses seeds from it upward)."""


def pairs_from_groups(groups: list[TrajectoryGroup]) -> list[PreferencePair]:
    """One pair per group whose rewards are not all equal: (first best, first worst)."""
    pairs = []
    for group in groups:
        rewards = group.rewards
        hi, lo = max(rewards), min(rewards)
        if hi == lo:  # no preference to learn from this task
            continue
        trajs = group.trajectories
        pairs.append(PreferencePair(trajs[0].task_id, trajs[rewards.index(hi)], trajs[rewards.index(lo)]))
    return pairs


def generate_pairs(sampler: Sampler, tokenizer: PreTrainedTokenizerBase, env_spec: EnvSpec, num_pairs: int,
                   group_size: int, rollout_cfg: RolloutConfig, seed: int,
                   max_rounds: int = 8) -> tuple[list[PreferencePair], int]:
    """Up to `num_pairs` pairs and the number of tasks sampled to find them.

    Each round samples `num_pairs` fresh task seeds x `group_size` replies in one batch and keeps
    the informative groups; rounds continue until there are enough pairs or `max_rounds` ran.
    Deterministic given `seed` (task seeds and sampling both derive from it).
    """
    if num_pairs < 1 or group_size < 2:
        raise ValueError(f"dpo.pairs must be >= 1 and dpo.group_size >= 2, got {num_pairs} and {group_size}")
    task_rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed % 2**63)
    pairs: list[PreferencePair] = []
    tasks = 0
    for _ in range(max_rounds):
        seeds = [task_rng.randrange(TASK_SEED_RANGE) for _ in range(num_pairs)]
        groups = run_groups(sampler, tokenizer, env_spec, seeds, group_size, rollout_cfg, generator)
        tasks += len(seeds)
        pairs += pairs_from_groups(groups)
        if len(pairs) >= num_pairs:
            break
    return pairs[:num_pairs], tasks


def pair_datums(pairs: list[PreferencePair]) -> list[Datum]:
    """Datums in the order pairwise losses read them: chosen at 2i, rejected at 2i + 1.

    Only the policy's sampled tokens carry weight; advantages are unused (zero).
    """
    return [trajectory_to_datum(t, 0.0) for p in pairs for t in (p.chosen, p.rejected)]


def summarize_pairs(pairs: list[PreferencePair]) -> dict[str, float]:
    """Counts and reward statistics of a pair set (for metadata and logs)."""
    if not pairs:
        return {"pairs": 0.0}
    return {"pairs": float(len(pairs)),
            "reward_gap_mean": statistics.fmean(p.reward_gap for p in pairs),
            "chosen_reward_mean": statistics.fmean(p.chosen.total_reward for p in pairs),
            "rejected_reward_mean": statistics.fmean(p.rejected.total_reward for p in pairs),
            "chosen_tokens_mean": statistics.fmean(p.chosen.num_sampled_tokens for p in pairs),
            "rejected_tokens_mean": statistics.fmean(p.rejected.num_sampled_tokens for p in pairs)}
