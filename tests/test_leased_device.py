"""The leased device is the device used: NVML inventories, CUDA_VISIBLE_DEVICES composed with an
inherited one and set before CUDA starts in a forked step, workers holding leases of their own.

There is no GPU here: NVML is a fake module (hardware we lack); everything else is real (the
executor, the forkserver, the ledger, a worker process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import dagster as dg
import pytest

from tinker_pipelines.scheduler.executor import gpu_executor
from tinker_pipelines.scheduler.inventory import (Gpu, Inventory, InventoryError, lease_visible_devices,
                                                  visible_gpus)
from tinker_pipelines.scheduler.ledger import Ledger, LeaseOwner
from tinker_pipelines.scheduler.placement import StepNeeds

UUIDS = [f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}" for i in range(4)]


def fake_pynvml(n_gpus: int = 4, fail: str = "") -> types.ModuleType:
    """A pynvml with `n_gpus` 80 GB GPUs; `fail`: 'missing' (no library), 'init' (driver not
    loaded), 'memory' (a GPU that cannot be read)."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    class NVMLError_DriverNotLoaded(NVMLError):
        pass

    class NVMLError_GpuIsLost(NVMLError):
        pass

    def init():
        if fail == "missing":
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
        if fail == "init":
            raise NVMLError_DriverNotLoaded("Driver Not Loaded")

    def memory(h):
        if fail == "memory" and h == 1:
            raise NVMLError_GpuIsLost("GPU is lost")
        return types.SimpleNamespace(total=80 * 10**9)

    m.NVMLError, m.NVMLError_LibraryNotFound = NVMLError, NVMLError_LibraryNotFound
    m.nvmlInit, m.nvmlShutdown = init, lambda: None
    m.nvmlDeviceGetCount = lambda: n_gpus
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetHandleByUUID = lambda u: UUIDS.index(u)
    m.nvmlDeviceGetUUID = lambda h: UUIDS[h].encode()
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = memory
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (7, 0) if h == 1 else (9, 0)  # GPU 1: a V100
    return m


# -- (b) composition: pure ---------------------------------------------------------------------
GPUS = [Gpu(i, UUIDS[i % 4] if i < 4 else f"GPU-{i}", "H100", 80 * 10**9) for i in range(8)]


@pytest.mark.parametrize("inherited, leased, child", [
    ("4,5", (1,), "5"),
    ("4,5", (0, 1), "4,5"),
    (f"{UUIDS[2]},{UUIDS[0]}", (1,), UUIDS[0]),
    ("GPU-2222,GPU-0000", (0,), "GPU-2222"),  # unique prefixes, kept as written
    (None, (3,), UUIDS[3]),  # nothing inherited: the physical name
])
def test_an_inherited_cuda_visible_devices_is_composed(inherited, leased, child):
    inventory = Inventory.from_gpus(visible_gpus(GPUS, inherited))
    assert lease_visible_devices(inventory, leased) == child
    # what travels to the step is the same inventory
    assert lease_visible_devices(Inventory.from_dict(inventory.to_config()), leased) == child


def test_visible_devices_limit_the_inventory_in_their_order_and_bad_entries_are_named():
    inventory = Inventory.from_gpus(visible_gpus(GPUS, "5,4"))
    assert len(inventory) == 2 and [d.uuid for d in inventory] == ["GPU-5", "GPU-4"]
    assert visible_gpus(GPUS, "-1") == () and visible_gpus(GPUS, "") == ()
    assert [e for _, e in visible_gpus(GPUS, "1,-1,2")] == ["1"]  # CUDA stops at a negative index
    with pytest.raises(InventoryError, match="entry '9' names no GPU"):
        visible_gpus(GPUS, "4,9")
    with pytest.raises(InventoryError, match="names GPU GPU-4 twice"):
        visible_gpus(GPUS, "4,GPU-4")
    assert lease_visible_devices(Inventory.from_config({"count": 2, "memory_gb": 8}), (1,)) is None


# -- detection through NVML --------------------------------------------------------------------
def test_detect_lists_gpus_through_nvml_limited_by_the_inherited_variable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(4))
    inventory = Inventory.detect({"CUDA_VISIBLE_DEVICES": "3,1"})
    assert [(d.kind, d.uuid, d.visible) for d in inventory] == [("cuda", UUIDS[3], "3"), ("cuda", UUIDS[1], "1")]
    assert [d.uuid for d in Inventory.detect({})] == UUIDS
    assert [d.kind for d in Inventory.detect({"CUDA_VISIBLE_DEVICES": "-1"})] == ["cpu"]


def test_no_nvml_library_is_one_cpu_device_and_a_broken_driver_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail="missing"))
    assert [d.kind for d in Inventory.detect({})] == ["cpu"]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail="init"))
    with pytest.raises(InventoryError, match=r"driver is installed but NVML fails to start \(NVMLError_DriverNotLoaded"):
        Inventory.detect({})
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail="memory"))
    with pytest.raises(InventoryError, match="NVML started but cannot read the GPUs.*GpuIsLost") as e:
        Inventory.detect({})
    assert "\n" not in str(e.value)


