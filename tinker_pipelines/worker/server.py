"""The worker process: a Unix socket, one thread per client, one compute thread.

Clients authenticate with the HMAC challenge of `multiprocessing.connection` (an auth key kept
in a 0600 file beside the 0600 socket); the handshake runs in the client's own thread with a
deadline, so a silent or unauthenticated client never blocks the others. The compute thread
takes the first pending request, then waits up to `window_s` for every other connected client
to have one pending too (Tinker's clock cycle): the `sample` calls of that cycle decode as one
mixed-adapter batch and its `forward_backward` calls share base passes (`Engine`). With
`TINKER_WORKER_TRACE=1` in its environment the worker logs each cycle's duration and requests,
and its resident memory after the cycle and at its peak so far, glibc's heap and its size when last
given back (`training/allocator.HeapGrowth`), in MB.

Experiments drift out of step: once one trains while another samples, every later cycle mixes a
few samples with other clients' training calls, and the mixed batches stay small (`benchmarks.
multi_lora`'s trace: two samples per cycle of four clients). So a cycle that has both `sample`
calls and other clients' other calls runs the others and holds its samples (`hold_s`): the next
cycle waits up to `hold_s` for those clients' next calls, and their samples join the held ones
in one batch. A sample is held only in a cycle that has other work to run, at most
`MAX_HOLDS` cycles, and only while it would still run within `MAX_HELD_S` of its first hold if
the cycle it waits for lasts as long as the last one with other work did: cycles of other
clients' training can be long (on a busy CPU, 10-20 s for eight SmolLM2 tenants), and a sample
held for one waits all of it. Each wait after such a cycle leaves the device idle for `hold_s` at
most. The
numbers are the same either way (each row's samples do not depend on its batch). A cycle runs
its samples first and answers them before its training calls run, so a sample's latency is its
own decode, not the cycle's.
"""

from __future__ import annotations

import collections
import errno
import gc
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import AuthenticationError, Listener, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

import msgspec

from tinker_pipelines.rollout.samples import Sample
from tinker_pipelines.training.allocator import heap_bytes
from tinker_pipelines.worker import messages as M
from tinker_pipelines.worker.engine import Engine, RequestError, resident_mb
from tinker_pipelines.worker.messages import Op

HANDSHAKE_TIMEOUT_S = 10.0


def key_path(address: str | Path) -> Path:
    """Where the auth key of the worker at `address` is kept."""
    return Path(f"{address}.key")


LISTEN_BACKLOG = 256
"""Connections the worker's socket queues before `accept` (multiprocessing's default is 1)."""
MAX_HOLDS = 4
"""Most cycles a `sample` call is held for other clients' samples to join it."""
MAX_HELD_S = 5.0
"""A `sample` call is held only while it would still run within this long of its first hold,
with the cycle it waits for lasting as long as the last cycle of other work did."""
_NOT_WORK = (Op.SHUTDOWN, Op.STATS)
"""Requests that do not mean their client will sample soon: they never hold samples."""
_BATCHED = (Op.SAMPLE, Op.FORWARD_BACKWARD)
"""Ops whose concurrent calls of several clients run together (`Engine.sample` / `forward_backward`)."""
_BATCHED_WITH = {Op.TINKER_FORWARD_BACKWARD: Op.FORWARD_BACKWARD}
"""Ops whose calls join another op's batch (Tinker's forward_backward shares passes with ours)."""


@dataclass
class _Item:
    client: int
    request: M.Request | None
    """The client's request; None: the client went away (its adapters are dropped)."""
    reply: M.Reply | None = None
    done: threading.Event = field(default_factory=threading.Event)
    holds: int = 0
    held_since: float | None = None
    """When a cycle first held it (monotonic)."""


