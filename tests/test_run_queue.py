"""The run queue of the embedded instance, end to end: a real temporary `DAGSTER_HOME` with the
`dagster.yaml` that `TinkerHome.ensure` writes (sized here for 2 devices), the project's code
location served by one `dagster api grpc` process, the real `dagster-daemon run`, and a burst
of `sft` runs submitted the way `dagster job launch` does (`execute_launch_command`: the run is
created from the code location and handed to the instance's run coordinator).

Asserted: every run is QUEUED on submission; the daemon never has more runs in progress than
the `tinker/loads_model` limit (sampled while they run, and from the run records' start/end
times), and two runs of one experiment never overlap; the coordinator tagged each run with its
experiment; the steps took slots of the `tinker_device` pool and gave them back; all end SUCCESS.
Then a run worker is killed (SIGKILL) while its step holds a pool slot: the code server marks
the run FAILED and the monitoring daemon frees the slot within
`free_slots_after_run_end_seconds` + `poll_interval_seconds`.
The server and the daemon run in their own process groups and are killed at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from tinker_pipelines.schedule_rules import DEVICE_POOL, EXPERIMENT_TAG, LOADS_MODEL_TAG, queue_limits
from tinker_pipelines.tracking import TinkerHome
from tinker_pipelines.tracking.home import FREE_SLOTS_AFTER_RUN_END_S, MONITORING_POLL_S

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEVICES = 2
EXPERIMENTS = ["qa", "qa", "qb", "qc"]
"""Submission order: qa's second run waits for its first (one run per experiment) and qc for a
free device; qa and qb run together."""
SFT = {"seed": 0, "model": {"name": "tiny", "dtype": "float32"}, "env": {"path": "arithmetic", "kwargs": {"max_operand": 3}},
       "training": {"iterations": 1, "groups_per_batch": 2, "group_size": 2, "max_new_tokens": 2},
       "sft": {"steps": 2, "batch_size": 4, "examples": 8}, "eval": {"every": 1, "num_tasks": 2}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    else:  # the group may still hold run workers
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_server(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    from dagster._grpc.client import DagsterGrpcClient

    client = DagsterGrpcClient(port=port, host="127.0.0.1")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            client.ping("ready")
            return
        except Exception:
            time.sleep(0.5)
    raise AssertionError(f"code server not up after {timeout} s: {log.read_text()[-3000:]}")


def _worker_pid(instance: dg.DagsterInstance, run_id: str) -> int | None:
    """The pid of an in-process run's worker, from its "Executing steps in process" engine event."""
    for e in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        md = e.dagster_event.engine_event_data.metadata if e.dagster_event.engine_event_data else {}
        if "pid" in md and "step_keys" in md:
            return int(md["pid"].value)
    return None


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda t: (t[0], t[1]))
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def test_max_overlap():
    assert _max_overlap([(0, 2), (1, 3), (2, 4)]) == 2  # an end at t sorts before a start at t
    assert _max_overlap([(0, 1), (2, 3)]) == 1


def test_existing_dagster_yaml_is_kept_and_upgraded_by_appending(tmp_path):
    home = TinkerHome(tmp_path / "old")
    home.dagster_home.mkdir(parents=True)
    old = "# mine\ntelemetry:\n  enabled: false\n"
    home.dagster_yaml.write_text(old)
    assert home.ensure().dagster_yaml.read_text() == old  # never rewritten
    assert home.missing_run_queue_sections() == ["run_coordinator", "concurrency", "run_monitoring"]
    assert home.upgrade_dagster_yaml(devices=3) == ["run_coordinator", "concurrency", "run_monitoring"]
    assert home.dagster_yaml.read_text().startswith(old) and home.upgrade_dagster_yaml() == []
    with dg.DagsterInstance.from_config(str(home.dagster_home)) as instance:
        queue = instance.get_concurrency_config()
        assert queue.run_queue_config.max_concurrent_runs == queue_limits(3).max_concurrent_runs
        assert queue.pool_config.default_pool_limit == 3 and instance.run_monitoring_enabled

    queued = "run_coordinator:\n  module: dagster._core.run_coordinator\n  class: QueuedRunCoordinator\n"
    plain = TinkerHome(tmp_path / "plain")  # a queue of the user's own: kept, no run limits added
    plain.dagster_home.mkdir(parents=True)
    plain.dagster_yaml.write_text(queued)
    assert plain.upgrade_dagster_yaml(devices=1) == ["concurrency", "run_monitoring"]
    with dg.DagsterInstance.from_config(str(plain.dagster_home)) as instance:
        queue = instance.get_concurrency_config()
        assert queue.pool_config.default_pool_limit == 1 and not queue.run_queue_config.tag_concurrency_limits

    limited = TinkerHome(tmp_path / "limited")  # ... with limits of its own: Dagster refuses `concurrency` beside it
    limited.dagster_home.mkdir(parents=True)
    limited.dagster_yaml.write_text(queued + "  config:\n    max_concurrent_runs: 5\n")
    assert limited.upgrade_dagster_yaml(devices=1) == ["run_monitoring"]
    with dg.DagsterInstance.from_config(str(limited.dagster_home)) as instance:
        assert instance.get_concurrency_config().run_queue_config.max_concurrent_runs == 5