def test_detect_never_imports_torch():
    """A detection that does not import torch cannot start CUDA (the real NVML here: no library)."""
    code = ("import sys; from tinker_pipelines.scheduler.inventory import Inventory; inv = Inventory.detect(); "
            "print(inv[0].kind, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.split() == ["cpu", "False"], out.stderr[-2000:]


# -- (d) a device that does not exist ------------------------------------------------------------
def test_a_cuda_device_the_machine_lacks_is_named_before_loading(monkeypatch):
    import torch

    from tinker_pipelines.models import resolve_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a 1-GPU machine (we have none)
    with pytest.raises(ValueError, match=r"model.device is 'cuda:7' but this machine has 1 CUDA device\(s\)"):
        resolve_device("cuda:7")
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert not torch.cuda.is_initialized()


# -- (a) the forked step applies its lease before CUDA starts ---------------------------------------
TWO = {"tinker/devices": "1", "tinker/sharing": "exclusive"}


@dg.op(tags=TWO)
def seen_a() -> str:
    time.sleep(0.5)  # both steps hold their device at once
    return json.dumps([os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("TINKER_LEASE_CUDA_AT_APPLY")])


@dg.op(tags=TWO)
def seen_b() -> str:
    time.sleep(0.5)
    return json.dumps([os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("TINKER_LEASE_CUDA_AT_APPLY")])


@dg.job(executor_def=gpu_executor)
def two_gpus():
    seen_a()
    seen_b()


@pytest.fixture
def _importable(monkeypatch):
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("launch", ["forkserver", "process"])
@pytest.mark.e2e
def test_each_step_gets_the_gpu_it_leased_set_before_cuda_started(tmp_path, monkeypatch, _importable, launch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(4))  # the executor detects (in this process)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")  # as SLURM would
    config = {"execution": {"config": {"step_launch": launch, "ledger_path": str(tmp_path / "l.sqlite")}}}
    with dg.instance_for_test() as instance:
        with dg.execute_job(dg.reconstructable(two_gpus), instance, run_config=config) as r:
            assert r.success
            seen = [json.loads(r.output_for_node(n)) for n in ("seen_a", "seen_b")]
    assert sorted(v for v, _ in seen) == ["1", "3"], seen  # each its own GPU, named as inherited
    expected = "uninitialized" if launch == "forkserver" else "torch not imported"
    assert [s for _, s in seen] == [expected, expected], seen


def test_apply_lease_refuses_a_process_whose_cuda_started(monkeypatch):
    import torch

    from tinker_pipelines.scheduler.step_entry import apply_lease

    env: dict[str, str] = {}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # as after a CUDA call (no GPU here)
    with pytest.raises(RuntimeError, match="CUDA was initialized before the step's lease") as e:
        apply_lease({"CUDA_VISIBLE_DEVICES": "GPU-1", "TINKER_LEASE_DEVICES": "1"}, env)
    assert env == {} and "\n" not in str(e.value)


# -- (c) a worker holds a lease of its own ---------------------------------------------------------
@pytest.mark.e2e
def test_an_exclusive_step_is_never_placed_on_a_device_a_worker_holds(tmp_path, monkeypatch):
    from tinker_pipelines.scheduler.step_entry import lease_environment
    from tinker_pipelines.worker.client import start_worker

    ledger_path = str(tmp_path / "l.sqlite")
    inventory = Inventory.from_config({"count": 2, "memory_gb": 16})
    # the lease variables of a LoRA step on device 1, as the step that starts the worker has them
    step_env = lease_environment(ledger_path, json.dumps(inventory.to_config()),
                                 json.dumps({"devices": 1, "memory_gb": 2, "sharing": "lora"}), "r", "s")
    ledger = Ledger(ledger_path)
    step_lease = ledger.leases()[0]
    for k, v in step_env.items():
        monkeypatch.setenv(k, v)
    worker = start_worker("tiny", tmp_path / "w.sock", device="cpu", log=tmp_path / "w.log")
    try:
        held = [l for l in ledger.leases() if l.owner.pid == worker.pid]
        assert len(held) == 1 and held[0].devices == step_lease.devices and held[0].needs.sharing == "lora"
        ledger.release(step_lease)  # the step ended; its worker lives on
        exclusive = StepNeeds(1, 0, "exclusive")
        first = ledger.acquire(LeaseOwner.current(), exclusive, inventory, timeout_s=0.5, poll_s=0.05)
        assert first.devices != held[0].devices  # the free device, not the worker's
        with pytest.raises(TimeoutError):
            ledger.acquire(LeaseOwner.current(), exclusive, inventory, timeout_s=0.5, poll_s=0.05)
        ledger.release(first)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
    # the worker's lease died with it: its device is whole again
    lease = Ledger(ledger_path).acquire(LeaseOwner.current(), StepNeeds(2, 0, "exclusive"), inventory, timeout_s=5)
    assert lease.devices == (0, 1)


def test_validating_a_dtype_asks_nvml_not_cuda(monkeypatch):
    """`model.dtype` auto/bfloat16 is resolved from NVML's compute capability while CUDA is not
    initialised: a config validated in the daemon or a step before its lease starts no CUDA."""
    import torch

    from tinker_pipelines.config import ConfigError, config_from_dict
    from tinker_pipelines.models import resolve_dtype

    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")  # cuda:1 is NVML's GPU 1, the V100
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def would_start_cuda(*a, **k):
        raise AssertionError("asked torch.cuda, which starts CUDA")

    monkeypatch.setattr(torch.cuda, "get_device_capability", would_start_cuda)
    monkeypatch.setattr(torch.cuda, "get_device_name", would_start_cuda)
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16 and resolve_dtype("auto", "cuda:1") == torch.float32
    with pytest.raises(ConfigError, match=r"model.dtype bfloat16 is not supported natively by cuda:1 "
                                          r"\(NVIDIA H100 80GB HBM3, compute capability < 8.0\)"):
        config_from_dict({"model": {"device": "cuda:1", "dtype": "bfloat16"}})
    assert not torch.cuda.is_initialized()
