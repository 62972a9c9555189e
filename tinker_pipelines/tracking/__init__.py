"""Tracking and storage: MLflow runs, metrics, registry and aliases; an artifact store on local
disk or S3. Plain library code (no dagster), usable from a notebook."""

from tinker_pipelines.tracking.home import TinkerHome, default_home
from tinker_pipelines.tracking.mlflow_tracker import Tracker, registered_model_name
from tinker_pipelines.tracking.store import ArtifactStore, LocalStore, S3Store, open_store

__all__ = ["ArtifactStore", "LocalStore", "S3Store", "TinkerHome", "Tracker", "default_home", "open_store",
           "registered_model_name"]
