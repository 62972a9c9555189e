"""Activation checkpointing: the same logprobs, values and gradients, far fewer saved activations."""

import dataclasses

import pytest
import torch
from test_prefix_sharing import _grpo_and_value_loss, _learner, _micro_batch

from tinker_pipelines.training.activation_checkpointing import checkpointed_layers, decoder_layers
from tinker_pipelines.config import ConfigError, config_from_dict
from tinker_pipelines.training.learner import pad_datums


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while `fn` runs (its activation memory)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("share", [True, False])
def test_same_gradients_bit_for_bit(tiny, mode, share):
    # share=True runs the continuation over the prompt's DynamicCache: its replay must start from
    # the cache as it was, or it would append the keys twice (a shape error or a wrong gradient)
    model, tok = tiny
    padded = pad_datums(_micro_batch(len(tok)), tok.pad_token_id)
    out = {}
    for gc in (False, True):
        learner = _learner(model, tok, mode, share)
        learner.cfg = dataclasses.replace(learner.cfg, gradient_checkpointing=gc)
        lp, v, loss = _grpo_and_value_loss(learner, padded)
        grads = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
        grads.update({f"value_head.{n}": p.grad.clone() for n, p in learner.value_head.named_parameters()})
        out[gc] = (lp, v, loss, grads)
    (lp, v, loss, grads), (lp1, v1, loss1, grads1) = out[False], out[True]
    assert torch.equal(lp, lp1) and torch.equal(v, v1) and torch.equal(loss, loss1)
    assert grads.keys() == grads1.keys() and any("k_proj" in n for n in grads)
    for n, g in grads.items():
        assert g.abs().max() > 0, n
        assert torch.equal(g, grads1[n]), n


@pytest.mark.parametrize("share", [True, False])
def test_saves_a_fraction_of_the_activations(tiny, share):
    model, tok = tiny
    padded = pad_datums(_micro_batch(len(tok)), tok.pad_token_id)
    saved = {}
    for gc in (False, True):
        learner = _learner(model, tok, "lora", share)
        learner.cfg = dataclasses.replace(learner.cfg, gradient_checkpointing=gc)
        saved[gc] = _saved_bytes(lambda: learner._forward(learner.model, padded, values=True))
    # what stays is each layer's input and the output layer's softmax: well under half
    assert 0 < saved[True] < 0.5 * saved[False], saved


def test_the_model_is_left_as_it_was(tiny):
    model, tok = tiny
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    with checkpointed_layers(model):
        assert all("forward" in vars(layer) for layer in layers)
        with checkpointed_layers(model):  # nested: wrapped once, unwrapped by the outer block
            pass
        assert all("forward" in vars(layer) for layer in layers)
    assert not any("forward" in vars(layer) for layer in layers)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), checkpointed_layers(model):  # no gradients: nothing to replay, the cache works
        out = model(input_ids=ids, use_cache=True)
    assert out.past_key_values.get_seq_length() == 4


def test_config_field_is_checked():
    base = {"output_dir": "runs/x", "training": {"gradient_checkpointing": True}}
    assert config_from_dict(base).training.gradient_checkpointing is True
    with pytest.raises(ConfigError, match="training.gradient_checkpointing"):
        config_from_dict({**base, "training": {"gradient_checkpointing": "yes"}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check)")
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_on_cuda_same_gradients_less_memory(tiny, mode):
    model, tok = tiny
    model.to("cuda")
    padded = pad_datums(_micro_batch(len(tok)), tok.pad_token_id, torch.device("cuda"))
    grads, peak = {}, {}
    for gc in (False, True):
        learner = _learner(model, tok, mode, True)
        learner.cfg = dataclasses.replace(learner.cfg, gradient_checkpointing=gc)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _grpo_and_value_loss(learner, padded)
        torch.cuda.synchronize()
        peak[gc] = torch.cuda.max_memory_allocated() - base
        grads[gc] = {n: p.grad for n, p in learner.model.named_parameters() if p.grad is not None}
    for n, g in grads[False].items():  # GPU kernels may sum in another order on the replay
        assert (grads[True][n] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-9, n
    assert peak[True] < peak[False], peak
