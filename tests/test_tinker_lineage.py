"""Tracking and lineage of Tinker API training clients (`serving.tinker.lineage`), on a real MLflow
store and a real Dagster instance: one MLflow run per training client (base, LoRA config, session
tags and metadata, per-step metrics with Tinker's ':' keys), each saved checkpoint a registered
version with its lineage, reported to Dagster as an asset materialization, and answered by the
real OpenAI endpoint as `MODEL/VERSION` (a LoRA adapter on lm_head too: Tinker's train_unembed)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import dagster as dg
import openai
import pytest
import torch

from resources.tinker_lineage import dagster_reporter
from tinker_pipelines.algorithms import get_algorithm
from tinker_pipelines.loops.datums import sft_datum
from tinker_pipelines.models import load_model, stop_token_ids
from tinker_pipelines.rollout.sampler import Sampler
from tinker_pipelines.serving.launch import ServerThread, build_server
from tinker_pipelines.serving.registry import Registry
from tinker_pipelines.serving.tinker.lineage import TinkerTracker, metric_name, registered_name
from tinker_pipelines.tracking import Tracker
from tinker_pipelines.training.learner import Learner, LearnerConfig

MODEL_ID = "3f2a9c:train:0"
SESSION = "session-1"
LORA = {"rank": 4, "seed": 1, "train_unembed": True, "train_mlp": False, "train_attn": True}
PROMPT = "What is 2 + 3?"


@pytest.fixture(scope="module")
def home():
    with tempfile.TemporaryDirectory(prefix="tinker-lineage-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture(scope="module")
def tracker(home):
    return Tracker(f"sqlite:///{home / 'mlflow.db'}", "tinker-api", str(home / "artifacts"))


@pytest.fixture(scope="module")
def saved(home, tracker, instance):
    """A training client as the service runs it: a `Learner` on the resident tiny base with a LoRA
    adapter on attention and lm_head (train_unembed), two SFT steps, each step's metrics logged,
    then `save_state` (no `base` in the record: the service's worker writes none) and
    `checkpoint_saved`."""
    net, tok = load_model("tiny", seed=0)
    cfg = LearnerConfig(lora_rank=4, lora_alpha=8.0, learning_rate=2e-2, lora_targets=("q_proj", "v_proj", "lm_head"))
    learner = Learner(net, cfg, tok.pad_token_id, base_name="tiny", adapter_name="m0", init_seed=1)
    tt = TinkerTracker(tracker, dagster_reporter(instance))
    run_id = tt.start_model(MODEL_ID, SESSION, "tiny", LORA, ["cookbook", "math_rl"], {"owner": "ana", "lr": 2e-2})
    datum = sft_datum(tok, [{"role": "user", "content": PROMPT}], "5")
    for step in range(2):
        out = learner.forward_backward([datum], get_algorithm("sft").loss)
        opt = learner.optim_step()
        assert tt.log_step(MODEL_ID, step, {"loss:sum": out["loss"], "optim:grad_norm": opt["grad_norm"]})
    path = home / "ckpt" / "weights-0002"
    learner.save_state(path)
    v = tt.checkpoint_saved(MODEL_ID, "weights", "0002", path, step=2)
    return {"tt": tt, "run_id": run_id, "v": v, "path": path, "learner": learner, "tok": tok, "net": net}


def test_each_training_client_is_one_run_with_its_base_lora_tags_and_metrics(saved, tracker):
    tt, run_id = saved["tt"], saved["run_id"]
    run = tracker.client.get_run(run_id)
    assert run.data.params["base_model"] == "tiny" and run.data.params["base_identity"] == "tiny(seed=0)"
    assert run.data.params["lora.rank"] == "4" and run.data.params["lora.train_unembed"] == "True"
    tags = run.data.tags
    assert tags["tinker.model_id"] == MODEL_ID and tags["tinker.session"] == SESSION
    assert json.loads(tags["tinker.session_tags"]) == ["cookbook", "math_rl"]
    assert tags["tinker.meta.owner"] == "ana" and tags["tinker.meta.lr"] == "0.02"
    # Tinker's ':' keys are MLflow metric names as they are; a retried step is not logged twice
    losses = tracker.history(run_id, "loss:sum")
    assert [s for s, _ in losses] == [0, 1] and losses[1][1] < losses[0][1]
    assert not tt.log_step(MODEL_ID, 1, {"loss:sum": 0.0, "optim:grad_norm": 0.0})
    assert len(tracker.client.get_metric_history(run_id, "loss:sum")) == 2
    # a restarted service (a new tracker) finds the same run
    assert TinkerTracker(tracker).start_model(MODEL_ID, SESSION, "tiny", LORA, [], {}) == run_id


def test_a_saved_checkpoint_is_a_registered_version_with_its_lineage(saved, tracker):
    tt, v = saved["tt"], saved["v"]
    assert (v.model, v.version, v.key) == ("tinkerapi-3f2a9c-train-0", "1", "tinkerapi-3f2a9c-train-0/1")
    assert v.tinker_path == f"tinker://{MODEL_ID}/weights/0002" and v.run_id == saved["run_id"]
    mv = tracker.client.get_model_version(v.model, v.version)
    assert mv.run_id == saved["run_id"]
    assert {k: mv.tags[k] for k in ("tinker.model_id", "tinker.session", "tinker.step", "tinker.kind", "tinker.path",
                                    "tinker.base", "tinker.base_path")} == {
        "tinker.model_id": MODEL_ID, "tinker.session": SESSION, "tinker.step": "2", "tinker.kind": "weights",
        "tinker.path": v.tinker_path, "tinker.base": "tiny(seed=0)", "tinker.base_path": "tiny"}
    assert mv.tags["content_hash"] == json.loads((saved["path"] / "record.json").read_text())["content_hash"]
    # the same save reported again (a retried request) is the same version; a sampler snapshot is the next
    assert tt.checkpoint_saved(MODEL_ID, "weights", "0002", saved["path"], step=2).version == "1"
    snap = tt.checkpoint_saved(MODEL_ID, "sampler_weights", "s0002", saved["path"], step=2)
    assert snap.version == "2" and snap.tinker_path == f"tinker://{MODEL_ID}/sampler_weights/s0002"


def test_each_registered_checkpoint_is_a_dagster_asset_materialization(saved, instance):
    v = saved["v"]
    event = instance.get_latest_materialization_event(dg.AssetKey(["tinker", v.model]))
    assert event is not None and saved["tt"].report_errors == 0
    md = {k: m.value for k, m in event.asset_materialization.metadata.items()}
    assert md["tinker_path"] in (v.tinker_path, f"tinker://{MODEL_ID}/sampler_weights/s0002")
    records = instance.fetch_materializations(dg.AssetKey(["tinker", v.model]), limit=10).records
    first = {k: m.value for k, m in records[-1].asset_materialization.metadata.items()}
    assert first == {"tinker_path": v.tinker_path, "registered_model": v.model, "version": "1", "step": 2,
                     "base": "tiny(seed=0)", "base_model": "tiny", "session_id": SESSION, "model_id": MODEL_ID,
                     "mlflow_run_id": v.run_id, "kind": "weights", "name": "0002", "content_hash": v.content_hash}
    # each registration reports once (the retried save too: it is a re-registration of version 1)
    assert [r.asset_materialization.metadata["version"].value for r in records] == ["2", "1", "1"]


def test_a_report_that_fails_is_counted_and_the_checkpoint_is_still_registered(saved, tracker):
    def down(_report):
        raise ConnectionError("instance unreachable")
    tt = TinkerTracker(tracker, down)
    tt.start_model("other", SESSION, "tiny", LORA, [], {})
    v = tt.checkpoint_saved("other", "weights", "0001", saved["path"], step=1)
    assert tt.report_errors == 1 and tracker.client.get_model_version(v.model, v.version).tags["tinker.step"] == "1"


def test_bad_input_is_refused_naming_the_field(saved, tracker):
    tt = saved["tt"]
    with pytest.raises(ValueError, match="start_model was never called"):
        tt.log_step("never-started", 0, {"loss:sum": 1.0})
    with pytest.raises(ValueError, match="kind must be one of"):
        tt.checkpoint_saved(MODEL_ID, "ephemeral", "x", saved["path"], 1)
    with pytest.raises(ValueError, match="status must be one of"):
        tt.end_model(MODEL_ID, "done")
    with pytest.raises(ValueError, match="step must be"):
        tt.log_step(MODEL_ID, -1, {"loss:sum": 1.0})
    with pytest.raises(ValueError, match="both become the MLflow name"):
        tt.log_step(MODEL_ID, 5, {"a[b": 1.0, "a_b": 2.0})
    # two ids that sanitize to one registered model are never mixed in it
    tt.start_model("3f2a9c-train-0", SESSION, "tiny", LORA, [], {})
    with pytest.raises(ValueError, match="both map to registered model"):
        tt.checkpoint_saved("3f2a9c-train-0", "weights", "0001", saved["path"], 1)
    assert registered_name("a/b@c:d") == "tinkerapi-a-b-c-d" and metric_name("loss:sum") == "loss:sum"


@pytest.fixture(scope="module")
def endpoint(saved, tracker):
    server = build_server(model="tiny", registry=Registry(tracker, None), device="cpu", dtype="float32")
    thread = ServerThread(server)
    yield server, thread.url
    thread.stop()


def test_the_openai_endpoint_serves_the_checkpoint_as_model_slash_version(saved, endpoint):
    """Through the real app and the `openai` client: the tokens and logprobs of the registered
    adapter (lm_head included) are the in-process learner's, and not the base's."""
    server, url = endpoint
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    v, tok, learner = saved["v"], saved["tok"], saved["learner"]
    got = client.completions.create(model=v.key, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    learner.activate()
    sampler = Sampler(learner.model, tok.pad_token_id, stop_token_ids(tok), tokenizer=tok)
    (s,) = sampler.sample([tok.encode(PROMPT, add_special_tokens=False)], 6, 0.0)
    lp = got.choices[0].logprobs.token_logprobs
    assert got.usage.completion_tokens == len(s.tokens) and len(lp) == len(s.tokens)
    assert max(abs(a - b) for a, b in zip(lp, s.logprobs)) < 1e-4
    assert max(abs(a - b) for a, b in zip(lp, base.choices[0].logprobs.token_logprobs)) > 1e-3
    card = client.models.retrieve(v.key).model_extra["tinker"]
    assert card["config"] is None and card["learner"]["lora_targets"] == ["q_proj", "v_proj", "lm_head"]


def test_a_version_that_names_no_base_is_refused_naming_it(saved, tracker, endpoint):
    _, url = endpoint
    run_id = tracker.client.create_run(tracker.experiment_id).info.run_id
    record = json.loads((saved["path"] / "record.json").read_text())
    tracker.register_adapter(run_id, "tinkerapi-nobase", saved["path"], "x", {"content_hash": record["content_hash"]})
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tinkerapi-nobase/1", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 409 and "names no base" in e.value.message
    assert e.value.body["param"] == "model" and e.value.body["code"] == "base_missing"


def test_from_env_runs_apart_from_train_and_registers_where_the_endpoint_looks(saved, monkeypatch, tmp_path):
    from tinker_pipelines.serving.registry import registry_from_env

    monkeypatch.setenv("TINKER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TINKER_DEPLOYMENT", raising=False)
    tt = TinkerTracker.from_env()
    assert tt.tracker.client.get_experiment(tt.tracker.experiment_id).name == "tinker-api"
    tt.start_model("env-model", SESSION, "tiny", LORA, [], {})
    v = tt.checkpoint_saved("env-model", "weights", "0001", saved["path"], step=1)
    registry = Registry(*registry_from_env())  # the endpoint's: experiment "tinker", the same registry
    assert registry.tracker.experiment_id != tt.tracker.experiment_id
    assert registry.resolve(v.key) == (v.model, v.version)
    fetched = registry.fetch(v.model, v.version)
    assert (fetched.config, fetched.base, fetched.base_path) == (None, "tiny(seed=0)", "tiny")
    assert fetched.learner["lora_targets"] == ["q_proj", "v_proj", "lm_head"] and fetched.learner["lora_rank"] == 4


def test_an_lm_head_adapter_checkpoint_holds_only_the_adapter_and_never_writes_the_shared_base(saved, tmp_path):
    """PEFT saves a copy of the frozen lm_head (tied to the embedding here) with an adapter on it
    unless told not to; loaded, that copy was written over the base every adapter shares. The
    checkpoint holds the LoRA factors alone, and a checkpoint that holds such a copy (written
    before, or on a base of other precision) leaves the shared base as it is."""
    from safetensors.torch import load_file, save_file

    from tinker_pipelines.checkpoint import read_record, write_record

    files = load_file(str(saved["path"] / "adapter_model.safetensors"))
    assert any("lm_head.lora_B" in k for k in files) and not any(".base_layer." in k for k in files)
    net, learner = saved["net"], saved["learner"]
    emb = net.get_input_embeddings().weight.detach().clone()
    old = tmp_path / "old"
    old.mkdir()
    for f in saved["path"].iterdir():
        if f.name != "record.json":
            (old / f.name).write_bytes(f.read_bytes())
    head = learner.model.base_model.model.lm_head.base_layer.weight.detach()
    save_file({**files, "base_model.model.lm_head.base_layer.weight": head.to(torch.bfloat16).float()},
              str(old / "adapter_model.safetensors"))
    write_record(old, {k: v for k, v in read_record(saved["path"]).items() if k not in ("content_hash", "files")})
    learner.load_state(old)
    assert torch.equal(net.get_input_embeddings().weight, emb)
    assert all(torch.equal(p, files[k.replace(".m0", "")]) for k, p in learner.model.named_parameters()
               if "lm_head.lora_" in k)
