"""The Tinker service as many people share it for days: one request's fault stays with it, a
bad request is a 4xx the SDK does not retry and uses up its seq_id, loaded adapters belong to a
session and go with it, checkpoints live until their TTL, and keys see only their own.

One service (tiny base, CPU worker) with two keys, a body bound of 256 KB and TTLs from 1 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch
import zstandard

import tinker
from tinker import types

from tinker_pipelines.serving.tinker.app import TinkerSettings
from tinker_pipelines.serving.tinker.launch import start_service
from tinker_pipelines.serving.tinker.tenancy import Keys

pytestmark = pytest.mark.e2e  # a worker process and an HTTP service

KEY_A, KEY_B = "tml-alice-key", "tml-bob-key"
BOUND = 256 * 1024
GAP_S = 30.0
"""Long enough that a call waiting for a seq_id that never comes is plainly slower than one that does not wait."""


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    home = tmp_path_factory.mktemp("tenants")
    keys = home / "keys"
    keys.write_text(f"# two tenants\n{KEY_A} alice\n{KEY_B} bob\n")
    handle = start_service("tiny", home=home / "service", device="cpu", dtype="float32", gap_timeout_s=GAP_S,
                           settings=TinkerSettings(keys=Keys.from_file(keys), max_body_bytes=BOUND),
                           worker_args=["--threads", str(torch.get_num_threads())], min_ttl_s=1)
    yield handle
    handle.stop()


def _client(service, key: str = KEY_A) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=service.url, api_key=key)


@pytest.fixture
def alice(service):
    sc = _client(service)
    yield sc
    sc.close("success").result()


def _sft(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
        "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, np.float32))})


DATA = [_sft([5, 9, 13, 21, 34, 55])]
ADAM = types.AdamParams(learning_rate=1e-2)
GREEDY = types.SamplingParams(max_tokens=5, temperature=0.0)


def _http(service, key: str = KEY_A) -> httpx.Client:
    return httpx.Client(base_url=service.url, headers={"X-API-Key": key}, timeout=60)


# -- one request's fault is its own -----------------------------------------------------------
def test_a_bad_row_fails_alone_and_its_neighbours_decode_as_without_it(service, alice):
    sc = alice.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints([3, 4, 5, 6])
    alone = sc.sample(prompt, 2, GREEDY).result()

    async def merged():
        good = sc.sample_async(prompt, 2, GREEDY)
        bad = sc.sample_async(types.ModelInput.from_ints([3, 10**9]), 1, GREEDY)
        overflow = sc.sample_async(types.ModelInput.from_ints([5] * 60), 1, types.SamplingParams(max_tokens=10**6))
        return await asyncio.gather(good, bad, overflow, return_exceptions=True)
    good, bad, overflow = asyncio.run(merged())
    assert not isinstance(good, Exception), good
    assert [s.tokens for s in good.sequences] == [s.tokens for s in alone.sequences]
    assert isinstance(bad, tinker.BadRequestError) and "outside the vocabulary" in str(bad)
    assert isinstance(overflow, tinker.BadRequestError) and "sampling_params.max_tokens" in str(overflow)


def test_bad_requests_are_4xx_the_sdk_does_not_retry(service, alice):
    tc = alice.create_lora_training_client("tiny", rank=4).result()
    started = time.monotonic()
    with pytest.raises(tinker.BadRequestError, match="optimizer family 'dimuon' is not served here.*adamw"):
        tc.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
    with pytest.raises(tinker.BadRequestError, match="optimizer_config.type 'dimuon'"):
        alice.create_lora_training_client("tiny", rank=4, optimizer=types.DimuonOptimizerConfig()).result()
    with _http(service) as http:
        r = http.post("/api/v1/weights_info", content=b"[1, 2")
        assert r.status_code == 400 and r.json()["field"] == "body", r.text
        r = http.post("/api/v1/weights_info", json=["not", "an", "object"])
        assert r.status_code == 400 and r.json()["field"] == "tinker_path"
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": None,
                                                             "sdk_version": "0.38.0"}).json()["session_id"]
        sampler = http.post("/api/v1/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}).json()["sampling_session_id"]
        r = http.post("/api/v1/asample", json={
            "sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "sampling_params": {"max_tokens": 2},
            "prompt": {"chunks": [{"type": "image", "data": "aGk=", "format": "png", "expected_tokens": 4}]}})
        assert r.status_code == 400 and r.json()["field"] in ("prompt.chunks", "prompt"), r.text
        r = http.post("/api/v1/unload_model", json={"model_id": "x"})
        assert r.status_code == 404 and "is not an endpoint of this service" in r.json()["detail"]
    assert time.monotonic() - started < 20  # answered, not retried for minutes
    tc.forward_backward(DATA, "cross_entropy").result()  # and the client goes on


def test_a_refused_call_uses_up_its_seq_id(service, alice):
    """Each refusal below happens before the call is ordered; the client's next call must not
    wait `GAP_S` for it."""
    tc = alice.create_lora_training_client("tiny", rank=4).result()
    model_id = tc.model_id
    with pytest.raises(tinker.BadRequestError):
        tc.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
    with pytest.raises(Exception, match="413|over this service's bound"):
        tc.save_state("x" * 100 + "y" * (BOUND + 10)).result()
    started = time.monotonic()
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    assert time.monotonic() - started < GAP_S / 2
    # raw requests the SDK would not make: a pydantic refusal, a bad zstd body, an unrouted call
    queue = service.service.models[model_id].queue
    nxt = queue.next
    with _http(service) as http:
        assert http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": nxt, "adam_params": 7}
                         ).status_code == 400
        assert http.post("/api/v1/forward_backward", content=b"\x28\xb5\x2f\xfdjunk", headers={
            "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}).status_code == 400
        assert http.post("/api/v1/copy_weights", json={"model_id": model_id, "seq_id": nxt + 1}).status_code == 404
    deadline = time.monotonic() + 5
    while queue.next != nxt + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert queue.next == nxt + 2  # both slots used up; the undecodable body named none


def test_a_zstd_bomb_is_refused_without_inflating_it(service):
    bomb = zstandard.ZstdCompressor(level=3).compress(b"\0" * (64 * 1024 * 1024))
    assert len(bomb) < BOUND
    with _http(service) as http:
        r = http.post("/api/v1/forward_backward", content=bomb, headers={
            "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
    assert r.status_code == 413 and "decompresses to more than" in r.json()["detail"]


# -- ids and retries ----------------------------------------------------------------------------
def test_a_retried_create_answers_the_first_and_ids_are_unique(service):
    svc = service.service
    with _http(service) as http:
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": None,
                                                             "sdk_version": "0.38.0"}).json()["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}
        first = http.post("/api/v1/create_model", json=body).json()["request_id"]
        again = http.post("/api/v1/create_model", json=body).json()["request_id"]
        assert first == again and len(first) > 30  # a uuid, not a counter
        result = http.post("/api/v1/retrieve_future", json={"request_id": first}).json()
        assert result["model_id"] == f"{session}:train:0"
        assert sum(m.session_id == session for m in svc.models.values()) == 1
        body = {"session_id": session, "sampling_session_seq_id": 3, "base_model": "tiny"}
        assert http.post("/api/v1/create_sampling_session", json=body).json() == \
            http.post("/api/v1/create_sampling_session", json=body).json()
        r = http.post("/api/v1/retrieve_future", json={"request_id": "req-0"})
        assert r.status_code == 404
        http.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}})


# -- lifetimes -----------------------------------------------------------------------------------
def test_adapters_belong_to_their_session_and_go_with_it(service):
    svc = service.service
    before = svc.loaded_adapters()["from_checkpoints"]
    sc = _client(service)
    tc = sc.create_lora_training_client("tiny", rank=4).result()
    path = tc.save_weights_for_sampler("for-sampling").result().path
    a = sc.create_sampling_client(model_path=path).result()
    b = sc.create_sampling_client(model_path=path).result()
    assert a.sample(types.ModelInput.from_ints([3, 4]), 1, GREEDY).result().sequences
    assert b.sample(types.ModelInput.from_ints([3, 4]), 1, GREEDY).result().sequences
    assert svc.loaded_adapters()["from_checkpoints"] == before + 1  # one adapter for both samplers
    # ephemeral snapshots: the third makes the first one's sampler answer 410, naming it
    snaps = [tc.save_weights_and_get_sampling_client().result() for _ in range(3)]
    with pytest.raises(tinker.APIStatusError, match="its weights were dropped") as e:
        snaps[0].sample(types.ModelInput.from_ints([3, 4]), 1, GREEDY).result()
    assert e.value.status_code == 410
    assert snaps[2].sample(types.ModelInput.from_ints([3, 4]), 1, GREEDY).result().sequences
    sc.close("success").result()
    assert svc.loaded_adapters()["from_checkpoints"] == before


def test_a_checkpoint_past_its_ttl_is_deleted(service, alice):
    tc = alice.create_lora_training_client("tiny", rank=4).result()
    rest = alice.create_rest_client()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds 0 is out of range"):
        tc.save_state("never", ttl_seconds=0).result()
    path = tc.save_state("short", ttl_seconds=2).result().path
    keep = tc.save_state("kept").result().path
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[path].expires_at is not None and listed[keep].expires_at is None
    d = service.service.checkpoint_dir(tc.model_id, "weights", "short")
    assert d.exists()
    deadline = time.monotonic() + 15
    while d.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not d.exists()
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [keep]
    with pytest.raises(tinker.NotFoundError):
        alice.create_training_client_from_state(path).result()
    rest.set_checkpoint_ttl_from_tinker_path(keep, 3600).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints[0].expires_at is not None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(keep, 10**12).result()


def test_deleting_a_checkpoint_a_sampler_uses_keeps_that_sampler(service, alice):
    tc = alice.create_lora_training_client("tiny", rank=4).result()
    path = tc.save_weights_for_sampler("in-use").result().path
    sampler = alice.create_sampling_client(model_path=path).result()
    before = sampler.sample(types.ModelInput.from_ints([3, 4]), 1, GREEDY).result().sequences[0].tokens
    alice.create_rest_client().delete_checkpoint_from_tinker_path(path).result()
    assert sampler.sample(types.ModelInput.from_ints([3, 4]), 1, GREEDY).result().sequences[0].tokens == before
    with pytest.raises(tinker.NotFoundError, match="no such checkpoint"):
        alice.create_sampling_client(model_path=path).result()


# -- keys ------------------------------------------------------------------------------------------
def test_two_keys_see_only_their_own_until_published(service, alice):
    bob = _client(service, KEY_B)
    try:
        tc = alice.create_lora_training_client("tiny", rank=4).result()
        path = tc.save_weights_for_sampler("alices").result().path
        rest_a, rest_b = alice.create_rest_client(), bob.create_rest_client()
        assert tc.model_id in {r.training_run_id for r in rest_a.list_training_runs(limit=100).result().training_runs}
        assert tc.model_id not in {r.training_run_id for r in rest_b.list_training_runs(limit=100).result().training_runs}
        assert path not in {c.tinker_path for c in rest_b.list_user_checkpoints(limit=100).result().checkpoints}
        with pytest.raises(tinker.NotFoundError):
            rest_b.get_training_run(tc.model_id).result()
        with pytest.raises(tinker.NotFoundError):
            bob.create_sampling_client(model_path=path).result()
        with pytest.raises(tinker.NotFoundError):
            rest_b.publish_checkpoint_from_tinker_path(path).result()
        with _http(service, KEY_A) as a, _http(service, KEY_B) as b:  # nor can bob read alice's futures
            session = tc.model_id.split(":")[0]
            rid = a.post("/api/v1/create_sampling_session", json={
                "session_id": session, "sampling_session_seq_id": 90, "base_model": "tiny"}).status_code
            rid = a.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 90, "base_model": "tiny",
                                                       "lora_config": {"rank": 2}}).json()["request_id"]
            assert b.post("/api/v1/retrieve_future", json={"request_id": rid}).status_code == 404
            assert a.post("/api/v1/retrieve_future", json={"request_id": rid}).status_code == 200
        rest_a.publish_checkpoint_from_tinker_path(path).result()
        assert any(c.public for c in rest_a.list_checkpoints(tc.model_id).result().checkpoints)
        shared = bob.create_sampling_client(model_path=path).result()
        assert shared.sample(types.ModelInput.from_ints([3, 4]), 1, GREEDY).result().sequences
        with pytest.raises(tinker.NotFoundError):  # published is readable, not bob's to change
            rest_b.delete_checkpoint_from_tinker_path(path).result()
        rest_a.unpublish_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError):
            bob.create_sampling_client(model_path=path).result()
    finally:
        bob.close("success").result()


def test_sessions_are_listed_for_their_key(service, alice):
    tc = alice.create_lora_training_client("tiny", rank=4).result()
    rest = alice.create_rest_client()
    session_id = tc.model_id.split(":")[0]
    assert session_id in rest.list_sessions(limit=1000).result().sessions
    got = rest.get_session(session_id).result()
    assert tc.model_id in got.training_run_ids
    bob = tinker.RestClient(base_url=service.url, api_key=KEY_B)
    assert session_id not in bob.list_sessions(limit=1000).result().sessions
    with pytest.raises(tinker.NotFoundError):
        bob.get_session(session_id).result()


def test_the_key_covers_every_route_and_bounds_every_body(service):
    with httpx.Client(base_url=service.url, timeout=30) as http:
        for path in ("/api/v1/healthz", "/v1/models", "/docs", "/openapi.json"):
            r = http.get(path)
            assert r.status_code == 401 and r.json()["field"] == "x-api-key", path
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY_B}"}).status_code == 200
        assert http.get("/api/v1/healthz", headers={"X-API-Key": KEY_A}).status_code == 200
        r = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"},
                      content=b"{" + b" " * (BOUND + 1) + b"}")
        assert r.status_code == 413

        def chunked():
            for _ in range(BOUND // 1024 + 2):
                yield b" " * 1024
        r = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"}, content=chunked())
        assert r.status_code == 413


def test_the_service_refuses_a_key_the_sdk_would_not_send(tmp_path):
    with pytest.raises(ValueError, match="does not start with 'tml-'"):
        start_service("tiny", home=tmp_path, api_key="secret", device="cpu")
    (tmp_path / "keys").write_text("tml-ok one\nnot-tml two\n")
    env = {**os.environ, "K": "secret"}
    for args in (["--api-key-env", "K"], ["--api-keys-file", str(tmp_path / "keys")]):
        run = subprocess.run([sys.executable, "-m", "tinker_pipelines", "tinker", "serve", "--model", "tiny",
                              "--home", str(tmp_path / "h"), *args], capture_output=True, text=True, env=env,
                             timeout=120)
        assert run.returncode != 0
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "tml-" in lines[0], run.stderr


def test_the_tinker_cli_lists_and_deletes_this_services_checkpoints(service, alice):
    tc = alice.create_lora_training_client("tiny", rank=4).result()
    path = tc.save_state("for-the-cli").result().path
    env = {**os.environ, "TINKER_BASE_URL": service.url, "TINKER_API_KEY": KEY_A, "TINKER_TELEMETRY": "0"}
    cli = [sys.executable, "-m", "tinker.cli"]
    run = subprocess.run([*cli, "--format", "json", "checkpoint", "list", "--run-id", tc.model_id],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert path in run.stdout
    run = subprocess.run([*cli, "checkpoint", "delete", path, "--yes"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert path not in {c.tinker_path for c in alice.create_rest_client().list_checkpoints(tc.model_id).result()
                        .checkpoints}
    run = subprocess.run([*cli, "--format", "json", "checkpoint", "list"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0 and path not in run.stdout, run.stderr
    json.loads(run.stdout)


def test_samplers_of_different_checkpoints_decode_together(service, alice):
    """Each checkpoint's adapter has a connection of its own: the service sends one sample call per
    connection at a time, so on one shared connection concurrent samples of several checkpoints
    went to the worker one after another; on their own they reach it together (one mixed decode)."""
    runtime = service.service.runtime
    tc = alice.create_lora_training_client("tiny", rank=4).result()
    paths = [tc.save_weights_for_sampler(f"ck{i}").result().path for i in range(4)]
    samplers = [alice.create_sampling_client(model_path=p).result() for p in paths]
    adapters = [service.service.samplers[s._sampling_session_id].adapter for s in samplers]
    conns = {id(runtime.connection(a)) for a in adapters}
    assert len(conns) == 4 and id(runtime.shared) not in conns
    prompt, params = types.ModelInput.from_ints([3, 4, 5]), types.SamplingParams(max_tokens=8, temperature=1.0)

    async def together():
        return await asyncio.gather(*(s.sample_async(prompt, 2, params) for s in samplers))
    assert all(len(r.sequences) == 2 for r in asyncio.run(together()))
    alice.create_rest_client().delete_checkpoint_from_tinker_path(paths[0]).result()


def test_unseeded_samples_of_unchanged_weights_differ_between_snapshots(alice):
    """Each snapshot draws its own sampling generator from its source's: two snapshots of the same
    weights do not repeat each other's unseeded samples (they did: every copy started from seed 0)."""
    tc = alice.create_lora_training_client("tiny", rank=4).result()
    prompt, params = types.ModelInput.from_ints([3, 4, 5]), types.SamplingParams(max_tokens=16, temperature=1.0)

    def tokens(sampler):
        return [s.tokens for s in sampler.sample(prompt, 4, params).result().sequences]
    first, second = (tc.save_weights_and_get_sampling_client().result() for _ in range(2))
    assert tokens(first) != tokens(second)
