"""Tinker's wire format, read and written with the pinned SDK's own types.

Request bodies are validated with the SDK's pydantic request classes (`tinker.types`, strict:
unknown keys are refused) and `forward_backward` is decoded with the SDK's published proto
module; results are encoded with the same proto module, so a new SDK that changes its format
fails `tests/test_tinker_sdk_types.py` before it fails a user. Nothing here is a copied schema.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import zstandard
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from tinker_pipelines.algorithms.tinker_losses import MAX_SOFT_TARGETS, TinkerLoss, TinkerLossError, tinker_loss
from tinker_pipelines.rollout.prompt_scores import PromptScoring

if TYPE_CHECKING:
    from tinker import types
    from tinker.types._pydantic_types.tensor_data import TensorData  # SampleRequest's own field type


class WireError(ValueError):
    """A request that does not decode; `field` names where (the error body carries it)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field
        self.slot: tuple[str, int] | None = None
        """(model_id, seq_id) of a training call refused after both were read."""


class BodyTooLarge(WireError):
    """A body over the service's bound once inflated (answered 413)."""

    status = 413


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
    """The body as the SDK sent it, zstd undone (`Content-Encoding: zstd`), read as a stream that
    stops at `max_bytes` of output: a frame's declared content size cannot be trusted, and
    `ZstdDecompressor.decompress` ignores `max_output_size` when the frame declares one (the SDK's
    frames always do), so it would inflate a bomb in full before any check."""
    if (encoding or "identity").lower() in ("identity", ""):
        return body
    if encoding.lower() != "zstd":
        raise WireError(f"Content-Encoding {encoding!r} is not supported (zstd or none)", "content-encoding")
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            out = reader.read(max_bytes + 1)
    except zstandard.ZstdError as e:
        raise WireError(f"the zstd body does not decompress ({e})", "body") from None
    if len(out) > max_bytes:
        raise BodyTooLarge(f"the body decompresses to more than this service's bound of {max_bytes} bytes", "body")
    return out


def _tensor(msg: pb.Tensor, where: str, max_sparse_cells: int = 0) -> torch.Tensor:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where} has dtype {pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype}"
                        f"; this service takes float32, int64 or int32", where)
    if msg.HasField("sparse_csr"):
        return _dense_from_csr(msg, dtype, where, max_sparse_cells)
    raw = msg.dense
    if len(raw) % np.dtype(dtype).itemsize:
        raise WireError(f"{where} has {len(raw)} bytes, not a whole number of {np.dtype(dtype).name}", where)
    arr = np.frombuffer(raw, dtype)
    shape = list(msg.shape) or [arr.size]
    if math.prod(shape) != arr.size:
        raise WireError(f"{where} has shape {shape} but {arr.size} values", where)
    return torch.from_numpy(arr.reshape(shape).copy())


