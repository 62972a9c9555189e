"""The reservation ledger: real processes contending, SIGKILLed owners, reused pids, heartbeat TTL, timeouts."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sqlite3
import threading
import time

import pytest

from tinker_pipelines.scheduler import Inventory, LeaseLost, LeaseOwner, Ledger, StepNeeds, replay_audit

ONE_GPU = {"devices": [{"memory_gb": 80}]}
EXCL = StepNeeds(1, 0.0, "exclusive")
HALF = StepNeeds(1, 50.0, "lora")  # two of these do not fit on one 80 GB device


def _contend(path: str, name: str, rounds: int, hold_s: float, start: mp.Event, out: mp.Queue) -> None:
    ledger, inventory = Ledger(path), Inventory.from_config(ONE_GPU)
    owner = LeaseOwner.current(run_id=name, step_key="contend")
    start.wait(10)
    spans = []
    for r in range(rounds):
        lease = ledger.acquire(owner, EXCL if r % 2 else HALF, inventory, timeout_s=15, poll_s=0.002)
        t0 = time.time()
        time.sleep(hold_s)
        t1 = time.time()
        assert ledger.release(lease)
        spans.append((t0, t1))
    out.put((name, spans))


def _hold_forever(path: str, out: mp.Queue) -> None:
    ledger = Ledger(path)
    lease = ledger.acquire(LeaseOwner.current(run_id="doomed"), EXCL, Inventory.from_config(ONE_GPU), timeout_s=10)
    out.put(lease.id)
    time.sleep(60)


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "ledger.sqlite")


def _waiting_rows(path: str) -> int:
    with sqlite3.connect(path) as con:
        return con.execute("SELECT COUNT(*) FROM waiting").fetchone()[0]


def test_two_processes_contending_for_one_device_never_overlap(path):
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    Ledger(path)  # create the file before the children race to
    procs = [ctx.Process(target=_contend, args=(path, f"p{i}", 8, 0.01, start, out)) for i in range(2)]
    for p in procs:
        p.start()
    start.set()
    results = dict(out.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    # What the holders saw: their critical sections never intersect.
    spans = sorted((t0, t1, name) for name, ss in results.items() for t0, t1 in ss)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        assert a == b or end <= begin, f"{a} and {b} held the device at once"
    # What the ledger recorded: the same, checked by replaying the audit log.
    events = Ledger(path).audit_log()
    report = replay_audit(events, Inventory.from_config(ONE_GPU))
    assert report.violations == () and not report.oversubscribed and not report.exclusive_shared
    assert report.grants == 16 and report.max_tenants == (1,)
    assert {e.run_id for e in events} == {"p0", "p1"} and len({e.pid for e in events}) == 2
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert all(a.at <= b.at for a, b in zip(events, events[1:]))
    assert 0 < report.utilization <= 1
    assert Ledger(path).leases() == () and _waiting_rows(path) == 0


def test_a_sigkilled_holder_loses_its_lease_to_the_next_acquirer(path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_hold_forever, args=(path, out))
    p.start()
    try:
        dead_id = out.get(timeout=30)
        ledger, inventory = Ledger(path), Inventory.from_config(ONE_GPU)
        with pytest.raises(TimeoutError):  # alive: it really holds the device
            ledger.acquire(LeaseOwner.current(), EXCL, inventory, timeout_s=0.1, poll_s=0.02)
        os.kill(p.pid, signal.SIGKILL)  # not reaped yet: a zombie counts as gone
        lease = ledger.acquire(LeaseOwner.current(run_id="next"), EXCL, inventory, timeout_s=5, poll_s=0.02)
    finally:
        p.kill()
        p.join(10)
    assert lease.devices == (0,)
    expiry = [e for e in ledger.audit_log() if e.event == "expire"]
    assert [e.lease_id for e in expiry] == [dead_id] and "is gone" in expiry[0].reason
    assert expiry[0].run_id == "doomed" and expiry[0].pid == p.pid
    assert replay_audit(ledger.audit_log(), inventory).violations == ()


def test_a_reused_pid_is_not_mistaken_for_the_owner(path):
    ledger, inventory = Ledger(path), Inventory.from_config(ONE_GPU)
    me = LeaseOwner.current()
    assert me.start_time is not None and me.start_time.count(":") >= 1
    impostor = LeaseOwner(os.getpid(), "another-boot:123", socket.gethostname(), "old-run", "old-step")
    old = ledger.acquire(impostor, EXCL, inventory, timeout_s=1)
    assert ledger.expire_dead() == (old,)
    mine = ledger.acquire(me, EXCL, inventory, timeout_s=1)
    assert ledger.expire_dead() == () and ledger.leases() == (mine,)


class FakeClock:
    """Stands in for the ledger's `time` module: wall time moves only when told, so TTL tests
    do not depend on how loaded the machine is."""

    def __init__(self) -> None:
        self.now = time.time()
        self.monotonic, self.sleep = time.monotonic, time.sleep

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    from tinker_pipelines.scheduler import ledger

    fake = FakeClock()
    monkeypatch.setattr(ledger, "time", fake)
    return fake


def test_owner_on_another_host_expires_only_by_ttl(path, clock):
    inventory = Inventory.from_config(ONE_GPU)
    foreign = LeaseOwner(1, None, "some-other-host")
    lease = Ledger(path).acquire(foreign, EXCL, inventory, timeout_s=1)
    clock.now += 3600
    assert Ledger(path).expire_dead() == ()  # pid 1 here says nothing about that host; no TTL
    Ledger(path).release(lease)
    lease = Ledger(path, ttl_s=30).acquire(foreign, EXCL, inventory, timeout_s=1)
    clock.now += 31
    assert Ledger(path).expire_dead() == (lease,)


def test_heartbeat_keeps_a_lease_and_its_absence_expires_it(path, clock):
    ledger, inventory = Ledger(path, ttl_s=30), Inventory.from_config(ONE_GPU)
    lease = ledger.acquire(LeaseOwner.current(run_id="r", step_key="s"), EXCL, inventory, timeout_s=1)
    for _ in range(5):
        clock.now += 20
        lease = ledger.heartbeat(lease)
        assert ledger.expire_dead() == ()
    assert lease.heartbeat_at == clock.now
    clock.now += 31
    with pytest.raises(LeaseLost):
        ledger.heartbeat(lease)  # too late, even though nobody had expired it yet
    assert ledger.leases() == () and ledger.release(lease) is False
    (expiry,) = [e for e in ledger.audit_log() if e.event == "expire"]
    assert "no heartbeat for 31.0 s (ttl 30 s)" in expiry.reason and (expiry.run_id, expiry.step_key) == ("r", "s")
    assert ledger.acquire(LeaseOwner.current(), EXCL, inventory, timeout_s=1).devices == (0,)


def test_acquire_times_out_and_leaves_no_waiter_behind(path):
    ledger, inventory = Ledger(path), Inventory.from_config(ONE_GPU)
    held = ledger.acquire(LeaseOwner.current(), HALF, inventory, timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no devices for 1 x 50 GB lora within 0.3 s"):
        ledger.acquire(LeaseOwner.current(step_key="late"), HALF, inventory, timeout_s=0.3, poll_s=0.05)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert _waiting_rows(path) == 0 and ledger.leases() == (held,)
    # A request that fits beside the holder is granted at once.
    assert ledger.acquire(LeaseOwner.current(), StepNeeds(1, 30.0, "lora"), inventory, timeout_s=0).devices == (0,)


def test_a_request_that_can_never_fit_fails_at_once(path):
    ledger, inventory = Ledger(path), Inventory.from_config(ONE_GPU)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="can never be placed"):
        ledger.acquire(LeaseOwner.current(), StepNeeds(2, 0.0, "exclusive"), inventory, timeout_s=60)
    with pytest.raises(ValueError, match="largest device has 80 GB"):
        ledger.acquire(LeaseOwner.current(), StepNeeds(1, 81.0, "lora"), inventory, timeout_s=60)
    assert time.monotonic() - t0 < 1.0 and _waiting_rows(path) == 0


def test_leases_against_a_different_inventory_are_refused(path):
    ledger = Ledger(path)
    lease = ledger.acquire(LeaseOwner.current(), HALF, Inventory.from_config(ONE_GPU), timeout_s=1)
    small = Inventory.from_config({"devices": [{"memory_gb": 60}]})
    with pytest.raises(ValueError, match="different inventory"):
        ledger.acquire(LeaseOwner.current(), HALF, small, timeout_s=1)
    ledger.release(lease)
    assert ledger.acquire(LeaseOwner.current(), HALF, small, timeout_s=1).devices == (0,)


@pytest.mark.parametrize("starve_after_s, younger_granted", [(0.2, False), (None, True)])
def test_a_starved_request_stops_younger_ones_from_backfilling(path, starve_after_s, younger_granted):
    ledger, inventory = Ledger(path, starve_after_s=starve_after_s), Inventory.from_config(ONE_GPU)
    small = StepNeeds(1, 20.0, "lora")
    held = ledger.acquire(LeaseOwner.current(), small, inventory, timeout_s=1)
    got = []
    big = threading.Thread(target=lambda: got.append(ledger.acquire(
        LeaseOwner.current(step_key="big"), EXCL, inventory, timeout_s=5, poll_s=0.02)))
    big.start()
    while _waiting_rows(path) == 0:
        time.sleep(0.01)
    time.sleep(0.3)  # the exclusive request has now waited longer than 0.2 s
    try:
        younger = ledger.acquire(LeaseOwner.current(step_key="small"), small, inventory, timeout_s=0.2, poll_s=0.02)
        ledger.release(younger)
        granted = True
    except TimeoutError:
        granted = False
    ledger.release(held)
    big.join(10)
    assert granted is younger_granted
    assert got and got[0].owner.step_key == "big"
    assert replay_audit(ledger.audit_log(), inventory).violations == ()


def test_replay_audit_flags_oversubscription_and_sharing():
    from tinker_pipelines.scheduler import AuditEvent

    inventory = Inventory.from_config({"count": 2, "memory_gb": 80})
    lora50 = StepNeeds(1, 50.0, "lora")
    events = [AuditEvent(1, 0.0, "grant", 1, (0,), lora50), AuditEvent(2, 1.0, "grant", 2, (0,), lora50),
              AuditEvent(3, 2.0, "grant", 3, (1,), EXCL), AuditEvent(4, 3.0, "grant", 4, (1,), StepNeeds(1, 1.0, "lora")),
              AuditEvent(5, 4.0, "release", 1, (0,), lora50), AuditEvent(6, 4.0, "release", 1, (0,), lora50)]
    report = replay_audit(events, inventory, until=10.0)
    assert report.oversubscribed and report.exclusive_shared and len(report.violations) == 3
    assert report.max_reserved_gb == (100.0, 80.0) and report.max_tenants == (2, 2)
    assert report.busy_s == (10.0, 8.0) and report.span_s == 10.0 and report.utilization == pytest.approx(0.9)


def test_replay_audit_reports_malformed_grants_without_calling_them_sharing():
    from tinker_pipelines.scheduler import AuditEvent

    report = replay_audit([AuditEvent(1, 0.0, "grant", 1, (0, 0), StepNeeds(2, 0.0, "exclusive")),
                           AuditEvent(2, 1.0, "grant", 2, (5,), EXCL)], Inventory.from_config(ONE_GPU))
    assert len(report.violations) == 2 and not report.exclusive_shared and not report.oversubscribed
    assert report.busy_s == (0.0,) and report.span_s == 1.0


def test_a_pinned_request_gets_only_its_device_or_waits(path):
    """`only=`: how a worker leases the very device its step leased."""
    inventory = Inventory.from_config({"devices": [{"memory_gb": 16}, {"memory_gb": 8}]})
    ledger = Ledger(path)
    me = LeaseOwner.current()
    assert ledger.acquire(me, StepNeeds(1, 2, "lora"), inventory, timeout_s=1, only=(1,)).devices == (1,)
    held = ledger.acquire(me, StepNeeds(1, 0, "exclusive"), inventory, timeout_s=1, only=(0,))
    with pytest.raises(TimeoutError):  # device 0 is held exclusively; device 1 is not allowed
        ledger.acquire(me, StepNeeds(1, 2, "lora"), inventory, timeout_s=0.2, poll_s=0.05, only=(0,))
    ledger.release(held)
    with pytest.raises(ValueError, match="can never be placed"):  # device 1 has 8 GB
        ledger.acquire(me, StepNeeds(1, 10, "lora"), inventory, timeout_s=1, only=(1,))
    with pytest.raises(ValueError, match=r"on devices \[5\]"):
        ledger.acquire(me, StepNeeds(1, 2, "lora"), inventory, timeout_s=1, only=(5,))


def test_a_lora_step_joins_the_device_where_a_worker_holds_its_base(path):
    """The ledger reads which bases workers' leases hold (`worker:<base>`): a step of that base
    goes there at its resident cost (its adapter and batch), one of another base goes to the idle
    device with its full estimate, and a step that cannot fit beside a base it lacks waits."""
    ledger, inventory = Ledger(path), Inventory.from_config({"count": 2, "memory_gb": 16})
    worker = ledger.acquire(LeaseOwner.current(run_id="w", step_key="worker:base-a"), StepNeeds(1, 10, "lora"),
                            inventory, timeout_s=5, only=(1,))
    warm = ledger.acquire(LeaseOwner.current(run_id="r1", step_key="s"),
                          StepNeeds(1, 12, "lora", base="base-a", resident_gb=1.5), inventory, timeout_s=5)
    assert warm.devices == (1,) and warm.needs.memory_gb == 1.5  # 12 GB would not fit beside the worker's 10
    cold = ledger.acquire(LeaseOwner.current(run_id="r2", step_key="s"),
                          StepNeeds(1, 12, "lora", base="base-b", resident_gb=1.5), inventory, timeout_s=5)
    assert cold.devices == (0,) and cold.needs.memory_gb == 12
    with pytest.raises(TimeoutError):  # base-b's worker holds no lease yet: a third copy fits nowhere
        ledger.acquire(LeaseOwner.current(run_id="r3", step_key="s"),
                       StepNeeds(1, 12, "lora", base="base-c", resident_gb=1.5), inventory, timeout_s=0.3, poll_s=0.05)
    for lease in (worker, warm, cold):
        assert ledger.release(lease)
    assert replay_audit(ledger.audit_log(), inventory).oversubscribed == 0
