"""`tinker-pipelines train CONFIG.yaml`: SFT warm start then RL, in a plain Python loop;
`tinker-pipelines worker --model NAME`: a resident device worker hosting many experiments' adapters;
`tinker-pipelines serve [MODEL@ALIAS ...]`: an OpenAI-compatible endpoint over the base and registered adapters;
`tinker-pipelines export SOURCE --out DIR`: an adapter as a PEFT directory, its base and merged weights;
`tinker-pipelines tinker serve --model NAME`: Tinker's API for the tinker SDK and tinker-cookbook;
`tinker-pipelines model-dir NAME --out DIR`: a catalogue model as a Hugging Face directory (for Tinker clients)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tinker_pipelines.cli import models as models_cli
from tinker_pipelines.cli.serving import cmd_export, cmd_serve
from tinker_pipelines.cli.tinker import add_parser as add_tinker_parser
from tinker_pipelines.cli.support import flags_named, one_line, parse_model_kwargs, warnings_as_lines
from tinker_pipelines.worker import default_socket

# torch (which `tinker_pipelines.config` pulls in) loads only once a command runs: `serve` and
# `worker` must set OMP_WAIT_POLICY (and `worker` GOMP_SPINCOUNT) before libgomp starts (see `main`).

WORKER_SPINCOUNT = 10_000
"""Spins an idle OpenMP thread of a worker makes before it sleeps (libgomp's `GOMP_SPINCOUNT`;
its default is 300k, 0 under OMP_WAIT_POLICY=PASSIVE). Measured on 2 cores, SmolLM2 Tinker
forward_backward of 64 datums: 1k, 10k and 100k spins all 4.0-5.4 s, 0 spins 5.3-7.8 s."""


def _fmt(metrics: dict[str, float]) -> str:
    keys = ("iteration", "reward_mean", "exact_rate", "eval/exact_rate", "eval/reward_mean", "loss", "kl",
            "grad_norm", "sampled_tokens", "time/iteration_s")
    parts = []
    for k in keys:
        if k in metrics:
            v = metrics[k]
            parts.append(f"{k}={int(v)}" if k in ("iteration", "sampled_tokens") else f"{k}={v:.4g}")
    return " ".join(parts)


def _yaml_problem(path: str, e: Exception) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or e
    return f"config file {path} is not valid YAML: {problem}{where}"


def _describe(e: BaseException, config_path: str, output_dir: str | None) -> tuple[str, int]:
    """(the one-line message, the exit status) for a fault that ended `train`; `output_dir` is
    None while the config is being read.

    The project's errors already name their cause (the field, the environment, the checkpoint),
    so they are printed as they are; anything else keeps its type, so it can be searched for."""
    import yaml

    from tinker_pipelines.checkpoint import CheckpointError
    from tinker_pipelines.config import ConfigError
    from tinker_pipelines.envs import EnvError
    from tinker_pipelines.worker import WorkerError

    reading_config = output_dir is None
    if isinstance(e, KeyboardInterrupt):
        kept = "" if reading_config else f"; checkpoints written so far are kept in {output_dir}"
        return f"interrupted{kept}", 130
    if isinstance(e, yaml.YAMLError):
        return _yaml_problem(config_path, e), 2
    if isinstance(e, ConfigError) or reading_config and isinstance(e, ValueError):
        return str(e), 2
    if isinstance(e, (CheckpointError, EnvError, WorkerError)):
        return str(e), 1
    if isinstance(e, OSError):
        where = "cannot read the config file" if reading_config else \
            f"a file under output_dir {output_dir} could not be written or read"
        detail = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
        return f"{where}: {detail}", 1
    if _write_failed(e):
        return f"writing a checkpoint under output_dir {output_dir} failed: {e}", 1
    if isinstance(e, ValueError):  # the library's own ValueErrors (context overflow, checkpoints) name their cause
        return str(e), 1
    return f"{type(e).__name__}: {e}", 1


def _write_failed(e: BaseException) -> bool:
    """Whether `e` is a failed file write that its library reports as its own error type
    (safetensors' SafetensorError, torch's PytorchStreamWriter), e.g. on a full disk."""
    return type(e).__module__.startswith("safetensors") or "PytorchStreamWriter failed" in str(e)


def cmd_train(args: argparse.Namespace) -> int:
    from tinker_pipelines.config import load_config

    output_dir = None
    bars: list = []
    try:
        cfg = load_config(args.config)
        if args.output_dir is not None:
            from dataclasses import replace

            from tinker_pipelines.config import ConfigError

            if not args.output_dir.strip():
                raise ConfigError("--output-dir must be a path (not empty)")
            cfg = replace(cfg, output_dir=args.output_dir)
        output_dir = cfg.output_dir
        _train(args, cfg, bars)
    except (Exception, KeyboardInterrupt) as e:
        if args.traceback:
            raise
        for bar in bars:  # end the progress lines, so the error starts a line of its own
            bar.close()
        message, status = _describe(e, args.config, output_dir)
        print(f"error: {one_line(message)}", file=sys.stderr)
        return status
    for bar in bars:
        bar.close()
    print(f"done: checkpoints and metrics.jsonl in {cfg.output_dir}")
    return 0


def _train(args: argparse.Namespace, cfg, bars: list) -> None:
    from tqdm import tqdm

    from tinker_pipelines.loops.train import train

    sft_bar = tqdm(total=cfg.sft.steps, desc="sft", unit="step", disable=not cfg.sft.steps, file=sys.stderr)
    rl_bar = tqdm(total=cfg.training.iterations, desc="rl", unit="it", file=sys.stderr)
    bars += [sft_bar, rl_bar]

    def on_sft(step: int, m: dict[str, float]) -> None:
        sft_bar.update(1)
        sft_bar.set_postfix(loss=f"{m['loss']:.3f}")

    def on_iter(m: dict[str, float]) -> None:
        if m["iteration"] >= 0:
            rl_bar.update(1)
        tqdm.write(_fmt(m), file=sys.stdout)

    if not args.worker:  # on a worker the worker's own log says which dtype it chose
        from tinker_pipelines.models import dtype_note, resolve_dtype

        note = dtype_note(cfg.model.dtype, cfg.model.device, resolve_dtype(cfg.model.dtype, cfg.model.device))
        if note:
            tqdm.write(note, file=sys.stdout)
    train(cfg, on_iteration=on_iter, on_sft_step=on_sft, resume=args.resume, worker=args.worker or None,
          overwrite=args.overwrite)


def cmd_worker(args: argparse.Namespace) -> int:
    import importlib
    import json

    try:
        kwargs = parse_model_kwargs(args.model_kwargs)
        from tinker_pipelines.models import base_identity, check_model_kwargs, check_model_name, resolve_device, \
            resolve_dtype

        with flags_named():
            check_model_name(args.model)
            check_model_kwargs(args.model, kwargs, "--model-kwargs")
            device = resolve_device(args.device)
            dtype = resolve_dtype(args.dtype, device)
        if args.socket and len(str(Path(args.socket).resolve())) > 100:
            raise ValueError(f"--socket {Path(args.socket).resolve()} is too long for a Unix socket (100 characters at most)")
        for name in args.imports:
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise ValueError(f"--import {name}: {e}") from None
        if args.max_train_rows < 0:
            raise ValueError(f"--max-train-rows must be >= 0, got {args.max_train_rows}")
        for name, v in (("--max-rows", args.max_rows), ("--max-lora-rank", args.max_lora_rank)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        for name, v in (("--park-ttl-s", args.park_ttl_s), ("--window-ms", args.window_ms), ("--hold-ms", args.hold_ms)):
            if not v >= 0:
                raise ValueError(f"{name} must be >= 0, got {v:g}")
        # The lease comes before the socket: a worker's socket is keyed by the physical device it holds
        from tinker_pipelines.scheduler.workers import placement_base

        lease, key = _worker_lease(args, device, placement_base(args.model, kwargs, args.seed),
                                   lambda: _base_weights_gb(args.model, kwargs, dtype))
        if lease is not None:
            print(f"worker lease {lease.id}: device {lease.devices[0]} ({lease.needs}), {key}", flush=True)
        socket = Path(args.socket or default_socket(base_identity(args.model, kwargs, args.seed), key))
        if len(str(socket.resolve())) > 100:
            raise ValueError(f"--socket {socket.resolve()} is too long for a Unix socket (100 characters at most)")
        from tinker_pipelines.worker.server import socket_path_problem

        problem = socket_path_problem(socket.absolute())  # before loading the model
        if problem:
            raise ValueError(f"--socket {socket}: {problem}")
    except (ValueError, ImportError, json.JSONDecodeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    from tinker_pipelines.models import load_model, stop_token_ids
    from tinker_pipelines.worker.engine import Engine, EngineConfig
    from tinker_pipelines.worker.server import WorkerServer

    if args.threads:
        torch.set_num_threads(args.threads)
    from tinker_pipelines.models import dtype_note

    note = dtype_note(args.dtype, device, dtype)
    if note:
        print(note, flush=True)
    try:
        model, tok = load_model(args.model, seed=args.seed, dtype=dtype, device=device, **kwargs)
    except Exception as e:  # a broken model directory, bad builder kwargs, no memory on the device
        print(f"error: cannot load model {args.model!r}: {one_line(f'{type(e).__name__}: {e}')}", file=sys.stderr)
        return 1
    model.requires_grad_(False)
    engine = Engine(model, tok.pad_token_id, stop_token_ids(tok), base_identity(args.model, kwargs, args.seed),
                    EngineConfig(batching=not args.no_batching, max_rows=args.max_rows, max_train_rows=args.max_train_rows,
                                 max_lora_rank=args.max_lora_rank, exclusive=args.exclusive,
                                 park_ttl_s=args.park_ttl_s), tokenizer=tok, device_key=key)
    try:
        WorkerServer(engine, socket.resolve(), window_s=args.window_ms / 1000, hold_s=args.hold_ms / 1000).serve_forever()
    except OSError as e:
        print(f"error: cannot listen on {socket}: {e}", file=sys.stderr)
        return 1
    return 0


def _base_weights_gb(model: str, kwargs: dict, dtype) -> float:
    """What a worker started by hand leases unless told (`--lease-memory-gb`): its base's weights
    at its dtype, from the model's config (`scheduler.estimate`)."""
    from tinker_pipelines.models import model_config
    from tinker_pipelines.scheduler.estimate import ModelShape

    return ModelShape.from_config(model_config(model, kwargs)).parameters() * dtype.itemsize / 1e9


