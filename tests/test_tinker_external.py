"""Weights out of the Tinker service: `save_weights_external` and `get_external_weights_urls`
through the pinned SDK, the files fetched with plain urllib (no key: the URLs are signed) and
loaded with `PeftModel.from_pretrained` on the tiny base built in this process.

One service (tiny base, fp32, CPU worker) with two keys, TTLs from 1 s.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import tinker
from tinker import types

from tinker_pipelines.serving.tinker.app import TinkerSettings
from tinker_pipelines.serving.tinker.external import KEY_FILE, External
from tinker_pipelines.serving.tinker.guard import SIGNED_PREFIX
from tinker_pipelines.serving.tinker.launch import start_service
from tinker_pipelines.serving.tinker.tenancy import Keys

pytestmark = pytest.mark.e2e  # a worker process and an HTTP service

KEY_A, KEY_B = "tml-alice-key", "tml-bob-key"
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors"}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    home = tmp_path_factory.mktemp("external")
    keys = home / "keys"
    keys.write_text(f"{KEY_A} alice\n{KEY_B} bob\n")
    handle = start_service("tiny", home=home / "service", device="cpu", dtype="float32", gap_timeout_s=30.0,
                           settings=TinkerSettings(keys=Keys.from_file(keys)),
                           worker_args=["--threads", str(torch.get_num_threads())], min_ttl_s=1)
    yield handle
    handle.stop()


@pytest.fixture
def alice(service):
    sc = tinker.ServiceClient(base_url=service.url, api_key=KEY_A)
    yield sc
    sc.close("success").result()


@pytest.fixture
def bob(service):
    sc = tinker.ServiceClient(base_url=service.url, api_key=KEY_B)
    yield sc
    sc.close("success").result()


def _rest(service, key: str = KEY_A) -> tinker.RestClient:
    return tinker.RestClient(base_url=service.url, api_key=key)


def _sft(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
        "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, np.float32))})


DATA = [_sft([5, 9, 13, 21, 34, 55, 89]), _sft([7, 8, 9, 10, 11])]
ADAM = types.AdamParams(learning_rate=5e-2)


def _trained(client: tinker.ServiceClient, steps: int = 2, **lora):
    tc = client.create_lora_training_client("tiny", rank=4, seed=5, **lora).result()
    for _ in range(steps):
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(ADAM).result()
    return tc


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _download(urls: dict[str, str], out: Path) -> Path:
    out.mkdir(parents=True)
    for rel, url in urls.items():
        status, body = _get(url)
        assert status == 200, (rel, status, body[:300])
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(body)
    return out


def _peft_logprobs(adapter_dir: Path) -> list[torch.Tensor]:
    """Each datum's target logprobs from the downloaded adapter on the tiny base built here."""
    from peft import PeftModel

    from tinker_pipelines.models import load_model

    base, _ = load_model("tiny", seed=0, dtype="float32", device="cpu")
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    out = []
    with torch.no_grad():
        for d in DATA:
            ids_T = torch.tensor(d.model_input.to_ints())
            targets_T = d.loss_fn_inputs["target_tokens"].to_torch().long()
            logits_TV = model(input_ids=ids_T[None]).logits[0].float()
            out.append(torch.log_softmax(logits_TV, -1).gather(-1, targets_T[:, None])[:, 0])
    return out


