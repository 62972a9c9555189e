"""The fused LoRA linear (`tinker_pipelines/training/lora_linear.py`) is PEFT's LoRA layer, run in fewer passes."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

from tinker_pipelines.training.lora_linear import _LoraLinear, adapters_disabled, fuse_lora_layers, lora_linear
from tinker_pipelines.models import load_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_the_fused_function_has_the_gradients_of_its_formula():
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)

    x, w, b, a, bl = leaf(2, 3, 5), leaf(4, 5), leaf(4), leaf(2, 5), leaf(4, 2)
    whole = ((0, 6, 0),)  # one span over the 2 x 3 rows: a plain LoRA layer
    assert torch.autograd.gradcheck(lambda *t: _LoraLinear.apply(t[0], t[1], t[2], whole, (1.5,), *t[3:]),
                                    (x, w, b, a, bl))
    assert torch.autograd.gradcheck(lambda x, a, bl: _LoraLinear.apply(x, w.detach(), None, whole, (0.5,), a, bl),
                                    (x, a, bl))
    y = _LoraLinear.apply(x, w, b, whole, (1.5,), a, bl)
    torch.testing.assert_close(y, x @ w.T + b + 1.5 * (x @ a.T) @ bl.T)
    # spans of rows with their own adapters (one used twice, some rows with none)
    a2, b2 = leaf(3, 5), leaf(4, 3)
    spans = ((0, 2, 1), (2, 3, 0), (4, 6, 1))
    assert torch.autograd.gradcheck(
        lambda x, a, bl, a2, b2: _LoraLinear.apply(x, w.detach(), b.detach(), spans, (1.5, -2.0), a, bl, a2, b2),
        (x, a, bl, a2, b2))
    y = _LoraLinear.apply(x, w, b, spans, (1.5, -2.0), a, bl, a2, b2).reshape(6, 4)
    x_NI = x.reshape(6, 5)
    expected = x_NI @ w.T + b
    delta2, delta1 = -2.0 * (x_NI @ a2.T) @ b2.T, 1.5 * (x_NI @ a.T) @ bl.T
    expected = torch.cat([expected[:2] + delta2[:2], expected[2:3] + delta1[2:3], expected[3:4],
                          expected[4:] + delta2[4:]])
    torch.testing.assert_close(y, expected)


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


def test_row_adapters_give_each_segment_its_own_adapter_fused_or_not():
    """`worker.batching.row_adapters`: rows of one pass, each segment through its own adapter (or
    none), whether its layers run fused or (an adapter with dropout) through PEFT's modules."""
    from tinker_pipelines.worker.batching import row_adapters

    _, fused = _peft_pair()
    torch.manual_seed(6)
    fused.add_adapter("drop", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    with torch.no_grad():
        for name, p in fused.named_parameters():
            if "lora_B.drop" in name:
                p.normal_(std=0.3)
    fused.eval()
    ids = torch.randint(0, 100, (5, 7), generator=torch.Generator().manual_seed(7))
    segments = [(0, 2, "default"), (2, 3, None), (3, 5, "drop")]
    with fused.disable_adapter(), row_adapters(fused, {5: segments}):
        together = fused(input_ids=ids).logits
    forwards = {m: m.__dict__.get("forward") for m in fused.modules() if hasattr(m, "lora_A")}
    assert all(f is not None and f.__func__.__name__ == "_fused_forward" for f in forwards.values())  # restored
    with torch.no_grad():
        for s, e, name in segments:
            if name is None:
                with fused.disable_adapter():
                    alone = fused(input_ids=ids[s:e]).logits
            else:
                fused.set_adapter(name)
                alone = fused(input_ids=ids[s:e]).logits
            torch.testing.assert_close(together[s:e], alone, rtol=0, atol=1e-5, msg=str(name))
    with torch.no_grad(), fused.disable_adapter():
        base = fused(input_ids=ids).logits
    assert not torch.allclose(together[0:2], base[0:2], atol=1e-3)  # both adapters change the function
    assert not torch.allclose(together[3:5], base[3:5], atol=1e-3)
    q_proj = next(m for n, m in fused.named_modules() if n.endswith("q_proj") and hasattr(m, "lora_A"))
    x = torch.randn(2, 3, q_proj.in_features)
    assert lora_linear(q_proj, x, [(0, 2, "default")]) is not None
    assert lora_linear(q_proj, x, [(0, 1, "default"), (1, 2, "drop")]) is None  # dropout: PEFT's modules


def test_adapters_disabled_is_peft_disable_adapter_without_its_side_effects():
    peft_model, fused = _peft_pair()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(8))
    grads_before = {n: p.requires_grad for n, p in fused.named_parameters()}
    with torch.no_grad():
        with peft_model.disable_adapter():
            expected = peft_model(input_ids=ids).logits
        with adapters_disabled(fused):
            base_only = fused(input_ids=ids).logits
        adapted = fused(input_ids=ids).logits
    assert torch.equal(base_only, expected)
    assert not torch.allclose(adapted, base_only, atol=1e-3)  # leaving the block brings the adapters back
    assert {n: p.requires_grad for n, p in fused.named_parameters()} == grads_before
    # a merged layer's base alone is not the base: PEFT's `disable_adapter` (which unmerges) runs
    merged = copy.deepcopy(fused)
    merged.merge_adapter()
    with torch.no_grad(), adapters_disabled(merged):
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
    # a model whose LoRA layers are not all fused gets PEFT's own `disable_adapter`
    with torch.no_grad(), adapters_disabled(peft_model):
        assert torch.equal(peft_model(input_ids=ids).logits, expected)
        assert all(m.disable_adapters for m in peft_model.modules() if hasattr(m, "lora_A"))
