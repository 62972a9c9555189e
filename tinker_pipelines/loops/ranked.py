"""One full-parameter RL iteration on every rank of a ranked step (`scheduler.ranks.run`'s target).

`full_iteration` builds the experiment (DeepSpeed ZeRO as `training.deepspeed` says), warm-starts it
(`sft.steps`) or resumes a checkpoint if given, samples the iteration's rollout split across the ranks and gathered
(`Experiment._split_rollout`), takes the training step on the whole batch and saves (rank 0
writes). With one process (no torchrun) it is the same iteration on one rank.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tinker_pipelines.config import config_from_dict
from tinker_pipelines.loops.experiment import Experiment, deterministic_metrics


def full_iteration(payload: dict[str, Any]) -> dict[str, Any]:
    """payload: {config, iteration, resume (checkpoint or None), save (directory or None)}. Returns
    (the same on every rank) the rollout's sampled tokens and logprobs per group and episode, the
    training metrics, what each rank sampled and on which device, and the saved record's hash."""
    cfg = config_from_dict(payload["config"])
    if cfg.training.deepspeed.stage == 0:
        raise ValueError("a ranked full-parameter step needs training.deepspeed.stage 2 or 3, got 0")
    exp = Experiment(cfg)
    if cfg.sft.steps and not payload.get("resume"):  # every rank warm-starts alike (same seed, same data)
        exp.sft()
    exp.start_rl()
    if payload.get("resume"):
        exp.resume(payload["resume"])
    iteration = int(payload.get("iteration", exp.iteration))
    ro = exp.rollout(iteration)
    metrics = {"iteration": float(iteration), **ro.metrics, **exp.train_step(ro.groups)}
    exp.iteration = iteration + 1
    record = exp.save(payload["save"], metrics) if payload.get("save") else None
    mine = {**(exp.rollout_share or {}), "device": os.environ.get("TINKER_RANK_DEVICE"),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    shares: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shares, mine)
    return {"groups": [[[(list(turn.sampled_tokens), list(turn.sampled_logprobs)) for turn in t.turns]
                        for t in g.trajectories] for g in ro.groups],
            "metrics": deterministic_metrics(metrics), "shares": shares,
            "content_hash": record["content_hash"] if record else None}
