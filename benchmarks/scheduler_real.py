"""The real part of `benchmarks.scheduler`: a fresh Dagster instance with the run queue, a daemon,
a code server and (by default) a resident worker on 2 simulated GPUs; `real_part` submits the
burst of `scheduler_burst` at once and measures it from the run records, the event logs and the
device ledger's audit log (`_measure`); `print_real` prints the table."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.scheduler_burst import KINDS_REAL, MODEL, plan
from tinker_pipelines.scheduler import Inventory, Ledger, replay_audit

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPUS_REAL = 2


@dataclass
class KindStats:
    """What the real part measured for one kind of run."""

    runs: int = 0
    success: int = 0
    wall_s: list[float] = field(default_factory=list)
    queue_wait_s: list[float] = field(default_factory=list)
    steps: int = 0
    """Device steps (leases) over all runs."""
    lease_s: list[float] = field(default_factory=list)
    """Per device step: grant to release/expiry."""
    step_s: list[float] = field(default_factory=list)
    """Per device step: STEP_START to its end (in-step time, without the process's imports)."""
    launch_to_grant_s: list[float] = field(default_factory=list)
    """Per device step: the executor's launch event to the lease grant (process start + lease wait)."""
    run_step_s: list[float] = field(default_factory=list)
    """Per successful run: sum of its device steps' in-step time."""
    devices: int = 0
    memory_gb: float = 0.0
    sharing: str = ""

    def summary(self) -> dict[str, Any]:
        return {"runs": self.runs, "success": self.success, "wall_s": _r(_mean(self.wall_s)),
                "queue_wait_s": _r(_mean(self.queue_wait_s)), "device_steps": self.steps,
                "lease_s": _r(_mean(self.lease_s)), "step_s": _r(_mean(self.step_s)),
                "launch_to_grant_s": _r(_mean(self.launch_to_grant_s)), "run_step_s": _r(_mean(self.run_step_s)),
                "devices": self.devices, "memory_gb": self.memory_gb, "sharing": self.sharing}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _r(x: float, nd: int = 2) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group (SIGKILL after 20 s); the group may outlive its leader (run workers)."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            if sig == signal.SIGTERM:
                return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass


def _stop_step_processes(ledger_path: Path) -> None:
    """Kill the step processes that still hold or wait for a lease (each is its own session leader:
    the executor starts them with start_new_session); only pids this ledger names."""
    if not ledger_path.exists():
        return
    con = sqlite3.connect(str(ledger_path), timeout=30)
    try:
        pids = {p for (p,) in con.execute("SELECT pid FROM leases UNION SELECT pid FROM waiting")}
    finally:
        con.close()
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_for_server(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    from dagster._grpc.client import DagsterGrpcClient

    client = DagsterGrpcClient(port=port, host="127.0.0.1")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the code server exited: {log.read_text()[-3000:]}")
        try:
            client.ping("ready")
            return
        except Exception:
            time.sleep(0.5)
    raise RuntimeError(f"code server not up after {timeout:.0f} s: {log.read_text()[-3000:]}")


def _wait_for_daemon(instance, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until the daemon's run-queue loop has sent a heartbeat."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited: {log.read_text()[-3000:]}")
        if "QUEUED_RUN_COORDINATOR" in instance.get_daemon_heartbeats():
            return
        time.sleep(0.5)
    raise RuntimeError(f"the daemon sent no heartbeat within {timeout:.0f} s: {log.read_text()[-3000:]}")


def real_part(runs: int, concurrency: int, gpu_memory_gb: float, timeout_s: float, use_worker: bool,
              keep: bool, log=print) -> dict[str, Any]:
    """Submit the burst to a real queue with a daemon; returns the figures and per-kind measurements."""
    import dagster as dg
    from dagster._cli.job import execute_launch_command
    from dagster._cli.workspace.cli_target import RepositoryOpts, get_repository_from_cli_opts
    from dagster_shared.cli import WorkspaceOpts

    from tinker_pipelines.tracking import TinkerHome

    tmp = Path(tempfile.mkdtemp(prefix="tinker-bench-scheduler-"))
    home = TinkerHome(tmp / "home").ensure(devices=concurrency)
    inventory_cfg = {"count": GPUS_REAL, "memory_gb": gpu_memory_gb}
    inventory = Inventory.from_config(inventory_cfg)
    ledger_path = home.dagster_home / "tinker_devices.sqlite"
    env = {**os.environ, "DAGSTER_HOME": str(home.dagster_home), "TINKER_HOME": str(home.root),
           "TINKER_EXECUTOR": "gpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)}
    os.environ["DAGSTER_HOME"] = str(home.dagster_home)  # this process's instance (submission, reading back)
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    try:
        if use_worker:
            address = tmp / "worker.sock"
            env["TINKER_WORKER"] = str(address)
            threads = str(max(1, min(2, os.cpu_count() or 1)))
            procs.append(_start([sys.executable, "-m", "tinker_pipelines", "worker", "--model", MODEL["name"],
                                 "--seed", str(MODEL["seed"]), "--socket", str(address), "--device", "cpu",
                                 "--threads", threads], env, tmp / "worker.log"))
        port = _free_port()
        workspace = tmp / "workspace.yaml"
        workspace.write_text(f"load_from:\n  - grpc_server:\n      host: 127.0.0.1\n      port: {port}\n"
                             "      location_name: tinker\n")
        server_log = tmp / "grpc.log"
        server = _start([str(BIN / "dagster"), "api", "grpc", "-m", "assets.definitions",
                         "-h", "127.0.0.1", "-p", str(port)], env, server_log)
        procs.append(server)
        _wait_for_server(port, server, server_log, timeout=300)
        if use_worker:
            from tinker_pipelines.worker.client import WorkerClient

            deadline = time.monotonic() + 300
            while True:
                if procs[0].poll() is not None:
                    raise RuntimeError(f"the worker exited: {(tmp / 'worker.log').read_text()[-3000:]}")
                try:
                    WorkerClient(str(address)).close()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the worker did not answer within 300 s") from None
                    time.sleep(0.5)
        ws_opts = WorkspaceOpts(workspace=[str(workspace)])
        with dg.DagsterInstance.get() as instance:
            with get_repository_from_cli_opts(instance, dg.__version__, ws_opts, RepositoryOpts()) as repo:
                for name in ("continue_training", "new_adapter_versions"):  # exactly the submitted runs
                    if repo.has_sensor(name):
                        sensor = repo.get_sensor(name)
                        instance.stop_sensor(sensor.get_remote_origin_id(), sensor.selector_id, sensor)
                kinds = tuple(k for k in KINDS_REAL if k != "inference" or repo.has_job("inference"))
            if "inference" not in kinds:
                log("note: this code location has no `inference` job; its share of the runs goes to the other kinds")
            specs = plan(runs, kinds)
            instance.add_dynamic_partitions("iterations", [s.partition for s in specs if s.job == "rl"])
            instance.add_dynamic_partitions("experiments", sorted({s.partition.split(":")[0] for s in specs
                                                                   if s.partition}))
            execution = {"execution": {"config": {"inventory": inventory_cfg}}}
            procs.append(_start([str(BIN / "dagster-daemon"), "run", "-w", str(workspace)], env, tmp / "daemon.log"))
            _wait_for_daemon(instance, procs[-1], tmp / "daemon.log", timeout=300)
            ready = time.monotonic()
            run_ids: list[str] = []
            for spec in specs:
                tags = {}
                if spec.partition:
                    tags["dagster/partition"] = spec.partition
                if spec.experiment:
                    tags["tinker/experiment"] = spec.experiment
                run = execute_launch_command(instance=instance, workspace_opts=ws_opts, job_name=spec.job,
                                             config_json=json.dumps({**spec.config, **execution}),
                                             tags=json.dumps(tags))
                run_ids.append(run.run_id)
            kind_of = dict(zip(run_ids, (s.kind for s in specs)))
            submitted = time.monotonic()
            log(f"code server, worker and daemon up in {ready - t0:.1f} s; {len(specs)} runs submitted in "
                f"{submitted - ready:.1f} s: " + ", ".join(f"{k} {sum(s.kind == k for s in specs)}" for k in kinds))
            ledger = Ledger(str(ledger_path))
            max_in_progress = max_leases = 0
            last_print = time.monotonic()
            while True:
                if procs[-1].poll() is not None:
                    raise RuntimeError(f"the daemon exited: {(tmp / 'daemon.log').read_text()[-3000:]}")
                current = instance.get_runs(dg.RunsFilter(run_ids=run_ids))
                active = sum(r.status in (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED) for r in current)
                max_in_progress = max(max_in_progress, active)
                ledger.expire_dead()
                max_leases = max(max_leases, len(ledger.leases()))
                done = sum(r.is_finished for r in current)
                if done == len(run_ids) or time.monotonic() - submitted > timeout_s:
                    break
                if time.monotonic() - last_print >= 60:
                    log(f"  {time.monotonic() - submitted:5.0f} s: {done} finished, {active} in progress, "
                        f"{len(run_ids) - done - active} queued")
                    last_print = time.monotonic()
                time.sleep(1.0)
            finished = time.monotonic()
            ledger.expire_dead()
            result = _measure(instance, run_ids, kind_of, kinds, ledger, inventory)
    finally:
        for proc in reversed(procs):
            _stop(proc)
        _stop_step_processes(ledger_path)
    result.update({"runs": len(run_ids), "real_wall_s": round(finished - ready, 1),
                   "real_setup_s": round(ready - t0, 1), "submit_s": round(submitted - ready, 1),
                   "max_runs_in_progress": max_in_progress, "max_leases_at_once": max_leases, "concurrency": concurrency, "worker": use_worker,
                   "gpu_memory_gb": gpu_memory_gb})
    if keep:
        result["home"] = str(tmp)
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _measure(instance, run_ids: list[str], kind_of: dict[str, str], kinds: tuple[str, ...], ledger: Ledger,
             inventory: Inventory) -> dict[str, Any]:
    import dagster as dg

    records = {r.dagster_run.run_id: r for r in instance.get_run_records(dg.RunsFilter(run_ids=run_ids))}
    audit = ledger.audit_log()
    grants = {e.lease_id: e for e in audit if e.event == "grant"}
    ends = {e.lease_id: e.at for e in audit if e.event in ("release", "expire")}
    leases_of: dict[tuple[str, str], list[Any]] = {}
    for lid, g in grants.items():
        leases_of.setdefault((g.run_id, g.step_key), []).append((g, ends.get(lid)))
    stats = {k: KindStats() for k in kinds}
    last_end = 0.0
    for run_id in run_ids:
        rec, st = records[run_id], stats[kind_of[run_id]]
        st.runs += 1
        ok = rec.dagster_run.status == dg.DagsterRunStatus.SUCCESS
        st.success += ok
        if rec.start_time is not None:
            st.queue_wait_s.append(rec.start_time - rec.create_timestamp.timestamp())
            if rec.end_time is not None:
                st.wall_s.append(rec.end_time - rec.start_time)
                last_end = max(last_end, rec.end_time)
        launched, started, ended = {}, {}, {}
        for e in instance.all_logs(run_id):
            ev = e.dagster_event
            if ev is None or not ev.step_key:
                continue
            if ev.event_type == dg.DagsterEventType.STEP_WORKER_STARTING:
                launched.setdefault(ev.step_key, e.timestamp)
            elif ev.event_type == dg.DagsterEventType.STEP_START:
                started[ev.step_key] = e.timestamp
            elif ev.event_type in (dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE):
                ended[ev.step_key] = e.timestamp
        run_step = 0.0
        for (rid, step_key), held in leases_of.items():
            if rid != run_id:
                continue
            for g, end in held:
                st.steps += 1
                st.devices = max(st.devices, g.needs.devices)
                st.memory_gb = max(st.memory_gb, g.needs.memory_gb)
                st.sharing = g.needs.sharing if st.sharing in ("", g.needs.sharing) else "mixed"
                if end is not None:
                    st.lease_s.append(end - g.at)
                if step_key in launched:
                    st.launch_to_grant_s.append(g.at - launched[step_key])
            if step_key in started and step_key in ended:
                st.step_s.append(ended[step_key] - started[step_key])
                run_step += ended[step_key] - started[step_key]
        if ok:
            st.run_step_s.append(run_step)
    report = replay_audit(audit, inventory, until=max([last_end] + [e.at for e in audit]) if audit else None)
    bad = sum(1 for v in report.violations if "GB reserved" in v or "shared by" in v)
    completed = sum(s.success for s in stats.values())
    return {"completed": completed, "lost": len(run_ids) - completed, "oversubscribed": bad,
            "audit_violations": len(report.violations), "device_utilization": round(report.utilization, 4),
            "device_busy_s": [round(b, 1) for b in report.busy_s], "audit_span_s": round(report.span_s, 1),
            "max_tenants": list(report.max_tenants), "grants": report.grants,
            "failed": sum(r.dagster_run.status == dg.DagsterRunStatus.FAILURE for r in records.values()),
            "unfinished": sum(not r.dagster_run.is_finished for r in records.values()),
            "kinds": {k: s.summary() for k, s in stats.items()}}


def print_real(r: dict[str, Any], log=print) -> None:
    log(f"\nreal: {r['runs']} runs on {GPUS_REAL} simulated x {r['gpu_memory_gb']:g} GB GPUs, queue/pool "
        f"{r['concurrency']}, {'a resident worker' if r['worker'] else 'no worker'}; submitted in {r['submit_s']:.0f} s "
        f"to a running daemon, all finished {r['real_wall_s']:.0f} s after the first submission "
        f"(setup {r['real_setup_s']:.0f} s)")
    cols = ("runs", "success", "wall_s", "queue_wait_s", "device_steps", "lease_s", "step_s", "launch_to_grant_s")
    log(f"{'kind':10}" + "".join(f"{c:>18}" for c in cols) + "   needs")
    for kind, s in r["kinds"].items():
        cells = "".join(f"{'-' if s[c] is None else s[c]:>18}" for c in cols)
        log(f"{kind:10}{cells}   {s['devices']} x {s['memory_gb']:g} GB {s['sharing']}")
    log(f"completed {r['completed']}, lost {r['lost']} (failed {r['failed']}, unfinished {r['unfinished']}); "
        f"audit: {r['grants']} grants, oversubscribed {r['oversubscribed']}, violations {r['audit_violations']}, "
        f"max tenants per device {r['max_tenants']}, device utilization {r['device_utilization']:.3f} "
        f"(busy {r['device_busy_s']} s of {r['audit_span_s']:.0f} s); at most {r['max_runs_in_progress']} runs "
        f"in progress, {r['max_leases_at_once']} leases at once")
