"""Sensors and schedule evaluated with build_sensor_context / build_schedule_context; the
`evaluate` job moving the `champion` alias in the MLflow registry; an adapter whose blocking
check failed is never promoted or trained on from."""

from __future__ import annotations

import datetime

import dagster as dg
import pytest
from dagster_env import NO_SFT, materializations, metadata, tracker

from assets.launch import rl_run_config, run_iterations
from assets.sensors import continue_training, new_adapter_versions, periodic_evaluation
from assets.definitions import defs, evaluate_job
from tinker_pipelines.envs.arithmetic import ArithmeticEnv
from tinker_pipelines.tracking import registered_model_name
from tinker_pipelines.types import StepResult

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)

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


class LengthRewardEnv(ArithmeticEnv):
    """Rewards that differ within a group without a warm start, so every iteration trains."""

    def step(self, action: str) -> StepResult:
        r = super().step(action)
        return StepResult(r.observation, float(len(action.strip()) % 2), r.done, r.info)


GATED = "klgate"
GATED_MODEL = registered_model_name(GATED)
# KL is exactly 0 at iteration 0 (the policy is the reference) and ~0.03 at iteration 1
GATED_CFG = {**NO_SFT, "env": {"path": f"{__name__}:LengthRewardEnv", "kwargs": {"max_operand": 3}},
             "kl_bound": 0.01}


@pytest.fixture(scope="module")
def gated():
    """Iteration 0 passes its checks (v1); iteration 1's KL is over the bound (v2, run failed)."""
    with dg.instance_for_test() as inst:
        assert run_iterations(inst, GATED, GATED_CFG, start=0, stop=3, raise_on_error=False,
                              auto_continue=True) == [True, False]
        yield inst


def _failure_messages(instance, run_id: str) -> str:
    return " ".join(str(e.dagster_event.event_specific_data) for e in instance.all_logs(run_id)
                    if e.dagster_event and e.dagster_event.is_step_failure)


def test_kl_over_its_bound_fails_the_iteration_and_tags_the_version(gated):
    t = tracker()
    v1, v2 = (t.client.get_model_version(GATED_MODEL, v).tags for v in ("1", "2"))
    assert (v1["tinker.checks"], v1["tinker.checks.failed"]) == ("passed", "")
    assert (v2["tinker.checks"], v2["tinker.checks.failed"]) == ("failed", "kl_within_bound")
    (rec,) = materializations(gated, "adapter_checkpoint", f"{GATED}:1")
    md = metadata(rec)
    assert md["checks"] == "failed: kl_within_bound" and md["kl"] > GATED_CFG["kl_bound"]
    assert md["model_version"] == "2"
    assert gated.get_run_by_id(rec.run_id).status == dg.DagsterRunStatus.FAILURE
    assert "kl_within_bound" in _failure_messages(gated, rec.run_id)
    assert metadata(materializations(gated, "adapter_checkpoint", f"{GATED}:0")[0])["checks"] == "passed"
    assert not materializations(gated, "eval_report", f"{GATED}:1")  # due, but skipped


def test_continue_training_does_not_continue_from_a_failed_adapter(gated):
    # iteration 1 already has its run; iteration 2 would follow the failed adapter of iteration 1
    assert continue_training(dg.build_sensor_context(instance=gated)).run_requests == []


def test_the_next_iteration_refuses_a_failed_parent(gated):
    assert run_iterations(gated, GATED, GATED_CFG, start=2, stop=3, raise_on_error=False) == [False]
    (run,) = gated.get_runs(dg.RunsFilter(tags={"dagster/partition": f"{GATED}:2"}))
    assert "is not trained on from: its blocking checks failed (kl_within_bound)" in _failure_messages(gated, run.run_id)
    assert not materializations(gated, "rollout_batch", f"{GATED}:2")


def test_new_adapter_versions_skips_a_failed_version(gated):
    with dg.build_sensor_context(instance=gated, resources={"mlflow": defs.resources["mlflow"]}) as ctx:
        result = new_adapter_versions(ctx)
    reqs = [r for r in result.run_requests if r.tags["tinker/model"] == GATED_MODEL]
    assert [r.tags["tinker/version"] for r in reqs] == ["1"]  # v2 is newer but failed its checks


def _evaluate(instance, version: str, raise_on_error: bool = True):
    cfg = {"ops": {"evaluate_adapter": {"config": {"model_name": GATED_MODEL, "version": version, "promote": True}}}}
    return dg.execute_job(dg.reconstructable(evaluate_job), instance, run_config=cfg, raise_on_error=raise_on_error)


def test_evaluate_refuses_to_promote_a_failed_version(gated):
    t = tracker()
    with _evaluate(gated, "2") as res:
        out = res.output_for_node("evaluate_adapter")
    assert out["promoted"] is False and "kl_within_bound" in out["promotion_refused"]
    assert t.alias_version(GATED_MODEL, "champion") is None  # there was no champion, and still none
    with _evaluate(gated, "1") as res:
        assert res.output_for_node("evaluate_adapter")["promoted"] is True
    assert str(t.alias_version(GATED_MODEL, "champion").version) == "1"


def test_evaluate_refuses_files_that_do_not_match_their_hash(gated, tmp_path):
    t = tracker()
    v1 = t.client.get_model_version(GATED_MODEL, "1")
    local = t.download_version(GATED_MODEL, "1", tmp_path)
    weights = local / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    run_id = t.find_run(GATED)
    bad = t.register_adapter(run_id, GATED_MODEL, local, "adapters/corrupt",
                             tags={**{k: v1.tags[k] for k in ("content_hash", "tinker.experiment", "tinker.checks")},
                                   "partition": f"{GATED}:corrupt"})
    assert t.client.get_model_version(GATED_MODEL, bad).tags["tinker.checks"] == "passed"
    t.set_alias(GATED_MODEL, "champion", "1")
    t.set_version_tag(GATED_MODEL, "1", "eval_score", -1.0)  # any evaluated version would beat it
    with _evaluate(gated, bad, raise_on_error=False) as res:
        assert not res.success
        message = _failure_messages(gated, res.run_id)
    assert f"{GATED_MODEL} v{bad} is not evaluated or promoted" in message and "corrupt" in message
    assert str(t.alias_version(GATED_MODEL, "champion").version) == "1"
    assert "eval_score" not in t.client.get_model_version(GATED_MODEL, bad).tags
