"""The S3 artifact store against a real S3-compatible server (moto's server mode, started here):
a store round trip, and RL iterations whose rollouts and adapters live only in S3."""

from __future__ import annotations


import boto3
import dagster as dg
import pytest
from conftest import moto_s3
from dagster_env import NO_SFT, materializations, metadata, tinker_home

from assets.jobs import rl
from assets.partitions import ITERATIONS, iteration_key
from assets.training import RL_ASSETS
from resources import build_resources
from resources.policy_engine import evict
from tinker_pipelines.tracking import S3Store, open_store
from tinker_pipelines.tracking.store import dumps, loads

BUCKET = "tinker-test"


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_s3(BUCKET) as url:
        yield url


def test_s3_store_round_trip(s3_endpoint, tmp_path):
    store = open_store(f"s3://{BUCKET}/unit", endpoint_url=s3_endpoint, cache_dir=tmp_path / "cache")
    assert isinstance(store, S3Store)
    assert store.put_bytes("a/b.pkl", dumps([1, 2])) == f"s3://{BUCKET}/unit/a/b.pkl"
    assert loads(store.get_bytes("a/b.pkl")) == [1, 2] and store.exists("a/b.pkl") and not store.exists("zz")
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "w.safetensors").write_bytes(b"\x00\x01" * 100)
    (src / "sub" / "r.json").write_text("{}")
    assert store.put_dir(src, "exp/00000/adapter") == f"s3://{BUCKET}/unit/exp/00000/adapter"
    got = store.local_dir("exp/00000/adapter")
    assert (got / "w.safetensors").read_bytes() == b"\x00\x01" * 100 and (got / "sub" / "r.json").exists()
    keys = [o["Key"] for o in store.client.list_objects_v2(Bucket=BUCKET, Prefix="unit/exp")["Contents"]]
    assert sorted(keys) == ["unit/exp/00000/adapter/sub/r.json", "unit/exp/00000/adapter/w.safetensors"]
    with pytest.raises(FileNotFoundError):
        store.local_dir("missing")


def test_a_checkpoint_record_is_uploaded_last(s3_endpoint, tmp_path):
    store = open_store(f"s3://{BUCKET}/order", endpoint_url=s3_endpoint, cache_dir=tmp_path / "cache")
    src = tmp_path / "ckpt"
    src.mkdir()
    for name in ("adapter_model.safetensors", "record.json", "value_head.safetensors", "rng.pt"):
        (src / name).write_bytes(b"x")
    order: list[str] = []
    upload = store.client.upload_file
    store.client.upload_file = lambda f, b, k: (order.append(k.rsplit("/", 1)[-1]), upload(f, b, k))
    store.put_dir(src, "c")
    assert order[-1] == "record.json" and sorted(order) == sorted(p.name for p in src.iterdir())


def s3_rl_job() -> dg.JobDefinition:
    """The `rl` job with the production resources (read from the environment at run time)."""
    defs = dg.Definitions(assets=RL_ASSETS, jobs=[rl], resources=build_resources("production"))
    return defs.resolve_job_def("rl")


def test_rl_iterations_with_artifacts_in_s3(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("TINKER_MLFLOW_ARTIFACT_LOCATION", str(tmp_path / "mlartifacts"))
    monkeypatch.setenv("TINKER_ARTIFACTS_URI", f"s3://{BUCKET}/prod")
    monkeypatch.setenv("TINKER_S3_ENDPOINT_URL", s3_endpoint)
    cfg = {**NO_SFT, "training": {**NO_SFT["training"], "iterations": 2}, "eval": {"every": 5, "num_tasks": 4}}
    run_config = {"ops": {"rollout_batch": {"config": {**cfg, "auto_continue": False}}}}
    with dg.instance_for_test() as instance:
        for k in range(2):
            key = iteration_key("s3exp", k)
            instance.add_dynamic_partitions(ITERATIONS.name, [key])
            evict()  # as in a fresh run process: iteration 1 must fetch iteration 0's adapter from S3
            with dg.execute_job(dg.reconstructable(s3_rl_job), instance, run_config=run_config,
                                tags={"dagster/partition": key}) as result:
                assert result.success
        md = [metadata(materializations(instance, "adapter_checkpoint", f"s3exp:{k}")[0]) for k in range(2)]
    assert md[0]["path"] == f"s3://{BUCKET}/prod/s3exp/00000/adapter"
    assert md[1]["previous_adapter"] == md[0]["path"]
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="prod/s3exp")["Contents"]}
    for k in range(2):
        assert f"prod/s3exp/{k:05d}/rollout.json" in keys
        assert f"prod/s3exp/{k:05d}/adapter/adapter_model.safetensors" in keys
    assert "prod/s3exp/experiment.json" in keys
    # the downloaded copy of iteration 0 sits in the local cache, not in the local artifact folder
    assert not (tinker_home().artifacts / "s3exp").exists()


def test_the_store_names_the_checkpoint_record_as_checkpoints_do():
    from tinker_pipelines.checkpoint import RECORD
    from tinker_pipelines.tracking import store

    assert store.RECORD == RECORD
