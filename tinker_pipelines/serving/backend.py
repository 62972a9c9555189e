"""Where the endpoint's tokens come from: one base model and a bounded set of loaded adapters.

`EngineBackend` serves from the resident worker's `Engine` in this process: a compute thread owns
it (PEFT adapters are added and removed between batches, never during one) and decodes every
pending request of a clock cycle in one mixed-adapter batch (`Sampler.sample_requests`: the base
matmuls once over all rows, each row its own adapter's low-rank delta). `WorkerBackend` serves
from a running `tinker-pipelines worker` over its socket instead; the worker batches there.

Adapters are loaded on first use and kept, least recently used evicted past `max_adapters`; an
adapter with a request in flight is never evicted.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, Callable


from tinker_pipelines.training.learner import LearnerConfig
from tinker_pipelines.rollout.sampler import BASE, SampleRequest
from tinker_pipelines.serving.errors import ServingError
from tinker_pipelines.serving.registry import Version

log = logging.getLogger(__name__)


def learner_config(v: Version) -> LearnerConfig:
    """The adapter's shape as it was trained (rank, alpha, targets, from the checkpoint's record;
    from the run config for a record that predates `learner`); no value head or reference:
    serving only decodes."""
    if v.learner:
        lr = v.learner
        targets = lr.get("lora_targets")
        shape = {"lora_targets": tuple(targets)} if targets else {}
        return LearnerConfig(mode="lora", lora_rank=int(lr["lora_rank"]), lora_alpha=float(lr["lora_alpha"]),
                             learning_rate=float(lr.get("learning_rate", 1e-4)), **shape)
    if v.config is None:
        raise ServingError(400, f"{v.key} records neither its learner settings nor a run config: its LoRA shape is "
                                "unknown", param="model", code="model_not_servable")
    t = v.config.training
    return LearnerConfig(mode="lora", lora_rank=t.lora_rank, lora_alpha=t.lora_alpha, learning_rate=t.learning_rate)


def adapter_name(v: Version) -> str:
    """The version's adapter name on the engine (no '.', as the engine requires)."""
    return f"{v.model}-v{v.version}".replace(".", "-")


@dataclass
class _Job:
    request: SampleRequest
    future: Future
    cancelled: bool = False