def _worker_lease(args: argparse.Namespace, device, base: str, weights_gb=lambda: 0.0):
    """(this worker's own 'lora' lease or None, the physical identity of its device). Started by
    a leased step: a lease on the step's device, which lives as long as this worker, so no
    exclusive step is placed where the base model sits. Started by hand with a ledger named
    (`--ledger`, else $TINKER_LEDGER): a lease like any step's, on its GPU (by UUID), or for a
    simulated or CPU inventory on `--lease-device` (default: where the ledger places it). The
    owner's step key names the base (`worker:<base>`). Raises ValueError / TimeoutError."""
    from tinker_pipelines.scheduler import workers
    from tinker_pipelines.scheduler.step_entry import LEDGER_ENV, hold_worker_lease

    cuda_index = (device.index or 0) if device.type == "cuda" else None
    step_key = workers.worker_step_key(base)
    held = workers.step_lease(os.environ)
    if held is not None:
        if args.lease_device is not None:
            raise ValueError("--lease-device is for a worker started by hand; this one inherits its step's lease "
                             f"(TINKER_LEASE_DEVICES={os.environ['TINKER_LEASE_DEVICES']})")
        lease = hold_worker_lease(os.environ, cuda_index, args.lease_memory_gb, args.lease_timeout_s, step_key)
        return lease, workers.leased_device_key(held[0], lease.devices[0], held[2])
    ledger_path = os.environ.get(LEDGER_ENV, "") if args.ledger is None else args.ledger
    if not ledger_path:
        if args.lease_device is not None or args.inventory:
            raise ValueError("--lease-device and --inventory need a ledger (--ledger or TINKER_LEDGER)")
        return None, workers.worker_device_key(device.type, cuda_index)
    inventory, only = _hand_lease_devices(args, device, cuda_index)
    from tinker_pipelines.scheduler.ledger import Ledger, LeaseOwner
    from tinker_pipelines.scheduler.placement import StepNeeds

    memory = weights_gb() if args.lease_memory_gb is None else args.lease_memory_gb
    if not memory > 0:
        raise ValueError(f"--lease-memory-gb must be > 0, got {memory:g}")
    import sqlite3

    try:
        lease = Ledger(ledger_path).acquire(LeaseOwner.current(step_key=step_key), StepNeeds(1, memory, "lora"),
                                            inventory, timeout_s=args.lease_timeout_s, poll_s=0.2, only=only)
    except (ValueError, TimeoutError, OSError, sqlite3.Error) as e:
        raise ValueError(f"--ledger {ledger_path}: no lease for this worker: {one_line(str(e))}") from None
    return lease, workers.leased_device_key(inventory, lease.devices[0], ledger_path)


