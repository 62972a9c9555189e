"""Tinker's built-in losses against a direct per-token computation, their gradients, their
`loss_fn_config` validation, and agreement with our own losses where the two coincide."""

import math

import pytest
import torch

from tinker_pipelines.algorithms import LossBatch, LossConfig, get_algorithm
from tinker_pipelines.algorithms.tinker_losses import (
    TINKER_LOSSES,
    TinkerLossError,
    cispo,
    cross_entropy,
    dro,
    importance_sampling,
    ppo,
    tinker_loss,
)


def _rl_tokens(n=40, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    sampling_N = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    # spread the log-ratio over [-0.6, 0.6] so both clip sides and the band are all hit
    target_N = sampling_N + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 1.2
    adv_N = torch.randn(n, generator=g, dtype=torch.float64)
    adv_N[:5] = 0.0  # prompt positions, as the cookbook sends them
    return target_N.to(dtype), sampling_N.to(dtype), adv_N.to(dtype)


def _direct(name, target, sampling, adv, weights=None, low=0.8, high=1.2, beta=0.1):
    """The documented formulas, one token at a time in Python floats."""
    total = 0.0
    for i in range(len(target)):
        t, q = float(target[i]), float(sampling[i]) if sampling is not None else 0.0
        a = float(adv[i]) if adv is not None else 0.0
        r = math.exp(t - q)
        if name == "cross_entropy":
            total += -t * float(weights[i])
        elif name == "importance_sampling":
            total += -r * a
        elif name == "ppo":
            total += -min(r * a, min(max(r, low), high) * a)
        elif name == "cispo":
            total += -min(max(r, low), high) * t * a
        elif name == "dro":
            total += -(t * a - 0.5 * beta * (t - q) ** 2)
    return total


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro"])
def test_rl_losses_match_direct_per_token_sum(name):
    target, sampling, adv = _rl_tokens(dtype=torch.float64)
    loss_fn = tinker_loss(name, {"beta": 0.3} if name == "dro" else None)
    inputs = {"target_tokens": torch.arange(40), "logprobs": sampling, "advantages": adv}
    assert loss_fn.check_inputs(inputs) == 40
    loss, metrics = loss_fn(target, inputs)
    low, high = loss_fn.config.get("clip_low_threshold"), loss_fn.config.get("clip_high_threshold")
    want = _direct(name, target, sampling, adv, low=low, high=high, beta=0.3)
    assert loss.item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert metrics == {"loss:sum": loss.item()}


def test_cross_entropy_matches_direct_sum_with_arbitrary_weights():
    # forward_backward_custom sends weights = -dC/dlogprobs: any sign, any size
    target = -torch.rand(30, dtype=torch.float64) * 4
    weights = torch.randn(30, dtype=torch.float64)
    loss, metrics = tinker_loss("cross_entropy")(target, {"target_tokens": torch.zeros(30, dtype=torch.long),
                                                          "weights": weights})
    assert loss.item() == pytest.approx(_direct("cross_entropy", target, None, None, weights), rel=1e-12)
    assert metrics["loss:sum"] == loss.item()


def test_sum_reduction_is_additive_over_datums():
    """Tinker sums over tokens, not a mean: two datums concatenated give the sum of their losses."""
    target, sampling, adv = _rl_tokens(n=24, seed=3, dtype=torch.float64)
    whole, _ = importance_sampling(target, sampling, adv)
    parts = importance_sampling(target[:10], sampling[:10], adv[:10])[0] + \
        importance_sampling(target[10:], sampling[10:], adv[10:])[0]
    assert whole.item() == pytest.approx(parts.item(), rel=1e-12)
    doubled, _ = importance_sampling(torch.cat([target, target]), torch.cat([sampling, sampling]),
                                     torch.cat([adv, adv]))
    assert doubled.item() == pytest.approx(2 * whole.item(), rel=1e-12)


def _analytic_grad(name, target, sampling, adv, weights=None, low=0.8, high=1.2, beta=0.1):
    """d loss / d target_logprobs, worked out by hand from each documented formula."""
    r = torch.exp(target - sampling) if sampling is not None else None
    if name == "cross_entropy":
        return -weights
    if name == "importance_sampling":
        return -r * adv
    if name == "ppo":
        # the unclipped term's gradient where it is the min (or ties), else the constant clipped term's 0
        unclipped_is_min = r * adv <= r.clamp(low, high) * adv
        return torch.where(unclipped_is_min, -r * adv, torch.zeros_like(r))
    if name == "cispo":
        return -r.clamp(low, high) * adv
    if name == "dro":
        return -(adv - beta * (target - sampling))
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_gradients_match_hand_derivation_and_gradcheck(name):
    target, sampling, adv = _rl_tokens(seed=7, dtype=torch.float64)
    weights = torch.randn(40, dtype=torch.float64)
    cfg = {"clip_low_threshold": 0.85, "clip_high_threshold": 1.15} if name in ("ppo", "cispo") else {}
    if name == "dro":
        cfg = {"beta": 0.2}
    loss_fn = tinker_loss(name, cfg)
    inputs = {"target_tokens": torch.arange(40), "weights": weights} if name == "cross_entropy" else \
        {"target_tokens": torch.arange(40), "logprobs": sampling, "advantages": adv}
    x = target.clone().requires_grad_(True)
    loss_fn(x, inputs)[0].backward()
    want = _analytic_grad(name, target, sampling, adv, weights, low=cfg.get("clip_low_threshold", 0.8),
                          high=cfg.get("clip_high_threshold", 1.2), beta=cfg.get("beta", 0.1))
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=1e-12)
    if name == "ppo":  # the data must exercise both a zero (clipped) and a live gradient
        assert (x.grad == 0).any() and (x.grad != 0).any()
    if name != "cispo":  # cispo's detached coefficient is not the derivative of its value: no gradcheck
        assert torch.autograd.gradcheck(lambda t: loss_fn(t, inputs)[0], (target.clone().requires_grad_(True),))


