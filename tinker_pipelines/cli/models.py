"""`tinker-pipelines model-dir NAME --out DIR`: a catalogue model as a Hugging Face directory
(`tiny --arch qwen3_5`: a tiny random model of one of the families users train)."""

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
        if args.arch is not None:
            from tinker_pipelines.models.tiny import TINY_ARCHS

            if args.name != "tiny":
                raise ValueError(f"--arch builds tiny models only, not {args.name!r}")
            if args.arch not in TINY_ARCHS:
                raise ValueError(f"--arch must be one of {', '.join(TINY_ARCHS)}, got {args.arch!r}")
            if "arch" in kwargs:
                raise ValueError("--arch and --model-kwargs' arch: give one of them")
            kwargs["arch"] = args.arch
        out, written = write_model_dir(args.name, args.out, seed=args.seed, overwrite=args.overwrite, **kwargs)
    except (ValueError, CheckpointError, ModelNotAvailableError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    what = f"{args.name} ({kwargs['arch']})" if "arch" in kwargs else args.name
    print(f"{'wrote' if written else 'already there:'} {what} as a Hugging Face directory {out}")
    print(f"  model_name for Tinker clients (tinker-cookbook's model_name=): {out}")
    return 0


def add_parser(sub) -> None:
    m = sub.add_parser("model-dir", help="a catalogue model as a Hugging Face directory (tokenizer, chat "
                                         "template), the model_name Tinker clients and the cookbook can open")
    m.add_argument("name", help="catalogue model: tiny or smollm2-135m-instruct")
    m.add_argument("--out", required=True, help="directory to write (kept as it is when it already holds NAME)")
    m.add_argument("--model-kwargs", default="",
                   help="JSON builder arguments (for tiny: hidden_size, num_layers, arch)")
    m.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    m.add_argument("--arch", default=None,
                   help="build tiny as this family, random weights from transformers' config class: llama (the "
                        "default), llama3, qwen2, qwen3, qwen3_5 or mistral")
    m.add_argument("--overwrite", action="store_true", help="replace an existing --out that holds something else")
    m.set_defaults(func=cmd_model_dir)
