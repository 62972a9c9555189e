"""Starting the Tinker service: a resident worker for the base, and one HTTP process that
serves Tinker's `/api/v1` and the OpenAI `/v1` from it.

In this process (`start_service`, a thread: tests, notebooks, benchmarks) or as
`tinker-pipelines tinker serve` (the CLI). Without an API key the service accepts any key, so
it listens on loopback only; a non-loopback host needs `--api-key-env`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_pipelines.serving.launch import DEFAULT_HOST, build_server, serving_env
from tinker_pipelines.serving.tinker.app import TinkerSettings, add_tinker_routes
from tinker_pipelines.serving.tinker.runtime import WORKER_TIMEOUT_S, Runtime
from tinker_pipelines.serving.tinker.service import Service
from tinker_pipelines.training.rules import TINKER_PASS_TOKENS


def check_host(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without a key (any key would be accepted)."""
    if api_key is not None:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"--host {host} is not loopback: without an API key this service accepts any key, so it "
                         "only listens on 127.0.0.1; set one with --api-key-env")


def base_aliases(model: str) -> tuple[str, ...]:
    """Other names clients may give the served base: a model directory's absolute path and name."""
    p = Path(model)
    return (str(p.resolve()), p.name) if p.is_dir() else ()


@dataclass(frozen=True)
class DeviceLease:
    """Where the service's worker may run, from the scheduler's ledger (the one Dagster's
    executor uses), so Dagster steps and Tinker clients never over-subscribe a device together."""

    ledger_path: str
    inventory: Any
    """A `scheduler.inventory.Inventory` (detected, configured, or simulated in tests)."""
    memory_gb: float
    """What the worker reserves on its device: the base, its adapters and activations."""
    timeout_s: float | None = 600.0


