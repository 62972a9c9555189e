"""How the GPU-aware step handler starts a step process: forked from a preloaded server, or fresh.

A fresh interpreter per step (`"process"`) spends ~10 s on this machine importing torch,
transformers, peft, dagster and mlflow before the step's first line: with a resident worker a
LoRA step is a thin client that takes well under a second, so the imports would be nearly all
of it. `"forkserver"` (the default) starts Python's `multiprocessing` forkserver once per run
process with those modules and the code location preloaded (`location_preload`); each step is
forked from it and pays only for the instance and the step itself. It is the same mechanism
Dagster's multiprocess executor offers (`start_method: forkserver`, `preload_modules`).

What keeps a forked step equivalent to a fresh one:
- The step takes the caller's environment, working directory and `PYTHONPATH` as they are at
  launch. The code location's modules read `TINKER_*` at import, so the preloaded ones are used
  only when the step's environment and directory are the server's; otherwise the step forgets
  them and imports the location afresh (`location_preload.refresh`).
- The server imports torch but never touches CUDA (`PYTORCH_NVML_BASED_CUDA_CHECK=1` in its
  environment keeps even an availability check from initialising the driver), and a step never
  detects devices (the executor passes its inventory down), so each step sets
  `CUDA_VISIBLE_DEVICES` for its lease before CUDA starts, exactly as a fresh process does;
  `step_entry.apply_lease` makes a step whose CUDA started earlier fail instead of running on
  the wrong GPU.
- The step leads its own session (`os.setsid`), so terminating it signals its process group,
  and it takes its lease as itself: the lease dies with it, however it exits.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import multiprocessing.context
import os
import subprocess
import sys
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util
from multiprocessing.context import set_spawning_popen
from typing import Any, Protocol

from tinker_pipelines.scheduler.location_preload import LOCATION_ENV
from tinker_pipelines.scheduler.step_entry import NEVER_FITS_EXIT, apply_lease, lease_environment

LAUNCHES = ("forkserver", "process")
"""Values of the executor's `step_launch` config."""
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "peft", "peft.tuners.lora",
           "mlflow", "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.model_registry.sqlalchemy_store",
           "sqlalchemy", "sqlalchemy.orm", "sqlalchemy.dialects.sqlite", "alembic", "alembic.command", "attr",
           "dagster", "dagster._cli.api", "dagster._core.execution.api", "dagster._core.execution.plan.active",
           "dagster._core.instance.factory", "dagster._core.storage.sqlite_storage",
           "dagster._core.storage.local_compute_log_manager", "dagster._core.executor.step_delegating",
           "dagster._core.definitions.repository_definition.repository_data_builder", "dagster._daemon",
           "tinker_pipelines.loops.train", "tinker_pipelines.tracking", "tinker_pipelines.worker.client",
           "tinker_pipelines.scheduler.migration_scripts", "tinker_pipelines.scheduler.preload_freeze")
"""Modules the forkserver imports once: third-party ones and the library core, which reads no
environment at import. The code location is imported too (`location_preload`). Then the storages'
alembic revision scripts are parsed (`migration_scripts`) and, last, everything the server holds is
frozen out of the steps' garbage collections (`preload_freeze`)."""


class StepProcess(Protocol):
    """What the handler needs of a launched step: its pid and, once it ended, its exit code."""

    pid: int | None

    def poll(self) -> int | None: ...


