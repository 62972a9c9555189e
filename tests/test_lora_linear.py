"""The fused LoRA linear (`tinker_pipelines/lora_linear.py`) is PEFT's LoRA layer, run in fewer passes."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

from tinker_pipelines.lora_linear import _LoraLinear, fuse_lora_layers
from tinker_pipelines.models import load_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_the_fused_function_has_the_gradients_of_its_formula():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, generator=gen, requires_grad=True)
    a = torch.randn(2, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    bl = torch.randn(4, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: _LoraLinear.apply(*t, 1.5), (x, w, b, a, bl))
    assert torch.autograd.gradcheck(lambda x, a, bl: _LoraLinear.apply(x, w.detach(), None, a, bl, 0.5), (x, a, bl))
    y = _LoraLinear.apply(x, w, b, a, bl, 1.5)
    torch.testing.assert_close(y, x @ w.T + b + 1.5 * (x @ a.T) @ bl.T)


def _peft_pair(seed: int = 0):
    torch.manual_seed(seed)
    model, _ = load_model("tiny")
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero, where the delta and dA vanish: make them show
            torch.nn.init.normal_(p, std=0.05)
    fused = copy.deepcopy(peft_model)
    assert fuse_lora_layers(fused) == 7 * model.config.num_hidden_layers
    assert fuse_lora_layers(fused) == 0  # idempotent
    return peft_model, fused


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().log_softmax(-1)[..., 3].mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_a_fused_model_computes_what_peft_computes():
    peft_model, fused = _peft_pair()
    ids = torch.randint(0, 100, (3, 11), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _logits_and_grads(peft_model, ids)
    logits, grads = _logits_and_grads(fused, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert set(grads) == set(ref_grads) and len(grads) == 2 * len(TARGETS) * fused.config.num_hidden_layers
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with peft_model.disable_adapter(), fused.disable_adapter(), torch.no_grad():
        assert torch.equal(fused(input_ids=ids).logits, peft_model(input_ids=ids).logits)


def test_what_it_cannot_fuse_runs_through_peft():
    peft_model, fused = _peft_pair()
    for model in (peft_model, fused):
        torch.manual_seed(5)  # the same new adapter in both
        model.add_adapter("second", LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"], lora_dropout=0.5))
        model.eval()
        for name, p in model.named_parameters():
            if "lora_B.second" in name:
                torch.nn.init.normal_(p, std=0.5)
    ids = torch.randint(0, 100, (4, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # mixed-adapter rows: PEFT's own inference path
        rows = ["default", "second", "__base__", "default"]
        assert torch.equal(fused(input_ids=ids, adapter_names=rows).logits,
                           peft_model(input_ids=ids, adapter_names=rows).logits)
        # an adapter with dropout, in training mode: PEFT's own (random) forward, seeded alike
        for model in (peft_model, fused):
            model.set_adapter("second")
            model.train()
        torch.manual_seed(3)
        expected = peft_model(input_ids=ids).logits
        torch.manual_seed(3)
        assert torch.equal(fused(input_ids=ids).logits, expected)


def test_bf16_keeps_peft_numerics_within_its_rounding():
    peft_model, fused = _peft_pair()
    peft_model.to(torch.bfloat16), fused.to(torch.bfloat16)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits.float(), peft_model(input_ids=ids).logits.float(),
                                   rtol=0.05, atol=0.05)
