"""The GPU-aware scheduler's pure parts (no dagster import here; the Dagster executor built on
them lives in its own module and is the only one in this package that imports dagster).

- `inventory`: `Device` and `Inventory` — the real CUDA devices (`Inventory.detect()`, one CPU
  device when there is no GPU) or a simulated set (`Inventory.from_config(...)`).
- `placement`: `StepNeeds` parsed from op tags (`tinker/devices`, `tinker/memory_gb`,
  `tinker/sharing`), `place` (best-fit packing of 'lora' steps, whole idle devices for
  'exclusive' ones, never over-subscribed), `check_fits` (fail at once on a request that can
  never be placed) and the anti-starvation reservation (`starving`, `reserve`). Pure functions: no I/O, no clock.
- `ledger`: the reservation ledger shared by all processes and runs on a machine — a sqlite
  file in WAL mode, each grant one `BEGIN IMMEDIATE` transaction; leases die with their owner
  process (pid + start time) or a missed heartbeat TTL; an append-only audit table, and
  `replay_audit` to check a log for over-subscription and measure utilization.

`benchmarks/scheduler_sim.py` drives the same `place` through a discrete-event simulation of
a 16-GPU machine against a FIFO whole-device baseline.
"""

from tinker_pipelines.scheduler.inventory import Device, Inventory
from tinker_pipelines.scheduler.ledger import (AuditEvent, AuditReport, Lease, LeaseLost, LeaseOwner, Ledger,
                                               replay_audit)
from tinker_pipelines.scheduler.placement import (TAG_PREFIX, Allocation, StepNeeds, check_fits, needs_from_tags,
                                                  place, reserve, starving)

__all__ = ["Allocation", "AuditEvent", "AuditReport", "Device", "Inventory", "Lease", "LeaseLost", "LeaseOwner",
           "Ledger", "StepNeeds", "TAG_PREFIX", "check_fits", "needs_from_tags", "place", "replay_audit",
           "reserve", "starving"]
