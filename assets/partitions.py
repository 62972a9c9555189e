"""Partitions: one key per experiment iteration (`<experiment>:<iteration>`), one per experiment.

Dagster cannot make a dynamic-partitioned asset depend on its own previous partition, so an
iteration finds its predecessor's adapter through the instance (see `lineage.py`).
"""

from __future__ import annotations

import re

import dagster as dg

ITERATIONS = dg.DynamicPartitionsDefinition(name="iterations")
"""Keys `<experiment>:<iteration>`, e.g. `quickstart:3`; added by sensors, launchers or the first step."""
EXPERIMENTS = dg.DynamicPartitionsDefinition(name="experiments")
"""Keys `<experiment>`: per-experiment assets (the SFT warm start)."""



def ensure_partition(instance: dg.DagsterInstance, partitions: dg.DynamicPartitionsDefinition, key: str) -> None:
    """Add `key` to a dynamic partitions definition unless it is there (`dagster job execute`
    with a partition tag adds none, so the first asset of a run does it)."""
    if not instance.has_dynamic_partition(partitions.name, key):
        instance.add_dynamic_partitions(partitions.name, [key])


def uri_value(uri: str) -> dg.MetadataValue:
    """Metadata for an artifact-store URI: a link for remote stores, a path for local disk."""
    return dg.MetadataValue.url(uri) if "://" in uri else dg.MetadataValue.path(uri)


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def check_experiment(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"experiment name {name!r} must match {_NAME.pattern} (letters, digits, _ . -)")
    return name


def iteration_key(experiment: str, iteration: int) -> str:
    return f"{check_experiment(experiment)}:{int(iteration)}"


def parse_iteration_key(key: str) -> tuple[str, int]:
    """`'demo:3'` -> `('demo', 3)`; raises ValueError naming the key otherwise."""
    name, sep, it = key.rpartition(":")
    if not sep or not it.isdigit():
        raise ValueError(f"partition key {key!r} must be '<experiment>:<iteration>', e.g. 'demo:0'")
    return check_experiment(name), int(it)


def experiment_of(partition_key: str) -> str | None:
    """The experiment a partition key names: `'demo:3'` (an iteration) or `'demo'` (an
    experiment) -> `'demo'`; None for keys of neither form.

    >>> experiment_of("demo:3"), experiment_of("demo"), experiment_of("a|b")
    ('demo', 'demo', None)
    """
    try:
        return parse_iteration_key(partition_key)[0] if ":" in partition_key else check_experiment(partition_key)
    except ValueError:
        return None


def store_key(experiment: str, iteration: int, what: str) -> str:
    """Artifact store key of one iteration's artifact (`demo/00003/adapter`)."""
    return f"{experiment}/{iteration:05d}/{what}"
