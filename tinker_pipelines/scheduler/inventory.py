"""What devices the scheduler may place steps on: the real ones, or a simulated set.

`Inventory.detect()` lists the GPUs through NVML (`nvidia-ml-py`), never through torch.cuda:
asking CUDA would initialise it, and a process whose CUDA is initialised ignores any later
`CUDA_VISIBLE_DEVICES`, so a step that detected its inventory itself ran on GPU 0 whatever it
leased. Without the NVML library (no NVIDIA driver) the inventory is one CPU device sized by the
machine's RAM; a driver that is there but fails is an `InventoryError`, never a CPU fallback.

An inherited `CUDA_VISIBLE_DEVICES` (SLURM, a container) limits the inventory to the GPUs it
names, in its order; each device keeps the entry that named it (`Device.visible`), and a lease's
child gets those entries (`lease_visible_devices`): inherited `4,5` and a lease on the second
device give the child `5`. Without one, a child gets the GPUs' UUIDs (physical names, whatever
CUDA's ordinal order).

`Inventory.from_config(...)` builds a simulated inventory for tests, CI and the scheduler
benchmark. Every config error names the field, e.g.
`scheduler.inventory.devices[1].memory_gb must be a positive number, got 'x'`.
`to_config()` / `from_dict()` carry any inventory (a detected one too) to step processes, which
therefore never detect.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("cuda", "cpu", "sim")
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


class InventoryError(RuntimeError):
    """The GPUs could not be listed: a broken driver, a CUDA_VISIBLE_DEVICES naming no GPU."""


@dataclass(frozen=True)
class Gpu:
    """One GPU (or MIG instance) as NVML lists it, before CUDA_VISIBLE_DEVICES is applied."""

    index: int | None
    """NVML's index (PCI bus order); None for a MIG instance."""
    uuid: str
    """'GPU-...' (or 'MIG-...' for a MIG instance)."""
    name: str
    """Product name, e.g. 'NVIDIA H100 80GB HBM3'."""
    memory_bytes: int
    """Total memory."""
    capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor) as NVML reports it; None when unknown."""


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
    """Human-readable name for logs and diagnostics, e.g. 'NVIDIA H100 80GB HBM3 (GPU-...)'."""
    uuid: str | None = None
    """A 'cuda' device's physical name ('GPU-...' or 'MIG-...'); None for other kinds."""
    visible: str | None = None
    """A 'cuda' device's entry for a child's CUDA_VISIBLE_DEVICES: the inherited entry that named
    it (an index, a UUID or a MIG id, kept as written), or its UUID when none was inherited."""

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
    def detect(cls, environ: Mapping[str, str] | None = None) -> Inventory:
        """The GPUs NVML lists, limited by `CUDA_VISIBLE_DEVICES` (of `environ`, default this
        process's), or one 'cpu' device with the machine's RAM when there is no NVIDIA driver.
        Never initialises CUDA (nor imports torch). Raises InventoryError when the driver is there
        but fails, or CUDA_VISIBLE_DEVICES names a GPU that does not exist."""
        environ = os.environ if environ is None else environ
        gpus = _nvml_gpus(environ.get(VISIBLE_ENV))
        if gpus is None:
            return cls((Device(0, "cpu", _machine_ram_gb(), "cpu"),))
        visible = visible_gpus(gpus, environ.get(VISIBLE_ENV))
        if not visible:  # CUDA_VISIBLE_DEVICES hides every GPU: CUDA sees none either
            return cls((Device(0, "cpu", _machine_ram_gb(), "cpu"),))
        return cls.from_gpus(visible)

    @classmethod
    def from_gpus(cls, visible: Sequence[tuple[Gpu, str]]) -> Inventory:
        """'cuda' devices for (GPU, entry for a child's CUDA_VISIBLE_DEVICES) pairs, in order."""
        return cls(tuple(Device(i, "cuda", g.memory_bytes / 1e9, f"{g.name} ({g.uuid})", g.uuid, entry)
                         for i, (g, entry) in enumerate(visible)))

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
        """A plain-data description (kind included; a GPU's uuid and visible entry too) that the
        ledger stores to detect a changed inventory and `from_dict` reads back."""
        out = []
        for d in self.devices:
            entry: dict[str, Any] = {"kind": d.kind, "memory_gb": round(d.memory_gb, 6), "name": d.name}
            if d.uuid is not None:
                entry["uuid"] = d.uuid
            if d.visible is not None:
                entry["visible"] = d.visible
            out.append(entry)
        return {"devices": out}

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> Inventory:
        """The inventory `to_config` described (how the executor hands its inventory to steps)."""
        return cls(tuple(Device(i, e["kind"], float(e["memory_gb"]), e["name"], e.get("uuid"), e.get("visible"))
                         for i, e in enumerate(config["devices"])))


def lease_visible_devices(inventory: Inventory, devices: Sequence[int]) -> str | None:
    """CUDA_VISIBLE_DEVICES for a process leasing `devices` of `inventory`: the entries that name
    them (composed with an inherited CUDA_VISIBLE_DEVICES, see `visible_gpus`); None unless they
    are all 'cuda' devices (simulated and CPU devices set nothing)."""
    if not devices or any(inventory[i].kind != "cuda" for i in devices):
        return None
    return ",".join(inventory[i].visible or inventory[i].uuid or str(i) for i in devices)


