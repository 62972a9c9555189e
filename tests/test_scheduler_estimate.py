"""The memory estimate from a model's config alone, against arithmetic done by hand here."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from tinker_pipelines.scheduler.estimate import Batch, ModelShape, adapter_parameters, estimate_memory

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)


def test_smollm2_135m_shaped_config_by_hand():
    shape = ModelShape.from_config(LlamaConfig(**SMOLLM2))
    # per layer: q 576x576, k and v 576x192 (3 kv heads of 64), o 576x576, gate/up/down 576x1536, 2 norms
    layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576
    assert layer == 3_540_096
    assert shape.parameters() == 49152 * 576 + 30 * layer + 576 == 134_515_008  # tied: no output layer
    batch = Batch(sample_rows=16, prompt_tokens=100, new_tokens=28, train_rows=8)
    est = estimate_memory(shape, "bfloat16", batch, lora_rank=8)
    assert est.weights_gb == pytest.approx(134_515_008 * 2 / 1e9)
    assert est.kv_cache_gb == pytest.approx(30 * 2 * 3 * 64 * 128 * 16 * 2 / 1e9)
    kept = 4 * 576 + 3 * 576 + 3 * 192 + 4 * 1536  # per token per layer, see layer_activation_elements
    assert est.activations_gb == pytest.approx(8 * 128 * (30 * kept + 49152) * 2 / 1e9)
    lora = 8 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)  # rank x (in + out), 7 modules
    assert adapter_parameters(shape, 8) == 30 * lora == 2_442_240
    assert est.adapter_gb == pytest.approx(30 * lora * 16 / 1e9)  # fp32 weight, grad, 2 Adam moments
    assert est.total_gb == pytest.approx(est.weights_gb + est.kv_cache_gb + est.activations_gb + est.adapter_gb)
    fp32 = estimate_memory(shape, "float32", batch, lora_rank=8)
    assert fp32.weights_gb == pytest.approx(2 * est.weights_gb) and fp32.adapter_gb == est.adapter_gb


def test_llama3_8b_shaped_config_by_hand():
    shape = ModelShape.from_config(LlamaConfig(**LLAMA3_8B))
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096
    assert shape.parameters() == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248  # untied output layer
    batch = Batch(sample_rows=64, prompt_tokens=512, new_tokens=16, train_rows=8, gradient_checkpointing=True)
    est = estimate_memory(shape, "auto", batch, lora_rank=16)  # auto counts as bf16
    assert est.weights_gb == pytest.approx(16.06, abs=0.005)
    assert est.kv_cache_gb == pytest.approx(32 * 2 * 8 * 128 * 528 * 64 * 2 / 1e9)  # ~4.43 GB
    kept = 32 * 4096 + (4 * 4096 + 3 * 4096 + 3 * 1024 + 4 * 14336)  # checkpointed: inputs + one layer
    assert est.activations_gb == pytest.approx(8 * 528 * (kept + 128256) * 2 / 1e9)
    assert est.describe() == (f"needs {est.total_gb:.1f} GB (weights 16.1, KV 4.4, "
                              f"activations {est.activations_gb:.1f}, adapter {est.adapter_gb:.1f})")
    warm = estimate_memory(shape, "auto", batch, lora_rank=16, base_resident=True)
    assert warm.weights_gb == 0 and warm.total_gb == pytest.approx(est.total_gb - est.weights_gb)
    assert "weights held by the worker" in warm.describe()
    no_ckpt = estimate_memory(shape, "auto", Batch(64, 512, 16, 8), lora_rank=16)
    assert no_ckpt.activations_gb > 5 * est.activations_gb  # every layer's tensors kept


def test_shape_from_config_json_mapping_and_families():
    assert ModelShape.from_config(dict(LLAMA3_8B, model_type="llama")) == ModelShape.from_config(LlamaConfig(**LLAMA3_8B))
    qwen2 = ModelShape.from_config(dict(SMOLLM2, model_type="qwen2"))
    assert qwen2.attention_bias and qwen2.parameters() == 134_515_008 + 30 * (9 + 2 * 3) * 64
    qwen3 = ModelShape.from_config(dict(SMOLLM2, model_type="qwen3", head_dim=128))
    assert qwen3.head_dim == 128 and qwen3.qk_norm
    nested = ModelShape.from_config({"model_type": "x", "text_config": dict(SMOLLM2)})
    assert nested.parameters() == 134_515_008


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="model config hidden_size must be a positive integer, got None"):
        ModelShape.from_config({k: v for k, v in SMOLLM2.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="model.dtype must be one of"):
        estimate_memory(ModelShape.from_config(SMOLLM2), "int3", Batch(1, 1, 1, 1), 8)


def test_catalog_configs_match_the_built_models_parameters():
    from tinker_pipelines.models import model_config
    from tinker_pipelines.models.tiny import build_tiny

    for arch in ("llama", "qwen3", "mistral"):
        model, _ = build_tiny(arch=arch, hidden_size=64, num_layers=2)
        shape = ModelShape.from_config(model_config("tiny", {"arch": arch, "hidden_size": 64, "num_layers": 2}))
        assert shape.parameters() == sum(p.numel() for p in model.parameters()), arch
    assert ModelShape.from_config(model_config("smollm2-135m-instruct")).parameters() == 134_515_008
