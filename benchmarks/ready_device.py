"""Is the leased device the device used? Measured through the real lease code, without dagster.

`measure(device)` forks a step from the real step server (`step_launch.fork_leased`, what the
executor's forkserver launch uses, less the Dagster step body), leases from a real ledger and
records what the step saw when its lease was applied:

- `step_saw_cuda_uninitialized`: the forked step's CUDA had not started when its lease
  variables were set (`TINKER_LEASE_CUDA_AT_APPLY` == 'uninitialized', torch preloaded);
- `cvd_composed`: under an inherited `CUDA_VISIBLE_DEVICES=4,5` (simulated GPUs), a step
  leasing the second device got `CUDA_VISIBLE_DEVICES=5`;
- `worker_lease_blocks_exclusive`: a process holding a worker's lease (`hold_worker_lease`, as
  `tinker-pipelines worker` takes it) keeps an exclusive request off its device.

With `device="cuda"` (a GPU machine) the first check uses the real inventory (NVML) and the step
also initialises CUDA after its lease and reports the UUID of the GPU it got
(`step_gpu_matches_lease`). Runs in seconds. Last line: JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tinker_pipelines.scheduler.inventory import Gpu, Inventory, visible_gpus
from tinker_pipelines.scheduler.ledger import Ledger, LeaseOwner
from tinker_pipelines.scheduler.placement import StepNeeds

SIM_GPUS = [Gpu(i, f"GPU-sim{i}-0000-0000-0000-000000000000", "simulated", 80 * 10**9) for i in range(8)]


def _record(path: str, use_cuda: bool) -> None:
    """The forked step's body: what it saw when its lease was applied (and, on a GPU, which GPU it got)."""
    out = {"cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "at_apply": os.environ.get("TINKER_LEASE_CUDA_AT_APPLY")}
    if use_cuda:
        import torch

        out["gpu_uuid"] = f"GPU-{torch.cuda.get_device_properties(0).uuid}"
    Path(path).write_text(json.dumps(out))


def _forked(ledger: str, inventory: Inventory, needs: dict, use_cuda: bool, tmp: str) -> dict:
    from tinker_pipelines.scheduler.step_launch import fork_leased

    out = os.path.join(tmp, f"step{time.monotonic_ns()}.json")
    args = (ledger, json.dumps(inventory.to_config()), json.dumps(needs), "ready_device", "probe")
    proc = fork_leased(args, _record, (out, use_cuda))
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc.poll() != 0 or not os.path.exists(out):
        return {"error": f"forked step exited with {proc.poll()}"}
    return json.loads(Path(out).read_text())


def _worker_blocks(tmp: str) -> bool:
    """A child holding a worker's lease on device 1 of 2: an exclusive request gets device 0,
    and a second one waits (times out) while the worker lives."""
    from tinker_pipelines.scheduler.step_entry import lease_environment

    ledger_path = os.path.join(tmp, "worker.sqlite")
    inventory = Inventory.from_config({"count": 2, "memory_gb": 16})
    holder = Ledger(ledger_path).acquire(LeaseOwner.current(), StepNeeds(1, 0, "exclusive"), inventory, timeout_s=5)
    env = lease_environment(ledger_path, json.dumps(inventory.to_config()),
                            json.dumps({"devices": 1, "memory_gb": 2, "sharing": "lora"}), "ready_device", "step")
    Ledger(ledger_path).release(holder)
    code = ("import os, sys, time; from tinker_pipelines.scheduler.step_entry import hold_worker_lease; "
            "l = hold_worker_lease(os.environ); print(l.devices[0], flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)
    try:
        held = int(child.stdout.readline())
        ledger = Ledger(ledger_path)
        step = ledger.leases()[0]
        ledger.release(step)  # the step ends, the worker lives on
        first = ledger.acquire(LeaseOwner.current(), StepNeeds(1, 0, "exclusive"), inventory, timeout_s=2)
        try:
            ledger.acquire(LeaseOwner.current(), StepNeeds(1, 0, "exclusive"), inventory, timeout_s=0.3, poll_s=0.05)
            return False
        except TimeoutError:
            return first.devices != (held,)
    finally:
        child.kill()
        child.wait()


def _config_check_leaves_cuda_alone() -> bool:
    """Resolving `model.device`/`model.dtype` 'auto' (what validating a config does, e.g. in the
    Dagster daemon) leaves CUDA uninitialised, in a fresh interpreter."""
    code = ("import torch; from tinker_pipelines.models import resolve_device, resolve_dtype; "
            "print(resolve_dtype('auto', resolve_device('auto')), torch.cuda.is_initialized())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return done.returncode == 0 and done.stdout.split()[-1:] == ["False"]


def measure(device: str = "cpu") -> dict:
    use_cuda = device.startswith("cuda")
    # the forked step imports this module by name (the step server never runs a caller's __main__)
    root = str(Path(__file__).resolve().parents[1])
    if root not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        ledger = os.path.join(tmp, "ledger.sqlite")
        out: dict = {"device": device}
        # composed: inherited 4,5 (simulated GPUs), device 0 taken, so the step leases the second
        sim = Inventory.from_gpus(visible_gpus(SIM_GPUS, "4,5"))
        blocker = Ledger(ledger).acquire(LeaseOwner.current(), StepNeeds(1, 0, "exclusive"), sim, timeout_s=5)
        seen = _forked(ledger, sim, {"devices": 1, "memory_gb": 0, "sharing": "exclusive"}, False, tmp)
        Ledger(ledger).release(blocker)
        out["cvd_composed"] = seen.get("cvd") == "5"
        out["step_saw_cuda_uninitialized"] = seen.get("at_apply") == "uninitialized"
        out["sim_step"] = seen
        if use_cuda:
            real = Inventory.detect()
            step = _forked(os.path.join(tmp, "real.sqlite"), real,
                           {"devices": 1, "memory_gb": 0, "sharing": "exclusive"}, True, tmp)
            leased = real[0].uuid
            out["cuda_step"] = {**step, "leased_uuid": leased}
            out["step_saw_cuda_uninitialized"] &= step.get("at_apply") == "uninitialized"
            out["step_gpu_matches_lease"] = leased is not None and step.get("gpu_uuid") == leased
            out["config_check_left_cuda_uninitialized"] = _config_check_leaves_cuda_alone()
        out["worker_lease_blocks_exclusive"] = _worker_blocks(tmp)
    # the GPU image has no dagster: the lease path must not need it
    out["ran_without_dagster"] = "dagster" not in sys.modules
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import ready_device  # by name: the forked step must find `_record` there, not in __main__

    from benchmarks import ready_main

    ready_main(ready_device.measure)
