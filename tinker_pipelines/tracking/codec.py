"""Artifacts as data, never as code: rollouts, datums and preference pairs in tagged JSON.

Anyone who can write the artifact store (an S3 bucket, a shared folder) must not be able to run
code in the trainer that reads it, so nothing here unpickles. The encoding keeps what the
trainer needs exactly: the project's frozen dataclasses by name (a closed list, `TYPES`; add your
own with `register`), tuples
as tuples, dict keys of any JSON type, floats bit for bit (JSON's shortest round-trip repr, NaN
and infinities included). Values an environment puts in `info` that JSON cannot hold are stored
as a NumPy/torch scalar's value, a tensor's nested list, or else their `repr` (text).

>>> from tinker_pipelines.types import Datum
>>> d = Datum((1, 2), (2, 3), (0.0, 1.0), advantages=(0.5, 0.5))
>>> decode(encode({"datums": [d], "step": (3, float("nan"))}))["datums"][0] == d
True
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

FORMAT = "tinker-json/1"
"""The `format` field of every encoded artifact."""


TYPES: dict[str, type] = {}
"""Dataclasses an artifact may hold, by name (the project's are added on first use)."""


def register(cls: type) -> type:
    """Allow artifacts to hold the dataclass `cls` (e.g. a custom algorithm's datum); usable as a decorator."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    _registry()[cls.__name__] = cls
    return cls


def _registry() -> dict[str, type]:
    if not TYPES:
        from tinker_pipelines.types import (CriticDatum, Datum, PreferencePair, StepResult, Trajectory,
                                            TrajectoryGroup, Turn)

        for t in (Turn, Trajectory, TrajectoryGroup, Datum, CriticDatum, StepResult, PreferencePair):
            TYPES.setdefault(t.__name__, t)
    return TYPES


def encode(value: Any) -> bytes:
    """`value` (the project's dataclasses, tuples, lists, dicts, scalars) as UTF-8 JSON."""
    return json.dumps({"format": FORMAT, "value": _plain(value)}, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """Inverse of `encode`; raises ValueError for anything else (a pickle above all), running nothing."""
    if data[:1] == b"\x80":
        raise ValueError("the artifact is a Python pickle; pickled artifacts are refused because loading one "
                         "can run code (re-run the step that wrote it)")
    try:
        doc = json.loads(data, object_hook=_revive)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the artifact is not {FORMAT} JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"the artifact is not in the {FORMAT} format")
    return doc["value"]


_NUMBERS = (int, float)


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        name = type(v).__name__
        if _registry().get(name) is not type(v):
            raise TypeError(f"cannot store a {type(v).__module__}.{name} in an artifact: allow it with "
                            "tinker_pipelines.tracking.codec.register")
        return {"__dataclass__": name, "fields": {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    if isinstance(v, tuple):  # token ids and logprobs: the bulk, stored without a walk
        return {"__tuple__": list(v) if all(type(x) in _NUMBERS for x in v) else [_plain(x) for x in v]}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {"__dict__": [[_plain(k), _plain(x)] for k, x in v.items()]}
    item, tolist = getattr(v, "item", None), getattr(v, "tolist", None)
    if callable(tolist):  # NumPy / torch arrays and scalars
        out = tolist()
        return out if isinstance(out, (list, int, float, bool)) else {"__repr__": repr(v)}
    if callable(item):
        return _plain(item())
    return {"__repr__": repr(v)}


def _revive(obj: dict) -> Any:
    if "__tuple__" in obj:
        return tuple(obj["__tuple__"])
    if "__dict__" in obj:
        return {(tuple(k) if isinstance(k, list) else k): x for k, x in obj["__dict__"]}
    if "__dataclass__" in obj:
        cls = _registry().get(obj["__dataclass__"])
        if cls is None:
            raise ValueError(f"the artifact names an unknown type {obj['__dataclass__']!r}")
        return cls(**obj["fields"])
    if "__repr__" in obj:
        return obj["__repr__"]
    return obj


__all__ = ["FORMAT", "TYPES", "decode", "encode", "register"]
