"""The product's `rl` job, full-parameter on `training.devices: 2`, under the GPU-aware executor on a
simulated 2-device inventory: every step runs as 2 gloo ranks (`torchrun`), the rollout is split
between them, and the iteration's outputs equal those of the same experiment on one device."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import torch
import yaml
from safetensors.torch import load_file

from tinker_pipelines.models import load_model
from tinker_pipelines.scheduler.ledger import Ledger
from tinker_pipelines.tracking.store import loads

STEPS = ("rollout_batch", "scored_trajectories", "adapter_checkpoint", "eval_report")
SETTINGS = {"seed": 2, "model": {"name": "tiny", "seed": 0, "dtype": "float32"},
            "env": {"path": "test_worker:ShortReplyEnv", "eval_kwargs": {}},
            "training": {"mode": "full", "iterations": 1, "groups_per_batch": 2, "group_size": 4, "max_new_tokens": 4,
                         "learning_rate": 1e-3, "micro_batch_size": 8, "deepspeed": {"stage": 2}},
            "eval": {"every": 1, "num_tasks": 4}}


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    here = os.path.dirname(__file__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _execute(tmp_path: Path, experiment: str, devices: int, ledger: str,
             executor: str = "gpu") -> subprocess.CompletedProcess:
    """`dagster job execute` of one iteration of `experiment` with TINKER_EXECUTOR=`executor`, as a user runs it."""
    home = tmp_path / "dagster"
    home.mkdir(exist_ok=True)
    (home / "dagster.yaml").touch()
    settings = {**SETTINGS, "training": {**SETTINGS["training"], "devices": devices}}
    run_config = {"ops": {"rollout_batch": {"config": settings}}}
    if executor == "gpu":
        run_config["execution"] = {"config": {"inventory": {"count": 2, "memory_gb": 16}, "ledger_path": ledger}}
    path = tmp_path / f"{experiment}.yaml"
    path.write_text(yaml.safe_dump(run_config))
    env = {**os.environ, "DAGSTER_HOME": str(home), "TINKER_HOME": str(tmp_path / "tinker"), "TINKER_EXECUTOR": executor}
    return subprocess.run([sys.executable, "-m", "dagster", "job", "execute", "-m", "assets.definitions", "-j", "rl",
                           "-c", str(path), "--tags", f'{{"dagster/partition": "{experiment}:0"}}'],
                          env=env, capture_output=True, text=True, timeout=900)


def _metadata(instance: dg.DagsterInstance, asset: str, partition: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1).records
    assert records, f"{asset} {partition} was not materialized"
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def _weights(directory: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("model*.safetensors")):
        state.update(load_file(str(f)))
    assert state, f"no weights in {directory}"
    return state


@pytest.mark.e2e
def test_rl_job_on_two_ranks_splits_rollouts_and_equals_one_device(tmp_path):
    ledger = str(tmp_path / "ledger.sqlite")
    two = _execute(tmp_path, "two", 2, ledger)
    assert two.returncode == 0, two.stderr[-4000:]
    events = Ledger(ledger).audit_log()
    grants = {e.step_key: e for e in events if e.event == "grant"}
    assert set(grants) == set(STEPS)
    assert all(g.devices == (0, 1) and g.needs.devices == 2 and g.needs.sharing == "exclusive"
               for g in grants.values()), grants
    one = _execute(tmp_path, "one", 1, ledger)
    assert one.returncode == 0, one.stderr[-4000:]
    ones = [e for e in Ledger(ledger).audit_log() if e.event == "grant" and e.seq > max(g.seq for g in grants.values())]
    assert sorted(e.step_key for e in ones) == sorted(STEPS) and all(len(e.devices) == 1 for e in ones)

    _check_equal_to_one_device(tmp_path)


def _check_equal_to_one_device(tmp_path: Path) -> None:
    """Experiment `two` (2 ranks) against `one` (1 device), both materialized under `tmp_path`."""
    instance = dg.DagsterInstance.from_config(str(tmp_path / "dagster"))
    ro2, ro1 = _metadata(instance, "rollout_batch", "two:0"), _metadata(instance, "rollout_batch", "one:0")
    # each rank sampled half the rows on the device it leased
    assert [(s["rank"], s["rows"], s["device"]) for s in ro2["rank_shares"]] == [(0, 4, "0"), (1, 4, "1")]
    assert "rank_shares" not in ro1
    assert all(ro2[k] == ro1[k] for k in ("reward_mean", "reward_std", "sampled_tokens", "episodes"))
    # the same gathered batch: token ids and logprobs of every episode equal (the base-only decoder is
    # batch-invariant on CPU), so the ranks' halves are the one device's whole
    store = tmp_path / "tinker"
    rollouts = [sorted(store.rglob(f"{name}/**/rollout.json")) for name in ("two", "one")]
    assert all(len(r) == 1 for r in rollouts), rollouts
    (g2, g1) = (loads(r[0].read_bytes())["groups"] for r in rollouts)
    assert len(g2) == 2 and g2 == g1

    ck2, ck1 = _metadata(instance, "adapter_checkpoint", "two:0"), _metadata(instance, "adapter_checkpoint", "one:0")
    assert ck2["checks"] == ck1["checks"] == "passed"
    assert ck2["trained_tokens"] == ck1["trained_tokens"] > 0 and ck2["model_version"] == ck1["model_version"] == "1"
    # DeepSpeed reduces the two shards' gradients in another order than one rank's sum: fp32 rounding only
    for key in ("loss", "kl", "reward_mean"):
        a, b = ck2[key], ck1[key]
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-5 * (1 + abs(b)), (key, a, b)
    w2, w1 = _weights(ck2["path"]), _weights(ck1["path"])
    start = load_model("tiny", seed=0, dtype="float32", device="cpu")[0].state_dict()
    assert set(w2) == set(w1) <= set(start)
    diff_N = torch.cat([(w2[n] - w1[n]).abs().flatten() for n in w1])
    step_N = torch.cat([(w1[n] - start[n]).abs().flatten() for n in w1])
    lr = SETTINGS["training"]["learning_rate"]
    # Adam's first step moves a weight by lr wherever its gradient is well above eps: there the two
    # agree to fp32 rounding (tests/test_deepspeed.py's 2.3e-7); below eps it magnifies the summation
    # order (measured: 40 of 1.16M weights beyond 2.3e-7, the largest 7.4e-6), never past a step
    assert (step_N > 0.9 * lr).float().mean() > 0.99
    assert diff_N[step_N > 0.9 * lr].max() <= 2.3e-7
    assert (diff_N > 2.3e-7).float().mean() < 1e-4 and diff_N.max() < lr
    ev2, ev1 = _metadata(instance, "eval_report", "two:0"), _metadata(instance, "eval_report", "one:0")
    assert ev2["eval_reward_mean"] == pytest.approx(ev1["eval_reward_mean"], abs=1e-6)


def test_more_devices_than_the_node_has_fails_the_rl_job_before_any_model_loads(tmp_path):
    ledger = str(tmp_path / "ledger.sqlite")
    r = _execute(tmp_path, "big", 3, ledger)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "ValueError: step rollout_batch (training.devices): step needs 3 x " in out
    assert "exclusive, but the inventory has only 2 device(s): it can never be placed" in out
    assert not Ledger(ledger).audit_log()
    assert not (tmp_path / "tinker").exists() or not list((tmp_path / "tinker").rglob("*.safetensors"))


@pytest.mark.e2e
def test_several_devices_under_the_in_process_executor_fail_naming_the_executor(tmp_path):
    """In-process, every step runs in the run's one process: `training.devices: 2` is refused
    there, naming the field and the executor that runs it, instead of training on one rank."""
    r = _execute(tmp_path, "inproc", 2, str(tmp_path / "ledger.sqlite"), executor="in_process")
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "training.devices: 2 needs the GPU-aware executor (TINKER_EXECUTOR=gpu)" in out, out[-2000:]
    assert not (tmp_path / "tinker").exists() or not list((tmp_path / "tinker").rglob("*.safetensors"))
