"""Sensors: continue an experiment until its configured iterations; evaluate new registry versions."""


import json

import dagster as dg

from assets.evaluation import CHAMPION, evaluate
from assets.jobs import rl
from assets.lineage import ADAPTER
from assets.partitions import ITERATIONS, iteration_key, parse_iteration_key
from assets.run_config import auto_continue, iteration_assets, rl_config_of, total_iterations
from resources import MLflowResource
from tinker_pipelines.schedule_rules import EXPERIMENT_TAG
from tinker_pipelines.tracking.mlflow_tracker import promotion_refusal


@dg.sensor(job=rl, minimum_interval_seconds=10, default_status=dg.DefaultSensorStatus.RUNNING)
def continue_training(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    """After iteration k of an experiment is materialized, request k+1 (same run config) until
    `training.iterations`; skips experiments launched with `auto_continue: false`, and adapters
    whose blocking checks failed (metadata `checks`: the run failed, nothing trains on from them)."""
    cursor = int(context.cursor or 0)
    records = context.instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=ADAPTER, after_storage_id=cursor),
                                                      limit=200, ascending=True).records
    requests, new_keys = [], []
    for rec in records:
        cursor = max(cursor, rec.storage_id)
        partition = rec.partition_key
        run = context.instance.get_run_by_id(rec.run_id) if partition else None
        if run is None:
            continue
        cfg = rl_config_of(run.run_config)
        if not auto_continue(cfg):
            continue
        verdict = rec.asset_materialization.metadata.get("checks")
        if verdict is not None and str(verdict.value) != "passed":
            context.log.info(f"{partition}: adapter checks {verdict.value}; not continuing from it")
            continue
        name, k = parse_iteration_key(partition)
        total = total_iterations(cfg)
        nxt = iteration_key(name, k + 1)
        if k + 1 >= total or context.instance.get_run_ids(dg.RunsFilter(tags={"dagster/partition": nxt}), limit=1):
            continue
        if not context.instance.has_dynamic_partition(ITERATIONS.name, nxt):
            new_keys.append(nxt)
        requests.append(dg.RunRequest(run_key=nxt, partition_key=nxt, run_config=run.run_config,
                                      asset_selection=iteration_assets(cfg, k + 1),
                                      tags={EXPERIMENT_TAG: name, "tinker/previous_run": rec.run_id}))
    return dg.SensorResult(run_requests=requests, cursor=str(cursor),
                           dynamic_partitions_requests=[ITERATIONS.build_add_request(new_keys)] if new_keys else [])


@dg.sensor(job=evaluate, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def new_adapter_versions(context: dg.SensorEvaluationContext, mlflow: MLflowResource) -> dg.SensorResult:
    """Poll the MLflow registry; evaluate the newest unseen version of each `tinker-*` model whose
    blocking checks passed and promote it to `champion` if it beats the current one (intermediate
    versions are skipped; a version that may not be promoted is never requested, and the log says why)."""
    seen: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
    tracker = mlflow.tracker()
    requests = []
    for name in tracker.models():
        new = tracker.client.search_model_versions(f"name = '{name}' and version_number > {seen.get(name, 0)}",
                                                   max_results=50, order_by=["version_number DESC"])
        if not new:
            continue
        seen[name] = max(seen.get(name, 0), *(int(mv.version) for mv in new))
        for mv in new:
            refusal = promotion_refusal(mv.tags)
            if refusal is None:
                requests.append(dg.RunRequest(
                    run_key=f"{name}:{mv.version}",
                    run_config={"ops": {"evaluate_adapter": {"config": {"model_name": name, "version": str(mv.version),
                                                                         "promote": True}}}},
                    tags={"tinker/model": name, "tinker/version": str(mv.version)}))
                break
            context.log.info(f"{name} v{mv.version} is not evaluated for promotion: {refusal}")
    return dg.SensorResult(run_requests=requests, cursor=json.dumps(seen, sort_keys=True))


@dg.schedule(job=evaluate, cron_schedule="0 3 * * *", default_status=dg.DefaultScheduleStatus.STOPPED)
def periodic_evaluation(context: dg.ScheduleEvaluationContext, mlflow: MLflowResource):
    """Nightly re-evaluation of every model's current champion (no promotion)."""
    tracker = mlflow.tracker()
    requests = []
    for name in tracker.models():
        if tracker.alias_version(name, CHAMPION) is not None:
            requests.append(dg.RunRequest(
                run_key=f"{name}:{context.scheduled_execution_time:%Y%m%d}",
                run_config={"ops": {"evaluate_adapter": {"config": {"model_name": name, "version": CHAMPION,
                                                                     "promote": False}}}}))
    return requests or dg.SkipReason("no registered model has a champion yet")


SENSORS = [continue_training, new_adapter_versions]
SCHEDULES = [periodic_evaluation]
