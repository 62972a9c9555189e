"""Full-parameter steps on several devices: the GPU-aware executor launches them as `torchrun`,
one gloo rank per device of a simulated inventory, each rank sampling its share of the rollout."""

from __future__ import annotations

import json
import os
import time

import dagster as dg
import pytest

from tinker_pipelines.config import ConfigError, config_from_dict
from tinker_pipelines.scheduler.executor import gpu_executor, is_ranked, step_needs
from tinker_pipelines.scheduler.ledger import Ledger
from tinker_pipelines.scheduler.rank_entry import apply_rank_device

EXCLUSIVE = {"tinker/devices": "1", "tinker/sharing": "exclusive"}
CONFIG = {"seed": 5, "model": {"name": "tiny", "dtype": "float32"},
          "env": {"path": "arithmetic", "kwargs": {"max_operand": 3, "partial_credit": 0.5}}, "algorithm": {"name": "grpo"},
          "training": {"mode": "full", "learning_rate": 1e-3, "groups_per_batch": 4, "group_size": 4,
                       "max_new_tokens": 6, "micro_batch_size": 8, "deepspeed": {"stage": 2}},
          "sft": {"steps": 10, "batch_size": 16, "examples": 64, "learning_rate": 3e-3}}


@dg.op(tags=EXCLUSIVE, config_schema={"config": dg.Permissive(), "target": dg.Field(str, is_required=False)})
def full_step(context) -> str:
    from tinker_pipelines.scheduler import ranks

    target = context.op_config.get("target", "tinker_pipelines.loops.ranked:full_iteration")
    return json.dumps(ranks.run(target, {"config": context.op_config["config"], "iteration": 0}))


@dg.job(executor_def=gpu_executor)
def full_job():
    full_step()


def fail_on_rank_one(payload: dict) -> dict:
    """A follower's failure in the middle of a collective step."""
    import torch

    torch.distributed.init_process_group("gloo")
    if torch.distributed.get_rank() == 1:
        raise ValueError("bad shard on purpose")
    torch.distributed.barrier()
    return {}


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _run(instance, tmp_path, devices: int, count: int = 2, target: str | None = None):
    config = {**CONFIG, "training": {**CONFIG["training"], "devices": devices}}
    op = {"config": config, **({"target": target} if target else {})}
    run_config = {"ops": {"full_step": {"config": op}},
                  "execution": {"config": {"inventory": {"count": count, "memory_gb": 80},
                                           "ledger_path": str(tmp_path / "ledger.sqlite")}}}
    return dg.execute_job(dg.reconstructable(full_job), instance, run_config=run_config, raise_on_error=False)


def _text(result) -> str:
    return " ".join(str(e.event_specific_data) + str(e.message) for e in result.all_events)


def _released(tmp_path, wait_s: float = 60.0) -> bool:
    """Whether the ledger holds no lease once the step process is gone: it keeps its lease until
    torchrun has stopped every rank, which may be a moment after Dagster saw the step end."""
    ledger = Ledger(str(tmp_path / "ledger.sqlite"))
    deadline = time.monotonic() + wait_s
    while ledger.leases() and time.monotonic() < deadline:
        ledger.expire_dead()
        time.sleep(0.2)
    return not ledger.leases()


@pytest.mark.e2e
def test_a_two_rank_step_samples_half_each_and_gathers_the_one_rank_batch(tmp_path):
    with dg.instance_for_test() as instance:
        with _run(instance, tmp_path, devices=2) as r:
            assert r.success, _text(r)[-3000:]
            split = json.loads(r.output_for_node("full_step"))
        grants = [e for e in Ledger(str(tmp_path / "ledger.sqlite")).audit_log() if e.event == "grant"]
        assert len(grants) == 1 and _released(tmp_path)  # one lease of both devices, for the whole torchrun
        with _run(instance, tmp_path, devices=1) as r:
            assert r.success, _text(r)[-3000:]
            one = json.loads(r.output_for_node("full_step"))
    assert [(s["rank"], s["rows"], s["device"]) for s in split["shares"]] == [(0, 8, "0"), (1, 8, "1")]
    assert [(s["world"], s["rows"]) for s in one["shares"]] == [(1, 16)]
    # the same token ids and logprobs, bit for bit, for every group and episode
    assert split["groups"] == one["groups"] and len(split["groups"]) == 4
    a, b = split["metrics"], one["metrics"]
    assert set(a) == set(b) and "grad_norm" in a
    assert all(a[k] == b[k] for k in ("reward_mean", "reward_std", "sampled_tokens", "episodes"))
    # the step's own numbers: DeepSpeed sums the ranks' shards in another order (tests/test_deepspeed.py)
    assert all(abs(a[k] - b[k]) <= 1e-5 * (1 + abs(b[k])) for k in a)
    assert _released(tmp_path)