class _ForkedStep:
    """A step forked from the preloaded server (a `multiprocessing.Process` underneath)."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        code = self._process.exitcode
        return None if code is None else (code if code >= 0 else 128 - code)  # killed by signal N: 128+N

    @property
    def returncode(self) -> int | None:
        return self.poll()


def _ensure_forkserver(location: dict[str, str] | None) -> None:
    """Start the server unless it runs; the preloads take effect when it starts (first launch).
    A server started in another environment (a script that sets `TINKER_WORKER` after its first
    run) keeps serving: its steps import the location afresh (`location_preload.refresh`)."""
    ctx = multiprocessing.get_context("forkserver")
    # the location first: it records the environment before the other imports add to it
    ctx.set_forkserver_preload(["tinker_pipelines.scheduler.location_preload", *PRELOAD])
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # inherited by the server when it starts
    if location is not None:  # for the server alone: never left in this process's (and its children's) environment
        os.environ[LOCATION_ENV] = json.dumps(location)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(LOCATION_ENV, None)


def code_location(code_pointer: Any) -> dict[str, str] | None:
    """{module, working_directory} of a step's code location given as a module or package (a
    code location given as a file is not preloaded: the step imports it)."""
    module = getattr(code_pointer, "module", None)
    if not isinstance(module, str) or not module:
        return None
    return {"module": module, "working_directory": getattr(code_pointer, "working_directory", None) or ""}


class _StepPopen(popen_forkserver.Popen):
    """`multiprocessing`'s forkserver launch, less re-running the caller's `__main__` in the child.

    A forked child normally re-imports the parent's main script so that targets defined there
    unpickle; the step's target lives in this module, and a user's script that calls
    `execute_job` without an `if __name__ == "__main__"` guard must not run again in every step.
    The body is the standard library's `_launch` with those two keys dropped."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        prep_data.pop("init_main_from_path", None)
        prep_data.pop("init_main_from_name", None)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)  # the child's sentinel of this parent, as the standard library keeps it
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _StepProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _StepPopen:
        return _StepPopen(process_obj)


def launch(how: str, lease_args: tuple[str, str, str, str, str], command: list[str],
           location: dict[str, str] | None = None) -> StepProcess:
    """Start a step: take its lease (`step_entry`'s arguments: ledger path, inventory JSON, needs
    JSON, run id, step key), then run the `dagster api execute_step` `command`. `location`
    (`code_location`): the step's code location, for the forkserver to preload."""
    if how == "process":
        if command[:1] == ["dagster"]:  # Dagster's default entry point needs it on PATH: use this interpreter's
            command = [sys.executable, "-m", "dagster", *command[1:]]
        return subprocess.Popen([sys.executable, "-m", "tinker_pipelines.scheduler.step_entry", *lease_args, "--",
                                 *command], start_new_session=True)
    if how != "forkserver":
        raise ValueError(f"gpu_executor.step_launch must be one of {', '.join(LAUNCHES)}, got {how!r}")
    spec = json.loads(lease_args[2])
    if spec is not None and spec.get("ranked"):  # the forked step holds the lease while torchrun runs
        return fork_leased(lease_args, _run_ranked_step, (command, spec["rank_dir"], lease_args[4], lease_args[3]))
    return fork_leased(lease_args, _run_dagster_step, (command,), location)


def fork_leased(lease_args: tuple[str, str, str, str, str], target: Any, args: tuple = (),
                location: dict[str, str] | None = None) -> StepProcess:
    """Fork a process from the step server that takes its lease as a step does, then calls
    `target(*args)` (a module-level function): the executor's steps (`launch`), and checks of
    the leased device itself (`benchmarks.ready_device`)."""
    _ensure_forkserver(location)
    process = _StepProcess(target=_forked_step, args=(lease_args, target, args, dict(os.environ), os.getcwd(),
                                                      location), name=f"step {lease_args[4]}", daemon=False)
    process.start()
    return _ForkedStep(process)


def _forked_step(lease_args: tuple[str, str, str, str, str], target: Any, args: tuple, environ: dict[str, str],
                 cwd: str, location: dict[str, str] | None) -> None:
    os.setsid()
    from tinker_pipelines.scheduler import location_preload

    location_preload.refresh(environ, cwd, location)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    # as `python -m dagster ...` would start: the working directory first, then $PYTHONPATH
    # (Dagster drops sys.path[0] when it imports the code location)
    front = [cwd, *[p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    sys.path[:] = front + [p for p in sys.path if p not in front]
    try:
        apply_lease(lease_environment(*lease_args))
    except (ValueError, TimeoutError, RuntimeError) as e:
        print(f"error: step {lease_args[4]} of run {lease_args[3]}: {e}", file=sys.stderr, flush=True)
        sys.exit(NEVER_FITS_EXIT)
    target(*args)


def _run_ranked_step(command: list[str], rank_dir: str, step_key: str, run_id: str) -> None:
    from pathlib import Path

    from tinker_pipelines.scheduler.ranks import launch_ranks

    sys.exit(launch_ranks(dict(os.environ), command, Path(rank_dir), f"{step_key} of run {run_id}"))


def _run_dagster_step(command: list[str]) -> None:
    from dagster._cli.api import execute_step_command

    args = command[command.index("execute_step") + 1:]
    execute_step_command.main(args=args, prog_name="dagster api execute_step", standalone_mode=False)
