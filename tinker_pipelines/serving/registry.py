"""Which registry version a `model` field names, its files (verified), and the base it needs.

`MODEL@ALIAS` and `MODEL/VERSION` name a version of a registered model (`parse_model_ref`);
`MODEL` alone is the latest version. A version's base is what its record says it was trained
on (`bases.resolve_base`): the catalogue model, or the SFT warm start with the recorded content
hash, fetched from the registry (`sft-<experiment>`) as the `evaluate` and `inference` jobs do.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker_pipelines.bases import BaseMissing, resolve_base
from tinker_pipelines.checkpoint import CheckpointError, read_record
from tinker_pipelines.config import Config, ConfigError, config_from_dict
from tinker_pipelines.loops.inference import parse_model_ref
from tinker_pipelines.serving.errors import ServingError, model_not_found
from tinker_pipelines.tracking.mlflow_tracker import EXPERIMENT_TAG


@dataclass(frozen=True)
class Version:
    """A resolved registry version, its checkpoint on local disk and the base it needs."""

    model: str
    """Registered model name (`tinker-<experiment>`)."""
    version: str
    path: Path
    """The downloaded checkpoint directory, its files checked against their recorded hashes."""
    config: Config
    base: str
    """`models.base_identity` of the base it was trained on."""
    base_path: str
    """What `load_model` takes to build that base (a catalogue name or a directory)."""

    @property
    def key(self) -> str:
        """The canonical name of this version on the endpoint: `MODEL/VERSION`."""
        return f"{self.model}/{self.version}"


def registry_from_env() -> tuple[Any, Any]:
    """(Tracker, artifact store) of this deployment: `.tinker/` (TINKER_HOME), or with
    TINKER_DEPLOYMENT=production the MLflow server and S3 store named by the environment,
    as `resources.build_resources` picks them."""
    from tinker_pipelines.tracking import Tracker, default_home, open_store

    home = default_home()
    if os.environ.get("TINKER_DEPLOYMENT", "local") == "production":
        tracker = Tracker(os.environ["MLFLOW_TRACKING_URI"],
                          artifact_location=os.environ.get("TINKER_MLFLOW_ARTIFACT_LOCATION") or None)
        return tracker, open_store(os.environ["TINKER_ARTIFACTS_URI"], os.environ.get("TINKER_S3_ENDPOINT_URL"),
                                   home.cache)
    home.ensure()
    return Tracker(home.mlflow_uri, artifact_location=str(home.mlflow_artifacts)), open_store(home.artifacts)


@dataclass
class Registry:
    """Resolves `model` fields against the MLflow registry and fetches verified checkpoints."""

    tracker: Any
    store: Any
    cache_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="tinker-serve-")))
    alias_ttl_s: float = 5.0
    """A reference is looked up again after this long, so a moved `champion` is followed."""
    _aliases: dict[tuple[str, str], tuple[float, str]] = field(default_factory=dict)

    def resolve(self, ref: str) -> tuple[str, str]:
        """(registered model, version number) that `ref` names; 404 naming it when there is none."""
        try:
            name, version = parse_model_ref(ref)
        except ConfigError as e:
            raise model_not_found(ref, str(e)) from None
        from mlflow.exceptions import MlflowException

        hit = self._aliases.get((name, version))
        if hit is not None and time.monotonic() - hit[0] < self.alias_ttl_s:  # no registry query per request
            return name, hit[1]
        try:
            if version.isdigit():
                mv = self.tracker.client.get_model_version(name, version)
            else:
                mv = self.tracker.alias_version(name, version) if version else self.tracker.latest_version(name)
        except MlflowException:
            mv = None
        if mv is None:
            if self.tracker.latest_version(name) is None:
                raise model_not_found(ref, f"registered model {name!r} does not exist or has no versions")
            what = f"version {version}" if version.isdigit() else f"alias {version!r}"
            raise model_not_found(ref, f"registered model {name!r} has no {what}")
        self._aliases[(name, version)] = (time.monotonic(), str(mv.version))
        return name, str(mv.version)

    def fetch(self, name: str, version: str) -> Version:
        """Download `name` v`version`, verify every file against its record and the record's content
        hash against the one the version was registered with (422 when they differ)."""
        mv = self.tracker.client.get_model_version(name, version)
        dest = self.cache_dir / f"{name}-v{version}-{time.monotonic_ns()}"
        path = self.tracker.download_version(name, version, dest)
        try:
            record = read_record(path, verify=True)
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            raise corrupt(name, version, str(e)) from None
        registered = mv.tags.get("content_hash")
        if registered and record.get("content_hash") != registered:
            raise corrupt(name, version, f"its files hash to {record.get('content_hash')}, but it was registered "
                                         f"with {registered}")
        cfg = config_from_dict(record["config"])
        if cfg.training.mode != "lora":
            raise ServingError(400, f"{name} v{version} trains every parameter (training.mode: full); the endpoint "
                                    "serves LoRA adapters on a shared base", param="model", code="model_not_servable")
        experiment = mv.tags.get(EXPERIMENT_TAG, name.removeprefix("tinker-"))
        try:
            base_path, base = resolve_base(record, cfg, experiment, self.cache_dir / "bases", self.tracker, self.store)
        except BaseMissing as e:
            raise ServingError(409, f"{name} v{version}: {e}", "invalid_request_error", "model",
                               "base_missing") from None
        except CheckpointError as e:
            raise corrupt(name, version, f"its base: {e}") from None
        return Version(name, version, Path(path), cfg, base, base_path)


def corrupt(name: str, version: str, why: str) -> ServingError:
    """A version whose files fail their hash: 422, never loaded."""
    return ServingError(422, f"{name} v{version} cannot be served: {why}", "invalid_request_error", "model",
                        "model_files_corrupt")
