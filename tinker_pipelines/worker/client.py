"""Thin clients of a resident worker: `WorkerClient`, `RemoteLearner`, `RemoteSampler`.

`RemoteLearner` implements `training.interface.TrainingClient` and `RemoteSampler` has the
methods of `Sampler` that an `Experiment` uses, so the same experiment code trains in-process or on a worker; with batching
off, the worker computes exactly what the in-process engine does (same metrics, tested).
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch

from tinker_pipelines.algorithms.losses import LossConfig, LossFn
from tinker_pipelines.algorithms.registry import ALGORITHMS
from tinker_pipelines.algorithms.tinker_losses import TinkerLoss, TinkerLossError
from tinker_pipelines.training.learner import LearnerConfig
from tinker_pipelines.rollout.sampler import ContextOverflowError, Sample
from tinker_pipelines.types import Datum
from tinker_pipelines.worker import WorkerDiedError, WorkerError, WorkerLost, WorkerTimeout
from tinker_pipelines.worker import messages as M
from tinker_pipelines.worker.server import key_path


CONNECT_TIMEOUT_S = 30.0
"""Bound on each step of connecting to a worker (the socket's connect, the auth handshake, the
hello): a stopped (SIGSTOP) worker's socket still accepts, and then nothing ever answers."""


class ClosedConnection(WorkerDiedError):
    """A call on a connection this client closed itself (`WorkerClient.close`)."""


