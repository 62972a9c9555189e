"""`benchmarks.rollout_sweep`'s ceiling: the decode step's weight matmuls alone, fused as our decoder fuses them."""

import torch

from benchmarks.rollout_sweep import matmul_ceiling, step_weights
from tinker_pipelines.models import load_model


def test_the_step_weights_are_fused_as_the_decoder_fuses_them():
    model, _ = load_model("tiny")
    weights = step_weights(model)
    layers = model.model.layers
    assert len(weights) == 4 * len(layers) + 1
    a, m = layers[0].self_attn, layers[0].mlp
    assert torch.equal(weights[0], torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    assert torch.equal(weights[2], torch.cat([m.gate_proj.weight, m.up_proj.weight]))
    assert weights[-1] is model.get_output_embeddings().weight
    # every parameter a step multiplies is there once (the embedding is the tied output layer)
    assert sum(w.numel() for w in weights) == sum(
        p.numel() for n, p in model.named_parameters() if "norm" not in n)


def test_the_ceiling_is_a_fraction_of_the_peak_per_row_count():
    # how the fraction grows with the rows is the benchmark's to measure (`benchmarks.rollout_sweep`):
    # a timing compared inside the suite flips whenever another process shares the cores
    model, _ = load_model("tiny")
    ceiling = matmul_ceiling(model, [1, 64], peak_gflops=1000.0, repeats=1)
    assert set(ceiling) == {1, 64}
    assert all(0 < c < 1 for c in ceiling.values())
