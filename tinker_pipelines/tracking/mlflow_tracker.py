"""MLflow for experiments: one run per experiment, per-iteration metrics, the adapter registry.

- `experiment_run(name)` finds the run by the tag `tinker.experiment` (deterministic lookup),
  creating it once; a retried iteration therefore logs into the same run.
- `log_metrics_once(run_id, step, metrics)` writes one atomic batch per step and skips a step
  already logged, so a retry never duplicates points.
- `register_adapter` logs the checkpoint directory as run artifacts and creates a model version
  from them with `create_model_version` (not `register_model`, which wants an MLflow model, and
  not the transformers flavour, which breaks PEFT reloads); a version already registered for the
  same partition and content hash is reused, also when two processes register it at once.
- Every version carries the verdict of its blocking checks (`tinker.checks`: passed/failed, and
  `tinker.checks.failed`: which); only a passed version may become `champion` (`promotion_refusal`).
- Aliases (`champion`), not stages.
- The MLflow experiment declares itself a model-training one (MLflow 3's experiment tag
  `mlflow.experimentKind` = `custom_model_development`, set at creation and added to an existing
  experiment that lacks it), not a GenAI one; `experiment_ui_path` is the UI link that opens on
  its runs and their charts.
- An embedded sqlite store runs in WAL mode with `synchronous=NORMAL` and busy timeouts (see
  `tune_sqlite`), so concurrent writers queue instead of failing with "database is locked".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

EXPERIMENT_TAG = "tinker.experiment"
CHECKS_TAG = "tinker.checks"
"""Version tag: `passed` or `failed`, the verdict of the blocking checks of the asset that wrote it."""
CHECKS_FAILED_TAG = "tinker.checks.failed"
"""Version tag: the failed blocking checks, comma-separated ('' when all passed)."""
BUSY_TIMEOUT_MS = 60_000
"""How long a new connection to an embedded sqlite store waits for another process's lock."""
LOCKED_RETRIES = 5
"""Registry writes retried when sqlite still reports a lock after the busy timeout."""
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
"""MLflow 3's experiment tag for what an experiment holds (`genai_development`: traces of an app;
`custom_model_development`: training runs with metrics)."""
EXPERIMENT_KIND = "custom_model_development"
"""Our experiments hold training runs: MLflow's UI is to show their runs and charts, not traces."""


def experiment_ui_path(experiment_id: str) -> str:
    """The MLflow UI page (after the server's address) with the runs of an experiment as charts.

    MLflow 3.17's UI picks its GenAI or model-training view by a switch kept in the browser
    (GenAI on a first visit) or by the `workflowType` query parameter, not by the experiment's
    kind: this link names the model-training view, the runs tab and the chart view."""
    return f"/#/experiments/{experiment_id}/runs?workflowType=machine_learning&compareRunsMode=CHART"


