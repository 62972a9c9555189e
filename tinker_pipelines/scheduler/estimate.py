"""What a step costs on a device, from the model's config alone (no weights): pure arithmetic.

`ModelShape.from_config` reads a transformers config (or its `config.json` as a mapping) of a
dense decoder (Llama, Qwen2/3, Mistral, SmolLM2: their parameter counts are exact; Qwen3.5's
linear-attention layers are counted as full attention); `estimate_memory` adds up, in GB (1e9
bytes, as `Inventory` counts them):

- weights: every parameter at the run's dtype (bf16/fp16 2 bytes, fp32 4): embeddings, per layer
  q/k/v/o, gate/up/down and two norms, the final norm, and an output layer unless tied;
- KV cache of the rollout batch: layers x 2 x kv_heads x head_dim x (prompt + new tokens) x rows;
- activations of one training micro-batch: what each decoder layer keeps for backward (with
  gradient checkpointing only its input, plus one layer recomputed), and the logits;
- the LoRA adapter: rank x (in + out) per target module, fp32 weights, gradients and two Adam
  moments (16 bytes a parameter, as PEFT keeps adapters in fp32 on a bf16 base).

The KV cache and the activations are added although a step samples and trains one after the
other: a resident worker may run one tenant's decode beside another's backward. A step whose
base a worker on the device already holds costs only the rest (`base_resident=True`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GB = 1e9
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "auto": 2}
"""Bytes per element by `model.dtype`; 'auto' counts as bf16, what it is on any GPU of compute
capability 8.0+ (older GPUs get fp32 and would need twice the weights)."""
ADAPTER_BYTES_PER_PARAM = 16
"""fp32 LoRA weight + gradient + Adam's two moments."""
PROMPT_TOKENS = 512
"""Prompt length assumed per sequence where only the config is known (it bounds the sampled
tokens, not the prompt): a few chat turns of an agentic environment."""
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The learner's default `lora_targets`."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a dense decoder that decide its memory."""

    vocab_size: int
    """Rows of the embedding (and of the output layer)."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (fewer than num_heads with grouped-query attention)."""
    head_dim: int
    """Width of one head."""
    intermediate_size: int
    """Width of the MLP (gate and up projections)."""
    tie_word_embeddings: bool
    """The output layer reuses the embedding (no parameters of its own)."""
    attention_bias: bool = False
    """q/k/v projections have biases (Qwen2)."""
    qk_norm: bool = False
    """Queries and keys have an RMSNorm of head_dim each (Qwen3)."""

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config or a `config.json` mapping; a multimodal config's text part.
        Raises ValueError naming a missing field."""
        get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        text = get("text_config")
        if text is not None:
            return cls.from_config(text)

        def need(key: str) -> int:
            v = get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model config {key} must be a positive integer, got {v!r}")
            return v

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv = get("num_key_value_heads") or heads
        head_dim = get("head_dim") or hidden // heads
        bias = get("attention_bias")
        if bias is None:
            bias = get("model_type") == "qwen2"  # Qwen2 builds its q/k/v biases without a flag
        return cls(need("vocab_size"), hidden, need("num_hidden_layers"), heads, int(kv), int(head_dim),
                   need("intermediate_size"), bool(get("tie_word_embeddings", True)), bool(bias),
                   get("model_type") in ("qwen3", "qwen3_moe"))

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear modules as (in, out) features, by their HF names."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, self.intermediate_size), "up_proj": (h, self.intermediate_size),
                "down_proj": (self.intermediate_size, h)}

    def parameters(self) -> int:
        """Every parameter of the model."""
        per_layer = sum(i * o for i, o in self.linears().values()) + 2 * self.hidden_size
        if self.attention_bias:
            per_layer += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + self.hidden_size


@dataclass(frozen=True)
class Batch:
    """What one step runs through the model."""

    sample_rows: int
    """Sequences decoded at once (a rollout batch: groups x group size)."""
    prompt_tokens: int
    """Prompt length assumed per sequence (the config does not bound it)."""
    new_tokens: int
    """Tokens sampled per sequence, over all its turns."""
    train_rows: int
    """Sequences per training forward (the micro-batch)."""
    gradient_checkpointing: bool = False
    """Layers keep only their input for backward and are recomputed one at a time."""

    @property
    def tokens(self) -> int:
        """Length of one sequence: prompt plus sampled tokens."""
        return self.prompt_tokens + self.new_tokens


@dataclass(frozen=True)
class MemoryEstimate:
    """A step's memory on one device, by part, in GB."""

    weights_gb: float
    """The base's parameters at the run's dtype (0 when a worker on the device holds them)."""
    kv_cache_gb: float
    """Keys and values of the rollout batch."""
    activations_gb: float
    """What backward needs of one training micro-batch, logits included."""
    adapter_gb: float
    """LoRA weights with their gradients and Adam moments."""
    base_resident: bool = False
    """The base's weights are another holder's (a resident worker): not counted here."""

    @property
    def total_gb(self) -> float:
        """The sum of the parts."""
        return self.weights_gb + self.kv_cache_gb + self.activations_gb + self.adapter_gb

    def describe(self) -> str:
        """One line, e.g. `needs 18.4 GB (weights 16.1, KV 1.2, activations 0.9, adapter 0.2)`."""
        weights = "weights held by the worker" if self.base_resident else f"weights {self.weights_gb:.1f}"
        return (f"needs {self.total_gb:.1f} GB ({weights}, KV {self.kv_cache_gb:.1f}, "
                f"activations {self.activations_gb:.1f}, adapter {self.adapter_gb:.1f})")


def adapter_parameters(shape: ModelShape, rank: int, targets: tuple[str, ...] = DEFAULT_LORA_TARGETS) -> int:
    """LoRA parameters: rank x (in + out) per target module per layer (`lm_head` once)."""
    linears = shape.linears()
    per_layer = sum(rank * sum(linears[t]) for t in targets if t in linears)
    head = rank * (shape.hidden_size + shape.vocab_size) if "lm_head" in targets else 0
    return shape.num_layers * per_layer + head


def layer_activation_elements(shape: ModelShape) -> int:
    """Elements one decoder layer keeps per token for backward: both norms' inputs and outputs,
    q/k/v before and after rotary (q and k) and the attention output, the MLP's gate, up, activated
    gate and product. Attention itself is SDPA's (no seq x seq matrix kept)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return 4 * shape.hidden_size + 3 * q + 3 * kv + 4 * shape.intermediate_size


def estimate_memory(shape: ModelShape, dtype: str, batch: Batch, lora_rank: int | None,
                    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS, base_resident: bool = False) -> MemoryEstimate:
    """A step's memory on one device (see the module docstring); `lora_rank` None: no adapter."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"model.dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    b = DTYPE_BYTES[dtype]
    weights = 0 if base_resident else shape.parameters() * b
    kv = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * batch.tokens * batch.sample_rows * b
    tokens = batch.train_rows * batch.tokens
    per_layer = layer_activation_elements(shape)
    if batch.gradient_checkpointing:
        kept = shape.num_layers * shape.hidden_size + per_layer
    else:
        kept = shape.num_layers * per_layer
    activations = tokens * (kept + shape.vocab_size) * b  # the logits, at the model's dtype
    adapter = 0 if lora_rank is None else adapter_parameters(shape, lora_rank, lora_targets) * ADAPTER_BYTES_PER_PARAM
    return MemoryEstimate(weights / GB, kv / GB, activations / GB, adapter / GB, base_resident)