class WorkerClient:
    """One authenticated connection to the worker at `address` (a Unix socket path), with one
    typed method per op (`messages.Op`); each sends the op's request struct and returns what
    its reply carries. Errors name the worker and the experiment (the request's adapter).

    `timeout_s` bounds each call (sending it, then waiting for its answer; None: no bound): past
    it the call raises `WorkerTimeout` and the connection is closed. A connection whose worker
    went away or timed out stays broken: every later call raises at once."""

    def __init__(self, address: str | Path, authkey: bytes | None = None, timeout_s: float | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.address = str(address)
        self.timeout_s = timeout_s
        self.explain: Callable[[str, WorkerDiedError], str | None] | None = None
        """Set by whoever watches the worker (the Tinker runtime): given what was being done and the
        transport error, what happened to the worker and what the caller can do (raised as
        `WorkerLost`), or None to raise the transport error as it is."""
        self.broken: WorkerDiedError | None = None
        """Why this connection can no longer be used (None while it can)."""
        try:
            self.conn = _connect(self.address, authkey if authkey is not None else _authkey(self.address),
                                 connect_timeout_s)
        except (FileNotFoundError, ConnectionRefusedError):
            raise WorkerError(f"no worker listening at {self.address} (start one with `tinker-pipelines worker`)") from None
        except AuthenticationError:
            raise WorkerError(f"the worker at {self.address} refused this client's auth key") from None
        except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO / SO_SNDTIMEO, or the connect's own timeout
            raise WorkerTimeout(f"the worker at {self.address} did not complete the connection handshake within "
                                f"{connect_timeout_s:g} s (stopped or hung)") from None
        except (EOFError, OSError) as e:
            raise WorkerDiedError(f"the worker at {self.address} hung up during the connection handshake "
                                  f"({type(e).__name__})") from None
        self._lock = threading.Lock()
        self.hello: M.HelloReply = self._send(M.Hello(M.SCHEMA), connect_timeout_s)  # type: ignore[assignment]
        self.info: dict[str, Any] = msgspec.structs.asdict(self.hello)
        """The worker's hello (`messages.HelloReply`) as a dict: base, device, dtype, limits."""
        _set_timeouts(self.conn, self.timeout_s)  # the handshake's bound is over; a call's is `timeout_s`

    def send(self, request: M.Request) -> M.Reply:
        """Send one request and wait for its reply struct; a refusal raises `WorkerError` (or
        `ContextOverflowError`) naming the worker, the op and the experiment; a worker that went
        away or gave no answer within `timeout_s` raises `WorkerDiedError` / `WorkerTimeout` (or
        `WorkerLost`, as `explain` words it)."""
        return self._send(request, self.timeout_s)

    def _send(self, request: M.Request, timeout_s: float | None) -> M.Reply:
        op = M.op_of(request)
        experiment = getattr(request, "adapter", "") or getattr(request, "name", "")
        about = f"{op.value}{f' of experiment {experiment!r}' if experiment else ''}"
        data, failed = b"", self.broken
        with self._lock:
            if failed is None:
                data, failed = self._exchange(request, about, timeout_s)
        if failed is not None:  # explained outside the lock: `explain` may wait for the worker's verdict
            raise self._lost(about, failed)
        try:
            reply = M.decode_reply(op, data)
        except M.BadMessage as e:
            raise WorkerError(f"worker {self.address}: {about}: unreadable reply ({e})") from None
        if isinstance(reply, M.Error):
            msg = f"worker {self.address}: {op.value}{f' for experiment {experiment!r}' if experiment else ''}: " \
                  f"{reply.message}"
            if reply.error == "TinkerLossError":  # the service answers it as the request's own error
                raise TinkerLossError(reply.message, reply.field)
            raise ContextOverflowError(msg) if reply.error == "context_overflow" else WorkerError(msg)
        return reply

    def _exchange(self, request: M.Request, about: str,
                  timeout_s: float | None) -> tuple[bytes, WorkerDiedError | None]:
        """One request and its answer's bytes, or the transport error (the connection is then broken)."""
        if self.broken is not None:  # broken while this call waited for the lock
            return b"", self.broken
        try:
            self.conn.send_bytes(M.encode(request))  # msgpack: `conn.send` would pickle
            if timeout_s is not None and not self.conn.poll(timeout_s):
                raise BlockingIOError
            return self.conn.recv_bytes(), None
        except BlockingIOError:  # no answer in time, or (SO_RCVTIMEO / SO_SNDTIMEO) a read or write stalled
            failed: WorkerDiedError = WorkerTimeout(f"worker {self.address} gave no answer to {about} within "
                                                    f"{timeout_s:g} s")
        except (EOFError, OSError) as e:
            failed = WorkerDiedError(f"worker {self.address} went away during {about} ({type(e).__name__})")
        self.broken = failed
        self.close()  # a late answer must never be read as the next call's; a live worker drops what we held
        return b"", failed

    def _lost(self, about: str, failed: WorkerDiedError) -> WorkerDiedError:
        message = self.explain(about, failed) if self.explain is not None else None
        return WorkerLost(message) if message else failed

    # -- one method per op ------------------------------------------------------------------
    def create(self, name: str, learner: dict[str, Any], seed: int, base_name: str = "", algorithm: str = "",
               claim: str | None = None) -> M.CreateReply:
        return self.send(M.Create(name, learner, seed, base_name, algorithm, claim))  # type: ignore[return-value]

    def create_sampler(self, name: str, path: str | Path, base_name: str = "") -> dict[str, Any]:
        """Host the weights of LoRA checkpoint `path` as read-only adapter `name` (sampling and
        scoring only), shaped as its record says; returns the checkpoint's record."""
        return self.send(M.CreateSampler(name, str(Path(path).resolve()), base_name)).record  # type: ignore[attr-defined]

    def copy_adapter(self, adapter: str, name: str) -> int:
        """Host read-only adapter `name`, an in-memory copy of `adapter`'s LoRA weights as they
        are now (sampling and scoring only; later steps of `adapter` leave it unchanged), held
        by this connection; returns the optimizer steps the copied weights have had."""
        return self.send(M.CopyAdapter(adapter, name)).steps  # type: ignore[attr-defined]

    def park(self, adapter: str, tag: str) -> None:
        self.send(M.Park(adapter, tag))

    def drop(self, adapter: str) -> None:
        self.send(M.Drop(adapter))

    def stats(self) -> dict[str, Any]:
        return self.send(M.Stats()).stats  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        self.send(M.Shutdown())

    def sample(self, request: M.SampleCall) -> M.SampleReply:
        return self.send(request)  # type: ignore[return-value]

    def forward_backward(self, adapter: str, datums: list[Datum], algorithm: str,
                         loss_cfg: dict[str, Any]) -> dict[str, float]:
        return self.send(M.ForwardBackward(adapter, M.wire_datums(datums), algorithm, loss_cfg)).metrics  # type: ignore[attr-defined]

    def tinker_forward_backward(self, adapter: str, datums: list[Datum], loss: str, loss_config: dict[str, float],
                                forward_only: bool) -> tuple[list[list[float]], dict[str, float]]:
        """Tinker's `forward_backward` (`forward_only`: its forward, no gradient work) over
        `datum_from_tinker`'s datums: each datum's target logprobs and the metrics (`loss:sum`).
        A bad loss name, config or datum raises `TinkerLossError` with its field."""
        reply = self.send(M.TinkerForwardBackward(adapter, M.wire_datums(datums), loss, dict(loss_config),
                                                  forward_only))
        return reply.logprobs, reply.metrics  # type: ignore[attr-defined]

    def optim_step(self, adapter: str, adam: dict[str, float] | None = None) -> dict[str, float]:
        """Apply the adapter's gradient; `adam` (Tinker's AdamParams) sets its optimizer for this step."""
        return self.send(M.OptimStep(adapter, None if adam is None else dict(adam))).metrics  # type: ignore[attr-defined]

    def compute_logprobs(self, adapter: str, datums: list[Datum]) -> list[list[float]]:
        return self.send(M.ComputeLogprobs(adapter, M.wire_datums(datums))).values  # type: ignore[attr-defined]

    def compute_reference_logprobs(self, adapter: str, datums: list[Datum]) -> list[list[float]]:
        return self.send(M.ComputeReferenceLogprobs(adapter, M.wire_datums(datums))).values  # type: ignore[attr-defined]

    def compute_values(self, adapter: str, datums: list[Datum]) -> list[list[float]]:
        return self.send(M.ComputeValues(adapter, M.wire_datums(datums))).values  # type: ignore[attr-defined]

    def save_state(self, adapter: str, path: str, record: dict[str, Any] | None = None,
                   extra_rng: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        rng = None if extra_rng is None else {k: M.Tensor.from_torch(t) for k, t in extra_rng.items()}
        return self.send(M.SaveState(adapter, path, record, rng)).record  # type: ignore[attr-defined]

    def load_state(self, adapter: str, path: str, optimizer: bool = True) -> dict[str, Any]:
        """Restore the adapter from a checkpoint; `optimizer=False`: its weights only."""
        return self.send(M.LoadState(adapter, path, optimizer)).record  # type: ignore[attr-defined]

    def verify_checkpoint(self, adapter: str, path: str, probe_tokens: list[int]) -> dict[str, Any]:
        return msgspec.structs.asdict(self.send(M.VerifyCheckpoint(adapter, path, list(probe_tokens))))

    def close(self) -> None:
        if self.broken is None:
            self.broken = ClosedConnection(f"the connection to worker {self.address} was closed by this client")
        try:
            self.conn.close()
        except OSError:
            pass


def _authkey(address: str | Path) -> bytes:
    env = os.environ.get("TINKER_WORKER_KEY")
    try:
        return bytes.fromhex(env) if env else key_path(address).read_bytes()
    except FileNotFoundError:
        raise WorkerError(f"no worker at {address}: its key file {key_path(address)} is missing "
                          "(start one with `tinker-pipelines worker`)") from None


def _connect(address: str, authkey: bytes, timeout_s: float) -> Connection:
    """`multiprocessing.connection.Client(address, authkey=...)`, with every step bounded by
    `timeout_s`: the socket's own timeout for the connect, SO_RCVTIMEO / SO_SNDTIMEO (a read or
    write that waits longer fails with EAGAIN, `BlockingIOError`) for the handshake."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout_s)
            try:
                s.connect(address)
            except BlockingIOError:  # the socket's backlog is full (a Unix socket does not queue the connect)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
                continue
            s.settimeout(None)  # blocking again: `Connection` reads and writes the descriptor itself
            conn = Connection(s.detach())
            break
        finally:
            s.close()
    try:
        _set_timeouts(conn, timeout_s)
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


def _set_timeouts(conn: Connection, timeout_s: float | None) -> None:
    """Bound each read and write on `conn`'s socket by `timeout_s` (None or 0: no bound)."""
    seconds = max(0.0, timeout_s or 0.0)
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))
    s = socket.socket(fileno=os.dup(conn.fileno()))  # the same socket: its options are the connection's
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    finally:
        s.close()


