"""A step process that first takes its devices: `python -m tinker_pipelines.scheduler.step_entry`.

With `step_launch: process` the GPU-aware step handler launches this instead of `dagster api
execute_step` (a forked step calls `lease_environment` and `apply_lease` the same way,
`step_launch`). It acquires a lease from the shared ledger *as itself*, sets
`CUDA_VISIBLE_DEVICES` (real CUDA inventories: the leased GPUs' entries, composed with an
inherited `CUDA_VISIBLE_DEVICES`, `inventory.lease_visible_devices`) and `TINKER_LEASE_DEVICES`,
then replaces itself (`exec`, the same pid) with the Dagster step command. The lease is therefore
owned by the step process for its whole life and expires the moment it exits, however it exits
(a kill -9 included): nothing has to remember to release it.

The step never detects the inventory: the executor passes the one it detected (or its simulated
one) down, so nothing in a step touches CUDA before `CUDA_VISIBLE_DEVICES` is set. `apply_lease`
refuses to go on in a process whose CUDA is already initialised (CUDA would ignore the variable
and the step would run on the wrong GPU) and records what it found in `TINKER_LEASE_CUDA_AT_APPLY`.

A resident worker that a step starts inherits the step's lease variables (`TINKER_LEDGER`,
`TINKER_LEASE_INVENTORY`, ...) and takes a lease of its own on the step's device
(`hold_worker_lease`, sharing 'lora'), which lives as long as the worker: an exclusive step is
never placed on a GPU a worker holds memory on.

A ranked step (NEEDS_JSON has `ranked`: a full-parameter step on k > 1 devices) is not replaced by
its command: this process holds the lease and runs `torchrun` with one rank per leased device
(`ranks.launch_ranks`), exit code `ranks.RANK_FAILED_EXIT` when a rank failed.

Arguments: LEDGER_PATH INVENTORY_JSON NEEDS_JSON RUN_ID STEP_KEY -- COMMAND...
Exit code 3 (before the step starts) when the request can never fit or times out.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tinker_pipelines.scheduler.inventory import VISIBLE_ENV, Inventory, lease_visible_devices
from tinker_pipelines.scheduler.ledger import Lease, Ledger, LeaseOwner
from tinker_pipelines.scheduler.placement import StepNeeds
from tinker_pipelines.scheduler.ranks import RANK_VISIBLE_ENV, launch_ranks

NEVER_FITS_EXIT = 3
STEP_PROCESS_ENV = "TINKER_STEP_PROCESS"
"""Set ("1") in the environment of every step process the GPU-aware handler starts: each runs one
step and exits (the policy engine then parks its experiments on their workers)."""


LEDGER_ENV = "TINKER_LEDGER"
"""The ledger file a leased step took its lease from (a worker it starts leases from it too)."""
INVENTORY_ENV = "TINKER_LEASE_INVENTORY"
"""JSON of the inventory (`Inventory.to_config`) the step's lease indices refer to."""
DEVICES_ENV = "TINKER_LEASE_DEVICES"
"""The inventory indices of the step's leased devices, comma-separated."""
BASE_GB_ENV = "TINKER_LEASE_BASE_GB"
"""What of a LoRA step's estimate its base's weights take (memory_gb - resident_gb): the lease a
worker the step starts holds for as long as it keeps the base loaded."""
CUDA_AT_APPLY_ENV = "TINKER_LEASE_CUDA_AT_APPLY"
"""What `apply_lease` found of CUDA when it set the lease variables: 'uninitialized' (torch
imported, CUDA not started) or 'torch not imported'."""


def inventory_from_json(inventory_json: str) -> Inventory:
    """The inventory the executor passed: `Inventory.to_config()` (kinds given), a simulated
    inventory's config, or null (detect here: only for callers that start no CUDA first)."""
    spec = json.loads(inventory_json)
    if spec is None:
        return Inventory.detect()
    devices = spec.get("devices") if isinstance(spec, dict) else None
    if isinstance(devices, list) and devices and all(isinstance(d, dict) and "kind" in d for d in devices):
        return Inventory.from_dict(spec)
    return Inventory.from_config(spec)


def lease_environment(ledger_path: str, inventory_json: str, needs_json: str, run_id: str,
                      step_key: str) -> dict[str, str]:
    """Take this process's lease (waiting as the ledger says) and return the variables that tell
    the step its devices, and `STEP_PROCESS_ENV` (alone for a step that needs none). Raises
    ValueError when the request can never fit, TimeoutError when it waited longer than its timeout."""
    spec = json.loads(needs_json)
    if spec is None:
        return {STEP_PROCESS_ENV: "1"}
    inventory = inventory_from_json(inventory_json)
    needs = StepNeeds(**{k: spec[k] for k in ("devices", "memory_gb", "sharing", "base", "resident_gb") if k in spec})
    lease = Ledger(ledger_path).acquire(LeaseOwner.current(run_id, step_key), needs, inventory,
                                        timeout_s=spec.get("timeout_s"), poll_s=spec.get("poll_s", 0.5))
    env = {STEP_PROCESS_ENV: "1", "TINKER_LEASE_DEVICES": ",".join(map(str, lease.devices)),
           "TINKER_LEASE_ID": str(lease.id), LEDGER_ENV: str(Path(ledger_path).absolute()),
           INVENTORY_ENV: json.dumps(inventory.to_config()), "TINKER_LEASE_MEMORY_GB": f"{lease.needs.memory_gb:g}",
           "TINKER_LEASE_SHARING": needs.sharing}
    if needs.base and 0 < needs.resident_gb < needs.memory_gb:  # what a worker it starts holds: the base
        env[BASE_GB_ENV] = f"{needs.memory_gb - needs.resident_gb:g}"
    visible = lease_visible_devices(inventory, lease.devices)
    if visible is not None:
        env[VISIBLE_ENV] = visible
        if spec.get("ranked"):  # one entry per leased device, in the lease's order: rank r's own GPU
            env[RANK_VISIBLE_ENV] = json.dumps(visible.split(","))
    return env


