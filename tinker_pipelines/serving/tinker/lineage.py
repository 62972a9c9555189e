"""Tracking and lineage of the Tinker API: MLflow runs, registered checkpoints, Dagster reports.

- Each training client (`create_model`, or a create-by-load) is one MLflow run, found again by
  its tag `tinker.model_id`, so a restarted service logs into the same run. Its params are the
  base and the LoRA config (`lora.rank`, `lora.train_unembed`, ...); its tags the session id, the
  session's tags (`tinker.session_tags`, a JSON list) and the user metadata (`tinker.meta.KEY`).
- `log_step` logs Tinker's metrics per optimizer step. Tinker's keys hold ':' (`loss:sum`);
  MLflow 3 allows ':' in metric names on POSIX, so a key is kept as it is. Any character MLflow
  refuses (outside letters, digits, `_ - . / :` and space) becomes '_' (`metric_name`); two keys
  that would then collide are refused. A retried step is logged once (`Tracker.log_metrics_once`).
- `checkpoint_saved` registers a saved checkpoint (already in our format: record plus hashes,
  verified here) as a version of `registered_name(model_id)`: one registered model per training
  client, `tinkerapi-<model id>` with every character outside `[A-Za-z0-9_.-]` replaced by '-'
  (MLflow names cannot hold '/' or ':', and the endpoint splits `MODEL/VERSION` and `MODEL@ALIAS`).
  Not `tinker-*`: those names are the `rl` experiments', whose versions the registry sensor
  evaluates with their run config. The registered model carries the exact model id (tag
  `tinker.model_id`), so two ids that sanitize to one name are refused rather than mixed. The
  version's tags carry its lineage: session, model id, step, base (`tinker.base` identity and
  `tinker.base_path`), kind, name and the `tinker://{model_id}/{kind}/{name}` path; registering the
  same path and content again returns the same version. The OpenAI endpoint serves it as
  `MODEL/VERSION` (`serving.registry` reads the adapter's shape from the record's `learner`).
- Each registered checkpoint is handed to `report` (a `LineageReport`), if given. The library
  never imports dagster: whoever launches the service passes `resources.tinker_lineage.
  dagster_reporter(instance)`, which records it on the Dagster instance as a runless asset
  materialization of `["tinker", <registered model>]`. A report that fails is logged and counted
  (`report_errors`); the checkpoint stays registered and the save succeeds.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from tinker_pipelines.checkpoint import read_record
from tinker_pipelines.serving.registry import TINKER_BASE_PATH_TAG, TINKER_BASE_TAG
from tinker_pipelines.tracking.mlflow_tracker import flatten

log = logging.getLogger(__name__)

MODEL_ID_TAG = "tinker.model_id"
SESSION_TAG = "tinker.session"
PREFIX = "tinkerapi-"
"""Registered model names of Tinker API checkpoints start with this (not `tinker-`: see above)."""
EXPERIMENT = "tinker-api"
"""The MLflow experiment of the training clients' runs (`from_env`)."""
KINDS = ("weights", "sampler_weights")
STATUSES = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
"""`end_model` statuses and the MLflow run status each sets."""
_METRIC_BAD = re.compile(r"[^\w.\-/: ]")
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.\-]")


def registered_name(model_id: str) -> str:
    """The registered model of a training client's checkpoints: `tinkerapi-<model id>`, every
    character outside `[A-Za-z0-9_.-]` replaced by '-'.

    >>> registered_name("3f2a:train:0")
    'tinkerapi-3f2a-train-0'
    """
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
    return PREFIX + _NAME_BAD.sub("-", model_id)


def metric_name(key: str) -> str:
    """A Tinker metric key as an MLflow metric name: ':' kept, other refused characters as '_'.

    >>> metric_name("loss:sum"), metric_name("grad norm[0]")
    ('loss:sum', 'grad norm_0_')
    """
    return _METRIC_BAD.sub("_", key)


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


