"""Building and starting the endpoint: in this process (a thread, for notebooks and tests), or as
a `tinker-pipelines serve` process (the CLI, the Dagster `serve` job)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tinker_pipelines.serving.app import Server, build_app
from tinker_pipelines.serving.backend import EngineBackend, WorkerBackend
from tinker_pipelines.serving.registry import Registry, registry_from_env

DEFAULT_HOST = "127.0.0.1"
"""Loopback only unless told otherwise: the endpoint has no authentication."""


def infer_base(ref: str, registry: Registry) -> tuple[str, dict[str, Any], int, str]:
    """(what `load_model` takes, builder kwargs, seed, base name) of the base the version `ref`
    names was trained on, so `serve --model` can be left out."""
    name, version = registry.resolve(ref)
    v = registry.fetch(name, version)
    if v.config is None:  # a Tinker API checkpoint: its base as recorded, builder defaults
        return v.base_path, {}, 0, v.base_path
    m = v.config.model
    if v.base_path != m.name:  # the experiment's SFT warm start
        return v.base_path, {}, 0, f"{name}-sft-base"
    return m.name, dict(m.kwargs), v.config.seed if m.seed is None else m.seed, m.name


def build_server(model: str | None = None, ref: str | None = None, worker: str | None = None,
                 max_adapters: int = 4, registry: Registry | None = None, use_registry: bool = True,
                 seed: int = 0, model_kwargs: dict[str, Any] | None = None, device: str = "auto",
                 dtype: str = "auto", max_rows: int = 256, **server_kw: Any) -> Server:
    """A `Server` over base `model` (or, without one, the base `ref`'s version was trained on), on
    an in-process engine or the resident worker at `worker`. Raises `ValueError`/`ServingError`
    with one sentence when the base cannot be found or loaded."""
    from tinker_pipelines.models import base_identity, load_model, load_tokenizer, stop_token_ids
    from tinker_pipelines.worker.engine import Engine, EngineConfig

    if registry is None and use_registry:
        registry = Registry(*registry_from_env())
    kwargs = dict(model_kwargs or {})
    base_name = server_kw.pop("base_name", None)
    if model is None and worker is None:
        if ref is None or registry is None:
            raise ValueError("name the base with --model, or a registered version (MODEL@ALIAS) to serve its base")
        model, kwargs, seed, inferred = infer_base(ref, registry)
        base_name = base_name or inferred
    if worker is not None:
        backend = WorkerBackend(worker)
        identity = backend.base_identity
        tokenizer = load_tokenizer(model if model is not None else _worker_model(identity))
        base_name = base_name or model or identity
    else:
        identity = base_identity(model, kwargs, seed)
        net, tokenizer = load_model(model, seed=seed, dtype=dtype, device=device, **kwargs)
        net.requires_grad_(False)
        engine = Engine(net, tokenizer.pad_token_id, stop_token_ids(tokenizer), identity,
                        EngineConfig(max_rows=max_rows, max_lora_rank=256), tokenizer=tokenizer)
        backend = EngineBackend(engine)
        base_name = base_name or (f"{Path(model).name}" if Path(model).is_dir() else model)
    return Server(backend, tokenizer, base_name, identity, registry, max_adapters=max_adapters, **server_kw)


def _worker_model(identity: str) -> str:
    """The catalogue name or directory of a worker's base identity (`tiny(seed=0)` -> `tiny`)."""
    return identity.split("(")[0]


class ServerThread:
    """Uvicorn serving `server` on `host`:`port` (0: a free port) in a daemon thread."""

    def __init__(self, server: Server, host: str = DEFAULT_HOST, port: int = 0):
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.host, self.port = host, sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}/v1"
        self.uvicorn = uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_ready(self.url, 60)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=10)


def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> dict:
    """Poll `{url}/../health` until it answers; raises `RuntimeError` on timeout or process exit."""
    health = url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(health, timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the server at {url} was not ready after {timeout_s:.0f} s")


def serving_env() -> dict[str, str]:
    """The environment of a served process: this one's, with OpenMP's idle threads sleeping
    (`OMP_WAIT_POLICY=PASSIVE`, unless set). With libgomp's default, torch's OpenMP worker spins
    after every parallel region while the decode thread runs Python between ops; with few cores
    that spinning takes a core from the decode thread and the HTTP threads (7-10x slower runs on
    2 cores, docs/serving.md). libgomp reads it once, as torch loads: hence a process setting."""
    return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def start_server_process(args: list[str], host: str = DEFAULT_HOST, port: int | None = None,
                         log: str | Path | None = None, timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`tinker-pipelines serve ARGS` in its own session; returns (process, base URL) once it answers."""
    if port is None:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "tinker_pipelines", "serve", *args, "--host", host,
                             "--port", str(port)], stdout=out, stderr=out, start_new_session=True, env=serving_env())
    url = f"http://{host}:{port}/v1"
    try:
        wait_ready(url, timeout_s, proc)
    except RuntimeError:
        proc.kill()
        raise
    return proc, url
