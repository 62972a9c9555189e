"""Losses and advantages against values computed by hand."""

import math

import pytest
import torch

from tinker_pipelines.algorithms import LossBatch, LossConfig, get_algorithm, kl_penalty
from tinker_pipelines.algorithms.advantages import group_centered, group_normalized, leave_one_out


def _batch(**kw):
    return LossBatch(weights_BT=torch.tensor([[0.0, 1.0, 1.0]]), **kw)


def test_sft_loss_is_mean_nll_over_weighted_tokens():
    lp = torch.tensor([[-9.0, -1.0, -3.0]])
    loss, m = get_algorithm("sft").loss(lp, _batch(), LossConfig())
    assert loss.item() == pytest.approx(2.0)  # (1 + 3) / 2, the prompt position ignored
    assert m["nll"] == pytest.approx(2.0)


def test_importance_sampling_loss_and_gradient():
    lp = torch.tensor([[0.0, math.log(0.5), math.log(0.2)]], requires_grad=True)
    old = torch.tensor([[0.0, math.log(0.25), math.log(0.2)]])
    adv = torch.tensor([[0.0, 1.0, -2.0]])
    loss, _ = get_algorithm("importance_sampling").loss(lp, _batch(behaviour_logprobs_BT=old, advantages_BT=adv),
                                                        LossConfig(normalization="token"))
    # ratios 2 and 1: -(2*1 + 1*(-2)) / 2 = 0
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    # d/dlp of -ratio*A/2 = -ratio*A/2
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -1.0, 1.0])


def test_grpo_clips_ratio_outside_band():
    old = torch.zeros(1, 3)
    lp = torch.tensor([[0.0, math.log(1.5), math.log(0.5)]], requires_grad=True)
    adv = torch.tensor([[0.0, 1.0, -1.0]])
    loss, m = get_algorithm("grpo").loss(lp, _batch(behaviour_logprobs_BT=old, advantages_BT=adv),
                                         LossConfig(clip_eps=0.2, normalization="token"))
    # token 1: min(1.5, 1.2) * 1 = 1.2 ; token 2: min(0.5*-1, 0.8*-1) = -0.8 -> -(1.2 - 0.8)/2
    assert loss.item() == pytest.approx(-0.2)
    assert m["clip_fraction"] == pytest.approx(1.0)
    loss.backward()
    assert lp.grad.abs().sum().item() == 0.0  # both clipped: no gradient


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_clip_blocks_the_gradient_only_on_the_side_the_advantage_pushes(name):
    """Four tokens outside the band: ratio 1.5 with A > 0 and ratio 0.5 with A < 0 are clipped
    (zero gradient, counted in clip_fraction); ratio 1.5 with A < 0 and 0.5 with A > 0 still get
    the unclipped gradient -A * ratio / n (the min picks the unclipped term) and are not counted."""
    w = torch.ones(1, 5)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.0]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 2.0]])
    extra = {"values_BT": torch.zeros(1, 5), "old_values_BT": torch.zeros(1, 5), "returns_BT": torch.zeros(1, 5)}
    batch = LossBatch(w, behaviour_logprobs_BT=torch.zeros(1, 5), advantages_BT=adv, **(extra if name == "ppo" else {}))
    loss, m = get_algorithm(name).loss(lp, batch, LossConfig(clip_eps=0.2, normalization="token"))
    loss.backward()
    grad = lp.grad[0].tolist()
    assert grad[0] == 0.0 and grad[1] == 0.0
    assert grad[2:] == pytest.approx([1.5 / 5, -0.5 / 5, -2.0 / 5])
    assert m["clip_fraction"] == pytest.approx(2 / 5)