def probe(address: str | Path, timeout_s: float = 2.0) -> str | None:
    """None when the worker at `address` answers, else why not (one line): a connection and its
    auth handshake must complete within `timeout_s`. It hangs up before the hello, so the worker
    registers no client and its compute thread never hears of it; the handshake runs in the
    worker's accept and client threads, so a long training step does not slow the answer."""
    try:
        conn = _connect(str(address), _authkey(address), timeout_s)
    except WorkerError as e:
        return str(e)
    except (FileNotFoundError, ConnectionRefusedError):
        return f"nothing accepts connections at {address}"
    except (BlockingIOError, TimeoutError):
        return f"no answer to a connection within {timeout_s:g} s"
    except AuthenticationError:
        return f"the worker at {address} refused the auth key in {key_path(address)}"
    except (EOFError, OSError) as e:
        return f"the connection failed ({type(e).__name__}: {e})"
    conn.close()
    return None


def algorithm_name(loss_fn: LossFn) -> str:
    """A registered algorithm whose loss is `loss_fn` (the worker looks losses up by name)."""
    for name, algo in ALGORITHMS.items():
        if algo.loss is loss_fn:
            return name
    raise WorkerError(f"loss {getattr(loss_fn, '__name__', loss_fn)!r} is not a registered algorithm's loss: "
                      "register it with `register_algorithm` in a module the worker imports (`--import MODULE`)")


