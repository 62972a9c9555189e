"""The one loss-and-gradient path, run by every learner and by the worker's shared passes.

A *pass* (`Pass`) is one padded batch through the model: one learner's micro-batch, or on a
worker the rows of several experiments' micro-batches over the shared base. Each `LossSpan` is
one loss over a contiguous block of the pass's rows, with the settings of the
`forward_backward` call it belongs to. For every pass, `accumulate_gradients` runs:

1. the reference (`span_references`): rows that carry their own reference logprobs
   (`Datum.reference_logprobs`) use them; the pass's reference forward runs once when a span
   needs a reference its rows do not carry;
2. the pass's forward: logprobs and values, [B, T];
3. each span (`span_loss`): its loss, the finite check, its share of its whole batch
   (`micro_batch_share`, so that micro-batching does not change the batch's gradient), its
   metrics weighted by that share and, when its tally collects them (`Tally.logprobs`, Tinker's
   per-datum outputs), its rows' target logprobs;
4. one backward of the sum of the spans' scaled losses (`loss.backward`, or DeepSpeed's
   `engine.backward`: the caller passes it).

The caller decides the passes and their callables, which is where the learners differ: the
in-process learner runs one pass per micro-batch; `DeepSpeedLearner` runs the same number of
passes on every rank (a weight-0 `filler` span where its shard is shorter) and takes the
shared-prefix forward only when every rank does, both decided in its own forward, so its
collectives line up; the worker puts several adapters' rows into one pass.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch

from tinker_pipelines.algorithms.losses import LossConfig, LossFn, loss_normalization, micro_batch_share
from tinker_pipelines.training.padding import _Padded, loss_batch
from tinker_pipelines.types import Datum

Backward = Callable[[torch.Tensor], object]
"""Backpropagates a pass's summed loss (`torch.Tensor.backward`, or a DeepSpeed engine's)."""


class Tally(Protocol):
    """Where one `forward_backward` call's results go: its metrics, why it failed and, when it
    asks for them, each datum's target logprobs."""

    totals: dict[str, float]
    error: BaseException | None
    logprobs: list[list[float]] | None
    """None, or a list the spans extend with each row's target logprobs (float32 values, one per
    token, in the call's datum order); then the passes compute every position (`pass_positions`)."""


@dataclass
class Account:
    """A `Tally` of its own (a learner's call; the worker's `FBJob` is one too)."""

    totals: dict[str, float] = field(default_factory=dict)
    """Metrics, each the sum over spans of the span's value times its share."""
    error: BaseException | None = None
    logprobs: list[list[float]] | None = None
    """Each datum's target logprobs when the call asks for them (set it to [] before the call)."""


class Positions(enum.Enum):
    """Which target positions a pass's forward computes (`Learner._run_forward`). Every loss here
    gives weight 0 exactly to positions that add nothing to it or to its gradient, which is what
    lets a forward skip them or compute them without gradient."""

    LOSS = "loss"
    """Those that carry loss (weight != 0): the output layer runs from the first weighted position
    on, and a prompt shared by consecutive rows runs once per run of them; positions before the
    first weighted one, and a shared prefix's, read 0."""
    RETURNED = "returned"
    """Every position's logprob, only weighted ones in the autograd graph: as `LOSS`, but a shared
    prefix's positions are computed once per run without gradient and given to each row, and a
    pass without a weighted position runs without gradient at all (Tinker's `forward_backward`
    returns every target logprob; a group whose rewards are all equal has no advantage)."""
    ALL = "all"
    """Every position, each in the graph, no prefix sharing."""


def pass_positions(tallies: Iterable[Tally]) -> Positions:
    """`RETURNED` when some tally collects logprobs, else `LOSS`."""
    return Positions.RETURNED if any(getattr(t, "logprobs", None) is not None for t in tallies) else Positions.LOSS


def own_metrics(loss_fn: LossFn) -> bool:
    """Whether `loss_fn` names all of its metrics itself (Tinker's losses: keys such as
    `loss:sum`, which the SDK splits at their ':'), so that the path adds no `loss` or
    `trained_tokens` beside them."""
    return bool(getattr(loss_fn, "own_metrics", False))


@dataclass
class LossSpan:
    """One loss over rows [start, end) of a pass."""

    start: int
    end: int
    loss_fn: LossFn
    loss_cfg: LossConfig
    batch_weight: float
    """Total loss weight of the whole batch the span is part of (its `forward_backward` call)."""
    batch_rows: int
    """Datums in that batch."""
    step: int
    """The learner's optimizer step (named by the non-finite-loss error)."""
    tally: Tally
    needs_reference: bool = False
    """Whether the loss gets reference logprobs."""
    values: bool = False
    """Whether the loss gets the value head's values."""
    grad_scale: float = 1.0
    """Scales the gradient, not the metrics (DeepSpeed: the world size, as it averages ranks)."""
    filler: bool = False
    """A weight-0 micro-batch run only so that every rank runs the same collectives: share 0."""


@dataclass
class Pass:
    """One forward over `padded` and the losses over its rows."""

    padded: _Padded
    spans: list[LossSpan]
    forward: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    """Logprobs [B, T] and values [B, T] (None without a value head) of the pass's rows."""
    reference: Callable[[], torch.Tensor] | None = None
    """The reference policy's logprobs [B, T] of the pass's rows (None: no span needs them)."""


