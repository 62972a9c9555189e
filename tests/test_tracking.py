"""MLflow tracking helpers against a real sqlite store; the local artifact store."""

from __future__ import annotations

import pytest

from tinker_pipelines.tracking import LocalStore, Tracker, open_store
from tinker_pipelines.tracking.mlflow_tracker import (EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, experiment_ui_path, flatten,
                                                       learning_curve_png)
from tinker_pipelines.tracking.store import dumps, loads


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    """One store for the module (creating an MLflow sqlite schema takes seconds); tests use distinct names."""
    d = tmp_path_factory.mktemp("mlflow")
    return Tracker(f"sqlite:///{d / 'mlflow.db'}", "t", artifact_location=str(d / "artifacts"))


def test_one_run_per_experiment_found_by_tag(tracker, tmp_path):
    run = tracker.experiment_run("exp", params={"training": {"learning_rate": 0.1}, "seed": 1})
    assert tracker.experiment_run("exp") == run
    fresh = Tracker(tracker.tracking_uri, "t")  # another process: lookup by tag, not memory
    assert fresh.experiment_run("exp") == run and fresh.experiment_run("other") != run
    assert tracker.client.get_run(run).data.params == {"training.learning_rate": "0.1", "seed": "1"}


def test_experiment_declares_itself_model_training(tracker):
    """MLflow 3's `mlflow.experimentKind`: set on a new experiment, added to an old one without it,
    kept when someone chose another kind (the REST API's view: tests/test_ui_browser.py)."""
    kind = EXPERIMENT_KIND_TAG
    assert (EXPERIMENT_KIND, kind) == ("custom_model_development", "mlflow.experimentKind")
    assert tracker.client.get_experiment(tracker.experiment_id).tags[kind] == "custom_model_development"
    old = tracker.client.create_experiment("made-before-the-tag")  # as a store from before this change holds it
    assert kind not in tracker.client.get_experiment(old).tags
    assert Tracker(tracker.tracking_uri, "made-before-the-tag").experiment_id == old
    assert tracker.client.get_experiment(old).tags[kind] == "custom_model_development"
    chosen = tracker.client.create_experiment("chosen-by-hand", tags={kind: "genai_development"})
    Tracker(tracker.tracking_uri, "chosen-by-hand")
    assert tracker.client.get_experiment(chosen).tags[kind] == "genai_development"
    assert experiment_ui_path("7") == "/#/experiments/7/runs?workflowType=machine_learning&compareRunsMode=CHART"


def test_metrics_logged_once_per_step(tracker):
    run = tracker.experiment_run("metrics")
    assert tracker.log_metrics_once(run, 0, {"reward_mean": 0.5, "kl": 0.1})
    assert not tracker.log_metrics_once(run, 0, {"reward_mean": 0.5, "kl": 0.1})  # a retry
    assert tracker.log_metrics_once(run, 1, {"reward_mean": 0.7, "kl": 0.2})
    assert tracker.history(run, "reward_mean") == [(0, 0.5), (1, 0.7)]
    assert len(tracker.client.get_metric_history(run, "kl")) == 2
    assert tracker.log_series_once(run, "sft/loss", [3.0, 2.0]) and not tracker.log_series_once(run, "sft/loss", [1.0])


def test_registry_versions_tags_aliases(tracker, tmp_path):
    run = tracker.experiment_run("registry")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "adapter_model.safetensors").write_bytes(b"weights")
    (ckpt / "record.json").write_text("{}")
    tags = {"partition": "exp:0", "content_hash": "abc", "dagster_run_id": "r1"}
    v1 = tracker.register_adapter(run, "tinker-registry", ckpt, "adapters/iter_00000", tags)
    assert tracker.register_adapter(run, "tinker-registry", ckpt, "adapters/iter_00000", tags) == v1  # retry
    v2 = tracker.register_adapter(run, "tinker-registry", ckpt, "adapters/iter_00001", {**tags, "partition": "exp:1"})
    assert (v1, v2) == ("1", "2")
    assert tracker.find_version("tinker-registry", partition="exp:1").tags["dagster_run_id"] == "r1"
    assert tracker.alias_version("tinker-registry", "champion") is None
    tracker.set_alias("tinker-registry", "champion", v1)
    assert str(tracker.alias_version("tinker-registry", "champion").version) == "1"
    tracker.set_alias("tinker-registry", "champion", v2)
    assert str(tracker.alias_version("tinker-registry", "champion").version) == "2"
    assert tracker.models() == ["tinker-registry"]
    got = tracker.download_version("tinker-registry", v2, tmp_path / "dl")
    assert (got / "adapter_model.safetensors").read_bytes() == b"weights"


def test_learning_curve_png():
    png = learning_curve_png({"reward_mean": [(0, 0.1), (1, 0.3)], "eval/exact_rate": [(1, 0.2)]}, "t")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_flatten_nested_params():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": {}}) == {"a.b": "1", "a.c.d": "x", "e": "{}"}


def test_local_store_round_trip(tmp_path):
    store = open_store(tmp_path / "store")
    assert isinstance(store, LocalStore)
    uri = store.put_bytes("exp/00000/rollout.json", dumps({"x": (1, 2)}))
    assert uri.endswith("exp/00000/rollout.json") and loads(store.get_bytes("exp/00000/rollout.json")) == {"x": (1, 2)}
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.txt").write_text("hi")
    store.put_dir(src, "exp/00000/adapter")
    assert (store.local_dir("exp/00000/adapter") / "sub" / "f.txt").read_text() == "hi"
    assert store.exists("exp/00000/adapter") and not store.exists("nope")
    with pytest.raises(FileNotFoundError):
        store.local_dir("nope")


def test_embedded_sqlite_store_is_wal_with_normal_sync(tracker, tmp_path):
    import sqlite3

    import sqlalchemy as sa

    tracker.log_metrics_once(tracker.experiment_run("wal"), 0, {"x": 1.0})
    path = tracker.tracking_uri.removeprefix("sqlite:///")
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)
    with sa.create_engine(tracker.tracking_uri).connect() as conn:  # any engine of this process on that file
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
    with sa.create_engine(f"sqlite:///{tmp_path / 'other.db'}").connect() as conn:  # other files keep the default
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL


def test_setup_command_prints_the_runs_chart_link_of_the_experiment(tmp_path):
    import os
    import subprocess
    import sys

    from tinker_pipelines.tracking.home import TinkerHome

    env = {**os.environ, "TINKER_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "tinker_pipelines.tracking"]
    before = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    assert "appears after the first training run" in before
    home = TinkerHome(tmp_path / "home")
    t = Tracker(home.mlflow_uri, "tinker", str(home.mlflow_artifacts))
    after = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    assert f"http://127.0.0.1:5000{experiment_ui_path(t.experiment_id)}" in after
