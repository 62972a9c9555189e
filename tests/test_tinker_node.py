"""The Tinker service over a node: several bases, several devices, one worker per (base, device).

A simulated inventory of 2 devices and 2 bases (the catalogue's tiny, and a tiny of other weights
written as a model directory): 4 real worker processes, one per base and simulated device, each a
CPU process told its device through its environment, driven by the pinned `tinker` SDK over
loopback. Sessions spread over the workers of their base, a killed worker fails only its own
sessions' calls (they resume from their last save), and the command line refuses bad device sets
in one line before any model loads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import tinker
from tinker import types

from test_tinker_liveness import ADAM, BIG, DATA  # one worker's calls: a short pair and a long pass
from tinker_pipelines.scheduler.inventory import Inventory
from tinker_pipelines.scheduler.ledger import Ledger
from tinker_pipelines.serving.tinker.devices import NodeDevices
from tinker_pipelines.serving.tinker.launch import start_service

pytestmark = pytest.mark.e2e  # worker processes, signals and an HTTP service

KEY = "tml-test-key"
INVENTORY = {"count": 2, "memory_gb": 80}
FAIL_BOUND_S = 60.0
RESTART_BOUND_S = 180.0


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from tinker_pipelines.models.hf_dir import write_model_dir

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    root = tmp_path_factory.mktemp("node")
    other, _ = write_model_dir("tiny", root / "tiny-b", seed=1)
    ledger = str(root / "ledger.sqlite")
    devices = NodeDevices(Inventory.from_config(INVENTORY), (0, 1), ledger, memory_gb=4.0)
    handle = start_service(["tiny", str(other)], home=root / "home", api_key=KEY, dtype="float32", devices=devices,
                           gap_timeout_s=5.0, worker_args=["--threads", "1"])
    yield handle, str(other), ledger
    handle.stop()


def _client(handle) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=handle.url, api_key=KEY)


def _worker(handle, tc) -> str:
    """The label of the worker holding a training client's adapter."""
    return handle.service.node.worker_of(handle.service.models[tc.model_id].trainer).label


def _logprobs(tc) -> list[float]:
    return tc.forward(DATA[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def _proc_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def test_capabilities_list_every_base_and_an_unserved_one_is_a_400_naming_them(node):
    handle, other, _ = node
    with _client(handle) as sc:
        rest = tinker.RestClient(base_url=handle.url, api_key=KEY)
        names = [m.model_name for m in rest.get_server_capabilities().result().supported_models]
        assert names == ["tiny", other]
        with pytest.raises(tinker.BadRequestError) as bad:
            sc.create_lora_training_client("no-such-base", rank=4).result()
    assert "base_model 'no-such-base' is not served here" in str(bad.value)
    assert "'tiny'" in str(bad.value) and repr(other) in str(bad.value)


def test_each_worker_runs_on_its_own_device_under_its_own_lease(node):
    handle, other, ledger = node
    seen = {}
    for slot in handle.workers:
        env = _proc_env(slot.supervisor.proc.pid)
        seen[(slot.base, slot.device)] = (env["CUDA_VISIBLE_DEVICES"], env["TINKER_SERVICE_DEVICE"])
    assert seen == {(b, d): (str(d), f"{d}:sim{d}") for b in ("tiny", other) for d in (0, 1)}
    leases = {lease.owner.step_key: lease.devices for lease in Ledger(ledger).leases()}
    assert leases == {f"tinker-service: {s.label}": (s.device,) for s in handle.workers}


def test_sessions_spread_over_their_bases_workers_balanced_and_stay_there(node):
    handle, other, _ = node
    bases = ["tiny", other] * 4
    clients = [_client(handle) for _ in bases]
    try:
        with ThreadPoolExecutor(8) as pool:  # created together: placement must not send them all to one worker
            tcs = list(pool.map(lambda cb: cb[0].create_lora_training_client(cb[1], rank=4, seed=1).result(),
                                zip(clients, bases)))
        by_worker: dict[str, list[str]] = {}
        for tc, base in zip(tcs, bases):
            by_worker.setdefault(_worker(handle, tc), []).append(base)
        assert sorted(by_worker) == sorted(s.label for s in handle.workers)
        assert all(len(v) == 2 and set(v) == {w.split(" on ")[0]} for w, v in by_worker.items()), by_worker
        loads = handle.service.node.loads()
        assert max(loads.values()) - min(loads.values()) <= 1, loads

        tc = tcs[1]  # of the directory base: its calls, snapshots and checkpoints stay on its worker
        where = _worker(handle, tc)
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        snap = tc.save_weights_and_get_sampling_client().result()
        assert len(snap.sample(types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=3)).result()
                   .sequences[0].tokens) == 3
        assert _worker(handle, tc) == where
        path = tc.save_weights_for_sampler("ck").result().path
        sampler = clients[1].create_sampling_client(model_path=path).result()
        sampler.sample(types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=3)).result()
        adapter = handle.service.samplers[sampler._sampling_session_id].adapter
        holder = handle.service.node.holder(adapter)
        assert holder in [w.runtime for w in handle.service.node.of_base(other)]
    finally:
        for sc in clients:
            sc.close("success").result()
    assert sum(handle.service.node.loads().values()) == 0


