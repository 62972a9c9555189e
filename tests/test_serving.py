"""The OpenAI-compatible endpoint on a real uvicorn server on 127.0.0.1, with the `openai` client
unchanged, over a real MLflow registry whose versions were registered by the `sft` and `rl` jobs:
base and adapters addressed as MODEL@ALIAS / MODEL/VERSION, streaming on the wire exactly,
episodes and `evaluate` against the endpoint equal to in-process, LRU eviction, the bad inputs
(unknown model, malformed JSON, context overflow, max_tokens, a client gone mid-stream, corrupt
files), the CLI's one-line errors, and the Dagster `serve` job."""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import dagster as dg
import openai
import pytest
import torch
from dagster_env import NO_SFT, tracker

from tinker_pipelines.config import config_from_dict
from tinker_pipelines.loops.experiment import Experiment
from tinker_pipelines.loops.inference import experiment_from_checkpoint
from tinker_pipelines.rollout.episodes import RolloutConfig, run_episodes
from tinker_pipelines.serving.client import EndpointSampler, evaluate_endpoint
from tinker_pipelines.serving.launch import ServerThread, build_server, serving_env
from tinker_pipelines.serving.registry import Registry
from tinker_pipelines.tracking import registered_model_name
from tinker_pipelines.tracking.mlflow_tracker import EXPERIMENT_TAG, checks_tags

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)

EXP = "serve"
MODEL = registered_model_name(EXP)
CFG = {**NO_SFT, "model": {"name": "tiny", "kwargs": {"num_layers": 2}, "dtype": "float32"}, "eval": {"every": 1, "num_tasks": 8}}
Q = [{"role": "user", "content": "What is 2 + 3?"}]


def _store():
    from assets.definitions import defs

    return defs.resources["artifact_store"].store()


@pytest.fixture(scope="module")
def instance():
    """Versions 1 and 2 of `tinker-serve` (alias champion -> 2), registered as the `rl` asset does
    (`Tracker.register_adapter` with its tags). Their adapters are the experiment's LoRA with B
    drawn at random instead of trained (training the tiny model until it answers costs minutes
    here): real checkpoints written by `Experiment.save`, so each version decodes differently."""
    exp = Experiment(config_from_dict(CFG))
    exp.start_rl()
    t = tracker()
    run_id = t.experiment_run(EXP)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(2):
            with torch.no_grad():
                for name, p in exp.learner.model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            record = exp.save(Path(tmp) / f"iter_{k}")
            t.register_adapter(run_id, MODEL, Path(tmp) / f"iter_{k}", f"adapters/iter_{k:05d}", tags={
                "partition": f"{EXP}:{k}", "content_hash": record["content_hash"], EXPERIMENT_TAG: EXP,
                "iteration": str(k), **checks_tags([])})
    t.set_alias(MODEL, "champion", "2")
    yield


@pytest.fixture(scope="module")
def endpoint(instance):
    """The endpoint over the base `champion` was trained on (inferred from the version), 2 adapter slots."""
    server = build_server(ref=f"{MODEL}@champion", registry=Registry(tracker(), _store(), alias_ttl_s=0),
                          max_adapters=2, device="cpu", dtype="float32", stream_tokens=3)
    thread = ServerThread(server)
    yield server, thread.url
    thread.stop()


@pytest.fixture(scope="module")
def client(endpoint):
    return openai.OpenAI(base_url=endpoint[1], api_key="unused", max_retries=0)


def _in_process(version: str):
    with tempfile.TemporaryDirectory() as tmp:
        return experiment_from_checkpoint(tracker().download_version(MODEL, version, tmp))


