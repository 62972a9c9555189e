"""The GPU-aware scheduler: pure parts, then the Dagster side built on them (only `executor` and
a step process's `step_launch` import dagster).

- `inventory`: `Device` and `Inventory` — the real GPUs (`Inventory.detect()` through NVML,
  never starting CUDA; limited by an inherited CUDA_VISIBLE_DEVICES, whose entries a lease's
  child gets: `lease_visible_devices`; one CPU device when there is no NVIDIA driver) or a
  simulated set (`Inventory.from_config(...)`).
- `placement`: `StepNeeds` parsed from op tags (`tinker/devices`, `tinker/memory_gb`,
  `tinker/sharing`), `place` (best-fit packing of 'lora' steps, whole idle devices for
  'exclusive' ones, never over-subscribed), `check_fits` (fail at once on a request that can
  never be placed) and the anti-starvation reservation (`starving`, `reserve`). Pure functions: no I/O, no clock.
- `estimate`: what a LoRA step needs on a device (weights, KV cache, activations, adapter), from
  the model's config alone; the executor turns `tinker/memory_gb: auto` into it.
- `ledger`: the reservation ledger shared by all processes and runs on a machine — a sqlite
  file in WAL mode, each grant one `BEGIN IMMEDIATE` transaction; leases die with their owner
  process (pid + start time) or a missed heartbeat TTL; an append-only audit table.
- `audit`: the audit log's events and `replay_audit`, which checks a log for over-subscription
  and measures utilization.
- `workers`: which physical device a resident worker holds (`worker_device_key`: a GPU's UUID,
  a leased simulated/CPU device's inventory entry scoped by its ledger, or `cpu`), the key of
  its default socket; a worker's own lease names its base (`worker_step_key`, `resident_bases`).

The Dagster side: `executor` (`gpu_executor`), `step_launch` and `step_entry` (how a step process
starts and takes its lease), `location_preload` (the code location the step forkserver imports
once) and `k8s` (the same tags as Kubernetes GPU requests).

`benchmarks/scheduler_sim.py` drives the same `place` through a discrete-event simulation of
a 16-GPU machine against a FIFO whole-device baseline.
"""

from tinker_pipelines.scheduler.inventory import Device, Inventory
from tinker_pipelines.scheduler.audit import AuditEvent, AuditReport, replay_audit
from tinker_pipelines.scheduler.ledger import Lease, LeaseLost, LeaseOwner, Ledger
from tinker_pipelines.scheduler.placement import (TAG_PREFIX, Allocation, StepNeeds, check_fits, needs_from_tags,
                                                  place, reserve, starving)

__all__ = ["Allocation", "AuditEvent", "AuditReport", "Device", "Inventory", "Lease", "LeaseLost", "LeaseOwner",
           "Ledger", "StepNeeds", "TAG_PREFIX", "check_fits", "needs_from_tags", "place", "replay_audit",
           "reserve", "starving"]
