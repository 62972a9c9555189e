"""The embedded default: one project-local folder (`.tinker/`) holding everything.

```
.tinker/dagster/      DAGSTER_HOME: the Dagster instance (sqlite run, event and schedule storage)
.tinker/mlflow/       mlflow.db (tracking + registry, sqlite) and artifacts/ (MLflow artifacts)
.tinker/artifacts/    the artifact store: rollouts, scored batches, checkpoints
.tinker/cache/        local copies of remote (S3) checkpoints
```

`TINKER_HOME` moves the folder; the production settings (MLflow server, S3) replace parts of it.

A fresh `dagster.yaml` also sets up the run queue (docs/runtime.md "Run queue"): queued runs
with per-experiment and per-device limits, the `tinker_device` pool for the steps that load
models, run monitoring that frees the pool slots of crashed runs, and run retries for crashed
runs of the jobs that ask for them (`RUN_RETRIES`). An existing file is never
rewritten; `python -m tinker_pipelines.tracking --upgrade` appends the sections it lacks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tinker_pipelines.schedule_rules import EXPERIMENT_TAG, LOADS_MODEL_TAG, device_count, queue_limits


@dataclass(frozen=True)
class TinkerHome:
    """Paths of the embedded default deployment under `root`."""

    root: Path

    @property
    def dagster_home(self) -> Path:
        return self.root / "dagster"

    @property
    def mlflow_dir(self) -> Path:
        return self.root / "mlflow"

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{(self.mlflow_dir / 'mlflow.db').resolve()}"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.mlflow_dir / "artifacts"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def dagster_yaml(self) -> Path:
        return self.dagster_home / "dagster.yaml"

    def ensure(self, devices: int | None = None) -> "TinkerHome":
        """Create the folders and, in a fresh Dagster home, its `dagster.yaml` (idempotent).

        `devices` sizes the run queue of a fresh `dagster.yaml` (default: `device_count()`)."""
        fresh = not self.dagster_home.exists() or not any(self.dagster_home.iterdir())
        for p in (self.dagster_home, self.mlflow_artifacts, self.artifacts, self.cache):
            p.mkdir(parents=True, exist_ok=True)
        if fresh:  # never switch storage under an instance that already has runs
            self.dagster_yaml.write_text(dagster_yaml(self.dagster_home, devices or device_count()))
        return self

    def missing_run_queue_sections(self) -> list[str]:
        """The run-queue sections (`run_coordinator`, `concurrency`, `run_monitoring`) that the
        existing `dagster.yaml` lacks; [] when there is none (a fresh one gets them all)."""
        return list(_missing_sections(self.dagster_yaml))

    def upgrade_dagster_yaml(self, devices: int | None = None) -> list[str]:
        """Append the run-queue sections the existing `dagster.yaml` lacks; returns their names.

        Nothing already in the file changes: a user's own `run_coordinator` (or `run_queue`) is
        kept, and then no `concurrency.runs` limits are added; when it sets limits itself, no
        `concurrency` section at all (Dagster refuses both at once). Takes effect when the daemon,
        webserver and code location restart."""
        missing = _missing_sections(self.dagster_yaml)
        if missing:
            blocks = _run_queue_blocks(devices or device_count(), with_run_limits="run_coordinator" in missing)
            text = self.dagster_yaml.read_text()
            added = "".join(blocks[name] for name in missing)
            note = "# Run queue, added by `python -m tinker_pipelines.tracking --upgrade`.\n"
            self.dagster_yaml.write_text(text + ("" if text.endswith("\n") else "\n") + note + added)
        return list(missing)


RUN_QUEUE_SECTIONS = ("run_coordinator", "concurrency", "run_monitoring")
"""Top-level keys of `dagster.yaml` that make up the run queue."""
FREE_SLOTS_AFTER_RUN_END_S = 15
"""`run_monitoring.free_slots_after_run_end_seconds`: pool slots that a finished (e.g. crashed) run
still holds are freed this long after its end."""
MONITORING_POLL_S = 15
"""`run_monitoring.poll_interval_seconds`: how often the monitoring daemon looks (Dagster's default is 120)."""
START_TIMEOUT_S = 300
"""`run_monitoring.start_timeout_seconds`: a run still STARTING after this long is failed (a run
worker imports torch first, which takes long on a loaded machine)."""


def dagster_yaml(dagster_home: Path, devices: int) -> str:
    """The embedded default `dagster.yaml` for a machine with `devices` devices."""
    return DAGSTER_YAML.format(home=dagster_home) + "".join(_run_queue_blocks(devices).values()) + RUN_RETRIES


RUN_RETRIES = """\
# Run retries (the daemon re-executes a failed run from its failure) for crashes only: a killed or
# out-of-memory run worker. A failed step or check would fail the same way again; flaky steps retry
# within the run (rollout_batch: rollout_retries). No job retries unless it asks with the tag
# dagster/max_retries (the rl job does: assets/jobs.py); a retried iteration registers no second
# version and logs no metric twice.
run_retries:
  enabled: true
  max_retries: 0
  retry_on_asset_or_op_failure: false
"""


def _run_queue_blocks(devices: int, with_run_limits: bool = True) -> dict[str, str]:
    """The run-queue sections of `dagster.yaml` as text blocks, keyed by their top-level key."""
    q = queue_limits(devices)
    runs = f"""\
  runs:
    max_concurrent_runs: {q.max_concurrent_runs}   # all runs in progress (STARTING or STARTED)
    tag_concurrency_limits:
      - key: {EXPERIMENT_TAG}      # one run per experiment: iteration k+1 needs k's adapter
        value:
          applyLimitPerUniqueValue: true
        limit: {q.per_experiment}
      - key: {LOADS_MODEL_TAG}     # runs whose process loads a model (rl, sft, dpo, evaluate): one per device
        value: "true"
        limit: {q.model_runs}
""" if with_run_limits else ""
    return {
        "run_coordinator": """\
# Runs wait in a queue that the daemon (`dagster dev`, `dagster-daemon run`) drains under the
# limits below; `dagster job execute` and `assets.launch` bypass it (their steps still take pool slots).
run_coordinator:
  module: assets.run_queue
  class: TinkerRunCoordinator    # QueuedRunCoordinator + the tinker/experiment tag from the partition
""",
        "concurrency": f"""\
# Sized for {q.devices} device(s) when this file was written. Change the run limits here (restart the
# daemon); a pool's limit with `dagster instance concurrency set tinker_device N` or in the UI.
concurrency:
{runs}  pools:
    granularity: op              # a step holds its slot while it executes, not for the whole run
    default_limit: {q.pool_limit}             # every pool without a limit of its own: tinker_device (model steps)
    op_granularity_run_buffer: 0 # do not start a run whose first step would only wait for a slot
""",
        "run_monitoring": f"""\
run_monitoring:
  enabled: true
  start_timeout_seconds: {START_TIMEOUT_S}
  poll_interval_seconds: {MONITORING_POLL_S}
  free_slots_after_run_end_seconds: {FREE_SLOTS_AFTER_RUN_END_S}   # crashed runs give their pool slots back
""",
    }


_QUEUE_LIMIT_KEYS = ("max_concurrent_runs", "tag_concurrency_limits", "block_op_concurrency_limited_runs")
"""Limits a run coordinator's own config (or `run_queue`) may set; Dagster then refuses a `concurrency` section."""


def _missing_sections(path: Path) -> tuple[str, ...]:
    """The run-queue sections that can be appended to the `dagster.yaml` at `path`."""
    if not path.exists():
        return ()
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    missing = [key for key in RUN_QUEUE_SECTIONS if key not in data]
    if "run_queue" in data and "run_coordinator" in missing:  # Dagster's older spelling of the queue
        missing.remove("run_coordinator")
    own = [data.get("run_queue") or {}, (data.get("run_coordinator") or {}).get("config") or {}]
    if "concurrency" in missing and any(k in cfg for cfg in own for k in _QUEUE_LIMIT_KEYS):
        missing.remove("concurrency")
    return tuple(missing)


DAGSTER_YAML = """\
# Embedded default instance (written by tinker_pipelines.tracking.home on first use).
# Dagster's sqlite storages with one pooled engine per database and synchronous=NORMAL (WAL), so an
# event is not an fsync (resources/instance_storage.py, docs/runtime.md "Overhead"); one database
# for all event logs instead of one per run. Production: see docs/dagster.production.yaml.
run_storage:
  module: resources.instance_storage
  class: TinkerSqliteRunStorage
  config:
    base_dir: {home}/history
event_log_storage:
  module: resources.instance_storage
  class: TinkerSqliteEventLogStorage
  config:
    base_dir: {home}/history
schedule_storage:
  module: resources.instance_storage
  class: TinkerSqliteScheduleStorage
  config:
    base_dir: {home}/schedules
telemetry:
  enabled: false
"""


def default_home() -> TinkerHome:
    """`$TINKER_HOME`, else `.tinker/` in the current directory (the project root)."""
    return TinkerHome(Path(os.environ.get("TINKER_HOME") or Path.cwd() / ".tinker").resolve())