def _hand_lease_devices(args: argparse.Namespace, device, cuda_index: int | None):
    """(the inventory a worker started by hand leases from, the devices it may get or None)."""
    import json

    from tinker_pipelines.scheduler import workers
    from tinker_pipelines.scheduler.inventory import Inventory, InventoryError
    from tinker_pipelines.scheduler.step_entry import INVENTORY_ENV

    text = args.inventory or os.environ.get(INVENTORY_ENV, "")
    try:
        spec = json.loads(text) if text else None
        if spec is None:
            inventory = Inventory.detect()
        elif isinstance(spec, dict) and isinstance(spec.get("devices"), list) and spec["devices"] and all(
                isinstance(d, dict) and "kind" in d for d in spec["devices"]):
            inventory = Inventory.from_dict(spec)
        else:
            inventory = Inventory.from_config(spec, field="--inventory")
    except (json.JSONDecodeError, InventoryError, KeyError, TypeError) as e:
        raise ValueError(f"--inventory {text!r}: {one_line(str(e))}") from None
    only = None
    if cuda_index is not None:
        uuid = workers.cuda_device_key(cuda_index)
        index = workers.inventory_index(inventory, uuid)
        if index is None:
            raise ValueError(f"--device {device} is {uuid}, which the ledger's inventory does not list")
        only = (index,)
    if args.lease_device is not None:
        if not 0 <= args.lease_device < len(inventory):
            raise ValueError(f"--lease-device {args.lease_device} is not a device of the inventory "
                             f"(0..{len(inventory) - 1})")
        if only is not None and only != (args.lease_device,):
            raise ValueError(f"--lease-device {args.lease_device} is not --device {device} (inventory device {only[0]})")
        only = (args.lease_device,)
    return inventory, only


