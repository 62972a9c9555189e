"""Tinker's HTTP API at `/api/v1`, as the pinned SDK (`tinker==0.38.0`) calls it.

Routes decode with the SDK's own request classes and answer with its response classes; an
error is `{"detail": <one line naming the field or id>, "field": ...}` with the status the SDK
turns into the right exception (400 bad request, 401 key, 404 unknown id, 413 body too large).
Statuses the SDK retries (408, 409, 429, 5xx) mean only "try again". The routes are added to
the OpenAI endpoint's app (`tinker_routes`), so one process serves both: a checkpoint a Tinker
client saves is answered by `/v1` from the same worker, behind the same key.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

import pydantic
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tinker import types

from tinker_pipelines.serving.tinker import wire
from tinker_pipelines.serving.tinker.futures import Failed, Proto
from tinker_pipelines.serving.tinker.service import Invalid, NotFound, Service

SUPPORTED_SDK = "0.38"
"""The SDK wire version served: `tinker` 0.38.x (its protobuf forward_backward and sample bodies)."""


class TinkerSettings(pydantic.BaseModel):
    """How the API guards itself."""

    api_key: str | None = None
    """The key every request's X-API-Key must equal; None accepts any key (loopback only)."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body, after zstd; a larger one is refused with 413."""
    poll_s: float = 30.0
    """How long `retrieve_future` holds a poll before answering 408 (the SDK waits 45 s)."""


def _error(status: int, detail: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail, "field": field}, status_code=status)


def _pydantic_error(e: pydantic.ValidationError) -> JSONResponse:
    first = e.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return _error(400, f"{loc or 'body'}: {first.get('msg', 'invalid')}", loc or "body")


async def _parse(request: Request, cls: type[pydantic.BaseModel]) -> Any:
    body = await _body(request)
    return cls.model_validate_json(body or b"{}")


async def _body(request: Request) -> bytes:
    settings: TinkerSettings = request.app.state.tinker_settings
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > settings.max_body_bytes:
        raise _TooLarge(int(declared), settings.max_body_bytes)
    body = await request.body()
    if len(body) > settings.max_body_bytes:
        raise _TooLarge(len(body), settings.max_body_bytes)
    return body


class _TooLarge(Exception):
    def __init__(self, size: int, bound: int):
        super().__init__(f"the request body of {size} bytes is over this service's bound of {bound} bytes")


def _svc(request: Request) -> Service:
    return request.app.state.tinker


def _future(request_id: str, **extra: Any) -> dict[str, Any]:
    return types.UntypedAPIFuture(request_id=request_id, **extra).model_dump(mode="json", exclude_none=True)


