"""The simulated part of `benchmarks.scheduler`: the trace built from the real part's
measurements (`sim_kinds`, `mean_gap_min`; MEASURED when there is no real run), run through
`benchmarks.scheduler_sim` against FIFO whole-device scheduling (`sim_part`), with the lower
bounds on makespan_ratio and the sensitivity table."""

from __future__ import annotations

import math
from typing import Any

from benchmarks import scheduler_sim as sim
from tinker_pipelines.scheduler import Inventory

MEASURED = {
    "lora_rl": {"runs": 8, "devices": 1, "memory_gb": 2.0, "sharing": "lora", "run_step_s": 17.71},
    "full_rl": {"runs": 4, "devices": 1, "memory_gb": 2.0, "sharing": "exclusive", "run_step_s": 11.74},
    "sft": {"runs": 4, "devices": 1, "memory_gb": 0.0, "sharing": "exclusive", "run_step_s": 9.83},
    "inference": {"runs": 4, "devices": 1, "memory_gb": 2.0, "sharing": "lora", "run_step_s": 7.06},
}
"""This benchmark's last real run (20 runs, all SUCCESS; per kind as in its JSON `real_kinds`), for `--part sim`."""
MEASURED_GPU_MEMORY_GB = 8.0
"""The real part's simulated GPU size when MEASURED was taken."""
SIM_GPUS = 16
SIM_GPU_MEMORY_GB = 80.0
SIM_JOBS = 500
TARGET_MEAN_MIN = 60.0
"""Share-weighted mean of the kinds' median durations after scaling."""
SIGMA = 0.5
LOAD = 1.5
STARVE_AFTER_MIN = 120.0
AGGREGATE_RATIO = 1.215
"""benchmarks.multi_lora's last aggregate_ratio on SmolLM2-135M (README)."""
GOAL = 0.6


def sim_kinds(measured: dict[str, dict[str, Any]], real_gpu_memory_gb: float) -> tuple[tuple[sim.Kind, ...], float]:
    """Simulation kinds from real measurements; returns (kinds, scale: simulated s per measured s)."""
    usable = {k: m for k, m in measured.items() if m.get("runs") and m.get("run_step_s")}
    if not usable:
        raise ValueError("no kind has a measured run_step_s (no successful run): nothing to feed the simulation")
    total = sum(m["runs"] for m in usable.values())
    mean_s = sum(m["runs"] / total * m["run_step_s"] for m in usable.values())
    scale = TARGET_MEAN_MIN * 60.0 / mean_s
    kinds = []
    for name, m in usable.items():
        lora = m["sharing"] == "lora"
        memory = m["memory_gb"] / real_gpu_memory_gb * SIM_GPU_MEMORY_GB if lora else SIM_GPU_MEMORY_GB
        kinds.append(sim.Kind(name, m["runs"] / total, int(m["devices"] or 1), round(memory, 6),
                              "lora" if lora else "exclusive", m["run_step_s"] * scale / 60.0, SIGMA))
    return tuple(kinds), scale


def mean_gap_min(kinds: tuple[sim.Kind, ...], load: float, gpus: int = SIM_GPUS) -> float:
    """The mean arrival gap that offers `load` x what `gpus` serve under FIFO (whole devices, no sharing)."""
    device_min = sum(k.share * k.devices * k.median_min * math.exp(k.sigma ** 2 / 2) for k in kinds)
    return device_min / (gpus * load)


def bounds(jobs: list[sim.Job], ratio: float, fifo: sim.Result) -> tuple[float, float]:
    """Two lower bounds on makespan_ratio: device-time (LoRA jobs at the best aggregate their memory
    allows, exclusive jobs unchanged, no device ever idle: our least device-time / FIFO's x FIFO's
    utilization) and arrivals (no job ends before its arrival plus its duration alone)."""
    device = sim.device_time_bound(jobs, ratio, SIM_GPU_MEMORY_GB) * fifo.utilization
    arrival = max(j.arrival_s + j.work_s for j in jobs) / fifo.makespan_s
    return device, arrival


def aggregate_needed(jobs: list[sim.Job], fifo: sim.Result, goal: float) -> float | None:
    """The least aggregate(4) at which neither bound excludes makespan_ratio <= goal (a necessary
    condition, not a sufficient one); None: no co-tenancy factor would do on this trace."""
    def ok(r: float) -> bool:
        return max(bounds(jobs, r, fifo)) <= goal

    lo, hi = 1.0, 1e6
    if not ok(hi):
        return None
    if ok(lo):
        return 1.0
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


SENSITIVITY = ((1.0, None), (2.0, None), (3.0, None), (4.0, None), (None, 0.9), (None, 3.0), (3.0, 3.0),
               (4.0, 3.0))
"""(aggregate(4), offered load) variants of the measured trace; None: the run's own value."""


