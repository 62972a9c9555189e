"""DPO as assets, partitioned per experiment like the SFT warm start:

(sft_checkpoint ->) preference_pairs -> dpo_checkpoint

Pairs come from scored rollouts of the starting policy (the SFT checkpoint when `sft.steps` > 0,
else the base model). The checkpoint asset trains with the library's `run_dpo`, registers the
adapter as an MLflow model version and evaluates it. Artifacts go through the artifact store;
metadata carries their paths and the numbers.
"""

import time

import dagster as dg

from assets import checks
from assets.lineage import load_settings, save_settings, settings_config
from assets.partitions import EXPERIMENTS, check_experiment, ensure_partition, uri_value
from assets.run_config import RLConfig
from assets.sft import sft_checkpoint
from resources import ArtifactStoreResource, MLflowResource
from tinker_pipelines.algorithms.registry import get_algorithm
from tinker_pipelines.bases import base_tags
from tinker_pipelines.config import Config
from tinker_pipelines.loops.dpo import pair_metrics, preference_pairs as sample_pairs, run_dpo
from tinker_pipelines.loops.preferences import summarize_pairs
from tinker_pipelines.schedule_rules import DEVICE_POOL, LORA_STEP_TAGS
from tinker_pipelines.tracking import registered_model_name
from tinker_pipelines.tracking.mlflow_tracker import CHECKS_TAG, checks_tags
from tinker_pipelines.tracking.store import dumps, loads
from tinker_pipelines.loops.train import Experiment

GROUP = "dpo"


class DPOJobConfig(RLConfig):
    """One DPO experiment (partition = experiment name): the same settings as its `sft` run;
    `algorithm.name` must be a preference loss (dpo) and `dpo.*` sizes the pairs and steps."""


def pairs_key(experiment: str) -> str:
    return f"{experiment}/dpo/preference_pairs.json"


def _experiment(cfg: Config, store, name: str) -> Experiment:
    """The starting policy: the base model, or the `sft` job's warm-started weights."""
    exp = Experiment(cfg)
    if cfg.sft.steps:
        key = f"{name}/sft"
        if not store.exists(key):
            raise dg.Failure(f"sft.steps is {cfg.sft.steps}: materialize sft_checkpoint (the `sft` job) for "
                             f"experiment {name!r} first")
        exp.use_base(store.local_dir(key))
    return exp


@dg.asset(partitions_def=EXPERIMENTS, group_name=GROUP, deps=[sft_checkpoint], kinds={"pytorch"}, pool=DEVICE_POOL, op_tags=LORA_STEP_TAGS)
def preference_pairs(context: dg.AssetExecutionContext, config: DPOJobConfig,
                     artifact_store: ArtifactStoreResource) -> dg.MaterializeResult:
    """dpo.pairs (chosen, rejected) episode pairs: G replies per task from the starting policy,
    scored by the env's reward; tasks whose best and worst differ give one pair each."""
    name = check_experiment(context.partition_key)
    cfg = config.to_library_config()  # validates before any model loads
    if not get_algorithm(cfg.algorithm.name).pairwise:
        raise dg.Failure(f"algorithm.name is {cfg.algorithm.name!r}: the dpo job needs a preference loss (dpo)")
    ensure_partition(context.instance, EXPERIMENTS, name)
    store = artifact_store.store()
    save_settings(store, name, config.settings())
    start = time.perf_counter()
    exp = _experiment(cfg, store, name)
    pairs, tasks = sample_pairs(exp)
    if not pairs:
        raise dg.Failure(f"no preference pairs from {tasks} tasks: every group scored its replies alike "
                         "(raise dpo.group_size, dpo.max_rounds or training.temperature, or warm-start with sft)")
    uri = store.put_bytes(pairs_key(name), dumps(pairs))
    stats = summarize_pairs(pairs)
    return dg.MaterializeResult(metadata={
        "path": uri_value(uri), "store_key": pairs_key(name), "pairs": len(pairs), "tasks_sampled": tasks,
        **{k: v for k, v in stats.items() if k != "pairs"},
        "policy": f"sft checkpoint {name}/sft" if cfg.sft.steps else f"base model {cfg.model.name}",
        "wall_time_s": round(time.perf_counter() - start, 3)})


