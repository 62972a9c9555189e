"""The pinned `tinker` SDK's wire format, as a server must read and write it.

Each request is sent by the SDK's own resource methods (its JSON dump, its protobuf encoder and
zstd compression) over a real ASGI app on an in-process transport, and the app decodes it the
way a server would: pydantic request classes from `tinker.types`, protobuf messages from
`tinker.proto.tinker_public_pb2`. Results a server encodes with that proto module are decoded
by the SDK's own `deserialize_proto_response`. If a new SDK changes any of this, these tests
fail before the Tinker service does.
"""

from __future__ import annotations

import asyncio
import json
import typing

import httpx
import numpy as np
import pytest
import zstandard
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import tinker
from tinker import types
from tinker._client import AsyncTinker
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import PROTO_SUPPORTED_TYPES, deserialize_proto_response
from tinker.types.loss_fn_type import LossFnType
from tinker.types.try_again_response import TryAgainResponse

from tinker_pipelines.algorithms.tinker_losses import TINKER_LOSSES, tinker_loss

SESSION = "probe-session"
MODEL_ID = f"{SESSION}:train:0"  # the id the SDK itself derives for create-by-load


class Recorder:
    """An ASGI app that records every request and answers what the test scripted for its path."""

    def __init__(self):
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.replies: dict[str, Response] = {}
        self.app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST", "DELETE"])])

    async def _handle(self, request: Request) -> Response:
        body = await request.body()
        self.requests.append((request.method, request.url.path, dict(request.headers), body))
        return self.replies.get(request.url.path, JSONResponse({"request_id": "req-1", "model_id": MODEL_ID}))

    def last_json(self, path: str) -> dict:
        method, got_path, headers, body = self.requests[-1]
        assert got_path == path, (got_path, path)
        assert headers["x-api-key"] == "tml-probe"  # the SDK authenticates with this header
        return json.loads(body)


def _run(recorder: Recorder, call, proto_compress: bool = False):
    async def go():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=recorder.app), base_url="http://probe")
        # strict validation, as the SDK's InternalClientHolder builds every AsyncTinker: a response that does
        # not validate against its class raises APIResponseValidationError
        client = AsyncTinker(api_key="tml-probe", base_url="http://probe", http_client=http, max_retries=0,
                             _strict_response_validation=True,
                             _client_config=types.ClientConfigResponse(proto_compress_fwdbwd=proto_compress))
        try:
            return await call(client)
        finally:
            await http.aclose()
    return asyncio.run(go())


def _prompt(tokens=(5, 6, 7)) -> types.ModelInput:
    return types.ModelInput.from_ints(list(tokens))


FUTURE = types.UntypedAPIFuture(request_id="req-1", model_id=MODEL_ID)