def checks_tags(failed: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The version tags recording which blocking checks failed (none: passed)."""
    return {CHECKS_TAG: "failed" if failed else "passed", CHECKS_FAILED_TAG: ",".join(failed)}


def promotion_refusal(tags: dict[str, str]) -> str | None:
    """Why a version with these tags may not be promoted, or None when it may."""
    verdict = tags.get(CHECKS_TAG)
    if verdict == "passed":
        return None
    if verdict == "failed":
        return f"its blocking checks failed ({tags.get(CHECKS_FAILED_TAG) or 'unnamed'})"
    return f"it has no {CHECKS_TAG} tag: it was not registered by a checked asset"


def registered_model_name(experiment: str) -> str:
    """The registry name of an experiment's adapters: `tinker-<experiment>`."""
    return f"tinker-{experiment}"


def flat_fields(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> dotted names, values as they are (an empty dict stays a value).

    >>> flat_fields({"a": {"b": 1, "c": {"d": "x"}}, "e": {}})
    {'a.b': 1, 'a.c.d': 'x', 'e': {}}
    """
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat_fields(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> MLflow params (`training.learning_rate`: '0.0001'; MLflow caps a value at 500 characters)."""
    return {k: str(v)[:500] for k, v in flat_fields(d, prefix).items()}


_TUNED_SQLITE: set[str] = set()


def tune_sqlite(uri: str) -> None:
    """Put the sqlite database of `uri` (sqlite:///path) in WAL mode with `synchronous=NORMAL` and a
    busy timeout of `BUSY_TIMEOUT_MS` on every connection this process opens to it.

    MLflow's sqlite store otherwise uses a rollback journal and fsyncs several times per commit
    (each logged batch, version, tag), which costs 5-20 ms per commit while other processes write
    to the disk. WAL with NORMAL is sqlite's recommended pair: commits survive a crash of the
    process and the database is never corrupted; an OS crash or power loss may drop the last
    commits. Other URIs are left alone. The journal mode is a property of the file, so other
    readers (`mlflow ui`) simply follow it. In WAL mode readers never wait for the writer, and
    writers (several step processes registering versions) wait for each other: the busy timeout
    set here covers the journal-mode switch at connect, MLflow sets 20 s for each of its sessions,
    and a registry write still locked after that is retried (`_unlocked`).
    """
    if not uri.startswith("sqlite:///"):
        return
    import os
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    path = os.path.realpath(uri.removeprefix("sqlite:///").split("?")[0])
    if not _TUNED_SQLITE:
        @event.listens_for(Engine, "connect")
        def _pragmas(dbapi_conn, _record) -> None:  # every engine, filtered to the tuned files
            if not isinstance(dbapi_conn, sqlite3.Connection):
                return
            row = dbapi_conn.execute("PRAGMA database_list").fetchone()
            if row and row[2] and os.path.realpath(row[2]) in _TUNED_SQLITE:
                # first, so that switching the journal mode waits for other writers too
                dbapi_conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
                dbapi_conn.execute("PRAGMA journal_mode=WAL").fetchall()
                dbapi_conn.execute("PRAGMA synchronous=NORMAL")
    _TUNED_SQLITE.add(path)


class Tracker:
    """An MLflow client bound to one tracking URI and one MLflow experiment."""

    def __init__(self, tracking_uri: str, experiment_name: str = "tinker", artifact_location: str | None = None,
                 registry_uri: str | None = None):
        from mlflow import MlflowClient

        tune_sqlite(tracking_uri)
        if registry_uri:
            tune_sqlite(registry_uri)
        self.tracking_uri = tracking_uri
        self._runs: dict[str, str] = {}
        self._artifact_uris: dict[str, str] = {}  # run id -> artifact root (fixed at run creation)
        self._models: set[str] = set()  # registered models known to exist
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri or tracking_uri)
        exp = self.client.get_experiment_by_name(experiment_name)
        if exp is None:
            try:
                self.experiment_id = self.client.create_experiment(experiment_name, artifact_location=artifact_location,
                                                                   tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
                return
            except Exception:  # created concurrently by another process
                exp = self.client.get_experiment_by_name(experiment_name)
        self.experiment_id = exp.experiment_id
        if EXPERIMENT_KIND_TAG not in exp.tags:  # created before we declared it, or by hand: a kind set there stays
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)

    # -- runs and metrics -----------------------------------------------------------------
    def find_run(self, experiment: str) -> str | None:
        runs = self.client.search_runs([self.experiment_id], f"tags.`{EXPERIMENT_TAG}` = '{experiment}'",
                                       max_results=2, order_by=["attributes.start_time ASC"])
        return runs[0].info.run_id if runs else None

    def experiment_run(self, experiment: str, params: dict[str, Any] | None = None) -> str:
        """The MLflow run of `experiment`, created (with params) on first use."""
        if experiment in self._runs:
            return self._runs[experiment]
        run_id = self.find_run(experiment)
        if run_id is None:
            run = self.client.create_run(self.experiment_id, run_name=experiment, tags={EXPERIMENT_TAG: experiment})
            run_id = run.info.run_id
            if params:
                from mlflow.entities import Param

                items = [Param(k, v) for k, v in flatten(params).items()]
                for i in range(0, len(items), 100):
                    self.client.log_batch(run_id, params=items[i:i + 100])
        self._runs[experiment] = run_id
        return run_id

    def logged_steps(self, run_id: str, key: str) -> set[int]:
        return {m.step for m in self.client.get_metric_history(run_id, key)}

    def log_metrics_once(self, run_id: str, step: int, metrics: dict[str, float]) -> bool:
        """Log `metrics` at `step` in one batch unless that step is already there; True if logged."""
        if not metrics:
            return False
        sentinel = sorted(metrics)[0]
        if step in self.logged_steps(run_id, sentinel):
            return False
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in sorted(metrics.items())])
        return True

    def log_series_once(self, run_id: str, key: str, values: list[float]) -> bool:
        """Log a whole series (step = index) unless `key` already has points; True if logged."""
        if not values or self.client.get_metric_history(run_id, key):
            return False
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, float(v), now, i) for i, v in enumerate(values)]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i:i + 1000])
        return True

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) pairs of a metric, one per step (the first if ever duplicated)."""
        seen: dict[int, float] = {}
        for m in sorted(self.client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
            seen.setdefault(m.step, m.value)
        return sorted(seen.items())

    def log_png(self, run_id: str, png: bytes, artifact_file: str) -> str:
        """Store a PNG as a run artifact; returns its artifact URI."""
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / Path(artifact_file).name
            p.write_bytes(png)
            sub = str(Path(artifact_file).parent) if "/" in artifact_file else None
            self.client.log_artifact(run_id, str(p), artifact_path=sub)
        return f"{self.artifact_uri(run_id)}/{artifact_file}"

    def finish(self, run_id: str) -> None:
        self.client.set_terminated(run_id, "FINISHED")

    # -- registry -----------------------------------------------------------------------
    def artifact_uri(self, run_id: str) -> str:
        if run_id not in self._artifact_uris:
            self._artifact_uris[run_id] = self.client.get_run(run_id).info.artifact_uri
        return self._artifact_uris[run_id]

    def _ensure_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        if name in self._models:  # registered models are never deleted by this project
            return
        try:
            self.client.get_registered_model(name)
        except MlflowException:
            try:
                self.client.create_registered_model(name, description="LoRA/full checkpoints of one experiment")
            except MlflowException:
                pass  # created concurrently
        self._models.add(name)

    def find_version(self, name: str, oldest: bool = False, **tags: str):
        """The newest (or oldest) version of `name` whose tags include all of `tags`, or None."""
        filt = " and ".join([f"name = '{name}'"] + [f"tags.`{k}` = '{v}'" for k, v in tags.items()])
        order = "ASC" if oldest else "DESC"
        found = self.client.search_model_versions(filt, max_results=10, order_by=[f"version_number {order}"])
        return found[0] if found else None

    def register_adapter(self, run_id: str, name: str, local_dir: str | Path, artifact_path: str,
                         tags: dict[str, str]) -> str:
        """Log `local_dir` as run artifacts and register them as a version of `name`; returns the version.

        Idempotent: a version with the same `partition` and `content_hash` tags is returned as is
        (its `tinker.checks` tags brought up to date). Two processes registering the same one at
        once both create a version; each then keeps the lowest of them and the later one deletes
        its own, so both return the same version.
        """
        tags = {k: str(v) for k, v in tags.items()}
        self._ensure_model(name)
        same = {"partition": tags["partition"], "content_hash": tags["content_hash"]} \
            if "partition" in tags and "content_hash" in tags else None
        if same:
            # the oldest: a newer one may be a racing writer's, about to be deleted
            existing = self.find_version(name, oldest=True, **same)
            if existing is not None:
                for key in (CHECKS_TAG, CHECKS_FAILED_TAG):
                    if key in tags and existing.tags.get(key) != tags[key]:
                        self.set_version_tag(name, existing.version, key, tags[key])
                return str(existing.version)
        self.client.log_artifacts(run_id, str(local_dir), artifact_path=artifact_path)
        source = f"{self.artifact_uri(run_id)}/{artifact_path}"
        mv = _unlocked(lambda: self.client.create_model_version(name, source, run_id=run_id, tags=tags))
        if same:
            first = self.find_version(name, oldest=True, **same)
            if first is not None and int(first.version) < int(mv.version):
                _unlocked(lambda: self.client.delete_model_version(name, str(mv.version)))
                return str(first.version)
        return str(mv.version)

    def set_version_tag(self, name: str, version: str, key: str, value: Any) -> None:
        self.client.set_model_version_tag(name, str(version), key, str(value))

    def alias_version(self, name: str, alias: str):
        """The model version behind `alias`, or None."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(name, alias)
        except MlflowException:
            return None

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, alias, str(version))

    def models(self, prefix: str = "tinker-") -> list[str]:
        return sorted(m.name for m in self.client.search_registered_models(f"name LIKE '{prefix}%'"))

    def latest_version(self, name: str):
        found = self.client.search_model_versions(f"name = '{name}'", max_results=1, order_by=["version_number DESC"])
        return found[0] if found else None

    def download_version(self, name: str, version: str, dest: str | Path) -> Path:
        """Fetch a version's files (the checkpoint directory) to `dest`."""
        import mlflow.artifacts

        mv = self.client.get_model_version(name, str(version))
        out = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dest),
                                                  tracking_uri=self.tracking_uri)
        return Path(out)


def _unlocked(write):
    """`write()`, retried with backoff while sqlite reports "database is locked" (a lock held past
    the busy timeout); a locked write changed nothing, so repeating it is safe."""
    from mlflow.exceptions import MlflowException

    for attempt in range(LOCKED_RETRIES + 1):
        try:
            return write()
        except MlflowException as e:
            if "database is locked" not in str(e) or attempt == LOCKED_RETRIES:
                raise
            time.sleep(0.2 * 2 ** attempt)


def learning_curve_png(series: dict[str, list[tuple[int, float]]], title: str = "") -> bytes:
    """A small PNG of metric curves (step, value), one line per series (matplotlib, Agg)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3), dpi=80)
    ax = fig.add_subplot()
    for label, pts in series.items():
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", markersize=3, label=label)
    ax.set_xlabel("iteration")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