def take_lease(spec: DeviceLease | None) -> tuple[Any, dict[str, str]]:
    """(the lease or None, the worker's extra environment). A 'lora' lease: other LoRA work may
    share the device, an exclusive step waits until the service stops. No devices, no lease."""
    if spec is None or len(spec.inventory) == 0:
        return None, {}
    from tinker_pipelines.scheduler.inventory import lease_visible_devices
    from tinker_pipelines.scheduler.ledger import Ledger, LeaseOwner
    from tinker_pipelines.scheduler.placement import StepNeeds

    lease = Ledger(spec.ledger_path).acquire(LeaseOwner.current(step_key="tinker-service"),
                                             StepNeeds(1, spec.memory_gb, "lora"), spec.inventory,
                                             timeout_s=spec.timeout_s, poll_s=0.5)
    visible = lease_visible_devices(spec.inventory, lease.devices)
    return lease, ({"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {})


@dataclass
class ServiceHandle:
    """A running service: its base URL (the SDK's `base_url`), worker and HTTP server."""

    url: str
    worker: subprocess.Popen
    service: Service
    _uvicorn: Any
    _thread: threading.Thread
    lease: Any = None
    """The device lease the worker runs under (None without devices to lease)."""
    ledger_path: str | None = None
    supervisor: Any = None
    """The `supervisor.WorkerSupervisor` that restarts a dead or hung worker (`worker` is then
    the one running now)."""

    @property
    def worker_pid(self) -> int:
        return self.worker.pid

    @property
    def openai_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
        if self.supervisor is not None:  # first: a worker stopped below is not one to restart
            self.supervisor.stop()
            self.worker = self.supervisor.proc
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)
        self.service.runtime.close()
        if self.worker.poll() is None:
            self.worker.terminate()
            try:
                self.worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.worker.kill()
        if self.lease is not None:
            from tinker_pipelines.scheduler.ledger import Ledger

            Ledger(self.ledger_path).release(self.lease)


def build_app(model: str, worker_address: Path, home: Path, settings: TinkerSettings, tracker: Any = None,
              gap_timeout_s: float = 60.0, max_lora_rank: int = 64,
              pass_tokens: int = TINKER_PASS_TOKENS, worker_timeout_s: float | None = WORKER_TIMEOUT_S,
              supervisor: Any = None, **service_options: Any) -> tuple[Any, Service]:
    """The app: the OpenAI endpoint over the worker, with Tinker's routes added (`service_options`:
    more of `Service`'s settings, e.g. `min_ttl_s`, `session_ttl_s`). Each worker call is bounded
    by `worker_timeout_s`; `supervisor` (a `WorkerSupervisor`) replaces a dead or hung worker. The
    tracker's calls are retried and never fail a call whose work was done (`ResilientTracker`)."""
    from tinker_pipelines.serving.app import build_app as build_openai_app
    from tinker_pipelines.serving.tinker.lineage import ResilientTracker

    runtime = Runtime(worker_address, pass_tokens=pass_tokens, timeout_s=worker_timeout_s, supervisor=supervisor)
    tracker = None if tracker is None else ResilientTracker.around(tracker)
    service = Service(runtime, model, home, tracker=tracker, gap_timeout_s=gap_timeout_s,
                      base_aliases=base_aliases(model), max_lora_rank=max_lora_rank, **service_options)
    server = build_server(model=model, worker=str(worker_address), use_registry=tracker is not None)
    if supervisor is not None:  # the OpenAI endpoint's own connections to the worker, made again
        supervisor.listeners.append(lambda generation: server.backend.reconnect())
    return add_tinker_routes(build_openai_app(server), service, settings), service


def start_service(model: str, port: int = 0, home: Path | None = None, api_key: str | None = None,
                  host: str = DEFAULT_HOST, device: str = "auto", dtype: str = "auto", tracker: Any = None,
                  gap_timeout_s: float = 60.0, worker_args: list[str] | None = None,
                  settings: TinkerSettings | None = None, lease: DeviceLease | None = None,
                  max_lora_rank: int = 64, pass_tokens: int = TINKER_PASS_TOKENS,
                  worker_timeout_s: float | None = WORKER_TIMEOUT_S, **service_options: Any) -> ServiceHandle:
    """Start a worker for `model` under a device lease and serve it in a thread of this process.
    A supervisor restarts the worker, with the same arguments on the same socket, when it dies
    or hangs (`supervisor.py`); every worker call is bounded by `worker_timeout_s`."""
    import tempfile

    import uvicorn

    from tinker_pipelines.serving.tinker.supervisor import WorkerSupervisor
    from tinker_pipelines.worker.client import start_worker

    settings = settings or TinkerSettings(api_key=api_key)
    keys = settings.accepted()  # a key the SDK would refuse is refused here, before anything starts
    check_host(host, None if keys.open else "set")
    home = Path(home or tempfile.mkdtemp(prefix="tinker-service-"))
    home.mkdir(parents=True, exist_ok=True)
    address = home / "worker.sock"
    held, env = take_lease(lease)
    extra = ["--max-lora-rank", str(max_lora_rank), *(worker_args or [])]

    def start() -> subprocess.Popen:
        proc = start_worker(model, address, device=device, dtype=dtype, extra=extra, log=home / "worker.log",
                            env=env, die_with_parent=True)
        (home / "worker.pid").write_text(str(proc.pid))
        return proc
    try:
        worker = start()
    except BaseException:
        if held is not None:
            from tinker_pipelines.scheduler.ledger import Ledger

            Ledger(lease.ledger_path).release(held)
        raise
    supervisor = WorkerSupervisor(worker, start, address, model, log_path=home / "worker.log")
    try:
        app, service = build_app(model, address, home, settings, tracker, gap_timeout_s, max_lora_rank, pass_tokens,
                                 worker_timeout_s, supervisor, **service_options)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        url = f"http://{host}:{sock.getsockname()[1]}"
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        loop: list[asyncio.AbstractEventLoop] = []
        thread = threading.Thread(target=_serve, args=(server, sock, loop), daemon=True)
        thread.start()
        wait_healthy(url, 60, key=next(iter(keys.by_key), None))
    except BaseException:
        worker.kill()
        raise
    handle = ServiceHandle(url, worker, service, server, thread, held, lease.ledger_path if lease else None,
                           supervisor)

    def restarted(generation: int) -> None:  # the service's own state lives in its event loop
        handle.worker = supervisor.proc
        loop[0].call_soon_threadsafe(service.worker_restarted, generation)
    supervisor.listeners.append(restarted)
    supervisor.start()
    return handle


def _serve(server: Any, sock: socket.socket, loop: list[asyncio.AbstractEventLoop]) -> None:
    """`uvicorn.Server.run`, telling `loop` the event loop it serves from."""
    async def serve() -> None:
        loop.append(asyncio.get_running_loop())
        await server.serve(sockets=[sock])
    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        runner.run(serve())


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None, key: str | None = None) -> None:
    """Until `healthz` answers ok (with `key`, which every route of a keyed service needs)."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(f"{url}/api/v1/healthz", headers={"X-API-Key": key} if key else {})
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the Tinker service exited with code {proc.returncode} before it was ready")
        try:  # healthz probes the worker for up to 2 s (app.HEALTH_PROBE_S)
            with urllib.request.urlopen(request, timeout=5) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the Tinker service at {url} was not ready after {timeout_s:.0f} s")


def start_service_process(args: list[str], home: Path, host: str = DEFAULT_HOST, port: int | None = None,
                          timeout_s: float = 300.0, key: str | None = None) -> tuple[subprocess.Popen, str]:
    """`tinker-pipelines tinker serve ARGS` in its own session; (process, base URL) once it answers."""
    if port is None:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    log = open(home / "service.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "tinker_pipelines", "tinker", "serve", *args, "--home", str(home),
                             "--host", host, "--port", str(port)], stdout=log, stderr=log, start_new_session=True,
                            env=serving_env())
    url = f"http://{host}:{port}"
    try:
        wait_healthy(url, timeout_s, proc, key)
    except RuntimeError:
        proc.kill()
        raise
    return proc, url
