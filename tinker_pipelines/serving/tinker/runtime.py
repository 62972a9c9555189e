"""The resident worker under the Tinker service, and what each Tinker call asks of it.

One worker per base model and device hosts every training client of that base as a LoRA
adapter. Each training client gets a connection of its own, so the worker's clock cycle sees
the clients as it sees `train --worker` experiments: their `sample` calls decode in one
mixed-adapter batch and their `forward_backward` calls share base passes, and one client's
error or disconnect touches nothing of the others (the worker drops only that connection's
adapters). Every method here blocks; the service calls them from worker threads.

Every worker call is bounded (`timeout_s`, the service's `--worker-timeout-s`). Under a
`WorkerSupervisor` (what `launch.start_service` sets up), a call that fails because its worker
died or hung raises `WorkerLost` naming what happened and what the client can do; the
supervisor replaces the worker, `generation` counts up, the shared connection is remade and the
checkpoints loaded read-only on it are loaded again (`worker_restarted`). A `Trainer` lives on
the worker of one generation: its adapter is gone with it (`lost_message`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker_pipelines.training.rules import TINKER_PASS_TOKENS, tinker_lora_settings
from tinker_pipelines.worker import WorkerDiedError, WorkerError, WorkerLost, WorkerTimeout
from tinker_pipelines.worker.client import ClosedConnection, WorkerClient, probe

log = logging.getLogger(__name__)

WORKER_TIMEOUT_S = 900.0
"""Default bound on one worker call (`--worker-timeout-s`): 15 minutes. A call's time includes
waiting behind the other clients' calls in the worker's cycle; the slowest training step
measured here took 165 s (a math_rl step on a 2-core CPU at a load average of 10,
docs/tinker.md), so a working worker does not meet it. A dead or stopped worker is found
sooner, by the supervisor's probes (`supervisor.py`)."""
RESTART_WAIT_S = 120.0
"""How long a new connection waits for a worker that is being restarted."""

@dataclass(frozen=True)
class LoraShape:
    """A training client's LoRA, as Tinker's `LoraConfig` gives it."""

    rank: int
    seed: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def learner(self) -> dict[str, Any]:
        """The worker's `LearnerConfig` fields for this adapter (`training.rules.tinker_lora_settings`)."""
        fields, _ = tinker_lora_settings({k: v for k, v in self.as_dict().items() if k != "seed"})
        return {**fields, "lora_targets": list(fields["lora_targets"])}

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "seed": self.seed, "train_mlp": self.train_mlp, "train_attn": self.train_attn,
                "train_unembed": self.train_unembed}


_adapter_ids = itertools.count()


def _adapter_name(prefix: str) -> str:
    return f"{prefix}{next(_adapter_ids)}"


class SharedConnection:
    """The runtime's shared connection (the base's samples, checkpoints loaded read-only), kept
    across worker restarts: `client` is the connection to the worker running now, and a `sample`
    that fails because its worker was lost waits for the new worker and is sent again, once (a
    sample changes nothing, and its seed travels with it). Other calls are the client's own.
    `checkpoint` (adapter name, directory) is what this connection holds: where the restart's
    listener could not load it again, the next sample does."""

    def __init__(self, client: WorkerClient, runtime: Runtime, generation: int = 0,
                 checkpoint: tuple[str, str] | None = None):
        self.client, self._runtime = client, runtime
        self.generation = generation
        """The worker generation `client` reaches."""
        self.checkpoint = checkpoint
        self._lock = threading.Lock()

    def sample(self, call: Any) -> Any:
        try:
            return self._current().sample(call)
        except WorkerLost:
            if self._runtime.supervisor is None:
                raise
            self._runtime.supervisor.wait_ready(RESTART_WAIT_S)  # the listeners have replaced `client` by then
            return self._current().sample(call)

    def _current(self) -> WorkerClient:
        """`client`, connected again (and its checkpoint loaded again) when it reaches an older worker."""
        if self.generation < self._runtime.generation:
            if self._runtime.supervisor is not None:  # outside the lock: the restart's listener takes it
                self._runtime.supervisor.wait_ready(RESTART_WAIT_S)
            self.refresh()
        return self.client

    def refresh(self) -> None:
        """Connect to the worker running now, and load the checkpoint on it, if `client` reaches
        an older one (the restart's listener, or else the next sample)."""
        with self._lock:
            if self.generation >= self._runtime.generation:
                return
            client, generation = self._runtime._connect(wait=False)
            try:
                if self.checkpoint is not None:
                    client.create_sampler(*self.checkpoint)
            except BaseException:
                client.close()
                raise
            old, self.client, self.generation = self.client, client, generation
        old.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


