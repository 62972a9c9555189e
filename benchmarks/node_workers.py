"""Workers by physical device: concurrent LoRA steps on a simulated node each train on the worker
of the device they leased (issue 50, item 1).

`measure(devices, bases, experiments)` runs one Dagster job on `gpu_executor` over a simulated
inventory of `devices` devices: one LoRA step per (base, experiment), all launched at once. Each
step finds its worker through the `PolicyEngine` resource (starting it, under a lease of its own,
when none answers on that device), creates its adapter there and takes one real training step
(`forward_backward` + `optim_step`), then reports what it leased and whom it talked to. Figures:

- `steps_on_leased_worker`: the fraction of steps whose worker holds its own lease on the very
  device the step leased (read from the ledger by the worker's pid) and calls itself by the same
  physical key (goal 1.0);
- `max_devices_busy`: the most devices holding a step's lease at once (goal: all, when the queue
  has work for all);
- `oversubscribed`: 1 when the ledger's audit replay finds a device over-subscribed (goal 0);
- `workers`, `distinct_worker_devices`, `seconds`, and the same for `--quick`.

Sizing: a step reserves more than half a device, so two steps never share one (each device runs
one step at a time, all devices are used), and a worker reserves 1 GB, so one worker per base
fits beside a step. Placement does not yet know which bases a device holds (the ledger records it:
`scheduler.workers.resident_bases`), so a device may end up with a worker of every base.

Workers are real processes (one tiny model each: hidden 16, one layer); on a 2-core machine most
of the time is their start (~10 CPU-s each: importing torch and transformers). Imports dagster:
not library code. `python -m benchmarks.node_workers [--quick]`: last line one JSON object.

`--inventory detect` (`measure(inventory="detect")`, what `scripts/gpu_check`'s node part runs)
takes the machine's own devices instead (the executor detects them through NVML): `--devices` is
then their number, steps and workers compute on CUDA, a step reserves all of a device but one
worker per base (so again one step per device), and `worker_keys_physical` says whether every
worker called itself by its leased GPU's UUID.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import dagster as dg

from tinker_pipelines.scheduler.executor import gpu_executor

MODEL_KWARGS = {"hidden_size": 16, "num_layers": 1}
WORKER_GB = 1.0
REPO = Path(__file__).resolve().parents[1]


def sizes(bases: int) -> tuple[float, float]:
    """(GB a step reserves, GB of a device): a step and one worker per base fit, two steps do not."""
    step = bases * WORKER_GB + 1
    return step, step + bases * WORKER_GB


def lora_step(base_seed: int, experiment: int, device: str = "cpu") -> str:
    """One LoRA training step on the worker of this step's leased device; what it saw, as JSON."""
    from dataclasses import asdict

    from resources.policy_engine import PolicyEngine
    from tinker_pipelines.config import config_from_dict
    from tinker_pipelines.scheduler.step_entry import cuda_state
    from tinker_pipelines.scheduler.workers import worker_device_key
    from tinker_pipelines.training.learner import LearnerConfig
    from tinker_pipelines.types import Datum
    from tinker_pipelines.worker.client import WorkerClient

    cfg = config_from_dict({"seed": experiment, "training": {"mode": "lora"},
                            "model": {"name": "tiny", "seed": base_seed, "kwargs": MODEL_KWARGS, "device": device,
                                      "dtype": "float32"}})
    address = PolicyEngine(start_worker=True, worker_lease_memory_gb=WORKER_GB).worker_address(cfg, None)
    name = f"b{base_seed}e{experiment}"
    tokens_T = tuple(range(1, 9))
    datum = Datum(tokens_T, tokens_T[1:] + (1,), (0.0,) * 4 + (1.0,) * 4, (-1.0,) * 8, (0.5,) * 8)
    client = WorkerClient(address)
    try:
        client.create(name, asdict(LearnerConfig(lora_rank=4)), experiment)
        metrics = client.forward_backward(name, [datum], "grpo", {})
        client.optim_step(name)
        stats = client.stats()
    finally:
        client.close()
    return json.dumps({"base": base_seed, "experiment": experiment, "pid": os.getpid(),
                       "lease_devices": os.environ.get("TINKER_LEASE_DEVICES"), "address": address,
                       "key": worker_device_key(device), "step_cuda": cuda_state(), "worker_pid": stats["pid"],
                       "worker_key": stats["device_key"], "worker_cuda": stats["cuda"],
                       "worker_base": stats["base"], "loss": metrics.get("loss")})


