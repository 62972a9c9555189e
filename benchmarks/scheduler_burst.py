"""The real part of `benchmarks.scheduler`, what it submits: the burst of runs (kinds in MIX's
proportions, their run configs on the tiny model, and the submission order `plan`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

KINDS_REAL = ("lora_rl", "full_rl", "sft", "inference")
MIX = {"lora_rl": 8, "full_rl": 4, "sft": 4, "inference": 4}
"""Runs of each kind in a burst of 20 (other sizes keep the proportions)."""
ITERATIONS = 2
"""Iterations per RL experiment: iteration 1 waits in the queue for iteration 0 (one run per experiment)."""
ENV = {"path": "arithmetic", "kwargs": {"max_operand": 5}}
MODEL = {"name": "tiny", "seed": 0}


def rl_settings(seed: int, mode: str) -> dict[str, Any]:
    return {"seed": seed, "model": MODEL, "env": ENV, "algorithm": {"name": "grpo", "kl_coef": 0.02},
            "training": {"mode": mode, "iterations": ITERATIONS, "learning_rate": 5e-3, "groups_per_batch": 8,
                         "group_size": 4, "max_new_tokens": 8},
            "eval": {"every": ITERATIONS, "num_tasks": 16}, "auto_continue": False}


def sft_settings(seed: int) -> dict[str, Any]:
    return {"seed": seed, "model": MODEL, "env": ENV,
            "training": {"mode": "full", "iterations": 1, "groups_per_batch": 2, "group_size": 2, "max_new_tokens": 4},
            "sft": {"steps": 30, "batch_size": 16, "examples": 128, "learning_rate": 3e-3},
            "eval": {"every": 1, "num_tasks": 4}}


INFERENCE = {"num_tasks": 32, "samples_per_task": 2, "temperature": 1.0}


@dataclass(frozen=True)
class RunSpec:
    """One run of the burst."""

    kind: str
    job: str
    partition: str | None
    """`dagster/partition` tag (None: unpartitioned, the inference job)."""
    config: dict[str, Any]
    """Run config without the executor section."""
    experiment: str | None = None
    """`tinker/experiment` tag set at submission (the coordinator derives it from the partition otherwise)."""


def counts(runs: int, kinds: tuple[str, ...] = KINDS_REAL) -> dict[str, int]:
    """Runs per kind for a burst of `runs`, in MIX's proportions (largest remainder; an inference run
    needs a lora_rl run before it, so inference never outnumbers lora_rl experiments)."""
    total = sum(MIX[k] for k in kinds)
    exact = {k: runs * MIX[k] / total for k in kinds}
    out = {k: int(v) for k, v in exact.items()}
    for k in sorted(kinds, key=lambda k: (-(exact[k] - out[k]), kinds.index(k)))[:runs - sum(out.values())]:
        out[k] += 1
    if "inference" in out and "lora_rl" in out:
        extra = out["inference"] - math.ceil(out["lora_rl"] / ITERATIONS)
        if extra > 0:
            out["inference"] -= extra
            out["lora_rl"] += extra
    return out


def plan(runs: int, kinds: tuple[str, ...] = KINDS_REAL) -> list[RunSpec]:
    """The burst in submission order: the iteration-0 runs of every kind interleaved, each inference
    run right after the iteration it reads, then the later iterations."""
    n = counts(runs, kinds)
    waves: list[list[RunSpec]] = [[] for _ in range(ITERATIONS)]
    per_wave: dict[str, list[list[RunSpec]]] = {k: [[] for _ in range(ITERATIONS)] for k in kinds}
    for kind, mode, prefix in (("lora_rl", "lora", "lora"), ("full_rl", "full", "full")):
        if kind not in n:
            continue
        left, e = n[kind], 0
        while left > 0:
            name = f"{prefix}{e}"
            for it in range(min(ITERATIONS, left)):
                cfg = {"ops": {"rollout_batch": {"config": rl_settings(100 + e, mode)}}}
                per_wave[kind][it].append(RunSpec(kind, "rl", f"{name}:{it}", cfg))
            left -= min(ITERATIONS, left)
            e += 1
    for i in range(n.get("sft", 0)):
        cfg = {"ops": {"sft_checkpoint": {"config": sft_settings(200 + i)}}}
        per_wave["sft"][0].append(RunSpec("sft", "sft", f"sft{i}", cfg))
    for i in range(n.get("inference", 0)):
        cfg = {"ops": {"inference_results": {"config": {"model": f"tinker-lora{i}/1", **INFERENCE}}}}
        per_wave["inference"][0].append(RunSpec("inference", "inference", None, cfg, experiment=f"lora{i}"))
    for it in range(ITERATIONS):
        lanes = [per_wave[k][it] for k in kinds if k != "inference"]
        inference = list(per_wave["inference"][it]) if "inference" in per_wave else []
        for j in range(max((len(lane) for lane in lanes), default=0)):
            for lane in lanes:
                if j < len(lane):
                    waves[it].append(lane[j])
                    reads = inference and inference[0].experiment == lane[j].partition.split(":")[0]
                    if lane[j].kind == "lora_rl" and reads:
                        waves[it].append(inference.pop(0))
        waves[it].extend(inference)
    return [spec for wave in waves for spec in wave]
