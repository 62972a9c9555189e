"""The `adapter_loads` check on real checkpoints of a tiny experiment (LoRA and full); who owns
non-finite rewards: the env wrapper per step (a real run fails with its message and registers
nothing), the `rewards_finite` check for totals and batch statistics that overflow."""

from __future__ import annotations

import math

import dagster as dg
import pytest
import torch
from dagster_env import NO_SFT, materializations, tracker

from assets.checks import adapter_loads, rewards_finite
from assets.launch import run_iterations
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.envs.arithmetic import ArithmeticEnv
from tinker_pipelines.tracking import registered_model_name
from tinker_pipelines.loops.train import Experiment
from tinker_pipelines.types import StepResult, Trajectory, TrajectoryGroup, Turn

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)


def _experiment(mode: str) -> Experiment:
    cfg = config_from_dict({**NO_SFT, "training": {**NO_SFT["training"], "mode": mode}})
    exp = Experiment(cfg)
    exp.start_rl()
    return exp


def test_lora_checkpoint_passes_then_fails_when_it_differs_or_is_corrupt(tmp_path):
    exp = _experiment("lora")
    exp.save(tmp_path / "a")
    ok = adapter_loads(exp, tmp_path / "a")
    assert ok.passed and ok.metadata["tensors_loaded"].value > 0
    assert ok.metadata["tensors_differing_from_resident"].value == 0
    with torch.no_grad():  # the resident policy moves on: the written files no longer match it
        next(p for n, p in exp.policy.named_parameters() if "lora_B" in n).add_(1.0)
    moved = adapter_loads(exp, tmp_path / "a")
    assert not moved.passed and moved.metadata["tensors_differing_from_resident"].value == 1
    exp.save(tmp_path / "b")
    f = tmp_path / "b" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    corrupt = adapter_loads(exp, tmp_path / "b")
    assert not corrupt.passed and "is corrupt" in corrupt.metadata["error"].value


def test_full_checkpoint_passes(tmp_path):
    exp = _experiment("full")
    exp.save(tmp_path / "c")
    result = adapter_loads(exp, tmp_path / "c")
    assert result.passed, result.metadata
    assert result.metadata["finite_logits"].value


class NanRewardEnv(ArithmeticEnv):
    def step(self, action: str) -> StepResult:
        r = super().step(action)
        return StepResult(r.observation, float("nan"), r.done, r.info)


def test_nan_reward_fails_the_run_with_the_envs_message_and_registers_nothing():
    cfg = {**NO_SFT, "env": {"path": f"{__name__}:NanRewardEnv", "kwargs": {"max_operand": 3}},
           "training": {**NO_SFT["training"], "iterations": 1}}
    with dg.instance_for_test() as instance:
        assert run_iterations(instance, "nanreward", cfg, raise_on_error=False) == [False]
        (run,) = instance.get_runs()
        events = [e.dagster_event for e in instance.all_logs(run.run_id) if e.dagster_event]
        failures = [str(e.event_specific_data) for e in events if e.is_step_failure]
        assert len(failures) == 1 and "environment NanRewardEnv returned a non-finite reward nan" in failures[0]
        assert "rollout_batch" in events[[e.is_step_failure for e in events].index(True)].step_key
        assert not [e for e in events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]  # not transient
        assert not materializations(instance, "rollout_batch")
    assert tracker().latest_version(registered_model_name("nanreward")) is None


def _trajectory(rewards: list[float]) -> Trajectory:
    turns = tuple(Turn((1, 2), (3,), (-0.5,), r, "x") for r in rewards)
    return Trajectory(turns, 0.0, "t0")


def test_rewards_finite_fails_when_finite_rewards_overflow():
    ok = [TrajectoryGroup((_trajectory([1.0, 0.5]), _trajectory([0.0, 0.0])))]
    assert rewards_finite(ok, {"reward_mean": 0.75, "reward_std": 0.75}).passed
    big = [TrajectoryGroup((_trajectory([1e308, 1e308]), _trajectory([0.0, 0.0])))]  # every step is finite
    assert all(math.isfinite(t.reward) for g in big for tr in g.trajectories for t in tr.turns)
    result = rewards_finite(big, {"reward_mean": math.inf, "reward_std": math.nan})
    assert not result.passed and result.metadata["non_finite"].value == 1
    assert result.metadata["non_finite_stats"].value == "reward_mean, reward_std"
    # a batch whose totals are finite but whose spread overflows
    wide = [TrajectoryGroup((_trajectory([1.7e308]), _trajectory([-1.7e308])))]
    assert not rewards_finite(wide, {"reward_mean": 0.0, "reward_std": math.inf}).passed
