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
from tinker_pipelines.scheduler.placement import needs_from_tags

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


def _config(tmp_path, count=1, memory=80, launch="forkserver"):
    return {"execution": {"config": {"inventory": {"count": count, "memory_gb": memory}, "step_launch": launch,
                                     "ledger_path": str(tmp_path / "ledger.sqlite")}}}


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))


@pytest.mark.e2e
def test_concurrent_runs_never_hold_one_device_together(tmp_path):
    """Two runs, each in its own process (`dagster job execute`), on one simulated device."""
    import subprocess
    import sys

    import yaml

    inventory = Inventory.from_config({"count": 1, "memory_gb": 80})
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("")
    with dg.DagsterInstance.from_config(str(home)) as instance:  # create the storages before two processes race to
        instance.get_runs()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_config(tmp_path)))
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    cmd = [sys.executable, "-m", "dagster", "job", "execute", "-f", __file__, "-a", "contended",
           "-c", str(tmp_path / "run.yaml")]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(
        line for e in errors for line in e.splitlines() if "rror" in line or "xception" in line)[-3000:]
    events = Ledger(str(tmp_path / "ledger.sqlite")).audit_log()
    report = replay_audit(events, inventory)
    assert sum(e.event == "grant" for e in events) == 4  # hold_device and lora_step of each run
    assert not report.oversubscribed and not report.exclusive_shared
    grants = sorted((e.at, e.run_id) for e in events if e.event == "grant")
    assert len({run for _, run in grants}) == 2


@pytest.mark.parametrize("launch", ["forkserver", "process"])
@pytest.mark.e2e
def test_a_killed_step_frees_its_lease_and_the_retry_gets_the_device(tmp_path, launch):
    with dg.instance_for_test() as instance:
        with dg.execute_job(dg.reconstructable(flaky), instance, run_config=_config(tmp_path, launch=launch)) as r:
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
        with dg.execute_job(dg.reconstructable(impossible), instance, raise_on_error=False,
                            run_config={"execution": {"config": {"step_launch": "thread"}}}) as r:
            assert not r.success
            text = " ".join(str(e.event_specific_data) + str(e.message) for e in r.all_events)
            assert "gpu_executor.step_launch must be one of forkserver, process, got 'thread'" in text
        with dg.execute_job(dg.reconstructable(impossible), instance, raise_on_error=False,
                            run_config={"execution": {"config": {"poll_interval_s": 0.0}}}) as r:
            assert not r.success
            text = " ".join(str(e.event_specific_data) + str(e.message) for e in r.all_events)
            assert "gpu_executor.poll_interval_s must be > 0, got 0.0" in text


