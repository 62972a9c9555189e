"""Thin clients of a resident worker: `WorkerClient`, `RemoteLearner`, `RemoteSampler`.

`RemoteLearner` implements `training.interface.TrainingClient` and `RemoteSampler` has the
methods of `Sampler` that an `Experiment` uses, so the same experiment code trains in-process or on a worker; with batching
off, the worker computes exactly what the in-process engine does (same metrics, tested).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from multiprocessing.connection import AuthenticationError, Client
from pathlib import Path
from typing import Any

import msgspec
import torch

from tinker_pipelines.algorithms.losses import LossConfig, LossFn
from tinker_pipelines.algorithms.registry import ALGORITHMS
from tinker_pipelines.algorithms.tinker_losses import TinkerLoss, TinkerLossError
from tinker_pipelines.training.learner import LearnerConfig
from tinker_pipelines.rollout.sampler import ContextOverflowError, Sample
from tinker_pipelines.types import Datum
from tinker_pipelines.worker import WorkerDiedError, WorkerError
from tinker_pipelines.worker import messages as M
from tinker_pipelines.worker.server import key_path


class WorkerClient:
    """One authenticated connection to the worker at `address` (a Unix socket path), with one
    typed method per op (`messages.Op`); each sends the op's request struct and returns what
    its reply carries. Errors name the worker and the experiment (the request's adapter)."""

    def __init__(self, address: str | Path, authkey: bytes | None = None):
        self.address = str(address)
        if authkey is None:
            env = os.environ.get("TINKER_WORKER_KEY")
            try:
                authkey = bytes.fromhex(env) if env else key_path(self.address).read_bytes()
            except FileNotFoundError:
                raise WorkerError(f"no worker at {self.address}: its key file {key_path(self.address)} is missing "
                                  "(start one with `tinker-pipelines worker`)") from None
        try:
            self.conn = Client(self.address, family="AF_UNIX", authkey=authkey)
        except (FileNotFoundError, ConnectionRefusedError):
            raise WorkerError(f"no worker listening at {self.address} (start one with `tinker-pipelines worker`)") from None
        except AuthenticationError:
            raise WorkerError(f"the worker at {self.address} refused this client's auth key") from None
        self._lock = threading.Lock()
        self.hello: M.HelloReply = self.send(M.Hello(M.SCHEMA))  # type: ignore[assignment]
        self.info: dict[str, Any] = msgspec.structs.asdict(self.hello)
        """The worker's hello (`messages.HelloReply`) as a dict: base, device, dtype, limits."""

    def send(self, request: M.Request) -> M.Reply:
        """Send one request and wait for its reply struct; a refusal raises `WorkerError` (or
        `ContextOverflowError`) naming the worker, the op and the experiment."""
        op = M.op_of(request)
        experiment = getattr(request, "adapter", "") or getattr(request, "name", "")
        about = f"{op.value}{f' of experiment {experiment!r}' if experiment else ''}"
        with self._lock:
            try:
                self.conn.send_bytes(M.encode(request))  # msgpack: `conn.send` would pickle
                data = self.conn.recv_bytes()
            except (EOFError, OSError) as e:
                raise WorkerDiedError(f"worker {self.address} went away during {about} ({type(e).__name__})") from None
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
        try:
            self.conn.close()
        except OSError:
            pass


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
