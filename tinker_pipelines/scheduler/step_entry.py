"""A step process that first takes its devices: `python -m tinker_pipelines.scheduler.step_entry`.

With `step_launch: process` the GPU-aware step handler launches this instead of `dagster api
execute_step` (a forked step calls `lease_environment` the same way, `step_launch`). It acquires
a lease from the shared ledger *as itself*, sets `CUDA_VISIBLE_DEVICES` (real CUDA inventories)
and `TINKER_LEASE_DEVICES`, then replaces itself (`exec`, the same pid) with the Dagster step
command. The lease is therefore owned by the step process for its whole life and expires the
moment it exits, however it exits (a kill -9 included): nothing has to remember to release it.

Arguments: LEDGER_PATH INVENTORY_JSON NEEDS_JSON RUN_ID STEP_KEY -- COMMAND...
Exit code 3 (before the step starts) when the request can never fit or times out.
"""

from __future__ import annotations

import json
import os
import sys

from tinker_pipelines.scheduler.inventory import Inventory
from tinker_pipelines.scheduler.ledger import Ledger, LeaseOwner
from tinker_pipelines.scheduler.placement import StepNeeds

NEVER_FITS_EXIT = 3
STEP_PROCESS_ENV = "TINKER_STEP_PROCESS"
"""Set ("1") in the environment of every step process the GPU-aware handler starts: each runs one
step and exits (the policy engine then parks its experiments on their workers)."""


def lease_environment(ledger_path: str, inventory_json: str, needs_json: str, run_id: str,
                      step_key: str) -> dict[str, str]:
    """Take this process's lease (waiting as the ledger says) and return the variables that tell
    the step its devices, and `STEP_PROCESS_ENV` (alone for a step that needs none). Raises
    ValueError when the request can never fit, TimeoutError when it waited longer than its timeout."""
    spec_inventory = json.loads(inventory_json)  # the executor's inventory config, or null: detect
    spec = json.loads(needs_json)
    if spec is None:
        return {STEP_PROCESS_ENV: "1"}
    inventory = Inventory.detect() if spec_inventory is None else Inventory.from_config(spec_inventory)
    needs = StepNeeds(**{k: spec[k] for k in ("devices", "memory_gb", "sharing")})
    lease = Ledger(ledger_path).acquire(LeaseOwner.current(run_id, step_key), needs, inventory,
                                        timeout_s=spec.get("timeout_s"), poll_s=spec.get("poll_s", 0.5))
    env = {STEP_PROCESS_ENV: "1", "TINKER_LEASE_DEVICES": ",".join(map(str, lease.devices)),
           "TINKER_LEASE_ID": str(lease.id)}
    if all(inventory[i].kind == "cuda" for i in lease.devices):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(inventory[i].index) for i in lease.devices)
    return env


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    ledger_path, inventory_json, needs_json, run_id, step_key = argv[:sep]
    command = argv[sep + 1:]
    try:
        env = {**os.environ, **lease_environment(ledger_path, inventory_json, needs_json, run_id, step_key)}
    except (ValueError, TimeoutError) as e:
        print(f"error: step {step_key} of run {run_id}: {e}", file=sys.stderr, flush=True)
        return NEVER_FITS_EXIT
    sys.stdout.flush()
    os.execvpe(command[0], command, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
