"""The GPU-aware placement at scale, simulated: 16 x 80 GB GPUs, a seeded trace of 500 jobs.

    python -m benchmarks.scheduler_sim [--jobs 500] [--seed 0] [--aggregate-ratio 1.5] [--starve-after-min 120]
                                       [--node] [--devices N]

A discrete-event simulation drives the scheduler's own `placement.place` (and its
anti-starvation reservation `reserve`) over a simulated `Inventory`, and compares it with the
baseline OpenTinker-style schedulers use: every job gets whole devices, first come first
served, and the head of the queue blocks everyone behind it. Both schedules are written as
ledger audit events and checked with `replay_audit` (no device over-subscribed, no exclusive
job sharing), which also measures utilization (device-seconds with at least one holder).

Trace assumptions (the constants below, hand-set; `benchmarks.scheduler` drives the same
simulation with kinds, memory and durations measured by its real part):
- An 8B-class base model in bf16 on 80 GB GPUs. A LoRA job reserves its own copy of the base
  plus adapter, optimizer state and activations (no base sharing between tenants is assumed);
  full-parameter jobs need whole devices.
- Kinds, by share of jobs: LoRA RL experiments, LoRA evaluation/inference, full-parameter SFT
  (2 GPUs) and full-parameter RL (4 GPUs); per kind a fixed device count and memory, and a
  log-normal duration (when alone on its devices) around a median.
- Arrivals are a Poisson process (exponential gaps, mean MEAN_GAP_MIN) that offers more work
  than FIFO can serve, so a queue builds: the regime where the scheduler matters (an
  under-loaded cluster finishes when the last job arrives, under any scheduler).
- Co-tenancy is not free: k jobs on one device each run at aggregate(k)/k of their alone speed,
  aggregate(1) = 1 and aggregate(4) = AGGREGATE_RATIO_4; in between aggregate is interpolated
  geometrically (aggregate(k) = k ** (log R4 / log 4): concave, the first co-tenant gains most)
  and beyond 4 it stays at R4 (no extrapolated gain). A multi-device job runs at the speed of
  its slowest device. The baseline never co-locates, so its jobs always run at full speed.
- Our scheduler backfills: every queued job that fits is placed, in arrival order; once the
  oldest queued job has waited longer than STARVE_AFTER_MIN, the devices `reserve` picks for it
  are closed to younger jobs until it is placed (as the ledger does; its default threshold is
  10 min because Dagster steps are minutes long, the jobs here are hours long).

What it can show: with aggregate(4) = R4 a LoRA job needs at best 1/R4 of the device-time it
takes alone, an exclusive job all of it, so makespan_ratio >= (our least device-time / FIFO's)
x FIFO's utilization. The run prints that bound; on this trace exclusive jobs are about two
thirds of the device-time, so at R4 = 1.5 it is ~0.85, and even an all-LoRA trace could not go
below 1/R4 = 0.67 unless FIFO idled devices. It also prints a few other R4 values and the
result without reservations, on the same trace.

`--node`: the trace of one 8-GPU node (`node_kinds`): per base (Llama-3-8B, Qwen2.5-7B,
Llama-3.2-3B and 1B shapes) a LoRA RL and an inference kind whose memory comes from
`scheduler.estimate` on the base's config, beside the same exclusive SFT and full-RL kinds. A
LoRA job placed where no worker holds its base starts one (a holding of the base's weights that
lives while a job of that base is on the device) and reserves only its adapter and batch; one
placed beside its base's worker reserves only those. `place` spreads new bases over idle
devices while enough stay free for the exclusive jobs waiting ahead. The run also prints the
same trace placed as before bases were named (every LoRA job its own copy, packed best-fit).
`--devices N` changes the GPU count of either trace.

The last line printed is one JSON object: makespan_ratio (ours / FIFO), mean_wait_ratio,
sim_utilization, fifo_utilization, jobs, devices, max_devices_busy, oversubscribed (from the
audit replay) and, with --node, unnamed_makespan_ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass, replace

from tinker_pipelines.scheduler import Inventory, StepNeeds, check_fits, place, replay_audit, reserve, starving
from tinker_pipelines.scheduler.estimate import Batch, ModelShape, estimate_memory
from tinker_pipelines.scheduler.placement import granted_needs
from tinker_pipelines.scheduler.ledger import AuditEvent

GPUS = 16
GPU_MEMORY_GB = 80.0
JOBS = 500
SEED = 0
AGGREGATE_RATIO_4 = 1.5
"""Aggregate throughput of 4 co-tenant LoRA jobs on one device relative to 1 alone."""
MEAN_GAP_MIN = 4.0
"""Mean gap between arrivals; FIFO serves one job per ~6.6 min here, so the queue grows."""
STARVE_AFTER_MIN = 120.0
"""Once the oldest queued job has waited this long, devices are reserved for it."""


@dataclass(frozen=True)
class Kind:
    """One kind of job in the trace."""

    name: str
    """Label in the report."""
    share: float
    """Fraction of the jobs."""
    devices: int
    """Devices per job."""
    memory_gb: float
    """Memory per device: what a lora job reserves (an exclusive job takes the whole device)."""
    sharing: str
    """'lora' or 'exclusive' under our scheduler (the baseline makes every job exclusive)."""
    median_min: float
    """Median duration alone on its devices, minutes."""
    sigma: float
    """Log-normal spread of the duration."""
    base: str = ""
    """The base a lora job's memory_gb includes a copy of; '' : none named (packed as before)."""
    resident_gb: float = 0.0
    """What a lora job reserves where a worker already holds its base (its adapter and batch)."""


