"""One client's bad request fails alone: the others batched with it get what they would alone.

Also the worker's front door: a second worker on a live socket is refused, a silent client is
cut off at the handshake deadline, and an unreadable hello is answered, not left hanging.
"""

import errno
import socket
import time
from dataclasses import asdict
from multiprocessing.connection import Client

import pytest
import torch

from tinker_pipelines.training.learner import LearnerConfig
from tinker_pipelines.models import load_model, stop_token_ids
from tinker_pipelines.serving import ServingError
from tinker_pipelines.serving import protocol as P
from tinker_pipelines.types import Datum
from tinker_pipelines.worker import messages
from tinker_pipelines.worker import batching as batching_module
from tinker_pipelines.worker import server as server_module
from tinker_pipelines.worker.engine import Engine, EngineConfig
from tinker_pipelines.worker.server import WorkerServer, key_path


@pytest.fixture(scope="module")
def engine():
    model, tok = load_model("tiny", seed=0)
    model.requires_grad_(False)
    e = Engine(model, tok.pad_token_id, stop_token_ids(tok), "tiny(seed=0)", EngineConfig(), tokenizer=tok)
    for i, name in enumerate(("one", "two")):
        e.create(1, name, asdict(LearnerConfig(mode="lora", learning_rate=1e-2)), seed=10 + i, base_name="")
    with torch.no_grad():  # non-zero B: each adapter changes the function
        g = torch.Generator().manual_seed(3)
        for n, p in e.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return e


def _state(seed: int) -> bytes:
    return torch.Generator().manual_seed(seed).get_state().numpy().tobytes()


def _good(adapter: str = "one") -> dict:
    return {"adapter": adapter, "prompts": [[5, 6, 7], [8, 9]], "max_new_tokens": 5, "temperature": 1.0,
            "generator_state": _state(1)}


def test_bad_sample_requests_fail_alone(engine):
    alone = engine.sample([_good()])[0]
    assert "samples" in alone
    bad = {"out of vocabulary": {**_good("two"), "prompts": [[10**6]]},
           "negative id": {**_good("two"), "prompts": [[-3, 4]]},
           "NaN temperature": {**_good("two"), "temperature": float("nan")},
           "generator state": {**_good("two"), "generator_state": b"xyz"},
           "prompts as a string": {**_good("two"), "prompts": "123"}}
    replies = engine.sample([_good(), *bad.values()])
    assert replies[0] == alone  # the same samples and generator state as alone
    expected = ["outside the model's vocabulary", "outside the model's vocabulary", "finite number",
                "not the state of a CPU torch.Generator", "list of token-id lists"]
    for (what, _), reply, text in zip(bad.items(), replies[1:], expected):
        assert "error" in reply and text in reply["message"], (what, reply)
    one = engine.sample([{**_good(), "stop": "ab"}])[0]  # a string is one stop string, as in OpenAI's API
    assert "samples" in one


def test_a_batch_that_fails_anyway_reruns_each_request_alone(engine, monkeypatch):
    """A failure no check foresaw (here: one request's row breaks the decoder): the generators
    are rewound and each request runs alone, so the good one gets its solo samples."""
    alone = engine.sample([_good()])[0]
    real = engine.sampler.sample_requests

    def fragile(requests):
        if any(r.max_new_tokens == 7 for r in requests):
            for r in requests:  # the failed batch had drawn uniforms already
                torch.rand(3, generator=r.generator)
            raise RuntimeError("decoder broke on this row")
        return real(requests)

    monkeypatch.setattr(engine.sampler, "sample_requests", fragile)
    replies = engine.sample([_good(), {**_good("two"), "max_new_tokens": 7}])
    assert replies[0] == alone
    assert replies[1]["error"] == "RuntimeError" and "decoder broke" in replies[1]["message"]


def _datums(n: int = 3, vocab_bad: bool = False) -> list[Datum]:
    out = []
    for i in range(n):
        ids = [5 + i, 6, 7, 8, 9, 10 + i]
        if vocab_bad and i == 1:
            ids[2] = 10**6
        w = (0.0, 0.0, 1.0, 1.0, 1.0)
        out.append(Datum(tuple(ids[:-1]), tuple(ids[1:]), w, (-1.0,) * 5, tuple(x * (i - 1) for x in w)))
    return out


def _grads(engine, name):
    return [None if p.grad is None else p.grad.clone() for p in engine.get(name).learner.params]


def _clear(engine):
    for name in ("one", "two"):
        for p in engine.get(name).learner.params:
            p.grad = None


