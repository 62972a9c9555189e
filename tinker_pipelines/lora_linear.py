"""A LoRA linear layer's forward and backward in as few passes over its activations as the maths needs.

PEFT computes `base(x) + lora_B(lora_A(x)) * scaling` as four autograd nodes: the LoRA output,
its scaled copy and the sum are each a tensor the size of the layer's output, written and read
again in the backward (the scale's gradient, the sum's fan-out, and a second `dx` added to the
base's). On a CPU, where a LoRA step's matmuls already run near the peak, those passes are most
of what a LoRA step costs beyond its base forward and input-gradient matmuls. Here the delta is
accumulated into the base output inside one matmul (`addmm_` with `alpha=scaling`), and the
backward writes `dx` once, adding the LoRA path into it in place:

    y_NO  = x_NI W_OI^T + b_O + s (x_NI A_RI^T) B_OR^T
    dx_NI = dy_NO W_OI + s (dy_NO B_OR) A_RI
    dA_RI = s (dy_NO B_OR)^T x_NI          dB_OR = s dy_NO^T (x_NI A_RI^T)

The function is the same as PEFT's up to float rounding (the order of two additions), and the
parameters and checkpoints are PEFT's own: `fuse_lora_layers` only changes how the layers run.
Anything else PEFT's layer can do (several active adapters, dropout, DoRA and other variants,
mixed-adapter batches, merged weights, autocast, a quantized base) runs PEFT's own forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch


class _LoraLinear(torch.autograd.Function):
    """`y = x W^T + b + s (x A^T) B^T` over the last dimension of `x`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight_OI: torch.Tensor, bias_O: torch.Tensor | None,
                A_RI: torch.Tensor, B_OR: torch.Tensor, scaling: float) -> torch.Tensor:
        x_NI = x.reshape(-1, x.shape[-1])
        ax_NR = x_NI @ A_RI.t()
        y_NO = torch.addmm(bias_O, x_NI, weight_OI.t()) if bias_O is not None else x_NI @ weight_OI.t()
        y_NO.addmm_(ax_NR, B_OR.t(), alpha=scaling)
        ctx.save_for_backward(x_NI, weight_OI, A_RI, B_OR, ax_NR)
        ctx.scaling, ctx.has_bias = scaling, bias_O is not None
        return y_NO.view(*x.shape[:-1], y_NO.shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_NI, weight_OI, A_RI, B_OR, ax_NR = ctx.saved_tensors
        s = ctx.scaling
        dy_NO = dy.reshape(-1, dy.shape[-1])
        need_x, need_w, need_b, need_a, need_b_lora, _ = ctx.needs_input_grad
        dax_NR = (dy_NO @ B_OR).mul_(s) if (need_x or need_a) else None
        dx = dw = db = da = dbl = None
        if need_x:
            dx_NI = dy_NO @ weight_OI
            dx_NI.addmm_(dax_NR, A_RI)
            dx = dx_NI.view(*dy.shape[:-1], x_NI.shape[-1])
        if need_w:
            dw = dy_NO.t() @ x_NI
        if need_b and ctx.has_bias:
            db = dy_NO.sum(0)
        if need_a:
            da = dax_NR.t() @ x_NI
        if need_b_lora:
            dbl = (dy_NO.t() @ ax_NR).mul_(s)
        return dx, dw, db, da, dbl, None


def _fusable(layer: torch.nn.Module, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The one active vanilla adapter `layer` would apply to `x`, or None where PEFT must run."""
    if args or kwargs or layer.disable_adapters or layer.merged or torch.is_autocast_enabled():
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    base = layer.base_layer
    if (name in getattr(layer, "lora_variant", {}) or type(base) is not torch.nn.Linear
            or not isinstance(layer.lora_dropout[name], torch.nn.Identity)
            or layer.lora_B[name].bias is not None):
        return None
    if not (x.dtype == base.weight.dtype == layer.lora_A[name].weight.dtype == layer.lora_B[name].weight.dtype):
        return None
    return name


def _fused_forward(layer: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = _fusable(layer, x, args, kwargs)
    if name is None:
        return layer._peft_forward(x, *args, **kwargs)
    base = layer.base_layer
    return _LoraLinear.apply(x, base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight,
                             float(layer.scaling[name]))


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
