"""The GPU-aware executor on a real instance with a simulated inventory (no GPU needed)."""

from __future__ import annotations

import os
import signal
import time

import dagster as dg
import pytest

from tinker_pipelines.scheduler.executor import gpu_executor, step_needs
from tinker_pipelines.scheduler.inventory import Inventory
from tinker_pipelines.scheduler.ledger import Ledger, replay_audit

EXCLUSIVE = {"tinker/devices": "1", "tinker/sharing": "exclusive"}
LORA = {"tinker/devices": "1", "tinker/memory_gb": "30", "tinker/sharing": "lora"}


@dg.op(tags=EXCLUSIVE)
def hold_device(context) -> str:
    time.sleep(1.0)
    return os.environ.get("TINKER_LEASE_DEVICES", "")


@dg.op(tags=LORA)
def lora_step(context, devices: str) -> str:
    time.sleep(0.5)
    return os.environ["TINKER_LEASE_DEVICES"]


@dg.op
def no_device() -> str:
    return os.environ.get("TINKER_LEASE_DEVICES", "none")


@dg.job(executor_def=gpu_executor)
def contended():
    lora_step(hold_device())
    no_device()


@dg.op(tags=EXCLUSIVE, retry_policy=dg.RetryPolicy(max_retries=1))
def dies_once(context) -> str:
    if context.retry_number == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the step process dies mid-step, holding its lease
    return os.environ["TINKER_LEASE_DEVICES"]


@dg.job(executor_def=gpu_executor)
def flaky():
    dies_once()


@dg.op(tags={"tinker/devices": "3", "tinker/sharing": "exclusive"})
def too_big() -> None:
    pass


@dg.job(executor_def=gpu_executor)
def impossible():
    too_big()


def _config(tmp_path, count=1, memory=80):
    return {"execution": {"config": {"inventory": {"count": count, "memory_gb": memory},
                                     "ledger_path": str(tmp_path / "ledger.sqlite")}}}


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))


def test_concurrent_runs_never_hold_one_device_together(tmp_path):
    """Two runs, each in its own process (`dagster job execute`), on one simulated device."""
    import subprocess
    import sys

    import yaml

    inventory = Inventory.from_config({"count": 1, "memory_gb": 80})
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_config(tmp_path)))
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    cmd = [sys.executable, "-m", "dagster", "job", "execute", "-f", __file__, "-a", "contended",
           "-c", str(tmp_path / "run.yaml")]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    events = Ledger(str(tmp_path / "ledger.sqlite")).audit_log()
    report = replay_audit(events, inventory)
    assert sum(e.event == "grant" for e in events) == 4  # hold_device and lora_step of each run
    assert not report.oversubscribed and not report.exclusive_shared
    grants = sorted((e.at, e.run_id) for e in events if e.event == "grant")
    assert len({run for _, run in grants}) == 2


def test_a_killed_step_frees_its_lease_and_the_retry_gets_the_device(tmp_path):
    with dg.instance_for_test() as instance:
        with dg.execute_job(dg.reconstructable(flaky), instance, run_config=_config(tmp_path)) as r:
            assert r.success and r.output_for_node("dies_once") == "0"
    events = Ledger(str(tmp_path / "ledger.sqlite")).audit_log()
    assert [e.event for e in events].count("grant") == 2
    assert any(e.event == "expire" for e in events)


def test_a_request_that_can_never_fit_fails_at_once(tmp_path):
    start = time.monotonic()
    with dg.instance_for_test() as instance:
        with dg.execute_job(dg.reconstructable(impossible), instance, run_config=_config(tmp_path, count=2),
                            raise_on_error=False) as r:
            assert not r.success
            text = " ".join(str(e.event_specific_data) + str(e.message) for e in r.all_events)
            assert "can never be placed" in text
    assert time.monotonic() - start < 120


def test_full_parameter_runs_ask_exclusive_and_bad_tags_name_the_tag():
    assert step_needs(LORA, {"ops": {"x": {"config": {"training": {"mode": "full"}}}}}).sharing == "exclusive"
    assert step_needs(LORA, {"ops": {"x": {"config": {"training": {"mode": "lora"}}}}}).sharing == "lora"
    with pytest.raises(ValueError, match="tinker/devices"):
        step_needs({"tinker/devices": "x"}, {})
    with dg.instance_for_test() as instance:
        with dg.execute_job(dg.reconstructable(impossible), instance, raise_on_error=False,
                            run_config={"execution": {"config": {"inventory": {"count": "two", "memory_gb": 8}}}}) as r:
            assert not r.success
            text = " ".join(str(e.event_specific_data) + str(e.message) for e in r.all_events)
            assert "gpu_executor.inventory.count must be a positive integer, got 'two'" in text