def test_lora_steps_reserve_their_runs_estimate_unless_the_tag_says_how_much():
    from tinker_pipelines.schedule_rules import LORA_STEP_TAGS
    from tinker_pipelines.scheduler.placement import cap_to_device, check_fits
    from tinker_pipelines.scheduler.executor import plan_step

    def run(model: dict, **training) -> dict:
        return {"ops": {"rollout_batch": {"config": {"model": model, "training": training}}}}

    smol = run({"name": "smollm2-135m-instruct"})  # defaults: 64 rows x (512 + 16) tokens per micro-batch
    needs, est = plan_step(LORA_STEP_TAGS, smol, "rollout_batch")
    assert needs.memory_gb == pytest.approx(est.total_gb, abs=1e-3) and needs.base == "smollm2-135m-instruct"
    assert 0 < needs.resident_gb == pytest.approx(est.total_gb - est.weights_gb, abs=1e-3)
    with pytest.raises(ValueError, match=r"^step needs 26\.2 GB \(weights 0\.3, KV 0\.8, activations 25\.1, "
                                         r"adapter 0\.0\) on one device, but the largest device has 16 GB"):
        check_fits(needs, Inventory.from_config({"count": 2, "memory_gb": 16}), est)
    # over the device by its batch alone (prompts assumed 512 tokens): a whole device, said in one line
    capped, note = cap_to_device(needs, Inventory.from_config({"count": 2, "memory_gb": 16}), est)
    assert capped.memory_gb == capped.resident_gb == 16 and capped.base == needs.base  # its batch alone is over 16
    assert note.startswith("needs 26.2 GB (weights 0.3,") and "reserves a whole device" in note and "\n" not in note
    assert cap_to_device(needs, Inventory.from_config({"count": 1, "memory_gb": 80}), est) == (needs, None)
    tiny_device = Inventory.from_config({"count": 1, "memory_gb": 0.2})  # not even the weights fit: refused
    assert cap_to_device(needs, tiny_device, est) == (needs, None)
    with pytest.raises(ValueError, match="can never be placed"):
        check_fits(needs, tiny_device, est)
    small, _ = plan_step(LORA_STEP_TAGS, run({"name": "smollm2-135m-instruct"}, micro_batch_size=8,
                                             gradient_checkpointing=True), "other_step")
    assert small.memory_gb < 2.5
    check_fits(small, Inventory.from_config({"count": 2, "memory_gb": 16}))
    assert plan_step(LORA, smol, "rollout_batch") == (needs_from_tags(LORA), None)  # an explicit size stays
    assert plan_step(LORA_STEP_TAGS, {}, "x")[0].memory_gb == 2.0  # nothing to estimate from
    assert plan_step(LORA_STEP_TAGS, run({"name": "tiny"}, mode="full"), "x")[0].sharing == "exclusive"
    with pytest.raises(ValueError, match="training.micro_batch_size"):
        plan_step(LORA_STEP_TAGS, run({"name": "tiny"}, micro_batch_size=0), "x")


@pytest.mark.e2e
def test_rl_job_on_the_gpu_executor_with_a_worker(tmp_path):
    """`dagster job execute` of the `rl` job with TINKER_EXECUTOR=gpu: every step its own process,
    LoRA steps as thin clients of a resident worker, devices from the ledger."""
    import subprocess
    import sys

    import torch
    import yaml

    from tinker_pipelines.worker.client import WorkerClient, start_worker

    address = tmp_path / "w.sock"
    worker = start_worker("tiny", address, device="cpu", dtype="float32", log=tmp_path / "worker.log",
                          extra=["--threads", str(torch.get_num_threads())])
    try:
        home = tmp_path / "dagster"
        home.mkdir()
        (home / "dagster.yaml").write_text("")
        settings = {"seed": 2, "model": {"name": "tiny", "seed": 0, "dtype": "float32"}, "env": {"path": "test_worker:ShortReplyEnv",
                                                                            "eval_kwargs": {}},
                    "training": {"iterations": 1, "groups_per_batch": 2, "group_size": 4, "max_new_tokens": 4},
                    "eval": {"every": 1, "num_tasks": 4}}
        run_config = {"ops": {"rollout_batch": {"config": settings}},
                      "execution": {"config": {"inventory": {"count": 1, "memory_gb": 16},
                                               "ledger_path": str(tmp_path / "ledger.sqlite")}}}
        (tmp_path / "rl.yaml").write_text(yaml.safe_dump(run_config))
        env = {**os.environ, "DAGSTER_HOME": str(home), "TINKER_HOME": str(tmp_path / "tinker"),
               "TINKER_EXECUTOR": "gpu", "TINKER_WORKER": str(address)}
        r = subprocess.run([sys.executable, "-m", "dagster", "job", "execute", "-m", "assets.definitions",
                            "-j", "rl", "-c", str(tmp_path / "rl.yaml"), "--tags", '{"dagster/partition": "gx:0"}'],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        events = Ledger(str(tmp_path / "ledger.sqlite")).audit_log()
        granted = {e.step_key for e in events if e.event == "grant"}
        assert {"rollout_batch", "scored_trajectories", "adapter_checkpoint"} <= granted
        assert all(e.needs.sharing == "lora" for e in events)
        assert not replay_audit(events, Inventory.from_config({"count": 1, "memory_gb": 16})).oversubscribed
        # each step process parked the experiment's adapter; each later one took it over
        probe = WorkerClient(address)
        stats = probe.stats()
        probe.close()
        assert stats["parked"] == ["gx"] and stats["claims"] == 3, stats
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
