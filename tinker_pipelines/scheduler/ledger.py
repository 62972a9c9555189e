"""The reservation ledger: device leases shared by every process and run on one machine.

A sqlite database in WAL mode (path given, e.g. beside the Dagster instance). Each acquisition
attempt is one `BEGIN IMMEDIATE` transaction (expire dead leases, read the live ones, `place`,
insert), so two processes can never be granted the same capacity. Dagster's executor state
lives in one run's process; this file is what makes placement hold across runs.

A lease expires when
- its owner process is gone: the owner records pid, host and process start time (boot id +
  start ticks from /proc/<pid>/stat), so a reused pid is not mistaken for the owner, and a
  zombie (killed, not yet reaped) counts as gone; owners on another host (another container's
  pid namespace) cannot be checked and rely on the TTL alone;
- or the ledger has a TTL and the lease's last `heartbeat` is older than it (a hung owner).
Requesters that wait record themselves in `waiting`; younger ones may overtake (backfill), but
once the oldest has waited longer than `starve_after_s`, the devices `placement.reserve` picks
for it are off limits to the others until it is served.

Every grant, release and expiry is appended to `audit` (monotonic `seq`, non-decreasing `at`);
`replay_audit` (`scheduler.audit`, re-exported here) checks a log for over-subscription and
exclusive sharing and measures utilization.
sqlite locking is not reliable on network file systems: keep the file on a local disk.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from tinker_pipelines.scheduler.audit import AuditEvent, AuditReport, replay_audit
from tinker_pipelines.scheduler.inventory import Inventory
from tinker_pipelines.scheduler.placement import StepNeeds, check_fits, granted_needs, place, reserve, starving

WORKER_STEP_PREFIX = "worker:"
"""A resident worker's lease carries the step key `worker:<base>` (`workers.placement_base`):
what the ledger reads to know which bases each device holds."""


def resident_bases(leases: Iterable[Lease]) -> dict[int, frozenset[str]]:
    """Per device index, the bases that live workers' leases say are loaded there."""
    out: dict[int, set[str]] = {}
    for lease in leases:
        key = lease.owner.step_key or ""
        if key.startswith(WORKER_STEP_PREFIX) and len(key) > len(WORKER_STEP_PREFIX):
            for d in lease.devices:
                out.setdefault(d, set()).add(key[len(WORKER_STEP_PREFIX):])
    return {d: frozenset(b) for d, b in out.items()}


__all__ = ["AuditEvent", "AuditReport", "Lease", "LeaseLost", "LeaseOwner", "Ledger", "owner_alive",
           "process_start_time", "replay_audit"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
  id INTEGER PRIMARY KEY AUTOINCREMENT, devices TEXT NOT NULL, n_devices INTEGER NOT NULL,
  memory_gb REAL NOT NULL, sharing TEXT NOT NULL, pid INTEGER NOT NULL, start_time TEXT,
  host TEXT NOT NULL, run_id TEXT, step_key TEXT, granted_at REAL NOT NULL,
  heartbeat_at REAL NOT NULL, ttl_s REAL);
