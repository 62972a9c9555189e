"""The guard in front of every route of the Tinker service's app: Tinker's `/api/v1`, the OpenAI
`/v1`, the docs and anything else the app serves.

For each HTTP request, before any route runs:
- the key (`X-API-Key`, as the tinker SDK sends it, or `Authorization: Bearer`, as the openai
  client does) must be one the service accepts (401 otherwise); its tenant becomes the request's
  (`tenancy.serve_as`). Only `SIGNED_PREFIX` routes go without a key: their URL carries a
  signature of its own, checked by the route;
- the body is read here, at most `max_body_bytes` of it (413 past that, whatever Content-Length
  says or does not say), and handed to the route as it came.

After the route: an exception becomes an answer in the service's error shape,
`{"detail": <one line naming the field>, "field": ...}`, with a status the SDK does not retry
for a bad request (400, 404, 410, 413) and 500 only for our own faults. A training call that
is answered with an error before it was ordered still uses up its `seq_id` (`refuse`), so the
client's next call runs at once instead of waiting for a call that will never come.
"""

from __future__ import annotations

import io
import json
import logging
import re
from typing import Any, Awaitable, Callable

import pydantic
import zstandard

from tinker_pipelines.serving.tinker import tenancy

log = logging.getLogger(__name__)

SIGNED_PREFIX = "/api/v1/external_weights/"
"""Download routes whose URLs are signed (`get_external_weights_urls`): no key needed."""
RETRIED = (408, 409, 429)
"""4xx statuses the SDK retries (`_base_client._should_retry`, with every 5xx): never a bad request's."""
PREFIX_BYTES = 64 * 1024
"""What is kept of each end of a body too large to serve: enough to read its model_id and seq_id."""
DRAIN_FACTOR = 4
"""A too-large body is read (and dropped) up to this many times the bound, to find its seq_id."""


def classify(e: BaseException) -> tuple[int, str, str | None]:
    """(status, one-line detail, field) of an exception raised while serving a request."""
    if isinstance(e, pydantic.ValidationError):
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return 400, f"{loc or 'body'}: {first.get('msg', 'invalid')}", loc or "body"
    if isinstance(e, json.JSONDecodeError):
        return 400, f"the body is not JSON ({e.msg} at character {e.pos})", "body"
    field, status = getattr(e, "field", None), getattr(e, "status", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in RETRIED:
        return status, _line(e), field
    if isinstance(e, LookupError) and isinstance(field, str):
        return 404, _line(e), field
    if isinstance(e, ValueError) and isinstance(field, str):  # wire.WireError, service.Invalid
        return 400, _line(e), field
    return 500, f"the service failed this request ({type(e).__name__}: {_line(e)}); it was logged", None


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


async def _send_json(send: Callable[[dict], Awaitable[None]], status: int, detail: str, field: str | None) -> None:
    body = json.dumps({"detail": detail, "field": field}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _given_key(headers: dict[str, str]) -> str | None:
    if "x-api-key" in headers:
        return headers["x-api-key"]
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def read_bounded(receive: Callable[[], Awaitable[dict]], bound: int, declared: int | None) -> tuple[bytes, bool]:
    """(the body, False), or, when it is over `bound`, (its first and last `PREFIX_BYTES`, True):
    a refused training call's model_id and seq_id are at one end or the other (JSON puts
    `seq_id` after a long `path`; protobuf writes both first). Past `DRAIN_FACTOR` times the
    bound nothing more is read."""
    chunks, total = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        total += len(chunk)
        chunks.append(chunk)
        if total > bound or (declared is not None and declared > bound):
            return await _ends(b"".join(chunks), message, receive, bound * DRAIN_FACTOR - total), True
        if not message.get("more_body", False):
            break
    return b"".join(chunks), False


async def _ends(head: bytes, last: dict, receive: Callable[[], Awaitable[dict]], budget: int) -> bytes:
    """The first and last `PREFIX_BYTES` of a body whose start is `head`, reading (and dropping)
    the rest while `budget` lasts."""
    tail = head[-PREFIX_BYTES:]
    head = head[:PREFIX_BYTES]
    while last.get("more_body", False) and budget > 0:
        last = await receive()
        if last["type"] != "http.request":
            break
        chunk = last.get("body", b"")
        budget -= len(chunk)
        tail = (tail + chunk)[-PREFIX_BYTES:]
    return head + b"\n" + tail if tail and not head.endswith(tail) else head


_JSON_MODEL = re.compile(rb'"model_id"\s*:\s*"([^"\\]{1,300})"')
_JSON_SEQ = re.compile(rb'"seq_id"\s*:\s*(\d{1,18})')


def training_slot(body: bytes, headers: dict[str, str]) -> tuple[str, int] | None:
    """(model_id, seq_id) of a training call's body (JSON or protobuf, whole or a prefix), if it names both."""
    if "protobuf" in headers.get("content-type", ""):
        try:
            raw = body if headers.get("content-encoding", "identity").lower() in ("identity", "") else \
                _inflate_prefix(body)
        except (ValueError, zstandard.ZstdError):
            return None
        return _proto_slot(raw)
    model, seq = _JSON_MODEL.search(body), _JSON_SEQ.search(body)
    if model is None or seq is None:
        return None
    return model.group(1).decode(errors="replace"), int(seq.group(1))


def _inflate_prefix(body: bytes) -> bytes:
    """As much of a zstd body as decodes (its head is all `_proto_slot` needs)."""
    out = bytearray()
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body))
    try:
        while len(out) < PREFIX_BYTES:
            chunk = reader.read(4096)
            if not chunk:
                break
            out += chunk
    except zstandard.ZstdError:
        pass  # a truncated frame: keep what decoded
    return bytes(out)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return value, i


