"""`tinker-pipelines tinker serve`: Tinker's API (and the OpenAI endpoint) over resident workers:
one for one base, or one per base (`--model A --model B`) and device (`--devices`).

Every fault before it serves is one line `error: ...`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("tinker", help="Tinker's API for the tinker SDK and tinker-cookbook, on our own worker")
    tsub = t.add_subparsers(dest="tinker_command", required=True)
    s = tsub.add_parser("serve", help="serve /api/v1 (Tinker) and /v1 (OpenAI) over resident workers")
    s.add_argument("--model", required=True, action="append",
                   help="a base: catalog name or model directory (clients name it so); repeat for several bases "
                        "(the first is the default, and the one the OpenAI endpoint serves)")
    s.add_argument("--home", default=".tinker/service",
                   help="where checkpoints (tinker://...), run metadata and the worker's socket live")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (non-loopback needs --api-key-env)")
    s.add_argument("--port", type=int, default=8001, help="port (0: any free one)")
    s.add_argument("--api-key-env", default="",
                   help="name of an environment variable holding the key every client must send (X-API-Key, or "
                        "Authorization: Bearer on /v1); without it (or --api-keys-file) any key is accepted, on "
                        "loopback only")
    s.add_argument("--api-keys-file", default="",
                   help="a file of keys, one 'KEY [NAME]' a line, each a tenant that sees only its own sessions, runs, "
                        "checkpoints and samplers (a published checkpoint is readable by all)")
    s.add_argument("--min-ttl-s", type=int, default=3600,
                   help="the shortest ttl_seconds a save or set_checkpoint_ttl accepts (hosted Tinker's: 3600)")
    s.add_argument("--device", default="auto", help="the worker's device: auto, cpu, cuda or cuda:N")
    s.add_argument("--devices", default="",
                   help="serve over these devices of the inventory: indices (0,1,2,3) or 'all'; one worker per base "
                        "on each, every new training client on the least-loaded worker of its base, and each "
                        "device claimed by this service alone")
    s.add_argument("--inventory", default="",
                   help="a simulated inventory for --devices (JSON or a JSON file, as the executor's "
                        "scheduler.inventory: {\"count\": 4, \"memory_gb\": 80}); default: the GPUs NVML lists "
                        "(the CPU when there are none)")
    s.add_argument("--dtype", default="auto", help="auto, float32, bfloat16")
    s.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body accepted")
    s.add_argument("--gap-timeout-s", type=float, default=60.0,
                   help="how long a training call waits for the seq_id before it before failing")
    s.add_argument("--worker-timeout-s", type=float, default=None,
                   help="longest a worker call may take before the worker counts as hung and is restarted "
                        "(default: serving.tinker.runtime.WORKER_TIMEOUT_S, 900; a call waits behind the other "
                        "clients' calls, so it is far above the slowest training step)")
    s.add_argument("--ledger", default="",
                   help="the device ledger shared with Dagster's GPU executor (default: "
                        "$DAGSTER_HOME/tinker_devices.sqlite when DAGSTER_HOME is set)")
    s.add_argument("--memory-gb", type=float, default=16.0,
                   help="GB of device memory the worker's lease reserves (base, adapters, activations)")
    s.add_argument("--max-lora-rank", type=int, default=64, help="largest LoRA rank a client may ask for")
    s.add_argument("--pass-tokens", type=int, default=None,
                   help="padded tokens per forward pass of a client's forward_backward (bounds its activations; "
                        "0: each call in one pass; default: training.rules.TINKER_PASS_TOKENS)")
    s.add_argument("--dagster-url", default="",
                   help="the Dagster webserver (e.g. http://127.0.0.1:3000) to report each saved checkpoint to as "
                        "an asset materialization of ['tinker', MODEL]")
    s.add_argument("--no-tracking", action="store_true",
                   help="no MLflow runs or registered checkpoints (checkpoints are still written to --home)")
    s.set_defaults(func=cmd_tinker_serve)


def _settings(args: argparse.Namespace):
    from tinker_pipelines.serving.tinker.app import TinkerSettings
    from tinker_pipelines.serving.tinker.launch import check_host

    from tinker_pipelines.serving.tinker.tenancy import Keys

    key, keys = None, None
    if args.api_key_env and args.api_keys_file:
        raise ValueError("--api-key-env and --api-keys-file: give one of them")
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            raise ValueError(f"--api-key-env {args.api_key_env}: that environment variable is empty or unset")
        Keys.single(key, f"--api-key-env {args.api_key_env}")
    if args.api_keys_file:
        keys = Keys.from_file(args.api_keys_file)
    check_host(args.host, key or (keys and "set"))
    if not 1 <= args.min_ttl_s <= 3600:
        raise ValueError(f"--min-ttl-s must be 1..3600, got {args.min_ttl_s}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    for name in ("max_body_mb", "gap_timeout_s", "memory_gb", "max_lora_rank"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.worker_timeout_s is not None and not args.worker_timeout_s > 0:
        raise ValueError(f"--worker-timeout-s must be > 0, got {args.worker_timeout_s}")
    if args.pass_tokens is not None and args.pass_tokens < 0:
        raise ValueError(f"--pass-tokens must be >= 0 (0: one pass per call), got {args.pass_tokens}")
    from tinker_pipelines.cli.support import flags_named
    from tinker_pipelines.models import check_model_name

    with flags_named():
        for model in args.model:
            check_model_name(model)
    from tinker_pipelines.serving.tinker.launch import check_bases

    check_bases(args.model)
    if args.device != "auto" and (args.devices or args.inventory):
        raise ValueError(f"--device {args.device} and --devices: give one of them (--devices places the workers)")
    return TinkerSettings(api_key=key, keys=keys, max_body_bytes=int(args.max_body_mb * 1024 * 1024))


def cmd_tinker_serve(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args)
        devices = _devices(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import signal
    import threading

    from tinker_pipelines.serving.tinker.launch import start_service
    from tinker_pipelines.worker import WorkerError

    # SIGTERM stops it cleanly (the worker too), from the moment it starts, even when the parent
    # left SIGTERM ignored (an ignored signal is inherited)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    tracker = None
    try:
        if not args.no_tracking:
            tracker = _tracker(args)
        handle = start_service(args.model, args.port, Path(args.home), settings.api_key, args.host, args.device,
                               args.dtype, tracker=tracker, gap_timeout_s=args.gap_timeout_s, settings=settings,
                               lease=None if devices else _lease(args), devices=devices,
                               max_lora_rank=args.max_lora_rank, min_ttl_s=args.min_ttl_s,
                               **({} if args.pass_tokens is None else {"pass_tokens": args.pass_tokens}),
                               **({} if args.worker_timeout_s is None else {"worker_timeout_s": args.worker_timeout_s}))
    except (ValueError, WorkerError, RuntimeError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"tinker service on {handle.url} (base_url for the tinker SDK; OpenAI at {handle.openai_url}), "
          f"worker pid {handle.worker_pid}, home {args.home}", flush=True)
    if len(handle.workers) > 1:
        for slot in handle.workers:
            print(f"worker {slot.label}: pid {slot.supervisor.proc.pid}, socket {slot.address}", flush=True)
    try:
        while handle._thread.is_alive() and not stop.is_set():
            handle._thread.join(timeout=0.5)  # wakes up for the signal handler
    except KeyboardInterrupt:
        pass
    finally:
        handle.stop()
    return 0


def _ledger_path(args: argparse.Namespace) -> str:
    from tinker_pipelines.scheduler.ledger import LEDGER_FILE

    return args.ledger or (str(Path(os.environ["DAGSTER_HOME"]) / LEDGER_FILE) if os.environ.get("DAGSTER_HOME")
                           else "")


def _devices(args: argparse.Namespace):
    """The device set of --devices / --inventory (None: one worker per base on --device), checked
    against the inventory before anything starts."""
    if not args.devices and not args.inventory:
        return None
    from tinker_pipelines.scheduler.inventory import Inventory, InventoryError
    from tinker_pipelines.serving.tinker.devices import NodeDevices, load_inventory, parse_devices

    try:
        inventory = load_inventory(args.inventory) if args.inventory else Inventory.detect()
    except InventoryError as e:
        raise ValueError(f"--devices: the GPUs cannot be listed: {e}") from None
    return NodeDevices(inventory, parse_devices(args.devices or "all", inventory), _ledger_path(args) or None,
                       args.memory_gb)


def _lease(args: argparse.Namespace):
    """The worker's device lease: on the ledger Dagster's executor uses, over the detected GPUs."""
    from tinker_pipelines.scheduler.inventory import Inventory
    from tinker_pipelines.serving.tinker.launch import DeviceLease

    ledger = _ledger_path(args)
    if not ledger:
        return None
    inventory = Inventory.detect()
    if len(inventory) == 0:
        print("warning: no GPU to lease; the worker runs on the CPU without a device lease", file=sys.stderr)
        return None
    return DeviceLease(ledger, inventory, args.memory_gb)


def _tracker(args: argparse.Namespace):
    """MLflow runs and registered checkpoints (`serving.tinker.lineage`), in this deployment's
    MLflow (TINKER_HOME, or TINKER_DEPLOYMENT=production); each checkpoint is reported to the
    Dagster webserver at --dagster-url."""
    from tinker_pipelines.serving.tinker.lineage import TinkerTracker, webserver_reporter

    return TinkerTracker.from_env(webserver_reporter(args.dagster_url) if args.dagster_url else None)
