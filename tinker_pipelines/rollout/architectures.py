"""The architectures the fast path runs, each declared as its differences from a Llama.

The lean decoder (`lean_decoder.LeanDecoder`), mixed-adapter batches and prompt sharing in
training (`training.prefix_sharing`) are written once, for a Llama-shaped decoder: an RMSNorm,
q|k|v projections, rotary positions, grouped-query SDPA attention, o projection, an RMSNorm and a
gated MLP, per layer. The families users name differ from it in a few places, which a `Family`
declares (as transformers' `modular_*.py` files describe Qwen3 as a diff of Qwen2 and Llama):

- Llama 2/3.x: nothing (3.x sets `rope_type: llama3`, a static rescaling of the frequencies);
- Qwen2/2.5: a bias on q, k and v (read from the modules: any family may carry biases);
- Qwen3: RMSNorm over each head of q and k before the rotary (`qk_norm`); small sizes tie the
  output layer to the embedding (read from the modules as well);
- Mistral: a sliding window over every layer where the config sets one (`window_of`);
- Qwen3.5 (dense): three of every four layers Gated DeltaNet (`layer_kinds`: 'linear_attention',
  `delta_net`), the fourth gated full attention (`attn_gate`) with q/k norms and a partial rotary;
  its RMSNorms scale by `1 + weight` (`centered_norm`).

What the shared decoder reads from the model itself rather than from a declaration: grouped-query
ratios, head sizes, biases, tied embeddings, the activation, and the rotary tables (the model's
own rotary module computes them, so every static RoPE variant is covered: `default`, `llama3`,
`linear`, `yarn`). `describe` refuses, with a reason naming it, whatever it cannot run exactly:
another class, another attention implementation, a RoPE type whose frequencies change with the
sequence (`dynamic`, `longrope`), a partial rotary, an unknown layer type.

A family whose layers are not all attention (Qwen3.5's Gated DeltaNet layers carry a per-row
recurrent state and conv state instead of keys and values) declares `layer_kinds`; the decoder
refuses kinds it has no step for (`LeanDecoder.LAYER_KINDS`), so such a family is added by
giving the decoder one more layer kind (its step, its prefill and its per-row state, which
`select` already treats as any per-row tensor), not by a copy of the decoder.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch


def _no_window(config) -> list[int | None]:
    return [None] * config.num_hidden_layers


def _window_everywhere(config) -> list[int | None]:
    """Mistral: `sliding_window` (when set) bounds every layer's attention."""
    return [getattr(config, "sliding_window", None)] * config.num_hidden_layers


def _window_by_layer_type(config) -> list[int | None]:
    """Qwen2/Qwen3: `layer_types[i] == 'sliding_attention'` layers see `sliding_window` keys
    (with `use_sliding_window`, the layers from `max_window_layers` on)."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


def _all_attention(config) -> list[str]:
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return ["attention" if t in ("full_attention", "sliding_attention") else t for t in types]


@dataclass(frozen=True)
class Family:
    """One architecture's declared differences from the shared (Llama) decoder."""

    model_type: str
    """`config.model_type`; the classes live in `transformers.models.<model_type>`."""
    causal_lm: str
    """The causal LM class name (exactly this class: a subclass may change the forward)."""
    norm: str
    """Its RMSNorm class: `weight * normalise_fp32(x).to(dtype)`, as `LlamaRMSNorm`."""
    qk_norm: bool = False
    """RMSNorm over each head of q and of k (`self_attn.q_norm`, `k_norm`) before the rotary."""
    window_of: Callable = field(default=_no_window)
    """Per layer, the sliding window (keys a query sees, itself included) or None."""
    layer_kinds: Callable = field(default=_all_attention)
    """Per layer, what mixes the tokens: 'attention' here; a hybrid family names others."""
    centered_norm: bool = False
    """Qwen3.5: every RMSNorm scales by `1 + weight` in fp32 before the cast back (its weights
    are stored around zero), where Llama's scales by `weight` after the cast."""
    attn_gate: bool = False
    """Qwen3.5: q_proj gives each head's query and an output gate side by side (`[q_h, gate_h]`);
    the attention output is multiplied by sigmoid(gate) before o_proj."""
    partial_rotary: bool = False
    """The rotary may cover only the first `partial_rotary_factor` of each head (Qwen3.5: a
    quarter); the rest passes through unrotated."""

    def causal_lm_class(self) -> type:
        package = self.model_type.removesuffix("_text")  # Qwen3.5's text config lives in `qwen3_5`
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        return getattr(module, self.causal_lm)