@dataclass(frozen=True)
class CheckpointVersion:
    """A registered checkpoint: `model`/`version` in the registry (`key`: what the OpenAI endpoint takes)."""

    model: str
    version: str
    tinker_path: str
    run_id: str
    content_hash: str

    @property
    def key(self) -> str:
        return f"{self.model}/{self.version}"


@dataclass(frozen=True)
class LineageReport:
    """What the Dagster instance is told of a registered checkpoint (`resources.tinker_lineage`)."""

    asset_key: tuple[str, ...]
    """`("tinker", <registered model>)`."""
    metadata: dict[str, Any]
    """tinker_path, registered_model, version, step, base, session_id, model_id, mlflow_run_id,
    kind, name, content_hash."""
    description: str


@dataclass
class _Model:
    run_id: str
    session_id: str
    base_model: str
    base_identity: str


class TinkerTracker:
    """MLflow runs, registered checkpoints and lineage reports of the Tinker API's training clients.

    `tracker` is a `tracking.Tracker` (the registry the OpenAI endpoint reads); `report`, if given,
    receives a `LineageReport` for each registered checkpoint."""

    def __init__(self, tracker: Any, report: Callable[[LineageReport], None] | None = None):
        self.tracker = tracker
        self.report = report
        self.report_errors = 0
        """Reports that raised (each logged); their checkpoints are registered all the same."""
        self._models: dict[str, _Model] = {}

    @classmethod
    def from_env(cls, report: Callable[[LineageReport], None] | None = None) -> TinkerTracker:
        """Over this deployment's MLflow (`registry_from_env`), its runs in the experiment
        `EXPERIMENT` (apart from the `train` runs; the registry is the same one)."""
        from tinker_pipelines.serving.registry import registry_from_env

        return cls(registry_from_env(EXPERIMENT)[0], report)

    # -- runs ---------------------------------------------------------------------------------
    def start_model(self, model_id: str, session_id: str, base_model: str, lora: dict[str, Any],
                    session_tags: list[str], user_metadata: dict[str, Any],
                    base_identity: str | None = None) -> str:
        """The MLflow run of training client `model_id` (created on first use; the same run when
        the service restarts). `base_identity`: `models.base_identity` of the base the worker
        hosts (default: that of `base_model` with the builder's defaults)."""
        name = registered_name(model_id)  # refuses a bad id before anything is written
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        if not isinstance(base_model, str) or not base_model:
            raise ValueError(f"base_model must be a non-empty string, got {base_model!r}")
        if base_identity is None:
            from tinker_pipelines.models import base_identity as identity_of

            base_identity = identity_of(base_model)
        run_id = self._find_run(model_id)
        if run_id is None:
            tags = {MODEL_ID_TAG: model_id, SESSION_TAG: session_id, TINKER_BASE_TAG: base_identity,
                    TINKER_BASE_PATH_TAG: base_model, "tinker.registered_model": name,
                    "tinker.session_tags": json.dumps(list(session_tags or []))}
            for k, v in (user_metadata or {}).items():
                tags[f"tinker.meta.{metric_name(str(k))}"] = str(v)[:5000]
            run_id = self.tracker.client.create_run(self.tracker.experiment_id, run_name=model_id, tags=tags).info.run_id
            from mlflow.entities import Param

            params = flatten({"base_model": base_model, "base_identity": base_identity, "lora": dict(lora or {})})
            self.tracker.client.log_batch(run_id, params=[Param(metric_name(k), v) for k, v in params.items()])
        self._models[model_id] = _Model(run_id, session_id, base_model, base_identity)
        return run_id

    def _find_run(self, model_id: str) -> str | None:
        runs = self.tracker.client.search_runs([self.tracker.experiment_id], f"tags.`{MODEL_ID_TAG}` = '{model_id}'",
                                               max_results=1, order_by=["attributes.start_time ASC"])
        return runs[0].info.run_id if runs else None

    def _model(self, model_id: str) -> _Model:
        """The run of `model_id`, from this process or (after a restart) from its run's tags."""
        if model_id in self._models:
            return self._models[model_id]
        run_id = self._find_run(model_id)
        if run_id is None:
            raise ValueError(f"model_id {model_id!r} has no MLflow run: start_model was never called for it")
        tags = self.tracker.client.get_run(run_id).data.tags
        m = _Model(run_id, tags[SESSION_TAG], tags[TINKER_BASE_PATH_TAG], tags[TINKER_BASE_TAG])
        self._models[model_id] = m
        return m

    def log_step(self, model_id: str, step: int, metrics: dict[str, float]) -> bool:
        """Log one optimizer step's metrics (Tinker keys, see `metric_name`); False when that step
        was already logged (a retried request)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        named: dict[str, float] = {}
        for k, v in metrics.items():
            n = metric_name(k)
            if n in named:
                raise ValueError(f"metric keys {k!r} and another both become the MLflow name {n!r}")
            named[n] = float(v)
        return self.tracker.log_metrics_once(self._model(model_id).run_id, step, named)

    def end_model(self, model_id: str, status: str = "finished") -> None:
        """End the run: `finished`, `failed` or `killed` (MLflow's FINISHED / FAILED / KILLED)."""
        if status.lower() not in STATUSES:
            raise ValueError(f"status must be one of {sorted(STATUSES)}, got {status!r}")
        self.tracker.client.set_terminated(self._model(model_id).run_id, STATUSES[status.lower()])
        self._models.pop(model_id, None)

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_saved(self, model_id: str, kind: Literal["weights", "sampler_weights"], name: str,
                         path: str | Path, step: int) -> CheckpointVersion:
        """Register the checkpoint at `path` (its files verified against its record) as a version
        of `registered_name(model_id)` with its lineage, and report it (`report`). Idempotent for
        the same tinker path and content."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
        m = self._model(model_id)
        record = read_record(path, verify=True)
        if record.get("mode") != "lora":
            raise ValueError(f"checkpoint {path} is not a LoRA adapter (mode: {record.get('mode')!r}); the Tinker API "
                             "trains LoRA adapters")
        reg = registered_name(model_id)
        self._claim(reg, model_id)
        where = tinker_path(model_id, kind, name)
        tags = {"partition": where, "content_hash": record["content_hash"], MODEL_ID_TAG: model_id,
                SESSION_TAG: m.session_id, "tinker.step": str(step), "tinker.kind": kind, "tinker.name": name,
                "tinker.path": where, TINKER_BASE_TAG: m.base_identity, TINKER_BASE_PATH_TAG: m.base_model}
        version = self.tracker.register_adapter(m.run_id, reg, path, f"tinker/{kind}/{name}", tags)
        out = CheckpointVersion(reg, version, where, m.run_id, record["content_hash"])
        self._report(out, m, model_id, kind, name, step)
        return out

    def checkpoint_deleted(self, model_id: str, kind: Literal["weights", "sampler_weights"], name: str) -> int:
        """Forget a deleted checkpoint: every registered version of its tinker path and the run
        artifacts `checkpoint_saved` copied it to, so no copy outlives the delete. How many
        versions went (0 when it was never registered)."""
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository as repository

        reg = registered_name(model_id)
        where = tinker_path(model_id, kind, name)
        client = self.tracker.client
        versions = client.search_model_versions(f"name = '{reg}' and tags.`tinker.path` = '{where}'", max_results=1000)
        for v in versions:
            client.delete_model_version(reg, str(v.version))
        run_id = self._find_run(model_id)
        if run_id is not None:
            try:
                repository(client.get_run(run_id).info.artifact_uri).delete_artifacts(f"tinker/{kind}/{name}")
            except FileNotFoundError:
                pass  # never copied (registration had failed) or already gone
        return len(versions)

    def _claim(self, reg: str, model_id: str) -> None:
        """Create `reg` tagged with `model_id`; refuse when it holds another model id's versions."""
        self.tracker._ensure_model(reg)
        client = self.tracker.client
        owner = client.get_registered_model(reg).tags.get(MODEL_ID_TAG)
        if owner is None:
            client.set_registered_model_tag(reg, MODEL_ID_TAG, model_id)
        elif owner != model_id:
            raise ValueError(f"model ids {owner!r} and {model_id!r} both map to registered model {reg!r}; "
                             "model ids must differ in more than the characters outside [A-Za-z0-9_.-]")

    def _report(self, v: CheckpointVersion, m: _Model, model_id: str, kind: str, name: str, step: int) -> None:
        if self.report is None:
            return
        report = LineageReport(
            ("tinker", v.model),
            {"tinker_path": v.tinker_path, "registered_model": v.model, "version": v.version, "step": step,
             "base": m.base_identity, "base_model": m.base_model, "session_id": m.session_id, "model_id": model_id,
             "mlflow_run_id": v.run_id, "kind": kind, "name": name, "content_hash": v.content_hash},
            f"Tinker API checkpoint {v.tinker_path}, registered as {v.key}")
        try:
            self.report(report)
        except Exception as e:  # noqa: BLE001 - the checkpoint is saved and registered; only the report is lost
            self.report_errors += 1
            log.warning("lineage report of %s (%s) failed: %s: %s", v.key, v.tinker_path, type(e).__name__, e)


def webserver_reporter(url: str, timeout_s: float = 10.0) -> Callable[[LineageReport], None]:
    """A `TinkerTracker` report that records each checkpoint through the Dagster webserver at
    `url` (its external-assets API, `POST /report_asset_materialization/{asset_key}`): what a
    service started from the command line uses, since the library does not import dagster. A
    refusal raises with the webserver's answer (the tracker counts and logs it)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    base = url.rstrip("/")

    def report(r: LineageReport) -> None:
        key = "/".join(urllib.parse.quote(part, safe="") for part in r.asset_key)
        body = json.dumps({"metadata": r.metadata, "description": r.description}).encode()
        request = urllib.request.Request(f"{base}/report_asset_materialization/{key}", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"the Dagster webserver at {base} refused the report ({e.code}: "
                               f"{e.read()[:200].decode(errors='replace')})") from None
    return report


class ResilientTracker:
    """A tracker (`TinkerTracker`) whose calls never fail the service's: each is tried
    `attempts` times with backoff (`backoff_s`, doubling), and one that still raises is logged
    on one line and answered None. Tracking follows the work: an `optim_step` already applied or
    a checkpoint already written is not failed because MLflow was unreachable. The tracker's
    methods are idempotent (a run is found by its model id, a step logged once, a checkpoint
    registered once per path and content), so a retry does no harm. `failures` counts the
    calls given up on. Other attributes are the tracker's own."""

    CALLS = ("start_model", "log_step", "end_model", "checkpoint_saved", "checkpoint_deleted")

    def __init__(self, tracker: Any, attempts: int = 3, backoff_s: float = 0.25):
        self.inner, self.attempts, self.backoff_s = tracker, attempts, backoff_s
        self.failures = 0

    @classmethod
    def around(cls, tracker: Any) -> ResilientTracker:
        return tracker if isinstance(tracker, cls) else cls(tracker)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name not in self.CALLS:
            return value
        return lambda *args, **kwargs: self._call(name, value, args, kwargs)

    def _call(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        delay, attempt = self.backoff_s, 0
        while True:
            attempt += 1
            try:
                return fn(*args, **kwargs)
            except ValueError as e:  # the tracker refused what it was given: trying again changes nothing
                why = e
                break
            except Exception as e:  # noqa: BLE001 - tracking must not fail the work it records
                why = e
            if attempt >= self.attempts:
                break
            time.sleep(delay)
            delay *= 2
        self.failures += 1
        text = str(why).strip().splitlines()
        log.warning("tracking: %s(%s) failed (%d %s), given up (the call it tracks stands): %s: %s", name,
                    ", ".join(repr(a) for a in args[:3]), attempt, "try" if attempt == 1 else "tries",
                    type(why).__name__, text[0] if text else "")
        return None
