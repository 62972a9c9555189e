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
    """The api part's in-process side trains the recipe's datums with Tinker's `importance_sampling`
    (`Learner.tinker_forward_backward`): its `loss:sum` is the sum over the reply tokens."""
    from tinker_pipelines.algorithms.tinker_losses import importance_sampling, tinker_loss
    from tinker_pipelines.training.learner import Learner, LearnerConfig

    model, tok = tiny
    learner = Learner(model, LearnerConfig(learning_rate=1e-3, micro_batch_size=64), tok.pad_token_id, init_seed=0)
    datums = [rep.rl_datum([3, 4, 5], (6, 7, 8), (-1.0, -2.0, -0.5), 0.5),
              rep.rl_datum([3, 4, 5, 9], (10,), (-3.0,), -1.0)]
    _, metrics = learner.tinker_forward_backward(datums, tinker_loss("importance_sampling"))
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in learner.params)
    lp = learner.compute_logprobs(datums)
    flat = lambda key: torch.tensor([v for d in datums for v, w in zip(getattr(d, key), d.weights) if w > 0])
    new = torch.tensor([v for d, row in zip(datums, lp) for v, w in zip(row, d.weights) if w > 0])
    want, _ = importance_sampling(new, flat("behaviour_logprobs"), flat("advantages"))
    assert metrics["loss:sum"] == pytest.approx(want.item(), rel=1e-6, abs=1e-6)
    assert not torch.cuda.is_initialized()
