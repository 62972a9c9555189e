"""Pure placement: which devices a step gets, given what is already leased. No I/O, no clocks.

A step declares its needs in op tags (strings, as Dagster stores them)::

    tinker/devices    how many devices (default 1)
    tinker/memory_gb  GB per device: what a 'lora' step reserves on each of its devices, or the
                      smallest device an 'exclusive' step accepts (default 0: any); 'auto': the
                      estimate from the run's model config (`estimate`), as the executor derives it
    tinker/sharing    'lora': may share a device with other 'lora' steps up to its memory;
                      'exclusive': whole devices, nobody else on them (default, the safe choice)

Rules: memory is never over-subscribed and an exclusive holder never shares a device. LoRA
steps are packed best-fit (the already-shared device with the least free memory that still
fits) so that whole devices stay free for exclusive steps. A LoRA step that names its base goes
where a worker already holds that base (it costs only its adapter and batch there), else to an
idle device before stacking another copy of a base onto a busy one, while enough idle devices
stay free for the exclusive steps waiting (`place`'s `resident` and `keep_idle`). `check_fits` tells a request that
can never be placed on this inventory from one that must wait, so the first fails at once.
Younger requests may overtake a waiting one (backfilling); once the oldest has waited longer
than a threshold (`starving`), `reserve` names devices that younger ones must leave alone.

Pass op tags only: run tags carry other `tinker/...` keys (tinker/experiment, tinker/model) and
an unknown key under the prefix is an error here, so that a typo like `tinker/gpus` is caught.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from tinker_pipelines.scheduler.estimate import PROMPT_TOKENS, MemoryEstimate
from tinker_pipelines.scheduler.inventory import Inventory

TAG_PREFIX = "tinker/"
SHARING = ("lora", "exclusive")
# Declared sizes like 0.1 + 0.2 do not sum exactly; a nanobyte of slack is not over-subscription.
EPS_GB = 1e-9
AUTO = "auto"
"""`tinker/memory_gb: auto`: what the step's run needs, estimated from its config (`estimate`)."""
AUTO_FALLBACK_GB = 2.0
"""What `auto` reserves where nothing estimated it (a run config without a model): the fixed
size every LoRA step reserved before the estimate."""


def check_needs(devices: object, memory_gb: object, sharing: object, name, shown=None) -> None:
    """The rules of a step's needs, for `StepNeeds` and its op tags alike: raise ValueError
    naming the field as `name(field)` and showing its value as `shown(field)` (default: repr).

    >>> check_needs(1, 0.0, "lora", lambda f: f"tag tinker/{f}")
    Traceback (most recent call last):
    ...
    ValueError: tag tinker/memory_gb (> 0) is required when tag tinker/sharing is 'lora'
    """
    values = {"devices": devices, "memory_gb": memory_gb, "sharing": sharing}
    shown = shown or (lambda f: repr(values[f]))

    def fail(f: str, what: str) -> None:
        raise ValueError(f"{name(f)} {what}, got {shown(f)}")

    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        fail("devices", "must be a positive integer")
    if isinstance(memory_gb, bool) or not isinstance(memory_gb, (int, float)) or not (
            math.isfinite(memory_gb) and memory_gb >= 0):
        fail("memory_gb", "must be a non-negative number")
    if sharing not in SHARING:
        fail("sharing", f"must be one of {', '.join(SHARING)}")
    if sharing == "lora" and memory_gb <= 0:  # a sharing step that reserves nothing could be stacked without limit
        raise ValueError(f"{name('memory_gb')} (> 0) is required when {name('sharing')} is 'lora'")


@dataclass(frozen=True)
class StepNeeds:
    """What one step asks of the devices."""

    devices: int = 1
    """How many distinct devices the step needs at once."""
    memory_gb: float = 0.0
    """Per device: reserved memory for 'lora'; the smallest acceptable device for 'exclusive'."""
    sharing: str = "exclusive"
    """'lora' (may share devices with other lora steps) or 'exclusive' (whole devices)."""
    base: str = ""
    """The base model whose weights `memory_gb` includes ('': unknown; the step is packed as before)."""
    resident_gb: float = 0.0
    """Per device, what a 'lora' step reserves where a worker already holds `base` (0: memory_gb)."""

    def __post_init__(self) -> None:
        check_needs(self.devices, self.memory_gb, self.sharing, lambda f: f"StepNeeds.{f}")
        if not isinstance(self.base, str):
            raise ValueError(f"StepNeeds.base must be a string, got {self.base!r}")
        if isinstance(self.resident_gb, bool) or not isinstance(self.resident_gb, (int, float)) or not (
                0 <= self.resident_gb <= self.memory_gb + EPS_GB):
            raise ValueError(f"StepNeeds.resident_gb must be a number in [0, memory_gb], got {self.resident_gb!r}")

    def __str__(self) -> str:
        return f"{self.devices} x {self.memory_gb:g} GB {self.sharing}"

    def on(self, device: int, resident: Mapping[int, Collection[str]]) -> float:
        """What the step reserves on `device`, given the bases workers hold (device -> bases)."""
        if self.base and self.resident_gb > 0 and self.base in resident.get(device, ()):
            return self.resident_gb
        return self.memory_gb


