"""Checkpoint directories: written atomically, identified by a content hash, loaded safely.

A checkpoint holds the weights (a PEFT adapter or full weights, in safetensors), `optimizer.pt`,
`rng.pt` and `record.json` (config, base model, iteration, metrics, content hash). Tensors are
loaded with `weights_only=True`, so a checkpoint cannot run code when it is opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

RECORD = "record.json"
_HASHED_SUFFIXES = (".safetensors",)


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces `path` only if the block succeeds.

    A crash mid-write leaves any previous checkpoint at `path` intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def content_hash(path: str | Path) -> str:
    """sha256 over the weight files of a checkpoint (names and bytes), as hex."""
    h = hashlib.sha256()
    for f in sorted(Path(path).rglob("*")):
        if f.is_file() and f.name.endswith(_HASHED_SUFFIXES):
            h.update(f.relative_to(path).as_posix().encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def write_record(path: str | Path, record: dict[str, Any]) -> dict[str, Any]:
    """Write `record.json` with the content hash added; returns the written record."""
    record = {**record, "content_hash": content_hash(path)}
    (Path(path) / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
    return record


def read_record(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """The checkpoint's record; with `verify`, fail if the weights do not match its hash."""
    f = Path(path) / RECORD
    if not f.exists():
        raise FileNotFoundError(f"{path} is not a checkpoint: no {RECORD}")
    record = json.loads(f.read_text())
    if verify and record.get("content_hash") != content_hash(path):
        raise ValueError(f"checkpoint {path} is corrupt: weights do not match the recorded content hash")
    return record


def rng_state() -> dict[str, Any]:
    """The process's RNG states (python, numpy, torch, and every CUDA device's when there are any)."""
    np_state = np.random.get_state()
    state = {"python": list(random.getstate()[1]), "python_version": random.getstate()[0],
             "python_gauss": random.getstate()[2], "numpy_keys": torch.from_numpy(np_state[1].copy()),
             "numpy_pos": int(np_state[2]), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states saved by `rng_state`."""
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy(), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