LLAMA = Family("llama", "LlamaForCausalLM", "LlamaRMSNorm")
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", "Qwen2RMSNorm", window_of=_window_by_layer_type)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", "Qwen3RMSNorm", qk_norm=True, window_of=_window_by_layer_type)
MISTRAL = Family("mistral", "MistralForCausalLM", "MistralRMSNorm", window_of=_window_everywhere)


def _hybrid_kinds(config) -> list[str]:
    """Qwen3.5: `layer_types` names each layer 'linear_attention' (Gated DeltaNet) or 'full_attention'."""
    return ["attention" if t == "full_attention" else t for t in config.layer_types]


QWEN3_5 = Family("qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3_5RMSNorm", qk_norm=True, layer_kinds=_hybrid_kinds,
                 centered_norm=True, attn_gate=True, partial_rotary=True)
"""Qwen3.5's dense text models (transformers' `qwen3_5`, config `Qwen3_5TextConfig`)."""
FAMILIES = {f.model_type: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, QWEN3_5)}

STATIC_ROPE = ("default", "llama3", "linear", "yarn")
"""RoPE types whose frequencies are fixed by the config: the model's rotary module gives the
same cos/sin for a position whatever else runs, so tables computed once per call are exact."""
MOVING_ROPE = {
    "dynamic": "rope_type 'dynamic' rescales the frequencies with the longest position the rotary "
               "module has seen (state kept between calls), so a step's keys depend on the call history",
    "longrope": "rope_type 'longrope' switches frequency tables with the sequence length",
}


def rope_problem(config, partial_ok: bool = False) -> str | None:
    """Why positions cannot be encoded once per call for `config`, or None (`partial_ok`: a
    rotary over part of each head is fine, the caller rotates only that part)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return "per-layer-type rope_parameters are not supported"
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in MOVING_ROPE:
        return MOVING_ROPE[kind]
    if kind not in STATIC_ROPE:
        return f"rope_type {kind!r} is not one of {', '.join(STATIC_ROPE)}"
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) and not partial_ok:
        return f"partial_rotary_factor {partial} (a rotary over part of each head) is not supported"
    return None


@dataclass(frozen=True)
class Arch:
    """What the shared decoder needs to know about one model, beyond its modules."""

    family: Family
    windows: tuple[int | None, ...]
    """Per layer, the sliding window or None (a window no sequence can outgrow is still one)."""
    kinds: tuple[str, ...]
    """Per layer, its mixer kind ('attention')."""


def family_of(config) -> Family | None:
    return FAMILIES.get(getattr(config, "model_type", None))


def describe(causal: torch.nn.Module, kinds_supported: tuple[str, ...] = ("attention",)) -> Arch | str:
    """`causal`'s `Arch`, or why the shared decoder cannot run it (one line naming the cause)."""
    config = getattr(causal, "config", None)
    family = family_of(config)
    if family is None:
        known = ", ".join(f.causal_lm for f in FAMILIES.values())
        return f"{type(causal).__name__} (model_type {getattr(config, 'model_type', None)!r}) is not one of {known}"
    if type(causal) is not family.causal_lm_class():
        return f"{type(causal).__name__} is not transformers' {family.causal_lm} (a subclass may change the forward)"
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        return f"attention implementation {impl!r} (the decoder matches transformers' 'sdpa')"
    problem = rope_problem(config, family.partial_rotary)
    if problem is not None:
        return problem
    kinds = tuple(family.layer_kinds(config))
    odd = sorted(set(kinds) - set(kinds_supported))
    if odd:
        return f"layer kind(s) {', '.join(odd)} have no lean step"
    return Arch(family, tuple(family.window_of(config)), kinds)
