"""Keeping the Tinker service's worker alive: a dead or hung worker is replaced by a new one,
started with the same arguments on the same socket, and whatever depended on the old one is told.

- Dead: its process exited (`Popen.poll`: SIGKILL, the OOM killer, a crash).
- Hung: `misses` probes in a row got no answer within `probe_timeout_s` (`client.probe`: a
  connection's auth handshake, which the worker's accept and client threads serve, so a long
  training step in its compute thread does not delay it), or a call on one of the runtime's
  connections got no answer within its bound (`--worker-timeout-s`; `lost(..., hung=...)`).
  A hung worker is killed with SIGKILL first.

Each replacement counts `generation` up and calls every listener with the new generation, in
the supervisor's thread (the runtime reconnects its shared connection and reloads the
checkpoints it had loaded read-only; the service closes the training clients of the old worker
as lost). A worker that fails to start is started again with backoff (1 s, doubling to 60 s),
each failure logged on one line; meanwhile `health()` says why.

The new worker is a child of the supervisor's thread, and the worker's parent-death signal
(`client.start_worker(die_with_parent=True)`) fires when that thread ends: the thread lives
until `stop()`, which the service calls as it stops.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from tinker_pipelines.worker import WorkerError
from tinker_pipelines.worker.client import probe

log = logging.getLogger(__name__)

PROBE_S = 2.0
"""How often the worker is checked."""
PROBE_TIMEOUT_S = 10.0
"""A probe's bound: its handshake takes milliseconds, even beside a training step."""
MISSES = 2
"""Probes in a row without an answer that make a worker hung (one may fall on a stall of the machine)."""
MAX_BACKOFF_S = 60.0