# (path, request as the SDK builds it, how the SDK sends it, the response class instance a server answers)
JSON_REQUESTS = [
    ("/api/v1/client/config", types.ClientConfigRequest(sdk_version=tinker.__version__),
     lambda c, r: c.service.client_config(request=r), types.ClientConfigResponse(proto_compress_fwdbwd=True)),
    ("/api/v1/create_session", types.CreateSessionRequest(tags=["a"], user_metadata={"k": "v"},
                                                          sdk_version=tinker.__version__, display_name="d"),
     lambda c, r: c.service.create_session(request=r), types.CreateSessionResponse(session_id=SESSION)),
    ("/api/v1/session_heartbeat", types.SessionHeartbeatRequest(session_id=SESSION),
     lambda c, r: c.service.session_heartbeat(session_id=r.session_id), types.SessionHeartbeatResponse()),
    ("/api/v1/create_model", types.CreateModelRequest(session_id=SESSION, model_seq_id=0, base_model="tiny",
                                                      lora_config=types.LoraConfig(rank=8, seed=3)),
     lambda c, r: c.models.create(request=r), FUTURE),
    ("/api/v1/get_info", types.GetInfoRequest(model_id=MODEL_ID), lambda c, r: c.models.get_info(request=r),
     types.GetInfoResponse(model_id=MODEL_ID, is_lora=True, lora_rank=8, model_name="tiny",
                           model_data=types.ModelData(arch="llama", model_name="tiny", tokenizer_id="tiny"))),
    ("/api/v1/optim_step", types.OptimStepRequest(model_id=MODEL_ID, seq_id=2,
                                                  optim_params=types.AdamParams(learning_rate=1e-3,
                                                                                grad_clip_norm=1.0)),
     lambda c, r: c.training.optim_step(request=r), FUTURE),
    ("/api/v1/save_weights", types.SaveWeightsRequest(model_id=MODEL_ID, path="ckpt-1", seq_id=3, ttl_seconds=60),
     lambda c, r: c.weights.save(request=r), FUTURE),
    ("/api/v1/save_weights_for_sampler", types.SaveWeightsForSamplerRequest(model_id=MODEL_ID, seq_id=4,
                                                                           sampling_session_seq_id=0),
     lambda c, r: c.weights.save_for_sampler(request=r), FUTURE),
    ("/api/v1/load_weights", types.LoadWeightsRequest(model_id=MODEL_ID, seq_id=5, optimizer=True,
                                                      path=f"tinker://{MODEL_ID}/weights/ckpt-1"),
     lambda c, r: c.weights.load(request=r), FUTURE),
    ("/api/v1/load_weights", types.LoadWeightsRequest(session_id=SESSION, model_seq_id=1, optimizer=False,
                                                      path=f"tinker://{MODEL_ID}/weights/ckpt-1"),
     lambda c, r: c.weights.load(request=r), FUTURE),
    ("/api/v1/create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=SESSION, sampling_session_seq_id=1, model_path=f"tinker://{MODEL_ID}/sampler_weights/s1"),
     lambda c, r: c.service.create_sampling_session(request=r),
     types.CreateSamplingSessionResponse(sampling_session_id=f"{SESSION}:sample:1")),
    ("/api/v1/asample", types.SampleRequest(
        sampling_session_id=f"{SESSION}:sample:0", seq_id=0, num_samples=4, prompt=_prompt(), prompt_logprobs=True,
        sampling_params=types.SamplingParams(max_tokens=5, temperature=0.7, top_k=20, top_p=0.9, seed=11,
                                             stop=["\n", "END"])),
     lambda c, r: c.sampling.asample(request=r),
     types.UntypedAPIFuture(request_id="req-2", sample_sequence_ids=["q0", "q1", "q2", "q3"])),
    ("/api/v1/asample", types.SampleRequest(
        sampling_session_id=f"{SESSION}:sample:0", seq_id=1, prompt=_prompt(),
        sampling_params=types.SamplingParams(max_tokens=1, stop=[2, 3]), prompt_logprobs_last_n=2),
     lambda c, r: c.sampling.asample(request=r), types.UntypedAPIFuture(request_id="req-3", sample_sequence_ids=["q4"])),
    ("/api/v1/telemetry", types.TelemetrySendRequest(events=[], platform="linux", sdk_version=tinker.__version__,
                                                     session_id=SESSION, process_uuid="p"),
     lambda c, r: c.telemetry.send(request=r), types.TelemetryResponse(status="accepted")),
]


@pytest.mark.parametrize("path,request_obj,send,response", JSON_REQUESTS,
                         ids=[f"{p}#{i}" for i, (p, *_) in enumerate(JSON_REQUESTS)])
def test_json_requests_decode_into_the_sdk_request_class(path, request_obj, send, response):
    recorder = Recorder()
    recorder.replies[path] = JSONResponse(response.model_dump(mode="json"))
    got = _run(recorder, lambda c: send(c, request_obj))
    _, _, headers, _ = recorder.requests[-1]
    assert headers["content-type"] == "application/json"
    decoded = type(request_obj).model_validate(recorder.last_json(path))
    assert decoded == request_obj
    # the discriminator a server can dispatch on travels in the body (model_dump keeps defaults)
    if "type" in type(request_obj).model_fields:
        assert recorder.last_json(path)["type"] == request_obj.type
    assert got == response