def make_job(bases: int, experiments: int, step_gb: float | None = None, device: str = "cpu") -> dg.JobDefinition:
    """One LoRA step per (base, experiment), independent of each other, all on `gpu_executor`;
    each reserves `step_gb` (default `sizes(bases)`) and computes on `device`."""
    step_gb = sizes(bases)[0] if step_gb is None else step_gb
    tags = {"tinker/devices": "1", "tinker/memory_gb": f"{step_gb:g}", "tinker/sharing": "lora"}

    def op_for(b: int, e: int) -> dg.OpDefinition:
        @dg.op(name=f"lora_b{b}_e{e}", tags=tags)
        def _op() -> str:
            return lora_step(b, e, device)
        return _op

    # experiment-major: the first wave holds every base
    ops = [op_for(b, e) for e in range(experiments) for b in range(bases)]

    @dg.job(name=f"node_workers_{bases}x{experiments}", executor_def=gpu_executor)
    def _job():
        for o in ops:
            o()
    return _job


@contextmanager
def _in_dir(path: Path) -> Iterator[None]:
    """Run with `path` as the working directory (workers' default sockets live under it) and the
    repository importable from there (step processes import this module)."""
    old_cwd, old_path = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(path)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), old_path) if p)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


def run_steps(bases: int, experiments: int, devices: int, home: Path, detected=None) -> list[dict]:
    """Execute the job once; the steps' records (raises with the failures' messages). `detected`:
    the machine's inventory, which the executor then detects itself (else a simulated one)."""
    if detected is None:
        _, device_gb = sizes(bases)
        args: tuple = (bases, experiments)
        execution = {"inventory": {"count": devices, "memory_gb": device_gb}}
    else:
        args, execution = (bases, experiments, detected_step_gb(detected, bases), _device(detected)), {}
    job = dg.build_reconstructable_job("benchmarks.node_workers", "make_job", reconstructable_args=args)
    execution.update({"ledger_path": str(home / "ledger.sqlite"), "max_concurrent": bases * experiments,
                      "poll_interval_s": 0.1})
    with dg.instance_for_test() as instance:
        with dg.execute_job(job, instance, run_config={"execution": {"config": execution}}) as result:
            if not result.success:
                raise RuntimeError("node_workers job failed: " + "; ".join(
                    str(getattr(e.event_specific_data, "error", None) or e.message)
                    for e in result.all_events if e.is_failure)[-3000:])
            return [json.loads(result.output_for_node(f"lora_b{b}_e{e}"))
                    for b in range(bases) for e in range(experiments)]


def detected_step_gb(inventory, bases: int) -> float:
    """A step's reservation on the machine's own devices: all of the smallest but one worker per base
    (more than half of any device, so two steps never share one)."""
    smallest = min(d.memory_gb for d in inventory)
    step = smallest - bases * WORKER_GB
    if step <= smallest / 2:
        raise ValueError(f"--inventory detect: a device of {smallest:.1f} GB cannot hold a step of more than half "
                         f"of it beside {bases} worker(s) of {WORKER_GB:g} GB")
    return round(step, 3)


def _device(inventory) -> str:
    """What steps and workers compute on: CUDA on a machine of GPUs, else the CPU."""
    return "cuda" if inventory[0].kind == "cuda" else "cpu"


def max_busy(events, is_step) -> int:
    """The most devices holding at least one lease that `is_step` accepts, at once."""
    held: dict[int, set[int]] = {}
    best = 0
    for ev in events:
        if not is_step(ev):
            continue
        for d in ev.devices:
            holders = held.setdefault(d, set())
            (holders.add if ev.event == "grant" else holders.discard)(ev.lease_id)
        best = max(best, sum(1 for h in held.values() if h))
    return best


