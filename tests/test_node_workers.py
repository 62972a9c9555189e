"""Workers by physical device (issue 50, item 1): a leased step trains on the worker of the very
device it leased, never on another step's; a worker started by hand takes a lease like a step.

Real parts: the Dagster instance and `gpu_executor` over a simulated inventory, the sqlite
ledger, worker processes with a tiny model. NVML is a fake module only where a GPU is named
(hardware we lack)."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from tinker_pipelines.scheduler.inventory import Gpu, Inventory, visible_gpus
from tinker_pipelines.scheduler.ledger import Ledger, LeaseOwner
from tinker_pipelines.scheduler.placement import StepNeeds
from tinker_pipelines.scheduler.step_entry import lease_environment
from tinker_pipelines.scheduler.workers import (cuda_device_key, leased_device_key, resident_bases,
                                                worker_device_key, worker_step_key)
from tinker_pipelines.worker import default_socket

from test_leased_device import UUIDS, fake_pynvml

LORA = json.dumps({"devices": 1, "memory_gb": 2, "sharing": "lora"})


def _lease_env(ledger_path: str, inventory: Inventory, step: str) -> dict[str, str]:
    return lease_environment(ledger_path, json.dumps(inventory.to_config()), LORA, "run", step)


def test_two_leased_steps_get_two_workers_keyed_by_the_device_not_cuda_0(tmp_path, monkeypatch):
    """Two steps leased on different devices see the same logical device and get different worker
    keys and sockets; a step on the same device of the same ledger gets the same one."""
    import torch

    sim = Inventory.from_config({"count": 2, "memory_gb": 3})  # one 2 GB step per device
    ledger = str(tmp_path / "l.sqlite")
    a, b = _lease_env(ledger, sim, "a"), _lease_env(ledger, sim, "b")
    assert a["TINKER_LEASE_DEVICES"] != b["TINKER_LEASE_DEVICES"]
    key_a, key_b = worker_device_key("cpu", None, a), worker_device_key("cpu", None, b)
    assert key_a.startswith(f"sim:{a['TINKER_LEASE_DEVICES']}@") and key_a != key_b
    assert default_socket("tiny(seed=0)", key_a) != default_socket("tiny(seed=0)", key_b)
    # the same device of the same ledger and inventory: the same worker, whoever asks
    assert leased_device_key(sim, int(a["TINKER_LEASE_DEVICES"]), ledger) == key_a
    # another ledger, or another simulated inventory: never the same worker
    assert leased_device_key(sim, 0, tmp_path / "other.sqlite") != leased_device_key(sim, 0, ledger)
    assert leased_device_key(Inventory.from_config({"count": 2, "memory_gb": 4}), 0, ledger) != \
        leased_device_key(sim, 0, ledger)
    assert worker_device_key("cpu", None, {}) == "cpu"  # no lease: the plain CPU

    # GPUs: every leased step sees cuda:0; its worker is keyed by the leased GPU's UUID
    gpus = Inventory.from_gpus(visible_gpus([Gpu(i, UUIDS[i], "H100", 80 * 10**9) for i in range(4)], None))
    env = {"TINKER_LEDGER": ledger, "TINKER_LEASE_DEVICES": "2", "TINKER_LEASE_INVENTORY": json.dumps(gpus.to_config())}
    assert worker_device_key("cuda", 0, env) == UUIDS[2]
    assert worker_device_key("cuda", None, {**env, "TINKER_LEASE_DEVICES": "3"}) == UUIDS[3]
    with pytest.raises(ValueError, match=r"device cuda:1 is not one of the 1 device\(s\) of the lease \(2\)"):
        worker_device_key("cuda", 1, env)
    # no lease: NVML maps the process's CUDA_VISIBLE_DEVICES, CUDA itself is never asked
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(4))
    assert worker_device_key("cuda", 0, {"CUDA_VISIBLE_DEVICES": "3,1"}) == UUIDS[3]
    assert cuda_device_key(1, {"CUDA_VISIBLE_DEVICES": "3,1"}) == UUIDS[1]
    assert not torch.cuda.is_initialized()


def test_the_ledger_says_which_base_a_device_holds(tmp_path):
    inventory = Inventory.from_config({"count": 2, "memory_gb": 8})
    ledger = Ledger(str(tmp_path / "l.sqlite"))
    held = ledger.acquire(LeaseOwner.current(step_key=worker_step_key("tiny(seed=3)")), StepNeeds(1, 1, "lora"),
                          inventory, only=(1,))
    ledger.acquire(LeaseOwner.current(run_id="r", step_key="rollout_batch"), StepNeeds(1, 1, "lora"), inventory)
    assert resident_bases(ledger.leases()) == {1: frozenset({"tiny(seed=3)"})}
    ledger.release(held)
    assert resident_bases(ledger.leases()) == {}


def _worker_cli(capsys, *args: str) -> tuple[int, str]:
    from tinker_pipelines import cli

    rc = cli.main(["worker", "--model", "tiny", *args])
    return rc, capsys.readouterr().err


def test_a_worker_started_by_hand_refuses_a_lease_it_cannot_get_before_loading(tmp_path, capsys, monkeypatch):
    for k in ("TINKER_LEDGER", "TINKER_LEASE_DEVICES", "TINKER_LEASE_INVENTORY"):
        monkeypatch.delenv(k, raising=False)
    ledger = str(tmp_path / "l.sqlite")
    one = json.dumps({"count": 1, "memory_gb": 3})
    # full: not even the tiny base's weights (its default lease, from its config) fit beside it
    Ledger(ledger).acquire(LeaseOwner.current(step_key="busy"), StepNeeds(1, 3, "lora"),
                           Inventory.from_config({"count": 1, "memory_gb": 3}))
    cases = [
        (["--ledger", ledger, "--inventory", one, "--lease-timeout-s", "0.3"], "no devices for"),
        (["--ledger", ledger, "--inventory", one, "--lease-memory-gb", "4"], "no lease for this worker"),
        (["--ledger", ledger, "--inventory", one, "--lease-device", "5"], "--lease-device 5 is not a device"),
        (["--ledger", ledger, "--inventory", '{"count": "x", "memory_gb": 3}'], "--inventory.count must be"),
        (["--lease-device", "0"], "need a ledger (--ledger or TINKER_LEDGER)"),
    ]
    for args, fragment in cases:
        rc, err = _worker_cli(capsys, "--device", "cpu", "--socket", str(tmp_path / "w.sock"), *args)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(errors) == 1 and fragment in errors[0], err
    assert not (tmp_path / "w.sock").exists()
    assert [l.owner.step_key for l in Ledger(ledger).leases()] == ["busy"]  # nothing granted to a refused worker


@pytest.mark.e2e
def test_concurrent_lora_steps_each_train_on_the_worker_of_their_leased_device(monkeypatch):
    """A worker started by hand leases simulated device 2; then 4 concurrent LoRA steps of one job
    on `gpu_executor` over 4 devices: 4 devices busy at once, 4 distinct workers, each step on the
    worker whose own lease is on the step's device (the step on device 2 on the hand-started one),
    no device over-subscribed, CUDA never started."""
    import tempfile
    from pathlib import Path

    from benchmarks import node_workers as nw
    from tinker_pipelines.models import base_identity
    from tinker_pipelines.worker.client import WorkerClient, start_worker

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for k in ("TINKER_LEDGER", "TINKER_LEASE_DEVICES", "TINKER_LEASE_INVENTORY", "TINKER_WORKER"):
        monkeypatch.delenv(k, raising=False)
    step_gb, device_gb = nw.sizes(1)
    inventory = {"count": 4, "memory_gb": device_gb}
    base = base_identity("tiny", nw.MODEL_KWARGS, 0)
    with tempfile.TemporaryDirectory(prefix="nw", dir="/tmp") as tmp:
        home, ledger = Path(tmp), Path(tmp) / "ledger.sqlite"
        key = leased_device_key(Inventory.from_config(inventory), 2, ledger)
        address = (home / default_socket(base, key)).resolve()
        address.parent.mkdir(parents=True)
        hand = start_worker("tiny", address, device="cpu", dtype="float32", log=f"{address}.log",
                            extra=["--model-kwargs", json.dumps(nw.MODEL_KWARGS), "--ledger", str(ledger),
                                   "--inventory", json.dumps(inventory), "--lease-device", "2",
                                   "--lease-memory-gb", str(nw.WORKER_GB), "--threads", "1"])
        try:
            own = [l for l in Ledger(str(ledger)).leases() if l.owner.pid == hand.pid]
            assert [(l.devices, l.owner.step_key) for l in own] == [((2,), worker_step_key(base))]
            probe = WorkerClient(address)
            assert probe.stats()["device_key"] == key
            probe.close()
            with nw._in_dir(home):
                records = nw.run_steps(1, 4, 4, home)
            out = nw.figures(records, ledger, Inventory.from_config(inventory))
        finally:
            nw.stop_workers(ledger)
            if hand.poll() is None:
                os.killpg(hand.pid, signal.SIGTERM)
            hand.wait(timeout=30)
    assert out["steps_on_leased_worker"] == 1.0 and out["max_devices_busy"] == 4, out
    assert out["oversubscribed"] == 0 and out["workers"] == 4 and out["distinct_worker_devices"] == 4, out
    by_device = {r["lease_devices"]: r for r in records}
    assert sorted(by_device) == ["0", "1", "2", "3"]  # never two steps on one device, never crossed
    assert by_device["2"]["worker_pid"] == hand.pid and by_device["2"]["address"] == str(address)
    assert len({r["address"] for r in records}) == 4
    assert out["cuda_initialized_in_steps"] == 0 and out["cuda_initialized_in_workers"] == 0
    assert {r["step_cuda"] for r in records} == {"uninitialized"}  # torch imported (forked steps), CUDA not started


def test_on_the_machine_s_own_gpus_a_step_takes_a_device_but_its_workers():
    """`--inventory detect`: a step reserves all of the smallest device but one worker per base (more
    than half: one step per device), and computes on CUDA; a device too small for that is refused."""
    from benchmarks import node_workers as nw

    def gpus(*gb):
        return Inventory.from_dict({"devices": [{"kind": "cuda", "memory_gb": g, "name": f"H100 {i}",
                                                 "uuid": f"GPU-{i}", "visible": f"GPU-{i}"} for i, g in enumerate(gb)]})

    assert nw.detected_step_gb(gpus(85.0, 80.0), bases=1) == 80.0 - nw.WORKER_GB
    assert nw.detected_step_gb(gpus(85.0, 85.0), bases=4) == 85.0 - 4 * nw.WORKER_GB
    assert nw._device(gpus(85.0)) == "cuda" and nw._device(Inventory.from_config({"count": 2, "memory_gb": 3})) == "cpu"
    with pytest.raises(ValueError, match="--inventory detect: a device of 6.0 GB cannot hold a step"):
        nw.detected_step_gb(gpus(6.0), bases=4)
    with pytest.raises(ValueError, match="inventory must be 'sim' or 'detect'"):
        nw.measure(inventory="gpus")