# -- service ---------------------------------------------------------------------------------
async def client_config(request: Request) -> Any:
    req = await _parse(request, types.ClientConfigRequest)
    version = str(req.sdk_version or "")
    if version.split(".")[:2] != SUPPORTED_SDK.split("."):
        return _error(400, f"sdk_version {version!r} is not supported: this service speaks the wire format of tinker "
                      f"{SUPPORTED_SDK}.x (pip install 'tinker=={SUPPORTED_SDK}.*')", "sdk_version")
    bound = request.app.state.tinker_settings.max_body_bytes
    return types.ClientConfigResponse(pjwt_auth_enabled=False, proto_compress_fwdbwd=True,
                                      fwdbwd_max_chunk_bytes_count=min(5_000_000, bound // 2),
                                      sample_use_retrieve_futures=False, custom_loss_server_side=False,
                                      sample_join_sampling_session=False, use_pyqwest_transport=False
                                      ).model_dump(mode="json")


async def create_session(request: Request) -> Any:
    return _svc(request).create_session(await _parse(request, types.CreateSessionRequest)).model_dump(mode="json")


async def heartbeat(request: Request) -> Any:
    req = await _parse(request, types.SessionHeartbeatRequest)
    svc = _svc(request)
    s = svc.session(req.session_id)
    if s.finished is not None:
        return _error(410, f"session {req.session_id!r} is finished", "session_id")
    svc.heartbeat(req.session_id)
    return types.SessionHeartbeatResponse().model_dump(mode="json")


async def finish(request: Request) -> Any:
    body = await _body(request)
    import json

    try:
        reason = (json.loads(body or b"{}").get("reason") or {}).get("type", "success")
    except (ValueError, AttributeError):
        raise Invalid("the body must be {'reason': {'type': ...}, 'detail': ...}", "reason") from None
    await _svc(request).finish(request.path_params["session_id"], str(reason))
    return {}


async def telemetry(request: Request) -> Any:
    await _body(request)
    return types.TelemetryResponse(status="accepted").model_dump(mode="json")


async def capabilities(request: Request) -> Any:
    svc = _svc(request)
    return types.GetServerCapabilitiesResponse(supported_models=[types.SupportedModel(
        model_name=svc.base_model, max_context_length=svc.runtime.max_context, trainable=True, sampleable=True)]
    ).model_dump(mode="json")


async def healthz(_request: Request) -> Any:
    return {"status": "ok"}


# -- models and training ---------------------------------------------------------------------
async def create_model(request: Request) -> Any:
    req = await _parse(request, types.CreateModelRequest)
    rid = _svc(request).create_model(req)
    return _future(rid, model_id=f"{req.session_id}:train:{req.model_seq_id}")


async def get_info(request: Request) -> Any:
    req = await _parse(request, types.GetInfoRequest)
    return _svc(request).info(req.model_id).model_dump(mode="json")


async def forward_backward(request: Request) -> Any:
    settings: TinkerSettings = request.app.state.tinker_settings
    body = wire.decompress(await _body(request), request.headers.get("content-encoding"), settings.max_body_bytes)
    if "protobuf" not in request.headers.get("content-type", ""):
        raise Invalid("forward_backward takes a protobuf body (application/x-protobuf), as the tinker SDK sends it",
                      "content-type")
    try:
        call = wire.decode_forward_backward(body)
    except wire.WireError as e:
        if e.slot is not None:
            _svc(request).refused(*e.slot, e)
        raise
    return _future(_svc(request).forward_backward(call), model_id=call.model_id)


async def optim_step(request: Request) -> Any:
    req = await _parse(request, types.OptimStepRequest)
    return _future(_svc(request).optim_step(req), model_id=req.model_id)


async def save_weights(request: Request) -> Any:
    req = await _parse(request, types.SaveWeightsRequest)
    return _future(_svc(request).save_weights(req), model_id=req.model_id)


async def save_for_sampler(request: Request) -> Any:
    req = await _parse(request, types.SaveWeightsForSamplerRequest)
    return _future(_svc(request).save_for_sampler(req), model_id=req.model_id)


async def load_weights(request: Request) -> Any:
    req = await _parse(request, types.LoadWeightsRequest)
    model_id = req.model_id or f"{req.session_id}:train:{req.model_seq_id}"
    return _future(_svc(request).load_weights(req), model_id=model_id)


# -- sampling --------------------------------------------------------------------------------
async def create_sampling_session(request: Request) -> Any:
    req = await _parse(request, types.CreateSamplingSessionRequest)
    sid = await _svc(request).create_sampler(req)
    return types.CreateSamplingSessionResponse(sampling_session_id=sid).model_dump(mode="json")


async def get_sampler(request: Request) -> Any:
    s = _svc(request).sampler(request.path_params["sampler_id"])
    return types.GetSamplerResponse(sampler_id=s.sampler_id, base_model=s.base_model,
                                    model_path=s.model_path).model_dump(mode="json")


async def asample(request: Request) -> Any:
    req = await _parse(request, types.SampleRequest)
    rid, ids = _svc(request).sample(req)
    return _future(rid, sample_sequence_ids=ids)


async def retrieve_future(request: Request) -> Any:
    req = await _parse(request, types.FutureRetrieveRequest)
    fut = _svc(request).futures.get(req.request_id)
    if fut is None:
        raise NotFound(f"request_id {req.request_id!r} is unknown (or its result expired)", "request_id")
    try:
        result = await asyncio.wait_for(asyncio.shield(fut), request.app.state.tinker_settings.poll_s)
    except asyncio.TimeoutError:
        return JSONResponse({"type": "try_again", "request_id": req.request_id, "queue_state": "active"},
                            status_code=408)
    if isinstance(result, Proto):
        return Response(result.body, media_type="application/x-protobuf")
    if isinstance(result, Failed):
        return {"error": result.error, "category": result.category}
    return result


# -- REST: training runs and checkpoints -----------------------------------------------------
async def training_run(request: Request) -> Any:
    return _svc(request).training_run(request.path_params["run_id"]).model_dump(mode="json")


async def list_checkpoints(request: Request) -> Any:
    cps = _svc(request).checkpoints(request.path_params["run_id"])
    return types.CheckpointsListResponse(checkpoints=cps).model_dump(mode="json")


async def delete_checkpoint(request: Request) -> Any:
    _svc(request).delete_checkpoint(request.path_params["run_id"], request.path_params["checkpoint_id"])
    return {}


async def weights_info(request: Request) -> Any:
    import json

    body = json.loads(await _body(request) or b"{}")
    svc = _svc(request)
    model_id, _, _, d = svc.resolve(str(body.get("tinker_path")), "tinker_path")
    meta = svc.checkpoint_meta(model_id, d)
    lora = meta["lora"]
    return types.WeightsInfoResponse(base_model=meta["base_model"], is_lora=True, lora_rank=lora["rank"],
                                     train_unembed=lora["train_unembed"], train_mlp=lora["train_mlp"],
                                     train_attn=lora["train_attn"]).model_dump(mode="json")


ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/client/config", client_config), ("POST", "/create_session", create_session),
    ("POST", "/session_heartbeat", heartbeat), ("POST", "/sessions/{session_id}/finish", finish),
    ("POST", "/telemetry", telemetry), ("GET", "/get_server_capabilities", capabilities), ("GET", "/healthz", healthz),
    ("POST", "/create_model", create_model), ("POST", "/get_info", get_info),
    ("POST", "/forward_backward", forward_backward), ("POST", "/optim_step", optim_step),
    ("POST", "/save_weights", save_weights), ("POST", "/save_weights_for_sampler", save_for_sampler),
    ("POST", "/load_weights", load_weights), ("POST", "/create_sampling_session", create_sampling_session),
    ("GET", "/samplers/{sampler_id}", get_sampler), ("POST", "/asample", asample),
    ("POST", "/retrieve_future", retrieve_future), ("GET", "/training_runs/{run_id}", training_run),
    ("GET", "/training_runs/{run_id}/checkpoints", list_checkpoints),
    ("DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", delete_checkpoint),
    ("POST", "/weights_info", weights_info),
]
"""Every endpoint the pinned SDK and tinker-cookbook's recipes call (see docs/tinker.md)."""


