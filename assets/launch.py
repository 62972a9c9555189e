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

__all__ = ["eval_due", "iteration_assets", "main", "rl_run_config", "run_iterations", "run_sft"]


def run_iterations(instance: dg.DagsterInstance, experiment: str, config: dict[str, Any],
                   start: int = 0, stop: int | None = None, raise_on_error: bool = True,
                   auto_continue: bool = False) -> list:
    """Execute the `rl` job for iterations `start..stop-1` (default: all configured).

    `auto_continue=False` (the default) keeps the continue_training sensor from also launching
    the next iteration when a daemon runs against the same instance."""
    from tinker_pipelines.definitions import rl_job

    stop = stop if stop is not None else total_iterations(config)
    job = dg.reconstructable(rl_job)
    run_config = rl_run_config(config, auto_continue)
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


def run_sft(instance: dg.DagsterInstance, experiment: str, config: dict[str, Any]) -> bool:
    """Execute the `sft` job (the warm start) for `experiment`; True on success."""
    from assets.partitions import EXPERIMENTS, check_experiment
    from tinker_pipelines.definitions import sft_job

    check_experiment(experiment)
    ensure_partition(instance, EXPERIMENTS, experiment)
    run_config = {"ops": {"sft_checkpoint": {"config": config}}}
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
    args = p.parse_args(argv)
    config = yaml.safe_load(open(args.run_config))["ops"]["rollout_batch"]["config"]
    config.pop("auto_continue", None)
    with dg.DagsterInstance.get() as instance:
        ok = run_iterations(instance, args.experiment, config, args.start, args.stop, raise_on_error=False)
    print(f"{sum(ok)} of {len(ok)} iterations succeeded")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
