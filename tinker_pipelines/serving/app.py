"""The OpenAI-compatible HTTP app: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

The `model` field names a base (`Server.base_name` or one of its `aliases`) or a registry version
(`MODEL@ALIAS`, `MODEL/VERSION`, `MODEL` for the latest). An app may serve several bases, one
`Server` each (`Servers`): a request goes to the server of the base its `model` names, a version to
the server of the base it was trained on (its `tinker.base` tag; without one, the first server's).
A stream decodes in segments of `stream_tokens`: each segment is one request to the backend's next
clock cycle, so a streaming client shares batches with everyone else, and one that goes away stops
at the next segment boundary and frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tinker_pipelines.models import render_chat
from tinker_pipelines.rollout.sampler import BASE, Sample, SampleRequest
from tinker_pipelines.serving import protocol as P
from tinker_pipelines.serving.backend import AdapterCache
from tinker_pipelines.serving.errors import ServingError, bad_request, model_not_found


@dataclass
class Server:
    """What the app serves: a backend over one base, its tokenizer, and the registry."""

    backend: Any
    tokenizer: Any
    base_name: str
    """The base model's id in `model` fields and `/v1/models`."""
    base_identity: str
    """`models.base_identity` of the served base; a version trained on another base is refused."""
    registry: Any = None
    max_adapters: int = 4
    max_concurrent: int = 64
    """Requests decoding at once; more wait for a slot."""
    stream_tokens: int = 8
    """Tokens per streamed segment (one backend request each)."""
    default_max_tokens: int = 256
    created: int = field(default_factory=lambda: int(time.time()))
    active: int = 0
    """Requests holding a slot now (`/health`)."""
    aliases: tuple[str, ...] = ()
    """Other names of the base in `model` fields (a model directory's absolute path and name)."""

    def __post_init__(self) -> None:
        self.cache = AdapterCache(self.backend, self.max_adapters)
        self.max_context = self.backend.max_context
        self.stop_ids = set(self.backend.stop_token_ids)
        self._slots: asyncio.Semaphore | None = None

    # -- models ----------------------------------------------------------------------------
    async def acquire(self, model: str) -> tuple[str, str | None, Any]:
        """(engine adapter, cache key or None for the base, Version or None); 404 naming an unknown one."""
        if model in (self.base_name, "base", *self.aliases):
            return BASE, None, None
        if self.registry is None:
            raise model_not_found(model, f"this server serves only its base {self.base_name!r} (no registry)")
        name, version = await asyncio.to_thread(self.registry.resolve, model)
        key = f"{name}/{version}"

        def fetch():
            v = self.registry.fetch(name, version)
            if v.base != self.base_identity:
                raise ServingError(400, f"{name} v{version} was trained on base {v.base}; this server serves "
                                        f"{self.base_identity} (start one with --model {v.base_path})",
                                   "invalid_request_error", "model", "model_base_mismatch")
            return v
        adapter, v = await asyncio.to_thread(self.cache.acquire, key, fetch)
        return adapter, key, v

    def release(self, key: str | None) -> None:
        if key is not None:
            self.cache.release(key)

    def card(self, model_id: str, v: Any = None) -> dict[str, Any]:
        out = {"id": model_id, "object": "model", "created": self.created, "owned_by": "tinker-pipelines",
               "root": model_id if v is None else self.base_name, "parent": None if v is None else self.base_name,
               "max_model_len": self.max_context, "stop_token_ids": sorted(self.stop_ids)}
        if v is not None:  # what a client needs to play the version's env against it (`serving.client`)
            from tinker_pipelines.config import config_to_dict

            out["tinker"] = {"registered_model": v.model, "version": v.version,
                             "config": None if v.config is None else config_to_dict(v.config), "learner": v.learner}
        return out

    # -- decoding --------------------------------------------------------------------------
    def slots(self) -> asyncio.Semaphore:
        if self._slots is None:  # made inside the server's event loop
            self._slots = asyncio.Semaphore(self.max_concurrent)
        return self._slots

    async def sample(self, adapter: str, prompts: list[list[int]], max_tokens: int, temperature: float,
                     gen: torch.Generator | None, extra: dict[str, Any]) -> list[Sample]:
        job = self.backend.submit(SampleRequest(prompts, max_tokens, temperature, gen, adapter, **extra))
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.cancelled = True  # the compute thread skips it if it has not started
            raise
        except ValueError as e:  # the sampler refused a parameter (the fields were checked already)
            raise bad_request(str(e)) from None

    def check_lengths(self, prompts: list[list[int]], params: P.Params, what: str) -> int:
        longest = max(len(p) for p in prompts)
        if params.max_tokens is None:
            max_tokens = min(self.default_max_tokens, max(1, self.max_context - longest)) \
                if what == "messages" else 16  # OpenAI's defaults: as much as fits / 16
        else:
            max_tokens = params.max_tokens
        if longest + max_tokens > self.max_context:
            raise P.context_error(longest, max_tokens, self.max_context, what)
        return max_tokens

    def text(self, tokens: tuple[int, ...] | list[int], stop: tuple[str, ...] = ()) -> tuple[str, bool]:
        """(the reply's text as OpenAI returns it, whether a stop string ended it): stop tokens and
        special tokens dropped, cut before the first stop string."""
        text = self.tokenizer.decode([t for t in tokens if t not in self.stop_ids], skip_special_tokens=True)
        cuts = [at for x in stop if (at := text.find(x)) >= 0]
        return (text[: min(cuts)], True) if cuts else (text, False)


