"""Tinker's semantics on the one gradient path: datums, summed losses, per-datum logprobs, AdamParams."""

import math

import pytest
import torch

from tinker_pipelines.algorithms.tinker_losses import (TinkerLossError, TinkerLossFn, datum_from_tinker,
                                                       tinker_loss)
from tinker_pipelines.models import load_model
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.rollout.truncation import target_logprobs
from tinker_pipelines.training.padding import pad_datums

TOKENS = [[5, 9, 12, 7, 30, 31], [5, 9, 40, 41, 42, 8], [6, 10, 11, 13, 14, 15]]
TOKENS_RAGGED = [[5, 9, 12, 7], [5, 9, 40, 41, 42, 8, 17, 19], [6, 10, 11]]


def ce_datums(tokens=TOKENS):
    return [datum_from_tinker(t[:-1], {"target_tokens": torch.tensor(t[1:]),
                                       "weights": torch.tensor([0.0, 0.0] + [1.0 + 0.5 * i] * (len(t) - 3))})
            for i, t in enumerate(tokens)]


def rl_datums(tokens=TOKENS_RAGGED):
    g = torch.Generator().manual_seed(3)
    return [datum_from_tinker(t[:-1], {"target_tokens": torch.tensor(t[1:]),
                                       "logprobs": -torch.rand(len(t) - 1, generator=g) * 3,
                                       "advantages": torch.randn(len(t) - 1, generator=g)})
            for t in tokens]


def learner(dtype="float32", mb=8, seed=1):
    model, tok = load_model("tiny", seed=0, dtype=dtype)
    lr = Learner(model, LearnerConfig(mode="lora", micro_batch_size=mb, grad_clip=1.0), tok.pad_token_id,
                 init_seed=seed)
    with torch.no_grad():  # a non-zero B, so the adapter changes the function and gets A's gradient
        g = torch.Generator().manual_seed(5)
        for n, p in lr.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return lr, tok


ADAM = {"learning_rate": 1e-3, "beta1": 0.8, "beta2": 0.9, "eps": 1e-10, "weight_decay": 0.01, "grad_clip_norm": 0.0}


@pytest.mark.parametrize("logprob_op", ["target_logprobs", "log_softmax"])
def test_cross_entropy_and_adam_step_equal_a_direct_torch_computation_fp32(logprob_op):
    """Bit for bit with the project's logprob op (`target_logprobs`, whose backward recomputes
    the softmax chunk by chunk); to float rounding with autograd's log_softmax."""
    ours, tok = learner()
    ref, _ = learner()
    datums = ce_datums()
    before = ours.compute_logprobs(datums)
    logprobs, metrics = ours.tinker_forward_backward(datums, tinker_loss("cross_entropy"))
    out = ours.optim_step(ADAM)
    # the direct computation: sum of -w * logprob over every token, then torch's AdamW
    padded = pad_datums(datums, tok.pad_token_id)
    logits_BTV = ref.model(input_ids=padded.inputs_BT, attention_mask=padded.mask_BT).logits
    if logprob_op == "target_logprobs":
        lp_BT = target_logprobs(logits_BTV, padded.targets_BT, 1.0)
    else:
        lp_BT = torch.log_softmax(logits_BTV.float(), -1).gather(-1, padded.targets_BT[..., None]).squeeze(-1)
    loss = -(lp_BT * padded.fields["weights"]).sum()
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.params]))
    opt = torch.optim.AdamW(ref.params, lr=1e-3, betas=(0.8, 0.9), eps=1e-10, weight_decay=0.01)
    opt.step()
    assert set(metrics) == {"loss:sum"}
    assert metrics["loss:sum"] == pytest.approx(loss.item(), rel=1e-6)
    assert logprobs == before  # the per-datum outputs are compute_logprobs' values
    assert [len(x) for x in logprobs] == [len(d.input_tokens) for d in datums]
    assert out["grad_norm"] == pytest.approx(norm.item(), rel=1e-6) and out["learning_rate"] == 1e-3
    if logprob_op == "target_logprobs":
        assert all(torch.equal(a, b) for a, b in zip(ours.params, ref.params))  # bit for bit
    else:
        assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(ours.params, ref.params))
    assert not all(torch.equal(a, b) for a, b in zip(ours.params, learner()[0].params))  # it did step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,config", [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
                                         ("cispo", {}), ("dro", {"beta": 0.5})])
