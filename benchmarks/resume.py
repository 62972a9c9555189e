"""`python -m benchmarks.resume`: kill -9 training at random moments, resume, and compare with an
uninterrupted run of the same config.

Each trial starts training in a child process, waits until it reaches a chosen moment (the n-th
rollout, optimizer update, checkpoint write, the instant after a checkpoint or after its registry
version is created, or between iterations/runs), sends SIGKILL to its process group after a random delay inside that moment,
and then resumes the way a user would: `train(cfg, resume=True)` for the plain loop, and for a
Dagster run `assets.launch.resume_iterations` (the dead run is marked failed and re-executed from
failure). The child reports the moments it enters over a pipe; nothing in the library changes for
the benchmark. Slow checkpoint writes (a short sleep after each file) give the kill a window
inside the write.

Figures (last line, JSON): `trials`, `identical` (final adapter, optimizer and RNG bit for bit,
and the same per-iteration metrics), `duplicate_metrics` (metric points logged twice, in
metrics.jsonl or MLflow, plus duplicate registry versions), `unloadable_checkpoints` (checkpoints
left on disk that fail verification or loading), `failed_runs_shown` (Dagster trials killed
inside a run whose failed run and its re-execution are both in the instance).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PLAIN_MOMENTS = ("rollout", "update", "checkpoint_write", "after_checkpoint", "between_iterations")
DAGSTER_MOMENTS = ("rollout", "update", "checkpoint_write", "after_checkpoint", "after_register", "between_runs")
WRITE_PAUSE_S = 0.04

PLAIN = {
    "seed": 5, "model": {"name": "tiny", "dtype": "float32"},  # measured in fp32, whatever `auto` is on this CPU
    "env": {"path": "arithmetic", "kwargs": {"max_operand": 3}},
    "algorithm": {"name": "grpo", "kl_coef": 0.05},
    "training": {"mode": "lora", "iterations": 4, "learning_rate": 5e-3, "groups_per_batch": 3, "group_size": 4,
                 "max_new_tokens": 4},
    "sft": {"steps": 10, "batch_size": 8, "examples": 32, "learning_rate": 3e-3},
    "eval": {"every": 2, "num_tasks": 4},
}
PPO = {**PLAIN, "algorithm": {"name": "ppo", "kl_coef": 0.0}, "sft": {"steps": 0}}
# PPO, whose value head trains on every episode: without a warm start the tiny model's GRPO groups
# are uniform and would never take an optimizer step (a kill-and-resume of nothing).
DAGSTER = {**PPO, "training": {**PPO["training"], "iterations": 3}}


# -- the child: training with probes that report moments ------------------------------------
def _install_probes(fd: int, dagster: bool) -> None:
    import torch

    import tinker_pipelines.training.learner_checkpoint as learner_checkpoint
    from tinker_pipelines.training.learner import Learner
    from tinker_pipelines.loops.experiment import Experiment

    def emit(moment: str) -> None:
        os.write(fd, f"{moment}\n".encode())

    def wrap(owner, name, before=None, after=None):
        orig = getattr(owner, name)

        def probe(*a, **k):
            if before:
                emit(before)
            out = orig(*a, **k)
            if after:
                emit(after)
            return out
        setattr(owner, name, probe)

    wrap(Experiment, "rollout", before="rollout")
    wrap(Learner, "forward_backward", before="update")
    wrap(Learner, "save_state", before="checkpoint_write")
    wrap(Experiment, "save", after="after_checkpoint")
    for owner, name in ((learner_checkpoint, "save_file"), (torch, "save")):  # a window inside the write
        orig = getattr(owner, name)

        def slow(*a, _orig=orig, **k):
            out = _orig(*a, **k)
            time.sleep(WRITE_PAUSE_S)
            return out
        setattr(owner, name, slow)
    if dagster:  # between runs: assets.launch calls dg.execute_job once per iteration
        import dagster as dg

        from tinker_pipelines.tracking import Tracker

        wrap(Tracker, "register_adapter", after="after_register")  # a version exists, its materialization not yet

        orig_exec = dg.execute_job

        def execute_job(*a, **k):
            emit("between_runs")
            return orig_exec(*a, **k)
        dg.execute_job = execute_job


def child(kind: str, cfg: dict[str, Any], out: str, resume: bool, fd: int) -> int:
    import torch

    torch.set_num_threads(1)
    if kind == "dagster":
        os.environ["TINKER_HOME"] = out
        from tinker_pipelines.tracking.home import TinkerHome

        os.environ["DAGSTER_HOME"] = str(TinkerHome(Path(out)).ensure(devices=1).dagster_home)
    _install_probes(fd, dagster=kind == "dagster")
    if kind == "plain":
        from tinker_pipelines.config import config_from_dict
        from tinker_pipelines.loops.train import train

        train(config_from_dict({**cfg, "output_dir": out}), resume=resume,
              on_iteration=lambda m: os.write(fd, b"between_iterations\n") if m["iteration"] >= 0 else None)
        return 0
    import dagster as dg

    from assets.launch import resume_iterations, run_iterations

    with dg.DagsterInstance.get() as instance:
        ok = (resume_iterations if resume else run_iterations)(instance, "resume", cfg)
    return 0 if all(ok) else 1


# -- the parent: kill, resume, compare ---------------------------------------------------------
def _spawn(kind: str, cfg: dict, out: Path, resume: bool) -> tuple[subprocess.Popen, int]:
    r, w = os.pipe()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path.cwd())}
    cmd = [sys.executable, "-m", "benchmarks.resume", "--child", kind, json.dumps(cfg), str(out), str(w)]
    if resume:
        cmd.append("--resume-child")
    proc = subprocess.Popen(cmd, pass_fds=(w,), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=open(out.parent / f"{out.name}.log", "ab"))
    os.close(w)
    return proc, r


def _watch(proc: subprocess.Popen, r: int, target: tuple[str, int] | None = None,
           delay_s: float = 0.0) -> tuple[list[tuple[str, float]], bool]:
    """Read moments until the child exits, or until `target` (moment, occurrence) then kill -9
    after `delay_s`; returns the moments seen with their times and whether the kill landed."""
    seen: list[tuple[str, float]] = []
    counts: dict[str, int] = {}
    buf = b""
    while True:
        ready, _, _ = select.select([r], [], [], 0.5)
        if ready:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                m = line.decode()
                seen.append((m, time.monotonic()))
                counts[m] = counts.get(m, 0) + 1
                if target and m == target[0] and counts[m] == target[1] + 1:
                    time.sleep(delay_s)
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    os.close(r)
                    return seen, proc.returncode == -signal.SIGKILL
        elif proc.poll() is not None:
            break
    proc.wait()
    os.close(r)
    return seen, False


def _run(kind: str, cfg: dict, out: Path, resume: bool = False) -> list[tuple[str, float]]:
    proc, r = _spawn(kind, cfg, out, resume)
    seen, _ = _watch(proc, r)
    if proc.returncode != 0:
        log = (out.parent / f"{out.name}.log").read_text()[-3000:]
        raise RuntimeError(f"{kind} child in {out} exited {proc.returncode}:\n{log}")
    return seen


def _gaps(seen: list[tuple[str, float]]) -> dict[str, list[float]]:
    """Per moment, how long each occurrence lasted until the next reported moment."""
    out: dict[str, list[float]] = {}
    for (m, t), (_, t2) in zip(seen, seen[1:] + [(None, seen[-1][1])]):
        out.setdefault(m, []).append(t2 - t)
    return out


def _tensors_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def same_state(a: Path, b: Path) -> bool:
    """Adapter, value head, optimizer and RNG of two checkpoints equal bit for bit."""
    import torch

    from tinker_pipelines.checkpoint import read_record

    ra, rb = read_record(a), read_record(b)
    if ra["content_hash"] != rb["content_hash"] or ra["learner_steps"] != rb["learner_steps"]:
        return False
    return all(_tensors_equal(torch.load(a / f, weights_only=True), torch.load(b / f, weights_only=True))
               for f in ("optimizer.pt", "rng.pt"))


def unloadable(ckpt_dirs: list[Path]) -> int:
    """Checkpoints that fail verification or whose files do not load."""
    import torch
    from safetensors.torch import load_file

    from tinker_pipelines.checkpoint import CheckpointError, read_record

    bad = 0
    for d in ckpt_dirs:
        try:
            read_record(d, verify=True)
            for f in d.glob("*.safetensors"):
                load_file(str(f))
            for f in d.glob("*.pt"):
                torch.load(f, weights_only=True)
        except (CheckpointError, OSError, RuntimeError, ValueError):
            bad += 1
    return bad


def _metrics_lines(out: Path) -> list[dict]:
    from tinker_pipelines.loops.train import deterministic_metrics

    return [deterministic_metrics(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]


def plain_result(out: Path, ref: Path, iterations: int) -> dict[str, Any]:
    last = f"checkpoints/iter_{iterations - 1:05d}"
    lines, ref_lines = _metrics_lines(out), _metrics_lines(ref)
    its = [m["iteration"] for m in lines]
    return {"identical": same_state(out / last, ref / last) and lines == ref_lines,
            "duplicate_metrics": len(its) - len(set(its)),
            "unloadable_checkpoints": unloadable(sorted((out / "checkpoints").glob("iter_*")))}


def dagster_result(home: Path, ref_home: Path, iterations: int, killed_in_run: bool) -> dict[str, Any]:
    import dagster as dg

    from tinker_pipelines.tracking import Tracker, registered_model_name
    from tinker_pipelines.tracking.home import TinkerHome

    def final(h: Path) -> tuple[Path, Tracker, dg.DagsterInstance]:
        th = TinkerHome(h)
        instance = dg.DagsterInstance.from_config(str(th.dagster_home))
        filt = dg.AssetRecordsFilter(asset_key=dg.AssetKey("adapter_checkpoint"),
                                     asset_partitions=[f"resume:{iterations - 1}"])
        rec = instance.fetch_materializations(filt, limit=1).records[0]
        path = Path(rec.asset_materialization.metadata["path"].value)
        return path, Tracker(th.mlflow_uri, "tinker", str(th.mlflow_artifacts)), instance

    path, tracker, instance = final(home)
    ref_path, ref_tracker, _ = final(ref_home)
    run_id, ref_run_id = tracker.find_run("resume"), ref_tracker.find_run("resume")
    dup, same_metrics = 0, True
    for key in ref_tracker.client.get_run(ref_run_id).data.metrics:
        if key.startswith("time/") or key.endswith("wall_s"):
            continue
        hist = tracker.client.get_metric_history(run_id, key)
        dup += len(hist) - len({m.step for m in hist})
        ref_hist = {m.step: m.value for m in ref_tracker.client.get_metric_history(ref_run_id, key)}
        same_metrics &= {m.step: m.value for m in hist} == ref_hist
    versions = tracker.client.search_model_versions(f"name = '{registered_model_name('resume')}'")
    dup += len(versions) - len({v.tags.get("partition") for v in versions})
    runs = instance.get_runs(dg.RunsFilter(job_name="rl"))
    failed = [r for r in runs if r.status == dg.DagsterRunStatus.FAILURE]
    shown = any(r.parent_run_id in {f.run_id for f in failed} and r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
    mlflow_runs = tracker.client.search_runs([tracker.experiment_id], "tags.`tinker.experiment` = 'resume'")
    return {"identical": same_state(path, ref_path) and same_metrics and len(mlflow_runs) == 1,
            "duplicate_metrics": dup, "unloadable_checkpoints": unloadable([path]),
            "failed_run_shown": (not killed_in_run) or (bool(failed) and shown)}


def trial(kind: str, cfg: dict, ref: dict, work: Path, i: int, rng: random.Random) -> dict[str, Any]:
    moments = PLAIN_MOMENTS if kind == "plain" else DAGSTER_MOMENTS
    moment = moments[i % len(moments)]
    if moment not in ref["gaps"]:
        raise RuntimeError(f"the uninterrupted {kind} run never reached moment {moment!r}: {sorted(ref['gaps'])}")
    gaps = ref["gaps"][moment]
    # between iterations/runs: not after the last one, where nothing is left to resume
    n = {"between_runs": lambda: rng.randrange(1, len(gaps)),
         "between_iterations": lambda: rng.randrange(len(gaps) - 1)}.get(moment, lambda: rng.randrange(len(gaps)))()
    delay = 0.0 if moment in ("after_checkpoint", "after_register", "between_iterations", "between_runs") else rng.uniform(0, 0.9 * gaps[n])
    out = work / f"{kind}-{i}"
    proc, r = _spawn(kind, cfg, out, resume=False)
    _, killed = _watch(proc, r, (moment, n), delay)
    _run(kind, cfg, out, resume=True)
    iterations = cfg["training"]["iterations"]
    res = (plain_result(out, ref["out"], iterations) if kind == "plain" else
           dagster_result(out, ref["out"], iterations, killed and moment != "between_runs"))
    return {"kind": kind, "algorithm": cfg["algorithm"]["name"], "moment": moment, "occurrence": n,
            "delay_s": round(delay, 3), "killed": killed, **res}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.resume", description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20, help="kills in all, split between the plain loop and Dagster")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments and delays")
    p.add_argument("--child", nargs=4, metavar=("KIND", "CONFIG", "OUT", "FD"), help=argparse.SUPPRESS)
    p.add_argument("--resume-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, cfg, out, fd = args.child
        return child(kind, json.loads(cfg), out, args.resume_child, int(fd))
    rng = random.Random(args.seed)
    plan = [("plain", PLAIN if i % 4 < 2 else PPO) if i % 2 == 0 else ("dagster", DAGSTER) for i in range(args.trials)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tinker-resume-") as tmp:
        work = Path(tmp)
        refs: dict[tuple[str, str], dict] = {}
        for kind, cfg in {(k, json.dumps(c, sort_keys=True)): (k, c) for k, c in plan}.values():
            out = work / f"ref-{kind}-{cfg['algorithm']['name']}"
            refs[(kind, cfg["algorithm"]["name"])] = {"out": out, "gaps": _gaps(_run(kind, cfg, out))}
        for i, (kind, cfg) in enumerate(plan):
            rows.append(trial(kind, cfg, refs[(kind, cfg["algorithm"]["name"])], work, i // 2, rng))
            r = rows[-1]
            print(f"{i:3d} {r['kind']:8s} {r['algorithm']:5s} {r['moment']:19s} #{r['occurrence']} "
                  f"+{r['delay_s']:.3f}s killed={r['killed']!s:5s} identical={r['identical']!s:5s} "
                  f"dup={r['duplicate_metrics']} unloadable={r['unloadable_checkpoints']}", flush=True)
    summary = {"trials": len(rows), "killed": sum(r["killed"] for r in rows),
               "identical": sum(r["identical"] for r in rows),
               "duplicate_metrics": sum(r["duplicate_metrics"] for r in rows),
               "unloadable_checkpoints": sum(r["unloadable_checkpoints"] for r in rows),
               "failed_runs_shown": sum(r.get("failed_run_shown", True) for r in rows if r["kind"] == "dagster"),
               "dagster_trials": sum(r["kind"] == "dagster" for r in rows),
               "moments": sorted({r["moment"] for r in rows})}
    print(json.dumps(summary, sort_keys=True))
    return 0 if summary["identical"] == summary["trials"] == summary["killed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
