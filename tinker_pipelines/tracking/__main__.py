"""`python -m tinker_pipelines.tracking`: create the embedded default under `.tinker/` (or
$TINKER_HOME) and print the environment and UI commands for it."""

from tinker_pipelines.tracking.home import default_home

home = default_home().ensure()
print(f"export DAGSTER_HOME={home.dagster_home}")
print("# Dagster UI: dagster dev -w workspace.yaml -h 127.0.0.1   (needs DAGSTER_HOME)")
print(f"# MLflow UI:  mlflow ui --backend-store-uri {home.mlflow_uri} -h 127.0.0.1 -p 5000")
