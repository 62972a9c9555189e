"""Dagster resources, and the one place that picks the local or production deployment.

The resource classes are imported on first use: the embedded instance's storage
(`resources.instance_storage`, loaded by the daemon and webserver from `dagster.yaml`) lives in
this package and must not pull in torch and transformers through the policy engine.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

import dagster as dg

from tinker_pipelines.tracking.home import default_home

if TYPE_CHECKING:
    from resources.mlflow_resource import MLflowResource
    from resources.policy_engine import PolicyEngine
    from resources.storage import ArtifactStoreResource

_LAZY = {"MLflowResource": "resources.mlflow_resource", "PolicyEngine": "resources.policy_engine",
         "ArtifactStoreResource": "resources.storage"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'resources' has no attribute {name!r}")


def build_resources(deployment: str | None = None) -> dict[str, dg.ConfigurableResource]:
    """`local` (default): everything under `.tinker/`. `production`: MLflow server and S3 from env.

    Production reads MLFLOW_TRACKING_URI, TINKER_ARTIFACTS_URI (s3://bucket/prefix) and
    TINKER_S3_ENDPOINT_URL (optional) and TINKER_MLFLOW_ARTIFACT_LOCATION (optional, for a new
    MLflow experiment; a tracking server normally decides); boto3 takes credentials from its
    usual chain (env, ~/.aws, instance role).
    """
    from resources.mlflow_resource import MLflowResource
    from resources.policy_engine import PolicyEngine
    from resources.storage import ArtifactStoreResource

    deployment = deployment or os.environ.get("TINKER_DEPLOYMENT", "local")
    home = default_home()
    if deployment == "local":
        home.ensure()
        return {
            "policy_engine": PolicyEngine(),
            "mlflow": MLflowResource(tracking_uri=home.mlflow_uri, artifact_location=str(home.mlflow_artifacts)),
            "artifact_store": ArtifactStoreResource(uri=str(home.artifacts), cache_dir=str(home.cache)),
        }
    if deployment == "production":
        return {
            "policy_engine": PolicyEngine(),
            "mlflow": MLflowResource(tracking_uri=dg.EnvVar("MLFLOW_TRACKING_URI"),
                                     artifact_location=os.environ.get("TINKER_MLFLOW_ARTIFACT_LOCATION", "")),
            "artifact_store": ArtifactStoreResource(uri=dg.EnvVar("TINKER_ARTIFACTS_URI"),
                                                    endpoint_url=os.environ.get("TINKER_S3_ENDPOINT_URL", ""),
                                                    cache_dir=str(home.cache)),
        }
    raise ValueError(f"TINKER_DEPLOYMENT must be 'local' or 'production', got {deployment!r}")


__all__ = ["ArtifactStoreResource", "MLflowResource", "PolicyEngine", "build_resources"]