def add_tinker_routes(app: FastAPI, service: Service, settings: TinkerSettings) -> FastAPI:
    """Serve `service` at `/api/v1` on `app` (the OpenAI endpoint's app, or a bare one)."""
    app.state.tinker = service
    app.state.tinker_settings = settings
    router = APIRouter(prefix="/api/v1")
    for method, path, fn in ROUTES:
        router.add_api_route(path, fn, methods=[method], name=f"tinker_{fn.__name__}")
    app.include_router(router)
    app.middleware("http")(_guard)
    return app


async def _guard(request: Request, call_next: Any) -> Response:
    """The key check and the error shape of every `/api/v1` request."""
    if not request.url.path.startswith("/api/v1/"):
        return await call_next(request)
    key = request.app.state.tinker_settings.api_key
    given = request.headers.get("x-api-key", "")
    # healthz answers without a key: it tells a load balancer or a launcher only that the service is up
    if key is not None and request.url.path != "/api/v1/healthz" and \
            not hmac.compare_digest(given.encode(), key.encode()):
        return _error(401, "X-API-Key is missing or wrong for this service", "x-api-key")
    try:
        return await call_next(request)
    except pydantic.ValidationError as e:
        return _pydantic_error(e)
    except (Invalid, wire.WireError) as e:
        return _error(400, str(e), e.field)
    except NotFound as e:
        return _error(404, str(e), e.field)
    except _TooLarge as e:
        return _error(413, str(e), "body")
