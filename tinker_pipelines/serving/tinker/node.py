"""The Tinker service over a node: one resident worker per (base model, device), each with a
runtime and a supervisor of its own.

Placement: each new training client, and each checkpoint loaded for sampling, goes to the
worker of its base holding the fewest live adapters (`Runtime.live_adapters`; ties go to the earlier
device), counting creates still under way, so N adapters of one base over k workers stay
balanced to within one while none close. What a training client makes afterwards (snapshots,
saves, loads) stays on its worker: its adapter exists in that worker's memory only, and every
call for its model id goes through its own connection there. A sampler of the base itself holds
nothing, so each of its calls goes to the least-loaded worker of its base.

A worker's death is its own: its supervisor restarts it on its device, only the training
clients it held are lost (`Service.worker_restarted` is told which runtime), and the other
workers' sessions never notice. With one worker this is exactly the single-worker service.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_pipelines.serving.tinker.runtime import LoraShape, Runtime, SharedConnection, Trainer


@dataclass
class NodeWorker:
    """One worker of the node: the base it holds, on which device, and its runtime."""

    base: str
    runtime: Runtime
    device: int | None = None
    """Its device's index in the service's inventory (None: the single worker of `--device`)."""
    label: str = ""
    """How messages name it: `tiny on device 1 (sim1)`."""


class Node:
    """The workers of every base, in device order, as `Service` uses them."""

    def __init__(self, workers: list[NodeWorker], aliases: dict[str, tuple[str, ...]] | None = None):
        if not workers:
            raise ValueError("a Tinker service needs at least one worker")
        self.workers = list(workers)
        self.bases = list(dict.fromkeys(w.base for w in self.workers))
        """The served bases, the first the default (a request naming none gets it)."""
        self.aliases = {b: tuple((aliases or {}).get(b, ())) for b in self.bases}
        """Other names clients may give each base (a model directory's absolute path and name)."""
        self.default = self.workers[0].runtime
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}
        """id(runtime) -> creates placed there and not finished: counted as load, so concurrent
        creates spread instead of all choosing the same least-loaded worker."""

    @classmethod
    def single(cls, runtime: Runtime, base: str, aliases: tuple[str, ...] = ()) -> Node:
        return cls([NodeWorker(base, runtime)], {base: aliases})

    def of_base(self, base: str) -> list[NodeWorker]:
        return [w for w in self.workers if w.base == base]

    def _load(self, rt: Runtime) -> int:
        return rt.live_adapters() + self._pending.get(id(rt), 0)

    def _least_loaded(self, base: str) -> Runtime:
        workers = self.of_base(base)
        if not workers:
            raise KeyError(f"no worker holds base {base!r}")
        return min(workers, key=lambda w: self._load(w.runtime)).runtime  # min keeps the first of equals

    def _place(self, base: str) -> Runtime:
        with self._lock:
            rt = self._least_loaded(base)
            self._pending[id(rt)] = self._pending.get(id(rt), 0) + 1
            return rt

    def _placed(self, rt: Runtime) -> None:
        with self._lock:
            self._pending[id(rt)] -= 1

    def create(self, lora: LoraShape, base: str) -> Trainer:
        """A training client of `base` on its least-loaded worker."""
        rt = self._place(base)
        try:
            return rt.create(lora, base)
        finally:
            self._placed(rt)

    def load_for_sampling(self, path: Path, base: str) -> str:
        """A checkpoint of `base` loaded read-only on its least-loaded worker."""
        rt = self._place(base)
        try:
            return rt.load_for_sampling(path)
        finally:
            self._placed(rt)

    def holder(self, adapter: str) -> Runtime | None:
        """The runtime that loaded checkpoint adapter `adapter` (None: none does)."""
        return next((w.runtime for w in self.workers if w.runtime.holds(adapter)), None)

    def connection(self, adapter: str, base: str) -> SharedConnection:
        """The connection that samples read-only adapter `adapter` of `base` (the base itself for "")."""
        if not adapter:
            with self._lock:
                return self._least_loaded(base).shared
        return (self.holder(adapter) or self.default).connection(adapter)

    def unload(self, adapter: str) -> None:
        rt = self.holder(adapter)
        if rt is not None:
            rt.unload(adapter)

    def info(self, base: str) -> dict[str, Any]:
        """The worker's own description of `base` (vocabulary, context, architecture)."""
        workers = self.of_base(base)
        return (workers[0].runtime if workers else self.default).info

    def worker_of(self, trainer: Trainer) -> NodeWorker | None:
        return next((w for w in self.workers if w.runtime is trainer.runtime), None)

    def loads(self) -> dict[str, int]:
        """Each worker's live adapters, by label (what placement balances)."""
        return {w.label or w.base: w.runtime.live_adapters() for w in self.workers}

    def health(self, timeout_s: float = 2.0) -> tuple[str | None, dict[str, str]]:
        """(why the service cannot serve, or None; each worker that does not answer, by label).
        The service is down only while some base has no worker answering: one worker being
        restarted fails its own sessions' calls, not the others', so a liveness probe must not
        restart the whole service for it."""
        down = {}
        for w in self.workers:
            problem = w.runtime.health(timeout_s)
            if problem is not None:
                down[w.label or w.base] = problem
        for base in self.bases:
            mine = [w for w in self.workers if w.base == base]
            if all((w.label or w.base) in down for w in mine):
                return down[mine[0].label or mine[0].base], down
        return None, down

    def close(self) -> None:
        for w in self.workers:
            w.runtime.close()
