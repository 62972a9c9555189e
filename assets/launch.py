"""Run iterations of an experiment through Dagster from Python, one run per iteration, in this
process: `execute_job` on a real instance, so the resident model is reused between runs.

These runs bypass the instance's run queue (`execute_job` launches nothing); their steps still
take slots of the `tinker_device` pool. The run-config helpers live in `assets.run_config`
(re-exported here); this module is the only one in `assets/` that imports the composition root,
lazily, and nothing imports this one.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from assets.partitions import ITERATIONS, ensure_partition, iteration_key
from assets.run_config import eval_due, iteration_assets, rl_run_config, total_iterations
from tinker_pipelines.schedule_rules import EXPERIMENT_TAG

__all__ = ["eval_due", "iteration_assets", "main", "resume_iterations", "rl_run_config", "run_iterations", "run_sft"]


def run_iterations(instance: dg.DagsterInstance, experiment: str, config: dict[str, Any],
                   start: int = 0, stop: int | None = None, raise_on_error: bool = True,
                   auto_continue: bool = False, log_level: str | None = None) -> list:
    """Execute the `rl` job for iterations `start..stop-1` (default: all configured).

    `auto_continue=False` (the default) keeps the continue_training sensor from also launching
    the next iteration when a daemon runs against the same instance. `log_level` sets the console
    logger's level (the event log keeps every event either way); None leaves the run config
    without a `loggers` section, as the sensors' runs that copy it expect."""
    from assets.definitions import rl_job

    stop = stop if stop is not None else total_iterations(config)
    job = dg.reconstructable(rl_job)
    run_config = {**rl_run_config(config, auto_continue), **_console(log_level)}
    results = []
    for k in range(start, stop):
        key = iteration_key(experiment, k)
        ensure_partition(instance, ITERATIONS, key)
        tags = {"dagster/partition": key, EXPERIMENT_TAG: experiment}
        with dg.execute_job(job, instance, run_config=run_config, tags=tags,
                            asset_selection=iteration_assets(config, k), raise_on_error=raise_on_error) as result:
            results.append(result.success)
        if not results[-1]:
            break
    return results


_UNFINISHED = (dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.NOT_STARTED,
               dg.DagsterRunStatus.CANCELING)


def resume_iterations(instance: dg.DagsterInstance, experiment: str, config: dict[str, Any],
                      stop: int | None = None, raise_on_error: bool = True) -> list:
    """Go on after the process running an experiment's iterations died (kill -9, OOM, a lost
    machine): mark its unfinished runs failed, as run monitoring would, and free the pool slots
    they held; re-execute the newest failed run from failure (a new run whose parent is the
    failed one, so the UI shows both); then run the iterations that never started."""
    from assets.definitions import rl_job

    runs = instance.get_runs(dg.RunsFilter(job_name="rl", tags={EXPERIMENT_TAG: experiment}))
    for run in runs:
        if run.status in _UNFINISHED:
            instance.report_run_failed(run, "its process died (resumed by assets.launch.resume_iterations)")
            instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
    results = []
    newest = instance.get_run_by_id(runs[0].run_id) if runs else None
    retried = newest is not None and instance.get_runs(dg.RunsFilter(tags={"dagster/parent_run_id": newest.run_id}), limit=1)
    if newest is not None and newest.status == dg.DagsterRunStatus.FAILURE and not retried:
        with dg.execute_job(dg.reconstructable(rl_job), instance, tags=dict(newest.tags), raise_on_error=raise_on_error,
                            reexecution_options=dg.ReexecutionOptions.from_failure(newest.run_id, instance)) as result:
            results.append(result.success)
        if not results[-1]:
            return results
    stop = stop if stop is not None else total_iterations(config)
    start = next((k for k in range(stop) if not _materialized(instance, iteration_key(experiment, k))), stop)
    return results + run_iterations(instance, experiment, config, start, stop, raise_on_error)


def _materialized(instance: dg.DagsterInstance, partition: str) -> bool:
    filt = dg.AssetRecordsFilter(asset_key=dg.AssetKey("adapter_checkpoint"), asset_partitions=[partition])
    return bool(instance.fetch_materializations(filt, limit=1).records)


def _console(log_level: str | None) -> dict[str, Any]:
    return {"loggers": {"console": {"config": {"log_level": log_level}}}} if log_level else {}


def run_sft(instance: dg.DagsterInstance, experiment: str, config: dict[str, Any], log_level: str | None = None) -> bool:
    """Execute the `sft` job (the warm start) for `experiment`; True on success."""
    from assets.partitions import EXPERIMENTS, check_experiment
    from assets.definitions import sft_job

    check_experiment(experiment)
    ensure_partition(instance, EXPERIMENTS, experiment)
    run_config = {"ops": {"sft_checkpoint": {"config": config}}, **_console(log_level)}
    with dg.execute_job(dg.reconstructable(sft_job), instance, run_config=run_config,
                        tags={"dagster/partition": experiment, EXPERIMENT_TAG: experiment},
                        raise_on_error=True) as result:
        return result.success


def main(argv: list[str] | None = None) -> int:
    """`python -m assets.launch EXPERIMENT RUN_CONFIG.yaml`: all iterations, one run each, in one
    process (the model stays resident), on the instance of $DAGSTER_HOME."""
    import argparse

    import yaml

    p = argparse.ArgumentParser(prog="python -m assets.launch", description=main.__doc__)
    p.add_argument("experiment")
    p.add_argument("run_config", help="the `rl` job's run config (ops.rollout_batch.config)")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--stop", type=int, default=None)
    p.add_argument("--resume", action="store_true",
                   help="the process that ran this experiment died: fail its unfinished run, re-execute it from "
                        "failure, then run the iterations that never started (ignores --start)")
    args = p.parse_args(argv)
    config = yaml.safe_load(open(args.run_config))["ops"]["rollout_batch"]["config"]
    config.pop("auto_continue", None)
    with dg.DagsterInstance.get() as instance:
        if args.resume:
            ok = resume_iterations(instance, args.experiment, config, args.stop, raise_on_error=False)
        else:
            ok = run_iterations(instance, args.experiment, config, args.start, args.stop, raise_on_error=False)
    print(f"{sum(ok)} of {len(ok)} iterations succeeded")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