class Servers:
    """Every base an app serves, one `Server` each; the first is the default (`model: "base"`)."""

    def __init__(self, servers: list[Server]):
        if not servers:
            raise ValueError("an OpenAI endpoint needs at least one server")
        self.all = list(servers)
        self.default = self.all[0]
        self._by_name: dict[str, Server] = {"base": self.default}
        for s in reversed(self.all):  # a name two bases share goes to the earlier one
            self._by_name.update({n: s for n in (s.base_name, *s.aliases)})
        self._trained_on: dict[tuple[str, str], str | None] = {}
        """(registered model, version) -> its `tinker.base` tag: a version's tags are set as it is registered."""

    def bases(self) -> str:
        return ", ".join(repr(s.base_name) for s in self.all)

    async def route(self, model: Any) -> Server:
        """The server of the base `model` names, or of the base a registry version was trained on;
        404 naming the served bases for a model none serves. One base: always its server, whose
        `acquire` answers for the model as it always did."""
        if len(self.all) == 1 or not isinstance(model, str) or not model:  # a bad `model` is check_params' 400
            return self.default
        if model in self._by_name:
            return self._by_name[model]
        registry = self.default.registry
        if registry is None:
            raise model_not_found(model, f"this server serves only its bases {self.bases()} (no registry)")
        try:
            name, version = await asyncio.to_thread(registry.resolve, model)
        except ServingError as e:
            if e.code != "model_not_found":
                raise
            raise ServingError(404, f"{e.message}; this server serves the bases {self.bases()} and registered "
                                    "versions trained on them", e.type, "model", e.code) from None
        if (name, version) not in self._trained_on:
            self._trained_on[name, version] = await asyncio.to_thread(registry.trained_on, name, version)
        identity = self._trained_on[name, version]
        # untagged (or another base's): the default, whose `acquire` names the base to start
        return next((s for s in self.all if s.base_identity == identity), self.default)


