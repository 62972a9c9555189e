"""What devices the scheduler may place steps on: the real ones, or a simulated set.

`Inventory.detect()` reads torch.cuda (or falls back to one CPU device sized by the machine's
RAM); `Inventory.from_config(...)` builds a simulated inventory for tests, CI and the
scheduler benchmark. Every config error names the field, e.g.
`scheduler.inventory.devices[1].memory_gb must be a positive number, got 'x'`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("cuda", "cpu", "sim")


@dataclass(frozen=True)
class Device:
    """One placeable device."""

    index: int
    """Position in the inventory (and the CUDA ordinal for 'cuda' devices); leases name devices by it."""
    kind: str
    """'cuda' (a real GPU), 'cpu' (the host, when there is no GPU) or 'sim' (simulated)."""
    memory_gb: float
    """Total memory in GB (10**9 bytes) that placement may hand out on this device."""
    name: str
    """Human-readable name for logs and diagnostics, e.g. 'NVIDIA H100 80GB HBM3'."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Device.kind must be one of {KINDS}, got {self.kind!r}")
        if not (isinstance(self.memory_gb, (int, float)) and math.isfinite(self.memory_gb) and self.memory_gb > 0):
            raise ValueError(f"Device.memory_gb must be a positive number, got {self.memory_gb!r}")


@dataclass(frozen=True)
class Inventory:
    """The devices of one machine (or one simulated machine), indexed 0..n-1."""

    devices: tuple[Device, ...]
    """The devices; `devices[i].index == i` always holds."""

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError("an inventory needs at least one device")
        for i, d in enumerate(self.devices):
            if d.index != i:
                raise ValueError(f"inventory device at position {i} has index {d.index}; indices must be 0..n-1")

    def __len__(self) -> int:
        return len(self.devices)

    def __iter__(self) -> Iterator[Device]:
        return iter(self.devices)

    def __getitem__(self, index: int) -> Device:
        return self.devices[index]

    @classmethod
    def detect(cls) -> Inventory:
        """The CUDA devices torch sees, or one 'cpu' device with the machine's RAM when there are none."""
        import torch  # lazy: the placement logic and the simulator never need torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            devices = []
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                # The UUID makes the name physical: under different CUDA_VISIBLE_DEVICES the same
                # ordinal is another GPU, and the ledger must see that the inventories differ.
                uuid = getattr(props, "uuid", None)
                name = f"{props.name} (GPU-{uuid})" if uuid is not None else props.name
                devices.append(Device(i, "cuda", props.total_memory / 1e9, name))
            return cls(tuple(devices))
        return cls((Device(0, "cpu", _machine_ram_gb(), "cpu"),))

    @classmethod
    def from_config(cls, config: Mapping[str, Any], field: str = "scheduler.inventory") -> Inventory:
        """A simulated inventory from `{"devices": [{"memory_gb": 80, "name": ...}, ...]}` or
        `{"count": 2, "memory_gb": 80}`; raises ValueError naming the offending field."""
        if not isinstance(config, Mapping):
            raise ValueError(f"{field} must be a mapping, got {config!r}")
        if "devices" in config:
            _no_unknown(config, {"devices"}, field)
            entries = config["devices"]
            if not isinstance(entries, (list, tuple)) or not entries:
                raise ValueError(f"{field}.devices must be a non-empty list, got {entries!r}")
            devices = []
            for i, entry in enumerate(entries):
                where = f"{field}.devices[{i}]"
                if not isinstance(entry, Mapping):
                    raise ValueError(f"{where} must be a mapping with memory_gb, got {entry!r}")
                _no_unknown(entry, {"memory_gb", "name"}, where)
                if "memory_gb" not in entry:
                    raise ValueError(f"{where}.memory_gb is required")
                memory = _positive_number(entry["memory_gb"], f"{where}.memory_gb")
                devices.append(Device(i, "sim", memory, _name(entry.get("name", f"sim{i}"), f"{where}.name")))
            return cls(tuple(devices))
        if "count" in config:
            _no_unknown(config, {"count", "memory_gb", "name"}, field)
            count = config["count"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"{field}.count must be a positive integer, got {count!r}")
            if "memory_gb" not in config:
                raise ValueError(f"{field}.memory_gb is required with {field}.count")
            memory = _positive_number(config["memory_gb"], f"{field}.memory_gb")
            prefix = _name(config.get("name", "sim"), f"{field}.name")
            return cls(tuple(Device(i, "sim", memory, f"{prefix}{i}") for i in range(count)))
        raise ValueError(f"{field} needs either 'devices' (a list) or 'count' and 'memory_gb', got keys {sorted(config)}")

    def to_config(self) -> dict[str, Any]:
        """A plain-data description (kind included) that the ledger stores to detect a changed inventory."""
        return {"devices": [{"kind": d.kind, "memory_gb": round(d.memory_gb, 6), "name": d.name} for d in self.devices]}


def _machine_ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):  # not POSIX: no way to ask without psutil
        return 1.0


def _positive_number(value: Any, field: str) -> float:
    # bool is an int subclass; `memory_gb: true` is a typo, not 1 GB.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field} must be a positive number, got {value!r}")
    return float(value)


def _name(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")
    return value


def _no_unknown(config: Mapping[str, Any], known: set[str], field: str) -> None:
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"{field}.{unknown[0]} is not a known field (known: {', '.join(sorted(known))})")