def visible_gpus(gpus: Sequence[Gpu], cuda_visible: str | None) -> tuple[tuple[Gpu, str], ...]:
    """The GPUs a process with `CUDA_VISIBLE_DEVICES=cuda_visible` sees, in CUDA's order, each
    with the entry that names it (its UUID when the variable is unset).

    Entries are NVML indices (`4`), UUIDs or unique UUID prefixes (`GPU-8f3a...`) or MIG UUIDs
    (`MIG-...`), as CUDA reads them; like CUDA, a negative index ends the list (`-1` hides every
    GPU). Integer entries are read in NVML's (PCI bus) order, which is CUDA's when
    CUDA_DEVICE_ORDER=PCI_BUS_ID or the GPUs are alike; the entry itself is what a child gets,
    so the child's CUDA reads it exactly as this process's would. Raises InventoryError naming an
    entry that matches no GPU, matches several, or repeats."""
    if cuda_visible is None:
        return tuple((g, g.uuid) for g in gpus if g.index is not None)
    out: list[tuple[Gpu, str]] = []
    for raw in cuda_visible.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if entry.lstrip("-").isdigit():
            if int(entry) < 0:
                break
            found = [g for g in gpus if g.index == int(entry)]
        elif entry.startswith(("GPU-", "MIG-")):
            found = [g for g in gpus if g.uuid.startswith(entry)]
        else:
            raise InventoryError(f"{VISIBLE_ENV} entry {entry!r} is neither an index, a GPU- UUID nor a MIG- UUID "
                                 f"(CUDA_VISIBLE_DEVICES={cuda_visible!r})")
        if len(found) != 1:
            listed = ", ".join(f"{g.index}: {g.uuid}" for g in gpus if g.index is not None)
            raise InventoryError(f"{VISIBLE_ENV} entry {entry!r} names {'no' if not found else 'more than one'} GPU "
                                 f"(CUDA_VISIBLE_DEVICES={cuda_visible!r}; NVML lists {listed or 'none'})")
        if any(g is found[0] for g, _ in out):
            raise InventoryError(f"{VISIBLE_ENV} names GPU {found[0].uuid} twice (CUDA_VISIBLE_DEVICES={cuda_visible!r})")
        out.append((found[0], entry))
    return tuple(out)


def _nvml_gpus(cuda_visible: str | None) -> list[Gpu] | None:
    """The GPUs NVML lists (and the MIG instances `cuda_visible` names); None when there is no
    NVML library, i.e. no NVIDIA driver. Raises InventoryError for a driver that fails."""
    try:
        import pynvml
    except ImportError:
        raise InventoryError("cannot list GPUs without initialising CUDA: the nvidia-ml-py package (pynvml) is "
                             "not installed (pip install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return None  # no NVIDIA driver on this machine: no GPU
    except pynvml.NVMLError as e:
        raise InventoryError(f"the NVIDIA driver is installed but NVML fails to start ({_nvml_message(e)}): "
                             "fix the driver (nvidia-smi shows the same error) or hide the GPUs with "
                             "CUDA_VISIBLE_DEVICES=''") from None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            gpus.append(_nvml_gpu(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i), i))
        for entry in (cuda_visible or "").split(","):
            if entry.strip().startswith("MIG-"):
                gpus.append(_nvml_gpu(pynvml, pynvml.nvmlDeviceGetHandleByUUID(entry.strip()), None))
        return gpus
    except pynvml.NVMLError as e:
        raise InventoryError(f"NVML started but cannot read the GPUs ({_nvml_message(e)}): the NVIDIA driver "
                             "looks broken (nvidia-smi shows the same error)") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _nvml_gpu(pynvml: Any, handle: Any, index: int | None) -> Gpu:
    def text(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        capability: tuple[int, int] | None = (int(major), int(minor))
    except pynvml.NVMLError:
        capability = None
    return Gpu(index, text(pynvml.nvmlDeviceGetUUID(handle)), text(pynvml.nvmlDeviceGetName(handle)),
               int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), capability)


def visible_gpu(ordinal: int, environ: Mapping[str, str] | None = None) -> Gpu | None:
    """The GPU that CUDA ordinal `ordinal` names in a process with `environ`'s
    CUDA_VISIBLE_DEVICES (default this process's), read through NVML without initialising CUDA;
    None when NVML is not there (no driver, or nvidia-ml-py missing) or there is no such ordinal.
    Raises InventoryError for a driver that fails."""
    environ = os.environ if environ is None else environ
    try:
        gpus = _nvml_gpus(environ.get(VISIBLE_ENV))
    except InventoryError as e:
        if "nvidia-ml-py" in str(e):
            return None
        raise
    visible = visible_gpus(gpus or [], environ.get(VISIBLE_ENV))
    return visible[ordinal][0] if 0 <= ordinal < len(visible) else None


def _nvml_message(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


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
