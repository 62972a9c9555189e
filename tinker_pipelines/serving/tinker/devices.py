"""The devices a Tinker service spreads over (`tinker serve --devices`), and its claim on them.

A service given a device set runs one worker per base on each of its devices. It claims each
device for itself with an exclusive `flock` on a file named by the device (its GPU UUID, or its
kind and name for simulated and CPU devices) in a folder shared by every service of the node:
beside the device ledger when there is one, else a per-user folder under the temporary
directory. A second service asking for a claimed device is refused before any model loads,
naming the holder; the lock goes with its holder's process, however it ends. Beside the claim,
each worker takes a 'lora' lease on its device in the ledger (when there is one), as the single
worker always did, so Dagster's LoRA steps may still share the device and exclusive ones wait.

Each worker learns its device from its environment, as a leased step does: a CUDA device's
`CUDA_VISIBLE_DEVICES` entry (so it runs on `cuda`, its only visible GPU); a simulated device's
index in `CUDA_VISIBLE_DEVICES` too (its worker runs on the CPU, so CUDA never reads it); and
`TINKER_SERVICE_DEVICE`, `INDEX:NAME`, for logs and tests.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_pipelines.scheduler.inventory import VISIBLE_ENV, Inventory, lease_visible_devices

DEVICE_ENV = "TINKER_SERVICE_DEVICE"
"""`INDEX:NAME` of the inventory device a service's worker runs for."""
CLAIMS_FOLDER = "tinker_service_devices"


@dataclass(frozen=True)
class NodeDevices:
    """Where a service's workers run: `devices` of `inventory`, one worker per base on each."""

    inventory: Inventory
    devices: tuple[int, ...]
    ledger_path: str | None = None
    """The device ledger each worker leases its device from (None: no ledger)."""
    memory_gb: float = 16.0
    """What each worker's lease reserves on its device (`--memory-gb`)."""
    claims_dir: str | None = None
    """Where the service's device claims live (default: beside the ledger, else `default_claims_dir`)."""
    timeout_s: float | None = 600.0
    """How long a worker's lease may wait for its device in the ledger."""

    def claims_folder(self) -> Path:
        if self.claims_dir:
            return Path(self.claims_dir)
        if self.ledger_path:
            return Path(self.ledger_path).absolute().parent / CLAIMS_FOLDER
        return default_claims_dir()

    def label(self, index: int) -> str:
        return f"device {index} ({self.inventory[index].name})"

    def worker_device(self, index: int) -> str:
        """The worker's `--device`: its only visible GPU, or the CPU for simulated and CPU devices."""
        return "cuda" if self.inventory[index].kind == "cuda" else "cpu"

    def worker_env(self, index: int) -> dict[str, str]:
        d = self.inventory[index]
        visible = lease_visible_devices(self.inventory, [index])
        env = {DEVICE_ENV: f"{index}:{d.name}"}
        if visible is not None:
            env[VISIBLE_ENV] = visible
        elif d.kind == "sim":
            env[VISIBLE_ENV] = str(index)
        return env


def default_claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"tinker-pipelines-{os.getuid()}" / CLAIMS_FOLDER


def load_inventory(text: str) -> Inventory:
    """`--inventory`: a simulated inventory's config (`Inventory.from_config`), as JSON or a JSON
    file's path; errors name the flag and the field."""
    source = text
    if not text.lstrip().startswith("{"):
        try:
            source = Path(text).read_text()
        except OSError as e:
            raise ValueError(f"--inventory {text}: not a JSON object and not a readable file ({e.strerror})") from None
    try:
        config = json.loads(source)
    except json.JSONDecodeError as e:
        raise ValueError(f"--inventory is not valid JSON: {e}") from None
    return Inventory.from_config(config, "--inventory")


def parse_devices(text: str, inventory: Inventory) -> tuple[int, ...]:
    """`--devices 0,1,3` (inventory indices) or `all`; refuses a device the inventory lacks or a repeat."""
    listed = ", ".join(f"{d.index}: {d.name}" for d in inventory)
    if text.strip() == "all":
        return tuple(range(len(inventory)))
    out: list[int] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry.isdigit():
            raise ValueError(f"--devices {text!r}: {entry!r} is not a device index (give indices like 0,1,3 or all; "
                             f"the inventory has {listed})")
        i = int(entry)
        if i >= len(inventory):
            raise ValueError(f"--devices {text!r}: the inventory has no device {i} (it has {listed})")
        if i in out:
            raise ValueError(f"--devices {text!r}: device {i} is given twice")
        out.append(i)
    return tuple(out)


def _claim_name(inventory: Inventory, index: int) -> str:
    d = inventory[index]
    raw = d.uuid if d.uuid else f"{d.kind}-{d.name}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw) + ".lock"


class Claims:
    """This service's exclusive hold on its devices (one locked file each), until `release`."""

    def __init__(self, held: list[tuple[int, int]]):
        self._held = held
        """(device index, open file descriptor holding its lock)."""

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(i for i, _ in self._held)

    def release(self) -> None:
        for _, fd in self._held:
            try:
                os.close(fd)  # closing the descriptor drops its lock
            except OSError:
                pass
        self._held = []


def claim_devices(spec: NodeDevices, home: Path) -> Claims:
    """Claim every device of `spec` for this process, or none: ValueError naming a device another
    service holds, and its holder."""
    folder = spec.claims_folder()
    folder.mkdir(parents=True, exist_ok=True)
    held: list[tuple[int, int]] = []
    try:
        for i in spec.devices:
            path = folder / _claim_name(spec.inventory, i)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(path)
                os.close(fd)
                raise ValueError(f"--devices: {spec.label(i)} is already claimed by another Tinker service "
                                 f"({holder}); stop it, or serve other devices") from None
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "home": str(Path(home).absolute())}).encode())
            held.append((i, fd))
    except BaseException:
        Claims(held).release()
        raise
    return Claims(held)


def _holder(path: Path) -> str:
    try:
        who: dict[str, Any] = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        who = {}
    return f"pid {who.get('pid', '?')}, home {who.get('home', '?')}; lock {path}"
