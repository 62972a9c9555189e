"""Finding an experiment's settings and iteration k-1's adapter (instance first, then registry)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from assets.partitions import iteration_key
from tinker_pipelines.config import ConfigError, config_from_dict
from tinker_pipelines.tracking import Tracker, registered_model_name

ADAPTER = dg.AssetKey("adapter_checkpoint")


def settings_key(experiment: str) -> str:
    return f"{experiment}/experiment.json"


def save_settings(store, experiment: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Store the experiment's settings on first use; later iterations must match them
    (except `training.iterations`, which may grow). Raises ConfigError naming the field."""
    key = settings_key(experiment)
    if store.exists(key):
        old = json.loads(store.get_bytes(key))
        diff = _first_difference(old, settings)
        if diff and diff != "config.training.iterations":
            raise ConfigError(f"{diff.removeprefix('config.')} differs from experiment {experiment!r}'s stored "
                              f"settings; start a new experiment name to change it")
        if not diff:
            return old
    store.put_bytes(key, json.dumps(settings, indent=2, sort_keys=True).encode())
    return settings


def load_settings(store, experiment: str) -> dict[str, Any]:
    key = settings_key(experiment)
    if not store.exists(key):
        raise RuntimeError(f"experiment {experiment!r} has no stored settings: materialize rollout_batch first")
    return json.loads(store.get_bytes(key))


def settings_config(settings: dict[str, Any]):
    return config_from_dict(settings["config"])


def _first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
            if d:
                return d
        return None
    return None if a == b else prefix.rstrip(".")


@dataclass(frozen=True)
class AdapterRef:
    """Where an iteration's adapter is, and how it was found."""

    iteration: int
    store_key: str | None
    uri: str
    model_version: str
    content_hash: str
    found_via: str


def find_adapter(instance: dg.DagsterInstance, tracker: Tracker | None, experiment: str,
                 iteration: int) -> AdapterRef | None:
    """The adapter of `experiment:iteration`: from its latest materialization's metadata, else
    from the registry version tagged with that partition, else None."""
    key = iteration_key(experiment, iteration)
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=ADAPTER, asset_partitions=[key]), limit=1).records
    if records:
        md = records[0].asset_materialization.metadata
        val = lambda k: str(md[k].value) if k in md else ""  # noqa: E731
        return AdapterRef(iteration, val("store_key") or None, val("path"), val("model_version"),
                          val("content_hash"), "dagster instance")
    if tracker is not None:
        mv = tracker.find_version(registered_model_name(experiment), partition=key)
        if mv is not None:
            return AdapterRef(iteration, None, mv.source, str(mv.version), mv.tags.get("content_hash", ""),
                              "mlflow registry")
    return None


def adapter_dir(ref: AdapterRef, store, tracker: Tracker | None, experiment: str, cache: Path) -> Path:
    """A local directory holding the adapter of `ref` (downloaded when remote)."""
    if ref.store_key:
        return store.local_dir(ref.store_key)
    if tracker is None:
        raise RuntimeError(f"adapter of iteration {ref.iteration} is only in the registry, and MLflow is unavailable")
    return tracker.download_version(registered_model_name(experiment), ref.model_version,
                                    cache / experiment / f"v{ref.model_version}")
