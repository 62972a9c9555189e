"""Dagster + MLflow overhead: the same RL iterations through the `rl` job vs the plain loop.

Dagster side: the embedded default (sqlite instance, MLflow sqlite store) in a temporary folder;
the `sft` job, then one `execute_job` run of `rl` per iteration in this process (the model stays
resident), exactly as `assets.launch.run_iterations` does. Plain side:
`tinker_pipelines.loops.train.train(cfg)`, which does the same SFT inline. Same config and seed.
Timed: the RL iterations only — for the plain loop from the end of its baseline evaluation
(before iteration 0, which the Dagster side does not do) to its return; for Dagster, all the
`rl` runs, including loading the SFT base model in the first one. The SFT warm start (identical
on both sides) is not timed. The MLflow database is created before timing.

    python -m benchmarks.overhead [--iterations 10] [--repeats 2] [--executor in_process|gpu]

`--executor gpu`: the Dagster side runs on the GPU-aware executor (`TINKER_EXECUTOR=gpu`): every
step is its own process (forked from the preloaded server) holding a device lease from the
ledger, and the LoRA steps are thin clients of a resident worker started on the SFT base after
the `sft` run, as a deployment with workers runs: `TINKER_WORKER` names its socket in the
environment from the first run on, as in a deployment's. The worker's start is not timed (a
resident worker pays it once), nor is the step forkserver's (the `sft` run starts it). The worker runs with cross-adapter batching off: one experiment
has nothing to batch with, and its unbatched path is the in-process engine's, so the metrics
must be identical. The plain side is unchanged: `train(cfg)` in one process.

Last line: {"ratio": ..., "identical": ..., "iterations": ..., "load_avg_1min": [at start, at end], ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path


PRESETS = {
    # a realistic iteration length (~10 s here, like SmolLM2-135M at 16x8 episodes): the default
    "standard": {"model": {"name": "tiny", "kwargs": {"hidden_size": 256}},
                 "training": {"groups_per_batch": 128, "group_size": 8, "max_new_tokens": 32}},
    # the tests' scale (~0.1-0.5 s iterations): shows the fixed per-run cost in isolation
    "small": {"model": {"name": "tiny"}, "training": {"groups_per_batch": 16, "group_size": 8, "max_new_tokens": 16}},
}


PHASES = ("time/rollout_s", "time/train_s")
"""Per-iteration phase times both sides record (sampling the episodes; the optimizer step)."""


def bench_config(iterations: int, preset: str = "standard") -> dict:
    p = PRESETS[preset]
    return {"seed": 0, "model": p["model"],
            "env": {"path": "arithmetic", "kwargs": {"max_operand": 5}},
            "algorithm": {"name": "grpo", "kl_coef": 0.02},
            "training": {"mode": "lora", "iterations": iterations, "learning_rate": 2e-3, **p["training"]},
            "sft": {"steps": 100, "batch_size": 16, "examples": 500, "learning_rate": 3e-3,
                    "kwargs": {"verbose_fraction": 0.5}},
            "eval": {"every": 5, "num_tasks": 32}}


def run_plain(cfg_dict: dict, out: Path) -> tuple[float, float, list[dict], dict[str, list[float]]]:
    from tinker_pipelines.config import config_from_dict
    from tinker_pipelines.loops.train import deterministic_metrics, train

    cfg = config_from_dict({**cfg_dict, "output_dir": str(out)})
    marks: dict[str, float] = {}

    def on_iteration(m: dict) -> None:
        if m["iteration"] < 0:  # the baseline evaluation is done: iterations start now
            marks["start"], marks["cpu"] = time.perf_counter(), time.process_time()

    history = train(cfg, on_iteration=on_iteration)
    phases = {key: [m[key] for m in history if key in m and m["iteration"] >= 0] for key in PHASES}
    return (time.perf_counter() - marks["start"], time.process_time() - marks["cpu"],
            [deterministic_metrics(m) for m in history], phases)


def run_dagster(cfg_dict: dict, home: Path, experiment: str, executor: str = "in_process"
                ) -> tuple[float, float, list[dict], dict[str, list[float]]]:
    import dagster as dg

    from assets.launch import run_iterations, run_sft
    from resources import build_resources
    from tinker_pipelines.tracking import TinkerHome, registered_model_name

    resources = build_resources("local")
    tracker = resources["mlflow"].tracker()  # the deployment exists before timing
    instance = dg.DagsterInstance.from_config(str(TinkerHome(home).ensure().dagster_home))
    worker = None
    address = home / "worker.sock"  # one path for every repeat: the environment stays the step forkserver's
    if executor == "gpu":  # in the environment from the first run on, as a deployment's is (the sft run ignores it)
        os.environ["TINKER_WORKER"] = str(address)
    try:
        run_sft(instance, experiment, cfg_dict)
        if executor == "gpu":
            worker = _start_worker(resources["artifact_store"].store().local_dir(f"{experiment}/sft"), address)
        start, cpu = time.perf_counter(), time.process_time()
        ok = run_iterations(instance, experiment, cfg_dict)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        instance.dispose()
        if worker is not None:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=60)
            os.environ.pop("TINKER_WORKER", None)
    if not all(ok):
        raise SystemExit(f"dagster runs failed: {ok}")
    run_id = tracker.find_run(experiment)
    keys = tracker.client.get_run(run_id).data.metrics.keys()
    per_step: dict[int, dict] = {}
    for key in keys:
        if key.startswith(("time/", "sft/")):
            continue
        for step, value in tracker.history(run_id, key):
            per_step.setdefault(step, {})[key] = value
    assert tracker.latest_version(registered_model_name(experiment)) is not None
    phases = {key: [v for step, v in sorted(tracker.history(run_id, key)) if step >= 0] for key in PHASES}
    return wall, cpu, [per_step[k] for k in sorted(per_step)], phases


def _start_worker(sft_base: Path, address: Path):
    """A resident worker on the experiment's SFT base; step processes reach it via TINKER_WORKER."""
    from tinker_pipelines.worker.client import start_worker

    # batching off: one experiment has nothing to batch with, and its unbatched path is the
    # in-process engine's own (merged adapter weights), so the metrics can be compared exactly
    proc = start_worker(str(Path(sft_base).resolve()), address, device="cpu", dtype="float32",
                        extra=["--threads", os.environ["OMP_NUM_THREADS"], "--no-batching", "--max-rows", "4096"],
                        log=address.with_suffix(".log"))
    return proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1, help="alternate plain/dagster this many times; best of each")
    p.add_argument("--preset", choices=sorted(PRESETS), default="standard", help="iteration size")
    p.add_argument("--executor", choices=["in_process", "gpu"], default="in_process",
                   help="the Dagster side's executor (gpu: step processes with device leases and a worker)")
    args = p.parse_args(argv)
    os.environ["TINKER_EXECUTOR"] = args.executor  # read when the jobs are defined (first import below)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    load_start = os.getloadavg()[0]  # other processes' load skews sqlite and CPU waits: reported
    tmp = Path(tempfile.mkdtemp(prefix="tinker-overhead-"))
    os.environ["TINKER_HOME"] = str(tmp / "tinker")
    cfg = bench_config(args.iterations, args.preset)
    plain_times, dagster_times, plain_cpu, dagster_cpu, plain_m, dagster_m = [], [], [], [], None, None
    phases: dict[str, list[dict]] = {"plain": [], "dagster": []}
    for r in range(args.repeats):
        t, c, plain_m, ph = run_plain(cfg, tmp / f"plain{r}")
        plain_times.append(t)
        plain_cpu.append(c)
        phases["plain"].append(ph)
        t, c, dagster_m, ph = run_dagster(cfg, tmp / "tinker", f"overhead{r}", args.executor)
        phases["dagster"].append(ph)
        dagster_times.append(t)
        dagster_cpu.append(c)
        print(f"repeat {r}: plain {plain_times[-1]:.2f}s  dagster {dagster_times[-1]:.2f}s", file=sys.stderr)
    identical = plain_m == dagster_m
    plain, dag = min(plain_times), min(dagster_times)
    n = args.iterations
    t = cfg["training"]
    print(f"\n{n} GRPO iterations (LoRA), model {cfg['model']}, seed 0, after {cfg['sft']['steps']} SFT steps; "
          f"{t['groups_per_batch']}x{t['group_size']} episodes x {t['max_new_tokens']} tokens; "
          f"eval every {cfg['eval']['every']} on {cfg['eval']['num_tasks']} tasks; best of {args.repeats}")
    print(f"executor: {args.executor}" + (" (a step process per step, device leases, LoRA steps on a resident worker)"
                                         if args.executor == "gpu" else " (the steps of a run share this process)"))
    print(f"{'':28}{'plain train()':>16}{'dagster rl job':>16}")
    print(f"{'wall time (s)':28}{plain:>16.2f}{dag:>16.2f}")
    print(f"{'per iteration (s)':28}{plain / n:>16.3f}{dag / n:>16.3f}")
    print(f"{'overhead per iteration (s)':28}{'':>16}{(dag - plain) / n:>16.3f}")
    per_iteration = {side: phases[side][(plain_times if side == "plain" else dagster_times).index(t)]
                     for side, t in (("plain", plain), ("dagster", dag))}  # the best repeat's
    best = {side: {key: statistics.fmean(v) for key, v in per_iteration[side].items()} for side in per_iteration}
    for key in PHASES:
        print(f"{'  ' + key.split('/')[1] + ' (mean)':28}{best['plain'][key]:>16.3f}{best['dagster'][key]:>16.3f}")
    rest = {side: (total / n - sum(best[side].values())) for side, total in (("plain", plain), ("dagster", dag))}
    print(f"{'  the rest (mean)':28}{rest['plain']:>16.3f}{rest['dagster']:>16.3f}   "
          "(evaluation, checkpoints, tracking; on Dagster also its steps and artifacts)")
    for key in PHASES:
        for side in per_iteration:
            print(f"  {key.split('/')[1]} per iteration, {side}: "
                  + " ".join(f"{v:.2f}" for v in per_iteration[side][key]))
    pc, dc = min(plain_cpu), min(dagster_cpu)
    print(f"{'process CPU time (s)':28}{pc:>16.2f}{dc:>16.2f}" + ("   (this process only: not the steps or the worker)"
                                                                 if args.executor == "gpu" else ""))
    print(f"{'wall / CPU ratio':28}{plain / pc:>16.2f}{dag / dc:>16.2f}   (>1: waiting for the CPU or disk)")
    print(f"ratio dagster/plain: wall {dag / plain:.3f}, process CPU {dc / pc:.3f}")
    print(f"{'all repeats (s)':28}{' '.join(f'{t:.1f}' for t in plain_times):>16}"
          f"{' '.join(f'{t:.1f}' for t in dagster_times):>16}")
    print(f"per-iteration metrics identical: {identical} ({len(plain_m)} vs {len(dagster_m)} iterations, "
          f"{statistics.fmean(len(m) for m in plain_m):.0f} metrics each)")
    if not identical:
        for k, (a, b) in enumerate(zip(plain_m, dagster_m)):
            diff = {key: (a.get(key), b.get(key)) for key in set(a) | set(b) if a.get(key) != b.get(key)}
            if diff:
                print(f"  iteration {k}: {dict(list(diff.items())[:4])}")
                break
    print(json.dumps({"ratio": round(dag / plain, 4), "identical": identical, "iterations": n,
                      "phases_s": {side: {k.split("/")[1]: round(v, 3) for k, v in best[side].items()}
                                   for side in best},
                      "cpu_ratio": round(dc / pc, 4) if args.executor == "in_process" else None, "preset": args.preset, "executor": args.executor,
                      "load_avg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
