"""The `rl` job with its policy engine on a resident worker: the same metrics as the plain loop."""

from __future__ import annotations

import os
import signal

import dagster as dg
import pytest
import torch
from dagster_env import tracker

from assets.launch import run_iterations
from resources.policy_engine import evict
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.loops.train import deterministic_metrics, train
from tinker_pipelines.worker.client import start_worker

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)

CFG = {"seed": 5, "model": {"name": "tiny", "seed": 0, "dtype": "float32"}, "env": {"path": "test_worker:ShortReplyEnv", "eval_kwargs": {}},
       "algorithm": {"name": "grpo", "kl_coef": 0.05},
       "training": {"mode": "lora", "iterations": 2, "learning_rate": 1e-2, "groups_per_batch": 3, "group_size": 4,
                    "max_new_tokens": 6},
       "eval": {"every": 2, "num_tasks": 8}}


def test_rl_job_on_a_worker_equals_the_plain_loop(tmp_path, monkeypatch):
    address = tmp_path / "w.sock"
    proc = start_worker("tiny", address, device="cpu", dtype="float32", log=tmp_path / "log",
                        extra=["--no-batching", "--threads", str(torch.get_num_threads())])
    try:
        monkeypatch.setenv("TINKER_WORKER", str(address))
        with dg.instance_for_test() as instance:
            assert run_iterations(instance, "on-worker", CFG) == [True, True]
        evict("on-worker")
        monkeypatch.delenv("TINKER_WORKER")
        plain = [deterministic_metrics(m) for m in train(config_from_dict({**CFG, "output_dir": str(tmp_path / "p")}))]
        t = tracker()
        run_id = t.find_run("on-worker")
        for k, expected in enumerate(plain):
            got = {key: dict(t.history(run_id, key)).get(k) for key in expected if key != "iteration"}
            assert got == {key: v for key, v in expected.items() if key != "iteration"}, f"iteration {k}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