def test_bad_forward_backward_fails_alone_and_a_failed_shared_pass_is_undone(engine, monkeypatch):
    call = {"adapter": "one", "datums": _datums(), "algorithm": "grpo", "loss_cfg": {}}
    _clear(engine)
    alone = engine.forward_backward([call])[0]
    g_alone = _grads(engine, "one")
    _clear(engine)
    replies = engine.forward_backward([call, {**call, "adapter": "two", "datums": _datums(vocab_bad=True)}])
    assert replies[0] == alone and "outside the model's vocabulary" in replies[1]["message"]
    for g, h in zip(_grads(engine, "one"), g_alone):
        torch.testing.assert_close(g, h, rtol=0, atol=0)
    # a shared pass that fails after accumulating: every gradient is put back, each call runs alone
    _clear(engine)
    real = batching_module.forward_backward_together

    def breaks_after(jobs, max_rows=0):
        real(jobs, max_rows)
        raise RuntimeError("shared pass broke")

    monkeypatch.setattr("tinker_pipelines.worker.engine.forward_backward_together", breaks_after)
    nan = [Datum(d.input_tokens, d.target_tokens, d.weights, d.behaviour_logprobs, (float("nan"),) * 5)
           for d in _datums()]
    replies = engine.forward_backward([call, {**call, "adapter": "two", "datums": nan}])
    assert replies[0] == alone and replies[1]["error"] == "FloatingPointError"
    assert all(p.grad is None for p in engine.get("two").learner.params)
    for g, h in zip(_grads(engine, "one"), g_alone):
        torch.testing.assert_close(g, h, rtol=0, atol=0)
    _clear(engine)


def test_serving_checks_the_fields_a_batch_would_fail_on():
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for field, value, text in (("top_p", 0, "top_p must be a number in (0, 1]"), ("min_p", 1, "min_p must be"),
                               ("seed", 2**70, "seed must be an integer in")):
        with pytest.raises(ServingError, match=text.replace("(", r"\(").replace("]", r"\]")) as err:
            P.check_params({**base, field: value}, P.CHAT, 1024)
        assert err.value.status == 400
    assert P.check_params({**base, "seed": -5, "top_p": 0.5, "min_p": 0.1}, P.CHAT, 1024).seed == -5


@pytest.fixture
def live_server(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(server_module, "HANDSHAKE_TIMEOUT_S", 0.5)
    address = tmp_path / "w.sock"
    server = WorkerServer(engine, address)
    server.start()
    yield server, address
    server.stop()


def test_a_second_worker_on_a_live_socket_is_refused(engine, live_server):
    server, address = live_server
    inode = address.stat().st_ino
    with pytest.raises(OSError) as err:
        WorkerServer(engine, address).start()
    assert err.value.errno == errno.EADDRINUSE and "already listens" in str(err.value)
    assert address.stat().st_ino == inode and key_path(address).exists()


def test_silent_and_unreadable_clients_are_cut_off_not_left_hanging(live_server):
    _, address = live_server
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(str(address))
    silent.settimeout(10)
    start, data = time.monotonic(), b""
    while chunk := silent.recv(4096):  # the challenge, then end-of-file at the deadline
        data += chunk
    assert data and time.monotonic() - start < 5
    silent.close()
    conn = Client(str(address), family="AF_UNIX", authkey=key_path(address).read_bytes())
    conn.send_bytes(b"not msgpack \xc1")
    reply = _hello_reply(conn)
    assert reply.error == "ProtocolError" and "first message must be a hello" in reply.message
    with pytest.raises(EOFError):
        conn.recv_bytes()
    conn = Client(str(address), family="AF_UNIX", authkey=key_path(address).read_bytes())
    conn.send_bytes(messages.encode(messages.Stats()))
    assert "first message must be a hello" in _hello_reply(conn).message
    good = Client(str(address), family="AF_UNIX", authkey=key_path(address).read_bytes())
    good.send_bytes(messages.encode(messages.Hello(messages.SCHEMA)))
    assert isinstance(messages.decode_reply(messages.Op.HELLO, good.recv_bytes()), messages.HelloReply)
    good.close()


def _hello_reply(conn) -> messages.Error:
    reply = messages.decode_reply(messages.Op.HELLO, conn.recv_bytes())
    assert isinstance(reply, messages.Error), reply
    return reply


def test_cli_worker_never_replaces_a_file_or_a_live_worker(live_server, tmp_path):
    import subprocess
    import sys

    _, address = live_server
    data = tmp_path / "notes.txt"
    data.write_text("keep me")
    for path, text in ((data, "is not a worker's socket"), (address, "already listens there")):
        r = subprocess.run([sys.executable, "-m", "tinker_pipelines", "worker", "--model", "tiny", "--device", "cpu",
                            "--socket", str(path)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith("error: --socket") and text in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert data.read_text() == "keep me"
    conn = Client(str(address), family="AF_UNIX", authkey=key_path(address).read_bytes())
    conn.send_bytes(messages.encode(messages.Hello(messages.SCHEMA)))  # the live worker still serves
    assert isinstance(messages.decode_reply(messages.Op.HELLO, conn.recv_bytes()), messages.HelloReply)
    conn.close()


def test_many_clients_connecting_at_once_all_get_in(live_server, monkeypatch):
    """After a restart every client connects again at the same moment; a Unix socket refuses a
    connect outright (EAGAIN) once its backlog is full, so the worker's is deep and a client
    that still meets a full one tries again within its connect bound."""
    import threading

    from tinker_pipelines.worker.client import WorkerClient

    monkeypatch.setattr(server_module, "HANDSHAKE_TIMEOUT_S", 30.0)
    _, address = live_server
    n, go = 48, threading.Barrier(48)
    got, failed = [], []

    def connect():
        go.wait()
        try:
            got.append(WorkerClient(address, connect_timeout_s=20))
        except Exception as e:  # noqa: BLE001 - each failure is reported below
            failed.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=connect) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in got:
        c.close()
    assert not failed and len(got) == n, failed[:3]
