"""MLflow as a resource: the embedded sqlite store by default, a tracking server in production."""

from __future__ import annotations

import dagster as dg

from tinker_pipelines.tracking import Tracker

_TRACKERS: dict[tuple[str, str, str], Tracker] = {}


class MLflowResource(dg.ConfigurableResource):
    """Where experiments, metrics and the adapter registry live."""

    tracking_uri: str
    """MLflow tracking URI: sqlite:///... (embedded) or http(s)://server (production)."""
    experiment_name: str = "tinker"
    """MLflow experiment that holds one run per tinker experiment."""
    artifact_location: str = ""
    """Artifact root for a newly created MLflow experiment ('' = the server's default)."""

    def tracker(self) -> Tracker:
        key = (self.tracking_uri, self.experiment_name, self.artifact_location)
        if key not in _TRACKERS:  # one client per process: the sqlite schema check runs once
            _TRACKERS[key] = Tracker(self.tracking_uri, self.experiment_name, self.artifact_location or None)
        return _TRACKERS[key]
