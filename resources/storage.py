"""The artifact store as a resource: a local directory or S3 (boto3, configurable endpoint)."""

from __future__ import annotations

import dagster as dg

from tinker_pipelines.tracking.store import LocalStore, S3Store, open_store


class ArtifactStoreResource(dg.ConfigurableResource):
    """Where rollouts, scored batches and checkpoints are written; metadata carries their URIs."""

    uri: str
    """A local directory, or s3://bucket/prefix."""
    endpoint_url: str = ""
    """S3 endpoint (MinIO, moto, ...); '' = AWS's default for the region."""
    cache_dir: str = ".tinker/cache"
    """Local copies of remote checkpoints (S3 only)."""

    def store(self) -> LocalStore | S3Store:
        return open_store(self.uri, endpoint_url=self.endpoint_url or None, cache_dir=self.cache_dir)
