"""The `evaluate` job: score a registered adapter version on held-out tasks and, when it beats
the current champion, move the registry alias `champion` to it.

Only a version whose blocking checks passed (`tinker.checks=passed`) and whose downloaded files
match the content hash it was registered with is promoted; the files are verified before anything
loads them, and a mismatch fails the run."""


import tempfile
import time
from pathlib import Path

import dagster as dg

from assets.checks import eval_score
from assets.run_config import EvaluateConfig
from resources import ArtifactStoreResource, MLflowResource
from tinker_pipelines.bases import BaseMissing, resolve_base
from tinker_pipelines.checkpoint import read_record
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.schedule_rules import DEVICE_POOL, LOADS_MODEL_TAG, LORA_STEP_TAGS
from tinker_pipelines.tracking.mlflow_tracker import promotion_refusal
from tinker_pipelines.loops.train import Experiment

CHAMPION = "champion"


def resolve_version(tracker, name: str, version: str):
    """The version of registered model `name` that `version` names: '' = the latest, a number, or
    an alias; `dg.Failure` with a one-sentence message when there is none (also used by `inference`)."""
    from mlflow.exceptions import MlflowException

    if tracker.latest_version(name) is None:
        raise dg.Failure(f"registered model {name!r} does not exist or has no versions")
    if not version:
        mv = tracker.latest_version(name)
    elif version.isdigit():
        try:
            mv = tracker.client.get_model_version(name, version)
        except MlflowException:  # MLflow raises for an unknown number; an unknown alias gives None below
            mv = None
    else:
        mv = tracker.alias_version(name, version)
    if mv is None:
        what = f"version {version}" if version.isdigit() else f"alias {version!r}"
        raise dg.Failure(f"registered model {name!r} has no {what}")
    return mv


def base_of_version(record: dict, cfg, mv, tracker, artifact_store: ArtifactStoreResource):
    """`bases.resolve_base` for registry version `mv` (also used by `inference`), kept in the
    store's cache (a worker may be started on it); `dg.Failure` naming a missing warm start
    instead of loading the adapter into another policy."""
    try:
        return resolve_base(record, cfg, mv.tags.get("tinker.experiment", mv.name.removeprefix("tinker-")),
                            Path(artifact_store.cache_dir) / "bases", tracker, artifact_store.store())
    except BaseMissing as e:
        raise dg.Failure(f"{mv.name} v{mv.version}: {e}") from None


@dg.op(tags={"kind": "mlflow", **LORA_STEP_TAGS}, pool=DEVICE_POOL)
def evaluate_adapter(context: dg.OpExecutionContext, config: EvaluateConfig, mlflow: MLflowResource,
                     artifact_store: ArtifactStoreResource) -> dict:
    """Load base model + the version's checkpoint, evaluate greedily, tag the version, maybe promote."""
    tracker = mlflow.tracker()
    mv = resolve_version(tracker, config.model_name, config.version)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = tracker.download_version(config.model_name, str(mv.version), tmp)
        record = verified_record(path, config.model_name, mv)
        cfg = config_from_dict(record["config"])
        exp = Experiment(cfg)
        if cfg.sft.steps:  # the very warm start it was trained on, found by its content hash
            base, _ = base_of_version(record, cfg, mv, tracker, artifact_store)
            exp.use_base(base)
        exp.start_rl()
        exp.resume(path)
    metrics = exp.evaluate(config.num_tasks or None)
    score = eval_score(metrics)
    n = config.num_tasks or cfg.eval.num_tasks
    tracker.set_version_tag(config.model_name, mv.version, "eval_score", score)
    tracker.set_version_tag(config.model_name, mv.version, "eval_num_tasks", n)
    champ = tracker.alias_version(config.model_name, CHAMPION)
    champ_score = float(champ.tags["eval_score"]) if champ is not None and "eval_score" in champ.tags else None
    refusal = promotion_refusal(mv.tags)
    promoted = False
    if config.promote and refusal is None and (champ is None or champ_score is None or score > champ_score):
        tracker.set_alias(config.model_name, CHAMPION, mv.version)
        promoted = True
    refused = f"not promoted: {refusal}" if config.promote and refusal else "none"
    result = {"model_name": config.model_name, "version": str(mv.version), "score": score,
              "champion_before": str(champ.version) if champ else "none",
              "champion_score_before": champ_score if champ_score is not None else "none",
              "promoted": promoted, "promotion_refused": refused, "wall_time_s": round(time.perf_counter() - start, 3),
              **{k.replace("eval/", "eval_"): v for k, v in metrics.items()}}
    context.add_output_metadata(result)
    if refused != "none":
        context.log.warning(f"{config.model_name} v{mv.version}: score {score:.4f}; {refused}")
    else:
        context.log.info(f"{config.model_name} v{mv.version}: score {score:.4f}; "
                         f"{'promoted to champion' if promoted else 'champion unchanged'}")
    return result


def verified_record(path, model_name: str, mv) -> dict:
    """The downloaded checkpoint's record, after checking its files against the recorded content
    hash and that hash against the one the version was registered with; `dg.Failure` otherwise."""
    try:
        record = read_record(path, verify=True)
    except (ValueError, FileNotFoundError) as e:
        raise dg.Failure(f"{model_name} v{mv.version} is not evaluated or promoted: {e}",
                         metadata={"model_name": model_name, "version": str(mv.version), "promoted": False}) from e
    registered = mv.tags.get("content_hash")
    if registered and record.get("content_hash") != registered:
        raise dg.Failure(f"{model_name} v{mv.version} is not evaluated or promoted: its files hash to "
                         f"{record.get('content_hash')}, but it was registered with {registered}",
                         metadata={"model_name": model_name, "version": str(mv.version), "promoted": False})
    return record


@dg.job(description="Evaluate a registered adapter version; promote it to `champion` when better.",
        executor_def=dg.in_process_executor, tags={LOADS_MODEL_TAG: "true"})
def evaluate():
    evaluate_adapter()
