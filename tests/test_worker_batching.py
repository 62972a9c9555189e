"""Several experiments' forward_backward in one base pass: each adapter gets its own gradient."""

import copy

import pytest
import torch

from tinker_pipelines.algorithms import LossConfig, get_algorithm
from tinker_pipelines.loops.datums import rl_datums, with_reference_logprobs
from tinker_pipelines.envs import EnvSpec
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.models import load_model, stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, run_groups
from tinker_pipelines.rollout.sampler import Sampler
from tinker_pipelines.types import Trajectory, TrajectoryGroup
from tinker_pipelines.worker.batching import FBJob, forward_backward_together


def _datums(model, tok, seeds, seed, algo="grpo"):
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    groups = run_groups(sampler, tok, EnvSpec("arithmetic"), list(seeds), 4, RolloutConfig(max_new_tokens=10),
                        torch.Generator().manual_seed(seed))
    shaped = [TrajectoryGroup(tuple(Trajectory(t.turns, float(len(t.turns[-1].sampled_tokens) + t.turns[-1].sampled_tokens[0] % 7), t.task_id)
                                    for t in g.trajectories)) for g in groups]
    return rl_datums(shaped, get_algorithm(algo).advantages)


def _learners(configs, share=None):
    model, tok = load_model("tiny", seed=0)
    base = model
    learners = []
    for i, cfg in enumerate(configs):
        lr = Learner(base, cfg, tok.pad_token_id, adapter_name=f"exp{i}", init_seed=100 + i)
        base = lr.model
        learners.append(lr)
    with torch.no_grad():  # distinct non-zero B so every adapter changes the function
        g = torch.Generator().manual_seed(5)
        for n, p in base.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return learners, tok


@pytest.mark.parametrize("kl,max_rows,cached", [(0.0, 12, False), (0.05, 12, False), (0.05, 0, False),
                                                (0.05, 12, True), (0.05, 0, True)])
def test_together_equals_alone(kl, max_rows, cached):
    """Shared passes (`max_rows` 12) give each experiment its solo gradients up to rounding;
    passes of their own (0, the worker's default) give exactly the solo floats. `cached`: the
    first experiment's datums carry their reference logprobs (PPO epochs), the last's do not."""
    configs = [LearnerConfig(mode="lora", learning_rate=1e-2, micro_batch_size=5, needs_reference=kl > 0),
               LearnerConfig(mode="lora", learning_rate=1e-2, micro_batch_size=8, lora_rank=4, temperature=0.7),
               LearnerConfig(mode="lora", learning_rate=1e-2, micro_batch_size=64, share_prefix=False,
                             needs_reference=cached)]
    learners, tok = _learners(configs)
    grpo = get_algorithm("grpo")
    cfgs = [LossConfig(kl_coef=kl), LossConfig(normalization="token"), LossConfig(kl_coef=0.1 if cached else 0.0)]
    datums = []
    for i, lr in enumerate(learners):
        lr.activate()
        datums.append(_datums(lr.model, tok, seeds=(i + 1, i + 7, i + 9), seed=i))
    if cached:
        datums[0] = with_reference_logprobs(datums[0], learners[0].compute_reference_logprobs)
    # alone, one after the other
    alone_metrics, alone_grads = [], []
    for lr, d, c in zip(learners, datums, cfgs):
        alone_metrics.append(lr.forward_backward(d, grpo.loss, c))
        alone_grads.append([p.grad.clone() for p in lr.params])
        for p in lr.params:
            p.grad = None
    jobs = forward_backward_together([FBJob(lr, d, grpo.loss, c) for lr, d, c in zip(learners, datums, cfgs)],
                                     max_rows=max_rows)
    for job, metrics, grads in zip(jobs, alone_metrics, alone_grads):
        assert job.error is None
        assert set(job.totals) == set(metrics)
        if max_rows == 0:
            assert job.totals == {**metrics, "trained_tokens": job.totals["trained_tokens"]}
            assert all(torch.equal(p.grad, g) for p, g in zip(job.learner.params, grads))
        for k in metrics:
            assert job.totals[k] == pytest.approx(metrics[k], abs=1e-5), k
        for p, g in zip(job.learner.params, grads):
            assert p.grad is not None
            torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-4)


def test_one_experiment_failing_leaves_the_others():
    configs = [LearnerConfig(mode="lora", learning_rate=1e-2) for _ in range(2)]
    learners, tok = _learners(configs)
    grpo = get_algorithm("grpo")
    learners[0].activate()
    d0 = _datums(learners[0].model, tok, (1, 2, 3), 0)
    learners[1].activate()
    d1 = _datums(learners[1].model, tok, (4, 5, 6), 1)
    alone = learners[1].forward_backward(d1, grpo.loss)
    g_alone = [p.grad.clone() for p in learners[1].params]
    for p in learners[1].params:
        p.grad = None

    def nan_loss(lp, batch, cfg):
        return lp.sum() * float("nan"), {}

    jobs = forward_backward_together([FBJob(learners[0], d0, nan_loss, LossConfig()),
                                      FBJob(learners[1], d1, grpo.loss, LossConfig())])
    assert isinstance(jobs[0].error, FloatingPointError)
    assert all(p.grad is None for p in learners[0].params)
    assert jobs[1].error is None and jobs[1].totals["loss"] == pytest.approx(alone["loss"], abs=1e-6)
    for p, g in zip(learners[1].params, g_alone):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-4)
