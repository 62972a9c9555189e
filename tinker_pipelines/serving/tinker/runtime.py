"""The resident worker under the Tinker service, and what each Tinker call asks of it.

One worker per base model and device hosts every training client of that base as a LoRA
adapter. Each training client gets a connection of its own, so the worker's clock cycle sees
the clients as it sees `train --worker` experiments: their `sample` calls decode in one
mixed-adapter batch and their `forward_backward` calls share base passes, and one client's
error or disconnect touches nothing of the others (the worker drops only that connection's
adapters). Every method here blocks; the service calls them from worker threads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker_pipelines.training.rules import TINKER_PASS_TOKENS, tinker_lora_settings
from tinker_pipelines.worker import WorkerError
from tinker_pipelines.worker.client import WorkerClient

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


@dataclass
class Trainer:
    """One training client's adapter on the worker, over its own connection."""

    conn: WorkerClient
    adapter: str
    lora: LoraShape
    snapshots: list[str] = field(default_factory=list)
    """Read-only adapters made by ephemeral `save_weights_for_sampler`, oldest first."""

    def close(self) -> None:
        self.conn.close()  # the worker drops every adapter this connection holds


class Runtime:
    """The worker at `address` (already running), as the Tinker service uses it."""

    def __init__(self, address: str | Path, keep_snapshots: int = 2, pass_tokens: int = TINKER_PASS_TOKENS):
        self.address = str(address)
        self.keep_snapshots = keep_snapshots
        """Ephemeral sampler adapters kept per client: a sampler made two saves ago may still be sampling."""
        self.pass_tokens = pass_tokens
        """Padded tokens per forward pass of a client's `forward_backward` (0: the whole call in one)."""
        probe = WorkerClient(self.address)
        self.info = probe.info
        probe.close()
        self.shared = WorkerClient(self.address)
        """Holds the adapters of sampling sessions made from a checkpoint path, and samples the base."""

    @property
    def max_context(self) -> int | None:
        return self.info.get("max_context")

    def create(self, lora: LoraShape, base_name: str) -> Trainer:
        conn = WorkerClient(self.address)
        name = _adapter_name("t")
        try:
            conn.create(name, {**lora.learner(), "micro_batch_tokens": self.pass_tokens}, lora.seed, base_name=base_name)
        except BaseException:
            conn.close()
            raise
        return Trainer(conn, name, lora)

    def forward_backward(self, t: Trainer, datums: list, loss: str, config: dict[str, float],
                         forward_only: bool) -> tuple[list[list[float]], dict[str, float]]:
        return t.conn.tinker_forward_backward(t.adapter, datums, loss, config, forward_only)

    def optim_step(self, t: Trainer, adam: dict[str, float]) -> dict[str, float]:
        return t.conn.optim_step(t.adapter, adam)

    def save(self, t: Trainer, path: Path, record: dict[str, Any]) -> dict[str, Any]:
        return t.conn.save_state(t.adapter, str(path), record)

    def load(self, t: Trainer, path: Path, optimizer: bool) -> dict[str, Any]:
        return t.conn.load_state(t.adapter, str(path), optimizer=optimizer)

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
        """A read-only adapter from the checkpoint at `path` (shaped as its record says), on the
        shared connection."""
        name = _adapter_name("p")
        self.shared.create_sampler(name, str(path))
        return name

    def close(self) -> None:
        self.shared.close()
