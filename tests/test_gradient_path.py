"""The one loss-and-gradient path (`training.gradient`): every learner and the worker run it."""

import pytest
import torch

from tinker_pipelines.algorithms import LossConfig, get_algorithm
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.training.padding import pad_datums
from tinker_pipelines.training import gradient
from tinker_pipelines.types import Datum
from tinker_pipelines.worker import batching

DATUMS = [Datum((1, 2, 3, 4), (2, 3, 4, 5), (0.0, 1.0, 1.0, 1.0), advantages=(0.0, 1.0, 1.0, 1.0)),
          Datum((1, 2, 6), (2, 6, 7), (0.0, 1.0, 1.0), advantages=(0.0, -1.0, -1.0))]


def test_learner_and_worker_run_the_one_path(tiny, monkeypatch):
    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode="lora", micro_batch_size=1), tok.pad_token_id, init_seed=0)
    calls = []
    real = gradient.accumulate_gradients

    def counted(passes, *a, **k):
        passes = list(passes)
        calls.append([len(p.spans) for p in passes])
        return real(iter(passes), *a, **k)

    monkeypatch.setattr("tinker_pipelines.training.learner.accumulate_gradients", counted)
    monkeypatch.setattr(batching, "accumulate_gradients", counted)
    grpo = get_algorithm("grpo")
    solo = learner.forward_backward(DATUMS, grpo.loss)
    grads = [p.grad.clone() for p in learner.params]
    learner.optimizer.zero_grad(set_to_none=True)
    job, = batching.forward_backward_together([batching.FBJob(learner, DATUMS, grpo.loss, LossConfig())])
    assert calls == [[1, 1], [1, 1]]  # a pass per micro-batch, a span each, both times
    assert job.error is None and job.totals == solo
    assert all(torch.equal(p.grad, g) for p, g in zip(learner.params, grads))


def test_a_filler_span_adds_no_gradient_and_no_metric_weight(tiny):
    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode="full"), tok.pad_token_id)
    padded = pad_datums(DATUMS[:1], tok.pad_token_id)
    tally = gradient.Account()
    span = gradient.LossSpan(0, 1, get_algorithm("grpo").loss, LossConfig(), 3.0, 2, 0, tally, filler=True)
    gradient.accumulate_gradients([gradient.Pass(padded, [span], lambda: learner._forward(learner.model, padded))])
    assert tally.totals["loss"] == 0.0 and tally.error is None
    assert all(p.grad is None or not p.grad.any() for p in learner.params)


def test_a_non_finite_loss_fails_its_span_alone_or_raises(tiny):
    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode="full"), tok.pad_token_id)
    padded = pad_datums(DATUMS, tok.pad_token_id)

    def nan_loss(lp_BT, batch, cfg):
        return lp_BT.sum() * float("nan"), {}

    bad, good = gradient.Account(), gradient.Account()
    spans = [gradient.LossSpan(0, 1, nan_loss, LossConfig(), 3.0, 1, 7, bad),
             gradient.LossSpan(1, 2, get_algorithm("grpo").loss, LossConfig(), 2.0, 1, 7, good)]
    forward = lambda: learner._forward(learner.model, padded)  # noqa: E731
    gradient.accumulate_gradients([gradient.Pass(padded, spans, forward)], fail_fast=False)
    assert isinstance(bad.error, FloatingPointError) and "learner step 7" in str(bad.error)
    assert good.error is None and "loss" in good.totals and not bad.totals
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        gradient.accumulate_gradients([gradient.Pass(padded, spans[:1], forward)])


def test_a_reference_loss_without_a_reference_forward_is_refused(tiny):
    model, tok = tiny
    padded = pad_datums(DATUMS, tok.pad_token_id)
    span = gradient.LossSpan(0, 2, get_algorithm("grpo").loss, LossConfig(kl_coef=0.1), 3.0, 2, 0,
                             gradient.Account(), needs_reference=True)
    with pytest.raises(ValueError, match="no reference forward"):
        gradient.span_references(gradient.Pass(padded, [span], lambda: None))
