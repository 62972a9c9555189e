"""Dagster + MLflow overhead: the same RL iterations through the `rl` job vs the plain loop.

Dagster side: a real sqlite instance and the embedded MLflow store in a temporary folder, one
`execute_job` run per iteration in this process (the model stays resident), exactly as
`assets.launch.run_iterations` does. Plain side: `tinker_pipelines.train.train(cfg)`. Same
config and seed. The plain loop also evaluates the untrained policy once before iteration 0;
that evaluation's time is subtracted from its wall time, which makes the ratio stricter.
The MLflow database is created before timing (a deployment exists before anyone trains).

    python -m benchmarks.overhead [--iterations 10] [--repeats 2]

Last line: {"ratio": ..., "identical": ..., "iterations": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def bench_config(iterations: int) -> dict:
    return {"seed": 0, "model": {"name": "tiny"},
            "env": {"path": "arithmetic", "kwargs": {"max_operand": 9}},
            "algorithm": {"name": "grpo", "kl_coef": 0.02},
            "training": {"mode": "lora", "iterations": iterations, "learning_rate": 2e-3,
                         "groups_per_batch": 16, "group_size": 8, "max_new_tokens": 16},
            "eval": {"every": 5, "num_tasks": 32}}


def run_plain(cfg_dict: dict, out: Path) -> tuple[float, list[dict]]:
    from tinker_pipelines.config import config_from_dict
    from tinker_pipelines.train import deterministic_metrics, train

    cfg = config_from_dict({**cfg_dict, "output_dir": str(out)})
    start = time.perf_counter()
    history = train(cfg)
    wall = time.perf_counter() - start
    baseline = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return wall - baseline.get("time/eval_s", 0.0), [deterministic_metrics(m) for m in history]


def run_dagster(cfg_dict: dict, home: Path, experiment: str) -> tuple[float, list[dict]]:
    import dagster as dg

    from assets.launch import run_iterations
    from resources import build_resources
    from tinker_pipelines.tracking import TinkerHome, registered_model_name

    tracker = build_resources("local")["mlflow"].tracker()  # the deployment exists before timing
    instance = dg.DagsterInstance.from_config(str(TinkerHome(home).ensure().dagster_home))
    try:
        start = time.perf_counter()
        ok = run_iterations(instance, experiment, cfg_dict)
        wall = time.perf_counter() - start
    finally:
        instance.dispose()
    if not all(ok):
        raise SystemExit(f"dagster runs failed: {ok}")
    run_id = tracker.find_run(experiment)
    keys = tracker.client.get_run(run_id).data.metrics.keys()
    per_step: dict[int, dict] = {}
    for key in keys:
        if key.startswith("time/"):
            continue
        for step, value in tracker.history(run_id, key):
            per_step.setdefault(step, {})[key] = value
    assert tracker.latest_version(registered_model_name(experiment)) is not None
    return wall, [per_step[k] for k in sorted(per_step)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2, help="alternate plain/dagster this many times; best of each")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    tmp = Path(tempfile.mkdtemp(prefix="tinker-overhead-"))
    os.environ["TINKER_HOME"] = str(tmp / "tinker")
    cfg = bench_config(args.iterations)
    plain_times, dagster_times, plain_m, dagster_m = [], [], None, None
    for r in range(args.repeats):
        t, plain_m = run_plain(cfg, tmp / f"plain{r}")
        plain_times.append(t)
        t, dagster_m = run_dagster(cfg, tmp / "tinker", f"overhead{r}")
        dagster_times.append(t)
        print(f"repeat {r}: plain {plain_times[-1]:.2f}s  dagster {dagster_times[-1]:.2f}s", file=sys.stderr)
    identical = plain_m == dagster_m
    plain, dag = min(plain_times), min(dagster_times)
    n = args.iterations
    print(f"\n{n} iterations, tiny model, seed 0, {cfg['training']['groups_per_batch']}x"
          f"{cfg['training']['group_size']} episodes x {cfg['training']['max_new_tokens']} tokens, "
          f"eval every {cfg['eval']['every']} on {cfg['eval']['num_tasks']} tasks, best of {args.repeats}")
    print(f"{'':28}{'plain train()':>16}{'dagster rl job':>16}")
    print(f"{'wall time (s)':28}{plain:>16.2f}{dag:>16.2f}")
    print(f"{'per iteration (s)':28}{plain / n:>16.3f}{dag / n:>16.3f}")
    print(f"{'overhead per iteration (s)':28}{'':>16}{(dag - plain) / n:>16.3f}")
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
    print(json.dumps({"ratio": round(dag / plain, 4), "identical": identical, "iterations": n}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