KINDS = (
    Kind("lora_rl", 0.45, 1, 20.0, "lora", 60.0, 0.5),      # rollouts + LoRA updates on its own base copy
    Kind("inference", 0.30, 1, 18.0, "lora", 15.0, 0.5),    # evaluation of an adapter: base + KV cache
    Kind("sft", 0.15, 2, 80.0, "exclusive", 45.0, 0.5),     # full-parameter SFT, ZeRO over 2 GPUs
    Kind("full_rl", 0.10, 4, 80.0, "exclusive", 120.0, 0.5),  # full-parameter RL: policy + reference over 4 GPUs
)


NODE_GPUS = 8
NODE_LOAD = 1.5
"""Offered load of the node trace: 1.5 x what FIFO whole-device scheduling serves on its GPUs."""
NODE_BASES = {
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "llama3.2-3b": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        tie_word_embeddings=True),
}
"""The node trace's bases: their published shapes as config.json mappings (bf16, no weights)."""
NODE_RL_BATCH = Batch(sample_rows=64, prompt_tokens=512, new_tokens=512, train_rows=8, gradient_checkpointing=True)
"""A LoRA RL step: 8 groups of 8 rollouts of up to 512 + 512 tokens, micro-batches of 8, checkpointed."""
NODE_EVAL_BATCH = Batch(sample_rows=64, prompt_tokens=512, new_tokens=512, train_rows=0)
"""An evaluation/inference step: the same decode, no training."""


def node_kinds() -> tuple[Kind, ...]:
    """The node trace's kinds: per base a LoRA RL kind (rank 16) and an inference kind, whose
    memory_gb and resident_gb come from `estimate_memory` on the base's config; full-parameter
    SFT (2 GPUs) and RL (4 GPUs) exclusive; shares and durations as in KINDS."""
    kinds = []
    for base, config in NODE_BASES.items():
        shape = ModelShape.from_config(config)
        for name, share, batch, rank, median in (("lora_rl", 0.45, NODE_RL_BATCH, 16, 60.0),
                                                 ("inference", 0.30, NODE_EVAL_BATCH, None, 15.0)):
            cold = estimate_memory(shape, "bfloat16", batch, rank)
            warm = estimate_memory(shape, "bfloat16", batch, rank, base_resident=True)
            kinds.append(Kind(f"{name}:{base}", share / len(NODE_BASES), 1, round(cold.total_gb, 3), "lora",
                              median, 0.5, base, round(warm.total_gb, 3)))
    kinds += [Kind("sft", 0.15, 2, GPU_MEMORY_GB, "exclusive", 45.0, 0.5),
              Kind("full_rl", 0.10, 4, GPU_MEMORY_GB, "exclusive", 120.0, 0.5)]
    return tuple(kinds)


