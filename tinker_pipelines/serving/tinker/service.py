"""The Tinker service's state and calls, without HTTP: sessions, training clients, sampling
sessions and their checkpoints, over one resident worker (`runtime.Runtime`) or the workers of
several bases and devices (`node.Node`: placement by load, a worker's loss its own).

Each training client is a `Model`: a LoRA adapter on the worker, its `SeqQueue` (its calls run
in `seq_id` order), its MLflow run and its checkpoints. A checkpoint is written in our own
format (`record.json` plus hashed tensors) under `home/checkpoints/<model_id>/<kind>/<name>`,
addressed as `tinker://<model_id>/<kind>/<name>`; each model's metadata is kept in
`home/runs/<model_id>.json`, so a restarted service resumes from any saved checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from tinker import types

from tinker_pipelines.algorithms.tinker_losses import (TinkerLoss, datum_from_tinker, soft_target_columns,
                                                        stack_soft_targets)
from tinker_pipelines.serving.tinker import catalog, tenancy, wire
from tinker_pipelines.serving.tinker.futures import Failed, Futures, Proto, Result, SeqQueue
from tinker_pipelines.serving.tinker.node import Node
from tinker_pipelines.serving.tinker.runtime import LoraShape, Runtime, Trainer
from tinker_pipelines.serving.tinker.sampling import Answer, SampleBatcher
from tinker_pipelines.types import Datum
from tinker_pipelines.worker import messages as M


log = logging.getLogger(__name__)

BASE_ADAPTER = ""
"""The adapter name that samples the worker's base without any adapter."""


class NotFound(LookupError):
    """An id the service does not know, or not for this key; `field` names which (answered 404)."""

    status = 404

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class Invalid(ValueError):
    """A request the service refuses; `field` names what (answered 400)."""

    status = 400

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class Gone(NotFound):
    """An id that existed and whose state was dropped (a snapshot sampler past `keep_snapshots`; answered 410)."""

    status = 410


OPTIMIZERS = ("adamw",)
"""Optimizer families this service steps (`create_model.optimizer_config.type`, `optim_step`'s params)."""


_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


def check_name(name: str, what: str = "path") -> str:
    """A checkpoint name: it becomes a path segment and the last part of a `tinker://` path."""
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise Invalid(f"{what} {name!r} is not a checkpoint name (1-128 of A-Z a-z 0-9 _ . -)", what)
    return name


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


@dataclass
class Session:
    session_id: str
    tags: list[str]
    user_metadata: dict[str, str]
    owner: str = tenancy.LOCAL
    display_name: str | None = None
    last_heartbeat: float = field(default_factory=time.monotonic)
    finished: str | None = None
    finished_at: float = 0.0


@dataclass
class Model:
    """One training client."""

    model_id: str
    session_id: str
    base_model: str
    lora: LoraShape
    user_metadata: dict[str, str]
    trainer: Trainer
    queue: SeqQueue
    owner: str = tenancy.LOCAL
    steps: int = 0
    last_request_time: str = field(default_factory=now_iso)
    last_checkpoint: dict[str, Any] | None = None
    last_sampler_checkpoint: dict[str, Any] | None = None
    saved: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Its checkpoints' listing entries by checkpoint id (`weights/NAME`), as `types.Checkpoint` fields."""
    pending_metrics: dict[str, float] = field(default_factory=dict)
    """The metrics of forward_backward calls since the last optimizer step (logged with it)."""

    def set_meta(self, meta: dict[str, Any]) -> None:
        """Take back the checkpoint entries of an edited `meta()` (publish, TTL, delete)."""
        self.saved = meta["checkpoints"]
        self.last_checkpoint, self.last_sampler_checkpoint = meta["last_checkpoint"], meta["last_sampler_checkpoint"]

    def meta(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "session_id": self.session_id, "owner": self.owner,
                "base_model": self.base_model,
                "lora": self.lora.as_dict(), "user_metadata": self.user_metadata, "steps": self.steps,
                "last_request_time": self.last_request_time, "last_checkpoint": self.last_checkpoint,
                "last_sampler_checkpoint": self.last_sampler_checkpoint, "checkpoints": self.saved}


@dataclass
class Sampler:
    """A sampling session: the base, a client's snapshot, or a checkpoint loaded read-only."""

    sampler_id: str
    base_model: str
    model_path: str | None
    adapter: str
    """The worker adapter it samples (`BASE_ADAPTER` for the base)."""
    trainer: Trainer | None = None
    """The client whose connection holds `adapter` (None: the runtime's shared connection)."""
    session_id: str = ""
    owner: str = tenancy.LOCAL
    source: str | None = None
    """The checkpoint directory its adapter was loaded from (`Service._loaded` counts its users)."""
    gone: str | None = None
    """Why its weights are no longer loaded (then `sample` answers 410 naming it)."""