def _add_worker_parser(sub) -> None:
    w = sub.add_parser("worker", help="a resident worker: one base model on one device, many experiments' adapters")
    w.add_argument("--model", default="tiny", help="catalog name or model directory (the base every adapter shares)")
    w.add_argument("--model-kwargs", default="",
                   help="JSON builder arguments (for tiny: hidden_size, num_layers, arch)")
    w.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    w.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    w.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    w.add_argument("--socket", default="", help="Unix socket path (default under .tinker/workers/)")
    w.add_argument("--no-batching", action="store_true",
                   help="serve one request at a time, exactly as in-process (no cross-experiment batches)")
    w.add_argument("--window-ms", type=float, default=20.0, help="how long a batch waits for other clients")
    w.add_argument("--hold-ms", type=float, default=250.0,
                   help="how long held samples wait for clients busy with other calls to sample too (0: no holding)")
    w.add_argument("--max-rows", type=int, default=256, help="most sequences in one sample batch")
    w.add_argument("--max-train-rows", type=int, default=0,
                   help="most sequences in one training pass shared by several experiments (0: none shared, "
                        "so each experiment's gradients are exactly its solo run's)")
    w.add_argument("--max-lora-rank", type=int, default=64, help="largest LoRA rank an experiment may use")
    w.add_argument("--exclusive", action="store_true", help="host one experiment, which may train every parameter")
    w.add_argument("--park-ttl-s", type=float, default=600.0,
                   help="how long an adapter a finished step process parked waits for the next one to claim it")
    w.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    w.add_argument("--ledger", default=None,
                   help="device ledger to take this worker's own lease from before loading the model "
                        "(default: $TINKER_LEDGER; '' : none); a step's worker inherits its step's")
    w.add_argument("--inventory", default="",
                   help="with --ledger: the inventory as JSON (a simulated one: {\"count\": 8, \"memory_gb\": 80}); "
                        "default: $TINKER_LEASE_INVENTORY, else the GPUs NVML lists")
    w.add_argument("--lease-device", type=int, default=None,
                   help="with --ledger: the inventory index to lease (default: the --device GPU, or where the ledger "
                        "places it)")
    w.add_argument("--lease-memory-gb", type=float, default=None,
                   help="GB its own lease reserves on its device (default: its base's weights where the step "
                        "that started it estimated them, else what that step reserved; started by hand, its "
                        "base's weights at its dtype)")
    w.add_argument("--lease-timeout-s", type=float, default=120.0,
                   help="how long to wait for its own lease")
    w.add_argument("--import", dest="imports", action="append", default=[],
                   help="import this module first (custom algorithms registered there); repeatable")
    w.set_defaults(func=cmd_worker)