def offered_gap_min(kinds: tuple[Kind, ...], load: float, gpus: int) -> float:
    """The mean arrival gap that offers `load` x what `gpus` serve under FIFO (whole devices)."""
    device_min = sum(k.share * k.devices * k.median_min * math.exp(k.sigma ** 2 / 2) for k in kinds)
    return device_min / (gpus * load)


@dataclass(frozen=True)
class Job:
    """One job of the trace."""

    id: int
    """Position in the trace (also its lease id in the audit)."""
    kind: Kind
    """What kind of job it is."""
    arrival_s: float
    """Submission time."""
    work_s: float
    """Duration alone on its devices."""


@dataclass(frozen=True)
class Result:
    """One simulated schedule."""

    makespan_s: float
    """Time the last job finished."""
    waits_s: dict[str, list[float]]
    """Per kind, each job's wait from arrival to start."""
    utilization: float
    """Busy device-seconds / (devices x makespan), from replaying the audit."""
    max_devices_busy: int = 0
    """The most devices holding at least one job at once."""
    oversubscribed: int = 0
    """Devices over-subscribed at some point, from replaying the audit (simulate asserts 0)."""


def trace(jobs: int, seed: int, kinds: tuple[Kind, ...] = KINDS, mean_gap_min: float = MEAN_GAP_MIN) -> list[Job]:
    """A seeded trace: Poisson arrivals, kinds drawn by share, log-normal durations."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(jobs):
        kind = rng.choices(kinds, weights=[k.share for k in kinds])[0]
        work = kind.median_min * 60.0 * math.exp(rng.gauss(0.0, kind.sigma))
        out.append(Job(i, kind, t, work))
        t += rng.expovariate(1.0 / (mean_gap_min * 60.0))
    return out


def kinds_of(jobs: list[Job]) -> tuple[Kind, ...]:
    """The kinds that occur in a trace, in order of first appearance."""
    return tuple(dict.fromkeys(j.kind for j in jobs))


def aggregate(k: int, ratio_4: float) -> float:
    """Aggregate throughput of k co-tenants relative to one alone (see the module docstring)."""
    if k <= 1:
        return 1.0
    return k ** (math.log(ratio_4) / math.log(4)) if k < 4 else ratio_4


def simulate(jobs: list[Job], inventory: Inventory, fifo: bool, ratio_4: float,
             starve_after_s: float | None) -> Result:
    """Run the trace to completion; `fifo`: whole devices, strict first come first served.

    A lora job of a kind with a `base` placed where no worker holds that base starts one there: a
    holding of the base's weights (memory_gb - resident_gb) that lives while a job of that base
    is on the device; the job itself reserves resident_gb."""
    kinds = kinds_of(jobs)
    needs = {k.name: _needs(k, fifo) for k in kinds}
    for n in needs.values():
        check_fits(n, inventory)
    arrivals = sorted(jobs, key=lambda j: j.arrival_s)
    queue: list[Job] = []
    running: dict[int, _Running] = {}
    workers = _Workers()
    events: list[AuditEvent] = []
    waits: dict[str, list[float]] = {k.name: [] for k in kinds}
    t, nxt, max_busy = 0.0, 0, 0

    def log(event: str, lease_id: int, devices: tuple[int, ...], n: StepNeeds) -> None:
        events.append(AuditEvent(len(events) + 1, t, event, lease_id, devices, n))

    while nxt < len(arrivals) or queue or running:
        t_arrive = arrivals[nxt].arrival_s if nxt < len(arrivals) else math.inf
        t_next = min([t_arrive] + [t + r.remaining_s / r.rate for r in running.values()])
        assert t_next < math.inf, "jobs queued but nothing can ever run"
        for r in running.values():
            r.remaining_s -= r.rate * (t_next - t)
        t = t_next
        for r in [r for r in running.values() if r.remaining_s <= 1e-6 * r.job.work_s]:
            del running[r.job.id]
            log("release", r.job.id, r.devices, r.needs)
            for w in workers.leave(r):
                log("release", w.lease_id, w.devices, w.needs)
        while nxt < len(arrivals) and arrivals[nxt].arrival_s <= t:
            queue.append(arrivals[nxt])
            nxt += 1
        for r in _schedule(queue, list(running.values()), workers, needs, inventory, fifo, t, starve_after_s):
            running[r.job.id] = r
            waits[r.job.kind.name].append(t - r.job.arrival_s)
            for w in r.started:
                log("grant", w.lease_id, w.devices, w.needs)
            log("grant", r.job.id, r.devices, r.needs)
        tenants = [0] * len(inventory)
        for r in running.values():
            for d in r.devices:
                tenants[d] += 1
        max_busy = max(max_busy, sum(1 for k in tenants if k))
        for r in running.values():  # a multi-device job runs at the pace of its slowest device
            r.rate = min(aggregate(tenants[d], ratio_4) / tenants[d] for d in r.devices)
    report = replay_audit(events, inventory, until=t)
    assert not report.violations, report.violations[:3]
    return Result(t, waits, report.utilization, max_busy, int(report.oversubscribed))


@dataclass
class _Running:
    """A job holding devices (mutable: its remaining work and rate change as tenants come and go)."""

    job: Job
    devices: tuple[int, ...]
    needs: StepNeeds
    remaining_s: float
    rate: float = 1.0
    started: tuple[_Worker, ...] = ()


@dataclass(frozen=True)
class _Worker:
    """A resident worker's holding of one base's weights on one device."""

    lease_id: int
    devices: tuple[int, ...]
    needs: StepNeeds


class _Workers:
    """The workers of the simulated node: which device holds which base, and for how many jobs."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, str], _Worker] = {}
        self.users: dict[tuple[int, str], int] = {}
        self.started = 0

    def resident(self) -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        for d, base in self.held:
            out.setdefault(d, set()).add(base)
        return out

    def join(self, job: Job, devices: tuple[int, ...], n: StepNeeds) -> tuple[StepNeeds, tuple[_Worker, ...]]:
        """The job's own reservation, and the workers it starts (its cost beyond resident_gb)."""
        if not n.base or n.resident_gb <= 0:
            return n, ()
        started = []
        for d in devices:
            key = (d, n.base)
            if key not in self.held:
                self.started += 1
                self.held[key] = _Worker(WORKER_LEASE_BASE + self.started, (d,),
                                         StepNeeds(1, n.memory_gb - n.resident_gb, "lora", n.base))
                started.append(self.held[key])
            self.users[key] = self.users.get(key, 0) + 1
        return replace(n, memory_gb=n.resident_gb), tuple(started)

    def leave(self, r: _Running) -> list[_Worker]:
        """The workers that go with `r`'s end: the last job of their base on their device."""
        gone = []
        for d in r.devices if r.needs.base else ():
            key = (d, r.needs.base)
            self.users[key] -= 1
            if self.users[key] == 0:
                gone.append(self.held.pop(key))
        return gone

    def holdings(self) -> list[_Worker]:
        return list(self.held.values())


