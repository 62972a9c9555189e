"""`gpu_executor`: Dagster's step-delegating executor with a step handler that places steps on devices.

Each step declares its needs in op tags (`tinker/devices`, `tinker/memory_gb`, `tinker/sharing`:
see `placement.needs_from_tags`); a step without them needs no device. The handler launches every
step as its own process (forked from a preloaded server by default: `step_launch`), which takes
a lease from the ledger shared by all runs on this instance (a sqlite file beside it), so two
runs never hold a device together beyond its capacity; the lease dies with the step process. Dagster's `StepDelegatingExecutor` brings
the rest: retries (op retry policies, `retries` config), step health checks, termination and
resuming a failed run. A request that can never fit fails its step at once.

A run whose config trains every parameter (`training.mode: full`, or the `sft` job) asks for its
devices `exclusive` even where the asset says `lora`: a full-parameter step never shares a device.
A LoRA step tagged `tinker/memory_gb: auto` (the assets' `LORA_STEP_TAGS`) reserves what its
run's model and batch need (`plan_step`, `scheduler.estimate`), and names its base so that
placement can spread bases over idle devices; a step whose estimate exceeds every device fails
at once, saying the estimate's parts.
Its `training.devices: k` raises the step's `tinker/devices` to k, and a full-parameter step on
k > 1 devices is launched as `torchrun` with one rank per leased device (`ranks`): the step
process holds the lease while its ranks run, and a failed rank fails the step with its one line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import dagster as dg
from dagster._core.events import DagsterEvent
from dagster._core.execution.retries import RetryMode, get_retries_config
from dagster._core.executor.step_delegating import (CheckStepHealthResult, StepDelegatingExecutor, StepHandler,
                                                    StepHandlerContext)

from tinker_pipelines.scheduler.ledger import LEDGER_FILE  # noqa: F401 (re-exported: the executor's default)
from tinker_pipelines.scheduler.inventory import Inventory, InventoryError
from tinker_pipelines.config import Config, config_from_dict
from tinker_pipelines.models import model_config
from tinker_pipelines.scheduler.estimate import PROMPT_TOKENS, Batch, MemoryEstimate, ModelShape, estimate_memory
from tinker_pipelines.scheduler.placement import (AUTO, TAG_PREFIX, StepNeeds, cap_to_device, check_fits,
                                                  needs_from_tags)
from tinker_pipelines.scheduler.ranks import RANK_FAILED_EXIT, failure_reason, rank_dir_for
from tinker_pipelines.scheduler.step_entry import NEVER_FITS_EXIT
from tinker_pipelines.scheduler.step_launch import LAUNCHES, StepProcess, code_location, launch

POLL_INTERVAL_S = 0.02
"""Default tick of the executor's loop: each tick reads the run's new events (one sqlite query,
~1 ms); at Dagster's default of 1 s, or 0.1 s, waiting for a tick was a visible part of a
few-second RL iteration's three step hand-offs."""


def step_needs(tags: dict[str, str], run_config: dict[str, Any], step_key: str | None = None) -> StepNeeds | None:
    """The step's needs from its op tags, made exclusive when the run trains every parameter, on
    as many devices as the run config's `training.devices` asks (when more than the tags)."""
    return plan_step(tags, run_config, step_key)[0]


def plan_step(tags: dict[str, str], run_config: dict[str, Any],
              step_key: str | None = None) -> tuple[StepNeeds | None, MemoryEstimate | None]:
    """The step's needs and, for `tinker/memory_gb: auto`, the estimate they reserve: from the
    model and training sections of the step's op config (or the run's first that has them).
    Without such a section `auto` is `placement.AUTO_FALLBACK_GB`; a malformed one raises
    `ConfigError` naming the field, before any model loads."""
    full = _trains_all_parameters(run_config)
    estimate, base = None, ""
    if str(tags.get(TAG_PREFIX + "memory_gb", "")).strip().lower() == AUTO and not full:
        section = _experiment_section(run_config, step_key)
        if section is not None:
            cfg = config_from_dict(section)
            estimate, base = config_estimate(cfg), _base_key(cfg)
    needs = needs_from_tags(tags, auto_memory_gb=None if estimate is None else round(estimate.total_gb, 3))
    if needs is not None and full:
        return StepNeeds(max(needs.devices, _training_devices(run_config)), needs.memory_gb, "exclusive"), None
    if needs is not None and estimate is not None and needs.sharing == "lora":
        resident = config_estimate(cfg, base_resident=True).total_gb
        needs = replace(needs, base=base, resident_gb=min(needs.memory_gb, round(resident, 3)))
    return needs, estimate


