"""Steps that lease k > 1 devices run as `torchrun` with k ranks, one per leased device.

The GPU-aware handler (`executor`) marks a full-parameter step that leases several devices as
ranked. Its step process takes the lease as any step does (`step_entry`, `step_launch`) and then,
instead of running the Dagster step itself, runs `launch_ranks`: `torchrun --nproc_per_node k`
over `rank_entry`, and waits. So the lease is held by that one process for the whole torchrun and
dies with it, however it ends.

Each rank (`rank_entry`) takes its own leased device: on a real CUDA inventory its
`CUDA_VISIBLE_DEVICES` names that one GPU (and `LOCAL_RANK` becomes 0, the only device it sees);
on a simulated or CPU inventory it runs on the CPU (DeepSpeed's CPU accelerator, gloo) with the
device it stands for in `TINKER_RANK_DEVICE`. Rank 0 runs the Dagster step command, so the step's
events come from one process; the other ranks follow: the step's body calls `run(target,
payload)`, which hands the same call to every rank (a file in the ranks' directory), and each
rank runs it, collectives included (DeepSpeed, the split rollout). A step whose body never calls
`run` releases the followers when it ends.

A rank that fails writes one line (`rank R (device D) failed: Type: message`) that the launcher
prints and leaves in `FAILURE_FILE`, where the handler's health check reads it.

The library core does not import this module's callers; it imports nothing of dagster.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

RANK_DIR_ENV = "TINKER_RANK_DIR"
"""The ranks' shared directory: the task (`TASK_FILE`), the release mark, each rank's error line."""
RANK_VISIBLE_ENV = "TINKER_RANK_VISIBLE"
"""JSON list: rank r's `CUDA_VISIBLE_DEVICES` (real CUDA inventories); absent on a simulated one."""
RANK_DEVICE_ENV = "TINKER_RANK_DEVICE"
"""The leased device (inventory index) a rank runs for."""
TASK_FILE, RELEASED_FILE, FAILURE_FILE = "task.json", "released", "failure"
RANK_FAILED_EXIT = 4
"""The launcher's exit code when a rank failed (its reason is in `FAILURE_FILE`)."""
POLL_S = 0.05
FOLLOWER_ERROR_WAIT_S = 2.0
"""How long rank 0, whose call failed, looks for a follower's error line to report instead."""


def rank_dir_for(ledger_path: str, run_id: str, step_key: str) -> Path:
    """Where a ranked step's ranks meet: beside the ledger, one directory per run and step."""
    return Path(ledger_path).absolute().parent / "ranks" / run_id / step_key.replace("/", "_")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """A torchrun whose launcher is killed (SIGKILL too) must not outlive it: it holds no lease."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: terminate_step's process-group signal still reaches torchrun
        pass


def launch_ranks(environ: dict[str, str], command: list[str], rank_dir: Path, step: str) -> int:
    """Run `command` (the Dagster step) as rank 0 of `torchrun` with one rank per leased device
    (`environ` holds the step's lease variables; `RANK_VISIBLE_ENV` on a real CUDA inventory, else
    gloo ranks on the CPU). Returns 0, or `RANK_FAILED_EXIT` after printing the first failed
    rank's one-line reason."""
    devices = environ["TINKER_LEASE_DEVICES"].split(",")
    rank_dir.mkdir(parents=True, exist_ok=True)
    for stale in rank_dir.iterdir():  # a retry of the step reuses the directory
        stale.unlink()
    env = {k: v for k, v in environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env[RANK_DIR_ENV] = str(rank_dir)
    if RANK_VISIBLE_ENV not in env:  # a simulated (or CPU) inventory: DeepSpeed's CPU accelerator, gloo
        env["DS_ACCELERATOR"] = "cpu"
        env.pop("CUDA_VISIBLE_DEVICES", None)
    if command[:1] == ["dagster"]:
        command = [sys.executable, "-m", "dagster", *command[1:]]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(len(devices)),
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                "-m", "tinker_pipelines.scheduler.rank_entry", *command]
    code = subprocess.call(torchrun, env=env, preexec_fn=_die_with_parent)
    if code == 0:
        return 0
    reason = _first_failure(rank_dir) or f"torchrun exited with code {code}"
    (rank_dir / FAILURE_FILE).write_text(reason + "\n")
    print(f"error: step {step}: {reason}", file=sys.stderr, flush=True)
    return RANK_FAILED_EXIT


