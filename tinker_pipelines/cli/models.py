"""`tinker-pipelines model-dir NAME --out DIR`: a catalogue model as a Hugging Face directory."""

from __future__ import annotations

import argparse
import sys

from tinker_pipelines.cli.support import one_line, parse_model_kwargs


def cmd_model_dir(args: argparse.Namespace) -> int:
    """Write the directory (or keep the one already written from the same model); faults are one
    line `error: ...`."""
    from tinker_pipelines.checkpoint import CheckpointError
    from tinker_pipelines.models.smollm2 import ModelNotAvailableError
    from tinker_pipelines.models.hf_dir import write_model_dir

    try:
        kwargs = parse_model_kwargs(args.model_kwargs)
        out, written = write_model_dir(args.name, args.out, seed=args.seed, overwrite=args.overwrite, **kwargs)
    except (ValueError, CheckpointError, ModelNotAvailableError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    print(f"{'wrote' if written else 'already there:'} {args.name} as a Hugging Face directory {out}")
    print(f"  model_name for Tinker clients (tinker-cookbook's model_name=): {out}")
    return 0


def add_parser(sub) -> None:
    m = sub.add_parser("model-dir", help="a catalogue model as a Hugging Face directory (tokenizer, chat "
                                         "template), the model_name Tinker clients and the cookbook can open")
    m.add_argument("name", help="catalogue model: tiny or smollm2-135m-instruct")
    m.add_argument("--out", required=True, help="directory to write (kept as it is when it already holds NAME)")
    m.add_argument("--model-kwargs", default="", help="JSON builder arguments (for tiny: hidden_size, num_layers)")
    m.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    m.add_argument("--overwrite", action="store_true", help="replace an existing --out that holds something else")
    m.set_defaults(func=cmd_model_dir)