class Service:
    """Every session, model and sampler of the served bases, over their workers."""

    def __init__(self, runtime: Runtime | Node, base_model: str, home: Path, tracker: Any = None,
                 gap_timeout_s: float = 60.0, base_aliases: tuple[str, ...] = (), max_lora_rank: int = 64,
                 session_ttl_s: float = 600.0, min_ttl_s: int = catalog.TTL_BOUNDS_S[0]):
        self.node = runtime if isinstance(runtime, Node) else Node.single(runtime, base_model, base_aliases)
        """Every worker, by base and device; a `Runtime` alone is a node of one worker."""
        self.runtime = self.node.default
        """The default base's first worker (the one worker of a single-worker service)."""
        self.base_model = self.node.bases[0]
        """The default base: what clients pass as `base_model` (a catalogue name or a model directory)."""
        self._bases = {alias: b for b in reversed(self.node.bases) for alias in (b, *self.node.aliases[b])}
        """Every name a client may give a served base -> that base."""
        self.base_aliases = set(self._bases)
        self.home = home
        self.tracker = tracker
        """A `lineage.TinkerTracker` (MLflow runs, registry, Dagster), or None."""
        self.gap_timeout_s = gap_timeout_s
        self.max_lora_rank = max_lora_rank
        self.session_ttl_s = session_ttl_s
        """A session without a heartbeat for this long is finished and its adapters freed (the SDK
        beats every 10 s while its process lives)."""
        self._reaper: asyncio.Task | None = None
        self._collector: asyncio.Task | None = None
        self.min_ttl_s = min_ttl_s
        """The shortest `ttl_seconds` a save takes (hosted Tinker's 1 hour; tests and soaks set less)."""
        self.collect_every_s = max(1.0, min(60.0, min_ttl_s / 4))
        """How often expired checkpoints are looked for."""
        """The largest rank the worker hosts (its --max-lora-rank)."""
        self.futures = Futures()
        self.batcher = SampleBatcher(lambda conn, call: conn.sample(call))
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self._loaded: dict[str, tuple[str, set[str]]] = {}
        """Checkpoint directory -> (its read-only adapter on the shared connection, the samplers using it)."""
        self._creates: dict[tuple[str, str, int], str] = {}
        """(session, what, seq) -> the request id of a create: a retried create gets the first one's future."""
        self.lost_models: dict[str, tuple[str, str]] = {}
        """model_id -> (owner, why) of training clients lost with their worker (`worker_restarted`)."""
        (home / "runs").mkdir(parents=True, exist_ok=True)
        (home / "checkpoints").mkdir(parents=True, exist_ok=True)

    # -- lookups ----------------------------------------------------------------------------
    def session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.owner != tenancy.current():
            raise NotFound(f"session_id {session_id!r} is unknown to this service", "session_id")
        return s

    def model(self, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None and self.lost_models.get(model_id, ("", ""))[0] == tenancy.current():
            raise Gone(f"model_id {model_id!r}: {self.lost_models[model_id][1]}", "model_id")
        if m is None or m.owner != tenancy.current():
            raise NotFound(f"model_id {model_id!r} is unknown to this service (create it, or load it from a "
                           "checkpoint with create_training_client_from_state)", "model_id")
        return m

    def sampler(self, sampler_id: str) -> Sampler:
        s = self.samplers.get(sampler_id)
        if s is None or s.owner != tenancy.current():
            raise NotFound(f"sampling_session_id {sampler_id!r} is unknown to this service", "sampling_session_id")
        if s.gone is not None:
            raise Gone(f"sampling_session_id {sampler_id!r}: {s.gone}", "sampling_session_id")
        return s

    def check_base(self, base_model: str | None, field_name: str = "base_model") -> str:
        """The served base `base_model` names (None: the default one), else a 400 naming the served ones."""
        if base_model is None:
            return self.base_model
        if base_model in self._bases:
            return self._bases[base_model]
        served = ", ".join(repr(b) for b in self.node.bases)
        raise Invalid(f"{field_name} {base_model!r} is not served here; this service serves {served}", field_name)

    def _sampler_base(self, s: Sampler) -> str:
        """The served base a sampler samples (`create_sampler` checked it)."""
        return self._bases.get(s.base_model, self.base_model)

    def _checkpoint_base(self, meta: dict[str, Any], field_name: str) -> str:
        """The served base a checkpoint was trained on (one base served: that one, as always)."""
        if len(self.node.bases) == 1:
            return self.base_model
        return self.check_base(meta.get("base_model"), field_name)

    # -- sessions ---------------------------------------------------------------------------
    def create_session(self, req: types.CreateSessionRequest) -> types.CreateSessionResponse:
        now = time.monotonic()  # finished sessions are remembered a while (their heartbeats answer 410), not forever
        for old in [k for k, x in self.sessions.items() if x.finished and now - x.finished_at > self.session_ttl_s]:
            del self.sessions[old]
        sid = f"s{secrets.token_hex(6)}"
        self.sessions[sid] = Session(sid, list(req.tags or []), dict(req.user_metadata or {}), tenancy.current(),
                                     req.display_name)
        self.start_background()
        return types.CreateSessionResponse(session_id=sid)

    async def _reap(self) -> None:
        """Finish sessions whose client went away without saying so (killed, lost network). A
        session whose finishing fails is logged and tried again on the next passes (at most
        `REAP_TRIES` in all); the reaper itself goes on whatever fails."""
        failed: dict[str, int] = {}
        while True:
            await asyncio.sleep(min(30.0, self.session_ttl_s / 4))
            try:
                now = time.monotonic()
                due = [s for s in self.sessions.values() if now - s.last_heartbeat > self.session_ttl_s
                       and failed.get(s.session_id, 0) < REAP_TRIES and (s.finished is None or (
                           s.session_id in failed and any(m.session_id == s.session_id for m in self.models.values())))]
                for s in due:
                    await self._reap_one(s, failed)
            except Exception as e:  # noqa: BLE001 - logged; the next pass runs all the same
                log.warning("session reaper: a pass failed (%s: %s); the next one is in %g s", type(e).__name__,
                            str(e).splitlines()[0] if str(e) else "", min(30.0, self.session_ttl_s / 4))

    async def _reap_one(self, s: Session, failed: dict[str, int]) -> None:
        token = tenancy.serve_as(s.owner)  # the reaper runs in whichever tenant's context started it
        try:
            await self.finish(s.session_id, "expired")
            failed.pop(s.session_id, None)
        except Exception as e:  # noqa: BLE001 - one session's failure must not stop the others' reaping
            failed[s.session_id] = failed.get(s.session_id, 0) + 1
            log.warning("session reaper: finishing expired session %s failed (%d of %d tries): %s: %s",
                        s.session_id, failed[s.session_id], REAP_TRIES, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
        finally:
            tenancy.reset(token)

    def worker_restarted(self, generation: int, runtime: Runtime | None = None) -> None:
        """The worker of `runtime` (default: the only one) was replaced by a new one of
        `generation` (`supervisor.WorkerSupervisor`; called in the event loop): the training
        clients whose adapters lived on an older one are closed as lost and their later calls
        answer 410 saying what happened and which save to resume from (`Runtime.lost_message`);
        so do the samplers that sampled their adapters. Other workers' clients are untouched.
        Samplers of checkpoint paths were loaded again by the runtime, and the base needs nothing."""
        runtime = runtime or self.runtime
        for m in [m for m in self.models.values() if m.trainer.generation < generation
                  and (m.trainer.runtime or self.runtime) is runtime]:
            why = runtime.lost_message(m.trainer)
            self.models.pop(m.model_id, None)
            self.lost_models[m.model_id] = (m.owner, why)
            for sampler in self.samplers.values():
                if sampler.trainer is m.trainer:
                    sampler.gone = why
            m.trainer.close()
            if self.tracker is not None:
                self.futures.spawn(asyncio.to_thread(self.tracker.end_model, m.model_id, "failed"))
        for source, (adapter, users) in list(self._loaded.items()):
            if (self.node.holder(adapter) or self.runtime) is not runtime or (Path(source) / "record.json").exists():
                continue  # the runtime loads it again on the new worker
            del self._loaded[source]  # deleted while in use: only the old worker's memory held it
            self.futures.spawn(asyncio.to_thread(runtime.unload, adapter))
            for sid in users:
                if sid in self.samplers:
                    self.samplers[sid].gone = ("its checkpoint was deleted while it sampled, and the worker that still "
                                               f"held its weights was restarted at {now_iso()}: its weights are gone")

    def heartbeat(self, session_id: str) -> None:
        self.session(session_id).last_heartbeat = time.monotonic()

    async def finish(self, session_id: str, reason: str) -> None:
        """End a session (its client said so, or stopped beating): its training clients and
        samplers go, and with them every adapter they held on the worker."""
        s = self.session(session_id)
        if s.finished is None:
            s.finished, s.finished_at = reason, time.monotonic()
        for m in [m for m in self.models.values() if m.session_id == session_id]:
            await self._close_model(m, reason)
        for sid in [k for k, x in self.samplers.items() if x.session_id == session_id]:
            await self._drop_sampler(sid)
        for key in [k for k in self._creates if k[0] == session_id]:
            del self._creates[key]
        # a finished session stays known (its heartbeats answer 410) until the reaper drops it

    async def _drop_sampler(self, sampler_id: str) -> None:
        """Forget a sampler; the last user of a path-loaded adapter unloads it."""
        s = self.samplers.pop(sampler_id, None)
        if s is None or s.source is None or s.source not in self._loaded:
            return
        adapter, users = self._loaded[s.source]
        users.discard(sampler_id)
        if not users:
            del self._loaded[s.source]
            await asyncio.to_thread(self.node.unload, adapter)

    def loaded_adapters(self) -> dict[str, int]:
        """Adapters this service holds on the worker, by kind (what a leak check counts)."""
        return {"training": len(self.models), "snapshots": sum(len(m.trainer.snapshots) for m in self.models.values()),
                "from_checkpoints": len(self._loaded)}

    async def _close_model(self, m: Model, status: str) -> None:
        self.models.pop(m.model_id, None)
        for sid in [k for k, s in self.samplers.items() if s.trainer is m.trainer]:
            await self._drop_sampler(sid)
        await asyncio.to_thread(m.trainer.close)
        if self.tracker is not None:
            await asyncio.to_thread(self.tracker.end_model, m.model_id, _RUN_STATUS.get(status, "killed"))

    # -- models -----------------------------------------------------------------------------
    def _lora(self, cfg: types.LoraConfig | None) -> LoraShape:
        cfg = cfg or types.LoraConfig(rank=32)
        if isinstance(cfg.rank, int) and cfg.rank > self.max_lora_rank:
            raise Invalid(f"lora_config.rank {cfg.rank} cannot be hosted here: this worker hosts ranks 1.."
                          f"{self.max_lora_rank}", "lora_config.rank")
        shape = LoraShape(cfg.rank, 0 if cfg.seed is None else int(cfg.seed), cfg.train_mlp, cfg.train_attn,
                          cfg.train_unembed)
        try:
            shape.learner()
        except ValueError as e:
            raise Invalid(str(e), str(e).split(" ", 1)[0].rstrip(":")) from None
        return shape

    def create_model(self, req: types.CreateModelRequest) -> str:
        """Starts creating a training client; returns the request id (its result: CreateModelResponse).
        The SDK re-sends a create whose answer it did not get (its HTTP timeout is 60 s): the
        same session and `model_seq_id` get the first request's future, not a second adapter."""
        s = self.session(req.session_id)
        first = self._creates.get((s.session_id, "model", req.model_seq_id))
        if first is not None:
            return first
        base = self.check_base(req.base_model)
        lora = self._lora(req.lora_config)
        optimizer = getattr(req.optimizer_config, "type", "adamw")
        if optimizer not in OPTIMIZERS:
            raise Invalid(f"optimizer_config.type {optimizer!r} is not served here; this service trains with "
                          f"{', '.join(OPTIMIZERS)} (optim_step takes AdamParams)", "optimizer_config.type")
        model_id = f"{s.session_id}:train:{req.model_seq_id}"
        if model_id in self.models:
            raise Invalid(f"model_seq_id {req.model_seq_id} already names {model_id!r} in this session", "model_seq_id")

        async def work() -> Result:
            await self._new_model(model_id, s, base, lora, dict(req.user_metadata or {}))
            return types.CreateModelResponse(model_id=model_id).model_dump(mode="json")
        rid = self.futures.run(work)
        self._creates[(s.session_id, "model", req.model_seq_id)] = rid
        return rid

    async def _new_model(self, model_id: str, s: Session, base: str, lora: LoraShape,
                         user_metadata: dict[str, str]) -> Model:
        trainer = await asyncio.to_thread(self.node.create, lora, base)
        m = Model(model_id, s.session_id, base, lora, user_metadata, trainer,
                  SeqQueue(self.futures, 1, self.gap_timeout_s), s.owner)
        self.models[model_id] = m
        self._save_meta(m)
        if self.tracker is not None:
            await asyncio.to_thread(self.tracker.start_model, model_id, s.session_id, base, lora.as_dict(),
                                    s.tags, {**s.user_metadata, **user_metadata})
        return m

    def info(self, model_id: str) -> types.GetInfoResponse:
        m = self.model(model_id)
        return types.GetInfoResponse(model_id=model_id, is_lora=True, lora_rank=m.lora.rank, model_name=m.base_model,
                                     model_data=types.ModelData(arch=self.node.info(m.base_model).get("arch")
                                                                or "causal_lm",
                                                                model_name=m.base_model, tokenizer_id=m.base_model))

    def training_run(self, model_id: str) -> types.TrainingRun:
        meta = self._meta(model_id)
        return types.TrainingRun(training_run_id=model_id, base_model=meta["base_model"],
                                 model_owner=meta.get("owner", tenancy.LOCAL),
                                 is_lora=True, lora_rank=meta["lora"]["rank"],
                                 last_request_time=meta["last_request_time"],
                                 last_checkpoint=_checkpoint(meta.get("last_checkpoint")),
                                 last_sampler_checkpoint=_checkpoint(meta.get("last_sampler_checkpoint")),
                                 user_metadata=meta.get("user_metadata") or None)

    # -- ordered training calls -------------------------------------------------------------
    def _ordered(self, model_id: str, seq_id: int | None, work: Callable[[Model], Any],
                 check: Callable[[], object] = lambda: None) -> str:
        """Queue `work` as call `seq_id` of `model_id`, after `check` (the request's own
        validation). A call refused by `check` still uses up its seq_id: the client counted it,
        so the calls after it must not wait for it."""
        m = self.model(model_id)
        if seq_id is None:
            raise Invalid("seq_id is missing: a training client's calls are ordered by it", "seq_id")
        try:
            check()
        except (Invalid, NotFound, ValueError) as e:
            self.refused(model_id, seq_id, e)
            raise
        m.last_request_time = now_iso()

        async def run() -> Result:
            return await work(m)
        return m.queue.submit(int(seq_id), run)

    def refused(self, model_id: str, seq_id: int, e: BaseException | str) -> None:
        """Use up call `seq_id` of `model_id` (if both exist, and the model is the caller's) as
        failed: it was answered with an error before it was ordered."""
        m = self.models.get(model_id)
        if m is None or seq_id is None or m.owner != tenancy.current():
            return

        async def fail() -> Result:
            return Failed(f"refused: {e}", "user")
        m.queue.submit(int(seq_id), fail)

    def forward_backward(self, call: wire.ForwardBackwardCall) -> str:
        async def work(m: Model) -> Result:
            info = self.node.info(m.base_model)
            vocab = info.get("vocab_size")
            # soft targets, (N, K) cross_entropy, run as K datums over the same tokens
            columns = [soft_target_columns(d.inputs) for d in call.data]
            datums = [_datum(wire.TinkerDatum(d.tokens, c), i, call.loss, vocab, info.get("max_context"))
                      for i, (d, cs) in enumerate(zip(call.data, columns)) for c in (cs or [d.inputs])]
            logprobs, metrics = await asyncio.to_thread(self.runtime.forward_backward, m.trainer, datums,
                                                        call.loss.name, dict(call.loss.config), call.forward_only)
            if not call.forward_only:
                m.pending_metrics.update(metrics)
            logprobs = stack_soft_targets(logprobs, [None if cs is None else len(cs) for cs in columns])
            return Proto(wire.encode_forward_backward(logprobs, metrics))
        return self._ordered(call.model_id, call.seq_id, work)

    def optim_step(self, req: types.OptimStepRequest) -> str:
        p = req.optim_params
        if not isinstance(p, types.AdamParams):
            family = getattr(p, "type", type(p).__name__)
            raise Invalid(f"optim_params: optimizer family {family!r} is not served here; this service steps with "
                          f"{', '.join(OPTIMIZERS)} (AdamParams)", "optim_params.type")
        adam = {"learning_rate": p.learning_rate, "beta1": p.beta1, "beta2": p.beta2, "eps": p.eps,
                "weight_decay": p.weight_decay, "grad_clip_norm": p.grad_clip_norm}

        def check() -> None:
            for k, v in adam.items():
                if not (isinstance(v, (int, float)) and v >= 0 and v == v and v != float("inf")):
                    raise Invalid(f"adam_params.{k} must be a finite number >= 0, got {v!r}", f"adam_params.{k}")
            if not (adam["beta1"] < 1 and adam["beta2"] < 1):
                raise Invalid("adam_params.beta1 and beta2 must be < 1", "adam_params.beta1")

        async def work(m: Model) -> Result:
            metrics = await asyncio.to_thread(self.runtime.optim_step, m.trainer, adam)
            m.steps += 1
            if self.tracker is not None:  # one MLflow step per optimizer step: its gradient's metrics and its own
                logged = {**m.pending_metrics, **{f"optim/{k}": v for k, v in metrics.items()}}
                await asyncio.to_thread(self.tracker.log_step, m.model_id, m.steps, logged)
            m.pending_metrics.clear()
            return types.OptimStepResponse(metrics={f"optim/{k}:mean" if ":" not in k else k: float(v)
                                                    for k, v in metrics.items()}).model_dump(mode="json")
        return self._ordered(req.model_id, req.seq_id, work, check)

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.home / "checkpoints" / model_id / kind / name

    def resolve(self, tinker_path: str, field_name: str = "path") -> tuple[str, str, str, Path]:
        """(model_id, kind, name, directory) of a `tinker://` path this service wrote, that the
        caller owns or its owner published."""
        try:
            parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        except (ValueError, TypeError) as e:
            raise Invalid(f"{field_name} {tinker_path!r} is not a tinker:// checkpoint path ({e})", field_name) from None
        kind, name = parsed.checkpoint_id.split("/", 1)
        check_name(name, field_name)
        d = self.checkpoint_dir(parsed.training_run_id, kind, name)
        meta = catalog.read_run(self.home, parsed.training_run_id) if parsed.training_run_id not in self.models \
            else self.models[parsed.training_run_id].meta()
        entry = ((meta or {}).get("checkpoints") or {}).get(parsed.checkpoint_id) or {}
        readable = meta is not None and (meta.get("owner", tenancy.LOCAL) == tenancy.current() or entry.get("public"))
        if not readable or not (d / "record.json").exists() or catalog.is_expired(entry):
            raise NotFound(f"{field_name} {tinker_path!r}: no such checkpoint on this service", field_name)
        return parsed.training_run_id, kind, name, d

    def save_weights(self, req: types.SaveWeightsRequest) -> str:
        return self._save(req.model_id, req.seq_id, "weights", req.path, req.overwrite,
                          lambda path: types.SaveWeightsResponse(path=path), req.ttl_seconds)

    def save_for_sampler(self, req: types.SaveWeightsForSamplerRequest) -> str:
        if req.path is not None:
            return self._save(req.model_id, req.seq_id, "sampler_weights", req.path, False,
                              lambda path: types.SaveWeightsForSamplerResponseInternal(path=path), req.ttl_seconds)

        def check() -> None:
            if req.sampling_session_seq_id is None:
                raise Invalid("save_weights_for_sampler needs a path or a sampling_session_seq_id", "path")

        inflight = getattr(req, "kind", "snapshot") == "inflight"

        async def work(m: Model) -> Result:
            # inflight: the client asked for the live weights, which its next optim_step changes
            adapter = m.trainer.adapter if inflight else await asyncio.to_thread(self.runtime.snapshot, m.trainer)
            self._mark_dropped_snapshots(m)
            sid = f"{m.session_id}:sample:{req.sampling_session_seq_id}"
            self.samplers[sid] = Sampler(sid, m.base_model, None, adapter, m.trainer, m.session_id, m.owner)
            return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sid).model_dump(mode="json")
        return self._ordered(req.model_id, req.seq_id, work, check)

    def _mark_dropped_snapshots(self, m: Model) -> None:
        """Samplers whose snapshot the runtime dropped (past `keep_snapshots`) answer 410 from now on."""
        live = {m.trainer.adapter, *m.trainer.snapshots}
        for s in self.samplers.values():
            if s.trainer is m.trainer and s.gone is None and s.adapter not in live:
                s.gone = (f"its weights were dropped: a training client keeps its {self.runtime.keep_snapshots} newest "
                          "save_weights_for_sampler snapshots; save with a name (save_weights_for_sampler(name)) "
                          "to sample a checkpoint for longer")

    def _save(self, model_id: str, seq_id: int | None, kind: str, name: str, overwrite: bool,
              response: Callable[[str], Any], ttl_seconds: int | None = None) -> str:
        path = f"tinker://{model_id}/{kind}/{name}"

        def check() -> None:
            check_name(name)
            self._ttl(ttl_seconds)

        async def work(m: Model) -> Result:
            d = self.checkpoint_dir(model_id, kind, name)
            if d.exists() and not overwrite:
                raise Invalid(f"checkpoint {path} exists; save under another name or pass overwrite", "path")
            record = {"tinker": {**m.meta(), "path": path, "kind": kind, "name": name, "saved_at": now_iso()}}
            await asyncio.to_thread(self.runtime.save, m.trainer, d, record)
            entry = {"checkpoint_id": f"{kind}/{name}", "checkpoint_type": "training" if kind == "weights" else
                     "sampler", "time": now_iso(), "tinker_path": path, "size_bytes": _size(d), "public": False,
                     "expires_at": catalog.expiry(ttl_seconds)}
            if self.tracker is not None:  # the OpenAI endpoint serves it as this MODEL/VERSION
                v = await asyncio.to_thread(self.tracker.checkpoint_saved, model_id, kind, name, d, m.steps)
                if v is not None:  # None: the registry was unreachable (logged); the checkpoint is saved
                    entry["user_metadata"] = {"registered_version": v.key}
            m.saved[entry["checkpoint_id"]] = entry
            if kind == "weights":
                m.last_checkpoint = entry
            else:
                m.last_sampler_checkpoint = entry
            self._save_meta(m)
            return response(path).model_dump(mode="json")
        return self._ordered(model_id, seq_id, work, check)

    def _loadable(self, req: types.LoadWeightsRequest) -> tuple[str, str, str, Path]:
        found = self.resolve(req.path)
        if req.optimizer and found[1] == "external_weights":
            raise Invalid(f"path {req.path!r} is an export of weights without optimizer state: load it without "
                          "the optimizer (create_training_client_from_state), or save_state to keep both", "path")
        return found

    def load_weights(self, req: types.LoadWeightsRequest) -> str:
        if req.model_id is not None:
            async def work(m: Model) -> Result:
                d = self.resolve(req.path)[3]
                record = await asyncio.to_thread(self.runtime.load, m.trainer, d, bool(req.optimizer))
                m.steps = _saved_steps(record, m.steps)
                return types.LoadWeightsResponse(path=req.path, model_id=m.model_id).model_dump(mode="json")
            return self._ordered(req.model_id, req.seq_id, work, lambda: self._loadable(req))
        s = self.session(req.session_id or "")
        if req.model_seq_id is None:
            raise Invalid("load_weights without a model_id needs a model_seq_id (create-by-load)", "model_seq_id")
        first = self._creates.get((s.session_id, "model", req.model_seq_id))
        if first is not None:  # a retried create-by-load: the first one's future, not a second adapter
            return first
        src_model, kind, name, d = self._loadable(req)
        meta = self.checkpoint_meta(src_model, d)
        base = self.check_base(req.base_model or meta["base_model"])
        lora = LoraShape(**meta["lora"])
        model_id = f"{s.session_id}:train:{req.model_seq_id}"

        async def create() -> Result:
            m = await self._new_model(model_id, s, base, lora, dict(req.user_metadata or meta.get("user_metadata")
                                                                    or {}))
            record = await asyncio.to_thread(self.runtime.load, m.trainer, d, bool(req.optimizer))
            m.steps = _saved_steps(record, 0)
            return types.LoadWeightsResponse(path=req.path, model_id=model_id).model_dump(mode="json")
        rid = self.futures.run(create)
        self._creates[(s.session_id, "model", req.model_seq_id)] = rid
        return rid

    def checkpoints(self, model_id: str) -> list[types.Checkpoint]:
        """The checkpoints of a training run that still exist, with what was recorded at save
        (their registered `MODEL/VERSION` in `user_metadata`)."""
        saved = self._meta(model_id).get("checkpoints") or {}
        return [types.Checkpoint.model_validate(e) for cid, e in sorted(saved.items())
                if (self.home / "checkpoints" / model_id / cid / "record.json").exists() and not catalog.is_expired(e)]

    # -- checkpoint lifetimes, listings, sessions -------------------------------------------
    def _ttl(self, ttl_seconds: Any) -> int | None:
        try:
            return catalog.check_ttl(ttl_seconds, self.min_ttl_s)
        except ValueError as e:
            raise Invalid(str(e), "ttl_seconds") from None

    def _edit_run(self, model_id: str, edit: Callable[[dict[str, Any]], Any]) -> Any:
        """Apply `edit` to the metadata of the caller's run `model_id` and keep it (in the live
        training client too, so its next save does not write the old entries back)."""
        meta = self._meta(model_id)
        out = edit(meta)
        if model_id in self.models:
            self.models[model_id].set_meta(meta)
        catalog.write_run(self.home, meta)
        return out

    def _entry(self, meta: dict[str, Any], checkpoint_id: str, expired_too: bool = False) -> dict[str, Any]:
        kind, _, name = checkpoint_id.partition("/")
        if kind not in catalog.KINDS:
            raise Invalid(f"checkpoint_id {checkpoint_id!r} must be KIND/NAME, KIND one of {', '.join(catalog.KINDS)}",
                          "checkpoint_id")
        check_name(name, "checkpoint_id")
        entry = (meta.get("checkpoints") or {}).get(checkpoint_id)
        if entry is None or (catalog.is_expired(entry) and not expired_too):
            raise NotFound(f"checkpoint {checkpoint_id!r} of {meta['model_id']!r} does not exist", "checkpoint_id")
        return entry

    async def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        """Delete a checkpoint: its files, its listing entry and its registered copy. A sampler
        already sampling it keeps its loaded adapter until its session ends (a delete frees
        storage; it does not break a job that is running), and no new one can load it."""
        def edit(meta: dict[str, Any]) -> None:
            self._entry(meta, checkpoint_id, expired_too=True)
            catalog.drop_entry(meta, checkpoint_id)
        self._edit_run(model_id, edit)
        await self._remove_files(model_id, checkpoint_id)

    async def _remove_files(self, model_id: str, checkpoint_id: str) -> None:
        import shutil

        kind, _, name = checkpoint_id.partition("/")
        await asyncio.to_thread(shutil.rmtree, self.checkpoint_dir(model_id, kind, name), True)
        if self.tracker is not None and kind in ("weights", "sampler_weights"):
            try:
                await asyncio.to_thread(self.tracker.checkpoint_deleted, model_id, kind, name)
            except Exception as e:  # noqa: BLE001 - the files are gone; a registry entry left behind is logged
                log.warning("checkpoint %s/%s deleted, but its registered copy was not: %s: %s", model_id,
                            checkpoint_id, type(e).__name__, e)

    def publish(self, model_id: str, checkpoint_id: str, public: bool) -> None:
        """Make a checkpoint readable by every key (or only its owner's again)."""
        self._edit_run(model_id, lambda meta: (self._entry(meta, checkpoint_id),
                                               catalog.update_entry(meta, checkpoint_id, public=public)))

    def set_ttl(self, model_id: str, checkpoint_id: str, ttl_seconds: Any) -> None:
        ttl = self._ttl(ttl_seconds)
        self._edit_run(model_id, lambda meta: (self._entry(meta, checkpoint_id),
                                               catalog.update_entry(meta, checkpoint_id,
                                                                    expires_at=catalog.expiry(ttl))))

    def _own_runs(self) -> list[dict[str, Any]]:
        me = tenancy.current()
        runs = {m["model_id"]: m for m in catalog.all_runs(self.home) if m.get("owner", tenancy.LOCAL) == me}
        runs.update({m.model_id: m.meta() for m in self.models.values() if m.owner == me})
        return sorted(runs.values(), key=lambda m: m.get("last_request_time") or "", reverse=True)

    def list_runs(self, limit: Any, offset: Any) -> types.TrainingRunsResponse:
        try:
            runs, cursor = catalog.page(self._own_runs(), limit, offset)
        except ValueError as e:
            raise Invalid(str(e), str(e).split(" ", 1)[0]) from None
        return types.TrainingRunsResponse(training_runs=[self.training_run(m["model_id"]) for m in runs], cursor=cursor)

    def list_user_checkpoints(self, limit: Any, offset: Any) -> types.CheckpointsListResponse:
        entries = [e for m in self._own_runs() for e in (m.get("checkpoints") or {}).values()
                   if not catalog.is_expired(e)]
        entries.sort(key=lambda e: e.get("time") or "", reverse=True)
        try:
            chosen, cursor = catalog.page(entries, limit, offset)
        except ValueError as e:
            raise Invalid(str(e), str(e).split(" ", 1)[0]) from None
        return types.CheckpointsListResponse(checkpoints=[types.Checkpoint.model_validate(e) for e in chosen],
                                             cursor=cursor)

    def get_session(self, session_id: str) -> types.GetSessionResponse:
        s = self.session(session_id)
        runs = sorted({m["model_id"] for m in self._own_runs() if m.get("session_id") == session_id})
        samplers = sorted(k for k, x in self.samplers.items() if x.session_id == session_id)
        return types.GetSessionResponse(training_run_ids=runs, sampler_ids=samplers,
                                        user_metadata={k: str(v) for k, v in s.user_metadata.items()} or None,
                                        display_name=s.display_name)

    def list_sessions(self, limit: Any, offset: Any) -> types.ListSessionsResponse:
        mine = [k for k, x in self.sessions.items() if x.owner == tenancy.current()]
        try:
            chosen, _ = catalog.page(mine, limit, offset)
        except ValueError as e:
            raise Invalid(str(e), str(e).split(" ", 1)[0]) from None
        return types.ListSessionsResponse(sessions=chosen)

    async def collect_expired(self) -> int:
        """Delete every checkpoint whose TTL has passed (all tenants'); how many."""
        n = 0
        for meta in list(catalog.all_runs(self.home)):
            for cid, entry in list((meta.get("checkpoints") or {}).items()):
                if catalog.is_expired(entry):
                    owner = tenancy.serve_as(meta.get("owner", tenancy.LOCAL))
                    try:
                        await self.delete_checkpoint(meta["model_id"], cid)
                        n += 1
                    except NotFound:
                        pass  # deleted meanwhile
                    finally:
                        tenancy.reset(owner)
        return n

    async def _collect(self) -> None:
        while True:
            await asyncio.sleep(self.collect_every_s)
            try:
                await self.collect_expired()
            except Exception as e:  # noqa: BLE001 - one failed pass is logged; the next pass tries again
                log.warning("deleting expired checkpoints failed: %s: %s", type(e).__name__, e)

    def start_background(self) -> None:
        """Start the session reaper and the TTL collector (once, inside the service's event loop)."""
        if self._reaper is None:
            self._reaper = asyncio.ensure_future(self._reap())
        if self._collector is None:
            self._collector = asyncio.ensure_future(self._collect())

    # -- sampling ---------------------------------------------------------------------------
    async def create_sampler(self, req: types.CreateSamplingSessionRequest) -> str:
        """A sampling session of the base or of a checkpoint. A checkpoint's adapter is loaded once
        however many samplers use it, and unloaded with the last of them; a retried create (same
        session and seq id) answers the sampler the first one made."""
        s = self.session(req.session_id)
        sid = f"{s.session_id}:sample:{req.sampling_session_seq_id}"
        if sid in self.samplers:
            return sid
        if req.model_path is None:
            self.samplers[sid] = Sampler(sid, self.check_base(req.base_model), None, BASE_ADAPTER, None, s.session_id,
                                         s.owner)
            return sid
        model_id, _, _, d = self.resolve(req.model_path, "model_path")
        meta = self.checkpoint_meta(model_id, d)
        base = self._checkpoint_base(meta, "model_path")
        source = str(d)
        if source not in self._loaded:
            adapter = await asyncio.to_thread(self.node.load_for_sampling, d, base)
            if sid in self.samplers or source in self._loaded:  # a retry or a twin got there while it loaded
                await asyncio.to_thread(self.node.unload, adapter)
            else:
                self._loaded[source] = (adapter, set())
        if sid in self.samplers:
            return sid
        adapter, users = self._loaded[source]
        users.add(sid)
        self.samplers[sid] = Sampler(sid, meta["base_model"], req.model_path, adapter, None, s.session_id, s.owner,
                                     source)
        return sid

    def sample(self, req: types.SampleRequest) -> tuple[str, list[str]]:
        s = self.sampler(req.sampling_session_id)
        chunks = getattr(req.prompt, "chunks", None) or []
        kinds = sorted({getattr(c, "type", type(c).__name__) for c in chunks} - {"encoded_text"})
        if kinds:
            raise Invalid(f"prompt holds {', '.join(kinds)} chunks; this service samples text (encoded_text) only",
                          "prompt.chunks")
        call = self._sample_call(s, req)
        self._check_rows(call, self.node.info(self._sampler_base(s)))
        ids = [f"{req.sampling_session_id}:{req.seq_id}:{i}" for i in range(req.num_samples)]

        async def work() -> Result:
            conn = s.trainer.conn if s.trainer else self.node.connection(s.adapter, self._sampler_base(s))
            answer = await self.batcher.sample(conn, call)
            return Proto(wire.encode_sample(*_sequences(answer, req)))
        return self.futures.run(work), ids

    def _check_rows(self, call: M.SampleCall, info: dict[str, Any]) -> None:
        """Refuse, before it can share a batch with anyone, a call the worker cannot run: a token
        outside the vocabulary, or a prompt that with `max_tokens` overflows the context."""
        vocab, context = info.get("vocab_size"), info.get("max_context")
        for prompt in call.prompts:
            if not prompt:
                raise Invalid("prompt is empty: sampling needs at least one token", "prompt")
            if vocab is not None:
                bad = next((t for t in prompt if not 0 <= t < vocab), None)
                if bad is not None:
                    raise Invalid(f"prompt has token id {bad}, outside the vocabulary [0, {vocab})", "prompt")
            if context is not None and len(prompt) + call.max_new_tokens > context:
                raise Invalid(f"prompt has {len(prompt)} tokens and sampling_params.max_tokens is "
                              f"{call.max_new_tokens}: {len(prompt) + call.max_new_tokens} is beyond the model's "
                              f"context of {context}", "sampling_params.max_tokens")

    def _sample_call(self, s: Sampler, req: types.SampleRequest) -> M.SampleCall:
        p = req.sampling_params
        prompt = req.prompt.to_ints() if hasattr(req.prompt, "to_ints") else list(req.prompt)
        if req.prompt_alt_tokens_k:
            raise Invalid("prompt_alt_tokens_k is not supported by this service", "prompt_alt_tokens_k")
        if not 1 <= req.num_samples <= 256:
            raise Invalid(f"num_samples must be 1..256, got {req.num_samples}", "num_samples")
        # the prompt's scores come from one forward over it on the worker, whatever num_samples
        scoring = wire.prompt_scoring(req, prompt, self.node.info(self._sampler_base(s)).get("vocab_size"))
        stop = p.stop if isinstance(p.stop, list) else ([p.stop] if p.stop else [])
        return M.SampleCall(adapter=s.adapter, prompts=[prompt], max_new_tokens=int(p.max_tokens or 16),
                            temperature=float(p.temperature), top_k=0 if p.top_k in (None, -1) else int(p.top_k),
                            top_p=float(p.top_p), stop=[x for x in stop if isinstance(x, str)],
                            stop_token_ids=[x for x in stop if isinstance(x, int)], seed=p.seed,
                            num_samples=int(req.num_samples), prompt_scoring=[scoring] if scoring else [],
                            top_logprobs=wire.topk_width(req.topk_sample_logprobs, "topk_sample_logprobs"))

    # -- persistence ------------------------------------------------------------------------
    def _save_meta(self, m: Model) -> None:
        catalog.write_run(self.home, m.meta())

    def checkpoint_meta(self, model_id: str, d: Path) -> dict[str, Any]:
        """The training client's metadata as checkpoint `d` of `model_id` recorded it at save
        (base, LoRA shape, user metadata), else as the service keeps it for that model."""
        return json.loads((d / "record.json").read_text()).get("tinker") or self._meta(model_id)

    def _meta(self, model_id: str) -> dict[str, Any]:
        """The metadata of training run `model_id`, which the caller owns."""
        meta = self.models[model_id].meta() if model_id in self.models else catalog.read_run(self.home, model_id)
        if meta is None or meta.get("owner", tenancy.LOCAL) != tenancy.current():
            raise NotFound(f"training run {model_id!r} is unknown to this service", "training_run_id")
        return meta


REAP_TRIES = 3
"""Passes of the session reaper that try to finish one expired session before it gives up on it."""

_RUN_STATUS = {"success": "finished", "errored": "failed", "interrupted": "killed", "expired": "killed"}
"""A session's finish reason as its runs' MLflow status."""


def _saved_steps(record: dict[str, Any], default: int) -> int:
    """The optimizer steps a loaded checkpoint's client had taken: as this service recorded them
    at save (`tinker.steps`), else the learner's own count."""
    return int((record.get("tinker") or {}).get("steps", record.get("learner_steps", default)))


def _checkpoint(entry: dict[str, Any] | None) -> types.Checkpoint | None:
    return None if entry is None else types.Checkpoint.model_validate(entry)


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _datum(d: wire.TinkerDatum, i: int, loss: TinkerLoss, vocab: int | None, max_context: int | None) -> Datum:
    if max_context is not None and len(d.tokens) > max_context:
        raise Invalid(f"data[{i}].model_input has {len(d.tokens)} tokens, beyond the model's context of "
                      f"{max_context}", f"data[{i}].model_input")
    if vocab is not None:
        targets = d.inputs["target_tokens"].tolist()
        bad = next((t for t in (*d.tokens, *targets) if not 0 <= t < vocab), None)
        if bad is not None:
            where = "model_input" if bad in d.tokens else "loss_fn_inputs.target_tokens"
            raise Invalid(f"data[{i}].{where} has token id {bad}, outside the vocabulary [0, {vocab})",
                          f"data[{i}].{where}")
    return datum_from_tinker(d.tokens, d.inputs, loss=loss, datum_index=i)


def _sequences(answer: Answer, req: types.SampleRequest) -> tuple:
    """`wire.encode_sample`'s arguments: the samples, and what the request asked of its prompt,
    position by position (None where a position was not scored: the first, those before
    `prompt_logprobs_last_n`)."""
    k = req.topk_sample_logprobs
    seqs = [wire.Sequence(list(s.tokens), list(s.logprobs), s.stop_reason != "length",
                          wire.TopKRows(list(s.top_logprobs), k) if k else None) for s in answer.samples]
    scores = answer.prompt_scores[0] if answer.prompt_scores else None
    if scores is None:
        return seqs, None
    unscored = [None] * scores.first
    prompt_lp = unscored + list(scores.logprobs) if req.prompt_logprobs else None
    topk = wire.TopKRows(unscored + list(scores.topk), req.topk_prompt_logprobs) if req.topk_prompt_logprobs else None
    targets = (req.target_prompt_logprobs, scores.targets) if req.target_prompt_logprobs is not None else None
    return seqs, prompt_lp, topk, targets
