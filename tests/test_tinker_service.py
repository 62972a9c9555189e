"""The Tinker service against the pinned `tinker` SDK, unmodified, on loopback.

One service (tiny base, fp32, CPU worker) is shared by the module's tests; each test makes its
own session and training clients, which is also how several users share one service.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import tinker
from tinker import types

from tinker_pipelines.algorithms.tinker_losses import datum_from_tinker, tinker_loss
from tinker_pipelines.serving.tinker.launch import start_service
from tinker_pipelines.serving.tinker.runtime import LoraShape
from tinker_pipelines.models import load_model

pytestmark = pytest.mark.e2e  # a worker process and an HTTP service

KEY = "tml-test-key"
THREADS = str(torch.get_num_threads())


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    handle = start_service("tiny", home=tmp_path_factory.mktemp("tinker"), api_key=KEY, device="cpu",
                           dtype="float32", gap_timeout_s=3.0, worker_args=["--threads", THREADS])
    yield handle
    handle.stop()


@pytest.fixture
def client(service):
    sc = tinker.ServiceClient(base_url=service.url, api_key=KEY)
    yield sc
    sc.close("success").result()


def _sft_datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    inputs, targets = tokens[:-1], tokens[1:]
    w = weights or [1.0] * len(targets)
    return types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.asarray(targets, np.int64)),
        "weights": types.TensorData.from_numpy(np.asarray(w, np.float32))})


def _rl_datum(tokens: list[int], seed: int) -> types.Datum:
    rng = np.random.default_rng(seed)
    inputs, targets = tokens[:-1], tokens[1:]
    return types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.asarray(targets, np.int64)),
        "logprobs": types.TensorData.from_numpy(-rng.random(len(targets)).astype(np.float32)),
        "advantages": types.TensorData.from_numpy(rng.standard_normal(len(targets)).astype(np.float32))})


DATA = [_sft_datum([5, 9, 13, 21, 34, 55]), _sft_datum([7, 8, 9, 10], [0.0, 1.0, 0.5])]
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def _local_learner(lora: LoraShape):
    from tinker_pipelines.training.learner import Learner, LearnerConfig

    torch.set_num_threads(int(THREADS))
    model, tok = load_model("tiny", seed=0, dtype="float32", device="cpu")
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in lora.learner().items()}
    return Learner(model, LearnerConfig(**cfg), tok.pad_token_id, base_name="tiny", adapter_name="local",
                   init_seed=lora.seed)


def _local_datums(data: list[types.Datum]):
    return [datum_from_tinker(d.model_input.to_ints(), {k: v.to_torch() for k, v in d.loss_fn_inputs.items()})
            for d in data]


def test_cross_entropy_step_equals_the_in_process_learner_exactly(client, tmp_path):
    tc = client.create_lora_training_client("tiny", rank=4, seed=3).result()
    fb = tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    fb2 = tc.forward_backward(DATA, "cross_entropy").result()

    local = _local_learner(LoraShape(4, 3))
    loss = tinker_loss("cross_entropy")
    lp1, m1 = local.tinker_forward_backward(_local_datums(DATA), loss)
    local.optim_step(ADAM.model_dump())
    _, m2 = local.tinker_forward_backward(_local_datums(DATA), loss)
    assert fb.metrics["loss:sum"] == m1["loss:sum"]
    assert fb2.metrics["loss:sum"] == m2["loss:sum"]
    assert fb2.metrics["loss:sum"] < fb.metrics["loss:sum"]
    # per-datum outputs: the target tokens' logprobs, one per token
    lp = [o["logprobs"].to_torch() for o in fb.loss_fn_outputs]
    assert [len(x) for x in lp] == [5, 3]
    assert [x.tolist() for x in lp] == lp1
    weights = torch.cat([d.loss_fn_inputs["weights"].to_torch() for d in DATA])
    assert float(-(torch.cat(lp) * weights).sum()) == pytest.approx(fb.metrics["loss:sum"], rel=1e-6)


def _group_datums(seed: int) -> list[types.Datum]:
    """A recipe's RL step: groups of samples of one prompt, advantage 0 on the prompt (and on a
    whole group whose rewards were equal), sampling logprob 0 there."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(3):
        prompt = rng.integers(3, 60, 12).tolist()
        for _ in range(4):
            reply = rng.integers(3, 60, int(rng.integers(2, 5))).tolist()
            tokens = prompt + reply
            adv = 0.0 if g == 2 else float(rng.choice([-0.5, 0.5, 1.0]))
            advantages = [0.0] * (len(prompt) - 1) + [adv] * len(reply)
            logprobs = [0.0] * (len(prompt) - 1) + (-rng.random(len(reply)) * 2).tolist()
            out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
                "logprobs": types.TensorData.from_numpy(np.asarray(logprobs, np.float32)),
                "advantages": types.TensorData.from_numpy(np.asarray(advantages, np.float32))}))
    return out