def test_dr_grpo_is_grpo_without_std_and_length_normalization():
    """Dr. GRPO (Liu et al., 2025): group-centred advantages (no std) and the token sum divided
    by a constant (B x max_tokens), whatever `normalization` the config passes; GRPO: std-scaled
    advantages and per-reply length normalization."""
    dr, grpo = get_algorithm("dr_grpo"), get_algorithm("grpo")
    assert (dr.advantages, grpo.advantages) == ("group_centered", "group_normalized")
    assert dr.normalization == "constant" and grpo.normalization is None
    w = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # replies of 3 and 1 tokens
    lp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    batch = LossBatch(w, behaviour_logprobs_BT=torch.zeros(2, 3), advantages_BT=adv)
    for norm in ("sequence", "token", "constant"):
        loss, _ = dr.loss(lp, batch, LossConfig(normalization=norm, max_tokens=4))
        assert loss.item() == pytest.approx(-(3 - 1) / (2 * 4))  # -sum(ratio * A) / (B * max_tokens)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-1 / 8] * 3 + [1 / 8, 0.0, 0.0])  # every token weighs 1 / (B L)
    ref = LossBatch(w, behaviour_logprobs_BT=torch.zeros(2, 3), advantages_BT=adv, ref_logprobs_BT=torch.full((2, 3), -1.0))
    kl_loss, m = dr.loss(torch.zeros(2, 3), ref, LossConfig(kl_coef=1.0, kl_estimator="k1", max_tokens=4))
    assert kl_loss.item() == pytest.approx(-(3 - 1) / 8 + 4 / 8)  # the KL term divided by the same constant
    assert m["kl"] == pytest.approx(1.0)  # logged per token, comparable across normalizations
    g_loss, _ = grpo.loss(lp, batch, LossConfig())
    assert g_loss.item() == pytest.approx(-(1 - 1) / 2)  # sequence means 1 and -1: the long reply weighs no more


def test_approx_kl_and_value_clip_fraction_are_reported():
    lp = torch.log(torch.tensor([[1.0, 1.5, 0.5]]))
    values = torch.tensor([[0.0, 1.0, 0.1]])
    batch = _batch(behaviour_logprobs_BT=torch.zeros(1, 3), advantages_BT=torch.ones(1, 3), values_BT=values,
                   old_values_BT=torch.zeros(1, 3), returns_BT=torch.tensor([[0.0, 3.0, -3.0]]))
    _, m = get_algorithm("ppo").loss(lp, batch, LossConfig(normalization="token", value_clip=0.2))
    k3 = [(r - 1) - math.log(r) for r in (1.5, 0.5)]
    assert m["approx_kl"] == pytest.approx(sum(k3) / 2)
    # token 1: v moved 1.0 > 0.2 away from old, towards R = 3: the clipped error is larger and wins;
    # token 2: v moved 0.1, inside the band
    assert m["value_clip_fraction"] == pytest.approx(0.5)


def test_ppo_adds_clipped_value_loss():
    old_lp = torch.zeros(1, 3)
    lp = torch.zeros(1, 3, requires_grad=True)
    adv = torch.tensor([[0.0, 1.0, -1.0]])
    values = torch.tensor([[5.0, 1.0, 0.0]], requires_grad=True)
    batch = _batch(behaviour_logprobs_BT=old_lp, advantages_BT=adv, values_BT=values,
                   old_values_BT=torch.tensor([[0.0, 0.5, 0.0]]), returns_BT=torch.tensor([[0.0, 0.0, 2.0]]))
    cfg = LossConfig(normalization="token", vf_coef=0.5, value_clip=0.2)
    loss, m = get_algorithm("ppo").loss(lp, batch, cfg)
    # policy: ratio 1, -(1 - 1)/2 = 0. value, token 1: v=1, clipped 0.7, R=0 -> max(1, 0.49) = 1;
    # token 2: v=0, R=2 -> max(4, 4) = 4; 0.5 * mean(1, 4) = 1.25; the prompt position is ignored.
    assert m["policy_loss"] == pytest.approx(0.0, abs=1e-7)
    assert m["value_loss"] == pytest.approx(1.25)
    assert loss.item() == pytest.approx(0.5 * 1.25)
    loss.backward()
    # d/dv of 0.5 * 0.5 * mean((v - R)^2) = 0.5 * (v - R) / 2 on the unclipped branch
    assert values.grad.tolist()[0] == pytest.approx([0.0, 0.25, -0.5])
    # explained variance: returns (0, 2), residuals (-1, 2): 1 - 2.25 / 1
    assert m["explained_variance"] == pytest.approx(-1.25)