def build_app(server: Server | list[Server]) -> FastAPI:
    """The FastAPI app over `server`, or over several, one per base, the first the default (every
    route finds them as `request.app.state.servers`, the default also as `.server`)."""
    app = FastAPI(title="tinker-pipelines OpenAI-compatible endpoint")
    app.state.servers = Servers(server if isinstance(server, list) else [server])
    app.state.server = app.state.servers.default
    app.add_exception_handler(ServingError, _serving_error)
    app.add_exception_handler(404, _no_route)
    app.add_exception_handler(405, _no_method)
    app.add_exception_handler(Exception, _internal)
    # name=: the OpenAPI operation ids and summaries (`chat_v1_chat_completions_post`, "Chat") clients see
    app.get("/v1/models", name="models")(_models)
    app.get("/v1/models/{model:path}", name="model")(_model)
    app.get("/health", name="health")(_health)
    app.post("/v1/completions", name="completions")(_completions)
    app.post("/v1/chat/completions", name="chat")(_chat)
    return app


# -- errors: every one in OpenAI's error shape ----------------------------------------------
async def _serving_error(_req: Request, e: ServingError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _no_route(req: Request, _e: Exception) -> JSONResponse:
    return JSONResponse(ServingError(404, f"Invalid URL ({req.method} {req.url.path})").body(), status_code=404)


async def _no_method(req: Request, _e: Exception) -> JSONResponse:
    return JSONResponse(ServingError(405, f"Method {req.method} is not allowed on {req.url.path}").body(),
                        status_code=405)


async def _internal(_req: Request, e: Exception) -> JSONResponse:
    msg = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return JSONResponse(ServingError(500, msg, "server_error").body(), status_code=500)


# -- routes ---------------------------------------------------------------------------------
def _servers_of(req: Request) -> Servers:
    return req.app.state.servers


async def _models(req: Request):
    data = []
    for server in _servers_of(req).all:
        data += [server.card(server.base_name)] + [server.card(k, v) for k, (_, v) in list(server.cache.loaded.items())]
    return {"object": "list", "data": data}


async def _model(model: str, req: Request):
    server = await _servers_of(req).route(model)
    adapter, key, v = await server.acquire(model)
    server.release(key)
    return server.card(key or server.base_name, v)


async def _health(req: Request):
    """Totals over every base (one base: its own figures, as always) and each base's own."""
    servers = _servers_of(req).all
    each = {s.base_name: {"active_requests": s.active, "loaded": list(s.cache.loaded), "batches": s.backend.batches}
            for s in servers}
    return {"status": "ok", "active_requests": sum(b["active_requests"] for b in each.values()),
            "loaded": [k for b in each.values() for k in b["loaded"]],
            "batches": sum(b["batches"] for b in each.values()), "bases": each}


async def _completions(req: Request):
    server, body, params = await _body_of(req, P.COMPLETIONS)
    for key, default in (("echo", False), ("best_of", 1), ("suffix", None)):
        if body.get(key, default) not in (default, None):
            raise bad_request(f"{key} is not supported by this endpoint", key)
    k = _top_logprobs(params, P.logprobs_asked(body, chat=False))
    prompts = P.completion_prompts(body, server.tokenizer)
    max_tokens = server.check_lengths(prompts, params, "prompt")
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    return await _respond(server, body, params, "text_completion", [p for p in prompts for _ in range(params.n)],
                          max_tokens, lambda s, i: _text_choice(server, s, i, k, as_ids,
                                                                params.extra.get("stop", ())), tools=False)


async def _chat(req: Request):
    server, body, params = await _body_of(req, P.CHAT)
    _check_chat_fields(body)
    messages = P.chat_messages(body)
    tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
    prompt = _chat_prompt(server, messages, body.get("tools"))
    max_tokens = server.check_lengths([prompt], params, "messages")
    k = _top_logprobs(params, P.logprobs_asked(body, chat=True))
    return await _respond(server, body, params, "chat.completion", [prompt] * params.n, max_tokens,
                          lambda s, i: _chat_choice(server, s, i, tools, k, params.extra.get("stop", ())),
                          tools=tools)


def _top_logprobs(params: P.Params, k: int | None) -> int | None:
    """Ask the sampler for `k` alternatives per token (`SampleRequest.top_logprobs`); `k` back."""
    if k:
        params.extra["top_logprobs"] = k
    params.logprobs = k
    return k


async def _body_of(req: Request, allowed: set[str]) -> tuple[Server, dict, P.Params]:
    """The server of the base the request's `model` names, the request's JSON object and its
    checked sampling parameters; 400 for anything else, 404 for a model no server serves."""
    raw = await req.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"We could not parse the JSON body of your request ({e}). The body must be one JSON "
                          "object.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    server = await _servers_of(req).route(body.get("model"))
    return server, body, P.check_params(body, allowed, server.max_context)


def _check_chat_fields(body: dict) -> None:
    """400 naming a chat field this endpoint does not support in the value given."""
    if body.get("response_format") not in (None, {"type": "text"}):
        raise bad_request("response_format: only {type: text} is supported", "response_format")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise bad_request("tool_choice: only 'auto' and 'none' are supported", "tool_choice")


def _chat_prompt(server: Server, messages: list, tools: Any) -> list[int]:
    """The prompt's tokens: `messages` (and `tools` where given) through the chat template."""
    kwargs = {"tools": tools} if tools else {}
    try:
        text = server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs) \
            if kwargs else render_chat(server.tokenizer, messages)
    except Exception as e:  # a template that refuses these messages (e.g. roles out of order)
        raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from None
    return server.tokenizer.encode(text, add_special_tokens=False)


