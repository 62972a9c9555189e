"""The RL iteration as assets, partitioned `<experiment>:<iteration>`:

rollout_batch -> scored_trajectories -> adapter_checkpoint (-> eval_report when due).

Bodies call the library (`Experiment.rollout / train_step / save / evaluate`); artifacts go to
the artifact store and only their URIs and small numbers go into the metadata. Every step loads or
uses the policy, so each takes a slot of the `tinker_device` pool while it runs (docs/runtime.md
"Run queue").

A full-parameter experiment with `training.devices: k > 1` runs each step on k ranks (the GPU-aware
executor launches it as `torchrun`): the body hands its stage to every rank (`_Step.on_ranks`,
`loops.ranked.rl_stage`), the rollout is split across them, and rank 0 (this process) writes the
artifacts, the checkpoint, MLflow and the materialization as with one device.
"""


import base64
import os
import time
import urllib.error
from pathlib import Path

import dagster as dg

from assets import checks
from assets.lineage import adapter_dir, find_adapter, load_settings, save_settings, settings_config
from assets.partitions import (ITERATIONS, ensure_partition, iteration_key, parse_iteration_key, store_key,
                               uri_value)
from assets.run_config import RLConfig
from resources import ArtifactStoreResource, MLflowResource, PolicyEngine
from tinker_pipelines.bases import base_tags
from tinker_pipelines.schedule_rules import DEVICE_POOL, eval_due, LORA_STEP_TAGS
from tinker_pipelines.envs import EnvError
from tinker_pipelines.scheduler import ranks
from tinker_pipelines.tracking import registered_model_name
from tinker_pipelines.tracking.mlflow_tracker import CHECKS_TAG, checks_tags, learning_curve_png, promotion_refusal
from tinker_pipelines.tracking.store import dumps, loads

GROUP = "rl"
TRANSIENT = (ConnectionError, TimeoutError, EOFError, urllib.error.URLError)
"""Errors of a remote env, reward server or worker that a retry of the step may not see again."""
RL_STAGE_TARGET = "tinker_pipelines.loops.ranked:rl_stage"
"""What every rank of a ranked RL step runs (`scheduler.ranks.run`)."""


def transient(error: BaseException) -> bool:
    """Whether `error` or what it wraps (an `EnvError` wraps the env's exception) is `TRANSIENT`."""
    while error is not None:
        if isinstance(error, TRANSIENT):
            return True
        error = error.__cause__
    return False


class _Step:
    """What every step of an iteration needs: names, store, tracker, settings, the experiment."""

    def __init__(self, context: dg.AssetExecutionContext, engine: PolicyEngine, store_res: ArtifactStoreResource,
                 mlflow: MLflowResource, settings: dict | None = None):
        self.context, self.engine = context, engine
        self.name, self.k = parse_iteration_key(context.partition_key)
        self.store, self.tracker = store_res.store(), mlflow.tracker()
        self.cache_dir = store_res.cache_dir
        self.settings = settings or load_settings(self.store, self.name)
        self.cfg = settings_config(self.settings)
        self.model_name = registered_model_name(self.name)
        self.start = time.perf_counter()
        k = self.cfg.training.devices
        if k > 1 and not self.ranked and int(os.environ.get("WORLD_SIZE", "1")) != k:
            # the in-process executor runs every step here, on one device: refuse, don't train on one rank
            raise ValueError(f"training.devices: {k} needs the GPU-aware executor (TINKER_EXECUTOR=gpu), which runs "
                             f"each step as {k} ranks, one per leased device; this run's executor would train on one")

    def adapter(self, iteration: int):
        return find_adapter(self.context.instance, self.tracker, self.name, iteration) if iteration >= 0 else None

    def checkpoint(self, i: int):
        ref = self.adapter(i)
        return adapter_dir(ref, self.store, self.tracker, self.name, Path(self.cache_dir)) if ref else None

    def sft_base(self):
        key = f"{self.name}/sft"
        return self.store.local_dir(key) if self.store.exists(key) else None

    def experiment(self, at: int):
        def checkpoint_hash(i: int):
            ref = self.adapter(i)
            return ref.content_hash if ref else None

        return self.engine.experiment(self.name, self.cfg, at, self.checkpoint, self.sft_base, checkpoint_hash)

    @property
    def ranked(self) -> bool:
        """Whether this step runs on several ranks (`training.devices` > 1 under the GPU-aware executor)."""
        return ranks.in_ranked_step()

    def on_ranks(self, stage: str, at: int, inputs: dict | None = None, save: Path | None = None) -> dict:
        """Stage `stage` of the experiment at iteration `at` on every rank of this ranked step (each
        rebuilds it from the stored settings, warm start and checkpoint, as `experiment` would);
        returns rank 0's result (`loops.ranked.rl_stage`)."""
        base = self.sft_base() if self.cfg.sft.steps else None
        if self.cfg.sft.steps and base is None:
            raise RuntimeError(f"sft.steps is {self.cfg.sft.steps}: materialize sft_checkpoint (the `sft` job) first")
        resume = self.checkpoint(at - 1) if at > 0 else None
        payload = {"config": self.settings["config"], "stage": stage, "at": at,
                   "resume": None if resume is None else str(Path(resume).resolve()),
                   "base": None if base is None else str(Path(base).resolve()),
                   "inputs": None if inputs is None else dumps(inputs).decode(),
                   "save": None if save is None else str(Path(save).resolve())}
        return ranks.run(RL_STAGE_TARGET, payload)

    def load(self, what: str):
        """An artifact an earlier step of this iteration wrote (`rollout.json`, `datums.json`): from
        memory when that step ran in this process on the same resident experiment, else the store."""
        found = self.engine.recall(self.name, self.k, what)
        return found if found is not None else loads(self.store.get_bytes(store_key(self.name, self.k, what)))

    def save(self, what: str, value) -> str:
        """Write an artifact of this iteration to the store (its URI) and keep it for later steps."""
        uri = self.store.put_bytes(store_key(self.name, self.k, what), dumps(value))
        self.engine.remember(self.name, self.k, what, value)
        return uri

    def run_id(self) -> str:
        return self.tracker.experiment_run(self.name, params=self.settings["config"])

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.start, 4)


