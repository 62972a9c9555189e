"""Shared fixtures: the tiny model is built once per session and copied per test."""

from __future__ import annotations

import contextlib
import copy
import socket

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(autouse=True)
def _same_global_rng_state():
    """Every test starts from the global RNGs (python, numpy, torch) seeded with 0, whatever ran
    before it. What draws from them (an adapter built without `init_seed`, a `torch.randn`)
    otherwise depends on which tests ran first, so a test could pass alone and fail after others."""
    from tinker_pipelines.checkpoint import seed_everything

    seed_everything(0)


@pytest.fixture(scope="session")
def _tiny_pristine():
    from tinker_pipelines.models import load_model

    return load_model("tiny", seed=0)


@pytest.fixture
def tiny(_tiny_pristine):
    """(model, tokenizer): a fresh copy of the tiny model for each test."""
    model, tokenizer = _tiny_pristine
    return copy.deepcopy(model), tokenizer


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """One plain-loop run of `dagster_env.SMALL` (the suite's small seeded config), trained once
    for the session: (its output_dir, its deterministic metrics per iteration). Tests that need
    this run's numbers as a reference read them here instead of training it again; they must not
    write under its output_dir. Under pytest-xdist the session's processes share one run: the
    first to get here trains it, the others wait on a lock and read its metrics (JSON keeps
    every float exact)."""
    import json
    import os

    from dagster_env import SMALL
    from filelock import FileLock

    from tinker_pipelines.config import config_from_dict
    from tinker_pipelines.loops.train import deterministic_metrics, train

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.mktemp("small_run") / "run"
        return out, [deterministic_metrics(m) for m in train(config_from_dict({**SMALL, "output_dir": str(out)}))]
    shared = tmp_path_factory.getbasetemp().parent  # this session's, above each process's own
    out, done = shared / "small_run" / "run", shared / "small_run" / "metrics.json"
    with FileLock(str(shared / "small_run.lock")):
        if not done.exists():
            metrics = [deterministic_metrics(m) for m in train(config_from_dict({**SMALL, "output_dir": str(out)}))]
            done.write_text(json.dumps(metrics))
    return out, json.loads(done.read_text())


@contextlib.contextmanager
def moto_s3(bucket: str):
    """A real S3-compatible server (moto's) on a free loopback port, test credentials in the
    environment and `bucket` created; yields the endpoint URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        mp.setenv(k, v)
    url = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
    try:
        yield url
    finally:
        mp.undo()
        server.stop()
