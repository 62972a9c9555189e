"""The Tinker service over a node: `python -m benchmarks.node_tinker` (CPU, simulated inventory).

One service (`launch.start_service` with a `NodeDevices` set) over a simulated inventory of
`--devices` devices and 2 bases (the catalogue's tiny, and a tiny of other weights written as a
model directory): one CPU worker process per base and device, each told its device through its
environment. `--clients` SDK clients (`tinker==0.38.0`, unmodified, over loopback), half on each
base, create their training clients together; then each takes a step and saves, the worker of
one device is SIGKILLed while its clients have a long `forward_backward` in flight, and the other
clients keep training. Last line, JSON:

- `tinker_sessions_spread`: every base's training clients ended on all of its workers (one per
  device), and every worker holds within one client of every other. Goal true.
- `worker_death_isolated`: the killed worker's in-flight calls failed naming it and the save to
  resume from; every other client's calls after the kill succeeded, on workers whose process and
  generation did not change; the killed worker came back on its own device; its clients resumed
  from their last save with the same logprobs and step count. Goal true.
- and the figures they come from (`tinker_workers`, `tinker_clients_per_worker`, `worker_restart_s`, ...).

`--inventory detect` (`measure(inventory="detect")`, what `scripts/gpu_check`'s node part runs)
serves over the machine's own GPUs instead (every one NVML lists; `--devices` is their number):
one CUDA worker per base and GPU. The victim worker is stopped (SIGSTOP) before its clients' long
calls go out and killed a second later, so those calls are in flight at the kill however fast the
device computes them.

`measure(...)` returns the dict, for `benchmarks/node.py` to compose.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

KEY = "tml-bench-key"
RESTART_BOUND_S = 300.0


def _datum(tokens: list[int]):
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
        "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, np.float32))})


def _env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def _start(work: Path, devices: int, inventory: str = "sim"):
    from tinker_pipelines.models.hf_dir import write_model_dir
    from tinker_pipelines.scheduler.inventory import Inventory
    from tinker_pipelines.serving.tinker.devices import NodeDevices
    from tinker_pipelines.serving.tinker.launch import start_service

    other, _ = write_model_dir("tiny", work / "tiny-b", seed=1, overwrite=True)
    inv = Inventory.detect() if inventory == "detect" else Inventory.from_config({"count": devices, "memory_gb": 80})
    spec = NodeDevices(inv, tuple(range(len(inv))), str(work / "ledger.sqlite"), memory_gb=4.0)
    handle = start_service(["tiny", str(other)], home=work / "home", api_key=KEY, dtype="float32", devices=spec,
                           gap_timeout_s=30.0, worker_args=["--threads", "1"])
    return handle, str(other)


def _spread(handle, tcs: list, bases: list[str]) -> dict[str, Any]:
    node = handle.service.node
    where = [node.worker_of(handle.service.models[tc.model_id].trainer) for tc in tcs]
    per_worker = {w.label: 0 for w in node.workers}
    for w in where:
        per_worker[w.label] += 1
    covered = all({w.device for w, b in zip(where, bases) if b == base} == {w.device for w in node.of_base(base)}
                  for base in node.bases)
    right_base = all(w.base == b for w, b in zip(where, bases))
    balanced = max(per_worker.values()) - min(per_worker.values()) <= 1
    return {"tinker_sessions_spread": covered and right_base and balanced, "tinker_workers": len(node.workers),
            "tinker_devices": len({w.device for w in node.workers}), "tinker_clients_per_worker": per_worker,
            "tinker_spread_balanced": balanced, "tinker_spread_every_device": covered}


def _kill_one(handle, clients: list, tcs: list, data: list, big: list) -> dict[str, Any]:
    """Step and save every client, kill the first device's worker of the default base mid-call."""
    import tinker
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
    node = handle.service.node
    label = {id(tc): node.worker_of(handle.service.models[tc.model_id].trainer).label for tc in tcs}
    paths, before = [], []
    for i, tc in enumerate(tcs):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam).result()
        paths.append(tc.save_state(f"step-1-{i}").result().path)
        before.append(tc.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())
    victim = handle.workers[0]
    mine = [i for i, tc in enumerate(tcs) if label[id(tc)] == victim.label]
    rest = [i for i in range(len(tcs)) if i not in mine]
    others = {s.label: (s.supervisor.proc.pid, s.supervisor.generation) for s in handle.workers if s is not victim}
    old_pid = victim.supervisor.proc.pid
    os.kill(old_pid, signal.SIGSTOP)  # the calls below cannot finish before the kill, on any device
    in_flight = [tcs[i].forward_backward(big, "cross_entropy") for i in mine]
    time.sleep(1.0)
    device = _env(old_pid).get("TINKER_SERVICE_DEVICE")
    os.kill(old_pid, signal.SIGKILL)
    killed = time.monotonic()
    later = [(tcs[i].forward_backward(data, "cross_entropy"), tcs[i]) for i in rest]
    failed_right = 0
    for i, fut in zip(mine, in_flight):
        try:
            fut.result(timeout=120)
        except tinker.RequestFailedError as e:
            failed_right += f"the worker for {victim.label} died" in str(e) and paths[i] in str(e)
    others_ok = 0
    for fut, tc in later:
        try:
            fut.result(timeout=120)
            tc.optim_step(adam).result(timeout=120)
            others_ok += 1
        except Exception as e:  # noqa: BLE001 - counted: any failure here breaks isolation
            print(f"an untouched client's call failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    untouched = {s.label: (s.supervisor.proc.pid, s.supervisor.generation) for s in handle.workers
                 if s is not victim} == others
    while victim.supervisor.generation == 0 or victim.runtime.health() is not None:
        if time.monotonic() - killed > RESTART_BOUND_S:
            break
        time.sleep(0.5)
    restart_s = time.monotonic() - killed
    back = victim.supervisor.generation > 0 and victim.supervisor.proc.pid != old_pid
    same_device = back and _env(victim.supervisor.proc.pid).get("TINKER_SERVICE_DEVICE") == device
    resumed_equal = 0
    for i in mine:
        r = clients[i].create_training_client_from_state_with_optimizer(paths[i]).result()
        lp = r.forward(data[:1], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        resumed_equal += lp == before[i] and handle.service.models[r.model_id].steps == 1
    isolated = (bool(mine) and failed_right == len(mine) and others_ok == len(rest) and untouched and back
                and same_device and resumed_equal == len(mine))
    return {"worker_death_isolated": isolated, "killed_worker": victim.label, "killed_worker_clients": len(mine),
            "killed_calls_failed_naming_save": failed_right, "other_clients_ok": others_ok,
            "other_clients": len(rest), "other_workers_untouched": untouched, "restarted_on_its_device": same_device,
            "resumed_equal": resumed_equal, "worker_restart_s": round(restart_s, 1)}


def measure(devices: int = 4, clients: int = 16, work: str | Path | None = None,
            inventory: str = "sim") -> dict[str, Any]:
    """Start the service over `devices` simulated devices (`inventory` "sim") or the machine's own
    ("detect": `devices` is ignored), spread `clients` SDK clients over it, kill one worker; the figures."""
    if inventory not in ("sim", "detect"):
        raise ValueError(f"inventory must be 'sim' or 'detect', got {inventory!r}")
    import tinker

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    work = Path(work or tempfile.mkdtemp(prefix="node-tinker-"))
    work.mkdir(parents=True, exist_ok=True)
    data = [_datum([5, 9, 13, 21, 34, 55]), _datum([7, 8, 9, 10])]
    big = [_datum(np.random.default_rng(i).integers(3, 400, 1000).tolist()) for i in range(24)]
    t0 = time.monotonic()
    handle, other = _start(work, devices, inventory)
    started_s = time.monotonic() - t0
    print(f"service over {len(handle.workers)} workers up in {started_s:.1f} s", flush=True)
    sdk = [tinker.ServiceClient(base_url=handle.url, api_key=KEY) for _ in range(clients)]
    try:
        bases = [("tiny", other)[i % 2] for i in range(clients)]
        with ThreadPoolExecutor(clients) as pool:
            tcs = list(pool.map(lambda i: sdk[i].create_lora_training_client(bases[i], rank=4, seed=i).result(),
                                range(clients)))
        out = {**_spread(handle, tcs, bases), "service_start_s": round(started_s, 1)}
        print(f"spread: {out['tinker_clients_per_worker']}", flush=True)
        out.update(_kill_one(handle, sdk, tcs, data, big))
    finally:
        for sc in sdk:
            try:
                sc.close("success").result(timeout=60)
            except Exception:  # noqa: BLE001 - a session of a lost worker may already be gone
                pass
        handle.stop()
    out["node_tinker_s"] = round(time.monotonic() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=4, help="simulated devices (one worker per base on each)")
    p.add_argument("--clients", type=int, default=16, help="SDK clients, half on each of the 2 bases")
    p.add_argument("--work", default="", help="keep the service's home and ledger here")
    p.add_argument("--inventory", choices=("sim", "detect"), default="sim",
                   help="simulated devices (default), or the machine's own GPUs (--devices ignored)")
    args = p.parse_args(argv)
    if args.devices < 1 or args.clients < 2:
        print("error: --devices must be >= 1 and --clients >= 2", file=sys.stderr)
        return 2
    print(json.dumps(measure(args.devices, args.clients, args.work or None, args.inventory)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
