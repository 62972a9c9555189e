"""Cross-adapter batching: several experiments' LoRA adapters in one pass over a shared base.

The mLoRA idea: the frozen base's matmuls run once over the rows of every experiment, and each
LoRA layer adds each experiment's low-rank delta to that experiment's rows only. Adapter
parameters are disjoint and the base is frozen, so one backward of the sum of the experiments'
losses, each normalised by its own batch, gives every adapter exactly its own gradient; the
clip and the Adam step stay per experiment (`Learner.optim_step`). Sampling does the same
inside the lean decoder (`LeanDecoder.set_adapters`).

PEFT's own mixed batches (`adapter_names=`) are inference-only and gather each adapter's rows;
here rows of one adapter are contiguous slices, and each LoRA layer adds every slice's delta
inside its base output and writes its input gradient once (`lora_linear`): no copies per layer.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Iterator

import torch

from tinker_pipelines.algorithms.losses import LossConfig, LossFn
from tinker_pipelines.models.dtypes import adapter_input, add_lora
from tinker_pipelines.training.learner import Learner
from tinker_pipelines.training.lora_linear import adapters_disabled, lora_linear
from tinker_pipelines.training.padding import _Padded, pad_datums
from tinker_pipelines.training.prefix_sharing import PrefixPlan, plan_prefix_sharing, supports_prefix_sharing
from tinker_pipelines.training.gradient import LossSpan, Pass, accumulate_gradients, own_metrics, pass_positions
from tinker_pipelines.types import Datum

Segments = list[tuple[int, int, str | None]]
"""Contiguous row ranges [start, end) and the adapter they use (None: the bare base)."""


def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT LoRA layers of `model` (those holding `lora_A` modules)."""
    return [m for m in model.modules() if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)]