class WorkerServer:
    """Serves one `Engine` on a Unix socket until `stop()` (or SIGTERM / SIGINT)."""

    def __init__(self, engine: Engine, address: str | Path, authkey: bytes | None = None, window_s: float = 0.02,
                 log=sys.stderr, hold_s: float = 0.25):
        self.engine, self.address, self.window_s, self.log = engine, str(address), window_s, log
        self.hold_s = hold_s
        self.cycles: collections.deque[tuple[str, ...]] = collections.deque(maxlen=1000)
        """The ops of the latest cycles, in order (what `TINKER_WORKER_TRACE` prints)."""
        self.held: collections.Counter[str] = collections.Counter()
        """Cycles each sample call was held for, by its label (`sample:ADAPTER`)."""
        self.authkey = authkey or secrets.token_bytes(32)
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._clients: set[int] = set()
        self._next_client = 0
        self._stopping = threading.Event()
        self._signalled = False
        self._work_cycle_s = 0.0
        """How long the latest cycle with other work than samples took (what a held sample waits)."""
        self._listener: Listener | None = None
        self._batched = {Op.SAMPLE: engine.sample, Op.FORWARD_BACKWARD: engine.forward_backward}
        self._handlers = self._handler_table()
        missing = set(Op) - {Op.HELLO} - set(self._batched) - set(_BATCHED_WITH) - set(self._handlers)
        if missing:  # an op declared in `messages` that nothing here serves
            raise TypeError(f"worker ops without a handler: {sorted(o.value for o in missing)}")

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        path, key = Path(self.address), key_path(self.address)
        problem = socket_path_problem(path)
        if problem:
            raise OSError(errno.EADDRINUSE if "listens" in problem else errno.EEXIST, problem)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # an existing directory keeps its mode
        for stale in (path, key):  # of a dead worker (a live one accepted above)
            if stale.is_symlink() or stale.exists():
                stale.unlink()
        old_umask = os.umask(0o077)  # bind() creates the socket owner-only: no moment where others may connect
        try:
            # a deep backlog: after a restart every client reconnects at once, and a Unix socket
            # whose backlog is full refuses a connect outright (EAGAIN) instead of queueing it
            self._listener = Listener(self.address, family="AF_UNIX", backlog=LISTEN_BACKLOG)
            os.chmod(path, 0o600)
            # O_EXCL | O_NOFOLLOW: never write through a link planted at the key's path (a shared directory)
            # after the unlink above; starting fails instead.
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as f:
                f.write(self.authkey)
        finally:
            os.umask(old_umask)
        threading.Thread(target=self._compute_loop, name="worker-compute", daemon=True).start()
        threading.Thread(target=self._accept_loop, name="worker-accept", daemon=True).start()

    def serve_forever(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # The base model and the libraries live as long as the worker: out of the collector's full
        # passes, which otherwise walk their ~0.4M objects again and again (~0.1 s each, mid-request)
        gc.collect()
        gc.freeze()
        self.start()
        print(f"worker ready: socket={self.address} base={self.engine.base} device={self.engine.device} "
              f"batching={'on' if self.engine.cfg.batching else 'off'}", flush=True)
        try:
            while not (self._signalled or self._stopping.wait(0.5)):
                pass
        finally:
            self.stop()

    def _on_signal(self, signum: int, frame: object) -> None:
        """SIGTERM / SIGINT: the serving loop stops within its next wake-up. A handler runs in the
        main thread between any two of its bytecodes, possibly while that thread holds the lock
        of `_stopping` (inside `Event.wait`), so it takes no lock: `stop()` here deadlocked the
        worker (it then outlived its killed service)."""
        self._signalled = True

    def stop(self) -> None:
        if self._stopping.is_set() and self._listener is None:
            return
        self._stopping.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()  # unlinks the socket
        for p in (Path(self.address), key_path(self.address)):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    # -- clients ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn = self._listener.accept()  # type: ignore[union-attr]
            except (OSError, AttributeError):
                return
            self._next_client += 1
            threading.Thread(target=self._serve_client, args=(conn, self._next_client), daemon=True).start()

    def _serve_client(self, conn, client: int) -> None:
        problem = self._greet(conn)
        if problem is None:  # gone, refused, or cut off by the deadline
            conn.close()
            return
        if problem:
            _send(conn, M.Error("ProtocolError", problem))
            conn.close()
            return
        e = self.engine
        _send(conn, M.HelloReply(M.SCHEMA, e.base, str(e.device), str(e.dtype).removeprefix("torch."),
                                 e.cfg.batching, list(e.stop_token_ids), e.pad_token_id, os.getpid(),
                                 e.sampler.max_context, e.model.get_output_embeddings().weight.shape[0]))
        self._clients.add(client)
        try:
            while True:
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    break
                try:
                    request = M.decode_request(data)
                except M.BadMessage as exc:  # refused alone: this client may go on, the others never notice
                    if not _send(conn, M.Error("ProtocolError", str(exc))):
                        break
                    continue
                item = _Item(client, request)
                self._queue.put(item)
                item.done.wait()
                if not _send(conn, item.reply):
                    break  # the client went away mid-call; the others are untouched
        finally:
            self._clients.discard(client)
            conn.close()
            self._queue.put(_Item(client, None))

    def _greet(self, conn) -> str | None:
        """Authenticate a new client and read its hello, within the handshake deadline: None
        when it went away or was refused, else why its hello is not served ('' when it is).
        Closing a connection does not wake a thread blocked reading it; shutting its socket down does."""
        deadline = threading.Timer(HANDSHAKE_TIMEOUT_S, _cut, args=(conn,))
        deadline.start()
        try:
            try:
                deliver_challenge(conn, self.authkey)
                answer_challenge(conn, self.authkey)
            except (AuthenticationError, OSError, EOFError, ValueError) as e:
                print(f"worker: refused a client ({type(e).__name__}: {e})", file=self.log, flush=True)
                return None
            try:
                data = conn.recv_bytes()
            except (OSError, EOFError, TypeError):  # gone, or cut off by the deadline (a closed handle)
                return None
        finally:
            deadline.cancel()
        return _hello_problem(data)

    # -- compute ----------------------------------------------------------------------------
    def _compute_loop(self) -> None:
        held: list[_Item] = []
        expected: set[int] = set()
        while True:
            if held:  # wait for the clients that were busy with other calls, up to hold_s
                batch, window = held, self.hold_s
            else:  # wait for every connected client, up to window_s
                batch, window, expected = [self._queue.get()], self.window_s, set()
            if self.engine.cfg.batching:
                deadline = time.monotonic() + window
                # (a client that went away meanwhile is not waited for)
                while not ((expected or self._clients) & self._clients) <= {i.client for i in batch}:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        batch.append(self._queue.get(timeout=remaining))
                    except queue.Empty:
                        break
            held, expected = self._hold(batch)
            batch = [i for i in batch if all(i is not h for h in held)]
            try:
                t0 = time.perf_counter()
                with self.engine.lock:
                    self._run(batch)
                ops = tuple(_label(i) for i in batch)
                if any(_op(i) not in (None, Op.SAMPLE, *_NOT_WORK) for i in batch):
                    self._work_cycle_s = time.perf_counter() - t0
                self.cycles.append(ops)
                if os.environ.get("TINKER_WORKER_TRACE"):
                    rss, peak = resident_mb()
                    print(f"worker: {time.perf_counter() - t0:.3f}s {','.join(ops)}"
                          + (f" (holding {len(held)} samples)" if held else "")
                          + f" rss {rss:.0f} peak {peak:.0f} heap {heap_bytes() >> 20}"
                          f" (released at {self.engine.heap.mark >> 20})", file=self.log, flush=True)
            except Exception as e:  # a bug must not kill the worker: report it to the callers
                traceback.print_exc(file=self.log)
                for item in batch:
                    if item.reply is None:
                        item.reply = M.error_reply(e)
            for item in batch:
                if item.reply is None and item.request is not None:  # a handler that replied nothing: a bug
                    item.reply = M.Error("RuntimeError", f"worker bug: no reply to {_label(item)}")
                item.done.set()

    def _hold(self, batch: list[_Item]) -> tuple[list[_Item], set[int]]:
        """The `sample` calls of `batch` to hold for a later cycle, and the clients whose next
        calls the hold waits for: those with other work in this cycle (none when batching is off,
        `hold_s` is 0, or the cycle has no other work)."""
        if not (self.engine.cfg.batching and self.hold_s > 0):
            return [], set()
        others = {i.client for i in batch if i.request is not None and M.op_of(i.request) not in (Op.SAMPLE, *_NOT_WORK)}
        now = time.monotonic()
        held = [i for i in batch if _op(i) == Op.SAMPLE and i.holds < MAX_HOLDS and i.client not in others
                and (0.0 if i.held_since is None else now - i.held_since) + self._work_cycle_s < MAX_HELD_S]
        if not (held and others):
            return [], set()
        for i in held:
            i.holds += 1
            self.held[_label(i)] += 1
            i.held_since = now if i.held_since is None else i.held_since
        return held, others

    def _run(self, batch: list[_Item]) -> None:
        e = self.engine
        expired = e.expire_parked()
        if expired:
            print(f"worker: dropped parked adapters nobody claimed in {e.cfg.park_ttl_s:g} s: {', '.join(expired)}",
                  file=self.log, flush=True)
        for item in batch:
            if isinstance(item.request, M.SampleCall) and not item.request.adapter:
                continue  # the bare base: anyone may sample it
            if isinstance(item.request, M.AdapterRequest):
                try:
                    self._check_owner(item.client, item.request.adapter)
                except RequestError as exc:
                    item.reply = M.error_reply(exc)
        for op in _BATCHED:
            items = [i for i in batch if _BATCHED_WITH.get(_op(i), _op(i)) == op and i.reply is None]
            if items:
                for item, reply in zip(items, self._batched[op]([_engine_call(i.request) for i in items])):
                    item.reply = (M.Error(reply["error"], reply["message"], reply.get("field", "")) if "error" in reply
                                  else _reply(_op(item), reply))
                    # answered now, not at the cycle's end: a sample need not wait for the
                    # training calls that follow it in this cycle (the next call joins a later one)
                    item.done.set()
        for item in batch:
            if item.reply is not None:
                continue
            if item.request is None:
                self._disconnected(item.client)
                continue
            try:
                item.reply = self._handlers[M.op_of(item.request)](item.client, item.request)
            except (RequestError, ValueError, KeyError, TypeError, FloatingPointError, RuntimeError,
                    FileNotFoundError) as exc:
                item.reply = M.error_reply(exc)

    def _disconnected(self, client: int) -> None:
        dropped = self.engine.drop_owned(client)
        if dropped:
            print(f"worker: client {client} went away; dropped {', '.join(dropped)}", file=self.log, flush=True)

    def _handler_table(self) -> dict[Op, Any]:
        """The handler of every op that runs one call at a time: (client id, request) -> reply.
        The owner of an `AdapterRequest`'s adapter was checked before (`_run`)."""
        e = self.engine

        def learner(r: M.AdapterRequest):
            return e.get(r.adapter).learner

        def park(c: int, r: M.Park) -> M.Reply:
            e.park(r.adapter, r.tag)
            return M.ParkReply()

        def drop(c: int, r: M.Drop) -> M.Reply:
            e.drop(r.adapter)
            return M.DropReply()

        def shutdown(c: int, r: M.Shutdown) -> M.Reply:
            threading.Thread(target=self.stop, daemon=True).start()  # after this reply is sent
            return M.ShutdownReply()

        return {
            Op.CREATE: lambda c, r: M.CreateReply(**e.create(c, r.name, r.learner, r.seed, r.base_name,
                                                              r.algorithm, r.claim)),
            Op.CREATE_SAMPLER: lambda c, r: M.CreateSamplerReply(e.create_sampler(c, r.name, r.path, r.base_name)),
            Op.COPY_ADAPTER: lambda c, r: M.CopyAdapterReply(**e.copy_adapter(c, r.adapter, r.name)),
            Op.PARK: park,
            Op.DROP: drop,
            Op.STATS: lambda c, r: M.StatsReply(e.stats()),
            Op.SHUTDOWN: shutdown,
            Op.OPTIM_STEP: lambda c, r: M.OptimStepReply(e.trainable(r.adapter).optim_step() if r.adam is None
                                                          else e.trainable(r.adapter).optim_step(r.adam)),
            Op.COMPUTE_LOGPROBS: lambda c, r: M.ComputeLogprobsReply(learner(r).compute_logprobs(M.datums_of(r.datums))),
            Op.COMPUTE_REFERENCE_LOGPROBS: lambda c, r: M.ComputeReferenceLogprobsReply(
                learner(r).compute_reference_logprobs(M.datums_of(r.datums))),
            Op.COMPUTE_VALUES: lambda c, r: M.ComputeValuesReply(learner(r).compute_values(M.datums_of(r.datums))),
            Op.SAVE_STATE: lambda c, r: M.SaveStateReply(e.save_state(
                r.adapter, r.path, r.record, {k: t.to_torch() for k, t in (r.extra_rng or {}).items()})),
            Op.LOAD_STATE: lambda c, r: M.LoadStateReply(e.load_state(r.adapter, r.path, r.optimizer)),
            Op.VERIFY_CHECKPOINT: lambda c, r: M.VerifyCheckpointReply(
                **learner(r).verify_checkpoint(r.path, r.probe_tokens)),
        }

    def _check_owner(self, client: int, name: str) -> None:
        h = self.engine.get(name)
        if h.parked is not None:
            raise RequestError(f"adapter {name!r} is parked on this worker: create it with its state tag to claim it")
        if h.owner != client:
            raise RequestError(f"adapter {name!r} belongs to another client of this worker")


def _hello_problem(data: bytes) -> str:
    """Why a client's first message is not a hello this worker can serve ('' when it is)."""
    try:
        hello = M.decode_hello(data)
    except M.BadMessage as e:
        return f"the first message must be a hello {{op: 'hello', schema: {M.SCHEMA!r}}} ({e})"
    if hello.schema != M.SCHEMA:
        return (f"client speaks worker protocol schema {hello.schema!r}, this worker speaks {M.SCHEMA!r} "
                "(run client and worker from the same tinker-pipelines version)")
    return ""


def _op(item: _Item) -> Op | None:
    return None if item.request is None else M.op_of(item.request)


def _label(item: _Item) -> str:
    """How a cycle's trace names a request: op:adapter."""
    r = item.request
    if r is None:
        return "disconnected:"
    return f"{M.op_of(r).value}:{r.adapter if isinstance(r, M.AdapterRequest) else getattr(r, 'name', '')}"


def _engine_call(r: M.Request) -> dict[str, Any]:
    """A batched request as `Engine.sample` / `forward_backward` take it."""
    call = msgspec.structs.asdict(r)
    if isinstance(r, (M.ForwardBackward, M.TinkerForwardBackward)):
        call["datums"] = M.datums_of(r.datums)
    return call


def _reply(op: Op, out: dict[str, Any]) -> M.Reply:
    """The reply struct of an `Engine` batched call's result."""
    if op == Op.SAMPLE:
        return M.SampleReply([Sample(tuple(t), tuple(lp), r, s, tuple(n), tuple(tuple(map(tuple, a)) for a in top))
                              for t, lp, r, s, n, top in out["samples"]],
                             out["generator_state"], out.get("prompt_logprobs"), out.get("prompt_scores"))
    if op == Op.TINKER_FORWARD_BACKWARD:
        return M.TinkerForwardBackwardReply(out["logprobs"], out["metrics"])
    return M.ForwardBackwardReply(out["metrics"])


def _cut(conn) -> None:
    """Shut a connection's socket down, so that a thread blocked reading it gets end-of-file."""
    try:
        s = socket.socket(fileno=os.dup(conn.fileno()))
    except (OSError, ValueError, TypeError):  # closed already
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


def socket_path_problem(path: Path) -> str:
    """Why a worker may not listen at `path` ('' when it may): another worker listens there, or
    something that is not a socket is in the way (a dead worker's socket is replaced)."""
    if path.is_symlink() or (path.exists() and not path.is_socket()):
        return "something that is not a worker's socket is there; refusing to replace it"
    if listening(path):
        return "a worker already listens there (stop it, or choose another --socket)"
    return ""


def listening(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket at `path`."""
    if not path.is_socket():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2.0)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def _send(conn, message: M.Reply) -> bool:
    try:
        conn.send_bytes(M.encode(message))  # msgpack: `conn.send` would pickle
        return True
    except (OSError, ValueError):
        return False