@dg.asset(partitions_def=ITERATIONS, group_name=GROUP, kinds={"pytorch"}, pool=DEVICE_POOL, op_tags=LORA_STEP_TAGS,
          check_specs=[dg.AssetCheckSpec(checks.REWARDS_FINITE, asset="rollout_batch", blocking=True,
                                         description="Every episode's total reward and the batch's reward "
                                                     "mean and std are finite (each step's reward is "
                                                     "checked by the env wrapper).")])
def rollout_batch(context: dg.AssetExecutionContext, config: RLConfig, policy_engine: PolicyEngine,
                  artifact_store: ArtifactStoreResource, mlflow: MLflowResource) -> dg.MaterializeResult:
    """groups_per_batch tasks x group_size episodes sampled from the policy after iteration k-1.

    A transient error of a remote env, reward server or worker (`TRANSIENT`, also wrapped in an
    `EnvError`) retries the step up to `rollout_retries` times; the rollout is seeded by the
    iteration, so a retry samples the same episodes. Any other error fails at once."""
    name, k = parse_iteration_key(context.partition_key)
    settings = config.settings()  # validates: a bad config fails here, naming the field, before any model loads
    ensure_partition(context.instance, ITERATIONS, context.partition_key)
    step = _Step(context, policy_engine, artifact_store, mlflow,
                 save_settings(artifact_store.store(), name, settings))
    run_id = step.run_id()
    prev = step.adapter(k - 1)
    if prev is not None and prev.model_version:
        tags = step.tracker.client.get_model_version(step.model_name, prev.model_version).tags
        if tags.get(CHECKS_TAG) == "failed":
            raise dg.Failure(f"iteration {k - 1}'s adapter ({step.model_name} v{prev.model_version}) is not "
                             f"trained on from: {promotion_refusal(tags)}")
    shares = None
    try:
        if step.ranked:
            out = step.on_ranks("rollout", k)
            ro, shares = out["rollout"], out["shares"]
        else:
            ro = step.experiment(at=k).rollout(k)
    except Exception as e:
        if not transient(e) or config.rollout_retries <= context.retry_number:
            raise
        if not isinstance(e, EnvError):  # the policy's side (a worker connection): reconnect on retry
            from resources.policy_engine import evict
            evict(name)
        wait = config.rollout_retry_delay_s * 2 ** context.retry_number
        context.log.warning(f"rollout of {context.partition_key} failed ({type(e).__name__}: {e}); retry "
                            f"{context.retry_number + 1} of {config.rollout_retries} in {wait:g} s")
        raise dg.RetryRequested(max_retries=config.rollout_retries, seconds_to_wait=wait) from e
    uri = step.save("rollout.json", {"groups": ro.groups, "metrics": ro.metrics})
    m = ro.metrics
    return dg.MaterializeResult(
        metadata={"path": uri_value(uri), "reward_mean": m["reward_mean"], "reward_std": m["reward_std"],
                  "exact_rate": m.get("exact_rate", float("nan")), "sampled_tokens": int(m["sampled_tokens"]),
                  "episodes": int(m["episodes"]), "wall_time_s": step.elapsed(), "mlflow_run_id": run_id,
                  "policy": prev.uri if prev else f"base model {step.cfg.model.name}",
                  "policy_model_version": prev.model_version if prev else "none",
                  **({"rank_shares": dg.MetadataValue.json(shares)} if shares else {})},
        check_results=[checks.rewards_finite(ro.groups, m)])


