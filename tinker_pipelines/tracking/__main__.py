"""`python -m tinker_pipelines.tracking [--upgrade]`: create the embedded default under `.tinker/`
(or $TINKER_HOME) and print the environment and UI commands for it. `--upgrade` appends the
run-queue sections an existing `dagster.yaml` lacks (nothing already there changes)."""

import sys

from tinker_pipelines.tracking.home import default_home

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
