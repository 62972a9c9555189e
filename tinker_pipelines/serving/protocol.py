"""OpenAI's request fields, checked, and its response objects, built (chat and legacy completions).

Fields this endpoint cannot honour are refused with a 400 naming them rather than ignored; a
sampler field (top_p, top_k, stop) passes through once `SampleRequest` has it.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, fields
from typing import Any

from tinker_pipelines.rollout.sampler import SampleRequest
from tinker_pipelines.serving.errors import bad_request

COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "min_p", "logprobs"}
"""OpenAI's fields, plus vLLM's `top_k` and `min_p` extensions."""
CHAT = COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs",
                 "response_format"}
COMPLETIONS = COMMON | {"prompt", "echo", "best_of", "suffix", "return_tokens_as_token_ids"}
MAX_N = 16
"""Most choices one request may ask for."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token: OpenAI's bound on chat `top_logprobs` (vLLM's `max_logprobs`
default), applied to the legacy `logprobs: k` too (OpenAI's own legacy endpoint stops at 5)."""
NO_MASS = -9999.0
"""A logprob of -inf (a token outside a truncated distribution's support) as the endpoint reports
it: JSON has no infinity; vLLM reports the same stand-in."""
SAMPLER_FIELDS = {f.name for f in fields(SampleRequest)}
"""What the sampler takes; top_p / top_k / stop pass through when they appear here."""


@dataclass
class Params:
    """The sampling part of a request, checked."""

    max_tokens: int | None
    temperature: float
    n: int
    stream: bool
    include_usage: bool
    seed: int | None
    extra: dict[str, Any]
    """Sampler fields beyond the basics (top_p, top_k, stop) with non-default values."""
    logprobs: int | None = None
    """Top logprobs per token the reply carries (0: each token's own only; None: no logprobs)."""


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad_request(f"{name} must be a number between {lo:g} and {hi:g}, got {v!r}", name)
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad_request(f"{name} must be an integer {bound}, got {v!r}", name, "integer_out_of_range" if
                          isinstance(v, int) and not isinstance(v, bool) else "invalid_type")
    return v


def check_params(body: dict, allowed: set[str], max_context: int | None) -> Params:
    """The request's sampling fields; 400 naming the first bad or unsupported one."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad_request("you must provide a model parameter (a string)", "model")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, 1, max_context)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    n = _int(body, "n", 1, MAX_N) or 1
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {stream!r}", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise bad_request("stream_options is an object {include_usage: bool}, allowed only with stream: true",
                          "stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64):
        raise bad_request(f"seed must be an integer in [-2**63, 2**64), got {seed!r}", "seed")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, 0.0, -2.0, 2.0) != 0.0:
            raise bad_request(f"{key} is not supported by this endpoint (only 0)", key)
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported by this endpoint", "logit_bias")
    extra: dict[str, Any] = {}
    top_p, min_p, top_k, stop = (_number(body, "top_p", 1.0, 0.0, 1.0), _number(body, "min_p", 0.0, 0.0, 1.0),
                                 body.get("top_k"), body.get("stop"))
    if top_p == 0.0:  # the sampler's range, checked here so that no batch it joins can fail on it
        raise bad_request("top_p must be a number in (0, 1] (1: off), got 0", "top_p")
    if min_p == 1.0:
        raise bad_request("min_p must be a number in [0, 1) (0: off), got 1", "min_p")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise bad_request(f"top_k must be an integer >= 0 (0 or -1: off), got {top_k!r}", "top_k")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or
                             not all(isinstance(x, str) and x for x in stop)):
        raise bad_request("stop must be a string or an array of at most 4 non-empty strings", "stop")
    asked = {"top_p": top_p if top_p != 1.0 else None, "min_p": min_p or None,
             "top_k": top_k if top_k not in (None, -1, 0) else None, "stop": tuple(stop) if stop else None}
    for key, v in asked.items():
        if v is None:
            continue
        if key not in SAMPLER_FIELDS:  # the sampler cannot do it yet: say so rather than ignore it
            raise bad_request(f"{key} is not supported by this endpoint's sampler yet (leave it at its default)", key)
        extra[key] = v
    return Params(max_tokens, temperature, n, stream, bool((opts or {}).get("include_usage")), seed, extra)


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """How many top logprobs per token a request asks for (0: only each token's own), or None for
    no logprobs. Chat: `logprobs: true` with `top_logprobs: k`; completions: `logprobs: k`. 400
    naming the field when it is malformed or k is out of [0, MAX_TOP_LOGPROBS]."""
    if not chat:
        return _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise bad_request(f"logprobs must be a boolean, got {want!r}", "logprobs", "invalid_type")
    k = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if k is not None and not want:
        raise bad_request("logprobs must be set to true if top_logprobs is used", "top_logprobs")
    return (k or 0) if want else None


def logprob_value(x: float) -> float:
    return x if x != float("-inf") else NO_MASS


def _byte_of_char() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's `bytes_to_unicode`)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_of_char()


def token_bytes(tokenizer, ids: list[int]) -> list[list[int]]:
    """Each token's UTF-8 bytes (OpenAI's `bytes`; a token may hold part of a character): read
    from a byte-level BPE vocabulary, else the token's decoded text encoded."""
    out = []
    for t, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        if isinstance(piece, str) and piece and all(c in _BYTE_OF_CHAR for c in piece):
            out.append([_BYTE_OF_CHAR[c] for c in piece])
        else:  # not byte-level (e.g. sentencepiece): the decoded text is the best there is
            out.append(list(tokenizer.decode([t]).encode("utf-8")))
    return out


def chat_messages(body: dict) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: text content, tool calls written out."""
    from tinker_pipelines.envs.tools import format_tool_call

    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}] must be an object with role system, user, assistant or tool", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if content is None and m.get("role") == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or an array of text parts", "messages")
        for call in m.get("tool_calls") or []:
            try:
                fn = call["function"]
                args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
                content += format_tool_call(fn["name"], args)
            except (KeyError, TypeError, ValueError):
                raise bad_request(f"messages[{i}].tool_calls: each needs function.name and JSON function.arguments",
                                  "messages") from None
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def completion_prompts(body: dict, tokenizer) -> list[list[int]]:
    """`prompt` as token lists: a string, an array of strings, an array of ids, or of id arrays."""
    p = body.get("prompt")
    ok = True
    if isinstance(p, str):
        p = [p]
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        p = [p]
    if not isinstance(p, list) or not p:
        ok = False
    else:
        out = []
        for item in p:
            if isinstance(item, str):
                out.append(tokenizer.encode(item, add_special_tokens=False))
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                if any(not 0 <= t < len(tokenizer) for t in item):
                    raise bad_request(f"prompt holds a token id outside the vocabulary (0..{len(tokenizer) - 1})",
                                      "prompt")
                out.append(list(item))
            else:
                ok = False
    if not ok:
        raise bad_request("prompt must be a string, an array of strings, an array of token ids or of arrays of them",
                          "prompt")
    if any(not x for x in out):
        raise bad_request("prompt must not be empty", "prompt")
    return out


def context_error(longest: int, max_tokens: int, max_context: int, what: str):
    return bad_request(f"This model's maximum context length is {max_context} tokens. However, you requested "
                       f"{longest + max_tokens} tokens ({longest} in the {what}, {max_tokens} in the completion). "
                       f"Please reduce the length of the {what} or completion.", what, "context_length_exceeded")


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def tool_message(text: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of an assistant reply: `<tool_call>{...}</tool_call>` blocks, the
    format the catalogue's chat templates and the tool env use, become OpenAI tool calls."""
    from tinker_pipelines.envs.tools import TOOL_CALL_OPEN, parse_tool_calls

    calls = [c for c in parse_tool_calls(text) if c.error is None]
    if not calls:
        return text, None
    before = text[: text.index(TOOL_CALL_OPEN)].strip()
    return before or None, [{"id": new_id("call"), "type": "function",
                             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def envelope(kind: str, rid: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": created or int(time.time()), "model": model}
