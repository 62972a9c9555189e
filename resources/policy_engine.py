"""The policy engine resource: resident `Experiment`s, one per experiment, per process.

Dagster builds resources per run, so the models live in a module-level cache keyed by
experiment name. Steps of one run (in-process executor) and runs executed one after another in
the same process (`execute_job` in a loop, the benchmark, a notebook) reuse the loaded model
and learner; a run in a fresh process (the daemon's launcher, `dagster job execute`) loads the
base model once and resumes from the previous iteration's checkpoint, which reproduces the
uninterrupted run exactly (weights, optimizer and RNG states are in the checkpoint).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import dagster as dg

from tinker_pipelines.config import Config
from tinker_pipelines.loops.experiment import Experiment
from tinker_pipelines.scheduler.step_entry import STEP_PROCESS_ENV


@dataclass
class _Entry:
    cfg: Config
    exp: Experiment
    # what earlier steps of the current iteration produced (rollouts, scored datums), so later steps
    # skip unpickling them from the store: (iteration, what) -> value, the latest iteration only
    handoff: dict[tuple[int, str], Any] = field(default_factory=dict)


_CACHE: dict[str, _Entry] = {}
_LOCK = threading.RLock()


def evict(experiment: str | None = None) -> None:
    """Forget the resident experiment(s) (tests; after a failure mid-update). An experiment on a
    worker closes its connection, so the worker drops its adapter."""
    with _LOCK:
        entries = list(_CACHE.values()) if experiment is None else [e for e in [_CACHE.get(experiment)] if e]
        if experiment is None:
            _CACHE.clear()
        else:
            _CACHE.pop(experiment, None)
    for entry in entries:
        if entry.exp.worker is not None:
            entry.exp.worker.close()


def resident(experiment: str) -> Experiment | None:
    entry = _CACHE.get(experiment)
    return entry.exp if entry else None


def _listening(address: str) -> bool:
    """Whether a worker answers at `address`."""
    from tinker_pipelines.worker import WorkerError
    from tinker_pipelines.worker.client import WorkerClient

    try:
        WorkerClient(address).close()
        return True
    except WorkerError:
        return False


class PolicyEngine(dg.ConfigurableResource):
    """Loads and keeps experiments resident (base model + learner) across steps and runs."""

    keep_resident: bool = True
    """Keep the experiment in memory after a step; false reloads from checkpoints every step."""
    worker: str = ""
    """Socket of a resident worker to train LoRA experiments on ('' : $TINKER_WORKER, else in-process)."""
    start_worker: bool = False
    """Start a worker on the experiment's base when none listens at `worker` (default socket under .tinker/)."""
    worker_lease_memory_gb: float = 0.0
    """GB the worker it starts leases on a leased step's device for as long as it lives (0: what the step reserved)."""

    def worker_address(self, cfg: Config, base: Path | None) -> str | None:
        """Where this experiment's worker listens, starting one if asked; None: in-process."""
        import os

        address = self.worker or os.environ.get("TINKER_WORKER", "")
        if not address and not self.start_worker:
            return None
        if cfg.training.mode != "lora":
            return None  # full-parameter experiments never share a base: in-process
        m = cfg.model
        seed = cfg.seed if m.seed is None else m.seed
        model = str(base) if base is not None else m.name
        if not address:
            from tinker_pipelines.worker import default_socket
            from tinker_pipelines.models import base_identity, resolve_device
            from tinker_pipelines.scheduler.workers import worker_device_key

            # keyed by the physical device (in a leased step every GPU is cuda:0): the worker of the
            # device this step leased, never another step's
            device = resolve_device(m.device)
            address = str(default_socket(base_identity(model, {} if base else m.kwargs, seed),
                                         worker_device_key(device.type, device.index)).resolve())
        if self.start_worker and not _listening(address):  # none yet, or a dead one's stale socket
            import json

            from tinker_pipelines.worker.client import start_worker

            extra = [] if base is not None else ["--seed", str(seed), "--model-kwargs", json.dumps(m.kwargs)]
            if self.worker_lease_memory_gb:
                extra += ["--lease-memory-gb", f"{self.worker_lease_memory_gb:g}"]
            Path(address).parent.mkdir(parents=True, exist_ok=True)  # its log lies beside the socket
            start_worker(model, address, device=m.device, dtype=m.dtype, extra=extra, log=f"{address}.log")
        return address

    def experiment(self, name: str, cfg: Config, at: int, checkpoint: Callable[[int], Path | None],
                   sft_base: Callable[[], Path | None] = lambda: None,
                   checkpoint_hash: Callable[[int], str | None] = lambda i: None) -> Experiment:
        """The experiment positioned at iteration `at` (iterations 0..at-1 already trained).

        Reuses the resident one when it is exactly there; on a worker, the adapter a previous
        step process parked there in that state (`checkpoint_hash(at - 1)`: the content hash of
        iteration at-1's checkpoint); otherwise loads the base model (the SFT checkpoint when
        `sft.steps` > 0) and resumes from `checkpoint(at - 1)`.
        """
        with _LOCK:
            entry = _CACHE.get(name)
            if entry is not None and entry.cfg == cfg and entry.exp.iteration == at and entry.exp.learner is not None:
                return entry.exp
            exp = self._load(cfg, at, checkpoint, sft_base, name, checkpoint_hash)
            if self.keep_resident:
                _CACHE[name] = _Entry(cfg, exp)
            return exp

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        """In a step process of `gpu_executor` (which exits after its step), park every resident
        experiment on its worker in the state its last checkpoint holds, so that the next step
        process takes it over instead of rebuilding it (`Experiment.resume_parked`). A step that
        failed while updating the policy has evicted it already (`updating`): it is not parked."""
        import os

        if not os.environ.get(STEP_PROCESS_ENV):
            return
        with _LOCK:
            parked = [e.exp for e in _CACHE.values() if e.exp.worker is not None]
        for exp in parked:
            try:
                exp.park()
            except Exception as e:  # noqa: BLE001 - the next step then rebuilds it from its checkpoint
                context.log.warning(f"could not park experiment {exp.name!r} on its worker: {e}")
        evict()

    def _load(self, cfg: Config, at: int, checkpoint: Callable[[int], Path | None],
              sft_base: Callable[[], Path | None], name: str = "",
              checkpoint_hash: Callable[[int], str | None] = lambda i: None) -> Experiment:
        base = sft_base() if cfg.sft.steps else None
        if cfg.sft.steps and base is None:
            raise RuntimeError(f"sft.steps is {cfg.sft.steps}: materialize sft_checkpoint (the `sft` job) first")
        address = self.worker_address(cfg, Path(base).resolve() if base is not None else None)
        if address is not None:
            from tinker_pipelines.worker.client import NEVER_SAVED

            exp = Experiment(cfg, worker=address, name=name or None,
                             base=Path(base).resolve() if base is not None else None)
            expected = checkpoint_hash(at - 1) if at > 0 else NEVER_SAVED
            if expected and exp.resume_parked(at, expected):
                return exp
        else:
            exp = Experiment(cfg)
        if base is not None and exp.worker is None:  # as train() does on resume: the warm-started weights replace the base
            exp.use_base(base)
        if exp.learner is None:  # (a worker's fresh adapter exists when no parked one matched)
            exp.start_rl()
        if at > 0:
            path = checkpoint(at - 1)
            if path is None:
                raise RuntimeError(f"iteration {at} needs the adapter of iteration {at - 1}, which was not found")
            exp.resume(path)
            if exp.iteration != at:
                raise RuntimeError(f"checkpoint {path} is at iteration {exp.iteration}, expected {at}")
        return exp

    @contextlib.contextmanager
    def updating(self, name: str) -> Iterator[None]:
        """Wrap a step that mutates the resident policy: on failure the entry is evicted, so a
        retry reloads from the last checkpoint instead of training on a half-updated model."""
        try:
            yield
        except BaseException:
            evict(name)
            raise
        if not self.keep_resident:
            evict(name)

    def remember(self, name: str, iteration: int, what: str, value: Any) -> None:
        """Keep `value` (already written to the store) for later steps of this iteration in this process."""
        entry = _CACHE.get(name)
        if entry is not None:
            entry.handoff = {key: v for key, v in entry.handoff.items() if key[0] == iteration}
            entry.handoff[(iteration, what)] = value

    def recall(self, name: str, iteration: int, what: str) -> Any | None:
        """What `remember` kept, or None (another process, or the experiment was reloaded): read the store."""
        entry = _CACHE.get(name)
        return entry.handoff.get((iteration, what)) if entry is not None else None
