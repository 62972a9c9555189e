"""Scheduling rules that the plain loop and the Dagster runtime share (no dagster import).

- `eval_due`: when an iteration (or a DPO step) runs the held-out evaluation.
- The run queue of the embedded Dagster instance: the run tags and the pool its limits name
  (`EXPERIMENT_TAG`, `LOADS_MODEL_TAG`, `DEVICE_POOL`) and `queue_limits(devices)`, the numbers
  `tinker_pipelines.tracking.home` writes into a fresh `dagster.yaml`, sized by `device_count()`.
"""

from __future__ import annotations

from dataclasses import dataclass

EXPERIMENT_TAG = "tinker/experiment"
"""Run tag naming the experiment; the queue runs at most one run per value at a time."""
LOADS_MODEL_TAG = "tinker/loads_model"
"""Run tag (value "true") of the jobs whose run process loads a model: at most one such run per device."""
DEVICE_POOL = "tinker_device"
"""Dagster concurrency pool of the steps that load or train a model."""


LORA_STEP_TAGS = {"tinker/devices": "1", "tinker/memory_gb": "auto", "tinker/sharing": "lora"}
"""Op tags of a step that trains or samples one LoRA experiment: one device, shared, as much of it
as the run's model and batch need (the GPU-aware executor estimates it from the run's config,
`scheduler.estimate`, and makes the step exclusive when the config trains every parameter)."""
EXCLUSIVE_STEP_TAGS = {"tinker/devices": "1", "tinker/sharing": "exclusive"}
"""Op tags of a step that trains every parameter of a model (SFT): one whole device."""


def eval_due(iteration: int, every: int, iterations: int) -> bool:
    """Whether 0-based `iteration` of `iterations` evaluates: every `every` iterations and after the last.

    >>> [k for k in range(7) if eval_due(k, every=3, iterations=7)]
    [2, 5, 6]
    """
    return (iteration + 1) % every == 0 or iteration + 1 == iterations


@dataclass(frozen=True)
class QueueLimits:
    """Limits of the run queue and the device pool for a machine with `devices` devices."""

    devices: int
    """Devices of the machine (GPUs, or 1 for the CPU)."""
    model_runs: int
    """Runs tagged `tinker/loads_model` in progress at once: one per device."""
    max_concurrent_runs: int
    """All runs in progress at once: the model runs plus two light ones."""
    pool_limit: int
    """Steps of the `tinker_device` pool executing at once, over all runs (and `execute_job`)."""
    per_experiment: int = 1
    """Runs of one experiment in progress at once (iteration k+1 needs k's adapter)."""


def queue_limits(devices: int) -> QueueLimits:
    """The embedded defaults: one model-loading run and one pool step per device.

    >>> queue_limits(1)
    QueueLimits(devices=1, model_runs=1, max_concurrent_runs=3, pool_limit=1, per_experiment=1)
    """
    n = max(1, int(devices))
    return QueueLimits(devices=n, model_runs=n, max_concurrent_runs=n + 2, pool_limit=n)


def device_count() -> int:
    """The number of devices runs are placed on: the CUDA devices torch sees, else 1 (the CPU).

    The same count as `len(tinker_pipelines.scheduler.Inventory.detect())`, without reading the
    devices' properties (which would initialize CUDA in this process)."""
    try:
        import torch  # lazy: only when a fresh dagster.yaml is written
    except ImportError:
        return 1
    try:
        return max(1, torch.cuda.device_count())
    except Exception:  # a broken driver must not stop the instance from being created
        return 1
