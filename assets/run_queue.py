"""The embedded instance's run coordinator: Dagster's `QueuedRunCoordinator`, plus the run tag
`tinker/experiment` derived from the run's partition, so that the queue's per-experiment limit
holds for every run — launched from the UI, `dagster job launch`, a backfill or a sensor — and
not only for runs whose launcher remembered the tag.

Named in `dagster.yaml` (`run_coordinator: {module: assets.run_queue, class: TinkerRunCoordinator}`,
written by `tinker_pipelines.tracking.home`); the daemon and the webserver load it, so it imports
only dagster and `assets.partitions`, never the ML stack. All limits stay in `dagster.yaml`
(`concurrency: runs:`), read by Dagster's own queue daemon.
"""

from __future__ import annotations

from collections.abc import Mapping

from dagster._core.run_coordinator import QueuedRunCoordinator, SubmitRunContext
from dagster._core.storage.dagster_run import DagsterRun
from dagster._core.storage.tags import PARTITION_NAME_TAG

from assets.partitions import experiment_of
from tinker_pipelines.schedule_rules import EXPERIMENT_TAG


def queue_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """The tags a run lacks for the queue's limits: `tinker/experiment` from `dagster/partition`.

    >>> queue_tags({"dagster/partition": "demo:3"}), queue_tags({"dagster/partition": "demo", "tinker/experiment": "x"})
    ({'tinker/experiment': 'demo'}, {})
    """
    if EXPERIMENT_TAG in tags or PARTITION_NAME_TAG not in tags:
        return {}
    name = experiment_of(tags[PARTITION_NAME_TAG])
    return {EXPERIMENT_TAG: name} if name else {}


class TinkerRunCoordinator(QueuedRunCoordinator):
    """Queues runs like `QueuedRunCoordinator`, after tagging each with its experiment."""

    def submit_run(self, context: SubmitRunContext) -> DagsterRun:
        run = context.dagster_run
        extra = queue_tags(run.tags)
        if extra:
            self._instance.add_run_tags(run.run_id, extra)
            run = self._instance.get_run_by_id(run.run_id) or run
            context = SubmitRunContext(run, context.workspace)
        return super().submit_run(context)
