"""`tinker-pipelines serve` and `tinker-pipelines export`: argument checks, then the endpoint or
the export; every fault is one line `error: ...`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tinker_pipelines.cli.support import flags_named, parse_model_kwargs, one_line


def cmd_serve(args: argparse.Namespace) -> int:
    """The endpoint on `--host`:`--port`; every fault before it serves is one line `error: ...`."""
    import json
    import socket

    from tinker_pipelines.serving import ServingError

    try:
        kwargs = parse_model_kwargs(args.model_kwargs)
        for name, v in (("--max-adapters", args.max_adapters), ("--max-concurrent", args.max_concurrent)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not 0 <= args.port < 65536:
            raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
        if args.model is None and not args.models and not args.worker:
            raise ValueError("name the base with --model, or a registered version (MODEL@ALIAS) to serve its base")
        if args.model:  # last: these load torch
            from tinker_pipelines.models import check_model_kwargs, check_model_name

            with flags_named():
                check_model_name(args.model)
                check_model_kwargs(args.model, kwargs, "--model-kwargs")
    except (ValueError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))  # before the model loads: a taken port fails at once
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        from tinker_pipelines.serving.launch import build_server

        server = build_server(args.model, args.models[0] if args.models else None, args.worker or None,
                              args.max_adapters, seed=args.seed, model_kwargs=kwargs, device=args.device,
                              dtype=args.dtype, max_concurrent=args.max_concurrent)
        for ref in args.models:  # loaded now, so the first request does not wait for them
            _preload(server, ref)
    except ServingError as e:
        print(f"error: {one_line(e.message)}", file=sys.stderr)
        return 1
    except Exception as e:  # a missing registry, a broken model directory, an unreachable worker
        print(f"error: {one_line(e if isinstance(e, ValueError) else f'{type(e).__name__}: {e}')}", file=sys.stderr)
        return 1
    import uvicorn

    from tinker_pipelines.serving.app import build_app

    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {server.base_name}{''.join(', ' + r for r in args.models)} at http://{host}:{sock.getsockname()[1]}/v1",
          flush=True)
    uvicorn.Server(uvicorn.Config(build_app(server), log_level="warning")).run(sockets=[sock])
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Export a checkpoint directory or a registered version; faults are one line `error: ...`."""
    from tinker_pipelines.bases import BaseMissing
    from tinker_pipelines.checkpoint import CheckpointError
    from tinker_pipelines.config import ConfigError
    from tinker_pipelines.serving.export import ExportError, export_checkpoint, export_version
    from tinker_pipelines.serving import ServingError

    try:
        if args.tolerance <= 0:
            raise ValueError(f"--tolerance must be > 0, got {args.tolerance}")
        if not Path(args.source).is_dir() and _looks_like_path(args.source):
            raise ValueError(f"checkpoint directory {args.source} does not exist (a registered version is "
                             "MODEL@ALIAS, MODEL/VERSION or MODEL)")
        if Path(args.source).is_dir():
            record = export_checkpoint(args.source, args.out, args.base or None, not args.no_merged,
                                       args.tolerance, args.device)
        elif args.base:
            raise ValueError("--base is for a checkpoint directory; a registered version's base is found "
                             f"from its record ({args.source} is not a directory)")
        else:
            record = export_version(args.source, args.out, merged=not args.no_merged, tolerance=args.tolerance,
                                    device=args.device)
    except ServingError as e:
        print(f"error: {one_line(e.message)}", file=sys.stderr)
        return 1
    except (ValueError, ExportError, CheckpointError, BaseMissing, ConfigError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    out = Path(args.out)
    diffs = record["max_logit_diff"]
    print(f"exported {record['source']} to {out}")
    print(f"  base:    {out / 'base'}  ({record['base']['identity_here']})")
    print(f"  adapter: {out / 'adapter'}  (PEFT; max logit difference {diffs['adapter']:.2g})")
    if "merged" in diffs:
        print(f"  merged:  {out / 'merged'}  (safetensors; max logit difference {diffs['merged']:.2g})")
    for problem in record["vllm_format_problems"]:
        print(f"  warning: vLLM would refuse the adapter: {problem}")
    return 0


def _looks_like_path(source: str) -> bool:
    """Whether an export source is meant as a directory (not MODEL@ALIAS, MODEL/VERSION or MODEL)."""
    import re

    return (source.startswith(("/", ".", "~")) or Path(source).exists()
            or ("/" in source and not re.fullmatch(r"[^/@]+/\d+", source)))


def _preload(server, ref: str) -> None:
    import asyncio

    _, key, _ = asyncio.run(server.acquire(ref))
    server.release(key)