def cuda_state() -> str:
    """How far CUDA got in this process, without starting it: 'torch not imported',
    'uninitialized', 'initialized', or 'initialized before fork' (a parent started it)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda"):
        return "torch not imported"
    if torch.cuda._is_in_bad_fork():
        return "initialized before fork"
    return "initialized" if torch.cuda.is_initialized() else "uninitialized"


def apply_lease(env: Mapping[str, str], environ: Any = None) -> None:
    """Set a lease's variables in `environ` (default: this process's), refusing when CUDA has
    started here already: it read CUDA_VISIBLE_DEVICES then, so the step would use GPU 0 (or
    what it saw), not the GPU it leased. Raises RuntimeError (one line)."""
    environ = os.environ if environ is None else environ
    state = cuda_state()
    if state not in ("uninitialized", "torch not imported"):
        raise RuntimeError(f"CUDA was {state} before the step's lease (devices {env.get('TINKER_LEASE_DEVICES')}) "
                           f"was applied, so {VISIBLE_ENV}={env.get(VISIBLE_ENV)!r} would be ignored: something "
                           "imported by the step server or the code location touches CUDA at import")
    environ.update(env)
    environ[CUDA_AT_APPLY_ENV] = state


def hold_worker_lease(environ: Mapping[str, str], cuda_index: int | None = None, memory_gb: float | None = None,
                      timeout_s: float | None = 120.0, step_key: str = "worker") -> Lease | None:
    """For a resident worker started by a leased step (`environ` holds the step's lease
    variables): a 'lora' lease of this process's own on the step's device (the `cuda_index`-th
    of the step's devices, the first by default), for `memory_gb` (default: what the step
    reserved per device). It lasts as long as this process. None when `environ` has no lease
    (a worker started by hand). ValueError when it can never be granted, TimeoutError after
    `timeout_s`. `step_key`: the owner's step key in the ledger (a worker names its base there,
    `workers.worker_step_key`)."""
    if not environ.get(LEDGER_ENV) or not environ.get("TINKER_LEASE_DEVICES") or not environ.get(INVENTORY_ENV):
        return None
    devices = [int(d) for d in environ["TINKER_LEASE_DEVICES"].split(",")]
    position = cuda_index or 0
    if not 0 <= position < len(devices):
        raise ValueError(f"the worker's device cuda:{position} is not one of the {len(devices)} device(s) "
                         f"its step leased ({environ['TINKER_LEASE_DEVICES']})")
    if environ.get("TINKER_LEASE_SHARING") == "exclusive":
        raise ValueError(f"the step that starts this worker holds device {devices[position]} exclusively; a worker "
                         "shares its device like a 'lora' step, so it can never be granted it")
    if memory_gb is None:  # the base's weights where the step's estimate split them off, else the step's share
        memory_gb = float(environ.get(BASE_GB_ENV) or environ.get("TINKER_LEASE_MEMORY_GB") or 0)
    memory = memory_gb
    if not memory > 0:
        raise ValueError(f"a worker's lease needs memory_gb > 0, got {memory:g}")
    inventory = Inventory.from_dict(json.loads(environ[INVENTORY_ENV]))
    return Ledger(environ[LEDGER_ENV]).acquire(LeaseOwner.current(step_key=step_key), StepNeeds(1, memory, "lora"),
                                               inventory, timeout_s=timeout_s, poll_s=0.2, only=(devices[position],))


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    ledger_path, inventory_json, needs_json, run_id, step_key = argv[:sep]
    command = argv[sep + 1:]
    env = dict(os.environ)
    try:
        apply_lease(lease_environment(ledger_path, inventory_json, needs_json, run_id, step_key), env)
    except (ValueError, TimeoutError, RuntimeError) as e:
        print(f"error: step {step_key} of run {run_id}: {e}", file=sys.stderr, flush=True)
        return NEVER_FITS_EXIT
    sys.stdout.flush()
    spec = json.loads(needs_json)
    if spec is not None and spec.get("ranked"):  # this process keeps the lease while torchrun runs
        return launch_ranks(env, command, Path(spec["rank_dir"]), f"{step_key} of run {run_id}")
    os.execvpe(command[0], command, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
