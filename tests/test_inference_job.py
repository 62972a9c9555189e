"""The `inference` job on a real temporary Dagster instance and MLflow registry: a registered
version (by alias, by number) generates for a task set, the metadata and the per-episode JSONL
equal what `run_inference` gives in-process for the same version and config, bad references and
bad fields fail with a clear message, and on a resident worker the results are the same."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path

import dagster as dg
import pytest
import torch
from dagster_env import SMALL, materializations, metadata, tracker

from assets.launch import run_iterations, run_sft
from tinker_pipelines.config import ConfigError
from assets.definitions import defs, inference_job
from tinker_pipelines.loops.inference import InferenceConfig, experiment_from_checkpoint, parse_model_ref, run_inference
from tinker_pipelines.tracking import registered_model_name

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)

EXP = "infer"
MODEL = registered_model_name(EXP)
CFG = {**SMALL, "training": {**SMALL["training"], "iterations": 2}}
TIMINGS = ("wall_s", "tokens_per_s")


@pytest.fixture(scope="module")
def instance():
    """SFT then 2 RL iterations of experiment `infer`: versions 1 and 2, alias champion -> 2."""
    with dg.instance_for_test() as inst:
        assert run_sft(inst, EXP, CFG)
        assert run_iterations(inst, EXP, CFG) == [True, True]
        tracker().set_alias(MODEL, "champion", "2")
        yield inst


def _run(instance, model: str, **fields):
    run_config = {"ops": {"inference_results": {"config": {"model": model, **fields}}}}
    with dg.execute_job(dg.reconstructable(inference_job), instance, run_config=run_config) as result:
        return result.success, result.run_id


def _result(instance, run_id: str) -> dict:
    (rec,) = [r for r in materializations(instance, "inference_results") if r.run_id == run_id]
    return metadata(rec)


def _failure(instance, run_id: str) -> str:
    events = [e for e in instance.all_logs(run_id) if e.dagster_event and e.dagster_event.is_step_failure]
    assert events, "the run has no step failure"
    data = events[0].dagster_event.step_failure_data
    return data.user_failure_data.description if data.user_failure_data else data.error.message  # dg.Failure's own text


def _jsonl(md: dict) -> list[dict]:
    return [json.loads(line) for line in Path(md["path"]).read_text().splitlines()]


def _in_process(version: str, cfg: InferenceConfig):
    """`run_inference` in this process on the registry's files of `version`, on the SFT base."""
    base = defs.resources["artifact_store"].store().local_dir(f"{EXP}/sft")
    with tempfile.TemporaryDirectory() as tmp:
        exp = experiment_from_checkpoint(tracker().download_version(MODEL, version, tmp), base)
    return exp, run_inference(exp, cfg)


def _untimed(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in TIMINGS}


@pytest.mark.parametrize("ref, version", [(f"{MODEL}@champion", "2"), (f"{MODEL}/1", "1"), (MODEL, "2")])
def test_inference_on_a_registered_version_equals_the_library_in_process(instance, ref, version):
    ok, run_id = _run(instance, ref, num_tasks=8)
    assert ok
    md = _result(instance, run_id)
    assert md["model"] == ref and md["model_version"] == version and md["registered_model"] == MODEL
    exp, expected = _in_process(version, InferenceConfig(num_tasks=8))
    s = expected.summary
    for key in ("success_rate", "pass_rate", "reward_mean", "reward_std"):
        assert md[key] == s[key], key
    assert md["sampled_tokens"] == s["sampled_tokens"] and md["episodes"] == 8 and md["tasks"] == 8
    assert md["wall_s"] > 0 and md["tokens_per_s"] > 0 and md["worker"] == "in-process"
    rows = _jsonl(md)
    assert len(rows) == 8 and rows == expected.records
    assert {"prompt", "completion", "reward", "success", "tokens"} <= set(rows[0])
    # the defaults (held-out split, greedy, one sample) are the episodes of Experiment.evaluate
    assert s["success_rate"] == exp.evaluate(8)["eval/exact_rate"]


