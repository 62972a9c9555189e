"""Tinker API checkpoints in Dagster's lineage: the reporter that `serving.tinker.lineage` calls.

The library cannot import dagster, so whoever launches the Tinker service (the `serve` job, a
CLI entry in the composition root) passes `dagster_reporter(instance)` to `TinkerTracker`. Each
registered checkpoint becomes a runless asset materialization of `["tinker", <registered
model>]` on that instance (`DagsterInstance.report_runless_asset_event`): written to the
instance's event log directly, so it needs no webserver running (the embedded default has none
unless `dagster dev` is up), no URL or port to configure, and a failure raises in the caller,
which counts and logs it. (The webserver's `POST /report_asset_materialization/{asset_key}`
records the same event, from a process that has no instance, at the cost of those.)
"""

from __future__ import annotations

from typing import Any, Callable

import dagster as dg

from tinker_pipelines.serving.tinker.lineage import LineageReport


def materialization(report: LineageReport) -> dg.AssetMaterialization:
    """The asset materialization a `LineageReport` stands for."""
    md: dict[str, Any] = {}
    for k, v in report.metadata.items():
        md[k] = dg.MetadataValue.int(v) if isinstance(v, int) and not isinstance(v, bool) else dg.MetadataValue.text(str(v))
    return dg.AssetMaterialization(asset_key=dg.AssetKey(list(report.asset_key)), description=report.description,
                                   metadata=md)


def dagster_reporter(instance: dg.DagsterInstance | None = None) -> Callable[[LineageReport], None]:
    """A `TinkerTracker` report that records each checkpoint on `instance` (default: the
    instance of `DAGSTER_HOME`, as the webserver and daemon open it)."""
    inst = instance if instance is not None else dg.DagsterInstance.get()

    def report(r: LineageReport) -> None:
        inst.report_runless_asset_event(materialization(r))
    return report