def sim_part(kinds: tuple[sim.Kind, ...], ratio: float, jobs_n: int, seed: int, load: float,
             log=print) -> dict[str, Any]:
    inventory = Inventory.from_config({"count": SIM_GPUS, "memory_gb": SIM_GPU_MEMORY_GB})
    starve = STARVE_AFTER_MIN * 60.0
    gap = mean_gap_min(kinds, load)
    jobs = sim.trace(jobs_n, seed, kinds, gap)
    ours, fifo, makespan_ratio, wait_ratio = sim._compare(jobs, inventory, ratio, starve)
    device_bound, arrival_bound = bounds(jobs, ratio, fifo)
    bound = max(device_bound, arrival_bound)
    needed = aggregate_needed(jobs, fifo, GOAL)
    log(f"sim: {len(jobs)} jobs on {SIM_GPUS} x {SIM_GPU_MEMORY_GB:g} GB GPUs, aggregate(4) = {ratio:g}, "
        f"offered load {load:g} (mean gap {gap:.2f} min), reservation after {STARVE_AFTER_MIN:g} min, seed {seed}")
    log(f"{'kind':12}{'share':>7}{'devices':>9}{'memory GB':>11}{'sharing':>11}{'median min':>12}")
    for k in kinds:
        log(f"{k.name:12}{k.share:7.2f}{k.devices:9d}{k.memory_gb:11.1f}{k.sharing:>11}{k.median_min:12.1f}")
    log(f"{'':26}{'packed (ours)':>15}{'FIFO exclusive':>16}")

    def all_w(r: sim.Result) -> list[float]:
        return [w for ws in r.waits_s.values() for w in ws]

    rows = [("makespan (h)", ours.makespan_s / 3600, fifo.makespan_s / 3600),
            ("mean wait (min)", sim._mean(all_w(ours)) / 60, sim._mean(all_w(fifo)) / 60),
            ("max wait (min)", max(all_w(ours), default=0) / 60, max(all_w(fifo), default=0) / 60)]
    for k in kinds:
        rows.append((f"  mean wait {k.name}", sim._mean(ours.waits_s[k.name]) / 60, sim._mean(fifo.waits_s[k.name]) / 60))
    for label, a, b in rows:
        log(f"{label:26}{a:15.1f}{b:16.1f}")
    log(f"{'utilization':26}{ours.utilization:15.3f}{fifo.utilization:16.3f}")
    met = makespan_ratio <= GOAL
    log(f"makespan_ratio {makespan_ratio:.3f} (goal <= {GOAL}: {'met' if met else 'NOT met'}); lower bounds on this "
        f"trace: device-time {device_bound:.3f}, arrivals {arrival_bound:.3f}")
    if not met:
        if device_bound > GOAL:
            log(f"  at the measured aggregate(4) = {ratio:g} the device-time bound alone ({device_bound:.3f}) "
                f"exceeds {GOAL}: no schedule of this trace reaches the goal")
        if arrival_bound > GOAL:
            log(f"  at offered load {load:g} the arrivals bound ({arrival_bound:.3f}) exceeds {GOAL} at any "
                f"co-tenancy factor (more load would lower it: see the table)")
        if needed is not None and bound > GOAL:
            log(f"  the bounds allow <= {GOAL} only from aggregate(4) >= {needed:.2f} (necessary, not sufficient)")
        if bound <= GOAL:
            log(f"  the bounds ({bound:.3f}) allow {GOAL}; the schedule does not reach it")
    log("sensitivity (same kinds and seed): aggregate(4), load, trace -> makespan_ratio, mean_wait_ratio, "
        "utilization, bounds (device-time, arrivals)")
    variants = [(r4 or ratio, ld or load, None) for r4, ld in SENSITIVITY]
    if needed is not None and needed > 1.0:  # does the schedule reach the goal where the bounds first allow it?
        variants.insert(4, (round(needed, 3), load, None))
    variants += [(ratio, None, "scheduler_sim kinds"), (3.0, None, "scheduler_sim kinds")]
    table = []
    for r4, ld, other in variants:
        vjobs = (sim.trace(jobs_n, seed, sim.KINDS, sim.MEAN_GAP_MIN) if other
                 else sim.trace(jobs_n, seed, kinds, mean_gap_min(kinds, ld)))
        o, f, m, w = sim._compare(vjobs, inventory, r4, starve)
        bd, ba = bounds(vjobs, r4, f)
        table.append({"aggregate_ratio": r4, "load": ld, "trace": other or "measured kinds",
                      "makespan_ratio": round(m, 4), "mean_wait_ratio": round(w, 4),
                      "utilization": round(o.utilization, 4), "device_time_bound": round(bd, 4),
                      "arrival_bound": round(ba, 4)})
        log(f"  {r4:6.3g}  {'-' if ld is None else f'{ld:g}':>4}  {other or 'measured kinds':20} ->  "
            f"{m:.3f}  {w:.3f}  {o.utilization:.3f}  ({bd:.3f}, {ba:.3f})")
    o, _, m, w = sim._compare(jobs, inventory, ratio, None)
    log(f"  without reservations: {m:.3f}  {w:.3f}  {o.utilization:.3f}")
    table.append({"aggregate_ratio": ratio, "load": load, "trace": "measured kinds, no reservations",
                  "makespan_ratio": round(m, 4), "mean_wait_ratio": round(w, 4), "utilization": round(o.utilization, 4)})
    return {"makespan_ratio": round(makespan_ratio, 4), "mean_wait_ratio": round(wait_ratio, 4),
            "sim_utilization": round(ours.utilization, 4), "fifo_utilization": round(fifo.utilization, 4),
            "jobs": len(jobs), "aggregate_ratio": ratio, "load": load, "makespan_bound": round(bound, 4),
            "device_time_bound": round(device_bound, 4), "arrival_bound": round(arrival_bound, 4),
            "goal_makespan_ratio": GOAL, "goal_met": met,
            "aggregate_ratio_needed": None if needed is None else round(needed, 3),
            "sim_kinds": {k.name: {"share": round(k.share, 4), "devices": k.devices, "memory_gb": k.memory_gb,
                                   "sharing": k.sharing, "median_min": round(k.median_min, 2)} for k in kinds},
            "sensitivity": table}