@pytest.mark.e2e
def test_burst_of_runs_is_queued_and_never_exceeds_the_limits(tmp_path):
    from dagster._cli.job import execute_launch_command
    from dagster_shared.cli import WorkspaceOpts

    limits = queue_limits(DEVICES)
    home = TinkerHome(tmp_path / "home").ensure(devices=DEVICES)
    env = {**os.environ, "DAGSTER_HOME": str(home.dagster_home), "TINKER_HOME": str(home.root),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    port = _free_port()
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(f"load_from:\n  - grpc_server:\n      host: 127.0.0.1\n      port: {port}\n"
                         "      location_name: tinker\n")
    procs: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        server_log = tmp_path / "grpc.log"
        procs.append(_start([str(BIN / "dagster"), "api", "grpc", "-m", "assets.definitions",
                             "-h", "127.0.0.1", "-p", str(port)], env, server_log))
        _wait_for_server(port, procs[0], server_log, timeout=180)
        with dg.DagsterInstance.from_config(str(home.dagster_home)) as instance:
            # the instance reads the written limits as Dagster's own config
            queue = instance.get_concurrency_config()
            assert type(instance.run_coordinator).__name__ == "TinkerRunCoordinator"
            assert queue.run_queue_config.max_concurrent_runs == limits.max_concurrent_runs
            assert queue.pool_config.default_pool_limit == limits.pool_limit == DEVICES
            assert {(t["key"], t["limit"]) for t in queue.run_queue_config.tag_concurrency_limits} == {
                (EXPERIMENT_TAG, 1), (LOADS_MODEL_TAG, DEVICES)}
            assert instance.run_monitoring_enabled and "MONITORING" in instance.get_required_daemon_types()

            instance.add_dynamic_partitions("experiments", sorted(set(EXPERIMENTS)) + ["qk"])
            runs = []
            for name in EXPERIMENTS:  # exactly `dagster job launch -w workspace.yaml -j sft ...`
                run = execute_launch_command(
                    instance=instance, workspace_opts=WorkspaceOpts(workspace=[str(workspace)]), job_name="sft",
                    config_json=json.dumps({"ops": {"sft_checkpoint": {"config": SFT}}}),
                    tags=json.dumps({"dagster/partition": name}))
                runs.append(run.run_id)
            submitted = time.monotonic()
            by_id = {r.run_id: r for r in instance.get_runs(dg.RunsFilter(run_ids=runs))}
            assert {by_id[r].status for r in runs} == {dg.DagsterRunStatus.QUEUED}  # no daemon yet
            for run_id, name in zip(runs, EXPERIMENTS):
                assert by_id[run_id].tags[EXPERIMENT_TAG] == name  # added by the coordinator
                assert by_id[run_id].tags[LOADS_MODEL_TAG] == "true"  # the job's run tag

            procs.append(_start([str(BIN / "dagster-daemon"), "run", "-w", str(workspace)], env,
                                tmp_path / "daemon.log"))
            in_progress, pool_claims = 0, 0
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                assert procs[1].poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
                current = instance.get_runs(dg.RunsFilter(run_ids=runs))
                active = (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)
                in_progress = max(in_progress, sum(r.status in active for r in current))
                info = instance.event_log_storage.get_concurrency_info(DEVICE_POOL)
                pool_claims = max(pool_claims, len(info.claimed_slots))
                if all(r.is_finished for r in current):
                    break
                time.sleep(0.5)
            finished = time.monotonic()

            records = {rec.dagster_run.run_id: rec for rec in instance.get_run_records(dg.RunsFilter(run_ids=runs))}
            statuses = [records[r].dagster_run.status for r in runs]
            assert statuses == [dg.DagsterRunStatus.SUCCESS] * len(runs), (
                statuses, (tmp_path / "daemon.log").read_text()[-2000:], server_log.read_text()[-3000:])
            for run_id in runs:  # queued first, then launched by the daemon (STARTING) and run
                types = [e.dagster_event.event_type for e in instance.all_logs(run_id) if e.dagster_event]
                order = [dg.DagsterEventType.RUN_ENQUEUED, dg.DagsterEventType.RUN_STARTING,
                         dg.DagsterEventType.RUN_START, dg.DagsterEventType.RUN_SUCCESS]
                assert [t for t in types if t in order] == order, types

            spans = {r: (records[r].start_time, records[r].end_time) for r in runs}
            overlap = _max_overlap(list(spans.values()))
            qa = [spans[r] for r, name in zip(runs, EXPERIMENTS) if name == "qa"]
            print(f"\nrun queue: {len(runs)} runs, limit {limits.model_runs}: at most {in_progress} in progress "
                  f"(sampled), {overlap} overlapping (run records), {pool_claims} pool slots held at once; "
                  f"qa runs {qa}; code server up + submit {submitted - started:.1f} s, daemon to all done "
                  f"{finished - submitted:.1f} s")
            assert 1 <= in_progress <= limits.model_runs and 1 <= overlap <= limits.model_runs  # never a third
            # qa and qb were let through together: seen in progress at once (STARTING counts), or
            # their recorded spans overlap (a run of ~3 s can end before the other's process starts)
            assert max(in_progress, overlap) == limits.model_runs
            assert qa[0][1] <= qa[1][0] or qa[1][1] <= qa[0][0]  # one run per experiment at a time
            assert 1 <= pool_claims <= limits.pool_limit
            info = instance.event_log_storage.get_concurrency_info(DEVICE_POOL)
            assert info.slot_count == DEVICES and not info.claimed_slots and not info.pending_steps

            # a crash: the worker of a long run is killed while its step holds a pool slot
            long_sft = {**SFT, "sft": {**SFT["sft"], "steps": 100_000}}
            crash = execute_launch_command(
                instance=instance, workspace_opts=WorkspaceOpts(workspace=[str(workspace)]), job_name="sft",
                config_json=json.dumps({"ops": {"sft_checkpoint": {"config": long_sft}}}),
                tags=json.dumps({"dagster/partition": "qk"})).run_id
            pid, deadline = None, time.monotonic() + 120
            while pid is None and time.monotonic() < deadline and not instance.get_run_by_id(crash).is_finished:
                held = [s.run_id for s in instance.event_log_storage.get_concurrency_info(DEVICE_POOL).claimed_slots]
                pid = _worker_pid(instance, crash) if crash in held else None
                time.sleep(0.5)
            assert pid, (instance.get_run_by_id(crash).status, server_log.read_text()[-3000:])
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            while time.monotonic() < deadline and not instance.get_run_by_id(crash).is_finished:
                time.sleep(0.5)
            failed = time.monotonic()
            assert instance.get_run_by_id(crash).status == dg.DagsterRunStatus.FAILURE
            held = [s.run_id for s in instance.event_log_storage.get_concurrency_info(DEVICE_POOL).claimed_slots]
            assert crash in held  # the dead worker could not give its slot back
            bound = FREE_SLOTS_AFTER_RUN_END_S + MONITORING_POLL_S + 20
            while time.monotonic() < failed + bound + 10:
                if not instance.event_log_storage.get_concurrency_info(DEVICE_POOL).claimed_slots:
                    break
                time.sleep(0.5)
            freed = time.monotonic()
            print(f"crashed run: worker killed {killed - finished:.1f} s after the burst, run FAILED "
                  f"{failed - killed:.1f} s later, its pool slot freed {freed - failed:.1f} s after that "
                  f"(free_slots_after_run_end_seconds {FREE_SLOTS_AFTER_RUN_END_S}, poll {MONITORING_POLL_S} s)")
            assert not instance.event_log_storage.get_concurrency_info(DEVICE_POOL).claimed_slots, \
                (tmp_path / "daemon.log").read_text()[-2000:]
            assert freed - failed <= bound
    finally:
        for proc in reversed(procs):
            _stop(proc)