def test_get_endpoints_answer_their_response_classes():
    recorder = Recorder()
    caps = types.GetServerCapabilitiesResponse(supported_models=[types.SupportedModel(
        model_name="tiny", max_context_length=256, trainable=True, sampleable=True)])
    recorder.replies["/api/v1/get_server_capabilities"] = JSONResponse(caps.model_dump(mode="json"))
    recorder.replies["/api/v1/healthz"] = JSONResponse({"status": "ok"})
    sampler = types.GetSamplerResponse(sampler_id=f"{SESSION}:sample:0", base_model="tiny")
    recorder.replies[f"/api/v1/samplers/{SESSION}:sample:0"] = JSONResponse(sampler.model_dump(mode="json"))
    assert _run(recorder, lambda c: c.service.get_server_capabilities()) == caps
    assert _run(recorder, lambda c: c.service.health_check()).status == "ok"
    assert _run(recorder, lambda c: c.get(f"/api/v1/samplers/{SESSION}:sample:0",
                                          cast_to=types.GetSamplerResponse)) == sampler
    assert [r[0] for r in recorder.requests] == ["GET", "GET", "GET"]


def _datum(n: int, seed: int) -> types.Datum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, n + 1)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(tokens[1:].astype(np.int64)),
        "logprobs": types.TensorData.from_numpy(-rng.random(n).astype(np.float32)),
        "advantages": types.TensorData.from_numpy(rng.standard_normal(n).astype(np.float32)),
    })


def _decode_datum(msg: pb.Datum) -> tuple[list[int], dict[str, np.ndarray]]:
    """How a server reads a proto datum: int32 token bytes per text chunk, dense tensors by dtype."""
    tokens = [t for chunk in msg.model_input for t in np.frombuffer(chunk.encoded_text.tokens, np.int32)]
    np_dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}
    inputs = {k: np.frombuffer(v.dense, np_dtype[v.dtype]).reshape(list(v.shape)) for k, v in msg.loss_fn_inputs.items()}
    return tokens, inputs


