"""A LoRA linear layer's forward and backward in as few passes over its activations as the maths needs.

PEFT computes `base(x) + lora_B(lora_A(x)) * scaling` as four autograd nodes: the LoRA output,
its scaled copy and the sum are each a tensor the size of the layer's output, written and read
again in the backward (the scale's gradient, the sum's fan-out, and a second `dx` added to the
base's). Here the delta is accumulated into the base output inside one matmul (`addmm_` with
`alpha=scaling`), and the backward writes `dx` once, adding the LoRA path into it in place (on
SmolLM2 on a CPU a LoRA step takes 0.89-0.97x the time and 0.81-0.90x the peak memory it takes
through PEFT's layers: `benchmarks.lora_vs_full`):

    y_NO  = x_NI W_OI^T + b_O + s (x_NI A_RI^T) B_OR^T
    dx_NI = dy_NO W_OI + s (dy_NO B_OR) A_RI
    dA_RI = s (dy_NO B_OR)^T x_NI          dB_OR = s dy_NO^T (x_NI A_RI^T)

The same function takes spans of rows with an adapter each (`lora_linear`): the worker's
cross-experiment batches (`worker.batching.row_adapters`) add every experiment's delta to its own
rows inside the one base output, with no per-layer slicing and concatenation.

The function is the same as PEFT's up to float rounding (the order of two additions), and the
parameters and checkpoints are PEFT's own: `fuse_lora_layers` only changes how the layers run.
An adapter whose dtype is not the base's (fp32 LoRA on a bf16 base, PEFT's default) follows the
rule in `tinker_pipelines.models.dtypes`, as PEFT's forward does: `x` cast to the adapter's dtype, the
low-rank path there (`(x A^T) B^T` then `* s`), the sum with the base output rounded once to
the base's dtype; in the backward `dy` is upcast for the low-rank products and the input's share
rounded to `x`'s dtype. Anything else PEFT's layer can do (several active adapters, dropout,
DoRA and other variants, mixed-adapter batches, merged weights, autocast, a quantized base)
runs PEFT's own forward.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch

from tinker_pipelines.models.dtypes import add_lora

class _LoraLinear(torch.autograd.Function):
    """`y = x W^T + b`, plus on each span of rows its adapter's `s (x A^T) B^T`, over the last
    dimension of `x`. `spans` are (first row, end row, adapter index) over the flattened rows;
    `factors` are A_0, B_0, A_1, B_1, ...; one span over every row is a plain LoRA layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight_OI: torch.Tensor, bias_O: torch.Tensor | None,
                spans: tuple[tuple[int, int, int], ...], scalings: tuple[float, ...],
                *factors: torch.Tensor) -> torch.Tensor:
        x_NI = x.reshape(-1, x.shape[-1])
        y_NO = torch.addmm(bias_O, x_NI, weight_OI.t()) if bias_O is not None else x_NI @ weight_OI.t()
        ax = []
        for s, e, k in spans:
            A_RI, B_OR = factors[2 * k], factors[2 * k + 1]
            if A_RI.dtype == x_NI.dtype:
                ax_SR = x_NI[s:e] @ A_RI.t()
                y_NO[s:e].addmm_(ax_SR, B_OR.t(), alpha=scalings[k])
            else:  # `dtypes`: the low-rank path in the adapter's dtype, the sum rounded once
                ax_SR = x_NI[s:e].to(A_RI.dtype) @ A_RI.t()
                y_NO[s:e] = add_lora(y_NO[s:e], (ax_SR @ B_OR.t()) * scalings[k])
            ax.append(ax_SR)
        ctx.save_for_backward(x_NI, weight_OI, *factors, *ax)
        ctx.spans, ctx.scalings, ctx.has_bias, ctx.n_factors = spans, scalings, bias_O is not None, len(factors)
        return y_NO.view(*x.shape[:-1], y_NO.shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_NI, weight_OI, *rest = ctx.saved_tensors
        factors, ax = rest[:ctx.n_factors], rest[ctx.n_factors:]
        dy_NO = dy.reshape(-1, dy.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_f = ctx.needs_input_grad[5:]
        dx_NI = dy_NO @ weight_OI if need_x else None
        dfactors: list[torch.Tensor | None] = [None] * len(factors)
        for (s, e, k), ax_SR in zip(ctx.spans, ax):
            A_RI, B_OR, scaling = factors[2 * k], factors[2 * k + 1], ctx.scalings[k]
            if A_RI.dtype != x_NI.dtype:
                _mixed_backward(dy_NO[s:e], x_NI[s:e], ax_SR, A_RI, B_OR, scaling, dx_NI[s:e] if need_x else None,
                                dfactors, 2 * k, need_f[2 * k], need_f[2 * k + 1])
                continue
            dy_SO = dy_NO[s:e]
            if need_x or need_f[2 * k]:
                dax_SR = (dy_SO @ B_OR).mul_(scaling)
                if need_x:
                    dx_NI[s:e].addmm_(dax_SR, A_RI)
                if need_f[2 * k]:
                    dfactors[2 * k] = _accumulate(dfactors[2 * k], dax_SR.t() @ x_NI[s:e])
            if need_f[2 * k + 1]:
                dfactors[2 * k + 1] = _accumulate(dfactors[2 * k + 1], (dy_SO.t() @ ax_SR).mul_(scaling))
        dx = dx_NI.view(*dy.shape[:-1], x_NI.shape[-1]) if need_x else None
        dw = dy_NO.t() @ x_NI if need_w else None
        db = dy_NO.sum(0) if need_b and ctx.has_bias else None
        return (dx, dw, db, None, None, *dfactors)


def _accumulate(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total.add_(part)


def _mixed_backward(dy_SO: torch.Tensor, x_SI: torch.Tensor, ax_SR: torch.Tensor, A_RI: torch.Tensor,
                    B_OR: torch.Tensor, scaling: float, dx_SI: torch.Tensor | None, dfactors: list,
                    ia: int, need_a: bool, need_b: bool) -> None:
    """The gradients of one span whose adapter's dtype is not the base's, as autograd gives them
    through PEFT's forward: `dy` upcast to the adapter's dtype, the low-rank products there, and
    the input's share rounded to `x`'s dtype before it joins the base's."""
    dlow_SO = dy_SO.to(B_OR.dtype) * scaling
    dax_SR = dlow_SO @ B_OR
    if dx_SI is not None:
        dx_SI.add_((dax_SR @ A_RI).to(dx_SI.dtype))
    if need_a:
        dfactors[ia] = _accumulate(dfactors[ia], dax_SR.t() @ x_SI.to(A_RI.dtype))
    if need_b:
        dfactors[ia + 1] = _accumulate(dfactors[ia + 1], dlow_SO.t() @ ax_SR)


def _vanilla(layer: torch.nn.Module, name: str, x: torch.Tensor) -> bool:
    """Whether adapter `name` of `layer` is a plain LoRA delta this module can apply to `x`."""
    base = layer.base_layer
    return (name not in getattr(layer, "lora_variant", {}) and type(base) is torch.nn.Linear
            and isinstance(layer.lora_dropout[name], torch.nn.Identity) and layer.lora_B[name].bias is None
            and x.dtype == base.weight.dtype and layer.lora_A[name].weight.dtype == layer.lora_B[name].weight.dtype
            and getattr(layer, "cast_input_dtype_enabled", True))


def lora_linear(layer: torch.nn.Module, x: torch.Tensor,
                segments: list[tuple[int, int, str | None]]) -> torch.Tensor | None:
    """`layer`'s base output on `x` with, on each segment [start, end) of its leading dimension,
    the delta of the named adapter (none for None or an adapter that does not target this layer),
    in one fused pass; None where PEFT's own code must run (see the module docstring)."""
    if layer.merged or torch.is_autocast_enabled() or type(layer.base_layer) is not torch.nn.Linear:
        return None
    per_row = x[0].numel() // x.shape[-1] if x.dim() > 1 else 1
    names: list[str] = []
    spans = []
    for start, end, name in segments:
        if name is None or name not in layer.lora_A:
            continue
        if not _vanilla(layer, name, x):
            return None
        if name not in names:
            names.append(name)
        spans.append((start * per_row, end * per_row, names.index(name)))
    base = layer.base_layer
    factors = [w for n in names for w in (layer.lora_A[n].weight, layer.lora_B[n].weight)]
    return _LoraLinear.apply(x, base.weight, base.bias, tuple(spans), tuple(float(layer.scaling[n]) for n in names),
                             *factors)


def _fused_forward(layer: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if layer.__dict__.get("_base_only"):
        return layer.base_layer(x, *args, **kwargs)
    y = None
    if not (args or kwargs or layer.disable_adapters):
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if len(active) == 1:
            y = lora_linear(layer, x, [(0, x.shape[0] if x.dim() > 1 else 1, active[0])])
    return layer._peft_forward(x, *args, **kwargs) if y is None else y


def fuse_lora_layers(model: torch.nn.Module) -> int:
    """Run every PEFT LoRA `Linear` of `model` through the fused forward (idempotent; adapters
    added later to the same layers are covered too). Returns how many layers it changed."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    changed = 0
    for module in model.modules():
        if isinstance(module, LoraLinear) and "_peft_forward" not in module.__dict__:
            module._peft_forward = module.forward
            module.forward = types.MethodType(_fused_forward, module)
            changed += 1
    return changed


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, `model` runs as its base alone, like PEFT's `disable_adapter()` but
    without its walks over every module on entry and exit (tens of milliseconds on SmolLM2, paid
    per micro-batch by a KL reference) and without changing which parameters require gradients.
    A model with LoRA layers that are not fused, or merged into their base weights (whose base
    alone is then no longer the base), falls back to `disable_adapter()`, which unmerges them."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not all("_peft_forward" in m.__dict__ and not m.merged for m in layers):
        with model.disable_adapter():
            yield
        return
    for m in layers:
        m.__dict__["_base_only"] = True
    try:
        yield
    finally:
        for m in layers:
            m.__dict__.pop("_base_only", None)
