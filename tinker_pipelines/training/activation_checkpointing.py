"""Activation checkpointing: keep one hidden state per decoder layer, recompute the rest in backward.

A training forward keeps every layer's intermediate activations (attention projections, the
MLP's gate and up products, norms) until its backward. For a small model at a long sequence
those dominate a step's memory: on SmolLM2-135M, a PPO micro-batch of 4 tool-use episodes
held ~1.9 GB of activations against 0.5 GB of weights (docs/algorithms.md, "The paper's table").
Under `checkpointed_layers(model)` each decoder layer keeps only its input; its backward runs
the layer's forward again first. The gradient is the same (the recomputation is the same
arithmetic on the same inputs; tested bit for bit on CPU) for about one more forward of compute.

Why not `model.gradient_checkpointing_enable()`: transformers checkpoints only modules in
training mode and drops any KV cache passed to a layer, while the learner runs its model in
eval mode (no dropout: the sampler and the learner compute one function) and its
prefix-sharing forward (`prefix_sharing`) passes a group's prompt to the continuation as a
`DynamicCache`. Here a layer is checkpointed whenever gradients are on, and its recomputation
starts from the cache layer as it was when the layer first ran, so the replay appends the same
keys to the same prefix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers in order: transformers' checkpointable layers (every decoder
    layer of its causal LMs, wrapped in PEFT or not), else the longest `ModuleList`."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if layers:
        return layers
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not stacks:
        raise ValueError(f"{type(model).__name__} has no stack of decoder layers to checkpoint")
    return list(max(stacks, key=len))


def _cache_layer(kwargs: dict, index: int) -> DynamicLayer | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:  # attention appends to any cache it is given, whatever `use_cache` says
        return None
    layer = cache.layers[index] if index < len(getattr(cache, "layers", ())) else None
    if layer is None:
        raise ValueError(f"activation checkpointing needs the cache's layer {index} before decoder layer {index} "
                         "runs (a DynamicCache built with the model's config)")
    if getattr(layer, "rebinds", False):  # its updates rebind attributes (`prefix_sharing._StateLayer`)
        return layer
    if not isinstance(layer, DynamicLayer) or type(layer).update is not DynamicLayer.update:
        # a static cache writes into its buffers in place: a replay cannot restore them cheaply
        raise ValueError(f"activation checkpointing replays a layer over a DynamicCache only, got {type(layer).__name__}")
    return layer


def _checkpointed(forward, index: int):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        cache_layer = _cache_layer(kwargs, index)
        entry = dict(vars(cache_layer)) if cache_layer is not None else None  # `update` rebinds, never writes in place

        def replay(*a, **kw):
            if entry is not None:
                vars(cache_layer).clear()
                vars(cache_layer).update(entry)
            return forward(*a, **kw)

        return checkpoint(replay, *args, use_reentrant=False, **kwargs)

    return run


@contextlib.contextmanager
def checkpointed_layers(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Checkpoint every decoder layer of `model` for the forwards run inside the block (their
    backward may run after it). Module hooks stay outside the checkpoint (the layer's `forward`
    is wrapped, not its `__call__`), so DeepSpeed ZeRO-3's parameter gathering runs again for the
    replay as it does for any forward. Nested or disabled: the model as it is."""
    wrapped = []
    for i, layer in enumerate(decoder_layers(model) if enabled else []):
        if "forward" not in vars(layer):  # not wrapped by an enclosing block already
            layer.forward = _checkpointed(layer.forward, i)
            wrapped.append(layer)
    try:
        yield
    finally:
        for layer in wrapped:
            del layer.forward