@contextlib.contextmanager
def row_adapters(model: torch.nn.Module, layouts: dict[int, Segments]) -> Iterator[None]:
    """Within the block, every LoRA layer adds adapter deltas per row segment on top of the
    base output, in one fused pass where it can (`lora_linear`). Use inside
    `adapters_disabled(model)` so the layers themselves add nothing otherwise. `layouts` maps a
    batch size to its segments: a shared-prefix forward runs its prefix rows and its
    continuation rows as two batches of different sizes. Adapters whose dtype is not the base's
    compute as PEFT does (`tinker_pipelines.models.dtypes`)."""

    def forward(module: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        segments = layouts.get(x.shape[0])
        if segments is None:
            raise RuntimeError(f"no adapter layout for a batch of {x.shape[0]} rows (have {sorted(layouts)})")
        if not (args or kwargs):
            fused = lora_linear(module, x, segments)
            if fused is not None:
                return fused
        output = previous[module](x, *args, **kwargs)  # the base alone: adapters are disabled
        pieces = []
        for s, e, name in segments:
            y = output[s:e]
            if name is not None and name in module.lora_A:  # PEFT's forward, as `dtypes` states it
                lora_A, lora_B = module.lora_A[name], module.lora_B[name]
                y = add_lora(y, lora_B(lora_A(adapter_input(x[s:e], lora_A.weight))) * module.scaling[name])
            pieces.append(y)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    layers = lora_layers(model)
    previous = {m: m.forward for m in layers}
    own = {m: m.__dict__.get("forward") for m in layers}  # a fused layer's own forward, else None
    for m in layers:
        m.forward = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in layers:
            if own[m] is None:
                del m.forward
            else:
                m.forward = own[m]


class _SegmentHeads(torch.nn.Module):
    """Each segment's rows through its own experiment's value head (0 where it has none)."""

    def __init__(self, segments: list[tuple[int, int, torch.nn.Module | None]]):
        super().__init__()
        self.segments = segments

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        parts = [head(hidden_BTH[s:e]) if head is not None else hidden_BTH.new_zeros(hidden_BTH[s:e].shape[:2])
                 for s, e, head in self.segments]
        return torch.cat(parts)


@dataclass
class FBJob:
    """One experiment's pending `forward_backward` call (a `training.gradient.Tally`)."""

    learner: Learner
    """The experiment's learner (a LoRA adapter on the shared base)."""
    datums: list[Datum]
    """Its training datums."""
    loss_fn: LossFn
    """Its loss."""
    loss_cfg: LossConfig
    """Its loss settings."""
    totals: dict[str, float] = field(default_factory=dict)
    """Its metrics, as `Learner.forward_backward` returns them (set by the call)."""
    error: BaseException | None = None
    """Why it failed (set by the call), else None."""
    total_w: float = 0.0
    """Its datums' total loss weight (set by the call)."""
    logprobs: list[list[float]] | None = None
    """[] to collect each datum's target logprobs (Tinker's outputs; filled by the call), else None."""


def _pieces(job: FBJob) -> list[list[Datum]]:
    return job.learner.micro_batches(job.datums)  # the same micro-batches as alone


def forward_backward_together(jobs: list[FBJob], max_rows: int = 0) -> list[FBJob]:
    """Accumulate each job's gradient as `Learner.forward_backward` would. With `max_rows` > 0
    the jobs' rows share base passes of at most that many rows (at least one micro-batch per
    pass); with 0 every pass holds one job's micro-batch, the very shape it has alone, so each job
    gets exactly the floats of its solo call (a shared pass changes the matmuls' shapes, and a
    row's floats with them: ~1e-5 relative on a gradient). Returns the jobs with `totals` (their
    metrics) or `error` set; a job whose loss is not finite fails alone and keeps no gradient
    from the call, the others go on."""
    model = jobs[0].learner.model
    if any(j.learner.model is not model or j.learner.cfg.mode != "lora" for j in jobs):
        raise ValueError("forward_backward_together needs LoRA learners on one shared model")
    pieces = [[(j, p) for p in _pieces(j)] for j in jobs]
    order = [pc for k in range(max(len(p) for p in pieces)) for p_list in pieces if k < len(p_list)
             for pc in [p_list[k]]]
    passes, current = [], []
    for job, chunk in order:
        if current and (max_rows <= 0 or sum(len(c) for _, c in current) + len(chunk) > max_rows):
            passes.append(current)
            current = []
        current.append((job, chunk))
    passes.append(current)
    for job in jobs:
        # Gradients allocated now, before any pass: the first backward would allocate them amid
        # the pass's freed buffers, splitting the heap the next job's pass needs into holes too
        # small for it (measured: three SmolLM2 jobs of 64 rows peaked at 8.0-8.3 GB that way,
        # 7.2 GB this way, 7.4 GB run one call at a time). The sums are the same: 0 + g is g.
        for p in job.learner.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        job.totals = {}
        job.total_w = sum(sum(d.weights) for d in job.datums)
        job.logprobs = [] if job.logprobs is not None else None
    # lazily: a job that failed in a pass leaves the later ones
    live = ([(j, c) for j, c in members if j.error is None] for members in passes)
    accumulate_gradients((_one_pass(model, members) for members in live if members), fail_fast=False)
    for job in jobs:
        if job.error is not None:
            for p in job.learner.params:
                p.grad = None
        elif not own_metrics(job.loss_fn):
            job.totals["trained_tokens"] = job.total_w
    return jobs


def _row_truncation(cfgs: list, device: torch.device) -> tuple:
    """Each row's (top_k, top_p, min_p): numbers when every experiment of the pass agrees, else [B, 1] tensors."""
    params = [(c.top_k, c.top_p, c.min_p) for c in cfgs]
    if len(set(params)) == 1:
        return params[0]
    return tuple(torch.tensor(col, device=device)[:, None] for col in zip(*params))


def _one_pass(model: torch.nn.Module, members: list[tuple[FBJob, list[Datum]]]) -> Pass:
    """One base pass over the members' rows (`training.gradient.Pass`): each member's
    micro-batch is a span with its own loss, share and error, its rows through its own adapter."""
    lead = members[0][0].learner  # settings that are per pass: those of its members (all, for prefix sharing)
    datums = [d for _, chunk in members for d in chunk]
    padded = pad_datums(datums, lead.pad_token_id, lead.device)
    spans, row = [], 0
    for job, chunk in members:  # a job may hold several spans of a pass
        lr = job.learner
        spans.append(LossSpan(row, row + len(chunk), job.loss_fn, job.loss_cfg, job.total_w, len(job.datums),
                              lr.steps, job, needs_reference=lr.cfg.needs_reference, values=lr.value_head is not None))
        row += len(chunk)
    temp_B11 = torch.tensor([j.learner.cfg.temperature for j, c in members for _ in c],
                            device=lead.device)[:, None, None]
    truncation = _row_truncation([j.learner.cfg for j, c in members for _ in c], lead.device)
    plan, layouts = _plan(model, padded, members, spans)
    heads = [(s.start, s.end, j.learner.value_head) for s, (j, _) in zip(spans, members)]
    head = _SegmentHeads(heads) if any(h is not None for _, _, h in heads) else None

    def reference() -> torch.Tensor:
        with adapters_disabled(model):
            return lead._forward(model, padded, temperature=temp_B11, truncation=truncation, head=None,
                                 plan=plan, sampled_support=False)[0]

    positions = pass_positions(j for j, _ in members)

    def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
        with adapters_disabled(model), row_adapters(model, layouts):
            _thaw(members)  # PEFT froze them: `set_adapter` of another adapter (and `disable_adapter`, the fallback)
            out = lead._forward(model, padded, positions, values=head is not None, temperature=temp_B11,
                                truncation=truncation, head=head, plan=plan)
        _thaw(members)  # leaving a fallback `disable_adapter` froze them again: a frozen leaf drops its gradient
        return out

    return Pass(padded, spans, forward, reference)


def _thaw(members: list[tuple[FBJob, list[Datum]]]) -> None:
    for j, _ in members:
        for p in j.learner.params:
            p.requires_grad_(True)


def _plan(model: torch.nn.Module, padded: _Padded, members: list[tuple[FBJob, list[Datum]]],
          spans: list[LossSpan]) -> tuple[PrefixPlan | None, dict[int, Segments]]:
    """The pass's shared-prefix plan (None: none, or not every member shares prefixes) and the
    adapter layout of each batch size its forward runs (the rows; with a plan, the prefixes too)."""
    layouts: dict[int, Segments] = {len(padded.inputs_BT): [(s.start, s.end, j.learner.adapter_name)
                                                            for s, (j, _) in zip(spans, members)]}
    if not (all(j.learner.cfg.share_prefix for j, _ in members) and supports_prefix_sharing(model)):
        return None, layouts
    plan = plan_prefix_sharing(padded.inputs_BT, padded.mask_BT, padded.fields["weights"],
                               breaks=frozenset(s.start for s in spans))
    if plan is not None:  # prefix rows are ordered like their runs, so experiments stay contiguous
        first_row_P = [plan.run_B.tolist().index(p) for p in range(len(plan.prefix_len_P))]
        owner = [next(j for s, (j, _) in zip(spans, members) if s.start <= r < s.end) for r in first_row_P]
        segs, start = [], 0
        for p in range(1, len(owner) + 1):
            if p == len(owner) or owner[p] is not owner[start]:
                segs.append((start, p, owner[start].learner.adapter_name))
                start = p
        layouts[len(owner)] = segs
    return plan, layouts