@dg.asset(partitions_def=ITERATIONS, group_name=GROUP, deps=[rollout_batch], kinds={"python"}, pool=DEVICE_POOL, op_tags=LORA_STEP_TAGS)
def scored_trajectories(context: dg.AssetExecutionContext, policy_engine: PolicyEngine,
                        artifact_store: ArtifactStoreResource, mlflow: MLflowResource) -> dg.MaterializeResult:
    """Training datums with advantages (`Experiment.score`: the algorithm's group estimator, or the
    critic's values and GAE for PPO), scored with the policy that sampled them."""
    step = _Step(context, policy_engine, artifact_store, mlflow)
    groups = step.load("rollout.json")["groups"]
    if step.ranked:
        datums = step.on_ranks("score", step.k, {"groups": groups})["datums"]
    else:
        datums = step.experiment(at=step.k).score(groups)
    uri = step.save("datums.json", datums)
    advs = [abs(a) for d in datums for a, w in zip(d.advantages, d.weights) if w]
    return dg.MaterializeResult(metadata={
        "path": uri_value(uri), "datums": len(datums),
        "informative_groups": sum(len(set(g.rewards)) > 1 for g in groups),
        "trained_tokens": int(sum(sum(d.weights) for d in datums)),
        "advantage_abs_mean": sum(advs) / len(advs) if advs else 0.0, "wall_time_s": step.elapsed()})


@dg.asset(partitions_def=ITERATIONS, group_name=GROUP, deps=[scored_trajectories], kinds={"pytorch", "mlflow"},
          pool=DEVICE_POOL, op_tags=LORA_STEP_TAGS,
          check_specs=[dg.AssetCheckSpec(checks.KL_WITHIN_BOUND, asset="adapter_checkpoint", blocking=True,
                                         description="KL to the reference policy within kl_bound."),
                       dg.AssetCheckSpec(checks.ADAPTER_LOADS, asset="adapter_checkpoint", blocking=True,
                                         description="The written checkpoint matches its content hash, loads "
                                                     "and gives finite logits.")])
def adapter_checkpoint(context: dg.AssetExecutionContext, policy_engine: PolicyEngine,
                       artifact_store: ArtifactStoreResource, mlflow: MLflowResource) -> dg.MaterializeResult:
    """One optimizer step on the datums scored_trajectories wrote; the checkpoint becomes a
    registered model version tagged with its checks' verdict. A failed check still registers the
    version (tagged `tinker.checks=failed`, so it can be inspected but never promoted or trained
    on from) and then fails the step, so the iteration fails and evaluation is skipped."""
    step = _Step(context, policy_engine, artifact_store, mlflow)
    name, k = step.name, step.k
    rollout, datums = step.load("rollout.json"), step.load("datums.json")
    exp = None if step.ranked else step.experiment(at=k)
    key = store_key(name, k, "adapter")
    with policy_engine.updating(name):
        if exp is None:  # every rank trains on its shard; rank 0 writes the checkpoint
            local = step.store.write_dir(key)
            out = step.on_ranks("train", k, {**rollout, "datums": datums}, save=local)
            exp, metrics, record = out["exp"], out["metrics"], out["record"]
        else:
            metrics = {"iteration": float(k), **rollout["metrics"], **exp.train_step(rollout["groups"], datums)}
            exp.iteration = k + 1
            local = step.store.write_dir(key)
            record = exp.save(local, metrics)
        uri = step.store.put_dir(local, key)
    results = [checks.kl_within_bound(metrics, step.settings["kl_bound"]), checks.adapter_loads(exp, local)]
    run_id = step.run_id()
    step.tracker.log_metrics_once(run_id, k, metrics)
    prev = step.adapter(k - 1)
    version = step.tracker.register_adapter(
        run_id, step.model_name, local, f"adapters/iter_{k:05d}",
        tags={"dagster_run_id": context.run.run_id, "partition": context.partition_key,
              "content_hash": record["content_hash"], "tinker.experiment": name, "iteration": str(k),
              "parent_version": prev.model_version if prev else "", "store_uri": uri,
              **base_tags(step.tracker, name, record), **checks_tags(checks.failed(results))})
    if checks.failed(results):
        context.log.error(f"{step.model_name} v{version} is tagged {CHECKS_TAG}=failed "
                          f"({', '.join(checks.failed(results))}): not promoted, not trained on from")
    return dg.MaterializeResult(
        metadata={"path": uri_value(uri), "store_key": key, "content_hash": record["content_hash"],
                  "checks": checks.verdict(results),
                  "model_version": version, "registered_model": step.model_name, "mlflow_run_id": run_id,
                  "reward_mean": metrics["reward_mean"], "reward_std": metrics["reward_std"],
                  "kl": metrics.get("kl", float("nan")), "loss": metrics.get("loss", float("nan")),
                  "sampled_tokens": int(metrics["sampled_tokens"]),
                  "trained_tokens": int(metrics.get("trained_tokens", 0)), "wall_time_s": step.elapsed(),
                  "previous_adapter": prev.uri if prev else "none (first iteration)",
                  "previous_model_version": prev.model_version if prev else "none"},
        check_results=results)


