"""Training runs and checkpoints as the service keeps them on disk, and the rules of their lifetimes.

Each training run's metadata is one JSON file, `home/runs/<model_id>.json` (`Model.meta()`): its
owner (a tenant, `tenancy`), base, LoRA shape and its checkpoints' listing entries by checkpoint
id (`weights/NAME`, `sampler_weights/NAME`), each with the fields of the SDK's `types.Checkpoint`
(`public`, `expires_at` among them). A checkpoint lives until it is deleted or its TTL passes
(then a collector deletes it); TTLs are bounded as hosted Tinker bounds them (`TTL_BOUNDS_S`).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

from tinker import types

TTL_BOUNDS_S = (3600, 10 * 365 * 24 * 3600)
"""The shortest and longest `ttl_seconds` a save accepts: 1 hour to 10 years, as the SDK documents."""
KINDS = ("weights", "sampler_weights", "external_weights")
"""Checkpoint kinds, as the second part of a `tinker://RUN/KIND/NAME` path."""
PAGE_LIMIT = 1000
"""The most items one listing page returns."""


def check_ttl(ttl_seconds: Any, min_s: int = TTL_BOUNDS_S[0], field: str = "ttl_seconds") -> int | None:
    """`ttl_seconds` if it is None (never expires) or within the bounds; else ValueError naming `field`."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
        raise ValueError(f"{field} must be an integer number of seconds or null, got {ttl_seconds!r}")
    low, high = min_s, TTL_BOUNDS_S[1]
    if not low <= ttl_seconds <= high:
        raise ValueError(f"{field} {ttl_seconds} is out of range: a checkpoint lives {low} s to {high} s "
                         "(10 years), or null for no expiry")
    return ttl_seconds


def expiry(ttl_seconds: int | None) -> str | None:
    """The ISO time `ttl_seconds` from now (None: never)."""
    if ttl_seconds is None:
        return None
    return (datetime.now(timezone.utc) + timedelta(seconds=ttl_seconds)).isoformat()


def is_expired(entry: dict[str, Any], now: datetime | None = None) -> bool:
    at = entry.get("expires_at")
    if not at:
        return False
    return datetime.fromisoformat(str(at)) <= (now or datetime.now(timezone.utc))


def run_path(home: Path, model_id: str) -> Path:
    return home / "runs" / f"{model_id}.json"


def read_run(home: Path, model_id: str) -> dict[str, Any] | None:
    path = run_path(home, model_id)
    if "/" in model_id or not path.exists():
        return None
    return json.loads(path.read_text())


def write_run(home: Path, meta: dict[str, Any]) -> None:
    """Write a run's metadata atomically (a reader never sees half of it)."""
    path = run_path(home, meta["model_id"])
    tmp = path.with_suffix(f".tmp{id(meta)}")
    tmp.write_text(json.dumps(meta))
    tmp.replace(path)


def all_runs(home: Path) -> Iterator[dict[str, Any]]:
    for path in sorted((home / "runs").glob("*.json")):
        try:
            yield json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced, or not ours


def page(items: list, limit: Any, offset: Any) -> tuple[list, types.Cursor]:
    """One page of `items` and its cursor; ValueError naming `limit` or `offset` when out of range."""
    for name, value, low in (("limit", limit, 1), ("offset", offset, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if limit > PAGE_LIMIT:
        raise ValueError(f"limit {limit} is over this service's page size of {PAGE_LIMIT}")
    return items[offset:offset + limit], types.Cursor(offset=offset, limit=limit, total_count=len(items))


def checkpoint(entry: dict[str, Any] | None) -> types.Checkpoint | None:
    return None if entry is None else types.Checkpoint.model_validate(entry)


def drop_entry(meta: dict[str, Any], checkpoint_id: str) -> dict[str, Any] | None:
    """Remove a checkpoint's entry from a run's metadata (and from its `last_*`); the entry, if any."""
    entry = (meta.get("checkpoints") or {}).pop(checkpoint_id, None)
    for last in ("last_checkpoint", "last_sampler_checkpoint"):
        if (meta.get(last) or {}).get("checkpoint_id") == checkpoint_id:
            meta[last] = None
    return entry


def update_entry(meta: dict[str, Any], checkpoint_id: str, **fields: Any) -> dict[str, Any]:
    """Set `fields` on a checkpoint's entry (and on its copy in `last_*`); the updated entry."""
    entry = meta["checkpoints"][checkpoint_id]
    entry.update(fields)
    for last in ("last_checkpoint", "last_sampler_checkpoint"):
        if (meta.get(last) or {}).get("checkpoint_id") == checkpoint_id:
            meta[last] = entry
    return entry
