"""Tinker's wire format, read and written with the pinned SDK's own types.

Request bodies are validated with the SDK's pydantic request classes (`tinker.types`, strict:
unknown keys are refused) and `forward_backward` is decoded with the SDK's published proto
module; results are encoded with the same proto module, so a new SDK that changes its format
fails `tests/test_tinker_sdk_types.py` before it fails a user. Nothing here is a copied schema.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from tinker_pipelines.algorithms.tinker_losses import TinkerLoss, TinkerLossError, tinker_loss


class WireError(ValueError):
    """A request that does not decode; `field` names where (the error body carries it)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field
        self.slot: tuple[str, int] | None = None
        """(model_id, seq_id) of a training call refused after both were read."""


@dataclass(frozen=True)
class TinkerDatum:
    """One decoded datum: its tokens and its `loss_fn_inputs` as tensors."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded `forward_backward` (or forward-only) request."""

    model_id: str
    seq_id: int
    loss: TinkerLoss
    forward_only: bool
    data: list[TinkerDatum]


_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def decompress(body: bytes, encoding: str | None, max_bytes: int) -> bytes:
    """The body as the SDK sent it, zstd undone (`Content-Encoding: zstd`); a frame that would
    decompress past `max_bytes` is refused before it is inflated."""
    if (encoding or "identity").lower() in ("identity", ""):
        return body
    if encoding.lower() != "zstd":
        raise WireError(f"Content-Encoding {encoding!r} is not supported (zstd or none)", "content-encoding")
    try:
        out = zstandard.ZstdDecompressor().decompress(body, max_output_size=max_bytes)
    except zstandard.ZstdError as e:
        raise WireError(f"the zstd body does not decompress ({e})", "body") from None
    if len(out) > max_bytes:
        raise WireError(f"the body decompresses to more than {max_bytes} bytes", "body")
    return out


def _tensor(msg: pb.Tensor, where: str) -> torch.Tensor:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where} has dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype}"
                        f"; this service takes float32, int64 or int32", where)
    if msg.HasField("sparse_csr"):
        raise WireError(f"{where} is sparse; this service takes dense 1-D tensors", where)
    raw = msg.dense
    if len(raw) % np.dtype(dtype).itemsize:
        raise WireError(f"{where} has {len(raw)} bytes, not a whole number of {np.dtype(dtype).name}", where)
    arr = np.frombuffer(raw, dtype)
    shape = list(msg.shape) or [arr.size]
    if math.prod(shape) != arr.size:
        raise WireError(f"{where} has shape {shape} but {arr.size} values", where)
    return torch.from_numpy(arr.reshape(shape).copy())


def _tokens(datum: pb.Datum, where: str) -> list[int]:
    tokens: list[int] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind not in (None, "encoded_text"):
            raise WireError(f"{where}.model_input.chunks[{j}] is {kind}; this service takes text only",
                            f"{where}.model_input")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise WireError(f"{where}.model_input.chunks[{j}] is not int32 tokens", f"{where}.model_input")
        tokens.extend(np.frombuffer(raw, np.int32).tolist())
    if not tokens:
        raise WireError(f"{where}.model_input is empty", f"{where}.model_input")
    return tokens


def loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    """`loss_fn_config`, preferring v2 (number or text) over the legacy float map, as the SDK writes both."""
    if msg.loss_fn_config_v2:
        return {k: (v.text if v.WhichOneof("value") == "text" else v.number) for k, v in msg.loss_fn_config_v2.items()}
    return dict(msg.loss_fn_config)


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A `forward_backward` protobuf body as a checked call: the loss is supported, its config
    valid, and every datum carries exactly the loss's inputs, each 1-D of the datum's length."""
    try:
        msg = pb.ForwardBackwardRequest.FromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends: a body that is not the message
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf ({type(e).__name__})", "body") from None
    if not msg.model_id:
        raise WireError("model_id is missing", "model_id")
    try:
        return _decode_checked(msg)
    except WireError as e:
        e.slot = (msg.model_id, int(msg.seq_id))  # the call's seq_id is used up all the same
        raise


def _decode_checked(msg: pb.ForwardBackwardRequest) -> ForwardBackwardCall:
    try:
        loss = tinker_loss(msg.loss_fn, loss_config(msg))
    except TinkerLossError as e:
        raise WireError(str(e), e.field) from None
    if not msg.data:
        raise WireError("data is empty: forward_backward needs at least one datum", "data")
    data = []
    for i, d in enumerate(msg.data):
        where = f"data[{i}]"
        tokens = _tokens(d, where)
        inputs = {k: _tensor(v, f"{where}.loss_fn_inputs.{k}") for k, v in d.loss_fn_inputs.items()}
        try:
            n = loss.check_inputs(inputs, i)
        except TinkerLossError as e:
            raise WireError(str(e), e.field) from None
        if n != len(tokens):
            raise WireError(f"{where}.loss_fn_inputs.target_tokens has {n} values but model_input has {len(tokens)} "
                            f"tokens; they must be the same length", f"{where}.loss_fn_inputs.target_tokens")
        data.append(TinkerDatum(tokens, inputs))
    return ForwardBackwardCall(msg.model_id, int(msg.seq_id), loss, bool(msg.forward_only), data)


def _batched(arrays: list[np.ndarray], dtype: int) -> pb.BatchedTensor:
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=dtype)


def encode_forward_backward(logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput` as protobuf: per datum its target tokens' logprobs (float32), and
    the metrics (`name:reduction` keys, as the SDK's chunk merging splits them)."""
    bad = [k for k in metrics if k.count(":") != 1]
    if bad:
        raise ValueError(f"metric keys must be 'name:reduction' (one ':'): {bad}")
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={k: float(v) for k, v in metrics.items()})
    record = out.loss_fn_outputs.add(num_datums=len(logprobs))
    record.fields["logprobs"].CopyFrom(_batched([np.asarray(lp, np.float32) for lp in logprobs], pb.DTYPE_FLOAT32))
    return out.SerializeToString()


@dataclass(frozen=True)
class Sequence:
    """One sampled sequence as the service returns it."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    """True when a stop string, stop token or end of text ended it; False when max_tokens did."""


def encode_sample(sequences: list[Sequence], prompt_logprobs: list[float | None] | None) -> bytes:
    """`SampleResponse` as protobuf; an unscored prompt position (the first) is NaN on the wire."""
    out = pb.SampleResponse()
    for s in sequences:
        out.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(s.tokens, np.int32).tobytes(),
                          logprobs=np.asarray(s.logprobs, np.float32).tobytes())
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray([math.nan if v is None else v for v in prompt_logprobs], np.float32).tobytes()
    return out.SerializeToString()