@pytest.mark.parametrize("compress", [True, False])
def test_forward_backward_is_protobuf_optionally_zstd(compress):
    data = [_datum(6, 1), _datum(9, 2)]
    request = types.ForwardBackwardRequest(model_id=MODEL_ID, seq_id=1, forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}))
    recorder = Recorder()
    _run(recorder, lambda c: c.training.forward_backward(request=request, forward_only=not compress), compress)
    _, path, headers, body = recorder.requests[-1]
    assert path == "/api/v1/forward_backward"
    assert headers["content-type"] == "application/x-protobuf"
    assert headers.get("content-encoding") == ("zstd" if compress else None)
    if compress:
        body = zstandard.ZstdDecompressor().decompress(body)
    msg = pb.ForwardBackwardRequest.FromString(body)
    assert (msg.model_id, msg.seq_id, msg.loss_fn, msg.forward_only) == (MODEL_ID, 1, "ppo", not compress)
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items()}
    assert config == pytest.approx({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    assert dict(msg.loss_fn_config) == pytest.approx(config)  # the legacy float map is written too
    assert tinker_loss(msg.loss_fn, config).config == pytest.approx(config)
    assert len(msg.data) == 2
    for sent, got in zip(data, msg.data):
        tokens, inputs = _decode_datum(got)
        assert tokens == sent.model_input.to_ints()
        assert set(inputs) == set(sent.loss_fn_inputs)
        for key, td in sent.loss_fn_inputs.items():
            np.testing.assert_array_equal(inputs[key], td.to_numpy())
            assert inputs[key].dtype == td.to_numpy().dtype


def _batched(arrays: list[np.ndarray], dtype: int) -> pb.BatchedTensor:
    """ForwardBackwardOutput's per-datum field: concatenated bytes plus byte offsets (len + 1)."""
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=dtype)


def test_results_a_server_encodes_decode_in_the_sdk():
    assert PROTO_SUPPORTED_TYPES == {types.ForwardBackwardOutput, types.SampleResponse}
    logprobs = [np.array([-0.5, -1.0, -2.0], np.float32), np.array([-0.25], np.float32)]
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={"loss:sum": 3.5})
    record = out.loss_fn_outputs.add(num_datums=2)
    record.fields["logprobs"].CopyFrom(_batched(logprobs, pb.DTYPE_FLOAT32))
    fb = deserialize_proto_response(out.SerializeToString(), types.ForwardBackwardOutput)
    assert fb.metrics == {"loss:sum": 3.5} and fb.loss_fn_output_type == "ArrayRecord"
    assert [o["logprobs"].to_numpy().tolist() for o in fb.loss_fn_outputs] == [a.tolist() for a in logprobs]

    sample = pb.SampleResponse(prompt_logprobs=np.array([np.nan, -1.5], np.float32).tobytes())
    sample.sequences.add(stop_reason=pb.STOP_REASON_STOP, tokens=np.array([4, 2], np.int32).tobytes(),
                         logprobs=np.array([-0.1, -0.2], np.float32).tobytes())
    sample.sequences.add(stop_reason=pb.STOP_REASON_LENGTH, tokens=np.array([9], np.int32).tobytes())
    sr = deserialize_proto_response(sample.SerializeToString(), types.SampleResponse)
    assert [s.stop_reason for s in sr.sequences] == ["stop", "length"]
    assert sr.sequences[0].tokens == [4, 2] and sr.sequences[0].logprobs == pytest.approx([-0.1, -0.2])
    assert sr.sequences[1].logprobs is None
    assert sr.prompt_logprobs == [None, -1.5]  # NaN marks an unscored position (the first token)


def test_retrieve_future_outcomes_and_error_bodies():
    """What retrieve_future may answer and how the SDK reads each (see api_future_impl.py)."""
    recorder = Recorder()
    path = "/api/v1/retrieve_future"
    retrieve = lambda c: c.futures.with_raw_response.retrieve(  # noqa: E731
        request=types.FutureRetrieveRequest(request_id="req-1"), max_retries=0)
    # a JSON result validates as the response class of the request
    recorder.replies[path] = JSONResponse({"model_id": MODEL_ID, "type": "create_model"})
    raw = _run(recorder, lambda c: retrieve(c))
    assert types.CreateModelResponse.model_validate(raw.http_response.json()).model_id == MODEL_ID
    # still running: 200 with a try_again body, which the SDK polls again
    recorder.replies[path] = JSONResponse({"type": "try_again", "request_id": "req-1", "queue_state": "active"})
    body = _run(recorder, lambda c: retrieve(c)).http_response.json()
    assert TryAgainResponse.model_validate(body).queue_state == "active"
    # a failed request: 200 with error + category, raised by the SDK as RequestFailedError(category)
    recorder.replies[path] = JSONResponse({"error": "loss_fn 'x' is not supported", "category": "user"})
    body = _run(recorder, lambda c: retrieve(c)).http_response.json()
    assert types.RequestFailedResponse.model_validate(body).category is types.RequestErrorCategory.User
    # the long-poll timing out: 408 (the SDK retries at once, reading queue_state from the body)
    recorder.replies[path] = JSONResponse({"type": "try_again", "queue_state": "active"}, status_code=408)
    with pytest.raises(tinker.APIStatusError) as e:
        _run(recorder, lambda c: retrieve(c))
    assert e.value.status_code == 408 and e.value.body == {"type": "try_again", "queue_state": "active"}


