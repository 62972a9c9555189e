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

from tinker_pipelines.config import Config, config_from_dict
from tinker_pipelines.loops.experiment import Experiment, deterministic_metrics
from tinker_pipelines.tracking import codec

RL_STAGES = ("rollout", "score", "train", "evaluate")
"""The stages of one RL iteration that `rl_stage` runs on every rank."""


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


def experiment_at(cfg: Config, at: int, resume: str | None, base: str | None) -> Experiment:
    """The experiment positioned at iteration `at`, as `resources.policy_engine` loads one in-process:
    the warm-started `base` (when `sft.steps`), the learner, then iteration at-1's checkpoint `resume`."""
    exp = Experiment(cfg)
    if base is not None:
        exp.use_base(base)
    exp.start_rl()
    if at > 0:
        if resume is None:
            raise RuntimeError(f"iteration {at} needs the checkpoint of iteration {at - 1}, which was not found")
        exp.resume(resume)
        if exp.iteration != at:
            raise RuntimeError(f"checkpoint {resume} is at iteration {exp.iteration}, expected {at}")
    return exp


def rl_stage(payload: dict[str, Any]) -> dict[str, Any]:
    """payload: {config, stage (one of `RL_STAGES`), at, resume (checkpoint of at-1 or None), base (the
    warm start or None), inputs (`codec` text of {groups, datums, metrics} or None), save (directory,
    train only)}. Returns rank 0's view: `exp` (this rank's experiment, for checks after the call) and
    the stage's result: rollout: `rollout` (`RolloutStats`, every rank's groups gathered) and `shares`
    (each rank's rows and device); score: `datums`; train: `metrics`, `record`; evaluate: `metrics`."""
    stage = payload["stage"]
    if stage not in RL_STAGES:
        raise ValueError(f"stage must be one of {', '.join(RL_STAGES)}, got {stage!r}")
    cfg = config_from_dict(payload["config"])
    at = int(payload["at"])
    exp = experiment_at(cfg, at, payload.get("resume"), payload.get("base"))
    inputs = codec.decode(payload["inputs"].encode()) if payload.get("inputs") else {}
    if stage == "rollout":
        ro = exp.rollout(at)
        mine = {**(exp.rollout_share or {}), "device": os.environ.get("TINKER_RANK_DEVICE")}
        shares: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(shares, mine)
        return {"exp": exp, "rollout": ro, "shares": shares}
    if stage == "score":
        return {"exp": exp, "datums": exp.score(inputs["groups"])}
    if stage == "evaluate":
        return {"exp": exp, "metrics": exp.evaluate()}
    metrics = {"iteration": float(at), **inputs["metrics"], **exp.train_step(inputs["groups"], inputs["datums"])}
    exp.iteration = at + 1
    return {"exp": exp, "metrics": metrics, "record": exp.save(payload["save"], metrics)}