def test_a_killed_worker_fails_only_its_own_sessions_and_they_resume_from_their_last_save(node):
    handle, other, _ = node
    clients = [_client(handle) for _ in range(4)]
    try:
        bases = ["tiny", "tiny", other, other]
        tcs = [f.result() for f in [sc.create_lora_training_client(b, rank=4, seed=2) for sc, b in zip(clients, bases)]]
        assert len({_worker(handle, tc) for tc in tcs}) == 4
        paths, before = [], []
        for i, tc in enumerate(tcs):
            tc.forward_backward(DATA, "cross_entropy").result()
            tc.optim_step(ADAM).result()
            paths.append(tc.save_state(f"one-step-{i}").result().path)
            before.append(_logprobs(tc))
        victim = next(s for s in handle.workers if s.label == _worker(handle, tcs[0]))
        others = {s.label: s.supervisor.proc.pid for s in handle.workers if s is not victim}

        in_flight = tcs[0].forward_backward(BIG, "cross_entropy")
        time.sleep(1.0)
        old_pid = victim.supervisor.proc.pid
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(tinker.RequestFailedError) as failed:
            in_flight.result(timeout=FAIL_BOUND_S)
        message = str(failed.value)
        assert f"the worker for {victim.label} died (signal 9, SIGKILL)" in message and paths[0] in message, message
        import httpx  # the service still serves both bases: degraded, not down (a liveness probe must not restart it)

        health = httpx.get(f"{handle.url}/api/v1/healthz", headers={"X-API-Key": KEY}, timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert list(health.json()["workers"]) == [victim.label]

        for tc in tcs[1:]:  # the other workers' sessions go on, untouched
            tc.forward_backward(DATA, "cross_entropy").result(timeout=FAIL_BOUND_S)
            tc.optim_step(ADAM).result(timeout=FAIL_BOUND_S)
        assert {s.label: s.supervisor.proc.pid for s in handle.workers if s is not victim} == others
        assert all(s.supervisor.generation == 0 for s in handle.workers if s is not victim)

        deadline = time.monotonic() + RESTART_BOUND_S
        while victim.supervisor.generation == 0 or victim.runtime.health() is not None:
            assert time.monotonic() < deadline, "the killed worker was not restarted"
            time.sleep(0.5)
        new_pid = victim.supervisor.proc.pid
        assert new_pid != old_pid
        assert _proc_env(new_pid)["TINKER_SERVICE_DEVICE"] == f"{victim.device}:sim{victim.device}"
        with pytest.raises(tinker.APIStatusError) as gone:
            tcs[0].forward(DATA, "cross_entropy").result(timeout=FAIL_BOUND_S)
        assert gone.value.status_code == 410 and paths[0] in str(gone.value)

        resumed = clients[0].create_training_client_from_state_with_optimizer(paths[0]).result()
        assert _logprobs(resumed) == before[0]
        assert handle.service.models[resumed.model_id].steps == 1
    finally:
        for sc in clients:
            sc.close("success").result()


def _serve(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                          os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tinker_pipelines", "tinker", "serve", "--home", str(home),
                           "--no-tracking", "--port", "0", *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("args, says", [
    (["--model", "tiny", "--devices", "0,2"],
     "--devices '0,2': the inventory has no device 2 (it has 0: sim0, 1: sim1)"),
    (["--model", "tiny", "--model", "tiny", "--devices", "0"], "--model tiny is given twice: give each base once"),
])
def test_bad_device_sets_and_bases_are_one_line_errors(tmp_path, args, says):
    run = _serve(*args, "--inventory", json.dumps(INVENTORY), home=tmp_path / "home")
    assert (run.returncode, run.stderr.strip()) == (2, f"error: {says}")


def test_a_second_service_claiming_a_device_is_refused_before_any_model_loads(node, tmp_path):
    handle, _, ledger = node
    started = time.monotonic()
    run = _serve("--model", "tiny", "--devices", "1", "--inventory", json.dumps(INVENTORY), "--ledger", ledger,
                 home=tmp_path / "home")
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert run.stderr.startswith("error: --devices: device 1 (sim1) is already claimed by another Tinker service "
                                 f"(pid {os.getpid()}, home {handle.service.home.absolute()}"), run.stderr
    assert not list((tmp_path / "home").rglob("*.log")), "a worker was started"
    assert time.monotonic() - started < 60


def test_the_benchmark_part_reports_both_goals_on_a_small_node(tmp_path):
    from benchmarks.node_tinker import measure

    out = measure(devices=2, clients=4, work=tmp_path)
    assert out["tinker_workers"] == 4 and out["tinker_devices"] == 2
    assert out["tinker_clients_per_worker"] and set(out["tinker_clients_per_worker"].values()) == {1}
    assert out["tinker_sessions_spread"] is True
    assert out["killed_worker_clients"] == 1 and out["other_clients_ok"] == 3
    assert out["worker_death_isolated"] is True, out
