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
import json
from typing import Any

import pydantic
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from tinker import types

from tinker_pipelines.serving.tinker import wire
from tinker_pipelines.serving.tinker.external import External
from tinker_pipelines.serving.tinker.futures import Failed, Proto
from tinker_pipelines.serving.tinker.guard import Guard
from tinker_pipelines.serving.tinker.service import Invalid, NotFound, Service
from tinker_pipelines.serving.tinker.tenancy import Keys

SUPPORTED_SDK = "0.38"
"""The SDK wire version served: `tinker` 0.38.x (its protobuf forward_backward and sample bodies)."""


class TinkerSettings(pydantic.BaseModel):
    """How the API guards itself."""

    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)

    api_key: str | None = None
    """The one key every request must carry (X-API-Key, or `Authorization: Bearer` on `/v1`);
    None, with no `keys`, accepts any key (loopback only)."""
    keys: Keys | None = None
    """Several keys, each a tenant of its own (`--api-keys-file`); overrides `api_key`."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body on any route, and after zstd; a larger one is refused with 413."""
    poll_s: float = 30.0
    """How long `retrieve_future` holds a poll before answering 408 (the SDK waits 45 s)."""


    def accepted(self) -> Keys:
        """The keys this service accepts, each with its tenant."""
        if self.keys is not None:
            return self.keys
        return Keys.any_key() if self.api_key is None else Keys.single(self.api_key, "the service's API key")


def _error(status: int, detail: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail, "field": field}, status_code=status)


async def _parse(request: Request, cls: type[pydantic.BaseModel]) -> Any:
    body = await _body(request)
    return cls.model_validate_json(body or b"{}")


async def _body(request: Request) -> bytes:
    return await request.body()  # the guard has read it already, within the bound


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
    node = _svc(request).node
    return types.GetServerCapabilitiesResponse(supported_models=[types.SupportedModel(
        model_name=base, max_context_length=node.info(base).get("max_context"), trainable=True, sampleable=True)
        for base in node.bases]).model_dump(mode="json")


HEALTH_PROBE_S = 2.0
"""How long `healthz` waits for the worker to answer its probe."""


async def healthz(request: Request) -> Any:
    """200 `{"status": "ok"}` while every worker answers, `{"status": "degraded", "workers":
    {label: reason}}` while some do not but every base has one that does (`Node.health`); else
    503 in the service's error shape with the reason (dead, hung, being restarted)."""
    problem, down = await asyncio.to_thread(_svc(request).node.health, HEALTH_PROBE_S)
    if problem is not None:
        return _error(503, problem)
    return {"status": "degraded", "workers": down} if down else {"status": "ok"}


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
    await _svc(request).delete_checkpoint(request.path_params["run_id"], request.path_params["checkpoint_id"])
    return {}


def _checkpoint_id(request: Request) -> str:
    return f"{request.path_params['kind']}/{request.path_params['name']}"


async def publish(request: Request) -> Any:
    _svc(request).publish(request.path_params["run_id"], _checkpoint_id(request), request.method == "POST")
    return {}


async def set_ttl(request: Request) -> Any:
    body = json.loads(await _body(request) or b"{}")
    if not isinstance(body, dict) or "ttl_seconds" not in body:
        raise Invalid("the body must be {'ttl_seconds': SECONDS or null}", "ttl_seconds")
    _svc(request).set_ttl(request.path_params["run_id"], _checkpoint_id(request), body["ttl_seconds"])
    return {}


def _page(request: Request) -> tuple[Any, Any]:
    """`limit` and `offset` query parameters as integers (a non-number is passed on for the service to refuse)."""
    out = []
    for name, default in (("limit", 20), ("offset", 0)):
        raw = request.query_params.get(name)
        out.append(default if raw is None else int(raw) if raw.lstrip("-").isdigit() else raw)
    return out[0], out[1]


