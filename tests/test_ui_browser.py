"""What a person sees in the two UIs, over a real experiment, in headless Chromium.

One module fixture trains experiment `uitest` for real (the SFT warm start, two `rl` iterations
(the last one evaluated), on the tiny model; then the `evaluate` job promotes the latest version to
`champion`) on the session's project home while it starts `dagster-webserver` and `mlflow ui`
(the command `python -m tinker_pipelines.tracking` prints) on 127.0.0.1. Exact facts are asserted
through Dagster's GraphQL endpoint and MLflow's REST API; the browser (Debian's `chromium`,
driven by Playwright through `executable_path`, no downloaded browser) checks what a person sees,
and every page is saved as a PNG into `$TINKER_TEST_ARTIFACTS/ui_screenshots/` (else a pytest
temporary folder; the path is printed). docs/runtime.md, "What you see in the UIs".
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
from dagster_env import SMALL, materializations, metadata, tinker_home, tracker
from test_listeners import _free_port, _stop

from assets.launch import run_iterations, run_sft
from tinker_pipelines.tracking import registered_model_name
from tinker_pipelines.tracking.mlflow_tracker import EXPERIMENT_KIND_TAG, experiment_ui_path

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXP = "uitest"
MODEL = registered_model_name(EXP)
CONFIG = {**SMALL, "training": {**SMALL["training"], "iterations": 2}, "eval": {"every": 2, "num_tasks": 4},
          "sft": {**SMALL["sft"], "steps": 20}}
RL_ASSETS = {"rollout_batch": {"rewards_finite"}, "scored_trajectories": set(),
             "adapter_checkpoint": {"adapter_loads", "kl_within_bound"}, "eval_report": {"not_worse_than_champion"}}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
UI_TIMEOUT_MS = 60_000  # a page under the load of a shared 2-core machine


@dataclass
class World:
    dagster: str  # http://127.0.0.1:PORT
    mlflow: str
    dagster_home: Path
    community_dialog_dismissed: bool
    shots: Path
    browser: object

    def page(self, width: int = 1600, height: int = 1000):
        """A page in a fresh browser context: a first visit, with nothing remembered."""
        ctx = self.browser.new_context(viewport={"width": width, "height": height})
        ctx.set_default_timeout(UI_TIMEOUT_MS)
        return ctx.new_page()

    def shot(self, page, name: str) -> Path:
        path = self.shots / f"{name}.png"
        page.screenshot(path=str(path))
        return path


def _get(url: str, data: dict | None = None) -> dict:
    body = json.dumps(data).encode() if data is not None else None
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _graphql(world: World, query: str, variables: dict | None = None) -> dict:
    out = _get(f"{world.dagster}/graphql", {"query": query, "variables": variables or {}})
    assert "errors" not in out, out
    return out["data"]


def _rest(world: World, endpoint: str, **params) -> dict:
    return _get(f"{world.mlflow}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(params)}")


def _printed_mlflow_ui(env: dict, port: int) -> list[str]:
    """`mlflow ui ...` as `python -m tinker_pipelines.tracking` prints it, on `port`, one worker."""
    out = subprocess.run([sys.executable, "-m", "tinker_pipelines.tracking"], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout
    (line,) = [ln for ln in out.splitlines() if ln.startswith("# MLflow UI:")]
    cmd = shlex.split(line.split(":", 1)[1])
    assert cmd[0] == "mlflow" and cmd[cmd.index("-h") + 1] == "127.0.0.1"
    cmd[cmd.index("-p") + 1] = str(port)
    return [str(BIN / "mlflow"), *cmd[1:], "--workers", "1"]


def _wait_until_up(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} never answered: {log.read_text()[-3000:]}")


def _wait_until_loaded(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 300) -> None:
    """The webserver answers `/server_info` before its code locations load: wait until every one is
    LOADED, and fail at once with its Python error if one could not load."""
    query = """{ workspaceOrError { __typename ... on Workspace { locationEntries { name loadStatus
                 locationOrLoadError { __typename ... on PythonError { message } } } } } }"""
    deadline = time.monotonic() + timeout_s
    entries: list = []
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            data = _get(f"{url}/graphql", {"query": query})["data"]["workspaceOrError"]
        except (OSError, KeyError, TypeError, ValueError):
            data = {}
        entries = data.get("locationEntries") or []
        for e in entries:
            err = e.get("locationOrLoadError") or {}
            if err.get("__typename") == "PythonError":
                raise AssertionError(f"code location {e['name']} failed to load: {err['message']}")
        if entries and all(e["loadStatus"] == "LOADED" for e in entries):
            return
        time.sleep(1)
    raise AssertionError(f"code locations never loaded ({entries}): {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: .ci/run installs it with apt-get")
        pytest.skip("no chromium on PATH (`apt-get install chromium`, as scripts/setup does when run as root)")
    from playwright.sync_api import sync_playwright

    from tinker_pipelines.tracking import TinkerHome

    home = tinker_home()  # the session's: MLflow store and artifacts of the code location's resources
    # a Dagster instance of our own, fresh as a user's first one (its dagster.yaml from TinkerHome.ensure)
    dagster_home = TinkerHome(tmp_path_factory.mktemp("ui-home")).ensure().dagster_home
    root = Path(os.environ["TINKER_TEST_ARTIFACTS"]) if os.environ.get("TINKER_TEST_ARTIFACTS") else \
        tmp_path_factory.mktemp("ui")
    shots = root / "ui_screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    logs = tmp_path_factory.mktemp("ui-logs")
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home), "TINKER_HOME": str(home.root),
           "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    dport, mport = _free_port(), _free_port()
    procs = []
    tracker()  # the MLflow schema first: `mlflow ui` creating it at the same moment fails one of the two
    try:
        # both servers start (tens of seconds each here) while the experiment trains
        for cmd, log in (([str(BIN / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(dport)],
                          logs / "dagster.log"),
                         (_printed_mlflow_ui(env, mport), logs / "mlflow.log")):
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                                           start_new_session=True), log))
        t0 = time.monotonic()
        with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
            assert run_sft(instance, EXP, CONFIG)
            assert run_iterations(instance, EXP, CONFIG) == [True, True]
            from assets.definitions import evaluate_job

            cfg = {"ops": {"evaluate_adapter": {"config": {"model_name": MODEL, "version": "latest", "promote": True}}}}
            with dg.execute_job(dg.reconstructable(evaluate_job), instance, run_config=cfg) as res:
                assert res.success
            assert metadata(materializations(instance, "eval_report", f"{EXP}:1")[0])["learning_curve_png"]
        trained = time.monotonic() - t0
        (dagster, dlog), (mlflow, mlog) = procs
        _wait_until_up(dagster, f"http://127.0.0.1:{dport}/server_info", dlog)
        _wait_until_loaded(dagster, f"http://127.0.0.1:{dport}", dlog)
        _wait_until_up(mlflow, f"http://127.0.0.1:{mport}/health", mlog)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():  # shown even while pytest captures output
                reporter.write_line(f"test_ui_browser: trained in {trained:.0f} s, both UIs up after "
                                    f"{time.monotonic() - t0:.0f} s; screenshots in {shots}")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM)
            try:
                yield World(f"http://127.0.0.1:{dport}", f"http://127.0.0.1:{mport}", dagster_home, False, shots,
                            browser)
            finally:
                browser.close()
    finally:
        for proc, _ in procs:  # both at once: each may take seconds to go
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc, _ in procs:
            _stop(proc)  # waits; SIGKILL to the group after 20 s


# -- Dagster ----------------------------------------------------------------------------------

def _dismiss_community_dialog(world: World, page) -> None:
    """Dagster shows 'Join the Dagster community' on the first visit to a fresh instance; Skip
    records it in $DAGSTER_HOME/.nux/nux.yaml, so no later page (or person) sees it again."""
    dialog = page.get_by_text("Join the Dagster community")
    if world.community_dialog_dismissed:
        return
    nux = world.dagster_home / ".nux" / "nux.yaml"
    # only the file says "seen": Dagster creates the .nux folder itself whenever the page asks
    assert not nux.exists()
    dialog.wait_for(state="visible")
    page.get_by_role("button", name="Skip").click()
    dialog.wait_for(state="hidden")
    deadline = time.monotonic() + 10
    while not nux.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "seen" in nux.read_text()
    world.community_dialog_dismissed = True


def test_graphql_asset_graph_checks_and_runs(world):
    data = _graphql(world, """{ assetNodes { assetKey { path } groupName dependencyKeys { path }
        assetChecksOrError { ... on AssetChecks { checks { name blocking } } } } }""")
    nodes = {"/".join(n["assetKey"]["path"]): n for n in data["assetNodes"]}
    rl = {k: n for k, n in nodes.items() if n["groupName"] == "rl"}
    assert set(rl) == set(RL_ASSETS)
    for asset, checks in RL_ASSETS.items():
        assert {c["name"] for c in rl[asset]["assetChecksOrError"]["checks"]} == checks, asset
    assert [d["path"] for d in rl["adapter_checkpoint"]["dependencyKeys"]] == [["scored_trajectories"]]
    runs = _graphql(world, """query($tags: [ExecutionTag!]) { runsOrError(filter: {tags: $tags}) {
        ... on Runs { results { runId jobName status tags { key value } } } } }""",
                    {"tags": [{"key": "dagster/partition", "value": f"{EXP}:1"}]})["runsOrError"]["results"]
    assert [(r["jobName"], r["status"]) for r in runs] == [("rl", "SUCCESS")]


def test_dagster_asset_lineage_shows_our_assets_and_their_checks(world):
    page = world.page()
    page.goto(f"{world.dagster}/locations/assets.definitions/asset-groups/rl/lineage")
    _dismiss_community_dialog(world, page)
    graph = page.locator("body")
    for asset in RL_ASSETS:
        page.get_by_text(asset, exact=True).first.wait_for(state="visible")
    # each node's check summary: all of its checks passed in the latest materialization
    page.get_by_text("2 / 2 Passed").first.wait_for(state="visible")
    assert graph.get_by_text("1 / 1 Passed").count() >= 2  # rollout_batch and eval_report
    assert page.get_by_text("Join the Dagster community").count() == 0
    world.shot(page, "dagster_asset_lineage")
    page.goto(f"{world.dagster}/assets/adapter_checkpoint?view=checks")
    for check in ("adapter_loads", "kl_within_bound"):
        page.get_by_text(check, exact=True).first.wait_for(state="visible")
    page.get_by_text("blocking").first.wait_for(state="visible")
    page.get_by_text("Passed", exact=True).first.wait_for(state="visible")
    assert page.get_by_text("Join the Dagster community").count() == 0  # dismissed for good
    world.shot(page, "dagster_adapter_checkpoint_checks")


def test_dagster_run_page_shows_a_finished_rl_run(world):
    (run,) = _graphql(world, """query($tags: [ExecutionTag!]) { runsOrError(filter: {tags: $tags}) {
        ... on Runs { results { runId } } } }""",
                      {"tags": [{"key": "dagster/partition", "value": f"{EXP}:1"}]})["runsOrError"]["results"]
    page = world.page()
    page.goto(f"{world.dagster}/runs/{run['runId']}")
    _dismiss_community_dialog(world, page)
    page.get_by_text("Success", exact=True).first.wait_for(state="visible")
    for step in RL_ASSETS:
        page.get_by_text(step, exact=True).first.wait_for(state="visible")
    page.get_by_text("RUN_SUCCESS").first.wait_for(state="visible")
    assert page.get_by_text(f"{EXP}:1").count() >= 1  # the partition tag
    world.shot(page, "dagster_rl_run")


def test_dagster_eval_report_metadata_shows_the_learning_curve(world):
    page = world.page()
    page.goto(f"{world.dagster}/assets/eval_report?partition={EXP}:1")
    _dismiss_community_dialog(world, page)
    page.get_by_text("learning_curve_png", exact=True).first.wait_for(state="visible")
    page.get_by_text("[Show Markdown]").first.click()
    img = page.locator("img[src^='data:image/png']").first
    img.wait_for(state="visible")
    width, height = img.evaluate("e => [e.naturalWidth, e.naturalHeight]")
    assert width > 100 and height > 100, (width, height)  # decoded, not a broken image
    world.shot(page, "dagster_eval_report_learning_curve")


# -- MLflow -----------------------------------------------------------------------------------

def _close_assistant(page) -> None:
    """MLflow 3.17 opens its Assistant panel on a first visit; close it, as a person would."""
    close = page.get_by_role("button", name="Close")
    try:
        close.first.wait_for(state="visible", timeout=15_000)
        close.first.click()
    except Exception:  # noqa: BLE001 - no panel opened: nothing to close
        pass


def _tinker_experiment(world: World) -> dict:
    return _rest(world, "experiments/get-by-name", experiment_name="tinker")["experiment"]


def _our_run(world: World, experiment_id: str) -> dict:
    out = _get(f"{world.mlflow}/api/2.0/mlflow/runs/search",
               {"experiment_ids": [experiment_id], "filter": f"tags.`tinker.experiment` = '{EXP}'"})
    (run,) = out["runs"]
    return run


def test_mlflow_rest_kind_curve_and_champion(world):
    exp = _tinker_experiment(world)
    assert {t["key"]: t["value"] for t in exp.get("tags", [])}[EXPERIMENT_KIND_TAG] == "custom_model_development"
    run = _our_run(world, exp["experiment_id"])
    assert run["info"]["status"] == "FINISHED"
    rid = run["info"]["run_id"]
    history = _rest(world, "metrics/get-history", run_id=rid, metric_key="reward_mean")["metrics"]
    assert sorted(m["step"] for m in history) == [0, 1]
    assert [m["step"] for m in _rest(world, "metrics/get-history", run_id=rid,
                                     metric_key="eval/reward_mean")["metrics"]] == [1]
    files = _rest(world, "artifacts/list", run_id=rid, path="curves")["files"]
    assert [f["path"] for f in files] == ["curves/learning_curve.png"] and int(files[0]["file_size"]) > 1000
    model = _rest(world, "registered-models/get", name=MODEL)["registered_model"]
    aliases = {a["alias"]: a["version"] for a in model.get("aliases", [])}
    versions = _get(f"{world.mlflow}/api/2.0/mlflow/model-versions/search?"
                    + urllib.parse.urlencode({"filter": f"name = '{MODEL}'"}))["model_versions"]
    assert sorted(v["version"] for v in versions) == ["1", "2"]
    assert aliases == {"champion": "2"}
    tags = {t["key"]: t["value"] for t in next(v for v in versions if v["version"] == "2")["tags"]}
    assert tags["tinker.checks"] == "passed" and tags["partition"] == f"{EXP}:1" and "eval_score" in tags


def test_mlflow_experiment_opens_on_runs_and_their_charts(world):
    exp = _tinker_experiment(world)
    page = world.page(height=1300)
    page.goto(world.mlflow + experiment_ui_path(exp["experiment_id"]))
    _close_assistant(page)
    page.get_by_role("heading", name="Runs").first.wait_for(state="visible")
    page.get_by_text(EXP, exact=True).first.wait_for(state="visible")  # our run in the run list
    page.get_by_placeholder("Search metric charts").fill("reward_mean")
    title = page.get_by_text("reward_mean", exact=True).first  # the chart of the per-iteration metric
    title.wait_for(state="visible")
    title.scroll_into_view_if_needed()
    page.get_by_text("Model metrics").first.wait_for(state="visible")
    # reward_mean and eval/reward_mean, drawn: the charts draw one after the other, as they load
    page.locator(".js-plotly-plot").nth(1).wait_for(state="attached", timeout=60_000)
    assert page.locator(".js-plotly-plot").count() >= 2
    headings = [h.inner_text() for h in page.get_by_role("heading").all()]
    assert "Overview" not in headings and page.get_by_text("No data available").count() == 0, headings  # not GenAI
    world.shot(page, "mlflow_experiment_charts")


def test_mlflow_run_shows_the_learning_curve_png(world):
    exp = _tinker_experiment(world)
    rid = _our_run(world, exp["experiment_id"])["info"]["run_id"]
    page = world.page()
    page.goto(f"{world.mlflow}/#/experiments/{exp['experiment_id']}/runs/{rid}/artifacts/curves/learning_curve.png"
              "?workflowType=machine_learning")
    _close_assistant(page)
    page.get_by_text("curves/learning_curve.png").first.wait_for(state="visible")
    img = page.locator("img[src^='blob:']").first
    img.wait_for(state="visible")
    width, height = img.evaluate("e => [e.naturalWidth, e.naturalHeight]")
    assert width > 100 and height > 100, (width, height)
    world.shot(page, "mlflow_learning_curve_png")


def test_mlflow_registry_shows_versions_tags_and_champion(world):
    page = world.page()
    page.goto(f"{world.mlflow}/#/models/{MODEL}")
    _close_assistant(page)
    page.get_by_role("heading", name=MODEL).first.wait_for(state="visible")
    for version in ("Version 1", "Version 2"):
        page.get_by_text(version, exact=True).first.wait_for(state="visible")
    page.get_by_text("champion").first.wait_for(state="visible")
    page.get_by_text("tinker.checks").first.wait_for(state="visible")
    page.get_by_text(f"{EXP}:1").first.wait_for(state="visible")  # version 2's partition tag
    row = page.locator("[role=row]", has=page.get_by_text("Version 2", exact=True))
    assert "champion" in row.first.inner_text()  # the alias sits on version 2's row
    world.shot(page, "mlflow_registry_champion")
