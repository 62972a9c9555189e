"""The OpenAI endpoint `/v1` of a Tinker service over two bases: every base is served, each from its
own worker, routed by the request's `model`.

Two real worker processes (the catalogue's tiny, and a tiny of other weights written as a model
directory), the real service on loopback with its MLflow tracking (sqlite, in a TINKER_HOME of its
own), the real `openai` client and the pinned `tinker` SDK. A version's base comes from its
`tinker.base` tag in that registry.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import openai
import pytest

import tinker
from tinker import types

from test_tinker_liveness import ADAM, DATA  # a short SFT pair on tiny's vocabulary
from tinker_pipelines.models import load_tokenizer, render_chat
from tinker_pipelines.serving.tinker.launch import start_service
from tinker_pipelines.serving.tinker.lineage import TinkerTracker, registered_name

pytestmark = pytest.mark.e2e  # worker processes and an HTTP service

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    from tinker_pipelines.models.hf_dir import write_model_dir

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    root = tmp_path_factory.mktemp("bases")
    other, _ = write_model_dir("tiny", root / "tiny-b", seed=1)
    was = os.environ.get("TINKER_HOME")
    os.environ["TINKER_HOME"] = str(root / "tinker-home")  # where the tracker registers and /v1 looks
    try:
        handle = start_service(["tiny", str(other)], home=root / "home", dtype="float32", gap_timeout_s=5.0,
                               worker_args=["--threads", "1"], tracker=TinkerTracker.from_env())
        yield handle, str(other)
        handle.stop()
    finally:
        if was is None:
            os.environ.pop("TINKER_HOME", None)
        else:
            os.environ["TINKER_HOME"] = was


def _openai(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.openai_url, api_key="unused", max_retries=0)


def _batches(handle) -> dict[str, int]:
    import httpx

    return {b: h["batches"] for b, h in httpx.get(f"{handle.url}/health").json()["bases"].items()}


def test_models_lists_every_base_and_an_unknown_model_is_a_404_naming_them(two):
    handle, other = two
    client = _openai(handle)
    assert [m.id for m in client.models.list().data] == ["tiny", other]
    assert client.models.retrieve(Path(other).name).id == other  # the directory's name is an alias of B
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "'tiny'" in e.value.message and repr(other) in e.value.message


def test_chat_on_the_second_base_answers_from_its_worker_as_the_tinker_sampler_does(two):
    """B's reply is its worker's (only B's backend ran a batch) and equals, token for token and
    logprob for logprob, the greedy sample of base B through the Tinker SDK; A's differs."""
    handle, other = two
    client = _openai(handle)
    before = _batches(handle)
    got = client.chat.completions.create(model=other, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True)
    after = _batches(handle)
    assert after[other] == before[other] + 1 and after["tiny"] == before["tiny"]
    assert got.model == other

    tok = load_tokenizer(other)
    prompt = tok.encode(render_chat(tok, MESSAGES), add_special_tokens=False)
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    with tinker.ServiceClient(base_url=handle.url, api_key="tml-unused") as sc:
        seq = sc.create_sampling_client(base_model=other).result().sample(
            types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    lp = [c.logprob for c in got.choices[0].logprobs.content]
    assert [c.token for c in got.choices[0].logprobs.content] == [tok.decode([t]) for t in seq.tokens]
    assert max(abs(a - b) for a, b in zip(lp, seq.logprobs)) < 1e-4

    on_a = client.chat.completions.create(model="base", messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True)
    assert _batches(handle)["tiny"] == after["tiny"] + 1  # `base` is the first base, as with one base
    assert max(abs(a.logprob - b) for a, b in zip(on_a.choices[0].logprobs.content, lp)) > 1e-3


def test_a_version_goes_to_the_base_its_tinker_base_tag_names(two, tmp_path):
    """Through a real MLflow registry: a version tagged with B's identity routes to B's server, an
    untagged one to the default (whose fetch then names the base it needs), an unknown one is a
    404 naming both bases."""
    from tinker_pipelines.serving.errors import ServingError
    from tinker_pipelines.serving.registry import TINKER_BASE_TAG, Registry
    from tinker_pipelines.tracking import Tracker

    handle, other = two
    servers = handle._uvicorn.config.app.state.servers
    a, b = servers.all
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "bases", str(tmp_path / "artifacts"))
    run_id = tracker.client.create_run(tracker.experiment_id).info.run_id
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "record.json").write_text("{}")
    tracker.register_adapter(run_id, "on-b", tmp_path / "ckpt", "b", {TINKER_BASE_TAG: b.base_identity})
    tracker.register_adapter(run_id, "untagged", tmp_path / "ckpt", "u", {})
    theirs, a.registry = a.registry, Registry(tracker, None)
    try:
        assert asyncio.run(servers.route("on-b/1")) is b and asyncio.run(servers.route("on-b")) is b
        assert asyncio.run(servers.route("untagged/1")) is a
        with pytest.raises(ServingError) as e:
            asyncio.run(servers.route("nothing/1"))
    finally:
        a.registry = theirs
    assert e.value.status == 404 and "'tiny'" in e.value.message and repr(other) in e.value.message