def test_rl_steps_over_shared_prompts_equal_the_in_process_learner_exactly(client):
    """The service weights only the tokens an advantage-gated loss reads and shares each group's
    prompt; the in-process learner given the same datums (as the service takes them) agrees bit
    for bit, every prompt position's logprob included."""
    loss = tinker_loss("importance_sampling")
    tc = client.create_lora_training_client("tiny", rank=4, seed=5).result()
    local = _local_learner(LoraShape(4, 5))
    for step in range(2):
        data = _group_datums(step)
        fb = tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(ADAM).result()
        mine = [datum_from_tinker(d.model_input.to_ints(), {k: v.to_torch() for k, v in d.loss_fn_inputs.items()},
                                  loss=loss) for d in data]
        assert sum(w == 0 for d in mine for w in d.weights) > sum(len(d.input_tokens) for d in mine) // 2
        lp, m = local.tinker_forward_backward(mine, loss)
        local.optim_step(ADAM.model_dump())
        assert fb.metrics["loss:sum"] == m["loss:sum"]
        got = [o["logprobs"].to_torch().tolist() for o in fb.loss_fn_outputs]
        assert got == lp and all(x != 0.0 for row in got for x in row)


def test_sample_equals_the_in_process_sampler_at_the_same_seed(client):
    sc = client.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints([3, 4, 5, 6])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=1234)
    a = sc.sample(prompt, num_samples=2, sampling_params=params).result()
    b = sc.sample(prompt, num_samples=2, sampling_params=params).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert all(len(s.tokens) == len(s.logprobs) > 0 for s in a.sequences)
    assert all(s.stop_reason in ("stop", "length") for s in a.sequences)

    from tinker_pipelines.models import stop_token_ids
    from tinker_pipelines.rollout.sampler import Sampler

    torch.set_num_threads(int(THREADS))
    model, tok = load_model("tiny", seed=0, dtype="float32", device="cpu")
    local = Sampler(model, tok.pad_token_id, stop_token_ids(tok)).sample(
        [[3, 4, 5, 6]] * 2, 6, 1.0, torch.Generator().manual_seed(1234))
    assert [list(x.tokens) for x in local] == [s.tokens for s in a.sequences]
    for x, s in zip(local, a.sequences):
        assert s.logprobs == pytest.approx(list(x.logprobs), abs=1e-6)


def test_prompt_logprobs_match_forward(client):
    tc = client.create_lora_training_client("tiny", rank=4, seed=1).result()
    sc = tc.save_weights_and_get_sampling_client().result()
    tokens = [5, 9, 13, 21, 34]
    lps = sc.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert lps[0] is None and len(lps) == len(tokens)
    fwd = tc.forward([_sft_datum(tokens)], "cross_entropy").result()
    got = fwd.loss_fn_outputs[0]["logprobs"].to_torch().tolist()
    assert got == pytest.approx(lps[1:], abs=1e-5)


def test_save_and_load_state_resume_bit_for_bit(client):
    tc = client.create_lora_training_client("tiny", rank=4, seed=5).result()
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    path = tc.save_state("after-one").result().path
    assert path == f"tinker://{tc.model_id}/weights/after-one"
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    want = tc.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"]

    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    resumed.forward_backward(DATA, "cross_entropy").result()
    resumed.optim_step(ADAM).result()
    assert resumed.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"] == want

    tc.load_state_with_optimizer(path).result()
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    assert tc.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"] == want