def micro_batches(datums: list[Datum], size: int, max_tokens: int = 0) -> list[list[Datum]]:
    """Consecutive chunks of at most `size` datums and, with `max_tokens` > 0, at most that many
    padded tokens (rows x the chunk's longest datum); a datum longer than `max_tokens` is a chunk
    of its own.

    >>> [len(c) for c in micro_batches([Datum((1,) * n, (1,) * n, (1.0,) * n) for n in (4, 4, 4, 9, 2)], 64, 12)]
    [3, 1, 1]
    """
    if max_tokens <= 0:
        return [datums[i:i + size] for i in range(0, len(datums), size)]
    chunks: list[list[Datum]] = []
    current: list[Datum] = []
    longest = 0
    for d in datums:
        n = len(d.input_tokens)
        if current and (len(current) == size or (len(current) + 1) * max(longest, n) > max_tokens):
            chunks.append(current)
            current, longest = [], 0
        current.append(d)
        longest = max(longest, n)
    return chunks + [current] if current else chunks


def _rows(t_BT: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t_BT if start == 0 and end == t_BT.shape[0] else t_BT[start:end]


def span_references(p: Pass) -> list[torch.Tensor | None]:
    """Each span's reference logprobs [rows, T]: its rows' own when they all carry them, else
    rows of the pass's reference forward (run once, only when some span needs it); None for a
    span without a reference."""
    own = [p.padded.own_reference(s.start, s.end) if s.needs_reference else None for s in p.spans]
    ref_BT = None
    if any(s.needs_reference and o is None for s, o in zip(p.spans, own)):
        if p.reference is None:
            raise ValueError("a loss needs reference logprobs, but this pass has no reference forward")
        with torch.no_grad():
            ref_BT = p.reference()
    return [o if o is not None or not s.needs_reference else _rows(ref_BT, s.start, s.end)
            for s, o in zip(p.spans, own)]


def span_loss(span: LossSpan, padded: _Padded, lp_BT: torch.Tensor, values_BT: torch.Tensor | None,
              ref_SBT: torch.Tensor | None) -> torch.Tensor | None:
    """The span's loss times its share of its batch (and `grad_scale`), its metrics added to its
    tally; None, with the tally's error set, when the loss is not finite."""
    fields = {k: _rows(v, span.start, span.end) for k, v in padded.fields.items()}
    values_SBT = _rows(values_BT, span.start, span.end) if span.values else None
    loss, metrics = span.loss_fn(_rows(lp_BT, span.start, span.end), loss_batch(fields, ref_SBT, values_SBT),
                                 span.loss_cfg)
    if not torch.isfinite(loss):
        span.tally.error = FloatingPointError(f"non-finite loss {loss.item()} at learner step {span.step}")
        return None
    share = 0.0 if span.filler else micro_batch_share(loss_normalization(span.loss_fn, span.loss_cfg),
                                                      float(fields["weights"].sum()), span.batch_weight,
                                                      span.end - span.start, span.batch_rows)
    for k, v in (metrics if own_metrics(span.loss_fn) else {"loss": loss.item(), **metrics}).items():
        span.tally.totals[k] = span.tally.totals.get(k, 0.0) + v * share
    collected = getattr(span.tally, "logprobs", None)
    if collected is not None:
        lengths = padded.mask_BT[span.start:span.end].sum(-1).tolist()
        rows = _rows(lp_BT, span.start, span.end).detach().float().tolist()
        collected.extend(row[:n] for row, n in zip(rows, lengths))
    return loss * (share * span.grad_scale)


def accumulate_gradients(passes: Iterable[Pass], backward: Backward = torch.Tensor.backward,
                         fail_fast: bool = True) -> int:
    """Run each pass (reference, forward, every span's loss) and backpropagate the sum of its
    spans' scaled losses, so parameters accumulate each span's share of its batch's gradient.
    Returns how many passes were backpropagated (a `Positions.RETURNED` pass without a weighted
    position has nothing to backpropagate).

    `passes` is consumed lazily: a generator may leave out a failed call's rows from later
    passes. With `fail_fast`, a non-finite loss raises `FloatingPointError` before its pass's
    backward; otherwise the span's tally records it, the span is left out of the sum and the
    other spans go on (the caller discards the failed call's gradient)."""
    return sum(_run_pass(p, backward, fail_fast) for p in passes)


def _run_pass(p: Pass, backward: Backward, fail_fast: bool) -> bool:
    """One pass of `accumulate_gradients`. A function of its own so that the pass's outputs and
    their graph die when it returns: held by a loop's variables they would live on through the
    next pass's forward (measured: three SmolLM2 passes of 64 rows peaked at 9.3-10.1 GB with
    the loop holding them, 8.0-8.3 GB with this function)."""
    refs = span_references(p)
    lp_BT, values_BT = p.forward()
    total, summed = None, []
    for span, ref_SBT in zip(p.spans, refs):
        scaled = span_loss(span, p.padded, lp_BT, values_BT, ref_SBT)
        if scaled is None:
            if fail_fast:
                raise span.tally.error
            continue
        total = scaled if total is None else total + scaled
        summed.append(span)
    if total is None or not total.requires_grad:  # no weighted position (`Positions.RETURNED`): a 0 gradient
        return False
    if not math.isfinite(total.item()):  # finite losses whose scaled sum overflows
        error = FloatingPointError(f"non-finite sum of {len(summed)} losses at learner step {summed[0].step}")
        if fail_fast:
            raise error
        for span in summed:
            span.tally.error = error
        return False
    backward(total)
    return True