def test_importance_sampling_and_ppo_equal_our_losses_bit_for_bit_in_fp32():
    """Where they coincide (one row, weights 1, a sum = 'constant' normalization over 1 token,
    symmetric clip), Tinker's IS and PPO are our `importance_sampling` and GRPO surrogate."""
    target, sampling, adv = _rl_tokens(n=64, seed=11, dtype=torch.float32)
    ours_cfg = LossConfig(normalization="constant", max_tokens=1, clip_eps=0.2)
    batch = LossBatch(weights_BT=torch.ones(1, 64), behaviour_logprobs_BT=sampling[None], advantages_BT=adv[None])
    for tinker_name, ours_name in (("importance_sampling", "importance_sampling"), ("ppo", "grpo")):
        x_tinker = target.clone().requires_grad_(True)
        x_ours = target[None].clone().requires_grad_(True)
        theirs, _ = tinker_loss(tinker_name, {"clip_low_threshold": 1 - 0.2, "clip_high_threshold": 1 + 0.2}
                                if tinker_name == "ppo" else None)(
            x_tinker, {"target_tokens": torch.arange(64), "logprobs": sampling, "advantages": adv})
        ours, _ = get_algorithm(ours_name).loss(x_ours, batch, ours_cfg)
        theirs.backward()
        ours.backward()
        assert theirs.dtype == ours.dtype == torch.float32
        assert theirs.item() == ours.item(), tinker_name
        assert torch.equal(x_tinker.grad, x_ours.grad[0]), tinker_name


def test_cross_entropy_equals_our_sft_loss_times_token_count():
    target = -torch.rand(1, 16) * 3
    loss, _ = cross_entropy(target[0], torch.ones(16))
    ours, _ = get_algorithm("sft").loss(target, LossBatch(weights_BT=torch.ones(1, 16)), LossConfig())
    assert loss.item() == pytest.approx(16 * ours.item(), rel=1e-6)