@pytest.mark.e2e
def test_a_failed_rank_fails_the_step_with_its_line_and_frees_the_lease(tmp_path):
    with dg.instance_for_test() as instance:
        with _run(instance, tmp_path, devices=2, target="test_ranked_steps:fail_on_rank_one") as r:
            assert not r.success
            assert "rank 1 (device 1) failed: ValueError: bad shard on purpose" in _text(r)
    assert _released(tmp_path)


def test_more_devices_than_the_node_has_fails_at_once_naming_the_field(tmp_path):
    with dg.instance_for_test() as instance:
        with _run(instance, tmp_path, devices=3) as r:
            assert not r.success
            assert ("step full_step (training.devices): step needs 3 x 0 GB exclusive, but the inventory has "
                    "only 2 device(s): it can never be placed") in _text(r)
    assert not Ledger(str(tmp_path / "ledger.sqlite")).audit_log()  # nothing was leased, no model loaded


def test_training_devices_sets_the_step_and_needs_zero():
    full = {"ops": {"x": {"config": {"training": {"mode": "full", "devices": 4}}}}}
    needs = step_needs(EXCLUSIVE, full)
    assert (needs.devices, needs.sharing) == (4, "exclusive") and is_ranked(needs, full)
    lora = {"ops": {"x": {"config": {"training": {"mode": "lora", "devices": 4}}}}}
    assert step_needs(EXCLUSIVE, lora).devices == 1 and not is_ranked(step_needs(EXCLUSIVE, lora), lora)
    with pytest.raises(ConfigError, match=r"training.devices > 1 needs training.deepspeed.stage 2 or 3"):
        config_from_dict({"training": {"mode": "full", "devices": 2}})
    with pytest.raises(ConfigError, match=r"training.devices must be >= 1, got 0"):
        config_from_dict({"training": {"mode": "full", "devices": 0}})
    with pytest.raises(ValueError, match=r"training.devices must be a positive integer, got 'two'"):
        step_needs(EXCLUSIVE, {"training": {"mode": "full", "devices": "two"}})


def test_each_rank_takes_its_own_leased_device():
    real = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TINKER_LEASE_DEVICES": "5,2",
            "TINKER_RANK_VISIBLE": json.dumps(["GPU-aaa", "GPU-bbb"])}
    assert apply_rank_device(real) == "2"
    assert real["CUDA_VISIBLE_DEVICES"] == "GPU-bbb" and real["LOCAL_RANK"] == "0"  # its one GPU is cuda:0
    simulated = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TINKER_LEASE_DEVICES": "0,1"}
    assert apply_rank_device(simulated) == "1"
    assert "CUDA_VISIBLE_DEVICES" not in simulated and simulated["LOCAL_RANK"] == "1"
    with pytest.raises(RuntimeError, match="torchrun started 3 ranks for a lease of 2 devices"):
        apply_rank_device({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", "TINKER_LEASE_DEVICES": "0,1"})


def _joins_the_group(payload):
    from tinker_pipelines.scheduler.ranks import check_in_ranked_body

    check_in_ranked_body()
    return "joined"


def test_a_multi_rank_learner_outside_ranks_run_is_refused_not_hung(tmp_path, monkeypatch):
    """The followers of a ranked step wait for `ranks.run`'s task: a body that joins a process
    group of several ranks without it (the RL assets) would hang its first collective; it fails
    at once naming training.devices, while `ranks.run`'s own target goes on."""
    from tinker_pipelines.scheduler import ranks

    monkeypatch.setenv(ranks.RANK_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"^training.devices: this step runs on 2 ranks, but its body does not call"):
        ranks.check_in_ranked_body()
    assert ranks.run(f"{__name__}:_joins_the_group", {}) == "joined"
    assert (tmp_path / ranks.TASK_FILE).exists()  # the followers were given the same task
    with pytest.raises(ValueError):  # and after it, outside run again
        ranks.check_in_ranked_body()
