"""Run iterations of an experiment through Dagster from Python, one run per iteration, in this
process: `execute_job` on a real instance, so the resident model is reused between runs."""

from __future__ import annotations

from typing import Any

import dagster as dg

from assets.partitions import ITERATIONS, ensure_partition, iteration_key


def rl_run_config(config: dict[str, Any], auto_continue: bool = False) -> dict[str, Any]:
    """Run config of the `rl` job from a library-style config dict (plus check bounds)."""
    return {"ops": {"rollout_batch": {"config": {**config, "auto_continue": auto_continue}}}}


def eval_due(config: dict[str, Any], iteration: int) -> bool:
    """Whether iteration k evaluates (every `eval.every` and after the last), as `eval_report` decides."""
    every = int(config.get("eval", {}).get("every", 5))
    total = int(config.get("training", {}).get("iterations", 10))
    return (iteration + 1) % every == 0 or iteration + 1 == total


def iteration_assets(config: dict[str, Any], iteration: int) -> list[dg.AssetKey]:
    """The assets a run of iteration k needs: `eval_report` only when due (one step less per run)."""
    names = ["rollout_batch", "scored_trajectories", "adapter_checkpoint"]
    return [dg.AssetKey(n) for n in names + (["eval_report"] if eval_due(config, iteration) else [])]


def run_iterations(instance: dg.DagsterInstance, experiment: str, config: dict[str, Any],
                   start: int = 0, stop: int | None = None, raise_on_error: bool = True,
                   auto_continue: bool = False) -> list:
    """Execute the `rl` job for iterations `start..stop-1` (default: all configured).

    `auto_continue=False` (the default) keeps the continue_training sensor from also launching
    the next iteration when a daemon runs against the same instance."""
    from tinker_pipelines.definitions import rl_job

    stop = stop if stop is not None else int(config.get("training", {}).get("iterations", 10))
    job = dg.reconstructable(rl_job)
    run_config = rl_run_config(config, auto_continue)
    results = []
    for k in range(start, stop):
        key = iteration_key(experiment, k)
        ensure_partition(instance, ITERATIONS, key)
        with dg.execute_job(job, instance, run_config=run_config, tags={"dagster/partition": key},
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
                        tags={"dagster/partition": experiment}, raise_on_error=True) as result:
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