def main(argv: list[str] | None = None) -> int:
    from tinker_pipelines.training.allocator import retain_freed_memory

    retain_freed_memory()  # workers, training and serving sample and train in this process
    warnings_as_lines()
    parser = argparse.ArgumentParser(prog="tinker-pipelines", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="SFT warm start (if configured) then RL from one YAML config")
    p.add_argument("config", help="path to the YAML config")
    p.add_argument("--output-dir", help="override output_dir")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an output_dir that holds an earlier run (deletes its checkpoints and metrics)")
    p.add_argument("--worker", help="train on the resident worker listening at this socket (LoRA)")
    p.add_argument("--traceback", action="store_true",
                   help="on an error, raise it with its traceback instead of printing one line (debugging)")
    p.set_defaults(func=cmd_train)
    _add_worker_parser(sub)
    s = sub.add_parser("serve", help="an OpenAI-compatible endpoint over the base model and registered adapters")
    s.add_argument("models", nargs="*", metavar="MODEL@ALIAS",
                   help="registered versions to load at start (MODEL@ALIAS, MODEL/VERSION); the first names the "
                        "base when --model is not given")
    s.add_argument("--model", help="the base: catalog name or model directory (default: the first version's base)")
    s.add_argument("--model-kwargs", default="", help="JSON builder arguments of the base (for tiny: hidden_size, ...)")
    s.add_argument("--seed", type=int, default=0, help="seed of the tiny base's weights (with --model tiny)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    s.add_argument("--max-adapters", type=int, default=4, help="adapters kept loaded (least recently used evicted)")
    s.add_argument("--max-concurrent", type=int, default=64, help="requests decoding at once (others wait)")
    s.add_argument("--worker", help="serve from the resident worker at this socket instead of in-process")
    s.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (in-process engine)")
    s.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    s.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    s.set_defaults(func=cmd_serve)
    e = sub.add_parser("export", help="a trained adapter as a PEFT directory, its base and merged safetensors")
    e.add_argument("source", help="a checkpoint directory, or a registered version (MODEL@ALIAS, MODEL/VERSION)")
    e.add_argument("--out", required=True, help="directory to create (must not exist)")
    e.add_argument("--base", default="", help="for a checkpoint directory trained on an SFT warm start: that base")
    e.add_argument("--no-merged", action="store_true", help="skip the merged full weights")
    e.add_argument("--tolerance", type=float, default=1e-4, help="largest logit difference accepted on reload, relative to the largest |logit|")
    e.add_argument("--device", default="cpu", help="where to load the models for the check (cpu, cuda, cuda:N)")
    e.set_defaults(func=cmd_export)
    add_tinker_parser(sub)
    models_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command in ("serve", "worker", "tinker"):
        # A compute thread beside request threads: libgomp's default lets torch's idle OpenMP
        # worker spin between ops and take the core they need (docs/serving.md, "Figures").
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.command == "worker":
        # ...but never spinning costs a training pass's thousands of small ops a wake-up each
        # (SmolLM2 forward_backward 7.2-7.8 s against 4.3-5.3 s); a short spin keeps most of
        # that and cannot hold a core for long. It overrides the wait policy's spin (libgomp).
        os.environ.setdefault("GOMP_SPINCOUNT", str(WORKER_SPINCOUNT))
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C before a command installed its own handler (e.g. while importing torch)
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