def test_exported_adapter_loads_with_peft_and_gives_the_services_logprobs(service, alice, tmp_path):
    tc = _trained(alice)  # train_unembed (the SDK's default): LoRA on lm_head too
    saved = tc.save_weights_external("ext1").result()
    assert saved.path == f"tinker://{tc.model_id}/external_weights/ext1"
    got = _rest(service).get_external_weights_urls(saved.path).result()
    assert set(got.urls) == PEFT_FILES
    assert all(u.startswith(service.url + SIGNED_PREFIX) for u in got.urls.values())  # the host the client used
    assert 3000 < got.expires.timestamp() - time.time() <= 3600
    d = _download(got.urls, tmp_path / "ext1")
    assert json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
    want = [o["logprobs"].to_torch() for o in tc.forward(DATA, "cross_entropy").result().loss_fn_outputs]
    peft = _peft_logprobs(d)
    base = [o["logprobs"].to_torch() for o in alice.create_lora_training_client("tiny", rank=4, seed=5).result()
            .forward(DATA, "cross_entropy").result().loss_fn_outputs]
    for w, p, b in zip(want, peft, base):
        assert float((w - p).abs().max()) < 1e-4
        assert float((w - b).abs().max()) > 1e-2  # trained away from the untrained adapter: the test can fail
    # the service hosts the export as any checkpoint: sampling it is sampling the client
    prompt, params = types.ModelInput.from_ints([5, 9, 13]), types.SamplingParams(max_tokens=4, seed=3)
    from_export = alice.create_sampling_client(model_path=saved.path).result().sample(prompt, 1, params).result()
    live = tc.save_weights_and_get_sampling_client().result().sample(prompt, 1, params).result()
    assert from_export.sequences[0].tokens == live.sequences[0].tokens
    listed = {c.checkpoint_id: c for c in _rest(service).list_checkpoints(tc.model_id).result().checkpoints}
    assert listed["external_weights/ext1"].checkpoint_type == "external"
    assert listed["external_weights/ext1"].size_bytes > (d / "adapter_model.safetensors").stat().st_size


def test_the_export_is_of_the_calls_before_it_in_seq_id_order(service, alice, tmp_path):
    tc = _trained(alice, steps=1, train_unembed=False)
    first = tc.save_weights_external("before")  # not waited on: the optim_step after it must not leak in
    tc.forward_backward(DATA, "cross_entropy")
    tc.optim_step(ADAM).result()
    rest = _rest(service)
    before = _peft_logprobs(_download(rest.get_external_weights_urls(first.result().path).result().urls,
                                      tmp_path / "before"))
    after = _peft_logprobs(_download(rest.get_external_weights_urls(tc.save_weights_external("after").result().path)
                                     .result().urls, tmp_path / "after"))
    now = [o["logprobs"].to_torch() for o in tc.forward(DATA, "cross_entropy").result().loss_fn_outputs]
    assert all(float((n - a).abs().max()) < 1e-4 for n, a in zip(now, after))
    assert all(float((n - b).abs().max()) > 1e-3 for n, b in zip(now, before))
    with pytest.raises(tinker.RequestFailedError, match="exists"):
        tc.save_weights_external("after").result()
    with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
        tc.save_weights_external("enc", age_encryption_recipients=["age1xyz"]).result()
    with pytest.raises(tinker.BadRequestError, match="not a checkpoint name"):
        tc.save_weights_external("a/b").result()
    assert tc.forward(DATA, "cross_entropy").result()  # the refused calls used up their seq_ids


