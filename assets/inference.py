"""The `inference` job: batch generation and scoring of a registered adapter version.

`inference_results` resolves `model` (`NAME@ALIAS`, `NAME/VERSION` or `NAME` for the latest) in
the MLflow registry, rebuilds the policy from the version's checkpoint (on the SFT warm start its
record names, from the registry), and runs `tinker_pipelines.loops.inference.run_inference`: in-process,
or on the resident worker the `policy_engine` resource names. The per-episode records go to the
artifact store as JSONL; the metadata carries the summary and the file's path.
"""

import json
import tempfile
import time
from pathlib import Path

import dagster as dg
from pydantic import Field

from assets.evaluation import base_of_version, resolve_version
from assets.partitions import uri_value
from assets.run_config import _config_class
from resources import ArtifactStoreResource, MLflowResource, PolicyEngine
from tinker_pipelines.checkpoint import read_record
from tinker_pipelines.config import ConfigError, config_from_dict
from tinker_pipelines.loops.inference import InferenceConfig, experiment_from_checkpoint, parse_model_ref, run_inference
from tinker_pipelines.schedule_rules import DEVICE_POOL, LORA_STEP_TAGS

GROUP = "inference"
PREVIEW_ROWS = 5
"""Records shown in the materialization's markdown preview (the JSONL has them all)."""


class InferenceRunConfig(_config_class(InferenceConfig)):  # type: ignore[misc]
    """A registered adapter version and the task set to generate for (fields documented as in
    `tinker_pipelines.loops.inference.InferenceConfig`)."""

    model: str = Field(description="The registered version: NAME@ALIAS (e.g. tinker-quickstart@champion), "
                                   "NAME/VERSION (a number) or NAME (the latest version).")

    def to_library_config(self) -> InferenceConfig:
        """The validated library config; raises `ConfigError` naming the bad field."""
        data = self.model_dump()
        data.pop("model")
        return InferenceConfig(**data).validate()


def _preview(records: list[dict]) -> str:
    def cell(text: str) -> str:
        return json.dumps(text)[1:-1].replace("|", "\\|")[:80]

    rows = [f"| {r['task']} | {cell(r['completion'])} | {r['reward']:.3g} | {r['success']} |"
            for r in records[:PREVIEW_ROWS]]
    return "\n".join(["| task | completion | reward | success |", "| --- | --- | --- | --- |", *rows])


@dg.asset(group_name=GROUP, kinds={"pytorch", "mlflow"}, pool=DEVICE_POOL, op_tags=LORA_STEP_TAGS)
def inference_results(context: dg.AssetExecutionContext, config: InferenceRunConfig, policy_engine: PolicyEngine,
                      mlflow: MLflowResource, artifact_store: ArtifactStoreResource) -> dg.MaterializeResult:
    """Completions and rewards of a registered adapter version on a task set (JSONL in the store)."""
    start = time.perf_counter()
    try:  # a bad field fails here, naming it, before the registry or any model is touched
        cfg = config.to_library_config()
        name, version = parse_model_ref(config.model)
    except ConfigError as e:
        raise dg.Failure(str(e)) from e
    tracker, store = mlflow.tracker(), artifact_store.store()
    mv = resolve_version(tracker, name, version)
    experiment = mv.tags.get("tinker.experiment", name)
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint is read into the policy, then dropped
        path = tracker.download_version(name, str(mv.version), tmp)
        record = read_record(path)
        record_cfg = config_from_dict(record["config"])
        base = None
        if record_cfg.sft.steps:  # the very warm start it was trained on, found by its content hash
            base = Path(base_of_version(record, record_cfg, mv, tracker, artifact_store)[0])
        address = policy_engine.worker_address(record_cfg, base)
        # a name of its own on the worker: the training run of the same experiment may hold its adapter
        exp = experiment_from_checkpoint(path, base, worker=address, name=f"inference-{context.run.run_id[:8]}")
    try:
        result = run_inference(exp, cfg)
    finally:
        if exp.worker is not None:  # the worker drops the adapter with its client's connection
            exp.worker.close()
    lines = "".join(json.dumps(r) + "\n" for r in result.records)
    uri = store.put_bytes(f"{experiment}/inference/v{mv.version}_{context.run.run_id}.jsonl", lines.encode())
    s = result.summary
    context.log.info(f"{name} v{mv.version}: success rate {s['success_rate']:.4f} over {int(s['episodes'])} "
                     f"episodes, {s['tokens_per_s']:.1f} tok/s{' on worker ' + address if address else ''}")
    return dg.MaterializeResult(metadata={
        "model": config.model, "registered_model": name, "model_version": str(mv.version),
        "success_rate": s["success_rate"], "pass_rate": s["pass_rate"], "reward_mean": s["reward_mean"],
        "reward_std": s["reward_std"], "sampled_tokens": int(s["sampled_tokens"]), "episodes": int(s["episodes"]),
        "tasks": cfg.num_tasks, "split": cfg.split, "temperature": cfg.temperature,
        "wall_s": s["wall_s"], "tokens_per_s": s["tokens_per_s"], "total_wall_s": round(time.perf_counter() - start, 3),
        "worker": address or "in-process", "path": uri_value(uri),
        "preview": dg.MetadataValue.md(_preview(result.records))})