WORKER_LEASE_BASE = 10_000_000
"""Audit lease ids of the simulated workers start here (jobs use their trace position)."""


def _needs(kind: Kind, fifo: bool) -> StepNeeds:
    if fifo or kind.sharing == "exclusive":
        return StepNeeds(kind.devices, 0.0, "exclusive")
    return StepNeeds(kind.devices, kind.memory_gb, kind.sharing, kind.base, kind.resident_gb)


def _schedule(queue: list[Job], running: list[_Running], workers: _Workers, needs: dict[str, StepNeeds],
              inventory: Inventory, fifo: bool, t: float, starve_after_s: float | None) -> list[_Running]:
    """One pass over the queue in arrival order, the way the ledger serves its waiters; removes
    and returns the jobs placed. Idle devices are kept for the exclusive jobs left waiting ahead."""
    holdings: list = list(running) + workers.holdings()
    failed: set[StepNeeds] = set()  # a grant only shrinks free capacity: what failed stays failed
    exclude: tuple[int, ...] = ()
    head_waits = False
    keep_idle = 0
    placed: list[_Running] = []
    for job in queue:
        n = needs[job.kind.name]
        if head_waits and (n in failed or len(failed) == len(set(needs.values()))):
            keep_idle += n.devices if n.sharing == "exclusive" else 0
            continue
        devices = place(n, inventory, holdings, exclude, workers.resident(), keep_idle)
        if devices is None:
            keep_idle += n.devices if n.sharing == "exclusive" else 0
            if head_waits:
                failed.add(n)
                continue
            head_waits = True  # this is the oldest job left waiting
            if fifo:
                break  # head-of-line blocking
            if starving(job.arrival_s, t, starve_after_s):
                exclude = reserve(n, inventory, holdings)
            continue
        own, started = workers.join(job, devices, granted_needs(n, devices, workers.resident()))
        r = _Running(job, devices, own, job.work_s, started=started)
        holdings += [r, *started]
        placed.append(r)
    done = {r.job.id for r in placed}
    queue[:] = [job for job in queue if job.id not in done]
    return placed


