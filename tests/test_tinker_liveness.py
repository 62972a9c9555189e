"""The Tinker service outlives its worker: a worker killed with SIGKILL or stopped with SIGSTOP
is found and restarted, every call that depended on it fails within a bound naming what
happened, its training clients resume from their last save with the same weights and step
count, and tracking errors fail no work that was done.

Each test starts its own service (tiny base, fp32, CPU worker) with `launch.start_service` and
drives it with the pinned `tinker` SDK, unmodified, over loopback, as tests/test_tinker_service.py
does; the worker is a real process, killed or stopped by signal.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import tinker
from tinker import types

from tinker_pipelines.serving.tinker.launch import start_service
from tinker_pipelines.serving.tinker.lineage import TinkerTracker

pytestmark = pytest.mark.e2e  # worker processes, signals and an HTTP service

KEY = "tml-test-key"
THREADS = str(torch.get_num_threads())
FAIL_BOUND_S = 60.0
"""How soon a call that depended on a killed worker must fail."""
RESTART_BOUND_S = 180.0
"""How soon a killed worker must be serving again (a fresh worker loads torch and the base)."""
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
        "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, np.float32))})


DATA = [_datum([5, 9, 13, 21, 34, 55]), _datum([7, 8, 9, 10])]
BIG = [_datum(np.random.default_rng(i).integers(3, 400, 1000).tolist()) for i in range(48)]
"""A forward_backward that keeps the tiny worker busy for seconds (48 passes of 1000 tokens)."""


@contextmanager
def _service(tmp_path: Path, **options):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    handle = start_service("tiny", home=tmp_path / "home", api_key=KEY, device="cpu", dtype="float32",
                           worker_args=["--threads", THREADS], **options)
    try:
        yield handle
    finally:
        handle.stop()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _health(handle) -> tuple[int, dict]:
    r = httpx.get(f"{handle.url}/api/v1/healthz", headers={"X-API-Key": KEY}, timeout=30)
    return r.status_code, r.json()


def _wait_health(handle, status: int, bound_s: float) -> tuple[int, dict]:
    deadline = time.monotonic() + bound_s
    got = _health(handle)
    while got[0] != status and time.monotonic() < deadline:
        time.sleep(0.2)
        got = _health(handle)
    assert got[0] == status, got
    return got


def _logprobs(tc) -> list[list[float]]:
    return [o["logprobs"].to_torch().tolist() for o in tc.forward(DATA, "cross_entropy").result().loss_fn_outputs]


def _sample(sampler) -> list[int]:
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=11)
    return sampler.sample(types.ModelInput.from_ints([5, 9, 13]), 1, params).result().sequences[0].tokens


def _completion(handle) -> httpx.Response:
    """The OpenAI endpoint of the same process, over its own connections to the worker."""
    return httpx.post(f"{handle.url}/v1/completions", headers={"X-API-Key": KEY}, timeout=60,
                      json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0})


def test_healthz_answers_503_while_the_worker_is_dead_and_ok_once_it_is_restarted(tmp_path):
    with _service(tmp_path) as handle, ExitStack() as stack:
        assert _health(handle) == (200, {"status": "ok"})
        sc = stack.enter_context(tinker.ServiceClient(base_url=handle.url, api_key=KEY))
        base = sc.create_sampling_client(base_model="tiny").result()
        want = _sample(base)
        assert _completion(handle).status_code == 200
        old = handle.worker_pid
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        status, body = _wait_health(handle, 503, 10)
        assert body["field"] is None and "the worker for tiny" in body["detail"], body
        _wait_health(handle, 200, RESTART_BOUND_S)
        assert _health(handle) == (200, {"status": "ok"}) and handle.worker_pid != old
        while True:  # the base sampler made before the kill goes on
            try:
                got = _sample(base)
                break
            except tinker.RequestFailedError:
                assert time.monotonic() - killed < RESTART_BOUND_S
        print(f"recovery: kill -> first successful sample {time.monotonic() - killed:.1f} s")
        assert got == want
        assert _completion(handle).status_code == 200, _completion(handle).text
        assert (tmp_path / "home" / "worker.pid").read_text() == str(handle.worker_pid)


def test_a_killed_worker_fails_the_call_in_flight_and_its_client_resumes_from_its_last_save(tmp_path):
    with _service(tmp_path) as handle, ExitStack() as stack:
        sc = stack.enter_context(tinker.ServiceClient(base_url=handle.url, api_key=KEY))
        tc = sc.create_lora_training_client("tiny", rank=4, seed=3).result()
        for _ in range(2):
            tc.forward_backward(DATA, "cross_entropy").result()
            tc.optim_step(ADAM).result()
        path = tc.save_state("two-steps").result().path
        want_logprobs = _logprobs(tc)
        reference = sc.create_training_client_from_state_with_optimizer(path).result()
        reference.forward_backward(DATA, "cross_entropy").result()
        want_step = reference.optim_step(ADAM).result().metrics
        sampler_path = tc.save_weights_for_sampler("two-steps").result().path
        from_path = sc.create_sampling_client(model_path=sampler_path).result()
        snapshot = tc.save_weights_and_get_sampling_client().result()
        base = sc.create_sampling_client(base_model="tiny").result()
        want_from_path, want_base = _sample(from_path), _sample(base)

        in_flight = tc.forward_backward(BIG, "cross_entropy")
        time.sleep(0.5)
        queued = base.sample(types.ModelInput.from_ints([5, 9, 13]), 1,
                             types.SamplingParams(max_tokens=4, temperature=1.0, seed=11))
        time.sleep(0.5)  # the worker is in the middle of the forward_backward, the sample waiting behind it
        os.kill(handle.worker_pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(tinker.RequestFailedError) as failed:
            in_flight.result(timeout=FAIL_BOUND_S)
        assert time.monotonic() - killed < FAIL_BOUND_S
        message = str(failed.value)
        assert "the worker for tiny died (signal 9, SIGKILL)" in message and path in message, message
        assert queued.result(timeout=RESTART_BOUND_S).sequences[0].tokens == want_base  # sent again, to the new one

        _wait_health(handle, 200, RESTART_BOUND_S)
        with pytest.raises(tinker.APIStatusError) as later:  # the lost client: 410, the same story, no retries
            tc.forward(DATA, "cross_entropy").result(timeout=FAIL_BOUND_S)
        assert later.value.status_code == 410
        assert "died (signal 9, SIGKILL)" in str(later.value) and "was restarted at" in str(later.value)
        assert path in str(later.value)
        with pytest.raises(tinker.APIStatusError) as gone:  # its in-memory snapshot went with it
            _sample(snapshot)
        assert gone.value.status_code == 410

        resumed = sc.create_training_client_from_state_with_optimizer(path).result()
        assert _logprobs(resumed) == want_logprobs
        assert handle.service.models[resumed.model_id].steps == 2
        resumed.forward_backward(DATA, "cross_entropy").result()
        assert resumed.optim_step(ADAM).result().metrics == want_step  # Adam's state and step count came back
        assert _sample(from_path) == want_from_path  # loaded again from disk on the new worker
        assert _sample(base) == want_base


def test_a_checkpoint_sampler_the_restart_could_not_load_again_loads_on_its_next_sample(tmp_path, monkeypatch):
    """After a worker restart, a checkpoint sampler whose load on the new worker failed (here on
    purpose, as a connection refused at a busy restart did) is loaded by its next sample, not
    left broken with the dead worker's connection."""
    from tinker_pipelines.serving.tinker.runtime import SharedConnection
    from tinker_pipelines.worker import WorkerError

    refresh, refused = SharedConnection.refresh, []

    def refuse_once(self):
        if self.checkpoint is not None and not refused and self.generation < self._runtime.generation:
            refused.append(self.checkpoint[0])
            raise WorkerError("the worker did not answer the connection (refused on purpose)")
        return refresh(self)

    monkeypatch.setattr(SharedConnection, "refresh", refuse_once)
    with _service(tmp_path) as handle, ExitStack() as stack:
        sc = stack.enter_context(tinker.ServiceClient(base_url=handle.url, api_key=KEY))
        tc = sc.create_lora_training_client("tiny", rank=4, seed=3).result()
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        from_path = sc.create_sampling_client(model_path=tc.save_weights_for_sampler("one").result().path).result()
        want = _sample(from_path)
        os.kill(handle.worker_pid, signal.SIGKILL)
        deadline = time.monotonic() + RESTART_BOUND_S
        while not refused and time.monotonic() < deadline:  # the restart's listener tries, and fails
            time.sleep(0.2)
        assert refused
        _wait_health(handle, 200, RESTART_BOUND_S)
        assert _sample(from_path) == want