def _train(tc, steps: int, loss: str = "importance_sampling") -> list[float]:
    out = []
    data = [_rl_datum([5, 9, 13, 21, 34, 55], 1), _rl_datum([7, 8, 9, 10], 2)]
    for _ in range(steps):
        out.append(tc.forward_backward(data, loss).result().metrics["loss:sum"])
        tc.optim_step(ADAM).result()
    return out


def test_two_clients_interleaved_end_exactly_as_alone(client):
    alone_a = _train(client.create_lora_training_client("tiny", rank=4, seed=11).result(), 3)
    alone_b = _train(client.create_lora_training_client("tiny", rank=8, seed=12).result(), 3, "ppo")
    a = client.create_lora_training_client("tiny", rank=4, seed=11).result()
    b = client.create_lora_training_client("tiny", rank=8, seed=12).result()
    data = [_rl_datum([5, 9, 13, 21, 34, 55], 1), _rl_datum([7, 8, 9, 10], 2)]
    got_a, got_b = [], []
    for _ in range(3):
        fa, fb = a.forward_backward(data, "importance_sampling"), b.forward_backward(data, "ppo")
        got_a.append(fa.result().metrics["loss:sum"])
        got_b.append(fb.result().metrics["loss:sum"])
        oa, ob = a.optim_step(ADAM), b.optim_step(ADAM)
        oa.result(), ob.result()
    assert got_a == alone_a and got_b == alone_b


def test_bad_requests_name_the_field_and_the_service_keeps_serving(client):
    tc = client.create_lora_training_client("tiny", rank=4, seed=2).result()
    bad_loss = [_sft_datum([5, 6, 7])]
    with pytest.raises(tinker.BadRequestError, match="loss_fn_inputs.logprobs is missing"):
        tc.forward_backward(bad_loss, "importance_sampling").result()
    with pytest.raises(tinker.BadRequestError, match="not supported by this service; supported: cross_entropy"):
        tc.forward_backward(bad_loss, "stable_reinforce").result()
    with pytest.raises((tinker.RequestFailedError, tinker.BadRequestError), match="vocabulary"):
        tc.forward_backward([_sft_datum([5, 6, 10_000_000])], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        client.create_lora_training_client("no-such-model", rank=4).result()
    # the same client still trains
    assert tc.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_service_killed_with_sigkill_restarts_and_loads_the_last_checkpoint(tmp_path):
    import signal


    from tinker_pipelines.serving.tinker.launch import start_service_process

    args = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--no-tracking"]
    proc, url = start_service_process(args, tmp_path)
    try:
        with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
            tc = sc.create_lora_training_client("tiny", rank=4, seed=7).result()
            tc.forward_backward(DATA, "cross_entropy").result()
            tc.optim_step(ADAM).result()
            path = tc.save_state("last").result().path
            want = tc.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"]
        worker_pid = int((tmp_path / "worker.pid").read_text())
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # the worker goes with its service (parent-death signal); a machine busy with disk work can
    # take seconds to tear down its memory
    deadline = time.monotonic() + 60
    while not _gone(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker_pid), _state(worker_pid)
    proc, url = start_service_process(args, tmp_path)
    try:
        with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
            resumed = sc.create_training_client_from_state_with_optimizer(path).result()
            assert resumed.forward_backward(DATA, "cross_entropy").result().metrics["loss:sum"] == want
            run = sc.create_rest_client().get_training_run_by_tinker_path(path).result()
            assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)



def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/status").read()
    except FileNotFoundError:
        return "gone"


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_calls_sent_out_of_seq_id_order_run_in_order(client, service):
    """optim_step (seq 2) arrives before the forward_backward (seq 1) whose gradient it applies."""
    import httpx
    from tinker.proto.request_conv import forward_backward_request_to_proto

    tc = client.create_lora_training_client("tiny", rank=4, seed=21).result()
    headers = {"X-API-Key": KEY}
    fb = types.ForwardBackwardRequest(model_id=tc.model_id, seq_id=1, forward_backward_input=types.ForwardBackwardInput(
        data=DATA, loss_fn="cross_entropy"))
    with httpx.Client(base_url=service.url, headers=headers, timeout=60) as http:
        step = http.post("/api/v1/optim_step", json=types.OptimStepRequest(
            model_id=tc.model_id, seq_id=2, optim_params=ADAM).model_dump(mode="json", exclude_none=True))
        assert step.status_code == 200, step.text
        time.sleep(0.5)  # the step waits for seq 1
        grad = http.post("/api/v1/forward_backward", content=forward_backward_request_to_proto(fb).SerializeToString(),
                         headers={"Content-Type": "application/x-protobuf"})
        assert grad.status_code == 200, grad.text

        def result(rid):
            r = http.post("/api/v1/retrieve_future", json={"request_id": rid})
            assert r.status_code == 200, r.text
            return r
        result(grad.json()["request_id"])
        metrics = result(step.json()["request_id"]).json()["metrics"]
    assert metrics["optim/grad_norm:mean"] > 0  # it ran after the gradient was there


