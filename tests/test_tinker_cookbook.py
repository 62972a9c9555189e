"""tinker-cookbook's recipes, unmodified, from their own environment (`.venv-cookbook`, made
by `scripts/setup_cookbook`, which `scripts/setup` runs last), against our Tinker service over HTTP."""

from __future__ import annotations

import pytest

from benchmarks import cookbook_runs as cr
from tinker_pipelines.models.hf_dir import write_model_dir
from tinker_pipelines.serving.tinker.launch import start_service

pytestmark = pytest.mark.e2e


def test_a_two_step_math_rl_run_of_the_cookbook_completes(tmp_path):
    assert cr.COOKBOOK_PYTHON.exists(), "no .venv-cookbook: run scripts/setup (or scripts/setup_cookbook alone)"
    model_dir, _ = write_model_dir("tiny", tmp_path / "tiny-dir")
    handle = start_service(str(model_dir), home=tmp_path / "service", api_key=cr.API_KEY, device="cpu",
                           dtype="float32")
    try:
        log = tmp_path / "rl"
        argv = cr.math_rl_argv(model_dir, handle.url, log, max_steps=2,
                               settings={"groups_per_batch": 2, "group_size": 2, "lora_rank": 4})
        run = cr.run_recipe(argv, cr.client_env(handle.url, runs_dir=tmp_path / "runs"), log, tmp_path / "out.txt",
                            timeout_s=600)
        run.check("math_rl")
        rows = cr.read_metrics(log)
        assert [r["step"] for r in rows if cr.CORRECT_KEY in r] == [0, 1]
        # the recipe's two steps trained one adapter on the worker: two optimizer steps, and its
        # training run is known to the service's REST API by the id the recipe's checkpoints carry
        runs = list((tmp_path / "service" / "runs").glob("*.json"))
        assert len(runs) == 1
        import json

        assert json.loads(runs[0].read_text())["steps"] == 2
    finally:
        handle.stop()
