"""Tinker's LoraConfig: its switches as LoRA targets, LoRA on the output layer (`train_unembed`,
the SDK's default) in the learner, its fused LoRA linear and the sampler's mixed decode."""

import pytest
import torch

from tinker_pipelines.algorithms.tinker_losses import datum_from_tinker, tinker_loss
from tinker_pipelines.models import load_model, stop_token_ids
from tinker_pipelines.rollout.sampler import Sampler, SampleRequest
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.training.rules import tinker_lora_settings

TOKENS = [[5, 9, 12, 7, 30, 31], [5, 9, 40, 41, 42, 8, 17]]


def _datums():
    return [datum_from_tinker(t[:-1], {"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)}) for t in TOKENS]


def _learners(dtype, specs):
    """Learners sharing one tiny base, one per (name, LoraConfig); non-zero B everywhere."""
    base, tok = load_model("tiny", seed=0, dtype=dtype)
    out = []
    for name, lora in specs:
        fields, seed = tinker_lora_settings(lora)
        lr = Learner(base, LearnerConfig(**fields, micro_batch_size=8), tok.pad_token_id, adapter_name=name,
                     init_seed=seed)
        base = lr.model
        out.append(lr)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for n, p in base.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return out, tok


def test_lora_config_switches_map_to_targets_and_bad_fields_are_named():
    fields, seed = tinker_lora_settings({"rank": 8})
    assert seed is None and fields["lora_rank"] == 8
    assert fields["lora_targets"] == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                      "lm_head")  # the SDK's defaults: everything, the output layer included
    assert tinker_lora_settings({"rank": 2, "train_attn": False, "train_unembed": False})[0]["lora_targets"] == \
        ("gate_proj", "up_proj", "down_proj")
    for bad, msg in (({"rank": 0}, "lora_config.rank must be an integer >= 1"),
                     ({"rank": 4, "train_mlp": "yes"}, "lora_config.train_mlp must be true or false"),
                     ({"rank": 4, "alpha": 8}, "lora_config.alpha is not a LoraConfig field"),
                     ({"rank": 4, "train_mlp": False, "train_attn": False, "train_unembed": False}, "all false")):
        with pytest.raises(ValueError, match=msg):
            tinker_lora_settings(bad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unembed_lora_trains_through_the_fused_layer_as_peft_computes_it(dtype):
    (lr,), tok = _learners(dtype, [("u", {"rank": 4, "seed": 3})])
    head = lr.model.get_base_model().lm_head
    assert "u" in head.lora_A and "_peft_forward" in head.__dict__  # a LoRA layer, run by the fused forward
    datums = _datums()
    logprobs, metrics = lr.tinker_forward_backward(datums, tinker_loss("cross_entropy"))
    assert head.lora_A["u"].weight.grad is not None and head.lora_A["u"].weight.grad.abs().sum() > 0
    assert head.lora_B["u"].weight.grad.abs().sum() > 0
    # PEFT's own forward of the same layers gives the same logprobs (to rounding: the fused layer
    # orders two additions differently)
    fused = lr.compute_logprobs(datums)
    for m in lr.model.modules():
        if "_peft_forward" in m.__dict__:
            m.forward = m._peft_forward
    peft = lr.compute_logprobs(datums)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert all(a == pytest.approx(b, abs=tol) for r, s in zip(fused, peft) for a, b in zip(r, s))
    with torch.no_grad():  # and the head's delta matters: without it the logprobs move
        head.lora_B["u"].weight.zero_()
    assert lr.compute_logprobs(datums) != peft


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_unembed_adapter_decodes_in_the_mixed_batch(dtype):
    (lu, lp), tok = _learners(dtype, [("u", {"rank": 4, "seed": 3}),
                                       ("p", {"rank": 4, "seed": 4, "train_unembed": False})])
    sampler = Sampler(lu.model, tok.pad_token_id, stop_token_ids(tok))
    prompts = [[5, 9, 12], [6, 10, 11, 13]]

    def req(adapter, seed):
        return SampleRequest(prompts, 6, 1.0, torch.Generator().manual_seed(seed), adapter)

    assert sampler.supports_mixed_adapters()
    decoder = sampler._mixed_decoder()
    assert decoder.set_adapters(["u", "p"], [0, 1])  # the output layer's delta is per row, not a refusal
    n_layers = len(decoder.layers)
    assert decoder.adapters.ranks(n_layers, 0) == {0: 4}  # only u has lm_head LoRA (rank 4)
    together = sampler.sample_each([req("u", 1), req("p", 2), req("p", 3)])
    assert sampler.counts == {"mixed_batches": 1, "mixed_batch_errors": 0}
    alone = [sampler.sample_requests([r])[0] for r in (req("u", 1), req("p", 2), req("p", 3))]
    assert together == alone  # a row's samples do not depend on its batch
    # the unembed adapter's sampling logprobs are its own policy's (head delta included)
    for lr, samples in ((lu, together[0]), (lp, together[1])):
        for p, s in zip(prompts, samples):
            ids = [*p, *s.tokens]
            d = datum_from_tinker(ids[:-1], {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
            lr.activate()
            learner_lp = lr.compute_logprobs([d])[0][len(p) - 1:]
            tol = 1e-4 if dtype == "float32" else 5e-2
            assert learner_lp == pytest.approx(list(s.logprobs), abs=tol)