def test_ppo_value_clip_stops_the_gradient_of_far_values():
    values = torch.tensor([[0.0, 1.0, 0.0]], requires_grad=True)
    batch = _batch(behaviour_logprobs_BT=torch.zeros(1, 3), advantages_BT=torch.zeros(1, 3), values_BT=values,
                   old_values_BT=torch.tensor([[0.0, 0.0, 0.0]]), returns_BT=torch.tensor([[0.0, 3.0, 0.0]]))
    loss, _ = get_algorithm("ppo").loss(torch.zeros(1, 3), batch, LossConfig(normalization="token", value_clip=0.2))
    loss.backward()
    # token 1: unclipped (1-3)^2 = 4 < clipped (0.2-3)^2 = 7.84: the clipped branch, constant in v
    assert values.grad.abs().sum().item() == 0.0
    loss, _ = get_algorithm("ppo").loss(torch.zeros(1, 3), batch, LossConfig(normalization="token", value_clip=0.0))
    values.grad = None
    loss.backward()
    assert values.grad[0, 1].item() != 0.0


def test_ppo_without_values_names_what_is_missing():
    batch = _batch(behaviour_logprobs_BT=torch.zeros(1, 3), advantages_BT=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="values_BT"):
        get_algorithm("ppo").loss(torch.zeros(1, 3), batch, LossConfig())


def test_grpo_sequence_normalisation_and_kl():
    w = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    lp = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    batch = LossBatch(w, behaviour_logprobs_BT=lp.clone(), advantages_BT=torch.tensor([[1.0, 1.0, 0], [-3.0, 0, 0]]),
                      ref_logprobs_BT=lp - 1.0)
    loss, m = get_algorithm("grpo").loss(lp, batch, LossConfig(kl_coef=0.5, kl_estimator="k3"))
    # surrogate: seq means 1 and -3 -> mean -1 -> loss +1; k3 with d=-1: e^-1 + 1 - 1 = 0.3679 per token
    k3 = math.exp(-1.0)
    assert m["kl"] == pytest.approx(k3, rel=1e-5)
    assert loss.item() == pytest.approx(1.0 + 0.5 * k3, rel=1e-5)


def test_kl_estimators():
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k9")


def test_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert group_normalized(r).tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], rel=1e-5)
    assert group_centered(r).tolist() == [0.5, -0.5, -0.5, 0.5]
    assert leave_one_out(torch.tensor([3.0, 0.0, 0.0])).tolist() == [3.0, -1.5, -1.5]


def test_unknown_algorithm_names_the_field():
    with pytest.raises(ValueError, match="algorithm.name 'reinforce9'"):
        get_algorithm("reinforce9")


def test_sequence_mean_with_untrained_rows_is_finite_and_micro_batches_add_up():
    """A row without trained tokens (weights all 0) counts as a zero sequence: a micro-batch of only
    such rows gives 0, not the NaN of an empty mean, and micro-batches scaled by
    `micro_batch_share` add up to the whole batch's mean."""
    from tinker_pipelines.algorithms.losses import masked_mean, micro_batch_share

    x_BT = torch.tensor([[1.0, 3.0], [5.0, 7.0], [2.0, 4.0], [6.0, 8.0]])
    w_BT = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    whole = masked_mean(x_BT, w_BT, "sequence")
    assert whole.item() == (3.0 + 6.0) / 4
    first = masked_mean(x_BT[:2], w_BT[:2], "sequence")
    assert first.item() == 0.0
    parts = sum(masked_mean(x_BT[s:s + 2], w_BT[s:s + 2], "sequence")
                * micro_batch_share("sequence", float(w_BT[s:s + 2].sum()), float(w_BT.sum()), 2, 4)
                for s in (0, 2))
    assert torch.isclose(parts, whole)
