"""The worker's cycles keep experiments' samples together: a `sample` call that meets other
clients' other calls is held until those clients sample too (at most `MAX_HOLDS` cycles, and
only while it would run within `MAX_HELD_S` of its first hold)."""

import threading
from dataclasses import asdict

import pytest
import torch

from tinker_pipelines.training.learner import LearnerConfig
from tinker_pipelines.models import load_model, stop_token_ids
from tinker_pipelines.worker.client import WorkerClient, sample_call
from tinker_pipelines.worker.engine import Engine, EngineConfig
from tinker_pipelines.worker.server import MAX_HOLDS, WorkerServer

LEARNER = asdict(LearnerConfig(mode="lora"))


def _sample(client: WorkerClient, adapter: str) -> list:
    return client.sample(sample_call(adapter, [[5, 6, 7], [8, 9]], 4, 1.0, torch.Generator().manual_seed(7))).samples


@pytest.fixture
def server(tmp_path, request):
    model, tok = load_model("tiny", seed=0)
    model.requires_grad_(False)
    engine = Engine(model, tok.pad_token_id, stop_token_ids(tok), "tiny(seed=0)", EngineConfig(), tokenizer=tok)
    # a long window: both clients' first calls meet in one cycle however the threads are scheduled
    s = WorkerServer(engine, tmp_path / "w.sock", window_s=1.0, hold_s=request.param)
    s.start()
    yield s
    s.stop()


def _cycle_of(server: WorkerServer, op: str) -> int:
    return next(k for k, ops in enumerate(server.cycles) if op in ops)


@pytest.mark.parametrize("server", [5.0, 0.0], indirect=True, ids=["hold", "no hold"])
def test_a_sample_waits_for_a_client_busy_with_another_call(server):
    a, b = WorkerClient(server.address), WorkerClient(server.address)
    a.create("a", LEARNER, seed=1)
    out = {}
    ta = threading.Thread(target=lambda: out.setdefault("a", _sample(a, "a")))

    def b_claims_then_samples():  # as a step process does: create (claim) its adapter, then sample
        b.create("b", LEARNER, seed=2)
        out["b"] = _sample(b, "b")

    tb = threading.Thread(target=b_claims_then_samples)
    ta.start(), tb.start()
    ta.join(30), tb.join(30)
    together = any("sample:a" in ops and "sample:b" in ops for ops in server.cycles)
    assert together == (server.hold_s > 0), list(server.cycles)
    assert out["a"] == _sample(a, "a")  # held or not, alone or batched: the same samples
    a.close(), b.close()


@pytest.mark.parametrize("server", [5.0], indirect=True)
@pytest.mark.parametrize("held_s, slow_s, holds", [(60.0, 0.0, MAX_HOLDS), (0.0, 0.0, 0), (1.5, 2.0, 0)],
                         ids=["by cycles", "by time", "by cycle length"])
def test_a_sample_is_held_at_most_max_holds_cycles(server, held_s, slow_s, holds, monkeypatch):
    """At most `MAX_HOLDS` cycles, and only while it would still run within `MAX_HELD_S` of its
    first hold: never when that is 0, nor when the other client's cycles last longer than it."""
    import time

    import tinker_pipelines.worker.server as server_mod
    from tinker_pipelines.worker.messages import Op

    monkeypatch.setattr(server_mod, "MAX_HELD_S", held_s)
    create = server._handlers[Op.CREATE]

    def slow_create(c, r):  # b's cycles last slow_s
        time.sleep(slow_s)
        return create(c, r)

    a, b = WorkerClient(server.address), WorkerClient(server.address)
    a.create("a", LEARNER, seed=1)
    server._handlers[Op.CREATE] = slow_create
    started, stop = threading.Event(), threading.Event()

    def b_never_samples():
        k = 0
        while not stop.is_set():
            b.create(f"b{k}", LEARNER, seed=k)
            started.set()
            k += 1

    tb = threading.Thread(target=b_never_samples)
    tb.start()
    assert started.wait(30)
    before = len(server.cycles)
    ta = threading.Thread(target=_sample, args=(a, "a"))
    ta.start()
    ta.join(60)  # held forever, it would still be waiting
    stop.set()
    tb.join(30)
    assert not ta.is_alive()
    assert server.held["sample:a"] == holds, list(server.cycles)
    waited = _cycle_of(server, "sample:a") - before  # cycles of b's alone while a's sample was held
    assert holds <= waited <= holds + 1, list(server.cycles)
    a.close(), b.close()


@pytest.mark.parametrize("server", [0.0], indirect=True, ids=["no hold"])
def test_a_sample_is_answered_before_its_cycle_trains(server):
    """A cycle runs its samples first and answers them at once: b's `forward_backward`, held open
    here, does not hold back a's sample in the same cycle (on a busy worker a training cycle
    lasts many seconds, and a sample waiting for its end counts them all)."""
    from tinker_pipelines.types import Datum
    from tinker_pipelines.worker.messages import Op

    train, training, release = server._batched[Op.FORWARD_BACKWARD], threading.Event(), threading.Event()

    def gated(calls):
        training.set()
        assert release.wait(60)
        return train(calls)

    server._batched[Op.FORWARD_BACKWARD] = gated
    a, b = WorkerClient(server.address), WorkerClient(server.address)
    a.create("a", LEARNER, seed=1), b.create("b", LEARNER, seed=2)
    datum = Datum((5, 6, 7), (6, 7, 8), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    out = {}
    tb = threading.Thread(target=lambda: out.setdefault("b", b.forward_backward("b", [datum], "grpo", {})))
    ta = threading.Thread(target=lambda: out.setdefault("a", _sample(a, "a")))
    tb.start(), ta.start()
    try:
        assert training.wait(30)
        ta.join(30)
        assert "a" in out and "b" not in out  # a's sample came back while b's training still ran
    finally:
        release.set()
        tb.join(30)
    assert "b" in out and len(out["a"]) == 2
    assert ("forward_backward:b", "sample:a") in [tuple(sorted(ops)) for ops in server.cycles]  # one cycle
    a.close(), b.close()


@pytest.mark.parametrize("flag", ["--hold-ms", "--window-ms"])
def test_a_negative_wait_is_refused(flag):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tinker_pipelines", "worker", flag, "-1"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {flag} must be >= 0, got -1"


def test_the_stop_signal_handler_takes_no_lock(tmp_path):
    """A signal handler runs in the main thread between any two of its bytecodes, also while that
    thread holds the lock of the event its serving loop waits on; a handler that took that lock
    deadlocked the worker, which then outlived the service that was killed."""
    import signal

    model, tok = load_model("tiny", seed=0)
    engine = Engine(model, tok.pad_token_id, stop_token_ids(tok), "tiny(seed=0)", EngineConfig(), tokenizer=tok)
    s = WorkerServer(engine, tmp_path / "w.sock")

    def interrupted_inside_wait():
        with s._stopping._cond:  # as in `Event.wait`, where the signal arrived
            s._on_signal(signal.SIGTERM, None)

    t = threading.Thread(target=interrupted_inside_wait, daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive()
    assert s._signalled
