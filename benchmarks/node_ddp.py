"""Split rollouts of a 2-rank full-parameter step: does each rank sample its share, and is the
gathered batch the 1-rank batch? Measured through the executor's launch path, without Dagster.

`measure()` runs one full-parameter iteration (tiny model, DeepSpeed ZeRO-2 on CPU, gloo) twice
with the same seed:
- on 1 rank: one plain process (`ranks.run` calls the iteration in-process);
- on 2 ranks: `step_entry` (what the GPU-aware executor runs for a step with `step_launch:
  process`) leases 2 devices of a simulated inventory from a real ledger and launches `torchrun`
  with one gloo rank per leased device (`ranks.launch_ranks`); rank 0 stands in for the Dagster
  step and calls `ranks.run`, the other rank follows.

Figures: `ddp_rollouts_split_equal` (goal true): every group's sampled token ids and logprobs are
exactly the 1-rank ones; `rows_per_rank` (episodes each rank sampled: half the batch each),
`total_rows`, `ranks_devices` (the simulated device each rank ran for: distinct, the lease's),
`lease_released` (the ledger holds nothing afterwards), `metrics_max_rel_diff` (the training
step's metrics against the 1-rank step's: DeepSpeed sums the ranks' shards in another order, so
within ~1e-5, not bit for bit), wall times. Last line: JSON.

`--inventory detect` (`measure(inventory="detect")`, what `scripts/gpu_check`'s node part runs)
leases the machine's own GPUs instead, one NCCL rank per GPU (`--world` is their number), and
the 1-rank step runs on the first GPU alone. There a rank decodes a smaller batch than the
1-rank step, and CUDA kernels may sum in another order per batch size: `tokens_equal` and
`logprobs_max_abs_diff` say how far the gathered batch is from the 1-rank one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "seed": 5, "model": {"name": "tiny", "dtype": "float32"},
    "env": {"path": "arithmetic", "kwargs": {"max_operand": 3, "partial_credit": 0.5}},
    "algorithm": {"name": "grpo"},
    "training": {"mode": "full", "iterations": 1, "learning_rate": 1e-3, "groups_per_batch": 4, "group_size": 4,
                 "max_new_tokens": 6, "micro_batch_size": 8, "deepspeed": {"stage": 2}},
    "sft": {"steps": 10, "batch_size": 16, "examples": 64, "learning_rate": 3e-3}, "eval": {"every": 1, "num_tasks": 4},
}
TIMEOUT_S = 600


def _env(cuda: bool = False, visible: str | None = None) -> dict[str, str]:
    """The runs' environment: DeepSpeed's CPU accelerator, or CUDA (on the GPU `visible` names;
    None: every GPU, and `step_entry` gives each rank its leased one)."""
    here = str(Path(__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p))
    if not cuda:
        env["DS_ACCELERATOR"] = "cpu"
    elif visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def _rank0(out: str, payload: str) -> None:
    """The step body of the 2-rank run (rank 0) and the whole 1-rank run."""
    from tinker_pipelines.scheduler import ranks

    result = ranks.run("tinker_pipelines.loops.ranked:full_iteration", json.loads(payload))
    Path(out).write_text(json.dumps(result))


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited with {proc.returncode}: {proc.stderr.strip().splitlines()[-3:]}")


def _differences(one: list, split: list) -> dict[str, Any]:
    """Whether the sampled token ids agree, and the largest logprob difference where they do."""
    flat = [(a, b) for g1, g2 in zip(one, split) for t1, t2 in zip(g1, g2) for a, b in zip(t1, t2)]
    tokens = len(one) == len(split) and all(a[0] == b[0] for a, b in flat)
    diff = max((abs(x - y) for a, b in flat if a[0] == b[0] for x, y in zip(a[1], b[1])), default=0.0)
    return {"tokens_equal": tokens, "logprobs_max_abs_diff": diff}


def measure(config: dict[str, Any] | None = None, world: int = 2, inventory: str = "sim") -> dict[str, Any]:
    """The figures above for `config` (default `CONFIG`) on `world` simulated devices (`inventory`
    "sim"), or on every GPU of the machine ("detect": `world` is their number)."""
    from tinker_pipelines.scheduler.inventory import Inventory
    from tinker_pipelines.scheduler.ledger import Ledger

    if inventory not in ("sim", "detect"):
        raise ValueError(f"inventory must be 'sim' or 'detect', got {inventory!r}")
    inv = Inventory.detect() if inventory == "detect" else Inventory.from_config({"count": world, "memory_gb": 80})
    world = len(inv)
    if world < 2:
        raise ValueError(f"a split step needs at least 2 devices; the inventory has {world}")
    cuda = inv[0].kind == "cuda"
    config = {**(config or CONFIG)}
    config["training"] = {**config["training"], "devices": world}
    payload = json.dumps({"config": config, "iteration": 0})
    me = [sys.executable, "-m", "benchmarks.node_ddp", "--rank0"]
    with tempfile.TemporaryDirectory(prefix="node_ddp-") as tmp:
        start = time.perf_counter()
        proc = subprocess.run([*me, f"{tmp}/one.json", payload], env=_env(cuda, inv[0].visible), capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        _check(proc, "the 1-rank step")
        one_s = time.perf_counter() - start
        ledger = f"{tmp}/ledger.sqlite"
        needs = {"devices": world, "memory_gb": 0.0, "sharing": "exclusive", "timeout_s": 60, "poll_s": 0.1,
                 "ranked": True, "rank_dir": f"{tmp}/ranks"}
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tinker_pipelines.scheduler.step_entry", ledger,
                               json.dumps(inv.to_config()), json.dumps(needs), "node_ddp", "step", "--",
                               *me, f"{tmp}/split.json", payload], env=_env(cuda),
                              capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        _check(proc, f"the {world}-rank step")
        split_s = time.perf_counter() - start
        one, split = (json.loads(Path(f"{tmp}/{n}.json").read_text()) for n in ("one", "split"))
        Ledger(ledger).expire_dead()  # the step process is gone: its lease goes with it
        released = not Ledger(ledger).leases()
    rows = [s["rows"] for s in split["shares"]]
    return {"ddp_rollouts_split_equal": split["groups"] == one["groups"] and sum(rows) == sum(
                len(g) for g in one["groups"]) and len(rows) == world,
            "rows_per_rank": rows, "total_rows": sum(len(g) for g in one["groups"]),
            "one_rank_rows": [s["rows"] for s in one["shares"]],
            "ranks_devices": [s["device"] for s in split["shares"]], "lease_released": released,
            "metrics_max_rel_diff": max(abs(split["metrics"][k] - v) / (1 + abs(v)) for k, v in one["metrics"].items()), **_differences(one["groups"], split["groups"]),
            "one_rank_s": round(one_s, 1), "split_s": round(split_s, 1), "world": world, "device_kind": inv[0].kind}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--world", type=int, default=2, help="simulated devices (ranks) of the split step")
    ap.add_argument("--inventory", choices=("sim", "detect"), default="sim",
                    help="simulated devices (default), or every GPU of the machine (--world ignored)")
    ap.add_argument("--rank0", nargs=2, metavar=("OUT", "PAYLOAD"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank0:
        _rank0(*args.rank0)
        return {}
    if args.world < 2:
        ap.error("--world must be at least 2")
    result = measure(world=args.world, inventory=args.inventory)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
