"""Placement on one 8-GPU node, simulated: `benchmarks.scheduler_sim`'s node trace as figures.

    python -m benchmarks.node_placement [--jobs 500] [--seed 0] [--devices 8]

LoRA kinds of four bases sized by `scheduler.estimate` from the bases' configs, exclusive SFT
and full-RL kinds beside them, placed by `placement.place` (new bases spread over idle devices,
steps joining their base's worker) against FIFO whole-device scheduling, both checked by
replaying their audit logs. The last line printed is one JSON object (`measure`'s), for
`benchmarks.node` to compose: makespan_ratio (ours / FIFO), makespan_h, fifo_makespan_h,
unnamed_makespan_ratio (the same trace with bases unnamed: every LoRA job its own copy, packed
best-fit), mean_wait_ratio, max_devices_busy (goal: all of them), oversubscribed (goal 0), devices, jobs.
"""

from __future__ import annotations

import argparse
import json

from benchmarks import scheduler_sim as sim
from tinker_pipelines.scheduler import Inventory


def measure(jobs: int = sim.JOBS, seed: int = sim.SEED, devices: int = sim.NODE_GPUS,
            aggregate_ratio: float = sim.AGGREGATE_RATIO_4,
            starve_after_min: float = sim.STARVE_AFTER_MIN) -> dict:
    """The node trace's figures (see the module docstring)."""
    inventory = Inventory.from_config({"count": devices, "memory_gb": sim.GPU_MEMORY_GB})
    trace = sim.node_trace(jobs, seed, devices)
    starve = starve_after_min * 60.0 if starve_after_min > 0 else None
    ours, fifo, ratio, wait_ratio = sim._compare(trace, inventory, aggregate_ratio, starve)
    _, _, unnamed, _ = sim._compare(sim.unnamed(trace), inventory, aggregate_ratio, starve)
    return {"makespan_ratio": round(ratio, 4), "makespan_h": round(ours.makespan_s / 3600, 2),
            "fifo_makespan_h": round(fifo.makespan_s / 3600, 2), "unnamed_makespan_ratio": round(unnamed, 4),
            "mean_wait_ratio": round(wait_ratio, 4), "max_devices_busy": ours.max_devices_busy,
            "oversubscribed": ours.oversubscribed, "devices": devices, "jobs": len(trace)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--jobs", type=int, default=sim.JOBS)
    ap.add_argument("--seed", type=int, default=sim.SEED)
    ap.add_argument("--devices", type=int, default=sim.NODE_GPUS)
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.devices < 4:
        ap.error("--jobs must be at least 1 and --devices at least 4 (the full-RL kind takes 4)")
    out = measure(args.jobs, args.seed, args.devices)
    print(f"{out['jobs']} jobs on {out['devices']} simulated 80 GB GPUs: makespan {out['makespan_h']} h vs "
          f"{out['fifo_makespan_h']} h FIFO whole-device ({out['makespan_ratio']}x; bases unnamed "
          f"{out['unnamed_makespan_ratio']}x), at most {out['max_devices_busy']} devices busy, "
          f"oversubscribed {out['oversubscribed']}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