class EngineBackend:
    """An in-process `Engine`, driven by one compute thread that batches concurrent requests."""

    def __init__(self, engine, window_s: float = 0.003):
        self.engine = engine
        self.window_s = window_s
        """How long a cycle waits for more requests after the first (a batch is cheaper than two)."""
        self.max_context = engine.sampler.max_context
        self.stop_token_ids = list(engine.stop_token_ids)
        self._queue: queue.Queue = queue.Queue()
        self.batches = 0
        """Sample batches run (the benchmark reads how many requests shared them)."""
        self.record: list[list[SampleRequest]] | None = None
        """When a list, every batch's requests are appended to it (`benchmarks.serving` replays them)."""
        threading.Thread(target=self._loop, name="serve-compute", daemon=True).start()

    # -- called from request handlers ------------------------------------------------------
    def submit(self, request: SampleRequest) -> _Job:
        job = _Job(request, Future())
        self._queue.put(job)
        return job

    def run(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the compute thread between batches (adapter loads and drops)."""
        fut: Future = Future()
        self._queue.put((fn, fut))
        return fut

    def load(self, v: Version) -> str:
        name = adapter_name(v)

        def create() -> str:
            e = self.engine
            e.create(0, name, asdict(learner_config(v)), seed=0, base_name=_record_base(v))
            e.load_state(name, str(v.path))
            return name
        return self.run(create).result()

    def unload(self, name: str) -> None:
        self.run(lambda: self.engine.drop(name)).result()

    # -- the compute thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            items = [self._queue.get()]
            deadline = time.monotonic() + self.window_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    items.append(self._queue.get(timeout=left))
                except queue.Empty:
                    break
            jobs = [i for i in items if isinstance(i, _Job) and not i.cancelled and i.future.set_running_or_notify_cancel()]
            for item in items:
                if isinstance(item, tuple):  # an adapter op: between batches, never during one
                    fn, fut = item
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the waiting handler
                        fut.set_exception(e)
            for chunk in _chunks(jobs, self.engine.cfg.max_rows):
                if self.record is not None:
                    self.record.append([j.request for j in chunk])
                # each request's own error: one client's bad request never fails the others
                out = self.engine.sampler.sample_each([j.request for j in chunk])
                self.batches += 1
                for j, samples in zip(chunk, out):
                    if isinstance(samples, Exception):
                        j.future.set_exception(samples)
                    else:
                        j.future.set_result(samples)


class WorkerBackend:
    """A running resident worker: one connection per loaded adapter (an adapter belongs to the
    connection that created it), so concurrent requests of several adapters reach the worker at
    once and its compute thread decodes them in one batch. The base is a fresh adapter, whose
    LoRA B matrices are zero: exactly the base weights."""

    def __init__(self, address: str):
        from tinker_pipelines.worker.client import WorkerClient

        self.address = address
        probe = WorkerClient(address)
        self.max_context = probe.info["max_context"]
        self.stop_token_ids = list(probe.info["stop_token_ids"])
        self.base_identity = probe.info["base"]
        probe.close()
        self._clients: dict[str, Any] = {}
        self._made: dict[str, tuple[LearnerConfig, str | None, str]] = {}
        """How each adapter was made (`reconnect` makes it again on a new worker)."""
        self.batches = 0
        self._base = f"serve-{id(self):x}-base"
        self._create(self._base, LearnerConfig(mode="lora"), None, "")

    def _create(self, name: str, lcfg: LearnerConfig, path: str | None, base_name: str) -> None:
        from tinker_pipelines.worker.client import WorkerClient

        client = WorkerClient(self.address)
        try:
            client.create(name, asdict(lcfg), 0, base_name)
            if path is not None:
                client.load_state(name, path)
        except BaseException:
            client.close()  # the worker drops the half-made adapter with the connection
            raise
        self._clients[name] = client
        self._made[name] = (lcfg, path, base_name)

    def reconnect(self) -> None:
        """The worker at `address` was replaced by a new one (the Tinker service's supervisor):
        make every adapter again on it as it was made, the base's and each loaded version's (from
        its checkpoint), under the same names. One that cannot be made keeps its broken connection
        (its requests fail, naming the lost worker) and is logged."""
        for name, (lcfg, path, base_name) in list(self._made.items()):
            old = self._clients.get(name)
            try:
                self._create(name, lcfg, path, base_name)
            except Exception as e:  # noqa: BLE001 - one adapter must not keep the others from coming back
                log.warning("adapter %s could not be made again on the new worker: %s", name,
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                continue
            if old is not None:
                old.close()

    def load(self, v: Version) -> str:
        name = f"{adapter_name(v)}-{id(self):x}"
        self._create(name, learner_config(v), str(v.path.resolve()), _record_base(v))
        return name

    def unload(self, name: str) -> None:
        client = self._clients.pop(name, None)
        self._made.pop(name, None)
        if client is not None:
            client.close()  # the worker drops an adapter with its connection

    def submit(self, request: SampleRequest) -> _Job:
        job = _Job(request, Future())
        threading.Thread(target=self._sample, args=(job,), daemon=True).start()
        return job

    def _sample(self, job: _Job) -> None:
        r = job.request
        name = self._base if r.adapter == BASE else r.adapter
        from tinker_pipelines.worker.client import sample_call, set_generator_state

        try:
            out = self._clients[name].sample(sample_call(name, r.prompts, r.max_new_tokens, r.temperature, r.generator,
                                                         top_k=r.top_k, top_p=r.top_p, min_p=r.min_p, stop=r.stop,
                                                         top_logprobs=r.top_logprobs))
            if r.generator is not None:
                set_generator_state(r.generator, out.generator_state)
            self.batches += 1
            job.future.set_result(out.samples)
        except BaseException as e:  # noqa: BLE001
            job.future.set_exception(e)


def _record_base(v: Version) -> str:
    from tinker_pipelines.checkpoint import read_record

    return read_record(v.path, verify=False).get("base_model") or ""


def _chunks(jobs: list[_Job], max_rows: int) -> list[list[_Job]]:
    out, cur, rows = [], [], 0
    for j in jobs:
        n = len(j.request.prompts)
        if cur and rows + n > max_rows:
            out.append(cur)
            cur, rows = [], 0
        cur.append(j)
        rows += n
    return out + ([cur] if cur else [])


class AdapterCache:
    """Loaded adapters by canonical key `MODEL/VERSION`, least recently used first."""

    def __init__(self, backend, max_adapters: int):
        self.backend, self.max_adapters = backend, max_adapters
        self.loaded: collections.OrderedDict[str, tuple[str, Version]] = collections.OrderedDict()
        self.in_use: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)

    def acquire(self, key: str, fetch: Callable[[], Version]) -> tuple[str, Version]:
        """The engine adapter of `key`, loaded on first use (`fetch` downloads and verifies it);
        the caller must `release(key)` when its request ends."""
        with self._loading[key]:  # two first requests for one version load it once
            with self._lock:
                if key in self.loaded:
                    self.loaded.move_to_end(key)
                    self.in_use[key] += 1
                    return self.loaded[key]
            v = fetch()
            with self._lock:
                idle = [k for k in self.loaded if not self.in_use[k]]
                if len(self.loaded) >= self.max_adapters and not idle:
                    raise ServingError(503, f"all {self.max_adapters} adapter slots hold versions with requests in "
                                            f"flight; retry, or start the server with a larger --max-adapters",
                                       "server_error", "model", "adapter_slots_busy")
                evict = idle[: max(0, len(self.loaded) - self.max_adapters + 1)]
                for k in evict:
                    name, _ = self.loaded.pop(k)
                    self.backend.unload(name)
            name = self.backend.load(v)
            with self._lock:
                self.loaded[key] = (name, v)
                self.in_use[key] += 1
                return name, v

    def release(self, key: str) -> None:
        with self._lock:
            self.in_use[key] -= 1
