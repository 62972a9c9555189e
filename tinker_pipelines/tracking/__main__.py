"""`python -m tinker_pipelines.tracking [--upgrade]`: create the embedded default under `.tinker/`
(or $TINKER_HOME) and print the environment and UI commands for it. `--upgrade` appends the
run-queue sections an existing `dagster.yaml` lacks (nothing already there changes)."""

import sqlite3
import sys

from tinker_pipelines.tracking.home import default_home


def _experiment_id(db, name: str = "tinker") -> str | None:
    """The MLflow experiment's id, read from the store without importing MLflow (None: not yet created)."""
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            row = con.execute("SELECT experiment_id FROM experiments WHERE name = ?", (name,)).fetchone()
    except sqlite3.Error:
        return None
    return str(row[0]) if row else None


home = default_home()
existed = home.dagster_yaml.exists()
home.ensure()
if "--upgrade" in sys.argv[1:]:
    added = home.upgrade_dagster_yaml()
    print(f"# {home.dagster_yaml}: " + (f"added {', '.join(added)}; restart the daemon and the UI" if added
                                        else "has the run queue already"))
elif existed and home.missing_run_queue_sections():
    print(f"# {home.dagster_yaml} predates the run queue (no {', '.join(home.missing_run_queue_sections())}): "
          "`python -m tinker_pipelines.tracking --upgrade` adds it")
print(f"export DAGSTER_HOME={home.dagster_home}")
print("# Dagster UI: dagster dev -w workspace.yaml -h 127.0.0.1   (needs DAGSTER_HOME)")
print(f"# MLflow UI:  mlflow ui --backend-store-uri {home.mlflow_uri} -h 127.0.0.1 -p 5000")
exp = _experiment_id(home.mlflow_dir / "mlflow.db")
# MLflow's UI opens an experiment on its GenAI view unless the link names the model-training one
print("#   runs and their charts: http://127.0.0.1:5000" + (
    f"/#/experiments/{exp}/runs?workflowType=machine_learning&compareRunsMode=CHART" if exp else
    "  (the `tinker` experiment appears after the first training run)"))
