"""The worker's wire protocol, declared once: the `Op` enum, one request and one reply struct per op.

Every message is one msgpack document sent with `Connection.send_bytes` (never `send`, which
pickles): a request is a struct tagged with its op (`{"op": "create", ...}`), its reply is the
op's reply struct (tagged with the same op) or an `Error`. Decoding is typed (`msgspec`), so a
message that does not fit the schema is refused with one line naming the op and the field, and
no bytes from the socket ever become code: there is no pickle on either side.

Tensors cross as `Tensor` (dtype name, shape, raw little-endian bytes; bf16 included, viewed as
bytes, not through numpy which has no bf16). Token ids and per-token floats cross as msgpack
ints and float64s, which round-trip Python's ints and floats exactly (`WireDatum` carries a
`Datum` or a PPO `CriticDatum`; `Sample`, `PromptScoring` and `PromptScores` cross as themselves).

`SCHEMA` is a hash of every struct's field names, types and defaults, computed at import: a
change to any message changes it, and a client of another schema is refused at its hello with
both versions named. `Hello`'s own shape must never change, so that such a client still gets
that one-line answer.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from typing import Any, Union

import msgspec
import torch

from tinker_pipelines.rollout.prompt_scores import PromptScores, PromptScoring
from tinker_pipelines.rollout.samples import Sample
from tinker_pipelines.types import CriticDatum, Datum


class Op(str, enum.Enum):
    """Every operation a worker serves (the `op` tag of its request and of its reply)."""

    HELLO = "hello"
    CREATE = "create"
    CREATE_SAMPLER = "create_sampler"
    COPY_ADAPTER = "copy_adapter"
    PARK = "park"
    DROP = "drop"
    STATS = "stats"
    SHUTDOWN = "shutdown"
    SAMPLE = "sample"
    FORWARD_BACKWARD = "forward_backward"
    TINKER_FORWARD_BACKWARD = "tinker_forward_backward"
    OPTIM_STEP = "optim_step"
    COMPUTE_LOGPROBS = "compute_logprobs"
    COMPUTE_REFERENCE_LOGPROBS = "compute_reference_logprobs"
    COMPUTE_VALUES = "compute_values"
    SAVE_STATE = "save_state"
    LOAD_STATE = "load_state"
    VERIFY_CHECKPOINT = "verify_checkpoint"


class Tensor(msgspec.Struct, frozen=True):
    """A tensor on the wire: dtype name (`torch.<name>`), shape, and its raw bytes in C order."""

    dtype: str
    shape: list[int]
    data: bytes

    def __post_init__(self) -> None:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"Tensor.dtype {self.dtype!r} is not a torch dtype")
        if any(n < 0 for n in self.shape):
            raise ValueError(f"Tensor.shape {self.shape} has a negative size")
        n = 1
        for s in self.shape:
            n *= s
        if len(self.data) != n * dt.itemsize:
            raise ValueError(f"Tensor.data has {len(self.data)} bytes, shape {self.shape} of {self.dtype} "
                             f"needs {n * dt.itemsize}")

    @classmethod
    def from_torch(cls, t: torch.Tensor) -> Tensor:
        flat = t.detach().cpu().contiguous().reshape(-1)
        # as uint8: numpy has no bf16, and the bytes are what must survive, not the values' type
        return cls(str(t.dtype).removeprefix("torch."), list(t.shape), flat.view(torch.uint8).numpy().tobytes())

    def to_torch(self) -> torch.Tensor:
        dt = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dt)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(dt).reshape(self.shape)


class CriticFields(msgspec.Struct, frozen=True):
    """What a `CriticDatum` (PPO) adds to a `Datum`."""

    rewards: tuple[float, ...]
    old_values: tuple[float, ...]
    returns: tuple[float, ...]


class WireDatum(msgspec.Struct, frozen=True):
    """A `Datum` on the wire, or a `CriticDatum` when `critic` is set (the loss reads its
    fields: a plain `Datum` would silently train PPO's value head on nothing)."""

    input_tokens: tuple[int, ...]
    target_tokens: tuple[int, ...]
    weights: tuple[float, ...]
    behaviour_logprobs: tuple[float, ...] = ()
    advantages: tuple[float, ...] = ()
    support_sizes: tuple[int, ...] = ()
    reference_logprobs: tuple[float, ...] = ()
    critic: CriticFields | None = None

    def __post_init__(self) -> None:
        self.to_datum()  # Datum's own length checks, at decode: the error names the datum's field

    @classmethod
    def of(cls, d: Datum) -> WireDatum:
        if type(d) not in (Datum, CriticDatum):  # another subclass's fields would be dropped on the way
            raise TypeError(f"a worker takes Datum or CriticDatum, not {type(d).__name__}")
        critic = CriticFields(**{f: getattr(d, f) for f in _CRITIC_FIELDS}) if isinstance(d, CriticDatum) else None
        return cls(**{f: getattr(d, f) for f in _DATUM_FIELDS}, critic=critic)

    def to_datum(self) -> Datum:
        base = {f: getattr(self, f) for f in _DATUM_FIELDS}
        if self.critic is None:
            return Datum(**base)
        return CriticDatum(**base, **{f: getattr(self.critic, f) for f in _CRITIC_FIELDS})


# The wire mirrors of Datum and CriticDatum must carry every field they have: a field added to
# either without its mirror here would be dropped on the way to the worker, so import fails instead.
_DATUM_FIELDS = tuple(f.name for f in dataclasses.fields(Datum))
_CRITIC_FIELDS = tuple(f.name for f in dataclasses.fields(CriticDatum) if f.name not in _DATUM_FIELDS)
if set(WireDatum.__struct_fields__) != {*_DATUM_FIELDS, "critic"} or \
        set(CriticFields.__struct_fields__) != set(_CRITIC_FIELDS):
    raise ImportError("worker.messages: WireDatum/CriticFields do not mirror Datum/CriticDatum's fields")


def wire_datums(datums: list[WireDatum]) -> list[WireDatum]:
    return [WireDatum.of(d) for d in datums]


def datums_of(wire: list[WireDatum]) -> list[Datum]:
    return [w.to_datum() for w in wire]


# -- requests -------------------------------------------------------------------------------
class Request(msgspec.Struct, frozen=True, tag_field="op"):
    """Base of every request; its `op` tag is the class's `Op`."""


class AdapterRequest(Request, frozen=True):
    """A request on one hosted adapter: only the client that holds it may send it."""

    adapter: str


class Hello(Request, frozen=True, tag=Op.HELLO.value):
    """A client's first message. Never change its shape: it is how another schema is told apart."""

    schema: str


class Create(Request, frozen=True, tag=Op.CREATE.value):
    name: str
    learner: dict[str, Any]  # `LearnerConfig` fields; the engine builds it and names a bad one
    seed: int
    base_name: str = ""
    algorithm: str = ""
    claim: str | None = None


class CreateSampler(Request, frozen=True, tag=Op.CREATE_SAMPLER.value):
    """Host a saved LoRA checkpoint's weights as a read-only adapter (sampling and scoring only)."""

    name: str
    path: str  # the checkpoint directory, as the worker sees it
    base_name: str = ""  # the base it must have been trained on ('': whatever its record names)


class CopyAdapter(AdapterRequest, frozen=True, tag=Op.COPY_ADAPTER.value):
    """Host read-only adapter `name`, a copy in memory of `adapter`'s LoRA weights as they are
    now (no optimizer state, nothing written to disk); later steps of `adapter` leave it as it is."""

    name: str


class Park(AdapterRequest, frozen=True, tag=Op.PARK.value):
    tag: str


class Drop(AdapterRequest, frozen=True, tag=Op.DROP.value):
    pass


class Stats(Request, frozen=True, tag=Op.STATS.value):
    pass


class Shutdown(Request, frozen=True, tag=Op.SHUTDOWN.value):
    pass


class SampleCall(AdapterRequest, frozen=True, tag=Op.SAMPLE.value):
    """Sample with `adapter` ('' : the base model without any adapter, which anyone may do)."""

    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float = 1.0
    generator_state: bytes | None = None  # a CPU torch.Generator's state; None: the adapter's own
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop: list[str] = []
    top_logprobs: int = 0
    seed: int | None = None  # Tinker's: a fresh generator from it (not with generator_state)
    stop_token_ids: list[int] = []  # ends rows besides the worker's own stop tokens
    num_samples: int = 1  # samples of each prompt, prompt by prompt in the reply
    prompt_logprobs: bool = False  # reply with each prompt token's logprob given its prefix
    prompt_scoring: list[PromptScoring] = []  # one per prompt (Tinker's prompt fields), or none: no scores


class ForwardBackward(AdapterRequest, frozen=True, tag=Op.FORWARD_BACKWARD.value):
    datums: list[WireDatum]
    algorithm: str  # a registered algorithm's name: losses are looked up, never sent
    loss_cfg: dict[str, Any] = {}


class TinkerForwardBackward(AdapterRequest, frozen=True, tag=Op.TINKER_FORWARD_BACKWARD.value):
    """Tinker's `forward_backward` (or, `forward_only`, its forward): a named Tinker loss over
    `datum_from_tinker`'s datums; the reply has each datum's target logprobs."""

    datums: list[WireDatum]
    loss: str  # a Tinker loss name (`algorithms.tinker_losses.TINKER_LOSSES`)
    loss_config: dict[str, Any] = {}  # its `loss_fn_config`; the worker validates it and names a bad key
    forward_only: bool = False


class OptimStep(AdapterRequest, frozen=True, tag=Op.OPTIM_STEP.value, omit_defaults=True):
    adam: dict[str, float] | None = None  # Tinker's AdamParams for this step; None: the learner's settings


class ComputeLogprobs(AdapterRequest, frozen=True, tag=Op.COMPUTE_LOGPROBS.value):
    datums: list[WireDatum]


class ComputeReferenceLogprobs(AdapterRequest, frozen=True, tag=Op.COMPUTE_REFERENCE_LOGPROBS.value):
    datums: list[WireDatum]


class ComputeValues(AdapterRequest, frozen=True, tag=Op.COMPUTE_VALUES.value):
    datums: list[WireDatum]


class SaveState(AdapterRequest, frozen=True, tag=Op.SAVE_STATE.value):
    path: str
    record: dict[str, Any] | None = None
    extra_rng: dict[str, Tensor] | None = None


class LoadState(AdapterRequest, frozen=True, tag=Op.LOAD_STATE.value, omit_defaults=True):
    path: str
    optimizer: bool = True  # False: the weights only (Tinker's load_weights without optimizer)


class VerifyCheckpoint(AdapterRequest, frozen=True, tag=Op.VERIFY_CHECKPOINT.value):
    path: str
    probe_tokens: list[int]


# -- replies --------------------------------------------------------------------------------
class Reply(msgspec.Struct, frozen=True, tag_field="op"):
    """Base of every reply; tagged with the op it answers."""


class Error(Reply, frozen=True, tag="error"):
    """A refused or failed request: the exception's kind and its one-line message, and the
    request field it names where the exception says (`TinkerLossError.field`)."""

    error: str
    message: str
    field: str = ""


class HelloReply(Reply, frozen=True, tag=Op.HELLO.value):
    schema: str
    base: str
    device: str
    dtype: str
    batching: bool
    stop_token_ids: list[int]
    pad_token_id: int
    pid: int
    max_context: int | None
    vocab_size: int | None = None
    """The output layer's width: a token id at or past it is refused before it joins a batch."""


class CreateReply(Reply, frozen=True, tag=Op.CREATE.value):
    steps: int
    claimed: bool
    record: dict[str, Any] | None = None


class CreateSamplerReply(Reply, frozen=True, tag=Op.CREATE_SAMPLER.value):
    record: dict[str, Any]  # the checkpoint's


class CopyAdapterReply(Reply, frozen=True, tag=Op.COPY_ADAPTER.value):
    steps: int  # the optimizer steps the copied weights have had


class ParkReply(Reply, frozen=True, tag=Op.PARK.value):
    pass


class DropReply(Reply, frozen=True, tag=Op.DROP.value):
    pass


class StatsReply(Reply, frozen=True, tag=Op.STATS.value):
    stats: dict[str, Any]  # counters for people and tests; free-form by design


class ShutdownReply(Reply, frozen=True, tag=Op.SHUTDOWN.value):
    pass


class SampleReply(Reply, frozen=True, tag=Op.SAMPLE.value):
    samples: list[Sample]
    generator_state: bytes | None = None  # the request's generator, advanced; None when it brought none
    prompt_logprobs: list[list[float]] | None = None  # per prompt, NaN first (no prefix); None: not asked
    prompt_scores: list[PromptScores] | None = None  # per prompt, with `prompt_scoring`; None: not asked


class ForwardBackwardReply(Reply, frozen=True, tag=Op.FORWARD_BACKWARD.value):
    metrics: dict[str, float]


class TinkerForwardBackwardReply(Reply, frozen=True, tag=Op.TINKER_FORWARD_BACKWARD.value):
    logprobs: list[list[float]]  # each datum's target logprobs (float32 values), in request order
    metrics: dict[str, float]  # Tinker's keys (`loss:sum`)


class OptimStepReply(Reply, frozen=True, tag=Op.OPTIM_STEP.value):
    metrics: dict[str, float]


class ComputeLogprobsReply(Reply, frozen=True, tag=Op.COMPUTE_LOGPROBS.value):
    values: list[list[float]]


class ComputeReferenceLogprobsReply(Reply, frozen=True, tag=Op.COMPUTE_REFERENCE_LOGPROBS.value):
    values: list[list[float]]


class ComputeValuesReply(Reply, frozen=True, tag=Op.COMPUTE_VALUES.value):
    values: list[list[float]]


class SaveStateReply(Reply, frozen=True, tag=Op.SAVE_STATE.value):
    record: dict[str, Any]


class LoadStateReply(Reply, frozen=True, tag=Op.LOAD_STATE.value):
    record: dict[str, Any]


class VerifyCheckpointReply(Reply, frozen=True, tag=Op.VERIFY_CHECKPOINT.value):
    finite_logits: bool
    tensors_loaded: int
    differing: list[str]
    missing: list[str]
    unexpected: list[str]


def _by_op(base: type) -> dict[Op, type]:
    out: dict[Op, type] = {}
    stack = list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        tag = cls.__struct_config__.tag
        if tag in Op._value2member_map_:  # not the abstract bases (tagged with their class names)
            out[Op(tag)] = cls
    return out


REQUESTS: dict[Op, type[Request]] = _by_op(Request)
"""The request struct of each op."""
REPLIES: dict[Op, type[Reply]] = _by_op(Reply)
"""The reply struct of each op."""
if set(REQUESTS) != set(Op) or set(REPLIES) != set(Op):  # a new op needs both, or the tables below lie
    raise ImportError(f"ops without a request or reply struct: {sorted(set(Op) - (set(REQUESTS) & set(REPLIES)))}")


def op_of(message: Request | Reply) -> Op:
    """The op a request or reply is tagged with."""
    return Op(type(message).__struct_config__.tag)


def schema_version(types: list[type]) -> str:
    """A hash of the field names, types and defaults of `types` and of every type they hold
    (docstrings left out: a reworded comment is not a new protocol)."""
    _, components = msgspec.json.schema_components(types)

    def strip(node: Any, names: bool = False) -> Any:  # names: keys are field names, kept whatever they are
        if isinstance(node, dict):
            return {k: strip(v, k == "properties" and not names) for k, v in node.items()
                    if names or k not in ("description", "title")}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    text = json.dumps(strip(components), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


SCHEMA: str = schema_version([*REQUESTS.values(), *REPLIES.values(), Error])
"""This build's protocol version; a client and a worker must agree on it."""


class BadMessage(ValueError):
    """Bytes that are not a message of this schema; its text is one line naming the op and field."""


_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODER = msgspec.msgpack.Decoder(Union[tuple(REQUESTS.values())])  # type: ignore[arg-type]
_HELLO_DECODER = msgspec.msgpack.Decoder(Hello)
_REPLY_DECODERS = {op: msgspec.msgpack.Decoder(Union[cls, Error]) for op, cls in REPLIES.items()}


def encode(message: Request | Reply) -> bytes:
    return _ENCODER.encode(message)


def decode_request(data: bytes) -> Request:
    """A request from the wire; `BadMessage` when it is not one of this schema."""
    return _decode(_REQUEST_DECODER, data, "request")


def decode_hello(data: bytes) -> Hello:
    return _decode(_HELLO_DECODER, data, "hello")


def decode_reply(op: Op, data: bytes) -> Reply:
    """The reply to a request of `op` (its reply struct or an `Error`)."""
    return _decode(_REPLY_DECODERS[op], data, f"{op.value} reply")


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, what: str) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:  # msgpack, but not this schema: name the op it claims
        op = _claimed_op(data)
        if op and op not in Op._value2member_map_:
            raise BadMessage(f"unknown op {op!r} (this worker serves {', '.join(o.value for o in Op)})") from None
        raise BadMessage(f"{f'op {op!r}' if op else what}: {_one_line(e)}") from None
    except msgspec.DecodeError as e:
        raise BadMessage(f"{what} is not a msgpack message of this protocol ({_one_line(e)})") from None


def _claimed_op(data: bytes) -> str:
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return ""
    op = raw.get("op") if isinstance(raw, dict) else None
    return op if isinstance(op, str) else ""


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def error_reply(e: BaseException) -> Error:
    """An exception as the `Error` its caller gets (a context overflow keeps its own kind, so
    the client raises `ContextOverflowError` again)."""
    from tinker_pipelines.rollout.sampler import ContextOverflowError

    kind = "context_overflow" if isinstance(e, ContextOverflowError) else type(e).__name__
    msg = f"missing field {e}" if isinstance(e, KeyError) else str(e)
    field = getattr(e, "field", "")
    return Error(kind, _one_line(msg) or kind, field if isinstance(field, str) else "")


__all__ = ["Op", "Tensor", "Request", "AdapterRequest", "Reply", "Error", "REQUESTS", "REPLIES", "SCHEMA",
           "BadMessage", "encode", "decode_request", "decode_hello", "decode_reply", "op_of", "error_reply"]
