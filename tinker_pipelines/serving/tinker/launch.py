"""Starting the Tinker service: a resident worker for the base (or one per base and device of a
device set, `devices.NodeDevices`), and one HTTP process that serves Tinker's `/api/v1` and the
OpenAI `/v1` from them (the OpenAI endpoint serves every base from that base's first worker).

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
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker_pipelines.serving.launch import DEFAULT_HOST, build_server, serving_env
from tinker_pipelines.serving.tinker.app import TinkerSettings, add_tinker_routes
from tinker_pipelines.serving.tinker.devices import NodeDevices, claim_devices
from tinker_pipelines.serving.tinker.node import Node, NodeWorker
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
class WorkerSlot:
    """One worker of the service: the base it holds, its device, socket, log and lease."""

    base: str
    device: int | None
    """Its device's index in `NodeDevices.inventory` (None: the single worker's `--device`)."""
    label: str
    """How messages name it: the base alone for the single worker, else `BASE on device I (NAME)`."""
    address: Path
    log: Path
    pid_file: Path
    device_arg: str
    env: dict[str, str] = field(default_factory=dict)
    lease: Any = None
    ledger_path: str | None = None
    supervisor: Any = None
    runtime: Any = None


@dataclass
class ServiceHandle:
    """A running service: its base URL (the SDK's `base_url`), worker and HTTP server."""

    url: str
    worker: subprocess.Popen
    service: Service
    _uvicorn: Any
    _thread: threading.Thread
    lease: Any = None
    """The device lease the (first) worker runs under (None without devices to lease)."""
    ledger_path: str | None = None
    supervisor: Any = None
    """The `supervisor.WorkerSupervisor` that restarts a dead or hung worker (`worker` is then
    the one running now); with several workers, the first one's (each has its own: `workers`)."""
    workers: list[WorkerSlot] = field(default_factory=list)
    """Every worker, by base then device (one, for one base without a device set)."""
    claims: Any = None
    """The service's exclusive claim on its devices (`devices.Claims`), or None."""
    _keepers: threading.Event = field(default_factory=threading.Event)

    @property
    def worker_pid(self) -> int:
        return self.worker.pid

    @property
    def openai_url(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> None:
        for slot in self.workers:  # first: a worker stopped below is not one to restart
            slot.supervisor.stop()
        if self.supervisor is not None:
            self.worker = self.supervisor.proc
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)
        self.service.node.close()
        _stop_workers([slot.supervisor.proc for slot in self.workers])
        _release(self.workers, self.claims)
        self._keepers.set()


def _stop_workers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _release(slots: list[WorkerSlot], claims: Any) -> None:
    from tinker_pipelines.scheduler.ledger import Ledger

    for slot in slots:
        if slot.lease is not None:
            Ledger(slot.ledger_path).release(slot.lease)
            slot.lease = None
    if claims is not None:
        claims.release()


def build_app(model: str, worker_address: Path, home: Path, settings: TinkerSettings, tracker: Any = None,
              gap_timeout_s: float = 60.0, max_lora_rank: int = 64,
              pass_tokens: int = TINKER_PASS_TOKENS, worker_timeout_s: float | None = WORKER_TIMEOUT_S,
              supervisor: Any = None, node: Node | None = None, **service_options: Any) -> tuple[Any, Service]:
    """The app: the OpenAI endpoint over the worker, with Tinker's routes added (`service_options`:
    more of `Service`'s settings, e.g. `min_ttl_s`, `session_ttl_s`). Each worker call is bounded
    by `worker_timeout_s`; `supervisor` (a `WorkerSupervisor`) replaces a dead or hung worker. The
    tracker's calls are retried and never fail a call whose work was done (`ResilientTracker`).
    With `node` (several workers), Tinker's routes serve all of them and the OpenAI endpoint
    serves each base from its first worker, `model` (the first base) the default."""
    from tinker_pipelines.serving.app import build_app as build_openai_app
    from tinker_pipelines.serving.tinker.lineage import ResilientTracker

    if node is None:
        node = Node.single(Runtime(worker_address, pass_tokens=pass_tokens, timeout_s=worker_timeout_s,
                                   supervisor=supervisor), model, base_aliases(model))
    tracker = None if tracker is None else ResilientTracker.around(tracker)
    service = Service(node, model, home, tracker=tracker, gap_timeout_s=gap_timeout_s,
                      max_lora_rank=max_lora_rank, **service_options)
    servers: list[Any] = []
    for base in node.bases:
        runtime = node.of_base(base)[0].runtime
        server = build_server(model=base, worker=runtime.address, aliases=node.aliases[base],
                              registry=servers[0].registry if servers else None,
                              use_registry=not servers and tracker is not None)
        if runtime.supervisor is not None:  # the OpenAI endpoint's own connections to this worker, made again
            runtime.supervisor.listeners.append(lambda generation, server=server: server.backend.reconnect())
        servers.append(server)
    return add_tinker_routes(build_openai_app(servers), service, settings), service


def check_bases(models: list[str]) -> None:
    """Refuse a base given twice (also as two names of one model directory)."""
    seen: dict[str, str] = {}
    for m in models:
        for name in (m, *base_aliases(m)[:1]):
            if name in seen:
                same = "" if seen[name] == m else f" (as {seen[name]!r})"
                raise ValueError(f"--model {m} is given twice{same}: give each base once")
        for name in (m, *base_aliases(m)[:1]):
            seen[name] = m


def plan_workers(models: list[str], home: Path, device: str, devices: NodeDevices | None) -> list[WorkerSlot]:
    """One worker per base and device, by base then device. One base without a device set: the
    single worker of today, at `home/worker.sock`."""
    if len(models) == 1 and devices is None:
        return [WorkerSlot(models[0], None, models[0], home / "worker.sock", home / "worker.log", home / "worker.pid",
                           device)]
    (home / "workers").mkdir(parents=True, exist_ok=True)
    slots = []
    for b, base in enumerate(models):
        for d in (devices.devices if devices is not None else (None,)):
            name = f"b{b}" if d is None else f"b{b}-d{d}"
            folder = home / "workers"
            slots.append(WorkerSlot(base, d, base if d is None else f"{base} on {devices.label(d)}",
                                    folder / f"{name}.sock", folder / f"{name}.log", folder / f"{name}.pid",
                                    device if d is None else devices.worker_device(d),
                                    {} if d is None else devices.worker_env(d)))
    return slots


def _lease_slot(slot: WorkerSlot, lease: DeviceLease | None, devices: NodeDevices | None) -> None:
    """Take the worker's lease: on its own device of a device set, else as the single worker always did."""
    if devices is None or slot.device is None:
        slot.lease, env = take_lease(lease)
        slot.ledger_path = lease.ledger_path if lease is not None else None
        slot.env = {**slot.env, **env}
        return
    if not devices.ledger_path:
        return
    from tinker_pipelines.scheduler.ledger import Ledger, LeaseOwner
    from tinker_pipelines.scheduler.placement import StepNeeds

    slot.lease = Ledger(devices.ledger_path).acquire(
        LeaseOwner.current(step_key=f"tinker-service: {slot.label}"), StepNeeds(1, devices.memory_gb, "lora"),
        devices.inventory, timeout_s=devices.timeout_s, poll_s=0.5, only=(slot.device,))
    slot.ledger_path = devices.ledger_path


def _starter(slot: WorkerSlot, dtype: str, extra: list[str]):
    from tinker_pipelines.worker.client import start_worker

    def start() -> subprocess.Popen:
        proc = start_worker(slot.base, slot.address, device=slot.device_arg, dtype=dtype, extra=extra, log=slot.log,
                            env=slot.env, die_with_parent=True)
        slot.pid_file.write_text(str(proc.pid))
        return proc
    return start


def _start_all(starters: list, keepers: threading.Event) -> list[subprocess.Popen]:
    """Start every worker, several at once. A worker dies with the thread that started it (its
    parent-death signal), so each is started by a thread that lives until the service stops."""
    if len(starters) == 1:
        return [starters[0]()]
    futures: list[Future] = []
    for i, start in enumerate(starters):
        fut: Future = Future()

        def keep(start=start, fut=fut) -> None:
            try:
                fut.set_result(start())
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                fut.set_exception(e)
                return
            keepers.wait()
        threading.Thread(target=keep, name=f"tinker-worker-start-{i}", daemon=True).start()
        futures.append(fut)
    wait(futures)
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        _stop_workers([f.result() for f in futures if f.exception() is None])
        raise failed[0]
    return [f.result() for f in futures]


def start_service(model: str | list[str], port: int = 0, home: Path | None = None, api_key: str | None = None,
                  host: str = DEFAULT_HOST, device: str = "auto", dtype: str = "auto", tracker: Any = None,
                  gap_timeout_s: float = 60.0, worker_args: list[str] | None = None,
                  settings: TinkerSettings | None = None, lease: DeviceLease | None = None,
                  max_lora_rank: int = 64, pass_tokens: int = TINKER_PASS_TOKENS,
                  worker_timeout_s: float | None = WORKER_TIMEOUT_S, devices: NodeDevices | None = None,
                  **service_options: Any) -> ServiceHandle:
    """Start the workers for `model` (a base, or several: the first is the default) and serve them
    in a thread of this process: one worker on `device` under a `lease`, or, with `devices`, one
    worker per base on each device of the set, which this service claims for itself. A supervisor
    per worker restarts it, with the same arguments on the same socket, when it dies or hangs
    (`supervisor.py`); every worker call is bounded by `worker_timeout_s`."""
    import tempfile

    settings = settings or TinkerSettings(api_key=api_key)
    keys = settings.accepted()  # a key the SDK would refuse is refused here, before anything starts
    check_host(host, None if keys.open else "set")
    models = [model] if isinstance(model, str) else list(model)
    check_bases(models)
    home = Path(home or tempfile.mkdtemp(prefix="tinker-service-"))
    home.mkdir(parents=True, exist_ok=True)
    claims = claim_devices(devices, home) if devices is not None else None
    slots = plan_workers(models, home, device, devices)
    keepers = threading.Event()
    extra = ["--max-lora-rank", str(max_lora_rank), *(worker_args or [])]
    try:
        for slot in slots:
            _lease_slot(slot, lease, devices)
        starters = [_starter(slot, dtype, extra) for slot in slots]
        procs = _start_all(starters, keepers)
    except BaseException:
        _release(slots, claims)
        keepers.set()
        raise
    try:
        handle = _serve_slots(slots, procs, starters, home, host, port, settings, keys, tracker, gap_timeout_s,
                              max_lora_rank, pass_tokens, worker_timeout_s, service_options)
    except BaseException:
        _stop_workers(procs)
        _release(slots, claims)
        keepers.set()
        raise
    handle.claims, handle._keepers = claims, keepers
    return handle


def _serve_slots(slots: list[WorkerSlot], procs: list[subprocess.Popen], starters: list, home: Path, host: str,
                 port: int, settings: TinkerSettings, keys: Any, tracker: Any, gap_timeout_s: float,
                 max_lora_rank: int, pass_tokens: int, worker_timeout_s: float | None,
                 service_options: dict[str, Any]) -> ServiceHandle:
    """Supervisors and runtimes for the started workers, the app over them, serving in a thread."""
    import uvicorn

    from tinker_pipelines.serving.tinker.supervisor import WorkerSupervisor

    for slot, proc, start in zip(slots, procs, starters):
        slot.supervisor = WorkerSupervisor(proc, start, slot.address, slot.label, log_path=slot.log)
    first = slots[0]
    node = None
    if len(slots) > 1:
        for slot in slots:
            slot.runtime = Runtime(slot.address, pass_tokens=pass_tokens, timeout_s=worker_timeout_s,
                                   supervisor=slot.supervisor)
        bases = list(dict.fromkeys(s.base for s in slots))
        node = Node([NodeWorker(s.base, s.runtime, s.device, s.label) for s in slots],
                    {b: base_aliases(b) for b in bases})
    app, service = build_app(first.base, first.address, home, settings, tracker, gap_timeout_s, max_lora_rank,
                             pass_tokens, worker_timeout_s, first.supervisor, node=node, **service_options)
    first.runtime = service.runtime
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = f"http://{host}:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    loop: list[asyncio.AbstractEventLoop] = []
    thread = threading.Thread(target=_serve, args=(server, sock, loop), daemon=True)
    thread.start()
    wait_healthy(url, max(60, 10 * len(slots)), key=next(iter(keys.by_key), None))
    handle = ServiceHandle(url, procs[0], service, server, thread, first.lease, first.ledger_path, first.supervisor,
                           slots)
    for slot in slots:
        def restarted(generation: int, slot: WorkerSlot = slot) -> None:  # the service's state lives in its loop
            if slot is first:
                handle.worker = slot.supervisor.proc
            loop[0].call_soon_threadsafe(service.worker_restarted, generation, slot.runtime)
        slot.supervisor.listeners.append(restarted)
        slot.supervisor.start()
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