def test_sampled_task_set_with_several_samples_per_task(instance):
    fields = {"num_tasks": 3, "split": "train", "seed_offset": 5, "temperature": 1.0, "samples_per_task": 3,
              "seed": 7, "max_new_tokens": 3}
    ok, run_id = _run(instance, f"{MODEL}@champion", **fields)
    assert ok
    md = _result(instance, run_id)
    rows = _jsonl(md)
    assert len(rows) == 9 and [(r["task"], r["sample"]) for r in rows][:4] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert {r["seed"] for r in rows} == {5, 6, 7} and all(r["tokens"] <= 3 for r in rows)
    assert 0 < md["success_rate"] < 1  # sampled training tasks: some solved, so the equality below means something
    _, expected = _in_process("2", InferenceConfig(**fields))
    assert rows == expected.records
    assert {k: md[k] for k in ("success_rate", "pass_rate", "reward_mean")} == \
        {k: expected.summary[k] for k in ("success_rate", "pass_rate", "reward_mean")}


@pytest.mark.parametrize("ref, message", [
    (f"{MODEL}@nope", f"registered model '{MODEL}' has no alias 'nope'"),
    (f"{MODEL}/99", f"registered model '{MODEL}' has no version 99"),
    ("tinker-no-such-model@champion", "registered model 'tinker-no-such-model' does not exist or has no versions"),
])
def test_unknown_model_alias_or_version_fails_with_the_message(instance, ref, message):
    ok, run_id = _run(instance, ref, num_tasks=2)
    assert not ok
    assert _failure(instance, run_id) == message
    assert not [r for r in materializations(instance, "inference_results") if r.run_id == run_id]


@pytest.mark.parametrize("fields, message", [
    ({"num_tasks": 0}, "inference.num_tasks must be >= 1, got 0"),
    ({"temperature": -0.5}, "inference.temperature must be >= 0 (0 is greedy), got -0.5"),
    ({"split": "dev"}, "inference.split must be one of ('eval', 'train'), got 'dev'"),
])
def test_bad_field_fails_naming_it(instance, fields, message):
    ok, run_id = _run(instance, f"{MODEL}@champion", **fields)
    assert not ok and _failure(instance, run_id) == message


def test_bad_reference_and_unknown_field():
    with dg.instance_for_test() as inst:
        ok, run_id = _run(inst, f"{MODEL}/latest")
        assert not ok and "model must be NAME@ALIAS, NAME/VERSION (a number) or NAME" in _failure(inst, run_id)
        with pytest.raises(dg.DagsterInvalidConfigError, match="num_task"):
            _run(inst, MODEL, num_task=3)


def test_library_rejects_bad_fields_before_any_model_work():
    for bad, field in [(InferenceConfig(num_tasks=0), "num_tasks"), (InferenceConfig(temperature=-1.0), "temperature"),
                       (InferenceConfig(samples_per_task=0), "samples_per_task"),
                       (InferenceConfig(temperature=float("nan")), "temperature")]:
        with pytest.raises(ValueError, match=f"inference.{field} "):
            run_inference(None, bad)  # type: ignore[arg-type]: validation comes first, no experiment needed
    assert parse_model_ref("m@a") == ("m", "a") and parse_model_ref("m/12") == ("m", "12")
    for bad in ("m@", "@a", "m/x", ""):
        with pytest.raises(ConfigError, match="NAME@ALIAS"):
            parse_model_ref(bad)


def test_inference_on_a_resident_worker_equals_in_process(instance, tmp_path, monkeypatch):
    from tinker_pipelines.worker.client import start_worker

    base = defs.resources["artifact_store"].store().local_dir(f"{EXP}/sft").resolve()
    address = tmp_path / "w.sock"
    proc = start_worker(str(base), address, device="cpu", dtype="float32", log=tmp_path / "log",
                        extra=["--no-batching", "--threads", str(torch.get_num_threads())])
    try:
        monkeypatch.setenv("TINKER_WORKER", str(address))
        fields = {"num_tasks": 4, "temperature": 1.0, "samples_per_task": 2, "seed": 1}
        ok, run_id = _run(instance, f"{MODEL}@champion", **fields)
        assert ok
        md = _result(instance, run_id)
        assert md["worker"] == str(address)
        monkeypatch.delenv("TINKER_WORKER")
        _, expected = _in_process("2", InferenceConfig(**fields))
        assert _jsonl(md) == expected.records
        assert {k: md[k] for k in _untimed(expected.summary)} == _untimed(expected.summary)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_readme_run_config_validates():
    import yaml

    from assets.inference import InferenceRunConfig

    run_config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "inference_quickstart.yaml").read_text())
    assert dg.validate_run_config(inference_job(), run_config)
    InferenceRunConfig(**run_config["ops"]["inference_results"]["config"]).to_library_config()