def test_micro_batching_does_not_change_a_summed_loss(dtype, name, config):
    datums = ce_datums(TOKENS_RAGGED) if name == "cross_entropy" else rl_datums()
    loss = tinker_loss(name, config)
    runs = []
    for mb in (1, 8):
        lr, _ = learner(dtype, mb)
        logprobs, metrics = lr.tinker_forward_backward(datums, loss)
        runs.append((logprobs, metrics, [p.grad.clone() for p in lr.params], lr))
    (lp1, m1, g1, lr1), (lp8, m8, g8, lr8) = runs
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == "float32" else dict(rtol=0.05, atol=1e-3)
    assert m1["loss:sum"] == pytest.approx(m8["loss:sum"], rel=tol["rtol"], abs=tol["atol"])
    # the same gradient up to the rounding of other matmul shapes, relative to each tensor's scale
    scale = 1e-5 if dtype == "float32" else 0.05
    assert all((a - b).abs().max() <= scale * b.abs().max() for a, b in zip(g1, g8))
    assert all(b.abs().max() > 0 for b in g8)
    assert all(p.dtype == torch.float32 for p in lr8.params)  # adapters stay fp32 over a bf16 base
    # padding adds nothing: the loss is Tinker's over the concatenated tokens of the datums
    direct = lr8.compute_logprobs(datums)
    lp_N = torch.tensor([x for row in direct for x in row])
    inputs = ({"weights": torch.tensor([w for d in datums for w in d.weights])} if name == "cross_entropy" else
              {"logprobs": torch.tensor([x for d in datums for x in d.behaviour_logprobs]),
               "advantages": torch.tensor([x for d in datums for x in d.advantages])})
    assert m8["loss:sum"] == pytest.approx(loss(lp_N, inputs)[1]["loss:sum"], rel=tol["rtol"], abs=tol["atol"])
    assert [len(r) for r in lp8] == [len(d.input_tokens) for d in datums]
    assert all(math.isfinite(x) for r in lp1 for x in r)
    if dtype == "float32":
        assert lp8 == direct
    else:
        assert all(a == pytest.approx(b, abs=0.05) for r, s in zip(lp8, direct) for a, b in zip(r, s))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_only_is_compute_logprobs_and_leaves_no_gradient(dtype):
    lr, _ = learner(dtype)
    datums = rl_datums()
    loss = tinker_loss("importance_sampling")
    logprobs, metrics = lr.tinker_forward_backward(datums, loss, forward_only=True)
    assert logprobs == lr.compute_logprobs(datums)
    assert all(p.grad is None for p in lr.params)
    _, trained = lr.tinker_forward_backward(datums, loss)
    assert set(metrics) == {"loss:sum"}
    assert metrics["loss:sum"] == pytest.approx(trained["loss:sum"], rel=1e-5 if dtype == "float32" else 0.05)


def test_adam_params_set_the_groups_clip_and_name_a_bad_field():
    lr, _ = learner()
    datums = ce_datums()
    lr.tinker_forward_backward(datums, tinker_loss("cross_entropy"))
    grads = [p.grad.clone() for p in lr.params]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    before = [p.detach().clone() for p in lr.params]
    out = lr.optim_step({**ADAM, "grad_clip_norm": norm / 4, "beta1": 0.0, "beta2": 0.0, "weight_decay": 0.0,
                         "learning_rate": 0.5})
    assert out["grad_norm"] == pytest.approx(norm, rel=1e-6)
    group = lr.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"]) == (0.5, (0.0, 0.0), 1e-10)
    # betas 0: the step is lr * g / (|g| + eps), g the clipped gradient; its sign shows the step ran
    for p, b, g in zip(lr.params, before, grads):
        moved = (b - p.detach())
        assert torch.equal(torch.sign(moved[g.abs() > 1e-3]), torch.sign(g[g.abs() > 1e-3]))
    with pytest.raises(ValueError, match=r"^adam_params.beta2 must be in \[0, 1\), got 1.5$"):
        lr.optim_step({"beta2": 1.5})
    with pytest.raises(ValueError, match="adam_params.momentum is not an AdamParams field"):
        lr.optim_step({"momentum": 0.9})


def test_datum_from_tinker_refuses_bad_inputs_naming_the_field():
    ce = tinker_loss("cross_entropy")
    with pytest.raises(TinkerLossError, match=r"data\[2\].loss_fn_inputs.weights must have shape \(3,\)") as e:
        datum_from_tinker([1, 2, 3], {"target_tokens": [2, 3, 4], "weights": [1.0, 1.0]}, datum_index=2)
    assert e.value.field == "data[2].loss_fn_inputs.weights"
    with pytest.raises(TinkerLossError) as e:
        datum_from_tinker([1, 2], {"target_tokens": torch.tensor([2.0, 3.0]), "weights": torch.ones(2)}, loss=ce,
                          datum_index=0)
    assert e.value.field == "data[0].loss_fn_inputs.target_tokens"
    with pytest.raises(TinkerLossError) as e:
        datum_from_tinker([1, 2], {"target_tokens": [2, 3], "weights": [1.0, 1.0]},
                          loss=tinker_loss("ppo"), datum_index=1)
    assert e.value.field == "data[1].loss_fn_inputs.logprobs"
    with pytest.raises(TinkerLossError, match="non-finite") as e:
        datum_from_tinker([1, 2], {"target_tokens": [2, 3], "logprobs": [0.0, float("nan")], "advantages": [1.0, 1.0]})
    rl = datum_from_tinker([1, 2], {"target_tokens": [2, 3], "logprobs": [-1.0, -2.0], "advantages": [0.5, 0.0]})
    assert rl.weights == (1.0, 1.0) and rl.behaviour_logprobs == (-1.0, -2.0) and rl.advantages == (0.5, 0.0)
    fn = TinkerLossFn(ce)
    assert fn.normalization == "sum" and fn.own_metrics
