"""The plain-Python training loop: optional SFT warm start, then RL iterations, checkpointed
so that a killed run resumes exactly (docs/resume.md). DPO configs go to `tinker_pipelines.loops.dpo`.

The stages live in `tinker_pipelines.loops.experiment` (re-exported here for existing imports).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tinker_pipelines.algorithms.registry import get_algorithm
from tinker_pipelines.config import Config, ConfigError
from tinker_pipelines.loops.dpo import train_dpo
from tinker_pipelines.loops import run_dir
from tinker_pipelines.loops.experiment import (EVAL_SEED_OFFSET, Experiment, RolloutStats, deterministic_metrics,
                                         derived_seed, summarize_groups)
from tinker_pipelines.loops.run_dir import append_metrics

if TYPE_CHECKING:
    from tinker_pipelines.worker.client import WorkerClient

__all__ = ["EVAL_SEED_OFFSET", "Experiment", "RolloutStats", "append_metrics", "derived_seed",
           "deterministic_metrics", "summarize_groups", "train"]


def train(cfg: Config, on_iteration: Callable[[dict[str, float]], None] | None = None,
          on_sft_step: Callable[[int, dict[str, float]], None] | None = None,
          resume: bool = False, worker: "WorkerClient | str | None" = None,
          overwrite: bool = False) -> list[dict[str, float]]:
    """SFT warm start (if configured), then `training.iterations` RL iterations; with `worker`,
    the RL iterations train on that resident worker (its base must be `output_dir/sft` when
    `sft.steps` > 0, so run the warm start first).

    Writes `metrics.jsonl`, `sft/` (the warm-started model) and `checkpoints/iter_XXXXX`
    under `output_dir`; with `resume`, continues from the latest complete checkpoint there
    (made with this config, else `CheckpointError`), with every finished iteration in
    `metrics.jsonl` exactly once. A fresh run refuses a directory holding checkpoints unless
    `overwrite` (which deletes them).
    """

    if resume and overwrite:
        raise ConfigError("resume and overwrite exclude each other: resume continues the checkpoints overwrite deletes")
    if get_algorithm(cfg.algorithm.name).pairwise:  # preference pairs instead of RL iterations
        return train_dpo(cfg, on_iteration, on_sft_step, resume, overwrite)
    out = Path(cfg.output_dir)
    ckpt_dir = out / "checkpoints"
    from tinker_pipelines.training.distributed import is_main_process

    writer = is_main_process()  # under torchrun (training.deepspeed) every rank runs this loop; rank 0 writes files
    if resume:
        latest = run_dir.prepare_resume(out, cfg) if writer else run_dir.latest_complete(out)[0]
    else:
        if not overwrite:
            run_dir.check_fresh(out, base_in_use=worker is not None)
        latest = None
    if writer:  # before any model work: an output_dir that cannot be written fails here, not after training
        try:
            out.mkdir(parents=True, exist_ok=True)
            if not os.access(out, os.W_OK):
                raise PermissionError(f"[Errno 13] Permission denied: {str(out)!r}")
        except OSError as e:
            raise ConfigError(f"output_dir {out} cannot be written: {e}") from None
    if worker is not None:
        if cfg.sft.steps and not (out / "sft").is_dir():
            raise ConfigError(f"sft.steps is {cfg.sft.steps}: run the warm start without --worker first "
                              f"(it writes {out / 'sft'}), then serve that directory with `tinker-pipelines worker`")
        exp = Experiment(cfg, worker=worker, base=(out / "sft").resolve() if cfg.sft.steps else None)
    else:
        exp = Experiment(cfg)
    if overwrite and writer:  # only now: a config that fails to build its model deletes nothing
        run_dir.clear_run(out, keep_base=worker is not None)
    if exp.worker is None and cfg.sft.steps and latest is None:
        exp.sft(on_sft_step)
        if writer:
            exp.save_base(out / "sft")
    elif exp.worker is None and cfg.sft.steps:
        exp.use_base(out / "sft")
    exp.start_rl()
    if latest is not None:
        exp.resume(latest)
        if writer:
            run_dir.restore_metrics(out, exp.iteration)
    else:
        out.mkdir(parents=True, exist_ok=True)
        if writer:
            (out / run_dir.METRICS).write_text("")
        if cfg.eval.every:
            before = {"iteration": -1.0, **exp.evaluate()}
            if writer:
                append_metrics(out / "metrics.jsonl", before)
            if on_iteration:
                on_iteration(before)
    history = []
    for it in range(exp.iteration, cfg.training.iterations):
        metrics = exp.run_iteration(it)
        exp.save(ckpt_dir / f"iter_{it:05d}", metrics)  # collective under DeepSpeed: rank 0 writes
        if writer:
            append_metrics(out / "metrics.jsonl", metrics)
        history.append(metrics)
        if on_iteration:
            on_iteration(metrics)
    return history
