"""Checkpoint directories: written atomically, identified by a content hash, loaded safely.

A checkpoint holds the weights (a PEFT adapter or full weights, in safetensors), `optimizer.pt`,
`rng.pt` and `record.json` (config, base model, iteration, metrics, content hash, and a manifest
of every file's size and sha256). Tensors are loaded with `weights_only=True`, so a checkpoint
cannot run code when it is opened. `record.json` is written last and is the commit marker: a
directory without it is not a checkpoint.
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


class CheckpointError(ValueError):
    """A checkpoint that is missing, partial, corrupt or made for another experiment."""


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to disk, so a rename that follows cannot
    publish a directory whose contents are still only in the page cache (power loss, kill -9 of a
    VM)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces `path` only if the block succeeds.

    The contents are fsynced before the rename and the parent after it. A crash mid-write
    leaves any previous checkpoint at `path` intact and only a hidden `.NAME.*` directory
    behind (`remove_partial` clears those).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_partial(parent: str | Path, prefix: str = "") -> list[Path]:
    """Delete the hidden temporary directories that interrupted `atomic_directory` writes of
    `parent/PREFIX*` left behind (restoring a previous version a kill left renamed aside);
    returns what was removed."""
    gone = []
    for d in sorted(Path(parent).glob(f".{prefix}*.*")):
        if not d.is_dir():
            continue
        target = d.with_name(d.name[1:-len(".old")]) if d.name.endswith(".old") else None
        if target is not None and not target.exists():  # killed between the two renames of a rewrite
            os.replace(d, target)
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def file_manifest(path: str | Path) -> dict[str, dict[str, Any]]:
    """Every file of a checkpoint but its record: relative name -> size and sha256."""
    path = Path(path)
    return {f.relative_to(path).as_posix(): {"size": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(path.rglob("*")) if f.is_file() and f.name != RECORD}


def write_record(path: str | Path, record: dict[str, Any]) -> dict[str, Any]:
    """Write `record.json` (last: it is the commit marker) with the content hash and the file
    manifest added; returns the written record."""
    record = {**record, "content_hash": content_hash(path), "files": file_manifest(path)}
    (Path(path) / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
    return record


def read_record(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """The checkpoint's record; with `verify`, fail (`CheckpointError`, naming the file) when a
    file is missing, truncated or changed since the record was written."""
    path = Path(path)
    f = path / RECORD
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not f.exists():
        raise CheckpointError(f"{path} is not a complete checkpoint: it has no {RECORD} (a write that never finished?)")
    try:
        record = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: {RECORD} is not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"checkpoint {path} is corrupt: {RECORD} is not a JSON object")
    if not verify:
        return record
    for name, want in sorted(record.get("files", {}).items()):
        g = path / name
        if not g.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if g.stat().st_size != want["size"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} has {g.stat().st_size} bytes, "
                                  f"the record says {want['size']} (truncated?)")
        if _sha256(g) != want["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} does not match its recorded sha256")
    if record.get("content_hash") != content_hash(path):
        raise CheckpointError(f"checkpoint {path} is corrupt: weights do not match the recorded content hash")
    return record


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name that is another's very tensor -> that first name (a tied output layer:
    `lm_head.weight` is `model.embed_tokens.weight` when the config ties them). `save_pretrained`
    writes one tensor per tie, so only these may be absent from a full checkpoint."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def state_fit(loaded: set[str], wanted: set[str], aliases: dict[str, str]) -> tuple[list[str], list[str]]:
    """(keys of `wanted` that `loaded` lacks, keys of `loaded` the model does not have), where a
    tied alias (`tied_aliases`) is loaded when its first name is and is never unexpected.

    >>> state_fit({"embed.weight"}, {"embed.weight", "lm_head.weight"}, {"lm_head.weight": "embed.weight"})
    ([], [])
    >>> state_fit({"embed.weight", "extra"}, {"embed.weight", "lm_head.weight"}, {})
    (['lm_head.weight'], ['extra'])
    """
    have = loaded | {alias for alias, name in aliases.items() if name in loaded}
    return sorted(wanted - have), sorted(loaded - wanted - set(aliases))


def untied_in(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> list[str]:
    """Tied names (`tied_aliases`) whose tensor in `state` differs from their first name's: a
    checkpoint of a model that did not tie them, which a tied model cannot hold (loading would
    keep one of the two and silently change the policy).

    >>> e = torch.zeros(2)
    >>> untied_in({"embed.weight": e, "lm_head.weight": e.clone()}, {"lm_head.weight": "embed.weight"})
    []
    >>> untied_in({"embed.weight": e, "lm_head.weight": e + 1}, {"lm_head.weight": "embed.weight"})
    ['lm_head.weight']
    """
    return sorted(a for a, name in aliases.items() if a in state and name in state
                  and not torch.equal(state[a], state[name]))


def check_ties(path: Path, state: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """Raise `CheckpointError` when the full checkpoint at `path` has two different tensors for
    names the model ties (`untied_in`)."""
    untied = untied_in(state, aliases)
    if untied:
        raise CheckpointError(f"checkpoint {path} has {untied[0]!r} different from {aliases[untied[0]]!r}, but this "
                              "model ties them (tie_word_embeddings): it was trained on a model with a separate "
                              "output layer")


def misfit_message(path: Path, files: list[Path], missing: list[str], unexpected: list[str]) -> str:
    """What a full checkpoint that does not fit the model lacks or has too much, naming its files."""
    names = ", ".join(f.name for f in files) or "(no model*.safetensors)"
    parts = [f"no tensor {', '.join(map(repr, missing[:3]))} in {names} (this model does not tie it to "
             "another weight, so it must be saved)"] if missing else []
    parts += [f"{', '.join(map(repr, unexpected[:3]))} in {names} is not a weight of this model"] if unexpected else []
    return f"checkpoint {path} does not fit the model: " + "; ".join(parts)


def load_torch_file(path: str | Path, map_location: Any = None) -> Any:
    """`torch.load` of a checkpoint's `.pt` file with `weights_only=True`: tensors and plain data
    only. Anything else (a pickled object, whose loading would run code) is refused as a
    `CheckpointError` naming the file; nothing in it runs."""
    import pickle

    path = Path(path)
    try:
        return torch.load(path, weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} holds objects other than tensors and plain "
                              f"data, refused without running them ({first})") from None


def is_complete(path: str | Path) -> bool:
    """Whether `path` is a checkpoint whose every file matches its record."""
    try:
        read_record(path, verify=True)
        return True
    except CheckpointError:
        return False


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
