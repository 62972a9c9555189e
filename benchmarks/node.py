"""The whole node on CPU (issue 50): a simulated inventory of 8 devices, one CPU process per device
a run uses, every part measured by its own module and reported together.

    python -m benchmarks.node            # every part (~10 minutes on 2 idle cores)
    python -m benchmarks.node --quick    # a test's scale
    python -m benchmarks.node --parts workers,tinker

Parts (each runnable alone as `python -m benchmarks.node_<part>`):
- `workers` (`node_workers`): bases x experiments concurrent LoRA steps on `gpu_executor`, each
  on the worker of the device it leased: `steps_on_leased_worker` (goal 1.0),
  `max_devices_busy` (goal 8 when the queue has work for 8), `oversubscribed` (goal 0).
- `placement` (`node_placement`): the placement code over an 8-GPU node trace whose LoRA jobs
  are sized by the memory estimate, against FIFO whole-device: `makespan_ratio`.
- `tinker` (`node_tinker`): SDK clients on a Tinker service over 4 simulated devices and 2
  bases: `tinker_sessions_spread` and `worker_death_isolated` (goals true).
- `ddp` (`node_ddp`): a 2-rank full-parameter step launched by the executor with split
  rollouts: `ddp_rollouts_split_equal` (goal true).

Last line: one JSON object with every part's keys (a part's own keys prefixed where two parts
name the same figure: `placement_max_devices_busy`, `placement_oversubscribed`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PARTS = ("workers", "placement", "tinker", "ddp")
QUICK = {"workers": {"devices": 4, "bases": 1, "experiments": 4}, "tinker": {"devices": 2, "clients": 4},
         "placement": {"jobs": 100}, "ddp": {}}
"""Each part's arguments at `--quick` (a test's scale); the defaults are the issue's."""


def _part(name: str, quick: bool) -> dict:
    """One part's figures, by its own module's `measure`."""
    args = QUICK[name] if quick else {}
    if name == "workers":
        from benchmarks import node_workers as m
        got = m.measure(**args)
        return {k: got[k] for k in ("steps_on_leased_worker", "max_devices_busy", "oversubscribed", "workers")
                if k in got}
    if name == "placement":
        from benchmarks import node_placement as m
        got = m.measure(**args)
        return {("placement_" + k if k in ("max_devices_busy", "oversubscribed") else k): v for k, v in got.items()}
    if name == "tinker":
        from benchmarks import node_tinker as m
        got = m.measure(**args)
        return {k: got[k] for k in ("tinker_sessions_spread", "worker_death_isolated") if k in got}
    from benchmarks import node_ddp as m
    got = m.measure(**args)
    return {k: got[k] for k in ("ddp_rollouts_split_equal", "rows_per_rank") if k in got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="every part at a test's scale")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        print(f"error: --parts: {', '.join(unknown) or 'none given'} not among {', '.join(PARTS)}", file=sys.stderr)
        return 2
    out: dict = {}
    for name in parts:
        t0 = time.perf_counter()
        got = _part(name, args.quick)
        print(f"{name}: {json.dumps(got)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        out.update(got)
    out["load_avg_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