def _first_failure(rank_dir: Path) -> str | None:
    errors = sorted(rank_dir.glob("rank_*.error"), key=lambda p: p.stat().st_mtime)
    return errors[0].read_text().strip() if errors else None


def failure_reason(rank_dir: Path) -> str | None:
    """The one-line reason a ranked step's launcher left, if any."""
    try:
        return (rank_dir / FAILURE_FILE).read_text().strip() or None
    except OSError:
        return None


def write_rank_error(rank: int, error: BaseException, environ: Any = None) -> str:
    """Record rank `rank`'s failure as one line in the ranks' directory; returns the line."""
    environ = os.environ if environ is None else environ
    first = (str(error).strip().splitlines() or [""])[0]
    line = f"rank {rank} (device {environ.get(RANK_DEVICE_ENV, '?')}) failed: {type(error).__name__}: {first}"
    directory = environ.get(RANK_DIR_ENV)
    if directory:
        (Path(directory) / f"rank_{rank}.error").write_text(line + "\n")
    return line


def _resolve(target: str) -> Callable[[dict[str, Any]], Any]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


_IN_RUN: list[str] = []
"""The target `run` is calling in this process (a stack: empty outside `run`)."""


def check_in_ranked_body(what: str = "this step") -> None:
    """Refuse (ValueError, one line) to join a process group of several ranks outside `run`: the
    other ranks wait for `run`'s task, so a body that builds a multi-rank learner itself would
    hang its collective forever instead of failing."""
    if in_ranked_step() and not _IN_RUN:
        raise ValueError(f"training.devices: {what} runs on {os.environ['WORLD_SIZE']} ranks, but its body does not "
                         "call scheduler.ranks.run, so its other ranks never join (a ranked step's body is "
                         "e.g. tinker_pipelines.loops.ranked:full_iteration or :rl_stage, as the RL job's assets "
                         "call it)")


def in_ranked_step(environ: Any = None) -> bool:
    """Whether this process is a rank of a ranked step of several ranks (where `run` hands its call on)."""
    environ = os.environ if environ is None else environ
    return bool(environ.get(RANK_DIR_ENV)) and int(environ.get("WORLD_SIZE", "1")) > 1


def run(target: str, payload: dict[str, Any]) -> Any:
    """Call `target` ('module:function') with `payload` (JSON-able) on every rank of this ranked
    step, rank 0's result returned here; outside a ranked step (one device) simply in this
    process. Call it once per step: the followers run one task and end."""
    if in_ranked_step():
        directory = os.environ[RANK_DIR_ENV]
        if int(os.environ.get("RANK", "0")) != 0:
            raise RuntimeError("ranks.run is called by rank 0 (the Dagster step); the others follow it")
        tmp = Path(directory) / (TASK_FILE + ".tmp")
        tmp.write_text(json.dumps({"target": target, "payload": payload}))
        tmp.replace(Path(directory) / TASK_FILE)
        _IN_RUN.append(target)
        try:
            return _resolve(target)(payload)
        except Exception as e:
            # a follower's failure reaches rank 0 as a broken collective: name the rank that failed
            reason = _wait_for_failure(Path(directory), FOLLOWER_ERROR_WAIT_S)
            if reason is None:
                raise
            raise RuntimeError(reason) from e
        finally:
            _IN_RUN.pop()
    return _resolve(target)(payload)


def _wait_for_failure(rank_dir: Path, wait_s: float) -> str | None:
    deadline = time.monotonic() + wait_s
    while (reason := _first_failure(rank_dir)) is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return reason


def follow(rank_dir: Path) -> None:
    """A follower rank: wait for rank 0's task (or its release) and run it."""
    while True:
        task = rank_dir / TASK_FILE
        if task.exists():
            spec = json.loads(task.read_text())
            _IN_RUN.append(spec["target"])
            try:
                _resolve(spec["target"])(spec["payload"])
            finally:
                _IN_RUN.pop()
            return
        if (rank_dir / RELEASED_FILE).exists():
            return
        time.sleep(POLL_S)


def release(rank_dir: Path) -> None:
    """Rank 0's step ended: followers still waiting for a task end too."""
    (rank_dir / RELEASED_FILE).touch()