def test_a_checkpoint_trained_on_the_second_base_is_served_by_v1_on_it(two):
    """A LoRA client of base B trained one step through the SDK and saved: its registered version
    (tagged with B's identity) answers on B's server, with the logprobs of the SDK's sampler of
    that checkpoint, not B's base's."""
    handle, other = two
    tok = load_tokenizer(other)
    prompt = tok.encode(render_chat(tok, MESSAGES), add_special_tokens=False)
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    with tinker.ServiceClient(base_url=handle.url, api_key="tml-unused") as sc:
        tc = sc.create_lora_training_client(other, rank=4, seed=2).result()
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        path = tc.save_weights_for_sampler("one-step").result().path
        seq = sc.create_sampling_client(model_path=path).result().sample(
            types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    client = _openai(handle)
    before = _batches(handle)
    got = client.chat.completions.create(model=registered_name(tc.model_id), messages=MESSAGES, max_tokens=6,
                                         temperature=0, logprobs=True)
    after = _batches(handle)
    assert after[other] == before[other] + 1 and after["tiny"] == before["tiny"]
    lp = [c.logprob for c in got.choices[0].logprobs.content]
    assert [c.token for c in got.choices[0].logprobs.content] == [tok.decode([t]) for t in seq.tokens]
    assert max(abs(a - b) for a, b in zip(lp, seq.logprobs)) < 1e-4
    base = client.chat.completions.create(model=other, messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True)
    assert max(abs(a.logprob - b) for a, b in zip(base.choices[0].logprobs.content, lp)) > 1e-3


def test_after_the_second_base_worker_restarts_v1_answers_on_it_again(two):
    """Each base's backend is reconnected by its own worker's supervisor: B's reply after its
    worker was killed and replaced is the one before; A's worker was never touched."""
    import signal
    import time

    handle, other = two
    client = _openai(handle)

    def reply(model: str) -> str:
        out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0,
                                             logprobs=True)
        return str([(c.token, round(c.logprob, 4)) for c in out.choices[0].logprobs.content])

    before, on_a = reply(other), reply("tiny")
    victim = handle.workers[1]
    assert victim.base == other
    a_pid, old_pid = handle.workers[0].supervisor.proc.pid, victim.supervisor.proc.pid
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while victim.supervisor.generation == 0 or victim.runtime.health() is not None:
        assert time.monotonic() < deadline, "the killed worker was not restarted"
        time.sleep(0.5)
    assert victim.supervisor.proc.pid != old_pid
    while True:  # the listeners run just after the new worker answers
        try:
            after = reply(other)
            break
        except openai.APIStatusError:
            assert time.monotonic() < deadline, "B's /v1 never answered again after its worker restarted"
            time.sleep(0.5)
    assert after == before and reply("tiny") == on_a
    assert handle.workers[0].supervisor.proc.pid == a_pid and handle.workers[0].supervisor.generation == 0