def test_checkpoints_are_listed_sampled_and_deleted(client):
    tc = client.create_lora_training_client("tiny", rank=4, seed=9, train_unembed=False).result()
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    sampler_path = tc.save_weights_for_sampler("s1").result().path
    state_path = tc.save_state("w1").result().path
    rest = client.create_rest_client()
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert set(listed) == {"weights/w1", "sampler_weights/s1"}
    assert listed["weights/w1"].tinker_path == state_path
    sc = client.create_sampling_client(model_path=sampler_path).result()
    prompt = types.ModelInput.from_ints([5, 9, 13])
    got = sc.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=3)).result().sequences[0]
    live = tc.save_weights_and_get_sampling_client().result()
    assert live.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=3)).result().sequences[0].tokens == got.tokens
    rest.delete_checkpoint_from_tinker_path(state_path).result()
    assert {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints} == {"sampler_weights/s1"}
    with pytest.raises(tinker.NotFoundError, match="no such checkpoint"):
        client.create_training_client_from_state(state_path).result()


def test_bad_input_gets_the_sdk_error_shape_and_the_service_keeps_serving(client, service):
    import httpx

    with pytest.raises(tinker.NotFoundError, match="training run 'nope:train:0' is unknown"):
        client.create_rest_client().get_training_run("nope:train:0").result()
    headers = {"X-API-Key": KEY}
    with httpx.Client(base_url=service.url, timeout=60) as http:
        r = http.post("/api/v1/get_info", json={"model_id": "nope:train:0", "type": "get_info"}, headers=headers)
        assert r.status_code == 404 and r.json()["field"] == "model_id"
        r = http.post("/api/v1/create_model", headers=headers, json={
            "session_id": "no-such-session", "model_seq_id": 0, "base_model": "tiny", "type": "create_model",
            "lora_config": {"rank": 4}})
        assert r.status_code == 404 and r.json()["field"] == "session_id"
        r = http.post("/api/v1/client/config", json={"sdk_version": "0.24.1"}, headers=headers)
        assert r.status_code == 400 and "sdk_version '0.24.1' is not supported" in r.json()["detail"]
        r = http.post("/api/v1/client/config", json={"sdk_version": "0.38.0"})
        assert r.status_code == 401 and r.json()["field"] == "x-api-key"  # a configured key is required
        r = http.post("/api/v1/optim_step", json={"model_id": "x", "seq_id": 1, "bogus": 1}, headers=headers)
        assert r.status_code == 400 and r.json()["field"]
        settings = service._uvicorn.config.app.state.tinker_settings
        bound, settings.max_body_bytes = settings.max_body_bytes, 1000
        try:
            r = http.post("/api/v1/forward_backward", content=b"\0" * 5000, headers={
                **headers, "Content-Type": "application/x-protobuf"})
            assert r.status_code == 413 and "over this service's bound of 1000 bytes" in r.json()["detail"]
        finally:
            settings.max_body_bytes = bound
    with pytest.raises(tinker.BadRequestError, match="lora_config.rank 128 cannot be hosted here"):
        client.create_lora_training_client("tiny", rank=128).result()
    sc = client.create_sampling_client(base_model="tiny").result()
    with pytest.raises(Exception, match="context"):
        sc.sample(types.ModelInput.from_ints([5] * 5000), 1, types.SamplingParams(max_tokens=2)).result()
    # everyone else is still served
    assert sc.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)).result().sequences