def _with(url: str, **changes: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    file = changes.pop("file", None)
    path = parts.path if file is None else parts.path.rsplit("/", 1)[0] + "/" + file
    return urllib.parse.urlunsplit(parts._replace(path=path, query=urllib.parse.urlencode({**query, **changes})))


def test_changed_expired_or_traversing_urls_are_refused(service, alice):
    tc = _trained(alice, steps=1, train_unembed=False)
    path = tc.save_weights_external("guarded").result().path
    urls = _rest(service).get_external_weights_urls(path).result().urls
    url = urls["adapter_model.safetensors"]
    q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
    sig = q["signature"]
    for bad in (_with(url, signature=sig[:-1] + ("0" if sig[-1] != "0" else "1")),
                _with(url, expires=str(int(q["expires"]) + 3600)),  # a later expiry, same signature
                _with(url, scope="public"),
                _with(url, file="adapter_config.json"),  # another file, this one's signature
                _with(url, signature="")):
        status, body = _get(bad)
        assert status == 403 and json.loads(body)["field"] == "signature", (bad, status, body)
    # signed by this service's own key, so only the expiry or the path can refuse them
    ext = External(Path(service.service.home))
    model_id, name = tc.model_id, "guarded"
    meta = json.loads((Path(service.service.home) / "runs" / f"{model_id}.json").read_text())
    version = q["v"]
    assert ext.signature(model_id, name, "adapter_model.safetensors", int(q["expires"]), "owner", version) == sig
    root = service.url + SIGNED_PREFIX
    expired = root + ext.url_path(model_id, name, "adapter_model.safetensors", int(time.time()) - 5, "owner", version)
    status, body = _get(expired)
    assert status == 410 and json.loads(body)["field"] == "expires"
    later = int(time.time()) + 600
    for rel in ("record.json", "../weights", "../../../runs/" + model_id + ".json", "../../../../" + KEY_FILE):
        status, body = _get(root + ext.url_path(model_id, name, rel, later, "owner", version))
        assert status == 404 and json.loads(body)["field"] == "file", (rel, status, body)
    assert meta["checkpoints"]["external_weights/guarded"]["checkpoint_type"] == "external"
    assert oct((Path(service.service.home) / KEY_FILE).stat().st_mode & 0o777) == "0o600"
    # the URLs route asks for a key; the download does not (checked above: urllib sent none)
    assert _get(f"{service.url}/api/v1/training_runs/{model_id}/checkpoints/external_weights/guarded/"
                "external_weights_urls")[0] == 401


def test_other_keys_get_urls_only_while_published_and_deletes_and_ttls_end_them(service, alice, bob, tmp_path):
    tc = _trained(alice, steps=1, train_unembed=False)
    path = tc.save_weights_external("shared").result().path
    a_rest, b_rest = _rest(service), _rest(service, KEY_B)
    with pytest.raises(tinker.NotFoundError, match="no such checkpoint"):
        b_rest.get_external_weights_urls(path).result()
    a_rest.publish_checkpoint_from_tinker_path(path).result()
    b_urls = b_rest.get_external_weights_urls(path).result().urls
    assert set(b_urls) == PEFT_FILES
    _download(b_urls, tmp_path / "bob")
    a_urls = a_rest.get_external_weights_urls(path).result().urls
    a_rest.unpublish_checkpoint_from_tinker_path(path).result()
    status, body = _get(b_urls["adapter_config.json"])  # issued through publication, which is withdrawn
    assert status == 403 and "no longer published" in json.loads(body)["detail"]
    assert _get(a_urls["adapter_config.json"])[0] == 200  # the owner's still work
    with pytest.raises(tinker.NotFoundError):
        b_rest.get_external_weights_urls(path).result()
    # the SDK refuses another kind before sending; the service does too
    r = httpx.get(f"{service.url}/api/v1/training_runs/{tc.model_id}/checkpoints/weights/x/external_weights_urls",
                  headers={"X-API-Key": KEY_A}, timeout=60)
    assert r.status_code == 400 and r.json()["field"] == "checkpoint_id"
    assert "not an external weights checkpoint" in r.json()["detail"]
    # a delete removes the files and ends every URL
    a_rest.delete_checkpoint_from_tinker_path(path).result()
    d = Path(service.service.home) / "checkpoints" / tc.model_id / "external_weights" / "shared"
    assert not d.exists()
    assert _get(a_urls["adapter_model.safetensors"])[0] == 404
    assert "external_weights/shared" not in {c.checkpoint_id for c in a_rest.list_checkpoints(tc.model_id).result()
                                             .checkpoints}
    # a TTL bounds the URLs' expiry, and its passing deletes the export
    short = tc.save_weights_external("short", ttl_seconds=2).result().path
    got = a_rest.get_external_weights_urls(short).result()
    assert got.expires.timestamp() - time.time() <= 2.5
    d = d.parent / "short"
    deadline = time.monotonic() + 30
    while d.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not d.exists()
    assert _get(got.urls["adapter_config.json"])[0] in (404, 410)


def test_the_signing_key_is_made_once_and_a_start_clears_cut_short_saves(tmp_path):
    exports = tmp_path / "checkpoints" / "s1:train:0" / "external_weights"
    (exports / "kept").mkdir(parents=True)
    (exports / ".kept.src-0a1b").mkdir()  # a save killed between the worker's write and the export
    (exports / ".late.x1y2z3").mkdir()  # an export killed before its rename
    first = External.open(tmp_path)
    assert sorted(p.name for p in exports.iterdir()) == ["kept"]
    assert oct((tmp_path / KEY_FILE).stat().st_mode & 0o777) == "0o600"
    again = External(tmp_path)  # a restart: the same key, so URLs issued before it still verify
    assert again.signature("m", "n", "f", 1, "owner", "v") == first.signature("m", "n", "f", 1, "owner", "v")
    assert External(tmp_path / "other").signature("m", "n", "f", 1, "owner", "v") != first.signature(
        "m", "n", "f", 1, "owner", "v")
    (tmp_path / KEY_FILE).write_text("abcd\n")
    with pytest.raises(ValueError, match="at least 64 hex digits"):
        External(tmp_path)