@dataclass
class Trainer:
    """One training client's adapter on the worker, over its own connection."""

    conn: WorkerClient
    adapter: str
    lora: LoraShape
    snapshots: list[str] = field(default_factory=list)
    """Read-only adapters made by ephemeral `save_weights_for_sampler`, oldest first."""
    generation: int = 0
    """The worker generation its adapter lives on (`WorkerSupervisor.generation`)."""
    resume_path: str | None = None
    """The tinker:// path of its last `save_state`, or of the checkpoint it was loaded from."""
    runtime: Any = field(default=None, repr=False, compare=False)
    """The `Runtime` (one worker) whose `create` made it: its adapter lives on that worker only."""

    def close(self) -> None:
        self.conn.close()  # the worker drops every adapter this connection holds
        if self.runtime is not None:
            self.runtime.forget(self)

    def lost_state(self) -> str:
        """What a client whose worker was lost can do."""
        if self.resume_path is None:
            return ("this training client's in-memory state is gone and was never saved: create a new training "
                    "client")
        return (f"this training client's in-memory state is gone: resume from its last checkpoint with "
                f"create_training_client_from_state_with_optimizer({self.resume_path!r}) "
                f"(create_training_client_from_state: weights only)")


class Runtime:
    """The worker at `address` (already running), as the Tinker service uses it."""

    def __init__(self, address: str | Path, keep_snapshots: int = 2, pass_tokens: int = TINKER_PASS_TOKENS,
                 timeout_s: float | None = WORKER_TIMEOUT_S, supervisor: Any = None):
        self.address = str(address)
        self.timeout_s = timeout_s
        """Bound on each worker call (None: none)."""
        self.supervisor = supervisor
        """The `supervisor.WorkerSupervisor` that replaces a dead or hung worker, or None."""
        self._lock = threading.Lock()
        self._live: set[str] = set()
        """Adapters of the training clients made here and not closed: counted by `live_adapters`."""
        self._from_checkpoints: dict[str, tuple[str, SharedConnection]] = {}
        """Read-only adapters `load_for_sampling` made: name -> (checkpoint directory, the
        connection of its own that holds it); loaded again on a new worker."""
        self.keep_snapshots = keep_snapshots
        """Ephemeral sampler adapters kept per client: a sampler made two saves ago may still be sampling."""
        self.pass_tokens = pass_tokens
        """Padded tokens per forward pass of a client's `forward_backward` (0: the whole call in one)."""
        probe, _ = self._connect()
        self.info = probe.info
        probe.close()
        client, gen = self._connect()
        self.shared = SharedConnection(client, self, gen)
        """Holds the adapters of sampling sessions made from a checkpoint path, and samples the base."""
        if supervisor is not None:
            supervisor.listeners.append(self.worker_restarted)

    @property
    def generation(self) -> int:
        return 0 if self.supervisor is None else self.supervisor.generation

    def _connect(self, trainer: Trainer | None = None, wait: bool = True) -> tuple[WorkerClient, int]:
        """A connection (and the worker generation it reaches) whose failures are explained as
        `WorkerLost`; waits for a worker that is being restarted (unless `wait` is False)."""
        for attempt in (0, 1):
            gen = self.supervisor.wait_ready(RESTART_WAIT_S) if self.supervisor and wait else self.generation
            try:
                conn = WorkerClient(self.address, timeout_s=self.timeout_s)
            except WorkerError:
                if self.supervisor is None or not wait or attempt:
                    raise
                self.supervisor.lost(gen)  # a worker found dead meanwhile is being replaced: try once more
                continue
            conn.explain = functools.partial(self._explain, gen, trainer)
            return conn, gen
        raise AssertionError("unreachable")

    def _explain(self, gen: int, trainer: Trainer | None, about: str, error: WorkerDiedError) -> str | None:
        """`WorkerClient.explain` for a connection to the worker of generation `gen`."""
        if self.supervisor is None:
            return None
        if isinstance(error, ClosedConnection) and self.supervisor.loss(gen) is None:
            return None  # we closed it; the worker is fine
        hung = f"it gave no answer to {about} within {self.timeout_s:g} s" if isinstance(error, WorkerTimeout) else None
        loss = self.supervisor.lost(gen, hung)
        if loss is None:
            return None  # the worker is fine: this connection alone broke
        what = loss.describe(self.supervisor.base)
        if trainer is None:
            return f"{what}; this call was lost with it: send it again"
        return f"{what}; {trainer.lost_state()}"

    def lost_message(self, t: Trainer) -> str:
        """Why a training client's calls fail once its worker was replaced."""
        loss = self.supervisor.loss(t.generation) if self.supervisor is not None else None
        what = loss.describe(self.supervisor.base) if loss else "its worker was replaced"
        return f"{what}; {t.lost_state()}"

    def worker_restarted(self, generation: int) -> None:
        """A new worker runs (the supervisor's listener, in its thread): connect the shared
        connection to it and load again every checkpoint that was loaded read-only, under the same
        adapter names, so samplers made from checkpoint paths go on sampling (one whose files were
        deleted meanwhile is not: the service retires its samplers, `Service.worker_restarted`)."""
        self.shared.refresh()
        with self._lock:
            todo = {name: entry for name, entry in self._from_checkpoints.items()
                    if (Path(entry[0]) / "record.json").exists()}  # a deleted one is the service's to retire

        def reload(name: str, path: str, conn: SharedConnection) -> None:
            try:
                conn.refresh()
            except WorkerError as e:  # its next sample tries again (`SharedConnection._current`)
                log.warning("checkpoint %s could not be loaded again on the new worker as %s: %s", path, name,
                            str(e).splitlines()[0])

        # at once, each on its connection: their loads meet in one worker cycle, and every call
        # waiting for the new worker waits for that cycle, not one per checkpoint
        threads = [threading.Thread(target=reload, args=(name, path, conn), daemon=True)
                   for name, (path, conn) in todo.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    @property
    def max_context(self) -> int | None:
        return self.info.get("max_context")

    def create(self, lora: LoraShape, base_name: str) -> Trainer:
        conn, gen = self._connect()
        name = _adapter_name("t")
        trainer = Trainer(conn, name, lora, generation=gen)
        conn.explain = functools.partial(self._explain, gen, trainer)
        try:
            conn.create(name, {**lora.learner(), "micro_batch_tokens": self.pass_tokens}, lora.seed, base_name=base_name)
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._live.add(name)
        trainer.runtime = self
        return trainer

    def forget(self, t: Trainer) -> None:
        """A training client closed: it no longer counts in `live_adapters`."""
        with self._lock:
            self._live.discard(t.adapter)

    def live_adapters(self) -> int:
        """Live adapters on this worker that sessions placed here: training clients and
        checkpoints loaded for sampling (what `node.Node` balances new ones by)."""
        with self._lock:
            return len(self._live) + len(self._from_checkpoints)

    def holds(self, adapter: str) -> bool:
        """Whether `adapter` is a checkpoint this runtime loaded for sampling."""
        with self._lock:
            return adapter in self._from_checkpoints

    def forward_backward(self, t: Trainer, datums: list, loss: str, config: dict[str, float],
                         forward_only: bool) -> tuple[list[list[float]], dict[str, float]]:
        return t.conn.tinker_forward_backward(t.adapter, datums, loss, config, forward_only)

    def optim_step(self, t: Trainer, adam: dict[str, float]) -> dict[str, float]:
        return t.conn.optim_step(t.adapter, adam)

    def save(self, t: Trainer, path: Path, record: dict[str, Any]) -> dict[str, Any]:
        out = t.conn.save_state(t.adapter, str(path), record)
        tinker = record.get("tinker") or {}
        if tinker.get("kind") == "weights" and tinker.get("path"):
            t.resume_path = tinker["path"]
        return out

    def load(self, t: Trainer, path: Path, optimizer: bool) -> dict[str, Any]:
        record = t.conn.load_state(t.adapter, str(path), optimizer=optimizer)
        t.resume_path = (record.get("tinker") or {}).get("path") or t.resume_path
        return record

    def snapshot(self, t: Trainer) -> str:
        """A read-only copy of the client's adapter as it is now (an ephemeral sampler), made in
        the worker's memory (`WorkerClient.copy_adapter`: no checkpoint written or read): later
        optimizer steps do not change what it samples. The oldest beyond `keep_snapshots` is dropped."""
        name = _adapter_name("s")
        t.conn.copy_adapter(t.adapter, name)
        t.snapshots.append(name)
        while len(t.snapshots) > self.keep_snapshots:
            old = t.snapshots.pop(0)
            try:
                t.conn.drop(old)
            except WorkerError:
                pass  # already gone with its connection
        return name

    def load_for_sampling(self, path: Path) -> str:
        """A read-only adapter from the checkpoint at `path` (shaped as its record says), on a
        connection of its own: the service sends one sample call per connection at a time, so
        checkpoints sharing one would decode one after another, where on connections of their
        own their calls reach the worker together and decode in one mixed-adapter batch."""
        name = _adapter_name("p")
        client, gen = self._connect()
        conn = SharedConnection(client, self, gen, checkpoint=(name, str(path)))
        with self._lock:  # listed first: a worker restarted meanwhile loads it too
            self._from_checkpoints[name] = (str(path), conn)
            client = conn.client
        try:
            client.create_sampler(name, str(path))
        except BaseException:
            with self._lock:
                self._from_checkpoints.pop(name, None)
            conn.client.close()
            raise
        return name

    def connection(self, adapter: str) -> SharedConnection:
        """The connection that samples read-only adapter `adapter` (the shared one for the base)."""
        with self._lock:
            entry = self._from_checkpoints.get(adapter)
        return self.shared if entry is None else entry[1]

    def unload(self, adapter: str) -> None:
        """Drop a read-only adapter `load_for_sampling` made (its last sampler is gone): its
        connection closes, and the worker drops what that connection held."""
        with self._lock:
            entry = self._from_checkpoints.pop(adapter, None)
        if entry is not None:
            entry[1].client.close()

    def health(self, timeout_s: float = 2.0) -> str | None:
        """None when the worker answers within `timeout_s`, else why not (one line)."""
        if self.supervisor is not None:
            return self.supervisor.health(timeout_s)
        reason = probe(self.address, timeout_s)
        return None if reason is None else f"the worker at {self.address} does not answer: {reason}"

    def close(self) -> None:
        with self._lock:
            held = [conn for _, conn in self._from_checkpoints.values()]
            self._from_checkpoints.clear()
        for conn in held:
            conn.client.close()
        self.shared.close()
