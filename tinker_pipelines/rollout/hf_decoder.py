"""`_HFDecoder`: the sampler's decode steps for any causal LM, through the model's own forward and
the cache that model's `generate` would build (models the lean decoder does not support, or
`Sampler(lean=False)`); `warn_fallback` says, once per model, why a model is here and what
that costs.

The cache is the model's own, not a bare `DynamicCache()`: a hybrid model such as Qwen3.5 keeps
a convolution state and a recurrent state, not keys and values, in three of every four layers,
and a cache built without the model's config has no slot for them (its forward then fails in
`get_conv_state`). Rows are dropped or repeated with `Cache.reorder_cache`, which moves those
states with the keys and values; `batch_select_indices` leaves linear-attention states behind.
"""

from __future__ import annotations

import copy
import warnings
import weakref

import torch
from transformers import DynamicCache, PreTrainedModel

FALLBACK_COST = "decodes one step at a time through the model's own forward, one adapter at a time"
"""What a model off the fast path pays (the warning's second half)."""

_warned: weakref.WeakSet = weakref.WeakSet()
"""Models whose fallback was already announced (once per model, not per call)."""


def _causal(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM inside a PEFT wrapper (whose LoRA layers stay injected), else `model`."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model


def generation_cache(model: torch.nn.Module, batch_size: int, max_len: int):
    """The cache `model.generate` would build for a batch (a dynamic one: the sampler's masks grow
    a column per step), or None for a model whose forward builds its own and returns it."""
    causal = _causal(model)
    prepare = getattr(causal, "_prepare_cache_for_generation", None)
    gen = getattr(causal, "generation_config", None)
    if prepare is None or gen is None:
        return DynamicCache(config=causal.config.get_text_config(decoder=True))
    gen = copy.deepcopy(gen)
    gen.cache_implementation, gen.use_cache = None, True  # dynamic: static caches need generate's own masks
    model_kwargs: dict = {}
    prepare(gen, model_kwargs, None, batch_size, max_len)
    return model_kwargs.get("cache")


def warn_fallback(model: torch.nn.Module, reason: str) -> None:
    """One `warning:` line per model (the CLI shows warnings as such lines) naming the reason and
    its cost."""
    causal = _causal(model)
    if causal in _warned:
        return
    _warned.add(causal)
    warnings.warn(f"{type(causal).__name__} is off the fast path ({reason}): it {FALLBACK_COST} "
                  "(no mixed-adapter batches, no prompt reuse while decoding)", stacklevel=3)


class _HFDecoder:
    """Decode steps through the model's own forward and its own cache (any causal LM)."""

    def __init__(self, model: PreTrainedModel, reason: str = ""):
        self.model = model
        self.reason = reason
        """Why the model is not on the lean decoder (`Sampler.decode_path`)."""

    def prefill(self, input_BL: torch.Tensor, mask_BL: torch.Tensor, positions_BL: torch.Tensor,
                max_new_tokens: int) -> torch.Tensor:
        B, L = input_BL.shape
        cache = generation_cache(self.model, B, L + max_new_tokens)
        out = self.model(input_ids=input_BL, attention_mask=mask_BL, position_ids=positions_BL,
                         cache=cache, use_cache=True, logits_to_keep=1)
        if cache is None:  # the model built its own
            cache = getattr(out, "cache", None)
            cache = cache if cache is not None else getattr(out, "past_key_values", None)
        self.cache = cache
        self.mask_BS = torch.cat([mask_BL, mask_BL.new_ones(B, max_new_tokens)], dim=1)
        self.next_pos_B = positions_BL[:, -1] + 1
        self.L = L
        return out.logits[:, -1]

    def select(self, keep_idx: torch.Tensor) -> None:
        """Keep (or repeat) rows `keep_idx` of every layer's cache: keys and values, and the conv
        and recurrent states of linear-attention layers."""
        reorder = getattr(self.cache, "reorder_cache", None)
        if reorder is not None:
            reorder(keep_idx)
        else:
            self.cache.batch_select_indices(keep_idx)
        self.mask_BS = self.mask_BS.index_select(0, keep_idx)
        self.next_pos_B = self.next_pos_B.index_select(0, keep_idx)

    def step(self, tok_B: torch.Tensor, t: int) -> torch.Tensor:
        out = self.model(input_ids=tok_B[:, None], attention_mask=self.mask_BS[:, : self.L + t + 1],
                         position_ids=(self.next_pos_B + t)[:, None], cache=self.cache, use_cache=True)
        return out.logits[:, -1]