@pytest.mark.parametrize("status,exc", [(400, tinker.BadRequestError), (401, tinker.AuthenticationError),
                                        (404, tinker.NotFoundError), (409, tinker.ConflictError),
                                        (422, tinker.UnprocessableEntityError), (429, tinker.RateLimitError),
                                        (500, tinker.InternalServerError)])
def test_http_error_status_maps_to_sdk_exception_with_json_body(status, exc):
    recorder = Recorder()
    detail = {"detail": "model_id 'nope' is unknown", "field": "model_id"}
    recorder.replies["/api/v1/get_info"] = JSONResponse(detail, status_code=status)
    with pytest.raises(exc) as e:
        _run(recorder, lambda c: c.models.get_info(request=types.GetInfoRequest(model_id="nope")))
    assert e.value.status_code == status and e.value.body == detail
    assert "model_id 'nope' is unknown" in e.value.message


def test_session_finish_and_rest_paths():
    recorder = Recorder()
    recorder.replies[f"/api/v1/sessions/{SESSION}/finish"] = Response(status_code=200)
    _run(recorder, lambda c: c.post(f"/api/v1/sessions/{SESSION}/finish",
                                    body={"reason": {"type": "success"}, "detail": None}, cast_to=type(None)))
    assert recorder.last_json(f"/api/v1/sessions/{SESSION}/finish") == {"reason": {"type": "success"}, "detail": None}
    # rolling checkpoint deletion: the checkpoint id keeps its "weights/" segment, so the route has a slash in it
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(f"tinker://{MODEL_ID}/weights/ckpt-1")
    assert (parsed.training_run_id, parsed.checkpoint_type, parsed.checkpoint_id) == (MODEL_ID, "training",
                                                                                     "weights/ckpt-1")
    recorder.replies[f"/api/v1/training_runs/{MODEL_ID}/checkpoints/weights/ckpt-1"] = Response(status_code=200)
    _run(recorder, lambda c: c.delete(f"/api/v1/training_runs/{parsed.training_run_id}/checkpoints/"
                                      f"{parsed.checkpoint_id}", cast_to=type(None)))
    method, path, _, _ = recorder.requests[-1]
    assert (method, path) == ("DELETE", f"/api/v1/training_runs/{MODEL_ID}/checkpoints/weights/ckpt-1")
    # resume reads the run's user_metadata (renderer_name) through GET training_runs/{id}
    run = {"training_run_id": MODEL_ID, "base_model": "tiny", "model_owner": "local", "is_lora": True, "lora_rank": 8,
           "last_request_time": "2026-01-01T00:00:00Z", "user_metadata": {"renderer_name": "role_colon"}}
    recorder.replies[f"/api/v1/training_runs/{MODEL_ID}"] = JSONResponse(run)
    got = _run(recorder, lambda c: c.get(f"/api/v1/training_runs/{MODEL_ID}", cast_to=types.TrainingRun))
    assert got.user_metadata == {"renderer_name": "role_colon"} and recorder.requests[-1][0] == "GET"


def test_our_supported_losses_are_sdk_loss_names_and_the_rest_are_refused():
    sdk_names = set(typing.get_args(LossFnType))
    assert set(TINKER_LOSSES) <= sdk_names
    for name in sdk_names - set(TINKER_LOSSES):
        with pytest.raises(ValueError, match="supported: cross_entropy, importance_sampling, ppo, cispo, dro"):
            tinker_loss(name)


def test_a_response_that_does_not_validate_is_an_sdk_error():
    recorder = Recorder()
    recorder.replies["/api/v1/create_session"] = JSONResponse({"type": "create_session"})  # no session_id
    with pytest.raises(tinker.APIResponseValidationError):
        _run(recorder, lambda c: c.service.create_session(request=types.CreateSessionRequest(
            tags=[], user_metadata=None, sdk_version=tinker.__version__)))