@dg.asset(partitions_def=EXPERIMENTS, group_name=GROUP, deps=[preference_pairs], kinds={"pytorch", "mlflow"},
          pool=DEVICE_POOL, op_tags=LORA_STEP_TAGS,
          check_specs=[dg.AssetCheckSpec(checks.ADAPTER_LOADS, asset="dpo_checkpoint", blocking=True,
                                         description="The written checkpoint matches its content hash, loads "
                                                     "and gives finite logits.")])
def dpo_checkpoint(context: dg.AssetExecutionContext, artifact_store: ArtifactStoreResource,
                   mlflow: MLflowResource) -> dg.MaterializeResult:
    """dpo.steps DPO steps on the pairs (LoRA: reference = adapter-disabled base; full: a frozen
    copy), saved, registered as a model version, evaluated on held-out tasks. As in the `rl` job,
    the version is tagged with the verdict of the blocking check (`tinker.checks`), and a failed
    check fails the step after registering it, so it is never promoted."""
    name = check_experiment(context.partition_key)
    store = artifact_store.store()
    settings = load_settings(store, name)
    cfg = settings_config(settings)
    pairs = loads(store.get_bytes(pairs_key(name)))
    tracker = mlflow.tracker()
    run_id = tracker.experiment_run(name, params=settings["config"])
    start = time.perf_counter()
    exp = _experiment(cfg, store, name)
    exp.start_rl()
    before = {**pair_metrics(exp.local_learner(), pairs, cfg.dpo.beta), **exp.evaluate()}

    def on_step(m: dict[str, float]) -> None:
        if int(m["iteration"]) % 10 == 0:
            context.log.info(f"dpo step {int(m['iteration'])}: loss {m['loss']:.4f}, accuracy {m['dpo/accuracy']:.2f}")

    history = run_dpo(exp, pairs, on_step)
    after = history[-1]
    key = f"{name}/dpo/adapter"
    local = store.write_dir(key)
    record = exp.save(local, after)
    uri = store.put_dir(local, key)
    for series in ("loss", "dpo/accuracy", "dpo/margin", "grad_norm"):
        tracker.log_series_once(run_id, f"dpo/train_{series.removeprefix('dpo/')}", [m[series] for m in history])
    tracker.log_metrics_once(run_id, cfg.dpo.steps, {f"dpo/{k}": v for k, v in after.items()
                                                      if k.startswith(("eval/", "pairs/"))})
    results = [checks.adapter_loads(exp, local)]
    model_name = registered_model_name(name)
    version = tracker.register_adapter(
        run_id, model_name, local, "adapters/dpo",
        tags={"dagster_run_id": context.run.run_id, "partition": name, "content_hash": record["content_hash"],
              "tinker.experiment": name, "algorithm": cfg.algorithm.name, "store_uri": uri,
              "preference_pairs": store.uri(pairs_key(name)), **base_tags(tracker, name, record),
              **checks_tags(checks.failed(results))})
    if checks.failed(results):
        context.log.error(f"{model_name} v{version} is tagged {CHECKS_TAG}=failed "
                          f"({', '.join(checks.failed(results))}): not promoted")
    score = checks.eval_score(after)
    tracker.set_version_tag(model_name, version, "eval_score", score)
    return dg.MaterializeResult(
        metadata={"path": uri_value(uri), "store_key": key, "content_hash": record["content_hash"],
                  "model_version": version, "registered_model": model_name, "mlflow_run_id": run_id,
                  "checks": checks.verdict(results), "steps": len(history), "pairs": len(pairs), "loss_first": history[0]["loss"],
                  "loss_last": after["loss"], "score": score,
                  **{f"before_{k.replace('/', '_')}": v for k, v in before.items() if not k.startswith("time/")},
                  **{f"after_{k.replace('/', '_')}": v for k, v in after.items()
                     if k.startswith(("eval/", "pairs/"))},
                  "wall_time_s": round(time.perf_counter() - start, 3)},
        check_results=results)


DPO_ASSETS = [preference_pairs, dpo_checkpoint]
