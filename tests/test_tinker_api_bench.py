"""`benchmarks.tinker_api`'s own pieces that run without the service: the recipe's datums in the
SDK's types, and the in-process side's loss (Tinker's `importance_sampling` sum) through our
learner."""

from __future__ import annotations


import pytest
import torch

from benchmarks import cookbook_replica as rep
from benchmarks import tinker_api
from benchmarks import tinker_api_steps as steps



def test_recipe_datums_in_the_sdks_types():
    d = rep.rl_datum([5, 6, 7], (8, 9), (-0.5, -1.5), 0.25)
    assert d.input_tokens == (5, 6, 7, 8) and d.target_tokens == (6, 7, 8, 9)
    assert d.behaviour_logprobs == (0.0, 0.0, -0.5, -1.5) and d.advantages == (0.0, 0.0, 0.25, 0.25)
    sdk = steps.to_sdk_datum(d)
    assert sdk.model_input.to_ints() == [5, 6, 7, 8]
    inputs = sdk.loss_fn_inputs
    assert inputs["target_tokens"].dtype == "int64" and inputs["target_tokens"].data == [6, 7, 8, 9]
    assert inputs["logprobs"].dtype == "float32" and inputs["advantages"].data == [0.0, 0.0, 0.25, 0.25]


class _Tok:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_group_advantages_are_centred_rewards():
    seqs = [([ord(c) for c in " 3\n\nUser:"], [-0.1] * 9, True), ([ord(c) for c in " 4"], [-0.2] * 2, False)]
    ds = steps.group_datums([1, 2], seqs, 1, 2, _Tok())
    # rewards 1.0 (right, stopped) and -0.1 (wrong, cut): mean 0.45
    assert ds[0].advantages[-1] == pytest.approx(0.55) and ds[1].advantages[-1] == pytest.approx(-0.55)


def test_inprocess_loss_is_tinkers_importance_sampling_sum(tiny):
    """The learner loss of the api part reports Tinker's `loss:sum` over the batch and its
    gradient is that sum's, divided by the weighted token count."""
    import copy

    from tinker_pipelines.algorithms.losses import LossConfig, importance_sampling_loss
    from tinker_pipelines.algorithms.tinker_losses import importance_sampling
    from tinker_pipelines.training.learner import Learner, LearnerConfig

    model, tok = tiny
    twin = copy.deepcopy(model)
    cfg = LearnerConfig(learning_rate=1e-3, micro_batch_size=64)
    learner = Learner(model, cfg, tok.pad_token_id, init_seed=0)
    datums = [rep.rl_datum([3, 4, 5], (6, 7, 8), (-1.0, -2.0, -0.5), 0.5),
              rep.rl_datum([3, 4, 5, 9], (10,), (-3.0,), -1.0)]
    metrics = learner.forward_backward(datums, steps.tinker_is_loss, LossConfig())
    grads = [p.grad.clone() for p in learner.params if p.grad is not None]
    lp = learner.compute_logprobs(datums)
    flat = lambda key: torch.tensor([v for d in datums for v, w in zip(getattr(d, key), d.weights) if w > 0])
    new = torch.tensor([v for d, row in zip(datums, lp) for v, w in zip(row, d.weights) if w > 0])
    want, _ = importance_sampling(new, flat("behaviour_logprobs"), flat("advantages"))
    assert metrics["loss_sum"] == pytest.approx(want.item(), rel=1e-6, abs=1e-6)
    # our own importance_sampling loss averaged over the weighted tokens: sum / W, the same gradient
    other = Learner(twin, cfg, tok.pad_token_id, init_seed=0)
    other.forward_backward(datums, importance_sampling_loss, LossConfig(normalization="token"))
    want_grads = [p.grad for p in other.params if p.grad is not None]
    assert len(grads) == len(want_grads) > 0
    assert any(g.abs().max() > 0 for g in grads)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert not torch.cuda.is_initialized()