class Holding(Protocol):
    """Anything that holds devices: a ledger lease, a simulated running job."""

    @property
    def devices(self) -> tuple[int, ...]: ...

    @property
    def needs(self) -> StepNeeds: ...


@dataclass(frozen=True)
class Allocation:
    """A plain holding, for simulations and tests."""

    devices: tuple[int, ...]
    """The granted device indices."""
    needs: StepNeeds
    """What was asked for."""


@dataclass(frozen=True)
class DeviceUse:
    """How one device is held right now."""

    reserved_gb: float
    """Sum of the memory reserved by 'lora' holders."""
    tenants: int
    """How many holdings include this device."""
    exclusive: int
    """How many of them are 'exclusive' (more than 0 means nobody else may join)."""


def needs_from_tags(tags: Mapping[str, str], prefix: str = TAG_PREFIX,
                    auto_memory_gb: float | None = None) -> StepNeeds | None:
    """The step's needs from its op tags, or None when no tag under `prefix` is set (the step
    needs no device). Unknown keys under the prefix and malformed values raise ValueError.

    `memory_gb: auto` is `auto_memory_gb`, what the caller estimated from the run's config
    (`estimate`), or `AUTO_FALLBACK_GB` where it has no estimate."""
    known = {prefix + "devices", prefix + "memory_gb", prefix + "sharing"}
    ours = {k: v for k, v in tags.items() if k.startswith(prefix)}
    if not ours:
        return None
    for key in sorted(ours):
        if key not in known:
            raise ValueError(f"unknown scheduler tag {key!r} (known: {', '.join(sorted(known))})")
    raw = {k[len(prefix):]: v for k, v in ours.items()}
    devices, memory = raw.get("devices", 1), raw.get("memory_gb", 0.0)
    sharing = str(raw.get("sharing", "exclusive")).strip().lower()
    if isinstance(devices, str):
        devices = int(devices.strip()) if devices.strip().lstrip("-").isdigit() else None
    if isinstance(memory, str) and memory.strip().lower() == AUTO:
        memory = AUTO_FALLBACK_GB if auto_memory_gb is None else auto_memory_gb
    if isinstance(memory, str):
        try:
            memory = float(memory.strip())
        except ValueError:
            memory = None

    def shown(f: str) -> str:  # the tag as written
        return repr(raw[f]) if f in raw else "unset"

    check_needs(devices, memory, sharing, lambda f: f"tag {prefix}{f}", shown)
    return StepNeeds(devices, memory, sharing)


def device_use(inventory: Inventory, leases: Iterable[Holding]) -> tuple[DeviceUse, ...]:
    """Per-device reservations; a holding on a device outside the inventory is an error (the
    holdings were made against a different inventory)."""
    reserved = [0.0] * len(inventory)
    tenants = [0] * len(inventory)
    exclusive = [0] * len(inventory)
    for lease in leases:
        for i in lease.devices:
            if not 0 <= i < len(inventory):
                raise ValueError(f"a lease holds device {i}, but the inventory has devices 0..{len(inventory) - 1}")
            tenants[i] += 1
            if lease.needs.sharing == "exclusive":
                exclusive[i] += 1
            else:
                reserved[i] += lease.needs.memory_gb
    return tuple(DeviceUse(r, t, x) for r, t, x in zip(reserved, tenants, exclusive))


def cap_to_device(needs: StepNeeds, inventory: Inventory,
                  estimate: MemoryEstimate | None) -> tuple[StepNeeds, str | None]:
    """A LoRA step whose estimate exceeds the largest device only by its batch (KV cache and
    activations, which assume `estimate.PROMPT_TOKENS`-token prompts the config does not bound)
    reserves that whole device's memory instead of failing: the model and adapter fit, and the
    run's real sequences may be far shorter. Returns the needs and a one-line note saying so."""
    largest = max(d.memory_gb for d in inventory)
    if (estimate is None or needs.sharing != "lora" or needs.memory_gb <= largest + EPS_GB
            or estimate.weights_gb + estimate.adapter_gb > largest):
        return needs, None
    note = (f"{estimate.describe()}, more than the largest device's {largest:g} GB by its batch (prompts "
            f"assumed {PROMPT_TOKENS} tokens): it reserves a whole device; lower training.micro_batch_size "
            "or set training.gradient_checkpointing to share one")
    return replace(needs, memory_gb=largest, resident_gb=min(needs.resident_gb, largest)), note