def clock(t: float) -> str:
    """A wall-clock time as messages show it: `2025-01-31 14:03:07 UTC`."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass
class WorkerLoss:
    """What happened to the worker of one generation."""

    generation: int
    cause: str
    """'died (signal 9, SIGKILL)', 'exited with code 1', 'hung (...)'."""
    at: float
    restarted_at: float | None = None
    restart_error: str | None = None
    """Why the latest attempt to start its replacement failed (None once one runs)."""

    def describe(self, base: str) -> str:
        """`the worker for BASE died (signal 9, SIGKILL) at T and was restarted at T2`."""
        text = f"the worker for {base} {self.cause} at {clock(self.at)}"
        if self.restarted_at is not None:
            return f"{text} and was restarted at {clock(self.restarted_at)}"
        if self.restart_error is not None:
            return f"{text}; starting a new one failed ({self.restart_error}) and is being tried again"
        return f"{text} and is being restarted"


class WorkerSupervisor:
    """Watches the worker `proc` listening at `address` and replaces it (`start()` -> a new
    `Popen`, ready for clients) when it dies or hangs."""

    def __init__(self, proc: subprocess.Popen, start: Callable[[], subprocess.Popen], address: str | Path,
                 base: str, probe_s: float = PROBE_S, probe_timeout_s: float = PROBE_TIMEOUT_S,
                 misses: int = MISSES, log_path: str | Path | None = None):
        self.address, self.base, self.log_path = str(address), base, log_path
        self.probe_s, self.probe_timeout_s, self.misses = probe_s, probe_timeout_s, misses
        self.listeners: list[Callable[[int], None]] = []
        """Called with the new generation once a new worker runs (in the supervisor's thread)."""
        self._start = start
        self._proc = proc
        self._generation = 0
        self._restarting = False
        self._losses: dict[int, WorkerLoss] = {}
        self._hung: tuple[int, str] | None = None
        """(generation, why) of a call that got no answer in time: the next check replaces that worker."""
        self._missed = 0
        self._checks_started = self._checks_done = 0
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tinker-worker-supervisor", daemon=True)

    @property
    def proc(self) -> subprocess.Popen:
        """The worker process now."""
        return self._proc

    @property
    def generation(self) -> int:
        """How many times the worker was replaced."""
        return self._generation

    def start(self) -> WorkerSupervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the service is stopping its worker); a restart under way is abandoned."""
        self._stopping.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # -- what the runtime and the service ask ---------------------------------------------------
    def loss(self, generation: int) -> WorkerLoss | None:
        """What happened to the worker of `generation` (None: nothing, it is the one running)."""
        with self._cond:
            return self._losses.get(generation)

    def lost(self, generation: int, hung: str | None = None, wait_s: float | None = None) -> WorkerLoss | None:
        """A call on a connection to the worker of `generation` failed (`hung`: it got no answer
        in time, and says so). Check the worker now and wait up to `wait_s` (default: a probe's
        bound and 5 s) for the verdict: its `WorkerLoss`, or None when the worker is fine (the
        connection alone broke)."""
        wait_s = self.probe_timeout_s + 5.0 if wait_s is None else wait_s
        with self._cond:
            if generation in self._losses:
                return self._losses[generation]
            if hung is not None and generation == self._generation:
                self._hung = (generation, hung)
            target = self._checks_started + 1  # a check that starts after this report
        self._wake.set()
        with self._cond:
            self._cond.wait_for(lambda: generation in self._losses or self._checks_done >= target
                                or self._stopping.is_set(), wait_s)
            return self._losses.get(generation)

    def wait_ready(self, timeout_s: float) -> int:
        """The generation of the running worker, once none is being started (at most `timeout_s`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._restarting or self._stopping.is_set(), timeout_s):
                loss = self._losses.get(self._generation)
                raise WorkerError(f"{loss.describe(self.base) if loss else 'the worker is being restarted'}; it "
                                  f"was not back within {timeout_s:g} s")
            return self._generation

    def health(self, timeout_s: float = 2.0) -> str | None:
        """None when the worker answers a probe within `timeout_s`, else why not (one line)."""
        with self._cond:
            if self._restarting:
                loss = self._losses.get(self._generation)
                return loss.describe(self.base) if loss else f"the worker for {self.base} is being restarted"
            proc = self._proc
        cause = _exit_cause(proc)
        if cause is not None:
            return f"the worker for {self.base} (pid {proc.pid}) {cause}; the service is restarting it"
        reason = probe(self.address, timeout_s)
        if reason is not None:
            return f"the worker for {self.base} (pid {proc.pid}) does not answer: {reason}"
        return None

    # -- the supervisor's thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.probe_s)
            self._wake.clear()
            if self._stopping.is_set():
                break
            with self._cond:
                self._checks_started += 1
                started = self._checks_started
            try:
                self._check()
            except Exception as e:  # noqa: BLE001 - this thread must outlive any one check (see the module doc)
                log.warning("worker supervisor: a check failed (%s: %s); checking again in %g s",
                            type(e).__name__, _line(e), self.probe_s)
            with self._cond:
                self._checks_done = max(self._checks_done, started)
                self._cond.notify_all()

    def _check(self) -> None:
        gen, proc = self._generation, self._proc
        cause = _exit_cause(proc) or self._reported_hang(gen)
        if cause is None:
            reason = probe(self.address, self.probe_timeout_s)
            if reason is None:
                self._missed = 0
                return
            try:  # a worker being killed closes its sockets a moment before its exit can be collected
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            cause = _exit_cause(proc) or self._reported_hang(gen)  # a call may have timed out meanwhile
            if cause is None:
                self._missed += 1
                log.warning("the worker for %s (pid %d) did not answer a probe (%d of %d before it counts as "
                            "hung): %s", self.base, proc.pid, self._missed, self.misses, reason)
                if self._missed < self.misses:
                    return
                cause = f"hung ({reason}; {self._missed} probes in a row)"
        self._replace(gen, proc, cause)

    def _reported_hang(self, gen: int) -> str | None:
        hung = self._hung
        return f"hung ({hung[1]})" if hung is not None and hung[0] == gen else None

    def _replace(self, gen: int, proc: subprocess.Popen, cause: str) -> None:
        loss = WorkerLoss(gen, cause, time.time())
        with self._cond:
            self._losses[gen] = loss
            for old in [g for g in self._losses if g < gen - 16]:
                del self._losses[old]
            self._restarting = True
            self._cond.notify_all()
        log.warning("the worker for %s (pid %d) %s; starting a new one%s", self.base, proc.pid, cause,
                    f" (the worker's log: {self.log_path})" if self.log_path else "")
        _kill(proc)
        new = self._start_new(loss)
        if new is None:
            return  # stopping
        with self._cond:
            self._proc, self._generation = new, gen + 1
            self._missed, self._hung = 0, None
            loss.restarted_at, loss.restart_error = time.time(), None
        for listener in self.listeners:
            try:
                listener(gen + 1)
            except Exception as e:  # noqa: BLE001 - one listener's failure must not keep the worker down
                log.warning("after the worker restart, %s failed: %s: %s", getattr(listener, "__qualname__", listener),
                            type(e).__name__, _line(e))
        with self._cond:
            self._restarting = False
            self._cond.notify_all()
        log.warning("the worker for %s is back (pid %d, generation %d), %.1f s after it %s", self.base, new.pid,
                    gen + 1, time.time() - loss.at, cause)

    def _start_new(self, loss: WorkerLoss) -> subprocess.Popen | None:
        delay = 1.0
        while not self._stopping.is_set():
            try:
                return self._start()
            except Exception as e:  # noqa: BLE001 - logged, and tried again: the service stays up without a worker
                loss.restart_error = _line(e)
                log.warning("starting a new worker for %s failed (%s: %s); trying again in %g s", self.base,
                            type(e).__name__, loss.restart_error, delay)
            if self._stopping.wait(delay):
                break
            delay = min(delay * 2, MAX_BACKOFF_S)
        return None


def _exit_cause(proc: subprocess.Popen) -> str | None:
    rc = proc.poll()
    if rc is None:
        return None
    if rc < 0:
        try:
            return f"died (signal {-rc}, {signal.Signals(-rc).name})"
        except ValueError:
            return f"died (signal {-rc})"
    return f"exited with code {rc}"


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL (a stopped process dies of it too) and collect it, so its socket can be taken over."""
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        log.warning("the old worker (pid %d) did not exit within 60 s of SIGKILL", proc.pid)


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
