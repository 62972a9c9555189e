"""A job for scripts/gpu_check: each step of a run on the GPU-aware executor records the device it
actually computes on, so that it can be held against the device its lease names.

`lease_probe`'s two steps each lease one device exclusively and return, as JSON: the lease's
devices (`TINKER_LEASE_DEVICES`), `CUDA_VISIBLE_DEVICES`, whether CUDA was already initialized
when the step's code began (it must not be: variables set after CUDA starts are ignored), and
the UUID of `cuda:0` as the step sees it (`torch.cuda.get_device_properties(0).uuid`, None
without CUDA). `run_probe` runs the job in-process (`dg.execute_job`, as tests/test_gpu_executor.py
does) and returns the steps' records. Imports dagster: not library code.
"""

from __future__ import annotations

import json
import os

import dagster as dg

from tinker_pipelines.scheduler.executor import gpu_executor

EXCLUSIVE = {"tinker/devices": "1", "tinker/sharing": "exclusive"}


def _record() -> str:
    import torch

    initialized_at_start = torch.cuda.is_initialized()
    uuid = None
    if torch.cuda.is_available():
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        torch.ones(1, device="cuda").sum().item()  # the step really computes there
    return json.dumps({"lease_devices": os.environ.get("TINKER_LEASE_DEVICES"),
                       "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                       "cuda_initialized_at_start": initialized_at_start, "uuid": uuid, "pid": os.getpid()})


@dg.op(tags=EXCLUSIVE)
def first_step() -> str:
    return _record()


@dg.op(tags=EXCLUSIVE)
def second_step() -> str:
    return _record()


@dg.job(executor_def=gpu_executor)
def lease_probe():
    first_step()
    second_step()


def run_probe(ledger_path: str, launch: str = "forkserver", inventory: dict | None = None) -> list[dict]:
    """One run of `lease_probe`; its steps' records. `inventory` None: the executor detects the
    machine's devices (the real path); else a simulated inventory (`{count, memory_gb}`)."""
    execution: dict = {"step_launch": launch, "ledger_path": ledger_path}
    if inventory is not None:
        execution["inventory"] = inventory
    with dg.instance_for_test() as instance:
        with dg.execute_job(dg.reconstructable(lease_probe), instance,
                            run_config={"execution": {"config": execution}}) as result:
            if not result.success:
                raise RuntimeError("lease_probe failed: " + "; ".join(
                    str(e.message) for e in result.all_events if e.is_failure)[-2000:])
            return [json.loads(result.output_for_node(n)) for n in ("first_step", "second_step")]
