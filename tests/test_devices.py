"""Device and dtype placement: `model.device` / `model.dtype`, and the paths that need a GPU.

The CUDA tests run where a GPU is present (`scripts/gpu_check` runs them on one); on a CPU
machine they are reported as skipped and prove nothing about GPUs.
"""

import pytest
import torch

from tinker_pipelines.config import ConfigError, config_from_dict
from tinker_pipelines.loops.datums import trajectory_to_datum
from tinker_pipelines.envs import EnvSpec
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.models import load_model, resolve_device, resolve_dtype, stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, run_groups
from tinker_pipelines.rollout.sampler import Sampler

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check)")
BF16_TOLERANCE = 5e-2
"""Sampler vs learner logprob agreement per token in bf16 (the lean decode step and the model's
own forward round differently at 8 bits of mantissa)."""


def test_device_and_dtype_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    # bf16 on a CPU with AMX/AVX512-BF16, else fp32 (tests/test_cpu_dtype.py fakes both kinds)
    from tinker_pipelines.models.dtypes import cpu_bf16_flag

    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if cpu_bf16_flag() else torch.float32)
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="model.device must be"):
        resolve_device("tpu:0")
    with pytest.raises(ValueError, match="model.dtype must be"):
        resolve_dtype("int3")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_config_on_a_cpu_machine_fails_before_any_model_loads():
    with pytest.raises(ConfigError, match="model.device is 'cuda' but this machine has no CUDA device"):
        config_from_dict({"model": {"device": "cuda"}})
    with pytest.raises(ConfigError, match="model.dtype must be"):
        config_from_dict({"model": {"dtype": "half-ish"}})


def _agreement(device: str, dtype: torch.dtype) -> float:
    model, tok = load_model("tiny", seed=0, dtype=dtype, device=device)
    learner = Learner(model, LearnerConfig(mode="lora"), tok.pad_token_id, init_seed=0)
    sampler = Sampler(learner.model, tok.pad_token_id, stop_token_ids(tok))
    groups = run_groups(sampler, tok, EnvSpec("arithmetic"), [1, 2, 3], 4, RolloutConfig(max_new_tokens=8),
                        torch.Generator().manual_seed(0))
    datums = [trajectory_to_datum(t, 1.0) for g in groups for t in g.trajectories]
    lp = learner.compute_logprobs(datums)
    worst = 0.0
    for d, row in zip(datums, lp):
        for t, w in enumerate(d.weights):
            if w:
                worst = max(worst, abs(row[t] - d.behaviour_logprobs[t]))
    return worst


def test_sampler_and_learner_agree_in_bf16_on_cpu():
    assert _agreement("cpu", torch.bfloat16) < BF16_TOLERANCE


@CUDA
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, BF16_TOLERANCE)])
def test_sampler_and_learner_agree_on_cuda(dtype, tol):
    assert _agreement("cuda", dtype) < tol


@CUDA
def test_train_and_resume_on_cuda(tmp_path):
    from tinker_pipelines.loops.train import deterministic_metrics, train

    cfg = {"seed": 1, "output_dir": str(tmp_path / "a"), "model": {"device": "cuda"},
           "env": {"path": "arithmetic", "kwargs": {"max_operand": 3, "partial_credit": 1.0}},
           "algorithm": {"name": "ppo"}, "training": {"iterations": 2, "groups_per_batch": 4, "group_size": 4},
           "eval": {"every": 2, "num_tasks": 8}}
    full = [deterministic_metrics(m) for m in train(config_from_dict(cfg))]
    part = config_from_dict({**cfg, "output_dir": str(tmp_path / "b"), "training": {**cfg["training"], "iterations": 1}})
    train(part)
    rest = train(config_from_dict({**cfg, "output_dir": str(tmp_path / "b")}), resume=True)
    assert [deterministic_metrics(m) for m in rest] == full[1:]


@CUDA
def test_mixed_adapter_batch_on_cuda():
    import test_multi_lora_sampling as t

    model, tok = t._multi_adapter_model()
    model.to("cuda")
    from tinker_pipelines.rollout.sampler import SampleRequest

    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    prompt = tok.encode("<|im_start|>user\n1 + 2 = ?<|im_end|>\n<|im_start|>assistant\n")
    out = sampler.sample_requests([SampleRequest([prompt] * 2, 6, 1.0, torch.Generator().manual_seed(i), name)
                                   for i, name in enumerate(t.ADAPTERS)])
    for name, samples in zip(t.ADAPTERS, out):
        model.set_adapter(name)
        for s in samples:
            ids = torch.tensor([prompt + list(s.tokens)], device="cuda")
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            ref = [lp[len(prompt) - 1 + j, tk].item() for j, tk in enumerate(s.tokens)]
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < 1e-4


@CUDA
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_fused_lora_layers_on_cuda(dtype, tol):
    """The fused LoRA linear (`lora_linear.py`) on a GPU: PEFT's logits and adapter gradients."""
    import copy

    from peft import LoraConfig, get_peft_model

    from tinker_pipelines.training.lora_linear import fuse_lora_layers

    torch.manual_seed(0)
    model, _ = load_model("tiny")
    model.to("cuda", dtype)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
                                autocast_adapter_dtype=False)  # adapters in the base's dtype: the fused path
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    fused = copy.deepcopy(peft_model)
    assert fuse_lora_layers(fused) > 0
    ids = torch.randint(0, 100, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    outs = []
    for m in (peft_model, fused):
        logits = m(input_ids=ids).logits.float()
        logits.log_softmax(-1)[..., 3].mean().backward()
        outs.append((logits.detach(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}))
    (ref, ref_grads), (got, grads) = outs
    assert (got - ref).abs().max().item() < tol
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= tol * max(1.0, ref_grads[name].abs().max().item()), name