@dg.multi_asset(
    name="eval_report", partitions_def=ITERATIONS, pool=DEVICE_POOL, op_tags=LORA_STEP_TAGS,
    can_subset=True,  # can_subset: may skip check and asset
    specs=[dg.AssetSpec("eval_report", deps=[adapter_checkpoint], skippable=True, group_name=GROUP, kinds={"mlflow"},
                        description="Held-out evaluation every eval.every iterations and after the last.")],
    check_specs=[dg.AssetCheckSpec(checks.NOT_WORSE_THAN_CHAMPION, asset="eval_report",
                                   description="Held-out score not below the champion's by more than the margin (warning).")])
def eval_report(context: dg.AssetExecutionContext, policy_engine: PolicyEngine,
                artifact_store: ArtifactStoreResource, mlflow: MLflowResource):
    """Held-out evaluation every `eval.every` iterations and after the last; learning curve PNG."""
    step = _Step(context, policy_engine, artifact_store, mlflow)
    name, k, cfg = step.name, step.k, step.cfg
    if not eval_due(k, cfg.eval.every, cfg.training.iterations):
        context.log.info(f"iteration {k}: evaluation not due (every {cfg.eval.every})")
        return
    metrics = step.on_ranks("evaluate", k + 1)["metrics"] if step.ranked else step.experiment(at=k + 1).evaluate()
    run_id = step.run_id()
    step.tracker.log_metrics_once(run_id, k, metrics)
    score = checks.eval_score(metrics)
    ref = step.adapter(k)
    if ref and ref.model_version:
        step.tracker.set_version_tag(step.model_name, ref.model_version, "eval_score", score)
    champ = step.tracker.alias_version(step.model_name, "champion")
    champ_score = float(champ.tags["eval_score"]) if champ is not None and "eval_score" in champ.tags else None
    curves = {key: step.tracker.history(run_id, key) for key in ("reward_mean", "eval/exact_rate", "eval/reward_mean")}
    png = learning_curve_png({k2: v for k2, v in curves.items() if v}, title=f"{name} (through iteration {k})")
    png_uri = step.tracker.log_png(run_id, png, "curves/learning_curve.png")
    stored = step.store.put_bytes(f"{name}/curves/learning_curve_{k:05d}.png", png)
    if k + 1 >= cfg.training.iterations:
        step.tracker.finish(run_id)
    yield dg.MaterializeResult(
        metadata={**{key.replace("eval/", "eval_"): v for key, v in metrics.items()}, "score": score,
                  "model_version": ref.model_version if ref else "none", "mlflow_run_id": run_id,
                  "learning_curve": uri_value(stored), "learning_curve_mlflow": png_uri,
                  "learning_curve_png": dg.MetadataValue.md(
                      f"![learning curve](data:image/png;base64,{base64.b64encode(png).decode()})"),
                  "wall_time_s": step.elapsed()},
        check_results=[checks.not_worse_than_champion(score, champ_score, str(champ.version) if champ else None,
                                                      step.settings["champion_margin"])])


RL_ASSETS = [rollout_batch, scored_trajectories, adapter_checkpoint, eval_report]
__all__ = ["RL_ASSETS", "iteration_key"]
