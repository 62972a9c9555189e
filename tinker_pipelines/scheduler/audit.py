"""The ledger's audit log as data: `AuditEvent` (one grant, release or expiry), and
`replay_audit`, which re-runs a log (the ledger's, or a simulation's) to find over-subscription
and exclusive sharing and to measure utilization (`AuditReport`). No I/O: the ledger reads the
events from its sqlite file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tinker_pipelines.scheduler.inventory import Inventory
from tinker_pipelines.scheduler.placement import EPS_GB, StepNeeds, device_use


@dataclass(frozen=True)
class AuditEvent:
    """One line of the audit table."""

    seq: int
    """Monotonic sequence number: the order of events."""
    at: float
    """Wall-clock time, non-decreasing in seq order."""
    event: str
    """'grant', 'release' or 'expire'."""
    lease_id: int
    """The lease concerned."""
    devices: tuple[int, ...]
    """Its devices."""
    needs: StepNeeds
    """Its needs."""
    pid: int | None = None
    """Owner pid."""
    host: str | None = None
    """Owner host."""
    run_id: str | None = None
    """Owner run id."""
    step_key: str | None = None
    """Owner step key."""
    reason: str | None = None
    """Why it expired (expire events only)."""


@dataclass(frozen=True)
class AuditReport:
    """What a replayed audit log says about the placements it records."""

    max_reserved_gb: tuple[float, ...]
    """Per device, the most 'lora' memory reserved at once (an exclusive holder counts its device's full memory)."""
    max_tenants: tuple[int, ...]
    """Per device, the most holders at once."""
    oversubscribed: bool
    """Some device's reserved memory ever exceeded its size."""
    exclusive_shared: bool
    """Some exclusive holder ever shared a device."""
    busy_s: tuple[float, ...]
    """Per device, seconds with at least one holder."""
    span_s: float
    """Seconds from the first event to the end of the replay."""
    utilization: float
    """sum(busy_s) / (devices * span_s)."""
    grants: int
    """Number of grants."""
    violations: tuple[str, ...]
    """Human-readable description of every inconsistency found (empty when all is well)."""


def replay_audit(events: Iterable[AuditEvent], inventory: Inventory, until: float | None = None) -> AuditReport:
    """Re-run an audit log: the peak use of each device, any over-subscription or exclusive
    sharing, and device-seconds busy (a device is busy while it has at least one holder) up to
    `until` (default: the last event)."""
    n = len(inventory)
    held: dict[int, AuditEvent] = {}
    max_reserved, max_tenants, busy = [0.0] * n, [0] * n, [0.0] * n
    violations: list[str] = []
    flags = {"oversubscribed": False, "exclusive_shared": False}
    clock: list[float] = []  # [first, last] event time once there is one

    def advance(to: float) -> None:
        if not clock:
            clock.extend([to, to])
        for i, use in enumerate(device_use(inventory, held.values())):
            busy[i] += max(0.0, to - clock[1]) if use.tenants else 0.0
        clock[1] = max(clock[1], to)

    events = sorted(events, key=lambda e: e.seq)
    for ev in events:
        advance(ev.at)
        if ev.event == "grant":
            if ev.lease_id in held:
                violations.append(f"seq {ev.seq}: lease {ev.lease_id} granted twice")
            if (any(not 0 <= i < n for i in ev.devices) or len(set(ev.devices)) != len(ev.devices)
                    or len(ev.devices) != ev.needs.devices):
                violations.append(f"seq {ev.seq}: lease {ev.lease_id} has devices {ev.devices} for {ev.needs}")
                continue
            held[ev.lease_id] = ev
            uses = device_use(inventory, held.values())
            for i in ev.devices:
                u, cap = uses[i], inventory[i].memory_gb
                max_tenants[i] = max(max_tenants[i], u.tenants)
                max_reserved[i] = max(max_reserved[i], cap if u.exclusive else u.reserved_gb)
                if u.exclusive and u.tenants > 1:
                    flags["exclusive_shared"] = True
                    violations.append(f"seq {ev.seq}: device {i} shared by {u.tenants} holders, {u.exclusive} exclusive")
                if u.reserved_gb > cap + EPS_GB:
                    flags["oversubscribed"] = True
                    violations.append(f"seq {ev.seq}: device {i} has {u.reserved_gb:g} GB reserved of {cap:g} GB")
        elif ev.event in ("release", "expire"):
            if held.pop(ev.lease_id, None) is None:
                violations.append(f"seq {ev.seq}: {ev.event} of lease {ev.lease_id}, which is not held")
        else:
            violations.append(f"seq {ev.seq}: unknown event {ev.event!r}")
    if clock and until is not None:
        advance(until)
    span = clock[1] - clock[0] if clock else 0.0
    return AuditReport(tuple(max_reserved), tuple(max_tenants), flags["oversubscribed"], flags["exclusive_shared"],
                       tuple(busy), span,
                       sum(busy) / (n * span) if span > 0 else 0.0,
                       sum(1 for e in events if e.event == "grant"), tuple(violations))