def config_estimate(cfg: Config, base_resident: bool = False) -> MemoryEstimate:
    """What one LoRA step of experiment `cfg` needs on its device (`estimate.estimate_memory`)."""
    t = cfg.training
    batch = Batch(t.groups_per_batch * t.group_size, PROMPT_TOKENS, t.max_new_tokens * t.max_turns,
                  t.micro_batch_size, t.gradient_checkpointing)
    shape = ModelShape.from_config(model_config(cfg.model.name, cfg.model.kwargs))
    return estimate_memory(shape, cfg.model.dtype, batch, t.lora_rank, base_resident=base_resident)


def _base_key(cfg: Config) -> str:
    """The step's base as workers' leases name theirs (`workers.placement_base`)."""
    from tinker_pipelines.scheduler.workers import placement_base

    m = cfg.model
    return placement_base(m.name, m.kwargs, cfg.seed if m.seed is None else m.seed)


def _experiment_section(run_config: Any, step_key: str | None) -> dict[str, Any] | None:
    """The `model` and `training` sections of the step's op config, else of the first op config
    that has a `model` mapping or a `training` mapping (an inference op names a registered
    version instead: no estimate)."""
    ops = run_config.get("ops") if isinstance(run_config, dict) else None
    if not isinstance(ops, dict):
        return None
    configs = [ops.get(step_key)] if step_key in ops else []
    configs += list(ops.values())
    for op in configs:
        c = op.get("config") if isinstance(op, dict) else None
        if isinstance(c, dict) and (isinstance(c.get("model"), dict) or isinstance(c.get("training"), dict)):
            return {k: c[k] for k in ("seed", "model", "training", "algorithm") if k in c and c[k] is not None}
    return None


def is_ranked(needs: StepNeeds | None, run_config: dict[str, Any]) -> bool:
    """A full-parameter step on several devices runs as `torchrun`, one rank per device (`ranks`)."""
    return needs is not None and needs.devices > 1 and _trains_all_parameters(run_config)


def _training_devices(config: Any) -> int:
    """The largest `training.devices` of the run config (1 when none is set)."""
    if not isinstance(config, dict):
        return 1
    training = config.get("training")
    own = training.get("devices", 1) if isinstance(training, dict) else 1
    if isinstance(own, bool) or not isinstance(own, int) or own < 1:
        raise ValueError(f"training.devices must be a positive integer, got {own!r}")
    return max([own, *(_training_devices(v) for v in config.values())])


def _trains_all_parameters(config: Any) -> bool:
    """Whether any `training` section of the run config has `mode: full`."""
    if isinstance(config, dict):
        training = config.get("training")
        if isinstance(training, dict) and training.get("mode") == "full":
            return True
        return any(_trains_all_parameters(v) for v in config.values())
    return False


class DeviceStepHandler(StepHandler):
    """Launches each step as a process that first takes its devices from the ledger."""

    def __init__(self, inventory_config: dict[str, Any] | None, ledger_path: str, timeout_s: float | None,
                 poll_s: float = 0.2, step_launch: str = "forkserver"):
        self.inventory_config, self.ledger_path = inventory_config, ledger_path
        self.inventory = Inventory.detect() if inventory_config is None else Inventory.from_config(inventory_config)
        self.timeout_s, self.poll_s, self.step_launch = timeout_s, poll_s, step_launch
        self._procs: dict[tuple[str, str], StepProcess] = {}

    @property
    def name(self) -> str:
        return "DeviceStepHandler"

    def _key(self, ctx: StepHandlerContext) -> tuple[str, str]:
        (step_key,) = ctx.execute_step_args.step_keys_to_execute
        return ctx.execute_step_args.run_id, step_key

    def launch_step(self, ctx: StepHandlerContext) -> Iterator[DagsterEvent]:
        run_id, step_key = self._key(ctx)
        run_config = ctx.dagster_run.run_config or {}
        needs, estimate = plan_step(dict(ctx.step_tags[step_key]), run_config, step_key)
        if needs is not None:
            needs, note = cap_to_device(needs, self.inventory, estimate)
            if note:
                ctx.instance.report_engine_event(f"step {step_key} {note}", ctx.dagster_run, step_key=step_key)
                print(f"warning: step {step_key} {note}", file=sys.stderr, flush=True)
            try:  # never waits forever: a step that cannot fit fails now, before any model loads
                check_fits(needs, self.inventory, estimate)
            except ValueError as e:
                asked = " (training.devices)" if needs.devices == _training_devices(run_config) > 1 else ""
                raise ValueError(f"step {step_key}{asked}: {e}") from None
        spec = None if needs is None else {"devices": needs.devices, "memory_gb": needs.memory_gb,
                                           "sharing": needs.sharing, "base": needs.base,
                                           "resident_gb": needs.resident_gb, "timeout_s": self.timeout_s,
                                           "poll_s": self.poll_s}
        if is_ranked(needs, run_config):
            spec.update(ranked=True, rank_dir=str(rank_dir_for(self.ledger_path, run_id, step_key)))
        # the inventory as detected here: a step that detected its own would start CUDA before its lease
        lease_args = (self.ledger_path, json.dumps(self.inventory.to_config()), json.dumps(spec), run_id, step_key)
        args = ctx.execute_step_args
        self._procs[(run_id, step_key)] = launch(self.step_launch, lease_args, list(args.get_command_args()),
                                                 code_location(args.job_origin.repository_origin.code_pointer))
        yield DagsterEvent.step_worker_starting(
            ctx.get_step_context(step_key), f"Launching step {step_key} needing {needs or 'no device'}",
            metadata={"needs": dg.MetadataValue.text(str(needs or "none"))})

    def check_step_health(self, ctx: StepHandlerContext) -> CheckStepHealthResult:
        proc = self._procs.get(self._key(ctx))
        if proc is None or proc.poll() is None or proc.returncode == 0:
            return CheckStepHealthResult.healthy()
        if proc.returncode == NEVER_FITS_EXIT:
            return CheckStepHealthResult.unhealthy("its devices could not be granted (see the step's stderr)")
        if proc.returncode == RANK_FAILED_EXIT:
            run_id, step_key = self._key(ctx)
            reason = failure_reason(rank_dir_for(self.ledger_path, run_id, step_key)) or "see the step's stderr"
            return CheckStepHealthResult.unhealthy(f"a rank of its torchrun failed: {reason}")
        return CheckStepHealthResult.unhealthy(f"the step process exited with code {proc.returncode}")

    def terminate_step(self, ctx: StepHandlerContext) -> Iterator[DagsterEvent]:
        proc = self._procs.get(self._key(ctx))
        if proc is not None and proc.poll() is None and proc.pid is not None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:  # it ended meanwhile
                pass
        yield from ()


