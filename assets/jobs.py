"""Jobs: `rl` (one iteration per run, partition `<experiment>:<iteration>`), `sft`, `dpo`, `evaluate`, `inference`, `serve`."""

from __future__ import annotations

import os

import dagster as dg

from assets.dpo import DPO_ASSETS
from assets.evaluation import evaluate
from assets.inference import inference_results
from assets.serving import serve
from assets.sft import sft_checkpoint
from assets.training import RL_ASSETS
from tinker_pipelines.schedule_rules import LOADS_MODEL_TAG

def _executor() -> dg.ExecutorDefinition:
    """`TINKER_EXECUTOR=gpu`: every step in its own process on devices granted by the GPU-aware
    executor (pair it with a resident worker, `TINKER_WORKER` or the policy engine's
    `start_worker`, so LoRA steps are thin clients instead of model loaders); default: in-process,
    where the steps of a run share the resident model."""
    choice = os.environ.get("TINKER_EXECUTOR", "in_process")
    if choice == "gpu":
        from tinker_pipelines.scheduler.executor import gpu_executor

        return gpu_executor
    if choice != "in_process":
        raise ValueError(f"TINKER_EXECUTOR must be 'in_process' or 'gpu', got {choice!r}")
    return dg.in_process_executor


EXECUTOR = _executor()

MODEL_RUN = {LOADS_MODEL_TAG: "true"}
"""Tag of every job here (and `evaluate`), and so of their runs (`tags`, not `run_tags`: `dagster
job launch` copies only the former): the run process loads a model, so the run queue admits one
such run per device (docs/runtime.md "Run queue")."""

RUN_RETRIES = {"dagster/max_retries": "1"}
"""The `rl` job's run retries: with the instance's `run_retries` (a fresh `dagster.yaml` enables them
for crashes only), the daemon re-executes a crashed iteration from its failure once; the re-executed
steps resume from the stored artifacts, and registering the same adapter again returns its version."""

rl = dg.define_asset_job(
    "rl", selection=dg.AssetSelection.assets(*RL_ASSETS),
    executor_def=EXECUTOR,  # in-process by default: the steps share the resident model (docs/runtime.md)
    tags={**MODEL_RUN, **RUN_RETRIES},
    description="One RL iteration of an experiment: rollouts, scoring, an optimizer step, a registered "
                "adapter version, and evaluation when due. Config under ops.rollout_batch.config.")

sft = dg.define_asset_job(
    "sft", selection=dg.AssetSelection.assets(sft_checkpoint),
    executor_def=EXECUTOR, tags=MODEL_RUN,
    description="Supervised warm start of an experiment's base model (partition = experiment name).")

dpo = dg.define_asset_job(
    "dpo", selection=dg.AssetSelection.assets(*DPO_ASSETS),
    executor_def=EXECUTOR, tags=MODEL_RUN,
    description="DPO of an experiment (partition = experiment name; run `sft` first when sft.steps > 0): "
                "preference pairs from scored rollouts, DPO steps, a registered and evaluated adapter version. "
                "Config under ops.preference_pairs.config.")

inference = dg.define_asset_job(
    "inference", selection=dg.AssetSelection.assets(inference_results),
    executor_def=EXECUTOR, tags=MODEL_RUN,
    description="Batch generation and scoring of a registered adapter version (model: NAME@ALIAS, NAME/VERSION "
                "or NAME) on a task set; per-episode JSONL in the artifact store. Config under "
                "ops.inference_results.config.")

JOBS = [rl, sft, dpo, evaluate, inference, serve]
