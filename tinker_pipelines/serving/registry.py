"""Which registry version a `model` field names, its files (verified), and the base it needs.

`MODEL@ALIAS` and `MODEL/VERSION` name a version of a registered model (`parse_model_ref`);
`MODEL` alone is the latest version. A version's base is what its record says it was trained
on (`bases.resolve_base`): the catalogue model, or the SFT warm start with the recorded content
hash, fetched from the registry (`sft-<experiment>`) as the `evaluate` and `inference` jobs do.

Two kinds of checkpoint are served the same way. One written by a run (`train`, the `rl` asset)
records its run `config`. One saved through the Tinker API (`serving.tinker.lineage`) has no run
config: its adapter's shape is the record's `learner` (rank, alpha, targets) and its base is the
record's `base` or, failing that, the version's `tinker.base` / `tinker.base_path` tags.
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
    config: Config | None
    """The run config it was trained with; None for a checkpoint saved through the Tinker API."""
    base: str
    """`models.base_identity` of the base it was trained on."""
    base_path: str
    """What `load_model` takes to build that base (a catalogue name or a directory)."""
    learner: dict[str, Any] = field(default_factory=dict)
    """The record's learner settings (`LearnerConfig` fields: mode, lora_rank, lora_alpha,
    lora_targets, ...); empty for a record that predates them."""

    @property
    def key(self) -> str:
        """The canonical name of this version on the endpoint: `MODEL/VERSION`."""
        return f"{self.model}/{self.version}"


def registry_from_env(experiment_name: str = "tinker") -> tuple[Any, Any]:
    """(Tracker, artifact store) of this deployment: `.tinker/` (TINKER_HOME), or with
    TINKER_DEPLOYMENT=production the MLflow server and S3 store named by the environment,
    as `resources.build_resources` picks them. The tracker's runs go to MLflow experiment
    `experiment_name`; the registry is the deployment's whatever it is."""
    from tinker_pipelines.tracking import Tracker, default_home, open_store

    home = default_home()
    if os.environ.get("TINKER_DEPLOYMENT", "local") == "production":
        tracker = Tracker(os.environ["MLFLOW_TRACKING_URI"], experiment_name,
                          artifact_location=os.environ.get("TINKER_MLFLOW_ARTIFACT_LOCATION") or None)
        return tracker, open_store(os.environ["TINKER_ARTIFACTS_URI"], os.environ.get("TINKER_S3_ENDPOINT_URL"),
                                   home.cache)
    home.ensure()
    return Tracker(home.mlflow_uri, experiment_name, str(home.mlflow_artifacts)), open_store(home.artifacts)


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

    def trained_on(self, name: str, version: str) -> str | None:
        """The base identity `name` v`version` carries in its `tinker.base` tag (Tinker-saved
        versions), without downloading it; None for a version without the tag."""
        return self.tracker.client.get_model_version(name, version).tags.get(TINKER_BASE_TAG)

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
        if "config" not in record:
            return _tinker_version(name, version, Path(path), record, mv.tags)
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
        return Version(name, version, Path(path), cfg, base, base_path, dict(record.get("learner") or {}))


TINKER_BASE_TAG = "tinker.base"
"""Version tag: `models.base_identity` of the base a checkpoint was trained on."""
TINKER_BASE_PATH_TAG = "tinker.base_path"
"""Version tag: what `load_model` takes to build that base (the Tinker `base_model`)."""


def _tinker_version(name: str, version: str, path: Path, record: dict[str, Any], tags: dict[str, str]) -> Version:
    """A checkpoint without a run config (saved through the Tinker API): its shape from the
    record's `learner`, its base from the record's `base` or the version's tags; refused (400 or
    409, naming what is missing) when it is not a LoRA adapter or names no base."""
    learner = record.get("learner")
    if not isinstance(learner, dict) or record.get("mode", learner.get("mode")) != "lora":
        what = "records no learner settings" if not isinstance(learner, dict) else \
            f"trains every parameter (mode: {record.get('mode')!r})"
        raise ServingError(400, f"{name} v{version} {what}; the endpoint serves LoRA adapters on a shared base",
                           param="model", code="model_not_servable")
    base = record.get("base") or {}
    if "sft_content_hash" in base:
        raise ServingError(409, f"{name} v{version} has no run config, so its SFT warm start cannot be found",
                           "invalid_request_error", "model", "base_missing")
    base_path = base.get("name") or tags.get(TINKER_BASE_PATH_TAG)
    identity = base.get("identity") or tags.get(TINKER_BASE_TAG)
    if not base_path or not identity:
        raise ServingError(409, f"{name} v{version} names no base: its record has no `base` and the version no "
                                f"{TINKER_BASE_TAG} / {TINKER_BASE_PATH_TAG} tags", "invalid_request_error", "model",
                           "base_missing")
    return Version(name, version, path, None, identity, base_path, dict(learner))


def corrupt(name: str, version: str, why: str) -> ServingError:
    """A version whose files fail their hash: 422, never loaded."""
    return ServingError(422, f"{name} v{version} cannot be served: {why}", "invalid_request_error", "model",
                        "model_files_corrupt")