def _dense_from_csr(msg: pb.Tensor, dtype: type, where: str, max_cells: int) -> torch.Tensor:
    """A sparse CSR tensor, dense (0 in every cell it does not list). The SDK sends a 2-D torch
    tensor that is mostly 0 this way (`Datum` -> `TensorData.from_torch_sparse`): the (N, K)
    weights of a custom loss over soft targets. At most `max_cells` cells: its shape is declared,
    not sent, so it is bounded before anything is allocated."""
    shape = list(msg.shape)
    if len(shape) != 2 or min(shape) < 0 or shape[0] * shape[1] > max_cells:
        raise WireError(f"{where} is sparse with shape {shape}; a sparse tensor here must be 2-D with at most "
                        f"{max_cells} cells", where)
    csr = msg.sparse_csr
    try:
        values = np.frombuffer(csr.values, dtype)
        crow = np.frombuffer(csr.crow_indices, np.int64)
        col = np.frombuffer(csr.col_indices, np.int64)
    except ValueError:
        raise WireError(f"{where}'s sparse_csr buffers are not whole numbers of their dtypes", where) from None
    rows, cols = shape
    if not (len(crow) == rows + 1 and crow[0] == 0 and crow[-1] == len(col) == len(values)
            and bool(np.all(np.diff(crow) >= 0)) and bool(np.all((col >= 0) & (col < cols)))):
        raise WireError(f"{where} is not a CSR tensor of shape {shape} (crow_indices, col_indices and values "
                        "disagree)", where)
    dense = np.zeros((rows, cols), dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return torch.from_numpy(dense)


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
        inputs = {k: _tensor(v, f"{where}.loss_fn_inputs.{k}", len(tokens) * MAX_SOFT_TARGETS)
                  for k, v in d.loss_fn_inputs.items()}
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


def encode_forward_backward(logprobs: list, metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput` as protobuf: per datum its target tokens' logprobs (float32), N of
    them, or (N, K) for soft targets (`tinker_losses.stack_soft_targets`), and the metrics
    (`name:reduction` keys, as the SDK's chunk merging splits them). Consecutive datums of one
    trailing shape are one record, as the SDK reads ragged outputs (its `trailing_shape`)."""
    bad = [k for k in metrics if k.count(":") != 1]
    if bad:
        raise ValueError(f"metric keys must be 'name:reduction' (one ':'): {bad}")
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={k: float(v) for k, v in metrics.items()})
    arrays = [np.asarray(lp, np.float32) for lp in logprobs]
    start = 0
    while start < len(arrays):
        end = start + 1
        while end < len(arrays) and arrays[end].shape[1:] == arrays[start].shape[1:]:
            end += 1
        record = out.loss_fn_outputs.add(num_datums=end - start)
        record.fields["logprobs"].CopyFrom(_batched(arrays[start:end], pb.DTYPE_FLOAT32))
        record.fields["logprobs"].trailing_shape.extend(arrays[start].shape[1:])
        start = end
    if not arrays:
        out.loss_fn_outputs.add(num_datums=0).fields["logprobs"].CopyFrom(_batched([], pb.DTYPE_FLOAT32))
    return out.SerializeToString()


MAX_TOPK_LOGPROBS = 20
"""Most tokens `topk_prompt_logprobs` and `topk_sample_logprobs` may ask for per position, and most
distinct token ids `target_prompt_logprobs` may name (the SDK: the server bounds its cost,
len(prompt) x distinct ids, as it bounds a top-k width). The SDK documents no number; 20 is
tinker-cookbook's distillation default (`topk`, "K=20 matches full-vocabulary KL") and vLLM's
`max_logprobs`. A wider request is answered 400 naming its field."""

TopK = tuple[tuple[int, float], ...]
"""One position's most likely tokens as (token id, logprob), most likely first."""


@dataclass(frozen=True)
class TopKRows:
    """Positions' most likely tokens, sent `k` wide; a None row is an unscored position."""

    rows: list[TopK | None]
    k: int


@dataclass(frozen=True)
class Sequence:
    """One sampled sequence as the service returns it."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    """True when a stop string, stop token or end of text ended it; False when max_tokens did."""
    topk: TopKRows | None = None
    """With `topk_sample_logprobs`: each token's most likely tokens under the distribution it was drawn from."""


def topk_width(k: int, field: str) -> int:
    """A requested top-k width, 0..`MAX_TOPK_LOGPROBS`; WireError naming `field` otherwise."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOPK_LOGPROBS:
        raise WireError(f"{field} must be an integer 0..{MAX_TOPK_LOGPROBS} (this service's bound), got {k!r}",
                        field)
    return k


def prompt_scoring(req: types.SampleRequest, prompt: list[int], vocab: int | None) -> PromptScoring | None:
    """What `req` asks the forward over its prompt for (None: nothing), its prompt fields checked:
    WireError naming the field a bound or the prompt's length refuses."""
    k = topk_width(req.topk_prompt_logprobs, "topk_prompt_logprobs")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None:
        if not req.prompt_logprobs:
            raise WireError("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs",
                            "prompt_logprobs_last_n")
        if isinstance(last_n, bool) or not 1 <= last_n <= len(prompt) - 1:
            raise WireError(f"prompt_logprobs_last_n must be 1..len(prompt) - 1 = {len(prompt) - 1}, got {last_n!r}",
                            "prompt_logprobs_last_n")
    positions, ids = ((), ()) if req.target_prompt_logprobs is None else \
        _target_cells(req.target_prompt_logprobs, len(prompt), vocab)
    if not (req.prompt_logprobs or k or positions):
        return None
    return PromptScoring(bool(req.prompt_logprobs), k, last_n or 0, positions, ids)


def _target_cells(td: TensorData, n_tokens: int, vocab: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`target_prompt_logprobs` as cells (position, token id), in the order of its values: row i
    is position i + 1; a -1 asks nothing. WireError naming the field when it is not
    `[len(prompt) - 1, K]` int64 ids (dense or CSR), names none, or names too many distinct ids."""
    f = "target_prompt_logprobs"
    if td.dtype != "int64":
        raise WireError(f"{f} must be an int64 tensor of token ids, got {td.dtype}", f)
    if td.shape is None or len(td.shape) != 2 or td.shape[1] < 1:
        raise WireError(f"{f} must be 2-D, [len(prompt) - 1, K] with K >= 1, got shape {td.shape}", f)
    rows, width = td.shape
    if rows != n_tokens - 1:
        raise WireError(f"{f} has {rows} rows; a prompt of {n_tokens} tokens needs len(prompt) - 1 = {n_tokens - 1}",
                        f)
    ids = np.asarray(td.data)
    if ids.size and (ids.dtype.kind not in "iu" or ids.ndim != 1):
        raise WireError(f"{f} must hold integer token ids", f)
    ids = ids.astype(np.int64)
    if td.sparse_crow_indices is None:
        if td.sparse_col_indices is not None:
            raise WireError(f"{f}.sparse_col_indices is set without sparse_crow_indices", f)
        if ids.size != rows * width:
            raise WireError(f"{f} has shape {td.shape} but {ids.size} values", f)
        row_of = np.arange(ids.size) // width
    else:
        crow = np.asarray(td.sparse_crow_indices, np.int64)
        col = np.asarray(td.sparse_col_indices if td.sparse_col_indices is not None else [], np.int64)
        if (len(crow) != rows + 1 or crow[0] != 0 or (np.diff(crow) < 0).any() or crow[-1] != len(col)
                or len(col) != ids.size or ((col < 0) | (col >= width)).any()):
            raise WireError(f"{f} is not a CSR tensor of shape {td.shape} (crow_indices, col_indices and data "
                            f"disagree)", f)
        row_of = np.repeat(np.arange(rows), np.diff(crow))
    asked = ids != -1
    outside = asked & ((ids < 0) | (ids >= vocab)) if vocab is not None else asked & (ids < 0)
    if outside.any():
        raise WireError(f"{f} has token id {int(ids[outside][0])}, outside the vocabulary [0, {vocab}) "
                        f"(-1 asks nothing)", f)
    if not asked.any():
        raise WireError(f"{f} names no token id (every cell is -1)", f)
    distinct = np.unique(ids[asked]).size
    if distinct > MAX_TOPK_LOGPROBS:
        raise WireError(f"{f} names {distinct} distinct token ids; this service scores at most {MAX_TOPK_LOGPROBS} "
                        f"(its cost, len(prompt) x distinct ids, is bounded as a top-k width is)", f)
    return tuple((row_of[asked] + 1).tolist()), tuple(ids[asked].tolist())


def _target_tensor(td: TensorData, values: tuple[float, ...]) -> pb.Tensor:
    """The logprobs of `td`'s cells (`_target_cells`' order) as float32 in `td`'s shape and
    layout, 0.0 where it had -1."""
    ids = np.asarray(td.data, np.int64)
    out = np.zeros(ids.size, np.float32)
    out[ids != -1] = values
    msg = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(td.shape or []))
    if td.sparse_crow_indices is None:
        msg.dense = out.tobytes()
    else:
        msg.sparse_csr.values = out.tobytes()
        msg.sparse_csr.crow_indices = np.asarray(td.sparse_crow_indices, np.int64).tobytes()
        msg.sparse_csr.col_indices = np.asarray(td.sparse_col_indices, np.int64).tobytes()
    return msg


def _topk(top: TopKRows) -> pb.TopkLogprobs:
    """Positions' top-k as the SDK's dense `(len(rows), k)` matrices. A position that was not
    scored (None), and the cells past its last token, hold the SDK's sentinel (`MASK_LOGPROB`,
    token 0), which it reads back as None and as a shorter list; so does a token of no mass (-inf,
    outside a truncated sampling distribution's support): it is not among the likely ones."""
    rows, k = top.rows, top.k
    ids_LK = np.zeros((len(rows), k), np.int32)
    lps_LK = np.full((len(rows), k), MASK_LOGPROB, np.float32)
    for i, row in enumerate(rows):
        kept = [(t, x) for t, x in (row or ())[:k] if x != -math.inf]
        if kept:
            ids_LK[i, :len(kept)], lps_LK[i, :len(kept)] = zip(*kept)
    return pb.TopkLogprobs(length=len(rows), k=k, token_ids=ids_LK.tobytes(), logprobs=lps_LK.tobytes())


def encode_sample(sequences: list[Sequence], prompt_logprobs: list[float | None] | None,
                  topk_prompt: TopKRows | None = None,
                  target_prompt: tuple[TensorData, tuple[float, ...]] | None = None) -> bytes:
    """`SampleResponse` as protobuf; an unscored prompt position (the first) is NaN on the wire.
    `topk_prompt`: one row per prompt position; `target_prompt`: the request's
    `target_prompt_logprobs` and its cells' logprobs (`prompt_scoring`'s order)."""
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
                                tokens=np.asarray(s.tokens, np.int32).tobytes(),
                                logprobs=np.asarray(s.logprobs, np.float32).tobytes())
        if s.topk is not None:
            seq.topk_sampled_logprobs.CopyFrom(_topk(s.topk))
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray([math.nan if v is None else v for v in prompt_logprobs], np.float32).tobytes()
    if topk_prompt is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt))
    if target_prompt is not None:
        out.target_prompt_logprobs.CopyFrom(_target_tensor(*target_prompt))
    return out.SerializeToString()