def test_bf16_logprobs_are_computed_in_fp32_and_grad_returns_in_bf16():
    target32, sampling32, adv32 = _rl_tokens(seed=5, dtype=torch.float32)
    target16 = target32.to(torch.bfloat16).requires_grad_(True)
    loss16, _ = ppo(target16, sampling32.to(torch.bfloat16), adv32.to(torch.bfloat16), 0.8, 1.2)
    assert loss16.dtype == torch.float32
    loss16.backward()
    assert target16.grad.dtype == torch.bfloat16
    # the same bf16 values computed in fp32 by hand: exact agreement, not just bf16 tolerance
    ref, _ = ppo(target16.detach().float(), sampling32.to(torch.bfloat16).float(),
                 adv32.to(torch.bfloat16).float(), 0.8, 1.2)
    assert loss16.item() == ref.item()
    assert not torch.cuda.is_initialized()


def test_defaults_are_tinkers():
    assert tinker_loss("ppo").config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert tinker_loss("cispo").config == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert tinker_loss("dro", {"beta": 0.05}).config == {"beta": 0.05}
    assert tinker_loss("importance_sampling", {}).config == {}
    assert list(TINKER_LOSSES) == ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]


@pytest.mark.parametrize("name", ["stable_reinforce", "custom", "gspo", "grpo", "", None])
def test_unsupported_losses_are_refused_naming_the_supported_set(name):
    with pytest.raises(TinkerLossError) as e:
        tinker_loss(name)
    assert e.value.field == "loss_fn"
    assert repr(name) in str(e.value)
    assert "supported: cross_entropy, importance_sampling, ppo, cispo, dro" in str(e.value)


@pytest.mark.parametrize("name,config,field,words", [
    ("ppo", {"clip_eps": 0.2}, "loss_fn_config.clip_eps", "allowed: clip_low_threshold, clip_high_threshold"),
    ("importance_sampling", {"beta": 0.1}, "loss_fn_config.beta", "allowed: none"),
    ("cross_entropy", {"clip_low_threshold": 0.9}, "loss_fn_config.clip_low_threshold", "allowed: none"),
    ("dro", {}, "loss_fn_config.beta", "is required"),
    ("dro", {"beta": "0.1"}, "loss_fn_config.beta", "finite number"),
    ("dro", {"beta": -1.0}, "loss_fn_config.beta", ">= 0"),
    ("ppo", {"clip_low_threshold": float("nan")}, "loss_fn_config.clip_low_threshold", "finite number"),
    ("ppo", {"clip_low_threshold": 1.3}, "loss_fn_config.clip_low_threshold", "<= clip_high_threshold"),
    ("cispo", {"clip_high_threshold": True}, "loss_fn_config.clip_high_threshold", "finite number"),
])
def test_bad_loss_fn_config_names_the_key(name, config, field, words):
    with pytest.raises(TinkerLossError) as e:
        tinker_loss(name, config)
    assert e.value.field == field
    assert field in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("name,inputs,field", [
    ("importance_sampling", {"target_tokens": torch.arange(4), "logprobs": torch.zeros(4)},
     "data[2].loss_fn_inputs.advantages"),
    ("importance_sampling", {"target_tokens": torch.arange(4), "logprobs": torch.zeros(4),
                             "advantages": torch.zeros(4), "mask": torch.ones(4)}, "data[2].loss_fn_inputs.mask"),
    ("cross_entropy", {"target_tokens": torch.zeros(4), "weights": torch.ones(4)},
     "data[2].loss_fn_inputs.target_tokens"),
    ("cross_entropy", {"target_tokens": torch.arange(4), "weights": torch.ones(3)}, "data[2].loss_fn_inputs.weights"),
    ("ppo", {"target_tokens": torch.arange(4), "logprobs": torch.zeros(4, dtype=torch.long),
             "advantages": torch.zeros(4)}, "data[2].loss_fn_inputs.logprobs"),
    ("ppo", {"target_tokens": torch.arange(4)[None], "logprobs": torch.zeros(4), "advantages": torch.zeros(4)},
     "data[2].loss_fn_inputs.target_tokens"),
])
def test_bad_loss_fn_inputs_name_the_datum_and_key(name, inputs, field):
    with pytest.raises(TinkerLossError) as e:
        tinker_loss(name, {"beta": 0.1} if name == "dro" else None).check_inputs(inputs, datum_index=2)
    assert e.value.field == field and field in str(e.value)
