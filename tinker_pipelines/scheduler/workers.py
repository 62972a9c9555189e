"""Which physical device a resident worker holds: its identity, its socket's key, its ledger mark.

Inside a leased step every GPU is `cuda:0` (CUDA_VISIBLE_DEVICES names the leased one), so a
worker keyed by its logical device would be shared by steps leased on different GPUs: the
compute would run on one GPU while the ledger says another. The rule, in one place:

- a device of a lease (a step's, the worker's own): the inventory's entry, i.e. a CUDA device's
  UUID, and a simulated or CPU device's `<kind>:<index>@<scope>`, scoped by the ledger file and
  the inventory it describes (two ledgers, or two simulated inventories, never share a worker);
- no lease: a CUDA device's UUID as NVML maps the process's CUDA_VISIBLE_DEVICES (never CUDA
  itself: a process whose CUDA started ignores any later CUDA_VISIBLE_DEVICES), and the plain
  CPU is `cpu`.

A worker's own lease names the base it holds in its owner's step key (`worker:<base identity>`,
`worker_step_key`), so what a device already holds can be read back from the ledger
(`resident_bases`). Pure: no torch, no dagster.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from tinker_pipelines.scheduler.inventory import VISIBLE_ENV, Inventory, visible_gpu
from tinker_pipelines.scheduler.ledger import WORKER_STEP_PREFIX, resident_bases  # noqa: F401 (resident_bases re-exported)
from tinker_pipelines.scheduler.step_entry import DEVICES_ENV, INVENTORY_ENV, LEDGER_ENV

"""The step key of a worker's own lease starts with this, followed by the base it holds."""


def leased_device_key(inventory: Inventory, index: int, ledger_path: str | os.PathLike) -> str:
    """The physical identity of device `index` of `inventory`, leased from `ledger_path`."""
    device = inventory[index]
    if device.kind == "cuda" and device.uuid:
        return device.uuid
    described = json.dumps(inventory.to_config(), sort_keys=True)
    scope = hashlib.sha256(f"{Path(ledger_path).absolute()}|{described}".encode()).hexdigest()[:10]
    return f"{device.kind}:{index}@{scope}"


def cuda_device_key(ordinal: int, environ: Mapping[str, str] | None = None) -> str:
    """The physical name of CUDA ordinal `ordinal` in a process with `environ`'s
    CUDA_VISIBLE_DEVICES: its UUID through NVML; without NVML, the variable's entry for it (as
    written) or, with no variable, the ordinal, which is then CUDA's physical order."""
    environ = os.environ if environ is None else environ
    gpu = visible_gpu(ordinal, environ)
    if gpu is not None:
        return gpu.uuid
    if VISIBLE_ENV not in environ:
        return f"cuda-index:{ordinal}"
    entries = [e.strip() for e in environ[VISIBLE_ENV].split(",") if e.strip()]
    if not 0 <= ordinal < len(entries):
        raise ValueError(f"device cuda:{ordinal} is not among {VISIBLE_ENV}={environ[VISIBLE_ENV]!r}")
    entry = entries[ordinal]
    return entry if entry.startswith(("GPU-", "MIG-")) else f"cuda-index:{entry}"


def step_lease(environ: Mapping[str, str] | None = None) -> tuple[Inventory, tuple[int, ...], str] | None:
    """(inventory, leased device indices, ledger path) of the lease whose variables `environ`
    holds (a leased step's, inherited by the worker it starts), or None."""
    environ = os.environ if environ is None else environ
    if not (environ.get(LEDGER_ENV) and environ.get(DEVICES_ENV) and environ.get(INVENTORY_ENV)):
        return None
    devices = tuple(int(d) for d in environ[DEVICES_ENV].split(","))
    return Inventory.from_dict(json.loads(environ[INVENTORY_ENV])), devices, environ[LEDGER_ENV]


def worker_device_key(device_type: str, cuda_index: int | None = None,
                      environ: Mapping[str, str] | None = None) -> str:
    """The physical identity of the device a worker on logical device (`device_type`,
    `cuda_index`) holds in a process with `environ` (default this one's): under a lease, the
    leased device (the `cuda_index`-th of the lease's devices for CUDA, the first otherwise);
    else a GPU's UUID, or `cpu`. Raises ValueError (one line) for a CUDA ordinal the lease or
    CUDA_VISIBLE_DEVICES does not have. Never starts CUDA."""
    lease = step_lease(environ)
    if lease is not None:
        inventory, devices, ledger_path = lease
        position = (cuda_index or 0) if device_type == "cuda" else 0
        if not 0 <= position < len(devices):
            raise ValueError(f"device cuda:{position} is not one of the {len(devices)} device(s) of the lease "
                             f"({','.join(map(str, devices))})")
        return leased_device_key(inventory, devices[position], ledger_path)
    if device_type == "cuda":
        return cuda_device_key(cuda_index or 0, environ)
    return device_type


def inventory_index(inventory: Inventory, key: str) -> int | None:
    """The index of the CUDA device whose UUID is `key` (a UUID or a unique prefix), or None."""
    found = [d.index for d in inventory if d.kind == "cuda" and d.uuid and d.uuid.startswith(key)]
    return found[0] if len(found) == 1 else None


def placement_base(name: str, kwargs: Mapping | None, seed: int) -> str:
    """How placement and workers' leases name a base: its `base_identity`, except a plain model
    directory by its resolved path (its identity hashes every weight file: a minute for 18 GB, too
    slow for a step's launch). The executor names a step's base and a worker its own lease by it,
    so a step finds the devices where its base is loaded."""
    from tinker_pipelines.checkpoint import RECORD
    from tinker_pipelines.models import CATALOG, base_identity

    if name in CATALOG or (Path(name) / RECORD).is_file():
        return base_identity(name, dict(kwargs or {}), seed)
    return str(Path(name).resolve())


def worker_step_key(base: str) -> str:
    """The step key a worker's own lease carries: it names the base the worker holds."""
    return WORKER_STEP_PREFIX + base