async def _respond(server: Server, body: dict, params: P.Params, kind: str, prompts: list[list[int]],
                   max_tokens: int, choice: Callable[[Sample, int], dict], tools: bool):
    """The whole reply as one object, or a `_Stream` of server-sent events (`params.stream`)."""
    model = body["model"]
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    adapter, key, _ = await server.acquire(model)  # held until released below: nothing may fail in between
    if not params.stream:
        try:
            async with server.slots():
                server.active += 1
                try:
                    samples = await server.sample(adapter, prompts, max_tokens, params.temperature, gen, params.extra)
                finally:
                    server.active -= 1
        finally:
            server.release(key)
        out = P.envelope(kind, P.new_id("chatcmpl" if kind == "chat.completion" else "cmpl"), model)
        out["choices"] = [choice(s, i) for i, s in enumerate(samples)]
        out["usage"] = P.usage(sum(len(p) for p in prompts[:: params.n]), sum(len(s.tokens) for s in samples))
        return out
    stream = _Stream(server, model, adapter, key, kind, prompts, max_tokens, params, gen, tools,
                     bool(body.get("return_tokens_as_token_ids")))
    return StreamingResponse(stream.events(), media_type="text/event-stream")


# -- streaming ------------------------------------------------------------------------------
@dataclass
class _Stream:
    """One streamed reply: decoded in segments of `server.stream_tokens`, each one backend request.

    Holds the adapter `key` from `Server.acquire` and releases it when `events` ends, however it
    ends (finished, failed, or the client went away)."""

    server: Server
    model: str
    adapter: str
    key: str | None
    kind: str
    prompts: list[list[int]]
    max_tokens: int
    params: P.Params
    gen: torch.Generator | None
    tools: bool
    as_ids: bool = False
    """Legacy completions name tokens `token_id:N` (`return_tokens_as_token_ids`)."""

    def __post_init__(self) -> None:
        self.chat = self.kind == "chat.completion"
        self.stops: tuple[str, ...] = self.params.extra.get("stop", ())
        self.tokens: list[list[int]] = [[] for _ in self.prompts]
        self.sent = ["" for _ in self.prompts]
        """Text each choice has streamed so far."""
        self.finish: list[str | None] = [None for _ in self.prompts]
        self.base: dict[str, Any] = {}
        self.k = self.params.logprobs
        self.unsent: list[list[tuple]] = [[] for _ in self.prompts]
        """Each choice's decoded (token, logprob, alternatives) whose logprobs no chunk carried yet."""
        self.offset = [0 for _ in self.prompts]
        """Characters of the token texts whose logprobs were sent (legacy `text_offset`)."""

    async def events(self) -> AsyncIterator[str]:
        """The server-sent events: a role chunk (chat), content chunks, the finish chunk, usage
        (`include_usage`), `[DONE]`; an error after the headers went out travels as an event."""
        server, n = self.server, len(self.prompts)
        self.base = P.envelope("chat.completion.chunk" if self.chat else "text_completion",
                               P.new_id("chatcmpl" if self.chat else "cmpl"), self.model)
        try:
            async with server.slots():
                server.active += 1
                try:
                    if self.chat:
                        yield self.chunk([self.piece(i, None, None, role=True) for i in range(n)])
                    while live := [i for i in range(n) if self.finish[i] is None]:
                        if pieces := await self.segment(live):
                            yield self.chunk(pieces)
                    yield self.chunk(self.final_pieces())
                    if self.params.include_usage:
                        n_prompt = sum(len(p) for p in self.prompts[:: self.params.n])
                        usage = P.usage(n_prompt, sum(map(len, self.tokens)))
                        yield f"data: {json.dumps({**self.base, 'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    server.active -= 1
        except ServingError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except ValueError as e:
            yield f"data: {json.dumps(bad_request(str(e)).body())}\n\n"
        finally:
            server.release(self.key)

    async def segment(self, live: list[int]) -> list[dict]:
        """Decode the next segment of the `live` choices (one backend request); the pieces of text
        that are now final."""
        server = self.server
        step = min(server.stream_tokens, self.max_tokens - len(self.tokens[live[0]]))
        out = await server.sample(self.adapter, [self.prompts[i] + self.tokens[i] for i in live], step,
                                  self.params.temperature, self.gen, self.params.extra)
        pieces = []
        for i, s in zip(live, out):
            self.tokens[i] += s.tokens
            if self.k is not None:
                self.unsent[i] += zip(s.tokens, s.logprobs, s.top_logprobs or [()] * len(s.tokens))
            text, stopped = server.text(self.tokens[i], self.stops)  # a stop string may span segments
            if s.stop_reason == "stop" or stopped or len(self.tokens[i]) >= self.max_tokens:
                self.finish[i] = "stop" if s.stop_reason == "stop" or stopped else "length"
            if self.finish[i] is None:  # hold back half a character and a possible stop string's start
                text = _hold_back(text, self.stops)
            if not self.tools and text[len(self.sent[i]):]:
                pieces.append(self.piece(i, text[len(self.sent[i]):], None))
                self.sent[i] = text
        return pieces

    def final_pieces(self) -> list[dict]:
        """Each choice's rest of text (all of it with tools: a tool call is known only once the
        reply is complete) and its finish reason."""
        final = []
        for i in range(len(self.prompts)):
            text, _ = self.server.text(self.tokens[i], self.stops)
            if self.tools:
                content, calls = P.tool_message(text)
                if calls:
                    self.finish[i] = "tool_calls"
                    delta = {"content": content} if content else {}
                    delta["tool_calls"] = [{**c, "index": j} for j, c in enumerate(calls)]
                    final.append({"index": i, "delta": delta, "logprobs": self.logprobs(i),
                                  "finish_reason": "tool_calls"})
                    continue
                if text:
                    final.append(self.piece(i, text, None))
            elif text[len(self.sent[i]):]:
                final.append(self.piece(i, text[len(self.sent[i]):], None))
            final.append(self.piece(i, None, self.finish[i]))
        return final

    def chunk(self, choices: list, usage: dict | None = None) -> str:
        obj = {**self.base, "choices": choices}
        if self.params.include_usage:
            obj["usage"] = usage
        return f"data: {json.dumps(obj)}\n\n"

    def piece(self, i: int, text: str | None, finish: str | None, role: bool = False) -> dict:
        lp = None if role else self.logprobs(i)
        if not self.chat:
            return {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def logprobs(self, i: int) -> dict | None:
        """The logprobs of choice i's tokens decoded since its last chunk (OpenAI's shape), or None."""
        if self.k is None or not self.unsent[i]:
            return None
        tokens, lps, alts = zip(*self.unsent[i])
        self.unsent[i] = []
        s = Sample(tuple(tokens), tuple(lps), "length", top_logprobs=tuple(alts))
        if self.chat:
            return _chat_logprobs(self.server, s, self.k)
        out = _completion_logprobs(self.server, s, self.k, self.as_ids, self.offset[i])
        self.offset[i] += sum(len(self.server.tokenizer.decode([t])) for t in tokens)
        return out


def _hold_back(text: str, stops: tuple[str, ...]) -> str:
    """`text` without what may still change: half a UTF-8 character, or the start of a stop string."""
    text = text.rstrip("\ufffd")
    cut = max((k for x in stops for k in range(1, len(x)) if text.endswith(x[:k])), default=0)
    return text[: len(text) - cut]


def _text_choice(server: Server, s: Sample, i: int, k: int | None, as_ids: bool, stop: tuple[str, ...]) -> dict:
    return {"index": i, "text": server.text(s.tokens, stop)[0],
            "logprobs": None if k is None else _completion_logprobs(server, s, k, as_ids),
            "finish_reason": "stop" if s.stop_reason == "stop" else "length"}


def _completion_logprobs(server: Server, s: Sample, k: int, as_ids: bool, start: int = 0) -> dict[str, Any]:
    """OpenAI's legacy logprobs: tokens, their logprobs, for each token a map of the `k` most
    likely ones (and the sampled one, as OpenAI adds it) to their logprobs, and the character
    offset of each token in the completion's text (the first at `start`); `top_logprobs` is None with k = 0."""
    texts = [server.tokenizer.decode([t]) for t in s.tokens]
    name = (lambda t: f"token_id:{t}") if as_ids else (lambda t: server.tokenizer.decode([t]))
    top = None
    if k:
        top = []
        for t, x, alts in zip(s.tokens, s.logprobs, s.top_logprobs):
            d = {name(a): P.logprob_value(v) for a, v in alts[:k]}
            d.setdefault(name(t), P.logprob_value(x))
            top.append(d)
    offsets = [start]
    for piece in texts[:-1]:
        offsets.append(offsets[-1] + len(piece))
    return {"tokens": [name(t) for t in s.tokens], "token_logprobs": [P.logprob_value(x) for x in s.logprobs],
            "top_logprobs": top, "text_offset": offsets[: len(texts)]}


def _chat_choice(server: Server, s: Sample, i: int, tools: bool, k: int | None, stop: tuple[str, ...]) -> dict:
    text = server.text(s.tokens, stop)[0]
    content, calls = P.tool_message(text) if tools else (text, None)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    finish = "tool_calls" if calls else ("stop" if s.stop_reason == "stop" else "length")
    return {"index": i, "message": message, "logprobs": None if k is None else _chat_logprobs(server, s, k),
            "finish_reason": finish}


def _chat_logprobs(server: Server, s: Sample, k: int) -> dict[str, Any]:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and `k` alternatives."""
    tok = server.tokenizer
    alts = [a[:k] for a in s.top_logprobs] if k else [() for _ in s.tokens]
    ids = sorted({t for t in s.tokens} | {a for row in alts for a, _ in row})
    text = dict(zip(ids, (tok.decode([t]) for t in ids)))
    raw = dict(zip(ids, P.token_bytes(tok, ids)))

    def entry(t: int, x: float) -> dict[str, Any]:
        return {"token": text[t], "logprob": P.logprob_value(x), "bytes": raw[t]}
    return {"content": [{**entry(t, x), "top_logprobs": [entry(a, v) for a, v in row]}
                        for t, x, row in zip(s.tokens, s.logprobs, alts)], "refusal": None}
