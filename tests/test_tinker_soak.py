"""The soak benchmark (`benchmarks/tinker_soak.py`) compressed to 2 minutes on the tiny model: a
client SIGKILLed mid-call at ~40 s, the worker SIGKILLed at ~60 s, bad requests throughout; the
service must meet the soak's goals. Also the soak's own bookkeeping, on real SDK exceptions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import tinker
from tinker import types

from benchmarks.tinker_soak import schedule
from benchmarks.tinker_soak_client import Bad, classify

REPO = Path(__file__).resolve().parents[1]


def _status_error(status: int, detail: str, field: str) -> tinker.APIStatusError:
    response = httpx.Response(status, json={"detail": detail, "field": field},
                              request=httpx.Request("POST", "http://127.0.0.1/api/v1/x"))
    cls = {400: tinker.BadRequestError, 404: tinker.NotFoundError, 500: tinker.InternalServerError}[status]
    return cls(f"Error code: {status} - {response.json()}", response=response, body=response.json())


def test_a_bad_request_counts_as_expected_only_as_a_4xx_naming_its_field():
    bad = Bad("ttl", "ttl_seconds")
    assert classify(_status_error(400, "ttl_seconds 1 is out of range", "ttl_seconds"), bad) == ("expected", "bad:ttl")
    assert classify(_status_error(400, "something else", "path"), bad)[0] == "unexpected"
    assert classify(_status_error(500, "ttl_seconds broke us", "ttl_seconds"), bad)[0] == "unexpected"
    assert classify(None, bad)[0] == "unexpected"  # a bad request that succeeded
    user = tinker.RequestFailedError("data[1].model_input has token id 900, outside the vocabulary", "req-1",
                                     types.RequestErrorCategory.User)
    assert classify(user, Bad("fb_token", "data[1]")) == ("expected", "bad:fb_token")
    server = tinker.RequestFailedError("data[1] broke", "req-2", types.RequestErrorCategory.Server)
    assert classify(server, Bad("fb_token", "data[1]"))[0] == "unexpected"


def test_only_a_failure_owed_to_the_worker_kill_is_expected_of_a_good_call():
    killed = tinker.RequestFailedError("WorkerLost: the worker for tiny died (signal 9, SIGKILL) at ...", "req-3",
                                       types.RequestErrorCategory.Server)
    assert classify(killed, None) == ("expected", "worker_kill")
    assert classify(_status_error(404, "model_id 'x' is unknown", "model_id"), None)[0] == "unexpected"
    assert classify(None, None) == ("ok", None)


def test_the_fault_schedule():
    full = schedule(1800, 120, None, None)
    assert full.client_kills == [120 * k for k in range(1, 15)] and full.worker_kill == 900 and full.rss_at == 300
    ci = schedule(120, 0, 40, 60)
    assert ci.client_kills == [40] and ci.worker_kill == 60
    assert schedule(120, 0, None, -1).worker_kill is None


@pytest.mark.e2e  # a service, its worker and five SDK client processes, SIGKILLed on a schedule
def test_a_two_minute_soak_meets_the_goals(tmp_path):
    argv = [sys.executable, "-m", "benchmarks.tinker_soak", "--model", "tiny", "--minutes", "2", "--clients", "4",
            "--client-kill-first", "40", "--client-kill-every", "0", "--worker-kill-at", "60", "--seed", "1",
            "--work", str(tmp_path), "--no-cookbook"]
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=330)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    print(output[-3000:])
    assert r["soak_unexpected_failures"] == 0, output[-4000:]
    assert r["soak_lost_steps"] == 0 and r["soak_hung_futures"] == 0 and r["soak_adapters_leaked"] == 0, r
    assert r["soak_recovery_s"] is not None and r["soak_recovery_s"] <= 60, r
    # the faults happened and were checked, not skipped
    assert r["soak_client_kills"] == 1 and r["soak_client_kills_mid_call"] == 1, r
    assert r["soak_sessions_reaped"] == 1, r
    assert r["soak_worker_restart_s"] is not None, r
    assert r["soak_bad_requests"] >= 5 and r["soak_saves_checked"] >= 5 and r["soak_resumes_checked"] >= 1, r
    assert r["soak_calls"] >= 200 and r["soak_p99_small_call_s"] is not None, r
    assert r["soak_adapters_end"] == {"service": {"training": 0, "snapshots": 0, "from_checkpoints": 0},
                                      "worker": [], "live_sessions": 0}, r


@pytest.mark.e2e  # a service and its worker, SIGKILLed
def test_a_sampler_of_a_deleted_checkpoint_answers_410_after_a_worker_restart(tmp_path):
    import os
    import signal
    import time

    from tinker_pipelines.serving.tinker.launch import start_service

    key = "tml-soak-repro"
    handle = start_service("tiny", home=tmp_path / "home", api_key=key, device="cpu", dtype="float32")
    try:
        sc = tinker.ServiceClient(base_url=handle.url, api_key=key)
        tc = sc.create_lora_training_client("tiny", rank=4, seed=1).result()
        path = tc.save_weights_for_sampler("in-use").result().path
        sampler = sc.create_sampling_client(model_path=path).result()
        prompt, greedy = types.ModelInput.from_ints([3, 4]), types.SamplingParams(max_tokens=4, temperature=0.0)
        sampler.sample(prompt, 1, greedy).result()
        sc.create_rest_client().delete_checkpoint_from_tinker_path(path).result()
        sampler.sample(prompt, 1, greedy).result()  # a delete does not break a sampler already sampling it
        os.kill(handle.supervisor.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while handle.supervisor.generation == 0 or handle.service.runtime.health() is not None:
            assert time.monotonic() < deadline, "the worker was not restarted"
            time.sleep(0.2)
        with pytest.raises(tinker.APIStatusError) as gone:
            sampler.sample(prompt, 1, greedy).result(timeout=60)
        assert gone.value.status_code == 410 and "its checkpoint was deleted while it sampled" in str(gone.value)
    finally:
        handle.stop()
