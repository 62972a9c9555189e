"""The web UI: `dagster-webserver -w workspace.yaml` on 127.0.0.1 serves the asset graph.

Started in its own process group and stopped by killing the group (the webserver and `dagster
dev` spawn children, and `dagster dev` ignores SIGINT to its main process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)

ROOT = Path(__file__).resolve().parents[1]
QUERY = "{ assetNodes { assetKey { path } } repositoriesOrError { ... on RepositoryConnection { nodes { jobs { name } sensors { name } schedules { name } } } } }"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_webserver_serves_the_asset_graph(tmp_path):
    port = _free_port()
    (tmp_path / "dagster").mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "dagster"), "TINKER_HOME": str(tmp_path / "tinker"),
           "OMP_NUM_THREADS": "1"}
    exe = Path(sys.executable).with_name("dagster-webserver")
    proc = subprocess.Popen([str(exe), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "web.log", "wb"), start_new_session=True)
    try:
        data = None
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": QUERY}).encode(),
                                             headers={"Content-Type": "application/json"})
                data = json.loads(urllib.request.urlopen(req, timeout=10).read())["data"]
                if data["assetNodes"]:
                    break
            except (OSError, KeyError, TypeError):
                pass
            time.sleep(1)
        assert data and data["assetNodes"], (tmp_path / "web.log").read_text()[-3000:]
        assets = {"/".join(n["assetKey"]["path"]) for n in data["assetNodes"]}
        assert {"rollout_batch", "scored_trajectories", "adapter_checkpoint", "eval_report", "sft_checkpoint"} <= assets
        (repo,) = data["repositoriesOrError"]["nodes"]
        assert {"rl", "sft", "evaluate"} <= {j["name"] for j in repo["jobs"]}
        assert {s["name"] for s in repo["sensors"]} == {"continue_training", "new_adapter_versions"}
        assert [s["name"] for s in repo["schedules"]] == ["periodic_evaluation"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as r:
            assert r.status == 200
        _a_tinker_checkpoint_reported_through_the_webserver_is_on_the_instance(port, tmp_path / "dagster")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _a_tinker_checkpoint_reported_through_the_webserver_is_on_the_instance(port: int, dagster_home: Path) -> None:
    """What `tinker serve --dagster-url` does for each registered checkpoint (the library
    reports over HTTP: it does not import dagster)."""
    import dagster as dg
    import pytest

    from tinker_pipelines.serving.tinker.lineage import LineageReport, webserver_reporter

    report = webserver_reporter(f"http://127.0.0.1:{port}")
    report(LineageReport(("tinker", "tinkerapi-s1-train-0"), {"tinker_path": "tinker://s1:train:0/weights/w", "step": 3},
                         "Tinker API checkpoint tinker://s1:train:0/weights/w"))
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey(["tinker", "tinkerapi-s1-train-0"]))
    assert event is not None
    md = event.asset_materialization.metadata
    assert md["tinker_path"].value == "tinker://s1:train:0/weights/w" and md["step"].value == 3
    with pytest.raises(RuntimeError, match="refused the report"):
        webserver_reporter(f"http://127.0.0.1:{port}/no-such-prefix")(LineageReport(("tinker", "x"), {}, ""))