NEVER_SAVED = "untrained"
"""`RemoteLearner.saved_hash` of an adapter that was neither trained nor loaded."""


class RemoteLearner:
    """An experiment's adapter on a worker: a `TrainingClient` (`training.interface`) whose
    modules stay on the worker."""

    def __init__(self, client: WorkerClient, name: str, cfg: LearnerConfig, seed: int, base_name: str = "",
                 claim: str | None = None):
        """Creates adapter `name` on the worker; with `claim`, takes over the adapter a previous
        holder parked there with that state tag instead, when there is one (`claimed`)."""
        self.client, self.adapter_name, self.cfg, self.base_name = client, name, cfg, base_name
        self.device = torch.device(client.info["device"])  # a name: no tensor of the adapter lives here
        self.dtype: torch.dtype = getattr(torch, client.info["dtype"])
        out = client.create(name, asdict(cfg), seed, base_name, claim=claim)
        self.claimed: bool = out.claimed
        self.record: dict[str, Any] | None = out.record
        """The record of the checkpoint the adapter was last saved to or loaded from (None: neither)."""
        self.steps = out.steps
        self.saved_hash: str | None = (self.record or {}).get("content_hash", NEVER_SAVED)
        """Content hash of the checkpoint whose state the adapter holds: `NEVER_SAVED` while
        untrained, None once trained past its last checkpoint (then it is not parked)."""

    def activate(self) -> None:
        return None

    def forward_backward(self, datums: list[Datum], loss_fn: LossFn, loss_cfg: LossConfig = LossConfig()) -> dict[str, float]:
        if not datums:
            raise ValueError("forward_backward needs at least one datum")
        self.saved_hash = None
        return self.client.forward_backward(self.adapter_name, datums, algorithm_name(loss_fn), asdict(loss_cfg))

    def tinker_forward_backward(self, datums: list[Datum], loss: TinkerLoss,
                                forward_only: bool = False) -> tuple[list[list[float]], dict[str, float]]:
        if not forward_only:
            self.saved_hash = None
        return self.client.tinker_forward_backward(self.adapter_name, datums, loss.name, dict(loss.config),
                                                   forward_only)

    def optim_step(self, adam: dict[str, float] | None = None) -> dict[str, float]:
        self.saved_hash = None
        out = self.client.optim_step(self.adapter_name, adam)
        self.steps += 1
        return out

    def compute_logprobs(self, datums: list[Datum]) -> list[list[float]]:
        return self.client.compute_logprobs(self.adapter_name, datums)

    def compute_reference_logprobs(self, datums: list[Datum]) -> list[list[float]]:
        return self.client.compute_reference_logprobs(self.adapter_name, datums)

    def compute_values(self, datums: list[Datum]) -> list[list[float]]:
        return self.client.compute_values(self.adapter_name, datums)

    def save_state(self, path: str | Path, record: dict[str, Any] | None = None,
                   extra_rng: dict[str, Any] | None = None) -> dict[str, Any]:
        self.record = self.client.save_state(self.adapter_name, str(Path(path).resolve()), record, extra_rng)
        self.saved_hash = self.record["content_hash"]
        return self.record

    def verify_checkpoint(self, path: str | Path, probe_tokens: list[int]) -> dict[str, Any]:
        return self.client.verify_checkpoint(self.adapter_name, str(Path(path).resolve()), list(probe_tokens))

    def load_state(self, path: str | Path, optimizer: bool = True) -> dict[str, Any]:
        self.saved_hash = None  # until the load succeeded
        record = self.client.load_state(self.adapter_name, str(Path(path).resolve()), optimizer)
        self.steps = int(record.get("learner_steps", 0))
        self.record, self.saved_hash = record, record["content_hash"]
        return record

    def park(self, tag: str) -> bool:
        """Leave the adapter on the worker for the next holder that claims it with `tag` (the
        next step process of this experiment); False, and nothing parked, when it was trained
        past its last checkpoint (its state would be found in no checkpoint)."""
        if self.saved_hash is None:
            return False
        self.client.park(self.adapter_name, tag)
        return True