def stop_workers(ledger_path: Path) -> None:
    """SIGTERM the workers this measurement started (the live owners of `worker:` leases in its own
    fresh ledger; each leads its own process group) and wait until they are gone."""
    from tinker_pipelines.scheduler.ledger import Ledger, owner_alive
    from tinker_pipelines.scheduler.workers import WORKER_STEP_PREFIX

    owners = [l.owner for l in Ledger(str(ledger_path)).leases()
              if (l.owner.step_key or "").startswith(WORKER_STEP_PREFIX) and owner_alive(l.owner)]
    for o in owners:
        try:
            os.killpg(o.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while any(owner_alive(o) for o in owners) and time.monotonic() < deadline:
        time.sleep(0.2)


def figures(records: list[dict], ledger_path: Path, inventory) -> dict:
    """The figures of one run, from the steps' records and the ledger (read while workers live)."""
    from tinker_pipelines.models import base_identity
    from tinker_pipelines.scheduler.ledger import Ledger, replay_audit
    from tinker_pipelines.scheduler.workers import WORKER_STEP_PREFIX, resident_bases, worker_step_key

    ledger = Ledger(str(ledger_path))
    worker_leases = {l.owner.pid: l for l in ledger.leases() if (l.owner.step_key or "").startswith(WORKER_STEP_PREFIX)}

    def on_leased_worker(r: dict) -> bool:
        lease = worker_leases.get(r["worker_pid"])
        base = base_identity("tiny", MODEL_KWARGS, r["base"])
        return (lease is not None and lease.devices == (int(r["lease_devices"]),) and r["worker_key"] == r["key"]
                and lease.owner.step_key == worker_step_key(base) and r["worker_base"] == base)

    events = ledger.audit_log()
    report = replay_audit(events, inventory)
    resident = resident_bases(ledger.leases())
    physical = [r["worker_key"] == inventory[int(r["lease_devices"])].uuid for r in records
                if inventory[int(r["lease_devices"])].kind == "cuda"]
    return {"steps": len(records),
            "steps_on_leased_worker": sum(map(on_leased_worker, records)) / max(1, len(records)),
            "max_devices_busy": max_busy(events, lambda e: not (e.step_key or "").startswith(WORKER_STEP_PREFIX)),
            "oversubscribed": int(report.oversubscribed),
            "workers": len({r["worker_pid"] for r in records}),
            "distinct_worker_devices": len({r["worker_key"] for r in records}),
            **({"worker_keys_physical": all(physical)} if physical else {}),
            "bases_per_device_max": max((len(b) for b in resident.values()), default=0),
            "cuda_initialized_in_steps": sum(r["step_cuda"] not in ("uninitialized", "torch not imported")
                                             for r in records),
            "cuda_initialized_in_workers": sum(r["worker_cuda"] not in ("uninitialized", "torch not imported")
                                               for r in records)}


def measure(devices: int = 8, bases: int = 4, experiments: int = 8, keep_records: bool = False,
            inventory: str = "sim") -> dict:
    """Run `bases` x `experiments` concurrent LoRA steps on `devices` simulated devices (`inventory`
    "sim"), or on the machine's own ("detect": `devices` is ignored); the figures (with `records`,
    each step's record, when `keep_records`)."""
    from tinker_pipelines.scheduler.inventory import Inventory

    if inventory not in ("sim", "detect"):
        raise ValueError(f"inventory must be 'sim' or 'detect', got {inventory!r}")
    detected = Inventory.detect() if inventory == "detect" else None
    devices = len(detected) if detected is not None else devices
    inv = detected or Inventory.from_config({"count": devices, "memory_gb": sizes(bases)[1]})
    with tempfile.TemporaryDirectory(prefix="nw", dir="/tmp") as tmp:  # short: Unix socket paths
        home = Path(tmp)
        start = time.perf_counter()
        try:
            with _in_dir(home):
                records = run_steps(bases, experiments, devices, home, detected)
            seconds = time.perf_counter() - start
            out = {"devices": devices, "device_kind": inv[0].kind, "bases": bases, "experiments": experiments,
                   **figures(records, home / "ledger.sqlite", inv), "seconds": round(seconds, 1)}
        finally:
            stop_workers(home / "ledger.sqlite")
    if keep_records:
        out["records"] = records
    return out


QUICK = {"devices": 4, "bases": 1, "experiments": 4}
FULL = {"devices": 8, "bases": 4, "experiments": 8}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a test's scale: {QUICK}")
    for k, v in FULL.items():
        parser.add_argument(f"--{k}", type=int, default=None, help=f"default {v} ({QUICK[k]} with --quick)")
    parser.add_argument("--inventory", choices=("sim", "detect"), default="sim",
                        help="simulated devices (default), or the machine's own GPUs (--devices ignored)")
    args = parser.parse_args(argv)
    scale = {k: getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else FULL)[k]
             for k in FULL}
    print(json.dumps(measure(**scale, inventory=args.inventory)), flush=True)


if __name__ == "__main__":
    main()
