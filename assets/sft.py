"""The supervised warm start as an asset, partitioned per experiment: the RL iterations of an
experiment with `sft.steps > 0` start from this checkpoint. Each warm start is also registered
as a version of `sft-<experiment>`, so an adapter's recorded base can be fetched anywhere."""


import time

import dagster as dg

from assets.lineage import save_settings
from assets.partitions import EXPERIMENTS, check_experiment, ensure_partition, uri_value
from assets.run_config import RLConfig
from resources import ArtifactStoreResource, MLflowResource
from tinker_pipelines.bases import register_base, sft_model_name
from tinker_pipelines.checkpoint import content_hash
from tinker_pipelines.schedule_rules import DEVICE_POOL, EXCLUSIVE_STEP_TAGS
from tinker_pipelines.loops.train import Experiment


@dg.asset(partitions_def=EXPERIMENTS, group_name="sft", kinds={"pytorch", "mlflow"}, pool=DEVICE_POOL, op_tags=EXCLUSIVE_STEP_TAGS)
def sft_checkpoint(context: dg.AssetExecutionContext, config: RLConfig, artifact_store: ArtifactStoreResource,
                   mlflow: MLflowResource) -> dg.MaterializeResult:
    """Full-parameter SFT of the base model on the env's demonstrations (sft.* of the config)."""
    name = check_experiment(context.partition_key)
    cfg = config.to_library_config()
    ensure_partition(context.instance, EXPERIMENTS, name)
    if cfg.sft.steps < 1:
        raise dg.Failure(f"sft.steps is {cfg.sft.steps}: nothing to train (set sft.steps > 0)")
    store = artifact_store.store()
    settings = save_settings(store, name, config.settings())
    tracker = mlflow.tracker()
    run_id = tracker.experiment_run(name, params=settings["config"])
    start = time.perf_counter()
    exp = Experiment(cfg)
    history = exp.sft(lambda i, m: context.log.info(f"sft step {i}: loss {m['loss']:.4f}") if i % 50 == 0 else None)
    key = f"{name}/sft"
    local = store.write_dir(key)
    local.mkdir(parents=True, exist_ok=True)
    exp.save_base(local)
    uri = store.put_dir(local, key)
    tracker.log_series_once(run_id, "sft/loss", [m["loss"] for m in history])
    # the adapters trained on it name it by content hash: registered, it travels with them
    version = register_base(tracker, run_id, name, local)
    return dg.MaterializeResult(metadata={
        "path": uri_value(uri), "store_key": key,
        "content_hash": content_hash(local), "steps": len(history), "final_loss": history[-1]["loss"],
        "registered_model": sft_model_name(name), "model_version": version,
        "mlflow_run_id": run_id, "wall_time_s": round(time.perf_counter() - start, 3)})