def _post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_base_and_adapters_through_the_openai_client(endpoint, client):
    server, url = endpoint
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == server.base_name == "tiny" and server.base_identity == "tiny(num_layers=2,seed=3)"
    base = client.chat.completions.create(model=server.base_name, messages=Q, max_tokens=6, temperature=0)
    champ = client.chat.completions.create(model=f"{MODEL}@champion", messages=Q, max_tokens=6, temperature=0)
    v2 = client.chat.completions.create(model=f"{MODEL}/2", messages=Q, max_tokens=6, temperature=0)
    assert champ.choices[0].message.content == v2.choices[0].message.content  # the alias is version 2
    assert champ.model == f"{MODEL}@champion" and champ.object == "chat.completion"
    # the adapter changes what the base says: the tokens come from the version, not the base
    exp = _in_process("2")
    prompt = exp.tokenizer.encode(exp.tokenizer.apply_chat_template(Q, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
    (s,) = exp.sampler().sample([prompt], 6, 0.0)
    assert champ.usage.prompt_tokens == len(prompt) and champ.usage.completion_tokens == len(s.tokens)
    assert champ.choices[0].message.content == exp.tokenizer.decode(
        [t for t in s.tokens if t not in server.stop_ids], skip_special_tokens=True)
    assert f"{MODEL}/2" in [m.id for m in client.models.list().data]
    text = client.completions.create(model=f"{MODEL}/1", prompt=["1 + 1 =", "2 + 2 ="], max_tokens=3, temperature=0)
    assert [c.index for c in text.choices] == [0, 1] and text.usage.completion_tokens <= 6
    assert base.choices[0].message is not None


def _sse(url: str, body: dict) -> list[str]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    raw = r.read().decode()
    conn.close()
    return raw.split("\n\n")


def test_streaming_follows_the_wire_format_exactly(endpoint, client):
    _, url = endpoint
    req = {"model": f"{MODEL}@champion", "messages": Q, "max_tokens": 7, "temperature": 0}
    whole = client.chat.completions.create(**req)
    events = _sse(url, {**req, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": whole.usage.prompt_tokens, "completion_tokens": whole.usage.completion_tokens,
        "total_tokens": whole.usage.total_tokens}
    assert all(c["usage"] is None for c in chunks[:-1])  # usage: null until the last chunk
    finish = chunks[-2]["choices"][-1]
    assert finish == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": whole.choices[0].finish_reason}
    text = "".join(ch["delta"].get("content", "") for c in chunks[1:-1] for ch in c["choices"])
    assert text == whole.choices[0].message.content
    # without include_usage there is no usage chunk and no usage field; the openai client reads it all
    plain = [json.loads(e.removeprefix("data: ")) for e in _sse(url, {**req, "stream": True})[:-2]]
    assert all("usage" not in c and c["choices"] for c in plain)
    parts = list(client.chat.completions.create(**req, stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == text
    assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sampler_fields_pass_through(endpoint, client):
    """stop (also across streamed segments), top_k and top_p reach the sampler."""
    req = {"model": f"{MODEL}/1", "messages": Q, "max_tokens": 10, "temperature": 0}
    full = client.chat.completions.create(**req).choices[0].message.content
    assert len(full) >= 6
    stop = full[4:6]
    cut = client.chat.completions.create(**req, stop=[stop]).choices[0]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"
    parts = client.chat.completions.create(**req, stop=stop, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == cut.message.content
    # top_k=1 is greedy whatever the temperature
    greedy = client.chat.completions.create(**{**req, "temperature": 1.5}, seed=3, extra_body={"top_k": 1})
    assert greedy.choices[0].message.content == full
    a, b = (client.chat.completions.create(**{**req, "temperature": 1.0}, seed=5, top_p=0.9).choices[0].message.content
            for _ in range(2))
    assert a == b  # a seed makes a sampled reply repeat


def test_an_episode_and_evaluate_against_the_endpoint_equal_in_process(endpoint):
    _, url = endpoint
    exp = _in_process("2")
    expected = exp.evaluate(8)
    got = evaluate_endpoint(url, f"{MODEL}@champion", 8)
    assert got == {k: v for k, v in expected.items() if k.startswith("eval/")}
    # the rollout code of training, token for token, with a multi-turn-capable sampler over HTTP
    seeds = [10_000 + i for i in range(4)]
    cfg = RolloutConfig(4, 0.0, 1)
    remote = run_episodes(EndpointSampler(url, f"{MODEL}/2"), exp.tokenizer, [exp.eval_spec.build() for _ in seeds],
                          seeds, cfg)
    local = run_episodes(exp.sampler(), exp.tokenizer, [exp.eval_spec.build() for _ in seeds], seeds, cfg)
    assert [t.turns[0].sampled_tokens for t in remote] == [t.turns[0].sampled_tokens for t in local]
    for r, l in zip(remote, local):
        assert max(abs(a - b) for a, b in zip(r.turns[0].sampled_logprobs, l.turns[0].sampled_logprobs)) < 1e-4


def test_concurrent_adapters_share_batches_and_match_alone(endpoint, client):
    server, _ = endpoint
    models = [server.base_name, f"{MODEL}/1", f"{MODEL}/2"] * 3
    alone = {m: client.completions.create(model=m, prompt="3 + 4 =", max_tokens=5, temperature=0).choices[0].text
             for m in set(models)}
    batches = server.backend.batches
    out: dict[int, str] = {}

    def ask(i: int, m: str) -> None:
        out[i] = client.completions.create(model=m, prompt="3 + 4 =", max_tokens=5, temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i, m)) for i, m in enumerate(models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(models))] == [alone[m] for m in models]
    assert server.backend.batches - batches < len(models)  # some requests of different adapters shared a batch
    assert len(set(alone.values())) > 1  # the adapters differ, so the equality means each row kept its own


def test_adapters_load_on_first_use_and_the_least_recently_used_is_evicted(instance):
    server = build_server(ref=f"{MODEL}/1", registry=Registry(tracker(), _store()), max_adapters=1, device="cpu",
                          dtype="float32")
    thread = ServerThread(server)
    try:
        c = openai.OpenAI(base_url=thread.url, api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == [server.base_name]  # nothing loaded before a request
        first = c.completions.create(model=f"{MODEL}/1", prompt="1 + 2 =", max_tokens=4, temperature=0).choices[0].text
        c.completions.create(model=f"{MODEL}/2", prompt="1 + 2 =", max_tokens=4, temperature=0)
        assert [m.id for m in c.models.list().data] == [server.base_name, f"{MODEL}/2"]
        again = c.completions.create(model=f"{MODEL}/1", prompt="1 + 2 =", max_tokens=4, temperature=0).choices[0].text
        assert again == first and [m.id for m in c.models.list().data][1:] == [f"{MODEL}/1"]
    finally:
        thread.stop()


@pytest.mark.parametrize("model, message", [
    (f"{MODEL}@nope", f"The model `{MODEL}@nope` does not exist: registered model '{MODEL}' has no alias 'nope'"),
    (f"{MODEL}/99", f"The model `{MODEL}/99` does not exist: registered model '{MODEL}' has no version 99"),
    ("tinker-nothing@champion", "The model `tinker-nothing@champion` does not exist: registered model "
                                "'tinker-nothing' does not exist or has no versions"),
])
def test_unknown_model_is_a_404_naming_it(client, model, message):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model=model, messages=Q)
    assert e.value.status_code == 404 and e.value.body["message"] == message and e.value.code == "model_not_found"


def test_bad_requests_are_openai_errors_naming_the_field(endpoint, client):
    server, url = endpoint
    status, body = _post(url, "/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400 and body["error"]["code"] == "invalid_json" and "could not parse the JSON" in body["error"]["message"]
    long = "1 + 1 = " * 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.base_name, prompt=long, max_tokens=8)
    assert e.value.code == "context_length_exceeded" and f"maximum context length is {server.max_context}" in str(e.value)
    for bad in (0, -3, server.max_context + 1, "8"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.base_name, messages=Q, max_tokens=bad)
        assert e.value.param == "max_tokens", bad
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.base_name, messages=Q, temperature=3)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.base_name, messages=Q, frequency_penalty=0.5)
    assert e.value.param == "frequency_penalty"
    status, body = _post(url, "/chat/completions", json.dumps({"model": server.base_name, "messages": Q,
                                                                "best_answer": 1}).encode())
    assert status == 400 and body["error"]["param"] == "best_answer"
    status, body = _post(url, "/completions", json.dumps({"model": server.base_name, "prompt": [[5, 10**7]]}).encode())
    assert status == 400 and "outside the vocabulary" in body["error"]["message"]
    for field, value in (("top_logprobs", 5), ("logprobs", "yes"), ("top_p", 0), ("min_p", 1), ("seed", 2**70)):
        status, body = _post(url, "/chat/completions", json.dumps({"model": server.base_name, "messages": Q,
                                                                    field: value}).encode())
        assert status == 400 and body["error"]["param"] == field, (field, body)


def test_logprobs_and_top_logprobs_in_openai_shape(endpoint, client):
    """Chat `logprobs: true, top_logprobs: k` and completions `logprobs: k`: each token's logprob
    and its k most likely alternatives, those of the in-process sampler for the same version, under
    the distribution the token was drawn from (a truncated one: the alternatives it dropped have
    no mass, -9999.0 as vLLM writes -inf)."""
    server, url = endpoint
    exp = _in_process("2")
    prompt = exp.tokenizer.encode(exp.tokenizer.apply_chat_template(Q, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
    (want,) = exp.sampler().sample([prompt], 5, 0.0, top_logprobs=3)
    got = client.chat.completions.create(model=f"{MODEL}/2", messages=Q, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.tokens) == got.usage.completion_tokens
    for entry, t, lp, alts in zip(content, want.tokens, want.logprobs, want.top_logprobs):
        assert entry.token == exp.tokenizer.decode([t]) and entry.logprob == pytest.approx(lp, abs=1e-4)
        assert [a.token for a in entry.top_logprobs] == [exp.tokenizer.decode([a]) for a, _ in alts]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx([v for _, v in alts], abs=1e-4)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the sampled token is the most likely
    text = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert got.choices[0].message.content and text.startswith(got.choices[0].message.content)
    # sampled at T=0.7 from the top 2: both alternatives hold all the mass, the third none
    trunc = client.chat.completions.create(model=f"{MODEL}/2", messages=Q, max_tokens=4, temperature=0.7, seed=3,
                                           logprobs=True, top_logprobs=3, extra_body={"top_k": 2})
    for entry in trunc.choices[0].logprobs.content:
        a, b, c = (x.logprob for x in entry.top_logprobs)
        assert math.log(math.exp(a) + math.exp(b)) == pytest.approx(0.0, abs=1e-5) and c == -9999.0
        assert entry.logprob in (a, b)
    # legacy completions: a map per token (the sampled token always in it) and text offsets
    text = client.completions.create(model=f"{MODEL}/2", prompt="1 + 1 =", max_tokens=4, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    for tok, x, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(alts) <= 3 and alts[tok] == x
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    no_top = client.completions.create(model=f"{MODEL}/2", prompt="1 + 1 =", max_tokens=4, temperature=0, logprobs=0)
    assert no_top.choices[0].logprobs.top_logprobs is None
    assert no_top.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_streamed_logprobs_are_those_of_the_whole_reply(endpoint, client):
    """Each chunk carries the logprobs of the tokens decoded since the previous one (held-back
    text included later): joined, they are the non-streamed reply's, also with tool calls off."""
    req = {"model": f"{MODEL}/2", "messages": Q, "max_tokens": 7, "temperature": 0, "logprobs": True,
           "top_logprobs": 2}
    whole = client.chat.completions.create(**req).choices[0].logprobs.content
    parts = [e for c in client.chat.completions.create(**req, stream=True) for ch in c.choices
             if ch.logprobs is not None for e in ch.logprobs.content]
    assert [e.token for e in parts] == [e.token for e in whole] and len(whole) == 7
    assert [e.logprob for e in parts] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    assert [[a.token for a in e.top_logprobs] for e in parts] == [[a.token for a in e.top_logprobs] for e in whole]
    text = {"model": f"{MODEL}/2", "prompt": "1 + 1 =", "max_tokens": 7, "temperature": 0, "logprobs": 1}
    one = client.completions.create(**text).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**text, stream=True)
              if c.choices and c.choices[0].logprobs is not None]
    assert [t for c in chunks for t in c.tokens] == one.tokens
    assert [o for c in chunks for o in c.text_offset] == one.text_offset
    assert [list(a) for c in chunks for a in c.top_logprobs] == [list(a) for a in one.top_logprobs]


@pytest.mark.parametrize("route,body,param", [
    ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/completions", {"logprobs": 21}, "logprobs"),
    ("/completions", {"logprobs": True}, "logprobs"),
])
def test_logprobs_out_of_bounds_are_refused_naming_the_field(endpoint, route, body, param):
    server, url = endpoint
    ask = {"messages": Q} if route == "/chat/completions" else {"prompt": "1 + 1 ="}
    status, out = _post(url, route, json.dumps({"model": server.base_name, **ask, **body}).encode())
    assert status == 400 and out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error", out


def test_a_client_gone_mid_stream_frees_its_slot_and_others_are_served(endpoint, client):
    server, url = endpoint
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": f"{MODEL}/1", "messages": Q, "max_tokens": 600, "temperature": 1.0, "seed": 1, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.readline().startswith(b"data: ")  # the stream is under way
    assert server.active == 1
    conn.sock.close()  # gone, without reading the rest
    conn.close()
    other = client.chat.completions.create(model=f"{MODEL}/2", messages=Q, max_tokens=4, temperature=0)
    assert other.choices[0].message is not None
    deadline = time.monotonic() + 20
    while server.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.active == 0 and server.cache.in_use[f"{MODEL}/1"] == 0  # slot and adapter freed


def test_a_version_whose_files_fail_their_hash_is_refused(instance, endpoint, client):
    """Version 3: version 2's files registered again through `register_adapter`, then one of its
    files in the MLflow artifact store altered."""
    t = tracker()
    mv = t.client.get_model_version(MODEL, "2")
    with tempfile.TemporaryDirectory() as tmp:
        path = t.download_version(MODEL, "2", tmp)
        tags = {**mv.tags, "partition": f"{EXP}:corrupt"}
        v3 = t.register_adapter(mv.run_id, MODEL, path, "corrupt_adapter", tags)
    source = Path(t.client.get_model_version(MODEL, v3).source.removeprefix("file://"))
    weights = source / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model=f"{MODEL}/{v3}", messages=Q)
    assert e.value.code == "model_files_corrupt"
    assert f"{MODEL} v{v3} cannot be served" in str(e.value) and "adapter_model.safetensors" in str(e.value)
    assert f"{MODEL}/{v3}" not in [m.id for m in client.models.list().data]


def test_a_version_trained_on_an_sft_warm_start_is_served_on_that_base(instance):
    """Without --model the base is the one the version names: here its experiment's SFT warm
    start in the artifact store, written as the `sft` asset writes it."""
    exp_name, model = "serve-sft", registered_model_name("serve-sft")
    cfg = {**CFG, "sft": {"steps": 1, "batch_size": 4, "examples": 8, "learning_rate": 3e-3}}
    exp = Experiment(config_from_dict(cfg))
    exp.sft()
    store, t = _store(), tracker()
    local = store.write_dir(f"{exp_name}/sft")
    local.mkdir(parents=True, exist_ok=True)
    exp.save_base(local)
    store.put_dir(local, f"{exp_name}/sft")
    exp.start_rl()
    with torch.no_grad():
        for name, p in exp.learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    with tempfile.TemporaryDirectory() as tmp:
        record = exp.save(Path(tmp) / "a")
        t.register_adapter(t.experiment_run(exp_name), model, Path(tmp) / "a", "adapters/iter_00000", tags={
            "partition": f"{exp_name}:0", "content_hash": record["content_hash"], EXPERIMENT_TAG: exp_name,
            **checks_tags([])})
    server = build_server(ref=f"{model}/1", registry=Registry(t, store), device="cpu", dtype="float32")
    thread = ServerThread(server)
    try:
        assert server.base_identity == f"sha256:{exp.sft_record['content_hash']}"
        c = openai.OpenAI(base_url=thread.url, api_key="x", max_retries=0)
        got = c.completions.create(model=f"{model}/1", prompt=[[5, 6, 7]], max_tokens=6, temperature=0)
        (s,) = exp.sampler().sample([[5, 6, 7]], 6, 0.0)
        assert got.choices[0].text == server.text(s.tokens)[0]
        with pytest.raises(openai.BadRequestError) as e:  # trained on tiny itself, not on this warm start
            c.completions.create(model=f"{MODEL}/1", prompt="1", max_tokens=2)
        assert e.value.code == "model_base_mismatch" and "tiny(num_layers=2,seed=3)" in str(e.value)
    finally:
        thread.stop()


def test_served_from_a_resident_worker_the_tokens_are_the_same(instance, endpoint, client, tmp_path):
    from tinker_pipelines.worker.client import start_worker

    sock = tmp_path / "w.sock"
    proc = start_worker("tiny", sock, device="cpu", dtype="float32", log=tmp_path / "log",
                        extra=["--seed", "3", "--model-kwargs", '{"num_layers": 2}', "--threads", "1"])
    try:
        server = build_server(worker=str(sock), registry=Registry(tracker(), _store()))
        thread = ServerThread(server)
        c = openai.OpenAI(base_url=thread.url, api_key="x", max_retries=0)
        for model in (f"{MODEL}/1", f"{MODEL}@champion", "base"):
            req = {"model": model, "messages": Q, "max_tokens": 6, "temperature": 0, "stop": ["\n\n\n"]}
            expected = client.chat.completions.create(**{**req, "model": endpoint[0].base_name if model == "base"
                                                          else model}).choices[0].message.content
            assert c.chat.completions.create(**req).choices[0].message.content == expected, model
        # top logprobs travel over the worker's socket
        req = {"model": f"{MODEL}/1", "prompt": "1 + 1 =", "max_tokens": 3, "temperature": 0, "logprobs": 3}
        remote, local = c.completions.create(**req).choices[0].logprobs, client.completions.create(**req).choices[0].logprobs
        assert remote.tokens == local.tokens and [list(a) for a in remote.top_logprobs] == [list(a) for a in local.top_logprobs]
        assert [v for a in remote.top_logprobs for v in a.values()] == pytest.approx(
            [v for a in local.top_logprobs for v in a.values()], abs=1e-4)
        thread.stop()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_served_process_lets_idle_openmp_threads_sleep(monkeypatch):
    # spinning OpenMP workers took a core from the decode and HTTP threads (docs/serving.md)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert serving_env()["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a choice made by whoever starts it is kept
    assert serving_env()["OMP_WAIT_POLICY"] == "ACTIVE"


def test_an_engine_that_decoded_its_bare_base_decodes_its_first_adapter():
    """The first adapter swaps the base's linears for LoRA layers over the same weights: the
    sampler's cached decoder must not keep serving the bare base."""
    from dataclasses import asdict

    from tinker_pipelines.training.learner import LearnerConfig
    from tinker_pipelines.models import load_model, stop_token_ids
    from tinker_pipelines.rollout.sampler import BASE, Sampler, SampleRequest
    from tinker_pipelines.worker.engine import Engine

    model, tok = load_model("tiny", seed=0)
    model.requires_grad_(False)
    engine = Engine(model, tok.pad_token_id, stop_token_ids(tok), "tiny(seed=0)")
    prompts = [tok.encode("3 + 4 ="), tok.encode("1 + 2 =")]
    base = engine.sampler.sample_requests([SampleRequest(prompts, 6, 0.0, None, BASE)])[0]
    engine.create(0, "a", asdict(LearnerConfig(mode="lora")), seed=0, base_name="")
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for n, p in engine.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    served = engine.sampler.sample_requests([SampleRequest(prompts, 6, 0.0, None, "a")])[0]
    fresh = Sampler(engine.model, tok.pad_token_id, stop_token_ids(tok)).sample_requests(
        [SampleRequest(prompts, 6, 0.0, None, "a")])[0]
    assert [s.logprobs for s in served] == [s.logprobs for s in fresh]
    assert [s.logprobs for s in served] != [s.logprobs for s in base]


def test_tool_calls_in_responses():
    from tinker_pipelines.serving.protocol import tool_message

    content, calls = tool_message('Let me compute. <tool_call>{"name": "calculator", "arguments": '
                                  '{"expression": "6*7"}}</tool_call>')
    assert content == "Let me compute." and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "calculator", "arguments": '{"expression": "6*7"}'}
    assert tool_message("plain 42") == ("plain 42", None)
    assert tool_message("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", None)


def test_cli_errors_are_one_line(instance, endpoint, capsys):
    from tinker_pipelines.cli import main

    _, url = endpoint
    port = url.split(":")[2].split("/")[0]
    for args, message, status in [
            (["--model", "tiny", "--port", port], f"error: cannot listen on 127.0.0.1:{port}: Address already in use", 1),
            ([f"{MODEL}@nope", "--port", "0"], f"error: The model `{MODEL}@nope` does not exist: registered model "
                                               f"'{MODEL}' has no alias 'nope'", 1),
            (["--port", "0"], "error: name the base with --model, or a registered version", 2),
            (["--model", "tiny", "--max-adapters", "0"], "error: --max-adapters must be >= 1, got 0", 2)]:
        assert main(["serve", *args]) == status
        err = capsys.readouterr().err
        assert err.startswith(message) and len(err.strip().splitlines()) == 1, err


# a fresh process imports the ML stack: ~20 s idle, minutes on a loaded machine
def test_serve_job_deploys_the_endpoint_on_loopback(instance):
    from assets.definitions import serve_job

    run_config = {"ops": {"serve_endpoint": {"config": {"models": [f"{MODEL}@champion"], "port": 0}}}}
    with dg.instance_for_test() as inst, \
            dg.execute_job(dg.reconstructable(serve_job), inst, run_config=run_config) as result:
        assert result.success
        url = result.output_for_node("serve_endpoint")
        (output,) = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
        md = {k: v.value for k, v in output.event_specific_data.metadata.items()}
    try:
        assert url == md["url"] and url.startswith("http://127.0.0.1:")
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        assert f"{MODEL}/2" in [m.id for m in c.models.list().data]  # loaded at start
        assert c.chat.completions.create(model=f"{MODEL}@champion", messages=Q, max_tokens=3).choices
    finally:
        os.killpg(md["pid"], signal.SIGTERM)