def test_a_hung_worker_fails_calls_within_the_timeout_and_is_replaced(tmp_path):
    with _service(tmp_path, worker_timeout_s=8.0) as handle, ExitStack() as stack:
        sc = stack.enter_context(tinker.ServiceClient(base_url=handle.url, api_key=KEY))
        tc = sc.create_lora_training_client("tiny", rank=4, seed=5).result()
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        hung = handle.worker_pid
        os.kill(hung, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            call = tc.forward_backward(DATA, "cross_entropy")
            status, body = _health(handle)
            assert status == 503 and "does not answer" in body["detail"], body
            with pytest.raises(tinker.RequestFailedError, match=r"the worker for tiny hung \("):
                call.result(timeout=FAIL_BOUND_S)
            assert time.monotonic() - stopped < 8.0 + 30.0  # the bound, and the supervisor's own checks
            _wait_health(handle, 200, RESTART_BOUND_S)
            assert handle.worker_pid != hung
            assert _state(hung) == "gone"  # killed, not left stopped
            fresh = sc.create_lora_training_client("tiny", rank=4, seed=5).result()
            assert fresh.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"] > 0
        finally:  # never leave a stopped process behind, whatever failed
            _signal(hung, signal.SIGKILL)


def test_a_stopped_worker_is_found_by_its_probes_and_replaced(tmp_path):
    """With the default call bound (15 minutes), a stopped worker is found by the supervisor's
    probes (two in a row unanswered within 10 s), killed and replaced; the call waiting on it
    fails then, naming the hang."""
    with _service(tmp_path) as handle, ExitStack() as stack:
        sc = stack.enter_context(tinker.ServiceClient(base_url=handle.url, api_key=KEY))
        tc = sc.create_lora_training_client("tiny", rank=4, seed=5).result()
        hung = handle.worker_pid
        os.kill(hung, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            call = tc.forward_backward(DATA, "cross_entropy")
            with pytest.raises(tinker.RequestFailedError, match=r"hung \(no answer to a connection within 10 s; 2 "
                                                                 r"probes in a row\)"):
                call.result(timeout=FAIL_BOUND_S)
            assert time.monotonic() - stopped < FAIL_BOUND_S
            _wait_health(handle, 200, RESTART_BOUND_S)
            assert handle.worker_pid != hung and _state(hung) == "gone"
        finally:
            _signal(hung, signal.SIGKILL)


def _state(pid: int) -> str:
    """'gone' once the process exited (or is a zombie nobody collected yet), else its state letter."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    return "gone" if state == "Z" else state


class FlakyTracker(TinkerTracker):
    """A real tracker (MLflow on sqlite) whose calls raise as if MLflow were unreachable: the
    first `fail[name]` calls of each method raise, the rest go through."""

    def __init__(self, home: Path, fail: dict[str, int]):
        from tinker_pipelines.tracking import Tracker

        super().__init__(Tracker(f"sqlite:///{home / 'mlflow.db'}", "tinker-api", str(home / "artifacts")))
        self.fail = dict(fail)
        self.raised: dict[str, int] = {}

    def _maybe_fail(self, name: str) -> None:
        if self.fail.get(name, 0) > 0:
            self.fail[name] -= 1
            self.raised[name] = self.raised.get(name, 0) + 1
            from mlflow.exceptions import MlflowException

            raise MlflowException(f"API request to the tracking server failed ({name}, simulated outage)")

    def log_step(self, *args, **kwargs):
        self._maybe_fail("log_step")
        return super().log_step(*args, **kwargs)

    def checkpoint_saved(self, *args, **kwargs):
        self._maybe_fail("checkpoint_saved")
        return super().checkpoint_saved(*args, **kwargs)

    def end_model(self, *args, **kwargs):
        self._maybe_fail("end_model")
        return super().end_model(*args, **kwargs)


def test_tracking_errors_fail_no_optim_step_and_no_save(tmp_path, caplog):
    tracker = FlakyTracker(tmp_path, {"log_step": 1})
    with _service(tmp_path, tracker=tracker) as handle, ExitStack() as stack:
        sc = stack.enter_context(tinker.ServiceClient(base_url=handle.url, api_key=KEY))
        tc = sc.create_lora_training_client("tiny", rank=4, seed=7).result()
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(ADAM).result()  # its first log_step raised: retried, logged
        run = tracker._model(tc.model_id).run_id
        assert tracker.raised == {"log_step": 1}
        assert [m.step for m in tracker.tracker.client.get_metric_history(run, "loss:sum")] == [1]

        tracker.fail = {"log_step": 100, "checkpoint_saved": 100}  # MLflow down for good
        with caplog.at_level(logging.WARNING):
            tc.forward_backward(DATA, "cross_entropy").result()
            step = tc.optim_step(ADAM).result()
            saved = tc.save_state("while-mlflow-is-down").result()
        assert step.metrics["optim/grad_norm:mean"] > 0
        assert handle.service.models[tc.model_id].steps == 2  # the step was applied and counted
        assert (tmp_path / "home" / "checkpoints" / tc.model_id / "weights" / "while-mlflow-is-down" /
                "record.json").exists() and saved.path.endswith("while-mlflow-is-down")
        given_up = [r.getMessage() for r in caplog.records if "given up" in r.getMessage()]
        assert len(given_up) == 2 and "log_step" in given_up[0] and "checkpoint_saved" in given_up[1]
        assert all("\n" not in line for line in given_up)


def test_the_session_reaper_goes_on_after_a_tracker_error(tmp_path, caplog):
    tracker = FlakyTracker(tmp_path, {"end_model": 1000})  # every run's end raises
    with _service(tmp_path, tracker=tracker, session_ttl_s=3.0) as handle, \
            httpx.Client(base_url=f"{handle.url}/api/v1", headers={"X-API-Key": KEY}, timeout=60) as http, \
            caplog.at_level(logging.WARNING):
        def session_with_a_model() -> str:
            sid = http.post("/create_session", json=types.CreateSessionRequest(
                tags=[], user_metadata={}, sdk_version="0.38.0").model_dump(mode="json")).json()["session_id"]
            rid = http.post("/create_model", json=types.CreateModelRequest(
                session_id=sid, model_seq_id=0, base_model="tiny", lora_config=types.LoraConfig(rank=4)
            ).model_dump(mode="json")).json()["request_id"]
            assert "model_id" in http.post("/retrieve_future", json={"request_id": rid}).json()
            return sid

        def reaped(sid: str) -> bool:
            return not any(m.session_id == sid for m in handle.service.models.values())

        first = session_with_a_model()  # no heartbeats: expires after 3 s
        deadline = time.monotonic() + 30
        while not (reaped(first) and tracker.raised.get("end_model")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reaped(first) and tracker.raised["end_model"] >= 1
        second = session_with_a_model()
        deadline = time.monotonic() + 30
        while not reaped(second) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reaped(second), "the reaper stopped after the tracker's error"
        assert http.post("/session_heartbeat", json={"session_id": second, "type": "session_heartbeat"}
                         ).status_code == 410
        assert any("end_model" in r.getMessage() and "given up" in r.getMessage() for r in caplog.records)
