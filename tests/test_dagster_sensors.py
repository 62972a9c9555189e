"""Sensors and schedule evaluated with build_sensor_context / build_schedule_context; the
`evaluate` job moving the `champion` alias in the MLflow registry."""

from __future__ import annotations

import datetime

import dagster as dg
import pytest
from dagster_env import NO_SFT, tracker

from assets.launch import rl_run_config, run_iterations
from assets.sensors import continue_training, new_adapter_versions, periodic_evaluation
from tinker_pipelines.definitions import defs, evaluate_job
from tinker_pipelines.tracking import registered_model_name

EXP = "sensed"
CFG = {**NO_SFT, "training": {**NO_SFT["training"], "iterations": 2}}
MODEL = registered_model_name(EXP)


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as inst:
        assert run_iterations(inst, EXP, CFG, start=0, stop=1, auto_continue=True) == [True]
        yield inst


def test_continue_training_requests_the_next_iteration_until_done(instance):
    result = continue_training(dg.build_sensor_context(instance=instance))
    (req,) = result.run_requests
    assert req.partition_key == f"{EXP}:1" and req.run_key == f"{EXP}:1"
    assert req.run_config == rl_run_config(CFG, auto_continue=True)
    assert result.dynamic_partitions_requests[0].partition_keys == [f"{EXP}:1"]
    again = continue_training(dg.build_sensor_context(instance=instance, cursor=result.cursor))
    assert again.run_requests == []
    # the requested run executes; iteration 1 is the last of 2, so nothing more is requested
    assert run_iterations(instance, EXP, CFG, start=1, stop=2, auto_continue=True) == [True]
    done = continue_training(dg.build_sensor_context(instance=instance, cursor=result.cursor))
    assert done.run_requests == []
    # and a fresh cursor does not re-request an iteration that already has a run
    assert continue_training(dg.build_sensor_context(instance=instance)).run_requests == []


def test_continue_training_respects_auto_continue_false():
    with dg.instance_for_test() as inst:
        assert run_iterations(inst, "manual", CFG, start=0, stop=1) == [True]
        assert continue_training(dg.build_sensor_context(instance=inst)).run_requests == []


def test_new_version_is_evaluated_and_champion_moves_only_when_better(instance):
    resources = {"mlflow": defs.resources["mlflow"]}
    with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
        result = new_adapter_versions(ctx)
    reqs = [r for r in result.run_requests if r.tags["tinker/model"] == MODEL]
    assert len(reqs) == 1 and reqs[0].tags["tinker/version"] == "2"  # the newest; v1 is skipped
    with dg.build_sensor_context(instance=instance, resources=resources, cursor=result.cursor) as ctx:
        assert [r for r in new_adapter_versions(ctx).run_requests if r.tags["tinker/model"] == MODEL] == []

    t = tracker()

    def evaluate(version: str) -> None:
        cfg = {"ops": {"evaluate_adapter": {"config": {"model_name": MODEL, "version": version, "promote": True}}}}
        with dg.execute_job(dg.reconstructable(evaluate_job), instance, run_config=cfg) as res:
            assert res.success

    with dg.execute_job(dg.reconstructable(evaluate_job), instance, run_config=reqs[0].run_config) as res:
        assert res.success
    assert str(t.alias_version(MODEL, "champion").version) == "2"  # no champion before: promoted
    assert "eval_score" in t.client.get_model_version(MODEL, "2").tags
    t.set_version_tag(MODEL, "2", "eval_score", 5.0)  # an unbeatable champion
    evaluate("1")
    assert str(t.alias_version(MODEL, "champion").version) == "2"
    t.set_version_tag(MODEL, "2", "eval_score", -1.0)  # a weak champion
    evaluate("1")
    assert str(t.alias_version(MODEL, "champion").version) == "1"


def test_periodic_evaluation_schedule_targets_champions(instance):
    t = tracker()
    if t.alias_version(MODEL, "champion") is None:
        t.set_alias(MODEL, "champion", "1")
    ctx = dg.build_schedule_context(instance=instance, resources={"mlflow": defs.resources["mlflow"]},
                                    scheduled_execution_time=datetime.datetime(2026, 1, 2, 3))
    reqs = [r for r in periodic_evaluation(ctx) if MODEL in r.run_key]
    assert len(reqs) == 1
    assert reqs[0].run_config["ops"]["evaluate_adapter"]["config"] == {"model_name": MODEL, "version": "champion",
                                                                      "promote": False}
