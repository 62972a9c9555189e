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

import torch

from tinker_pipelines.algorithms.losses import LossConfig, LossFn
from tinker_pipelines.algorithms.registry import ALGORITHMS
from tinker_pipelines.training.learner import LearnerConfig
from tinker_pipelines.rollout.sampler import ContextOverflowError, Sample
from tinker_pipelines.types import Datum
from tinker_pipelines.worker import PROTOCOL_VERSION, WorkerDiedError, WorkerError
from tinker_pipelines.worker.server import key_path


class WorkerClient:
    """One authenticated connection to the worker at `address` (a Unix socket path)."""

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
        self.info: dict[str, Any] = self._roundtrip({"op": "hello", "v": PROTOCOL_VERSION}, "hello", "")

    def request(self, op: str, experiment: str = "", **fields: Any) -> Any:
        """Send one request and wait for its reply; errors name the worker and the experiment."""
        return self._roundtrip({"op": op, **fields}, op, experiment)

    def _roundtrip(self, message: dict[str, Any], op: str, experiment: str) -> Any:
        with self._lock:
            try:
                self.conn.send(message)
                reply = self.conn.recv()
            except (EOFError, OSError) as e:
                raise WorkerDiedError(f"worker {self.address} went away during {op}"
                                      f"{f' of experiment {experiment!r}' if experiment else ''} "
                                      f"({type(e).__name__})") from None
        if not reply.get("ok"):
            msg = f"worker {self.address}: {op}{f' for experiment {experiment!r}' if experiment else ''}: {reply.get('message')}"
            if reply.get("error") == "context_overflow":
                raise ContextOverflowError(msg)
            raise WorkerError(msg)
        return reply.get("result")

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
        out = client.request("create", name, name=name, learner=asdict(cfg), seed=seed, base_name=base_name,
                             claim=claim)
        self.claimed: bool = bool(out.get("claimed"))
        self.record: dict[str, Any] | None = out.get("record")
        """The record of the checkpoint the adapter was last saved to or loaded from (None: neither)."""
        self.steps = int(out.get("steps", 0))
        self.saved_hash: str | None = (self.record or {}).get("content_hash", NEVER_SAVED)
        """Content hash of the checkpoint whose state the adapter holds: `NEVER_SAVED` while
        untrained, None once trained past its last checkpoint (then it is not parked)."""

    def _call(self, what: str, **kwargs: Any) -> Any:
        return self.client.request("call", self.adapter_name, adapter=self.adapter_name, what=what, kwargs=kwargs)

    def activate(self) -> None:
        return None

    def forward_backward(self, datums: list[Datum], loss_fn: LossFn, loss_cfg: LossConfig = LossConfig()) -> dict[str, float]:
        if not datums:
            raise ValueError("forward_backward needs at least one datum")
        self.saved_hash = None
        return self.client.request("forward_backward", self.adapter_name, adapter=self.adapter_name, datums=datums,
                                   algorithm=algorithm_name(loss_fn), loss_cfg=asdict(loss_cfg))["metrics"]

    def optim_step(self) -> dict[str, float]:
        self.saved_hash = None
        out = self._call("optim_step")
        self.steps += 1
        return out

    def compute_logprobs(self, datums: list[Datum]) -> list[list[float]]:
        return self._call("compute_logprobs", datums=datums)

    def compute_reference_logprobs(self, datums: list[Datum]) -> list[list[float]]:
        return self._call("compute_reference_logprobs", datums=datums)

    def compute_values(self, datums: list[Datum]) -> list[list[float]]:
        return self._call("compute_values", datums=datums)

    def save_state(self, path: str | Path, record: dict[str, Any] | None = None,
                   extra_rng: dict[str, Any] | None = None) -> dict[str, Any]:
        self.record = self._call("save_state", path=str(Path(path).resolve()), record=record, extra_rng=extra_rng)
        self.saved_hash = self.record["content_hash"]
        return self.record

    def verify_checkpoint(self, path: str | Path, probe_tokens: list[int]) -> dict[str, Any]:
        return self._call("verify_checkpoint", path=str(Path(path).resolve()), probe_tokens=list(probe_tokens))

    def load_state(self, path: str | Path) -> dict[str, Any]:
        self.saved_hash = None  # until the load succeeded
        record = self._call("load_state", path=str(Path(path).resolve()))
        self.steps = int(record.get("learner_steps", 0))
        self.record, self.saved_hash = record, record["content_hash"]
        return record

    def park(self, tag: str) -> bool:
        """Leave the adapter on the worker for the next holder that claims it with `tag` (the
        next step process of this experiment); False, and nothing parked, when it was trained
        past its last checkpoint (its state would be found in no checkpoint)."""
        if self.saved_hash is None:
            return False
        self.client.request("park", self.adapter_name, name=self.adapter_name, tag=tag)
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
        # bytes, not a tensor: torch pickles tensors as shared-memory handles only a related process can open
        state = generator.get_state().numpy().tobytes() if generator is not None else None
        out = self.client.request("sample", self.adapter, adapter=self.adapter, prompts=[list(p) for p in prompts],
                                  max_new_tokens=max_new_tokens, temperature=temperature, generator_state=state,
                                  top_k=top_k, top_p=top_p, min_p=min_p, stop=list(stop))
        if generator is not None:
            generator.set_state(torch.frombuffer(bytearray(out["generator_state"]), dtype=torch.uint8))
        return [Sample(tuple(t), tuple(lp), r, s, tuple(n)) for t, lp, r, s, n in out["samples"]]


def start_worker(model: str, address: str | Path, device: str = "auto", dtype: str = "auto",
                 extra: list[str] | None = None, timeout_s: float = 300.0, log: str | Path | None = None) -> subprocess.Popen:
    """Start `tinker-pipelines worker` in its own session and wait until it accepts clients."""
    cmd = [sys.executable, "-m", "tinker_pipelines", "worker", "--model", model, "--socket", str(address),
           "--device", device, "--dtype", dtype, *(extra or [])]
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
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
