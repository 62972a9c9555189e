"""The embedded default: one project-local folder (`.tinker/`) holding everything.

```
.tinker/dagster/      DAGSTER_HOME: the Dagster instance (sqlite run, event and schedule storage)
.tinker/mlflow/       mlflow.db (tracking + registry, sqlite) and artifacts/ (MLflow artifacts)
.tinker/artifacts/    the artifact store: rollouts, scored batches, checkpoints
.tinker/cache/        local copies of remote (S3) checkpoints
```

`TINKER_HOME` moves the folder; the production settings (MLflow server, S3) replace parts of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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

    def ensure(self) -> "TinkerHome":
        """Create the folders and, in a fresh Dagster home, its `dagster.yaml` (idempotent)."""
        fresh = not self.dagster_home.exists() or not any(self.dagster_home.iterdir())
        for p in (self.dagster_home, self.mlflow_artifacts, self.artifacts, self.cache):
            p.mkdir(parents=True, exist_ok=True)
        if fresh:  # never switch storage under an instance that already has runs
            (self.dagster_home / "dagster.yaml").write_text(DAGSTER_YAML.format(home=self.dagster_home))
        return self


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