@dg.executor(
    name="gpu_executor",
    config_schema={
        "inventory": dg.Field(dg.Permissive(), is_required=False,
                              description="A simulated inventory ({count, memory_gb} or {devices: [...]}); "
                                          "absent: the real CUDA devices (or the CPU as one device)."),
        "ledger_path": dg.Field(str, is_required=False,
                                description="The device ledger shared by all runs (default: beside the instance)."),
        "acquire_timeout_s": dg.Field(float, is_required=False,
                                      description="Fail a step that waited this long for devices (default: wait)."),
        "max_concurrent": dg.Field(int, is_required=False, description="Most step processes of one run at once."),
        "step_launch": dg.Field(str, default_value="forkserver",
                                description="How step processes start: 'forkserver' (forked from a server with "
                                            "torch, transformers, peft, dagster and mlflow preloaded) or 'process' "
                                            "(a fresh interpreter per step)."),
        "poll_interval_s": dg.Field(float, default_value=POLL_INTERVAL_S,
                                    description="How often the run process looks for its steps' events (a "
                                                "finished step's successor starts within this)."),
        "retries": get_retries_config(),
    },
    requirements=dg.multiple_process_executor_requirements(),
)
def gpu_executor(init_context: dg.InitExecutorContext) -> StepDelegatingExecutor:
    cfg = init_context.executor_config
    try:
        inventory = cfg.get("inventory")
        if inventory is not None:
            Inventory.from_config(inventory, field="gpu_executor.inventory")
    except ValueError as e:
        raise dg.DagsterInvalidConfigError(str(e), [], inventory) from None
    if not cfg["poll_interval_s"] > 0:
        raise dg.DagsterInvalidConfigError(f"gpu_executor.poll_interval_s must be > 0, got {cfg['poll_interval_s']!r}",
                                           [], cfg["poll_interval_s"])
    if cfg["step_launch"] not in LAUNCHES:
        raise dg.DagsterInvalidConfigError(f"gpu_executor.step_launch must be one of {', '.join(LAUNCHES)}, "
                                           f"got {cfg['step_launch']!r}", [], cfg["step_launch"])
    ledger = cfg.get("ledger_path") or str(Path(init_context.instance.root_directory) / LEDGER_FILE)
    try:
        handler = DeviceStepHandler(inventory, ledger, cfg.get("acquire_timeout_s"), step_launch=cfg["step_launch"])
    except InventoryError as e:  # a broken driver: the run fails saying so, never becomes one CPU device
        raise dg.DagsterInvariantViolationError(f"gpu_executor: {e}") from None
    return StepDelegatingExecutor(handler, retries=RetryMode.from_config(cfg["retries"]),
                                  max_concurrent=cfg.get("max_concurrent"), check_step_health_interval_seconds=1,
                                  sleep_seconds=cfg["poll_interval_s"])