def check_fits(needs: StepNeeds, inventory: Inventory, estimate: MemoryEstimate | None = None) -> None:
    """Raise ValueError when `needs` could not be placed even on an idle inventory; with the
    `estimate` its memory came from, a message too large for every device says its parts."""
    n = len(inventory)
    largest = max(d.memory_gb for d in inventory)
    if needs.devices > n:
        raise ValueError(f"step needs {needs}, but the inventory has only {n} device(s): it can never be placed")
    big_enough = sum(1 for d in inventory if d.memory_gb >= needs.memory_gb - EPS_GB)
    if big_enough == 0 and estimate is not None:
        raise ValueError(f"step {estimate.describe()} on one device, but the largest device has {largest:g} GB and a "
                         "LoRA step has no multi-device plan: it can never be placed (lower "
                         "training.micro_batch_size or set training.gradient_checkpointing)")
    if big_enough == 0:
        raise ValueError(f"step needs {needs}, but the largest device has {largest:g} GB: it can never be placed")
    if big_enough < needs.devices:
        raise ValueError(f"step needs {needs}, but only {big_enough} of the {n} devices have "
                         f">= {needs.memory_gb:g} GB: it can never be placed")


def place(needs: StepNeeds, inventory: Inventory, leases: Iterable[Holding], exclude: Collection[int] = (),
          resident: Mapping[int, Collection[str]] | None = None, keep_idle: int = 0) -> tuple[int, ...] | None:
    """The device indices to grant (sorted), or None when the step must wait for a release.
    Devices in `exclude` (held back for a starving request, see `reserve`) are not used.

    For a 'lora' step that names its `base`: `resident` maps a device to the bases its workers
    hold; there the step costs `resident_gb` and goes first (best fit among them). Elsewhere it
    brings its own copy of the base, and goes to an idle device before a busy one (then the
    fewest tenants), as long as `keep_idle` idle devices stay free for exclusive steps waiting
    (the caller counts them); past that it packs best-fit like a step without a base.

    Does not tell "wait" from "never": call `check_fits` first.
    """
    use = device_use(inventory, leases)
    usable = [d for d in inventory if d.index not in exclude]
    if needs.sharing == "exclusive":
        # Smallest idle devices that are large enough: big ones stay for requests that need them.
        candidates = [d for d in usable if use[d.index].tenants == 0 and d.memory_gb >= needs.memory_gb - EPS_GB]
        candidates.sort(key=lambda d: (d.memory_gb, d.index))
    else:
        held = resident or {}
        cost = {d.index: needs.on(d.index, held) for d in usable}
        candidates = [d for d in usable if use[d.index].exclusive == 0
                      and d.memory_gb - use[d.index].reserved_gb >= cost[d.index] - EPS_GB]
        idle = sum(1 for d in candidates if use[d.index].tenants == 0)
        spread = bool(needs.base) and idle - needs.devices >= keep_idle

        def key(d):
            u = use[d.index]
            warm = cost[d.index] < needs.memory_gb
            crowd = u.tenants if spread else u.tenants == 0  # spread: idle first; else shared first
            return not warm, crowd, d.memory_gb - u.reserved_gb - cost[d.index], d.index

        candidates.sort(key=key)  # best fit within each group
    if len(candidates) < needs.devices:
        return None
    return tuple(sorted(d.index for d in candidates[:needs.devices]))


def granted_needs(needs: StepNeeds, devices: Collection[int], resident: Mapping[int, Collection[str]]) -> StepNeeds:
    """What a grant of `devices` reserves: `resident_gb` where a worker holds the base on every
    one of them, else the full `memory_gb` (a lease has one figure for all its devices)."""
    cost = max(needs.on(i, resident) for i in devices)
    return needs if cost == needs.memory_gb else replace(needs, memory_gb=cost)


def starving(waiting_since: float, now: float, starve_after_s: float | None) -> bool:
    """Whether the oldest waiting request has waited long enough to get a reservation (None: never)."""
    return starve_after_s is not None and now - waiting_since > starve_after_s


def reserve(needs: StepNeeds, inventory: Inventory, leases: Iterable[Holding]) -> tuple[int, ...]:
    """The devices to hold back for a starving request: while it waits, younger requests are
    placed with `exclude=` these, so they drain and it cannot be bypassed forever (the
    reservation of EASY backfilling, without run-time estimates: the devices likeliest to
    free up first stand in for "soonest"). Only the oldest waiting request gets one."""
    use = device_use(inventory, leases)
    usable = [d for d in inventory if d.memory_gb >= needs.memory_gb - EPS_GB]
    if needs.sharing == "exclusive":
        usable.sort(key=lambda d: (use[d.index].tenants, use[d.index].reserved_gb, d.memory_gb, d.index))
    else:
        usable.sort(key=lambda d: (use[d.index].exclusive, -(d.memory_gb - use[d.index].reserved_gb),
                                   use[d.index].tenants, d.index))
    return tuple(sorted(d.index for d in usable[:needs.devices]))
