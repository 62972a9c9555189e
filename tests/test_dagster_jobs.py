"""The `sft` and `rl` jobs on a real temporary instance (`instance_for_test` + `execute_job`)."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from dagster_env import NO_SFT, SMALL, materializations, metadata, tracker

from assets.launch import rl_run_config, run_iterations, run_sft
from resources.policy_engine import evict, resident
from tinker_pipelines.bases import sft_model_name
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.serving.export import export_version
from tinker_pipelines.tracking import registered_model_name
from tinker_pipelines.loops.train import deterministic_metrics, train

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)

EXP = "jobs"


@pytest.fixture(scope="module")
def trained():
    """SFT then 3 RL iterations of experiment `jobs`, one run per iteration."""
    with dg.instance_for_test() as instance:
        assert run_sft(instance, EXP, SMALL)
        assert run_iterations(instance, EXP, SMALL) == [True, True, True]
        yield instance


def test_iterations_materialize_with_metadata_and_lineage(trained):
    versions = []
    for k in range(3):
        (rec,) = materializations(trained, "adapter_checkpoint", f"{EXP}:{k}")
        md = metadata(rec)
        for key in ("reward_mean", "reward_std", "kl", "sampled_tokens", "trained_tokens", "wall_time_s",
                    "mlflow_run_id", "model_version", "content_hash", "path"):
            assert key in md, key
        assert (Path(md["path"]) / "adapter_model.safetensors").exists()
        assert md["previous_model_version"] == (versions[-1] if versions else "none")
        versions.append(md["model_version"])
        (roll,) = materializations(trained, "rollout_batch", f"{EXP}:{k}")
        assert metadata(roll)["policy_model_version"] == (versions[-2] if k else "none")
        assert {"rewards_finite"} <= _passed_checks(trained, "rollout_batch", f"{EXP}:{k}")
        assert {"kl_within_bound", "adapter_loads"} <= _passed_checks(trained, "adapter_checkpoint", f"{EXP}:{k}")
    assert len(set(versions)) == 3
    # eval every 2 and after the last: iterations 1 and 2, with a learning-curve PNG
    assert sorted(r.partition_key for r in materializations(trained, "eval_report")) == [f"{EXP}:1", f"{EXP}:2"]
    curve = metadata(materializations(trained, "eval_report", f"{EXP}:2")[0])["learning_curve"]
    assert Path(curve).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (sft,) = materializations(trained, "sft_checkpoint", EXP)
    assert metadata(sft)["steps"] == 40


def _passed_checks(instance, asset: str, partition: str) -> set[str]:
    """Names of the checks on `asset` that passed in the run that materialized `partition`."""
    (rec,) = materializations(instance, asset, partition)
    events = instance.all_logs(rec.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
    evals = [e.dagster_event.event_specific_data for e in events]
    return {e.check_name for e in evals if e.asset_key == dg.AssetKey(asset) and e.passed}


def test_same_metrics_as_the_plain_loop(trained, small_run):
    plain = small_run[1]  # SMALL through the plain loop
    t = tracker()
    run_id = t.find_run(EXP)
    for k, expected in enumerate(plain):
        got = {key: dict(t.history(run_id, key)).get(k) for key in expected}
        assert got == expected, f"iteration {k}"


def test_one_mlflow_run_registry_versions_and_tags(trained):
    t = tracker()
    runs = t.client.search_runs([t.experiment_id], f"tags.`tinker.experiment` = '{EXP}'")
    assert len(runs) == 1
    run_id = runs[0].info.run_id
    assert runs[0].data.params["training.learning_rate"] == "0.005"
    assert [s for s, _ in t.history(run_id, "reward_mean")] == [0, 1, 2]
    assert len(t.client.get_metric_history(run_id, "reward_mean")) == 3
    name = registered_model_name(EXP)
    versions = t.client.search_model_versions(f"name = '{name}'")
    assert len(versions) == 3
    for mv in versions:
        k = int(mv.tags["iteration"])
        rec = metadata(materializations(trained, "adapter_checkpoint", f"{EXP}:{k}")[0])
        assert mv.tags["partition"] == f"{EXP}:{k}" and mv.tags["content_hash"] == rec["content_hash"]
        assert trained.get_run_by_id(mv.tags["dagster_run_id"]).tags["dagster/partition"] == f"{EXP}:{k}"
    files = t.client.list_artifacts(run_id, "adapters/iter_00002")
    assert {Path(f.path).name for f in files} >= {"adapter_model.safetensors", "record.json"}


def test_the_warm_start_is_registered_and_every_adapter_names_it(trained, tmp_path):
    """The `sft` job registers its warm start as `sft-<experiment>`; each adapter version is
    tagged with that version and its record holds the warm start's content hash, so the
    registered version exports onto the very base it was trained on."""
    t = tracker()
    sft_md = metadata(materializations(trained, "sft_checkpoint", EXP)[0])
    (base,) = t.client.search_model_versions(f"name = '{sft_model_name(EXP)}'")
    assert base.tags["content_hash"] == sft_md["content_hash"] and str(sft_md["model_version"]) == str(base.version)
    assert sft_model_name(EXP) not in t.models()  # not an adapter: the registry sensor never evaluates it
    for mv in t.client.search_model_versions(f"name = '{registered_model_name(EXP)}'"):
        assert (mv.tags["tinker.base_model"], mv.tags["tinker.base_version"]) == (sft_model_name(EXP), str(base.version))
    record = export_version(f"{registered_model_name(EXP)}/3", tmp_path / "out")
    assert record["base"]["sft_content_hash"] == sft_md["content_hash"]
    assert max(record["max_logit_diff"].values()) <= 1e-4


def test_retry_in_fresh_process_state_resumes_and_does_not_duplicate(trained):
    """Re-running iteration 1 with nothing resident: iteration 0's adapter is found through the
    instance, the result is bit-identical, and MLflow gets no duplicate points or versions."""
    before = metadata(materializations(trained, "adapter_checkpoint", f"{EXP}:1")[0])
    evict()
    assert run_iterations(trained, EXP, SMALL, start=1, stop=2) == [True]
    after = metadata(materializations(trained, "adapter_checkpoint", f"{EXP}:1")[0])
    assert after["content_hash"] == before["content_hash"]
    assert after["model_version"] == before["model_version"]
    t = tracker()
    run_id = t.find_run(EXP)
    assert len(t.client.get_metric_history(run_id, "reward_mean")) == 3
    assert len(t.client.get_metric_history(run_id, "eval/exact_rate")) == 2
    assert len(t.client.search_model_versions(f"name = '{registered_model_name(EXP)}'")) == 3


def test_bad_config_fails_naming_the_field_before_any_model_loads():
    bad = {**NO_SFT, "training": {**NO_SFT["training"], "learning_rate": -1.0}}
    with dg.instance_for_test() as instance:
        assert run_iterations(instance, "badcfg", bad, raise_on_error=False) == [False]
        (run,) = instance.get_runs()
        failure = [e for e in instance.all_logs(run.run_id) if e.dagster_event and e.dagster_event.is_step_failure]
        assert "training.learning_rate must be positive" in json.dumps(str(failure[0].dagster_event.event_specific_data))
    assert resident("badcfg") is None
    with pytest.raises(dg.DagsterInvalidConfigError, match="learning_rat"):
        with dg.instance_for_test() as instance:
            bad = {**NO_SFT, "training": {**NO_SFT["training"], "learning_rat": 1.0}}
            run_iterations(instance, "typo", bad)


def test_rl_run_config_shape():
    cfg = rl_run_config(NO_SFT)
    assert cfg["ops"]["rollout_batch"]["config"]["auto_continue"] is False


def test_full_parameter_mode_iteration():
    cfg = {**NO_SFT, "training": {**NO_SFT["training"], "mode": "full", "iterations": 1}, "eval": {"every": 1, "num_tasks": 4}}
    with dg.instance_for_test() as instance:
        assert run_iterations(instance, "fullmode", cfg) == [True]
        md = metadata(materializations(instance, "adapter_checkpoint", "fullmode:0")[0])
        assert list(Path(md["path"]).glob("model*.safetensors"))
        assert {"adapter_loads", "kl_within_bound"} <= _passed_checks(instance, "adapter_checkpoint", "fullmode:0")
        assert materializations(instance, "eval_report", "fullmode:0")


def test_ppo_epochs_with_a_kl_reference_score_it_once_and_match_the_plain_loop(tmp_path):
    """`scored_trajectories` writes the reference logprobs into `datums.json` (PPO's passes reuse
    them), and the job's metrics are the plain loop's."""
    from tinker_pipelines.tracking.store import loads

    cfg = {**NO_SFT, "algorithm": {"name": "ppo", "ppo_epochs": 2, "minibatches": 2, "kl_coef": 0.05},
           "training": {**NO_SFT["training"], "iterations": 1}, "eval": {"every": 1, "num_tasks": 4}}
    with dg.instance_for_test() as instance:
        assert run_iterations(instance, "ppokl", cfg) == [True]
        md = metadata(materializations(instance, "scored_trajectories", "ppokl:0")[0])
        datums = loads(Path(str(md["path"]).removeprefix("file://")).read_bytes())
        assert datums and all(len(d.reference_logprobs) == len(d.input_tokens) for d in datums)
        assert any(r < 0 for d in datums for r, w in zip(d.reference_logprobs, d.weights) if w)
        t = tracker()
        run_id = t.find_run("ppokl")
        plain = [deterministic_metrics(m) for m in train(config_from_dict({**cfg, "output_dir": str(tmp_path)}))]
        for k, expected in enumerate(plain):
            got = {key: dict(t.history(run_id, key)).get(k) for key in expected}
            assert got == expected, f"iteration {k}"
        assert plain[-1]["optim_steps"] == 4 and plain[-1]["kl"] != 0


def test_embedded_instance_storage(tmp_path):
    """A fresh project home's instance: Dagster's sqlite storages with pooled engines and
    synchronous=NORMAL; an iteration runs on it, and another process (as the daemon or webserver
    would) opens the same instance without importing the ML stack and sees the run."""
    import subprocess
    import sys

    from resources.instance_storage import (TinkerSqliteEventLogStorage, TinkerSqliteRunStorage,
                                            TinkerSqliteScheduleStorage)
    from tinker_pipelines.tracking import TinkerHome

    home = TinkerHome(tmp_path / "home").ensure()
    cfg = {**NO_SFT, "training": {**NO_SFT["training"], "iterations": 1}, "eval": {"every": 1, "num_tasks": 4}}
    with dg.DagsterInstance.from_config(str(home.dagster_home)) as instance:
        assert isinstance(instance.run_storage, TinkerSqliteRunStorage)
        assert isinstance(instance.event_log_storage, TinkerSqliteEventLogStorage)
        assert isinstance(instance.schedule_storage, TinkerSqliteScheduleStorage)
        assert run_iterations(instance, "embedded", cfg) == [True]
        assert materializations(instance, "eval_report", "embedded:0")
        for storage in (instance.run_storage, instance.event_log_storage, instance.schedule_storage):
            with storage._pool.transaction() as conn:
                assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    probe = ("import sys, dagster as dg; i = dg.DagsterInstance.from_config(sys.argv[1]); "
             "print(len(i.get_runs()), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, str(home.dagster_home)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["1", "False"], out.stderr[-2000:]
