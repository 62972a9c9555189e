"""Batch inference: generate for a task set with a trained policy and score it with the env's rewards.

The same function runs in a notebook, the CLI and the Dagster `inference` job:

    exp = experiment_from_checkpoint("runs/x/iter_00002")        # or Experiment(cfg, worker=...)
    result = run_inference(exp, InferenceConfig(num_tasks=100))
    result.summary["success_rate"], result.records[0]["completion"]

Generation goes through the rollout code (`run_episodes`) with the experiment's sampler, so an
experiment bound to a resident worker samples there and one in-process samples here, with the
same tokens. With the defaults (held-out split, greedy, one sample per task) the episodes are
exactly those of `Experiment.evaluate(num_tasks)`.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tinker_pipelines.checkpoint import read_record
from tinker_pipelines.config import ConfigError, config_from_dict
from tinker_pipelines.rollout.episodes import run_episodes
from tinker_pipelines.loops.experiment import EVAL_SEED_OFFSET, Experiment, derived_seed
from tinker_pipelines.types import Trajectory

SPLITS = ("eval", "train")


@dataclass(frozen=True)
class InferenceConfig:
    """The task set and how it is sampled."""

    num_tasks: int = 32
    """Tasks to generate for (task seeds seed_offset .. seed_offset + num_tasks - 1 of the split)."""
    split: str = "eval"
    """'eval': held-out tasks (the env's eval_kwargs, the seeds Experiment.evaluate uses); 'train': training tasks."""
    seed_offset: int = 0
    """Index of the first task within the split."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    max_new_tokens: int = 0
    """Tokens the policy may produce per turn; 0 = the experiment's training.max_new_tokens."""
    samples_per_task: int = 1
    """Episodes per task (more than one is useful with temperature > 0)."""
    seed: int = 0
    """Seed of the sampling generator (used when temperature > 0)."""

    def validate(self) -> "InferenceConfig":
        """Raise `ConfigError` (a ValueError) naming the first bad field; returns self."""
        checks = [
            (self.num_tasks >= 1, "num_tasks", "must be >= 1", self.num_tasks),
            (self.split in SPLITS, "split", f"must be one of {SPLITS}", self.split),
            (self.seed_offset >= 0, "seed_offset", "must be >= 0", self.seed_offset),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
             "must be >= 0 (0 is greedy)", self.temperature),
            (self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0 (0: the experiment's)", self.max_new_tokens),
            (self.samples_per_task >= 1, "samples_per_task", "must be >= 1", self.samples_per_task),
        ]
        for ok, name, what, value in checks:
            if not ok:
                raise ConfigError(f"inference.{name} {what}, got {value!r}")
        return self


@dataclass(frozen=True)
class InferenceResult:
    """What `run_inference` returns."""

    records: list[dict[str, Any]]
    """One JSON-serializable dict per episode (task-major: the samples of task 0 first)."""
    summary: dict[str, float]
    """success_rate, pass_rate, reward_mean, reward_std, sampled_tokens, episodes, tasks, wall_s, tokens_per_s."""


def parse_model_ref(ref: str) -> tuple[str, str]:
    """(registered model, version) from `NAME@ALIAS`, `NAME/VERSION` or `NAME` (version '' = the latest).

    >>> parse_model_ref("tinker-qs@champion"), parse_model_ref("tinker-qs/3"), parse_model_ref("tinker-qs")
    (('tinker-qs', 'champion'), ('tinker-qs', '3'), ('tinker-qs', ''))
    """
    ref = ref.strip()
    if "@" in ref:
        name, _, version = ref.rpartition("@")
    elif "/" in ref:
        name, _, version = ref.rpartition("/")
        if not version.isdigit():
            raise ConfigError(f"model must be NAME@ALIAS, NAME/VERSION (a number) or NAME, got {ref!r}")
    else:
        name, version = ref, ""
    if not name or ("@" in ref and not version):
        raise ConfigError(f"model must be NAME@ALIAS, NAME/VERSION (a number) or NAME, got {ref!r}")
    return name, version


def success(traj: Trajectory) -> bool:
    """Whether an episode solved its task: the env's `info['exact']` when it reports one
    (arithmetic, tools, guess-number, the two-agent game), else a positive total reward."""
    if "exact" in traj.info:
        return bool(traj.info["exact"])
    return traj.total_reward > 0


def _json_safe(info: dict[str, Any]) -> dict[str, Any]:
    # env info is free-form; the records must stay one JSON line each
    return json.loads(json.dumps(info, default=str))


def run_inference(exp: Experiment, cfg: InferenceConfig) -> InferenceResult:
    """Generate for `cfg`'s task set with `exp`'s current policy, score with the env's rewards.

    `success_rate` is the fraction of episodes that solved their task (`success`), `pass_rate`
    the fraction of tasks solved by at least one of their samples (the same with one sample).
    """
    cfg.validate()  # before any model work
    evaluation = cfg.split == "eval"
    spec = exp.eval_spec if evaluation else exp.env_spec
    base_seed = (EVAL_SEED_OFFSET if evaluation else 0) + cfg.seed_offset
    task_seeds = [base_seed + i for i in range(cfg.num_tasks)]
    seeds = [s for s in task_seeds for _ in range(cfg.samples_per_task)]
    ro = exp.rollout_cfg
    # the experiment's truncation and stop strings, at this job's temperature and length
    rollout_cfg = replace(ro, max_new_tokens=cfg.max_new_tokens or ro.max_new_tokens, temperature=cfg.temperature)
    # greedy decoding draws no uniforms; a generator only when sampling, seeded from the config alone
    gen = torch.Generator().manual_seed(derived_seed(cfg.seed, "inference")) if cfg.temperature > 0 else None
    start = time.perf_counter()
    trajs = run_episodes(exp.sampler(), exp.tokenizer, [spec.build() for _ in seeds], seeds, rollout_cfg, gen)
    wall_s = time.perf_counter() - start

    records = []
    for i, (seed, traj) in enumerate(zip(seeds, trajs, strict=True)):
        records.append({
            "task": i // cfg.samples_per_task, "sample": i % cfg.samples_per_task, "seed": seed,
            "task_id": traj.task_id,
            "prompt": exp.tokenizer.decode(list(traj.turns[0].prompt_tokens), skip_special_tokens=False),
            "completion": traj.turns[-1].action_text, "actions": [t.action_text for t in traj.turns],
            "reward": traj.total_reward, "success": success(traj), "tokens": traj.num_sampled_tokens,
            "prompt_tokens": len(traj.turns[0].prompt_tokens), "stop_reason": traj.stop_reason,
            "info": _json_safe(traj.info)})
    rewards = [r["reward"] for r in records]
    tokens = sum(r["tokens"] for r in records)
    solved = {r["task"] for r in records if r["success"]}
    summary = {
        "success_rate": statistics.fmean(float(r["success"]) for r in records),
        "pass_rate": len(solved) / cfg.num_tasks,
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "sampled_tokens": float(tokens), "episodes": float(len(records)), "tasks": float(cfg.num_tasks),
        "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0}
    return InferenceResult(records, summary)


def experiment_from_checkpoint(path: str | Path, base: str | Path | None = None, worker: str | None = None,
                               name: str | None = None) -> Experiment:
    """The policy a checkpoint directory (`Experiment.save`'s, or a downloaded registry version)
    holds, rebuilt from its record's config: in-process, or as adapter `name` on the resident
    `worker`. `base` is the warm-started base directory, required when the record says
    `sft.steps > 0` (the checkpoint holds only the adapter trained on top of it)."""
    cfg = config_from_dict(read_record(path)["config"])
    if cfg.sft.steps and base is None:
        raise ConfigError(f"the checkpoint at {path} was trained on an SFT warm start (sft.steps is "
                          f"{cfg.sft.steps}): pass its base directory")
    base = Path(base).resolve() if cfg.sft.steps else None
    if worker is not None:
        exp = Experiment(cfg, worker=worker, name=name, base=base)
    else:
        exp = Experiment(cfg, name=name)
        if base is not None:  # the warm-started weights replace the catalogue base, as on resume
            exp.use_base(base)
    exp.start_rl()
    exp.resume(path)
    return exp