CREATE TABLE IF NOT EXISTS waiting (
  ticket INTEGER PRIMARY KEY AUTOINCREMENT, pid INTEGER NOT NULL, start_time TEXT,
  host TEXT NOT NULL, run_id TEXT, step_key TEXT, needs TEXT NOT NULL, since REAL NOT NULL,
  polled_at REAL NOT NULL, stale_after_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS audit (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, event TEXT NOT NULL,
  lease_id INTEGER NOT NULL, devices TEXT NOT NULL, n_devices INTEGER NOT NULL,
  memory_gb REAL NOT NULL, sharing TEXT NOT NULL, pid INTEGER, host TEXT, run_id TEXT,
  step_key TEXT, reason TEXT);
"""
_LEASE_COLS = "id, devices, n_devices, memory_gb, sharing, pid, start_time, host, run_id, step_key, granted_at, heartbeat_at, ttl_s"
_AUDIT_COLS = "seq, at, event, lease_id, devices, n_devices, memory_gb, sharing, pid, host, run_id, step_key, reason"


LEDGER_FILE = "tinker_devices.sqlite"
"""The device ledger's file name, in the Dagster instance's root directory by default (the
executor's and the Tinker service's)."""


class LeaseLost(RuntimeError):
    """The lease is no longer in the ledger (released, or expired because its owner looked dead)."""


@dataclass(frozen=True)
class LeaseOwner:
    """Who holds (or waits for) a lease."""

    pid: int
    """Owning process id; the lease dies with it."""
    start_time: str | None
    """'<boot id>:<start ticks>' of that process, so a reused pid is not the owner; None if unknown."""
    host: str
    """Host name; a pid is only checked on its own host."""
    run_id: str | None = None
    """Dagster run id, for diagnostics."""
    step_key: str | None = None
    """Dagster step key, for diagnostics."""

    @classmethod
    def current(cls, run_id: str | None = None, step_key: str | None = None, pid: int | None = None) -> LeaseOwner:
        """This process (or the live process `pid` on this host) as an owner."""
        pid = os.getpid() if pid is None else pid
        return cls(pid, process_start_time(pid), socket.gethostname(), run_id, step_key)


@dataclass(frozen=True)
class Lease:
    """Devices granted to one owner until release or expiry."""

    id: int
    """Ledger id; never reused."""
    devices: tuple[int, ...]
    """Granted device indices."""
    needs: StepNeeds
    """What was asked for."""
    owner: LeaseOwner
    """Who holds it."""
    granted_at: float
    """Wall-clock time of the grant."""
    heartbeat_at: float
    """Wall-clock time of the last heartbeat (the grant counts as one)."""
    ttl_s: float | None
    """Heartbeat TTL this lease was granted under; None: only owner death expires it."""


def process_start_time(pid: int) -> str | None:
    """'<boot id>:<start ticks>' from /proc (Linux), or None where /proc is not available."""
    stat = _proc_stat(pid)
    if stat is None:
        return None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{boot}:{stat[1]}"


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start ticks) of pid, or None when it does not exist or /proc is missing."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = text[text.rindex(")") + 2:].split()
    return rest[0], rest[19]  # field 3 (state) and field 22 (starttime)


def owner_alive(owner: LeaseOwner) -> bool | None:
    """True/False when the owner's process can be checked from here, None when it cannot (another host)."""
    if owner.host != socket.gethostname():
        return None
    if Path("/proc/self/stat").exists():
        stat = _proc_stat(owner.pid)
        if stat is None or stat[0] in ("Z", "X"):
            return False
        return owner.start_time is None or owner.start_time == process_start_time(owner.pid)
    try:  # no /proc (macOS): existence only
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Ledger:
    """Handle on the ledger file; cheap and picklable (each call opens its own connection)."""

    path: str
    """The sqlite file; created with its parent folder if missing."""
    ttl_s: float | None = None
    """Heartbeat TTL for new leases; None: a lease only dies with its owner process."""
    starve_after_s: float | None = 600.0
    """Once the oldest waiter has waited this long, devices are reserved for it; None: never."""

    def __post_init__(self) -> None:
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as con:
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(_SCHEMA)

    def acquire(self, owner: LeaseOwner, needs: StepNeeds, inventory: Inventory,
                timeout_s: float | None = None, poll_s: float = 0.5, only: Collection[int] | None = None) -> Lease:
        """Block until `place` grants devices; ValueError at once if it never can, TimeoutError
        after `timeout_s` (None: wait forever). `only`: the devices it may be granted (a worker
        leases the very device its step leased)."""
        check_fits(needs, inventory)
        pinned: tuple[int, ...] = ()
        if only is not None:
            only = set(only)
            if not only <= set(range(len(inventory))) or len(only) < needs.devices:
                raise ValueError(f"cannot lease {needs} on devices {sorted(only)} of an inventory of {len(inventory)}")
            check_fits(needs, Inventory(tuple(replace(d, index=i) for i, d in
                                              enumerate(d for d in inventory if d.index in only))))
            pinned = tuple(i for i in range(len(inventory)) if i not in only)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # The waiter is this polling process (the owner may be another one), so a dead poller's
        # row is dropped; a live poller whose row was dropped as stale (a long pause) rejoins
        # with its original wait time.
        poller, since = LeaseOwner.current(owner.run_id, owner.step_key), time.time()
        needs_json = json.dumps({"devices": needs.devices, "memory_gb": needs.memory_gb, "sharing": needs.sharing})
        waiter = (poller.pid, poller.start_time, poller.host, owner.run_id, owner.step_key, needs_json, since)
        ticket = None
        try:
            while True:
                with self._tx() as con:
                    now, _ = self._expire(con, time.time())
                    self._check_inventory(con, inventory)
                    if ticket is None or con.execute("UPDATE waiting SET polled_at = ? WHERE ticket = ?",
                                                     (now, ticket)).rowcount == 0:
                        ticket = con.execute(
                            "INSERT INTO waiting (pid, start_time, host, run_id, step_key, needs, since, polled_at,"
                            " stale_after_s) VALUES (?,?,?,?,?,?,?,?,?)",
                            waiter + (now, max(30.0, 20 * poll_s))).lastrowid
                    leases = self._leases(con)
                    head = con.execute("SELECT ticket, since, needs FROM waiting ORDER BY since, ticket LIMIT 1"
                                       ).fetchone()
                    exclude: tuple[int, ...] = pinned
                    if head[0] != ticket and starving(head[1], now, self.starve_after_s):
                        exclude += reserve(StepNeeds(**json.loads(head[2])), inventory, leases)
                    resident = resident_bases(leases)
                    devices = place(needs, inventory, leases, exclude, resident, self._exclusive_waiting(con, ticket))
                    if devices is not None:
                        needs = granted_needs(needs, devices, resident)
                        lease_id = con.execute(
                            f"INSERT INTO leases ({_LEASE_COLS.split(', ', 1)[1]}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                            (json.dumps(devices), needs.devices, needs.memory_gb, needs.sharing, owner.pid,
                             owner.start_time, owner.host, owner.run_id, owner.step_key, now, now, self.ttl_s)).lastrowid
                        lease = Lease(lease_id, devices, needs, owner, now, now, self.ttl_s)
                        self._audit(con, now, "grant", lease)
                        con.execute("DELETE FROM waiting WHERE ticket = ?", (ticket,))
                        ticket = None
                        return lease
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no devices for {needs} within {timeout_s:g} s "
                                       f"(run {owner.run_id}, step {owner.step_key})")
                wait = poll_s if deadline is None else min(poll_s, max(0.0, deadline - time.monotonic()))
                time.sleep(wait)
        finally:
            if ticket is not None:
                with self._tx() as con:
                    con.execute("DELETE FROM waiting WHERE ticket = ?", (ticket,))

    @staticmethod
    def _exclusive_waiting(con: sqlite3.Connection, ticket: int) -> int:
        """Devices that other waiters' exclusive requests need: a LoRA step that brings a base
        of its own leaves that many idle devices for them (`place`'s `keep_idle`)."""
        n = 0
        for (spec,) in con.execute("SELECT needs FROM waiting WHERE ticket != ?", (ticket,)):
            w = json.loads(spec)
            n += w["devices"] if w.get("sharing") == "exclusive" else 0
        return n

    def release(self, lease: Lease) -> bool:
        """Give the devices back; False if the lease was already gone (released or expired)."""
        with self._tx() as con:
            if con.execute("DELETE FROM leases WHERE id = ?", (lease.id,)).rowcount == 0:
                return False
            self._audit(con, _clamped_now(con), "release", lease)
            return True

    def heartbeat(self, lease: Lease) -> Lease:
        """Mark the lease as still in use; raises LeaseLost when it has expired or was released."""
        with self._tx() as con:
            now, _ = self._expire(con, time.time())  # a beat after the TTL is too late, even if nobody noticed yet
            held = con.execute("UPDATE leases SET heartbeat_at = ? WHERE id = ?", (now, lease.id)).rowcount > 0
        if not held:  # raised after the commit, so the expiry above is recorded
            raise LeaseLost(f"lease {lease.id} on devices {lease.devices} is no longer held")
        return Lease(lease.id, lease.devices, lease.needs, lease.owner, lease.granted_at, now, lease.ttl_s)

    def leases(self) -> tuple[Lease, ...]:
        """The leases in the ledger now (dead owners included until something expires them)."""
        with self._connect() as con:
            return self._leases(con)

    def expire_dead(self) -> tuple[Lease, ...]:
        """Remove the leases whose owner is gone or whose heartbeat is older than their TTL."""
        with self._tx() as con:
            return self._expire(con, time.time())[1]

    def audit_log(self) -> tuple[AuditEvent, ...]:
        """Every grant, release and expiry so far, in seq order."""
        with self._connect() as con:
            rows = con.execute(f"SELECT {_AUDIT_COLS} FROM audit ORDER BY seq").fetchall()
        return tuple(AuditEvent(seq, at, ev, lid, tuple(json.loads(devs)), StepNeeds(n, mem, sharing),
                                pid, host, run, step, reason)
                     for seq, at, ev, lid, devs, n, mem, sharing, pid, host, run, step, reason in rows)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # isolation_level=None: we issue BEGIN ourselves; the timeout is sqlite's busy wait.
        con = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            con.execute("PRAGMA synchronous=NORMAL")  # safe in WAL mode; a power cut kills the owners too
            yield con
        finally:
            con.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    def _leases(self, con: sqlite3.Connection) -> tuple[Lease, ...]:
        rows = con.execute(f"SELECT {_LEASE_COLS} FROM leases ORDER BY id").fetchall()
        return tuple(Lease(i, tuple(json.loads(devs)), StepNeeds(n, mem, sharing),
                           LeaseOwner(pid, start, host, run, step), granted, beat, ttl)
                     for i, devs, n, mem, sharing, pid, start, host, run, step, granted, beat, ttl in rows)

    def _expire(self, con: sqlite3.Connection, now: float) -> tuple[float, tuple[Lease, ...]]:
        """Expire dead leases and forget dead waiters inside the caller's transaction; returns
        `now` (raised to the last audit time so timestamps never run backwards) and the expired."""
        now = _clamped_now(con, now)
        expired = []
        for lease in self._leases(con):
            alive = owner_alive(lease.owner)
            reason = None
            if alive is False:
                reason = f"owner process {lease.owner.pid} on {lease.owner.host} is gone"
            elif lease.ttl_s is not None and now - lease.heartbeat_at > lease.ttl_s:
                reason = f"no heartbeat for {now - lease.heartbeat_at:.1f} s (ttl {lease.ttl_s:g} s)"
            if reason is not None:
                con.execute("DELETE FROM leases WHERE id = ?", (lease.id,))
                self._audit(con, now, "expire", lease, reason)
                expired.append(lease)
        for ticket, pid, start, host, polled, stale in con.execute(
                "SELECT ticket, pid, start_time, host, polled_at, stale_after_s FROM waiting").fetchall():
            if owner_alive(LeaseOwner(pid, start, host)) is False or now - polled > stale:
                con.execute("DELETE FROM waiting WHERE ticket = ?", (ticket,))
        return now, tuple(expired)

    def _check_inventory(self, con: sqlite3.Connection, inventory: Inventory) -> None:
        # Leases granted against 2 x 80 GB must not be re-read as if the devices were 2 x 40 GB.
        wanted = json.dumps(inventory.to_config(), sort_keys=True)
        row = con.execute("SELECT value FROM meta WHERE key = 'inventory'").fetchone()
        if row is not None and row[0] != wanted:
            if con.execute("SELECT COUNT(*) FROM leases").fetchone()[0]:
                raise ValueError(f"the ledger {self.path} holds leases granted against a different inventory "
                                 f"({row[0]}); this request uses {wanted}")
        if row is None or row[0] != wanted:
            con.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('inventory', ?)", (wanted,))

    @staticmethod
    def _audit(con: sqlite3.Connection, now: float, event: str, lease: Lease, reason: str | None = None) -> None:
        o = lease.owner
        con.execute(f"INSERT INTO audit ({_AUDIT_COLS.split(', ', 1)[1]}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    (now, event, lease.id, json.dumps(lease.devices), lease.needs.devices, lease.needs.memory_gb,
                     lease.needs.sharing, o.pid, o.host, o.run_id, o.step_key, reason))


def _clamped_now(con: sqlite3.Connection, now: float | None = None) -> float:
    """Wall-clock now, raised to the last audit time: other processes' clocks may lag a little."""
    now = time.time() if now is None else now
    last = con.execute("SELECT at FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
    return max(now, last[0]) if last else now