class RemoteSampler:
    """Samples with an experiment's adapter on a worker, with `Sampler`'s interface. A local
    (CPU) generator's state travels with each call and comes back advanced, so the draws are
    the ones the in-process sampler makes."""

    def __init__(self, client: WorkerClient, adapter: str):
        self.client, self.adapter = client, adapter
        self.stop_token_ids = list(client.info["stop_token_ids"])
        self.max_context = client.info["max_context"]
        self.pad_token_id = client.info["pad_token_id"]

    def sample(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
               generator: torch.Generator | None = None, *, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0, stop: tuple[str, ...] | list[str] = ()) -> list[Sample]:
        if not prompts:
            return []
        if generator is not None and generator.device.type != "cpu":
            raise ValueError("a worker takes a CPU generator (its uniforms are moved to the worker's device)")
        out = self.client.sample(sample_call(self.adapter, prompts, max_new_tokens, temperature, generator, top_k=top_k,
                                             top_p=top_p, min_p=min_p, stop=stop))
        if generator is not None:
            set_generator_state(generator, out.generator_state)
        return out.samples


def sample_call(adapter: str, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                generator: torch.Generator | None, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                stop: tuple[str, ...] | list[str] = (), top_logprobs: int = 0) -> M.SampleCall:
    """A `sample` request; a CPU generator travels as its state's bytes and comes back advanced."""
    state = generator.get_state().numpy().tobytes() if generator is not None else None
    return M.SampleCall(adapter, [list(p) for p in prompts], max_new_tokens, temperature, state, top_k, top_p,
                        min_p, list(stop), top_logprobs)


def set_generator_state(generator: torch.Generator, state: bytes | None) -> None:
    if state is None:
        raise WorkerError("the worker returned no generator state for a request that brought one")
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def _parent_death_signal() -> None:
    """In the forked child, before exec: SIGTERM when the parent thread exits (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    import signal as _signal

    ctypes.CDLL(None, use_errno=True).prctl(1, _signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def start_worker(model: str, address: str | Path, device: str = "auto", dtype: str = "auto",
                 extra: list[str] | None = None, timeout_s: float = 300.0, log: str | Path | None = None,
                 env: dict[str, str] | None = None, die_with_parent: bool = False) -> subprocess.Popen:
    """Start `tinker-pipelines worker` in its own session and wait until it accepts clients.
    `env` is added to this process's environment. With `die_with_parent`, the worker gets
    SIGTERM when this process dies, even by SIGKILL (Linux's parent-death signal), so a killed
    service does not leave its worker holding the device."""
    cmd = [sys.executable, "-m", "tinker_pipelines", "worker", "--model", model, "--socket", str(address),
           "--device", device, "--dtype", dtype, *(extra or [])]
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True,
                            env={**os.environ, **env} if env else None,
                            preexec_fn=_parent_death_signal if die_with_parent else None)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise WorkerError(f"the worker for {model} exited with code {proc.returncode} before it was ready"
                              f"{f' (log: {log})' if log else ''}")
        if key_path(address).exists() and Path(address).exists():
            try:
                WorkerClient(address).close()
                return proc
            except WorkerError:
                pass
        time.sleep(0.1)
    proc.kill()
    raise WorkerError(f"the worker for {model} was not ready after {timeout_s:.0f} s")
