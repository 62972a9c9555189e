"""bf16 end to end on CPU: fp32 LoRA adapters (PEFT's default) with non-zero B on a bf16 tiny model.

The worker samples a mixed batch and trains a shared pass (the fast paths, counted in its stats,
with no failure), each adapter getting what it gets alone; the sampler's behaviour logprobs
agree with the learner's `compute_logprobs` in-process and on the worker. Tolerances are set
from measured figures (CPU, tiny model): agreement max 3.9e-3 / mean 1.4e-3 in-process,
2.6e-3 / 8.0e-4 on the worker; shared-pass gradients equal to alone's.
"""

import torch

from benchmarks import ready_bf16
from benchmarks.ready_bf16 import (ADAPTERS, GRAD_RTOL, PROMPTS, bf16_engine, in_process_agreement,
                                   sample_request, worker_check)
from tinker_pipelines.models.dtypes import rms_norm
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.training.lora_linear import lora_linear
from tinker_pipelines.models import load_model

AGREEMENT_MAX, AGREEMENT_MEAN = ready_bf16.AGREEMENT_MAX["cpu"], ready_bf16.AGREEMENT_MEAN["cpu"]


def test_worker_mixed_sampling_and_shared_training_in_bf16():
    engine = bf16_engine()
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for n, p in engine.model.named_parameters() if "lora_" in n)
    assert all(float(p.detach().abs().max()) > 0 for n, p in engine.model.named_parameters() if "lora_B" in n)
    out = worker_check(engine)
    assert out["samples_match"], "a mixed bf16 batch gave other samples than each adapter alone"
    assert out["mixed_batches"] > 0 and out["mixed_batch_errors"] == 0, out
    assert out["shared_passes"] > 0 and out["shared_pass_errors"] == 0, out
    assert out["grad_rel_err"] < GRAD_RTOL, out
    assert out["agreement_max"] < AGREEMENT_MAX and out["agreement_mean"] < AGREEMENT_MEAN, out


def test_the_two_adapters_sample_differently():
    """Non-zero B: the adapters change the function (a zero-B test could not see a lost delta)."""
    engine = bf16_engine()
    one, two = engine.sample([sample_request(a) for a in ADAPTERS])
    assert [s[0] for s in one["samples"]] != [s[0] for s in two["samples"]]
    assert len(one["samples"]) == len(PROMPTS)


def test_a_failed_shared_pass_is_logged_and_counted(caplog, monkeypatch):
    engine = bf16_engine()
    from tinker_pipelines.worker import engine as engine_module

    def broken(jobs, max_rows=0):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine_module, "forward_backward_together", broken)
    samples = {a: engine.sample([sample_request(a)])[0]["samples"] for a in ADAPTERS}
    from benchmarks.ready_bf16 import rl_datums

    calls = [{"adapter": a, "datums": rl_datums(PROMPTS, samples[a]), "algorithm": "grpo", "loss_cfg": {}}
             for a in ADAPTERS]
    with caplog.at_level("WARNING"):
        replies = engine.forward_backward(calls)
    assert all("metrics" in r for r in replies)  # each call reran alone
    assert engine.stats()["shared_pass_errors"] == 1
    assert any("injected failure" in r.message and "RuntimeError" in r.message for r in caplog.records)


def test_sampler_agrees_with_learner_in_process_bf16():
    out = in_process_agreement()
    assert out["agreement_max"] < AGREEMENT_MAX and out["agreement_mean"] < AGREEMENT_MEAN, out


def test_fused_lora_linear_matches_peft_in_bf16():
    """The fused layer on a bf16 base with fp32 adapters: PEFT's forward and gradients."""
    model, tok = load_model("tiny", seed=0, dtype="bfloat16")
    lr = Learner(model, LearnerConfig(mode="lora"), tok.pad_token_id, init_seed=1)
    layer = next(m for m in lr.model.modules() if hasattr(m, "lora_A") and "_peft_forward" in m.__dict__)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    outs, grads = [], []
    for fused in (True, False):
        xi = x.clone().requires_grad_(True)
        y = lora_linear(layer, xi, [(0, 3, "default")]) if fused else layer._peft_forward(xi)
        assert y is not None and y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        outs.append(y.detach())
        grads.append([xi.grad, layer.lora_A["default"].weight.grad.clone(), layer.lora_B["default"].weight.grad.clone()])
        layer.lora_A["default"].weight.grad = layer.lora_B["default"].weight.grad = None
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        assert a.dtype == b.dtype
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3)


def test_rms_norm_is_transformers_llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    h = torch.randn(4, 64).bfloat16() * 3
    assert torch.equal(rms_norm(h, norm.weight, norm.variance_epsilon), norm(h))
    h32 = torch.randn(4, 64)
    norm32 = norm.float()
    assert torch.equal(rms_norm(h32, norm32.weight, norm32.variance_epsilon), norm32(h32))


def test_mixed_delta_upcast_same_off_cpu_form():
    """The GPU form of the mixed-adapter delta (side-by-side factors, one masked product) and the
    batch-invariant CPU form (adapter by adapter) compute the same bf16 outputs, up to fp32 rounding."""
    from tinker_pipelines.rollout.mixed_lora import RowAdapters

    g = torch.Generator().manual_seed(0)
    H, O, r = 32, 48, 4
    lora = [[[(torch.randn(r, H, generator=g), torch.randn(O, r, generator=g) * 0.1), None, None, None]],
            [[(torch.randn(r, H, generator=g), torch.randn(O, r, generator=g) * 0.1), None, None, None]],
            [[None, None, None, None]]]  # the bare base
    rows = [0, 1, 1, 2, 0]
    x = torch.randn(len(rows), 3, H, generator=g).bfloat16()
    y0 = torch.randn(len(rows), 3, O, generator=g).bfloat16()
    outs = []
    for invariant in (True, False):
        y = y0.clone()
        RowAdapters(lora, rows, invariant=invariant).add_delta(y, x, 0, 0)
        outs.append(y)
    assert torch.allclose(outs[0].float(), outs[1].float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(outs[0][3], y0[3])  # the base row is untouched
    want = (y0[1].float() + (x[1].float() @ lora[1][0][0][0].t()) @ lora[1][0][0][1].t()).bfloat16()
    assert torch.allclose(outs[0][1].float(), want.float(), rtol=1e-2, atol=1e-2)