def device_time_bound(jobs: list[Job], ratio_4: float, gpu_memory_gb: float = GPU_MEMORY_GB) -> float:
    """Our least possible device-time over FIFO's: LoRA jobs at the best aggregate their memory
    allows, exclusive ones unchanged. makespan_ratio cannot fall below this x FIFO's utilization."""
    ours = fifo = 0.0
    for j in jobs:
        fifo += j.work_s * j.kind.devices
        if j.kind.sharing == "exclusive":
            ours += j.work_s * j.kind.devices
        else:
            # the first job brings the base (memory_gb), the rest join its worker (resident_gb)
            k_max = max(1, 1 + int((gpu_memory_gb - j.kind.memory_gb + 1e-9) // (j.kind.resident_gb or j.kind.memory_gb)))
            ours += j.work_s * j.kind.devices / max(aggregate(k, ratio_4) for k in range(1, k_max + 1))
    return ours / fifo


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _compare(jobs: list[Job], inventory: Inventory, ratio_4: float, starve_after_s: float | None):
    ours = simulate(jobs, inventory, False, ratio_4, starve_after_s)
    fifo = simulate(jobs, inventory, True, ratio_4, None)
    waits = [_mean([w for ws in r.waits_s.values() for w in ws]) for r in (ours, fifo)]
    return ours, fifo, ours.makespan_s / fifo.makespan_s, (waits[0] / waits[1] if waits[1] else math.nan)


def node_trace(jobs: int, seed: int, gpus: int = NODE_GPUS, load: float = NODE_LOAD,
               kinds: tuple[Kind, ...] | None = None) -> list[Job]:
    """The node trace: `node_kinds` arriving at `load` x FIFO's capacity on `gpus` devices."""
    kinds = kinds or node_kinds()
    return trace(jobs, seed, kinds, offered_gap_min(kinds, load, gpus))


def unnamed(jobs: list[Job]) -> list[Job]:
    """The same jobs with their bases unnamed: each LoRA job brings its own copy, packed best-fit
    (the placement before bases were named)."""
    kinds = {k: replace(k, base="", resident_gb=0.0) for k in kinds_of(jobs)}
    return [replace(j, kind=kinds[j.kind]) for j in jobs]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--jobs", type=int, default=JOBS)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--aggregate-ratio", type=float, default=AGGREGATE_RATIO_4,
                    help="aggregate throughput of 4 co-tenant LoRA jobs relative to 1 alone")
    ap.add_argument("--starve-after-min", type=float, default=STARVE_AFTER_MIN, help="<= 0: no reservations")
    ap.add_argument("--node", action="store_true",
                    help=f"the node trace: {NODE_GPUS} GPUs, LoRA kinds of 4 bases sized by the memory estimate")
    ap.add_argument("--devices", type=int, default=None,
                    help=f"GPUs (default {GPUS}, or {NODE_GPUS} with --node)")
    args = ap.parse_args(argv)
    gpus = args.devices or (NODE_GPUS if args.node else GPUS)
    if args.aggregate_ratio <= 0 or args.jobs < 1 or gpus < 1:
        ap.error("--aggregate-ratio must be positive, --jobs and --devices at least 1")
    inventory = Inventory.from_config({"count": gpus, "memory_gb": GPU_MEMORY_GB})
    kinds = node_kinds() if args.node else KINDS
    too_wide = [k.name for k in kinds if k.devices > gpus]
    if too_wide:
        ap.error(f"--devices {gpus}: kinds {', '.join(too_wide)} need more devices than that")
    jobs = node_trace(args.jobs, args.seed, gpus, kinds=kinds) if args.node else trace(args.jobs, args.seed)
    starve = args.starve_after_min * 60.0 if args.starve_after_min > 0 else None
    ours, fifo, makespan_ratio, wait_ratio = _compare(jobs, inventory, args.aggregate_ratio, starve)
    gap = offered_gap_min(kinds, NODE_LOAD, gpus) if args.node else MEAN_GAP_MIN
    print(f"{len(jobs)} jobs on {gpus} x {GPU_MEMORY_GB:g} GB GPUs, aggregate(4) = {args.aggregate_ratio:g}, "
          f"mean arrival gap {gap:.3g} min, reservation after {args.starve_after_min:g} min, seed {args.seed}")
    if args.node:
        for k in kinds:
            print(f"  {k.name:24} share {k.share:.3f}  {k.devices} x {k.memory_gb:6.1f} GB {k.sharing:9}"
                  + (f" ({k.resident_gb:.1f} GB beside its base's worker)" if k.base else ""))
    _report(jobs, ours, fifo, args.aggregate_ratio)
    print("sensitivity (same trace): aggregate(4), reservation -> makespan_ratio, mean_wait_ratio, utilization")
    for ratio, s in [(1.0, starve), (2.0, starve), (3.0, starve), (args.aggregate_ratio, None)]:
        o, _, m, w = _compare(jobs, inventory, ratio, s)
        print(f"  {ratio:4g}  {'off' if s is None else f'{s / 60:g} min':>8}  ->  {m:.3f}  {w:.3f}  {o.utilization:.3f}")
    out = {"makespan_ratio": round(makespan_ratio, 4), "mean_wait_ratio": round(wait_ratio, 4),
           "sim_utilization": round(ours.utilization, 4), "fifo_utilization": round(fifo.utilization, 4),
           "jobs": len(jobs), "devices": gpus, "max_devices_busy": ours.max_devices_busy,
           "oversubscribed": ours.oversubscribed}
    if args.node:  # the same trace placed as before bases were named: every LoRA job its own copy, packed
        o, _, m, w = _compare(unnamed(jobs), inventory, args.aggregate_ratio, starve)
        print(f"bases unnamed (each LoRA job its own copy, packed best-fit): makespan_ratio {m:.3f}, "
              f"mean_wait_ratio {w:.3f}, utilization {o.utilization:.3f}, max devices busy {o.max_devices_busy}")
        out["unnamed_makespan_ratio"] = round(m, 4)
    print(json.dumps(out))
    return out


def _report(jobs: list[Job], ours: Result, fifo: Result, ratio_4: float) -> None:
    width = max(26, 14 + max(len(k.name) for k in kinds_of(jobs)))
    print(f"{'':{width}}{'packed (ours)':>15}{'FIFO exclusive':>16}")
    rows = [("makespan (h)", ours.makespan_s / 3600, fifo.makespan_s / 3600)]
    for label, pick in (("mean wait (min)", _mean), ("max wait (min)", lambda ws: max(ws, default=0.0))):
        rows.append((label, pick([w for ws in ours.waits_s.values() for w in ws]) / 60,
                     pick([w for ws in fifo.waits_s.values() for w in ws]) / 60))
    for k in kinds_of(jobs):
        rows.append((f"  mean wait {k.name}", _mean(ours.waits_s[k.name]) / 60, _mean(fifo.waits_s[k.name]) / 60))
    for label, a, b in rows:
        print(f"{label:{width}}{a:15.1f}{b:16.1f}")
    print(f"{'utilization':{width}}{ours.utilization:15.3f}{fifo.utilization:16.3f}")
    print(f"{'max devices busy':{width}}{ours.max_devices_busy:15d}{fifo.max_devices_busy:16d}")
    bound = device_time_bound(jobs, ratio_4)
    print(f"device-time bound: at best we need {bound:.3f} of FIFO's device-time, so makespan_ratio >= "
          f"{bound * fifo.utilization:.3f} on this trace (perfect packing, no idle device)")


if __name__ == "__main__":
    main()
