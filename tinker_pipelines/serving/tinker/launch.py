"""Starting the Tinker service: a resident worker for the base, and one HTTP process that
serves Tinker's `/api/v1` and the OpenAI `/v1` from it.

In this process (`start_service`, a thread: tests, notebooks, benchmarks) or as
`tinker-pipelines tinker serve` (the CLI). Without an API key the service accepts any key, so
it listens on loopback only; a non-loopback host needs `--api-key-env`.
"""

from __future__ import annotations

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
from tinker_pipelines.serving.tinker.runtime import Runtime
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

    @property
    def worker_pid(self) -> int:
        return self.worker.pid

    @property
    def openai_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
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
              pass_tokens: int = TINKER_PASS_TOKENS) -> tuple[Any, Service]:
    """The app: the OpenAI endpoint over the worker, with Tinker's routes added."""
    from tinker_pipelines.serving.app import build_app as build_openai_app

    runtime = Runtime(worker_address, pass_tokens=pass_tokens)
    service = Service(runtime, model, home, tracker=tracker, gap_timeout_s=gap_timeout_s,
                      base_aliases=base_aliases(model), max_lora_rank=max_lora_rank)
    server = build_server(model=model, worker=str(worker_address), use_registry=tracker is not None)
    return add_tinker_routes(build_openai_app(server), service, settings), service


def start_service(model: str, port: int = 0, home: Path | None = None, api_key: str | None = None,
                  host: str = DEFAULT_HOST, device: str = "auto", dtype: str = "auto", tracker: Any = None,
                  gap_timeout_s: float = 60.0, worker_args: list[str] | None = None,
                  settings: TinkerSettings | None = None, lease: DeviceLease | None = None,
                  max_lora_rank: int = 64, pass_tokens: int = TINKER_PASS_TOKENS) -> ServiceHandle:
    """Start a worker for `model` under a device lease and serve it in a thread of this process."""
    import tempfile

    import uvicorn

    from tinker_pipelines.worker.client import start_worker

    check_host(host, api_key)
    home = Path(home or tempfile.mkdtemp(prefix="tinker-service-"))
    home.mkdir(parents=True, exist_ok=True)
    address = home / "worker.sock"
    held, env = take_lease(lease)
    extra = ["--max-lora-rank", str(max_lora_rank), *(worker_args or [])]
    try:
        worker = start_worker(model, address, device=device, dtype=dtype, extra=extra, log=home / "worker.log",
                              env=env, die_with_parent=True)
    except BaseException:
        if held is not None:
            from tinker_pipelines.scheduler.ledger import Ledger

            Ledger(lease.ledger_path).release(held)
        raise
    (home / "worker.pid").write_text(str(worker.pid))
    try:
        settings = settings or TinkerSettings(api_key=api_key)
        app, service = build_app(model, address, home, settings, tracker, gap_timeout_s, max_lora_rank, pass_tokens)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        url = f"http://{host}:{sock.getsockname()[1]}"
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        wait_healthy(url, 60)
    except BaseException:
        worker.kill()
        raise
    return ServiceHandle(url, worker, service, server, thread, held, lease.ledger_path if lease else None)


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the Tinker service exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the Tinker service at {url} was not ready after {timeout_s:.0f} s")


def start_service_process(args: list[str], home: Path, host: str = DEFAULT_HOST, port: int | None = None,
                          timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
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
        wait_healthy(url, timeout_s, proc)
    except RuntimeError:
        proc.kill()
        raise
    return proc, url
