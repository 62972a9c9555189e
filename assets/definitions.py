"""The composition root: the one Dagster `Definitions` object of the project.

Loaded by `workspace.yaml` (`dagster dev`) and by `dagster job execute -m assets.definitions`.
The deployment (local embedded default or production) is chosen once, in `resources.build_resources`,
from `TINKER_DEPLOYMENT`.
"""

from __future__ import annotations

import dagster as dg

from assets.dpo import DPO_ASSETS
from assets.evaluation import evaluate
from assets.inference import inference_results
from assets.jobs import JOBS
from assets.sensors import SCHEDULES, SENSORS
from assets.sft import sft_checkpoint
from assets.training import RL_ASSETS
from resources import build_resources

defs = dg.Definitions(
    assets=[*RL_ASSETS, sft_checkpoint, *DPO_ASSETS, inference_results],
    jobs=JOBS,
    sensors=SENSORS,
    schedules=SCHEDULES,
    resources=build_resources(),
)


def rl_job() -> dg.JobDefinition:
    """The resolved `rl` job (for `reconstructable` / `execute_job`)."""
    return defs.resolve_job_def("rl")


def evaluate_job() -> dg.JobDefinition:
    return defs.resolve_job_def("evaluate")


def sft_job() -> dg.JobDefinition:
    return defs.resolve_job_def("sft")


def dpo_job() -> dg.JobDefinition:
    return defs.resolve_job_def("dpo")


def inference_job() -> dg.JobDefinition:
    return defs.resolve_job_def("inference")


def serve_job() -> dg.JobDefinition:
    return defs.resolve_job_def("serve")


__all__ = ["defs", "evaluate", "rl_job", "sft_job", "dpo_job", "evaluate_job", "inference_job", "serve_job"]
