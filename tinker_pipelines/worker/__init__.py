"""Resident device workers: one long-lived process per device owns the base model and hosts many
experiments' LoRA adapters, each with its own optimizer, RNG, value head and step counter.

- `engine`: the hosted adapters and the batching rule (concurrent `sample` calls decode in one
  mixed-adapter batch; concurrent `forward_backward` calls share base passes, `batching`).
- `messages`: the wire protocol: the `Op` enum and one typed request and reply struct per op,
  sent as msgpack (no pickle), versioned by a hash of the schema (`messages.SCHEMA`).
- `server`: `tinker-pipelines worker`: a Unix socket (`multiprocessing.connection`, HMAC auth key),
  one thread per client, one compute thread, one handler per op.
- `client`: `WorkerClient`, and `RemoteLearner` / `RemoteSampler`, which stand in for the
  in-process `Learner` / `Sampler` so the same `Experiment` runs either way.

Only token ids, logprobs, advantages and file paths cross the socket, never weights.
"""

class WorkerError(RuntimeError):
    """A worker refused or failed a request; the message names the worker and the experiment."""


class WorkerDiedError(WorkerError):
    """The worker process went away during a call."""


class WorkerTimeout(WorkerDiedError):
    """A call got no answer within its connection's bound (`WorkerClient(timeout_s=...)`): the
    worker is hung or far slower than it should be. The connection is closed, since a late
    answer would be taken for the next call's."""


class WorkerLost(WorkerDiedError):
    """The worker a connection talked to died or hung and was replaced by a new one: what that
    connection held there (adapters, optimizer state, snapshots) is gone. The message says what
    happened and what to do."""


def default_socket(model: str, device: str) -> "Path":
    """Where a worker for `model` on physical device `device` listens unless told: under the
    project's `.tinker/` (the command line and the Dagster resource that starts workers both look
    there). `device` is `scheduler.workers.worker_device_key`'s, never a logical `cuda:0`."""
    import hashlib
    from pathlib import Path

    slug = hashlib.sha256(f"{model}|{device}".encode()).hexdigest()[:12]
    return Path(".tinker") / "workers" / f"{slug}.sock"