async def list_training_runs(request: Request) -> Any:
    return _svc(request).list_runs(*_page(request)).model_dump(mode="json")


async def list_user_checkpoints(request: Request) -> Any:
    return _svc(request).list_user_checkpoints(*_page(request)).model_dump(mode="json")


async def get_session(request: Request) -> Any:
    return _svc(request).get_session(request.path_params["session_id"]).model_dump(mode="json")


async def list_sessions(request: Request) -> Any:
    return _svc(request).list_sessions(*_page(request)).model_dump(mode="json")


async def not_served(request: Request) -> Any:
    raise NotFound(f"{request.method} {request.url.path} is not an endpoint of this service (see docs/tinker.md "
                   "for what it serves)", "path")


async def weights_info(request: Request) -> Any:
    body = json.loads(await _body(request) or b"{}")
    if not isinstance(body, dict) or not isinstance(body.get("tinker_path"), str):
        raise Invalid("the body must be {'tinker_path': 'tinker://...'}", "tinker_path")
    svc = _svc(request)
    model_id, _, _, d = svc.resolve(body["tinker_path"], "tinker_path")
    meta = svc.checkpoint_meta(model_id, d)
    lora = meta["lora"]
    return types.WeightsInfoResponse(base_model=meta["base_model"], is_lora=True, lora_rank=lora["rank"],
                                     train_unembed=lora["train_unembed"], train_mlp=lora["train_mlp"],
                                     train_attn=lora["train_attn"]).model_dump(mode="json")


async def save_weights_external(request: Request) -> Any:
    req = await _parse(request, types.SaveWeightsExternalRequest)
    return _future(request.app.state.tinker_external.save(_svc(request), req), model_id=req.model_id)


async def external_weights_urls(request: Request) -> Any:
    p = request.path_params
    return request.app.state.tinker_external.urls(_svc(request), p["run_id"], _checkpoint_id(request),
                                                  str(request.base_url)).model_dump(mode="json")


async def external_weights_file(request: Request) -> Any:
    """A file of an external weights checkpoint; no key: the URL's signature is checked instead."""
    p = request.path_params
    path = request.app.state.tinker_external.file(p["run_id"], p["name"], p["file"], request.query_params)
    return FileResponse(path, media_type="application/json" if path.suffix == ".json" else "application/octet-stream")


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
    ("POST", "/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", publish),
    ("DELETE", "/training_runs/{run_id}/checkpoints/{kind}/{name}/publish", publish),
    ("PUT", "/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", set_ttl),
    ("DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", delete_checkpoint),
    ("GET", "/training_runs", list_training_runs), ("GET", "/checkpoints", list_user_checkpoints),
    ("GET", "/sessions/{session_id}", get_session), ("GET", "/sessions", list_sessions),
    ("POST", "/weights_info", weights_info), ("POST", "/save_weights_external", save_weights_external),
    ("GET", "/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls", external_weights_urls),
    ("GET", "/external_weights/{run_id}/{name}/{file:path}", external_weights_file),
]
"""Every endpoint the pinned SDK and tinker-cookbook's recipes call (see docs/tinker.md)."""


def add_tinker_routes(app: FastAPI, service: Service, settings: TinkerSettings) -> FastAPI:
    """Serve `service` at `/api/v1` on `app` (the OpenAI endpoint's app, or a bare one)."""
    app.state.tinker = service
    app.state.tinker_external = External.open(service.home)
    app.state.tinker_settings = settings
    router = APIRouter(prefix="/api/v1")
    for method, path, fn in ROUTES:
        router.add_api_route(path, fn, methods=[method], name=f"tinker_{fn.__name__}_{method.lower()}")
    # last, so that it answers only what no route above does, in the service's error shape
    router.add_api_route("/{rest:path}", not_served, methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
                         name="tinker_not_served")
    app.include_router(router)
    app.add_middleware(Guard, settings=settings, refuse=service.refused)
    return app
