"""Retries on a real instance: a flaky env retries rollout_batch within the run; re-executed runs
(what the daemon's run retries do after a crash) register no second version and log no metric
twice; a fresh dagster.yaml retries crashed `rl` runs and nothing else."""

from __future__ import annotations

import dagster as dg
import pytest
from dagster_env import NO_SFT, materializations, metadata, tracker

from assets.launch import run_iterations
from assets.run_config import RUN_ONLY
from resources.policy_engine import evict
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.envs.arithmetic import ArithmeticEnv
from tinker_pipelines.tracking import registered_model_name
from tinker_pipelines.loops.train import EVAL_SEED_OFFSET, deterministic_metrics, train
from tinker_pipelines.types import StepResult

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)


class FlakyEnv(ArithmeticEnv):
    """A reward server that is unreachable for the next `fail_train` training steps and the next
    `fail_eval` evaluation steps; rewards differ within a group, so every iteration trains."""

    fail_train = 0
    fail_eval = 0

    def step(self, action: str) -> StepResult:
        which = "fail_eval" if self._seed >= EVAL_SEED_OFFSET else "fail_train"
        if getattr(FlakyEnv, which) > 0:
            setattr(FlakyEnv, which, getattr(FlakyEnv, which) - 1)
            raise ConnectionError("reward server unreachable")
        r = super().step(action)
        return StepResult(r.observation, float(len(action.strip()) % 2), r.done, r.info)


def _config(retries: int = 2) -> dict:
    return {**NO_SFT, "env": {"path": f"{__name__}:FlakyEnv", "kwargs": {"max_operand": 3}},
            "training": {**NO_SFT["training"], "iterations": 1}, "eval": {"every": 1, "num_tasks": 4},
            "rollout_retries": retries, "rollout_retry_delay_s": 0.0}


def _events(instance, run_id: str, kind: dg.DagsterEventType) -> list:
    return [e.dagster_event for e in instance.all_logs(run_id, of_type=kind)]


def _points(experiment: str, key: str) -> int:
    t = tracker()
    return len(t.client.get_metric_history(t.find_run(experiment), key))


def test_transient_env_errors_retry_rollout_batch(tmp_path):
    FlakyEnv.fail_train, FlakyEnv.fail_eval = 2, 0
    with dg.instance_for_test() as instance:
        assert run_iterations(instance, "flaky", _config()) == [True]
        (run,) = instance.get_runs()
        retries = _events(instance, run.run_id, dg.DagsterEventType.STEP_UP_FOR_RETRY)
        assert [e.step_key for e in retries] == ["rollout_batch", "rollout_batch"]
        assert FlakyEnv.fail_train == 0
        assert metadata(materializations(instance, "adapter_checkpoint", "flaky:0")[0])["checks"] == "passed"
    t = tracker()
    assert len(t.client.search_model_versions(f"name = '{registered_model_name('flaky')}'")) == 1
    assert _points("flaky", "reward_mean") == 1
    # the retried rollout sampled the episodes an unfailing one samples: the plain loop's numbers
    lib = {k: v for k, v in _config().items() if k not in RUN_ONLY}
    (plain,) = [deterministic_metrics(m) for m in train(config_from_dict({**lib, "output_dir": str(tmp_path)}))]
    run_id = t.find_run("flaky")
    assert {key: dict(t.history(run_id, key)).get(0) for key in plain} == plain


def test_retries_run_out_with_the_envs_message():
    FlakyEnv.fail_train, FlakyEnv.fail_eval = 10, 0
    with dg.instance_for_test() as instance:
        assert run_iterations(instance, "flakyout", _config(retries=1), raise_on_error=False) == [False]
        (run,) = instance.get_runs()
        assert len(_events(instance, run.run_id, dg.DagsterEventType.STEP_UP_FOR_RETRY)) == 1
        (failure,) = _events(instance, run.run_id, dg.DagsterEventType.STEP_FAILURE)
        assert "raised in step(): ConnectionError: reward server unreachable" in str(failure.event_specific_data)
    assert tracker().latest_version(registered_model_name("flakyout")) is None
    FlakyEnv.fail_train = 0


def test_reexecuted_runs_register_no_second_version_and_log_no_metric_twice():
    FlakyEnv.fail_train, FlakyEnv.fail_eval = 0, 1  # the iteration fails in eval_report, after registering
    name = registered_model_name("reexec")
    t = tracker()
    with dg.instance_for_test() as instance:
        assert run_iterations(instance, "reexec", _config(), raise_on_error=False) == [False]
        (failed,) = instance.get_runs()
        assert [mv.version for mv in t.client.search_model_versions(f"name = '{name}'")] == [1]
        from assets.definitions import rl_job

        job = dg.reconstructable(rl_job)
        # the daemon's default strategy: from failure (only eval_report runs again)
        with dg.execute_job(job, instance, tags=dict(failed.tags),
                            reexecution_options=dg.ReexecutionOptions.from_failure(failed.run_id, instance)) as res:
            assert res.success
            assert {e.step_key for e in _events(instance, res.run_id, dg.DagsterEventType.STEP_SUCCESS)} == {"eval_report"}
        # ALL_STEPS in a fresh process state: adapter_checkpoint trains and registers again
        evict()
        with dg.execute_job(job, instance, tags=dict(failed.tags),
                            reexecution_options=dg.ReexecutionOptions(parent_run_id=failed.run_id)) as res:
            assert res.success
        recs = materializations(instance, "adapter_checkpoint", "reexec:0")
        assert len(recs) == 2 and {metadata(r)["model_version"] for r in recs} == {"1"}
        assert len({metadata(r)["content_hash"] for r in recs}) == 1
    assert [mv.version for mv in t.client.search_model_versions(f"name = '{name}'")] == [1]
    assert _points("reexec", "reward_mean") == 1 and _points("reexec", "eval/reward_mean") == 1


def test_fresh_instance_retries_crashed_rl_runs_only(tmp_path):
    from dagster._daemon.auto_run_reexecution.auto_run_reexecution import should_retry

    from assets.definitions import defs
    from tinker_pipelines.tracking import TinkerHome

    home = TinkerHome(tmp_path / "home").ensure(devices=1)
    with dg.DagsterInstance.from_config(str(home.dagster_home)) as instance:
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 0
        assert not instance.run_retries_retry_on_asset_or_op_failure
        bad = {**NO_SFT, "training": {**NO_SFT["training"], "learning_rate": -1.0}}
        assert run_iterations(instance, "retrybad", bad, raise_on_error=False) == [False]
        (step_failed,) = instance.get_runs()
        assert step_failed.tags["dagster/max_retries"] == "1"
        assert not should_retry(step_failed, instance)  # a failed step would fail again

        def crashed(job: str) -> dg.DagsterRun:
            run = instance.create_run_for_job(defs.resolve_job_def(job), run_config={},
                                              tags=defs.resolve_job_def(job).tags)
            instance.report_run_failed(run)  # what the code server does when a run worker dies
            return instance.get_run_by_id(run.run_id)

        assert should_retry(crashed("rl"), instance)
        assert not should_retry(crashed("sft"), instance)  # no dagster/max_retries tag