def _proto_slot(buf: bytes) -> tuple[str, int] | None:
    """Fields 1 (model_id) and 2 (seq_id) of a ForwardBackwardRequest, written first by every
    protobuf encoder (fields go out in number order), so a prefix of the body holds them."""
    model_id, seq_id, i = None, None, 0
    try:
        while i < len(buf) and (model_id is None or seq_id is None):
            tag, i = _varint(buf, i)
            number, kind = tag >> 3, tag & 7
            if kind == 0:
                value, i = _varint(buf, i)
                if number == 2:
                    seq_id = value
            elif kind == 2:
                size, i = _varint(buf, i)
                if number == 1:
                    model_id = buf[i:i + size].decode()
                i += size
            else:
                return None
    except (ValueError, UnicodeDecodeError):
        return None
    return (model_id, seq_id) if model_id and seq_id is not None else None


class Guard:
    """ASGI middleware: keys, body bound, error shape and seq_id use-up (see the module's doc).
    `refuse(model_id, seq_id, message)` uses up a training call's slot."""

    def __init__(self, app: Any, settings: Any, refuse: Callable[[str, int, str], None]):
        self.app = app
        self.settings = settings
        self.keys = settings.accepted()
        self.refuse = refuse

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        signed = path.startswith(SIGNED_PREFIX)
        tenant = tenancy.LOCAL if signed else self.keys.tenant(_given_key(headers))
        if tenant is None:
            return await _send_json(send, 401, "the API key (X-API-Key, or Authorization: Bearer) is missing or not "
                                    "one this service accepts", "x-api-key")
        declared = headers.get("content-length", "")
        bound = self.settings.max_body_bytes
        body, too_large = await read_bounded(receive, bound, int(declared) if declared.isdigit() else None)
        token = tenancy.serve_as(tenant)
        try:
            if too_large:
                detail = f"the request body is over this service's bound of {bound} bytes"
                self._use_up(path, headers, body, detail)
                return await _send_json(send, 413, detail, "body")
            status = await self._serve(scope, receive, send, body)
            if status >= 400:
                self._use_up(path, headers, body, f"refused with HTTP {status}")
        finally:
            tenancy.reset(token)

    async def _serve(self, scope: dict, receive: Callable, send: Callable, body: bytes) -> int:
        started: list[int] = []
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def capture(message: dict) -> None:
            if message["type"] == "http.response.start":
                started.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, replay, capture)
        except Exception as e:  # noqa: BLE001 - every failure becomes an answer in the service's shape
            if started:
                raise  # the answer has begun: nothing can replace it
            status, detail, field = classify(e)
            if status >= 500:
                log.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=e)
            await _send_json(send, status, detail, field)
            return status
        return started[0] if started else 500

    def _use_up(self, path: str, headers: dict[str, str], body: bytes, why: str) -> None:
        if scope_is_training(path):
            slot = training_slot(body, headers)
            if slot is not None:
                self.refuse(slot[0], slot[1], why)


def scope_is_training(path: str) -> bool:
    """A POST under `/api/v1` may be a training client's call (only those carry a model_id and seq_id)."""
    return path.startswith("/api/v1/") and not path.startswith(SIGNED_PREFIX)
