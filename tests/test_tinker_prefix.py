"""Tinker's forward_backward over groups that share a prompt: the prompt runs once per group and
its positions' logprobs come back without gradient (`gradient.Positions.RETURNED`), and
everything a client sees (every position's logprob, the loss, the gradient) is what the plain
forward gives."""

import random

import pytest
import torch

import tinker_pipelines.training.learner as learner_module
from tinker_pipelines.algorithms.tinker_losses import datum_from_tinker, tinker_loss
from tinker_pipelines.models import load_model
from tinker_pipelines.rollout.truncation import target_logprobs
from tinker_pipelines.training.learner import Learner, LearnerConfig, pad_datums
from tinker_pipelines.training.prefix_sharing import plan_prefix_sharing, shared_prefix_forward
from tinker_pipelines.training.rules import tinker_lora_settings
from tinker_pipelines.types import Datum

TOL = {"float32": 1e-5, "bfloat16": 3e-2}


def _groups(loss: str | None, seed: int = 0, zero_groups: int = 0) -> list[Datum]:
    """Cookbook-shaped RL datums: groups of 4 samples of one prompt; the prompt's positions have
    advantage 0 and sampling logprob 0, the completion's the group-normalized reward. One
    datum's client-given targets at prompt positions are not the next input token."""
    rng = random.Random(seed)
    out = []
    for g in range(3 + zero_groups):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(9, 16))]
        for _ in range(4):
            completion = [rng.randrange(3, 200) for _ in range(rng.randint(2, 6))]
            toks = prompt + completion
            n = len(toks) - 1
            adv = 0.0 if g >= 3 else rng.choice([-1.0, 0.5, 1.0])
            advantages = [0.0] * (len(prompt) - 1) + [adv] * len(completion)
            logprobs = [0.0] * (len(prompt) - 1) + [-rng.uniform(0.5, 3.0) for _ in completion]
            out.append(datum_from_tinker(toks[:-1], {"target_tokens": toks[1:], "logprobs": logprobs,
                                                     "advantages": advantages},
                                         loss=tinker_loss(loss, {"beta": 0.1} if loss == "dro" else None) if loss else None))
            assert len(out[-1].weights) == n
    odd = out[1]
    targets = list(odd.target_tokens)
    targets[2] = (targets[2] + 7) % 200
    out[1] = Datum(odd.input_tokens, tuple(targets), odd.weights, odd.behaviour_logprobs, odd.advantages)
    return out


def _learner(dtype: str, share: bool) -> Learner:
    base, tok = load_model("tiny", seed=0, dtype=dtype)
    fields, _ = tinker_lora_settings({"rank": 4})
    learner = Learner(base, LearnerConfig(**{**fields, "share_prefix": share}), tok.pad_token_id, init_seed=11)
    with torch.no_grad():  # B non-zero, so that every LoRA factor (k/v under the prefix included) has a gradient
        g = torch.Generator().manual_seed(5)
        for n, p in learner.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)
    return learner


def _step(learner: Learner, datums: list[Datum], loss: str):
    logprobs, metrics = learner.tinker_forward_backward(datums, tinker_loss(loss))
    grads = {n: p.grad.float().clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    return logprobs, metrics, grads


def _assert_same(a, b, tol: float) -> None:
    (lp_a, m_a, g_a), (lp_b, m_b, g_b) = a, b
    assert [len(r) for r in lp_a] == [len(r) for r in lp_b]
    assert all(x == pytest.approx(y, abs=tol) for r, s in zip(lp_a, lp_b) for x, y in zip(r, s))
    assert m_a["loss:sum"] == pytest.approx(m_b["loss:sum"], rel=tol, abs=tol)
    assert g_a.keys() == g_b.keys() and len(g_a) > 0
    for n, g in g_b.items():
        assert torch.allclose(g_a[n], g, rtol=tol, atol=tol * max(1.0, float(g.abs().max()))), n


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo"])
def test_shared_prompts_give_the_plain_logprobs_loss_and_gradient(dtype, loss, monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("every_position"))
        return shared_prefix_forward(*args, **kwargs)

    monkeypatch.setattr(learner_module, "shared_prefix_forward", counted)
    shared = _step(_learner(dtype, share=True), _groups(loss), loss)
    assert calls and all(calls), calls  # the prompts were shared, every position returned
    plain = _step(_learner(dtype, share=False), _groups(loss), loss)
    # and as the service ran before weights marked the gated tokens: every token weighted, no sharing
    ungated = _step(_learner(dtype, share=True), _groups(None), loss)
    assert len(calls) == 1  # weights all 1: nothing to share
    _assert_same(shared, plain, TOL[dtype])
    _assert_same(shared, ungated, TOL[dtype])
    assert all(x != 0 for row in shared[0] for x in row)  # prompt positions came back, not 0


def test_dro_is_not_gated_and_a_pass_without_advantages_still_backpropagates():
    dro = _groups("dro")
    assert all(w == 1.0 for d in dro for w in d.weights)
    # one group whose rewards were all equal (advantage 0 everywhere) in a pass of its own
    idle = _groups("importance_sampling", zero_groups=1)[12:]
    assert all(w == 0.0 for d in idle for w in d.weights)
    learner = _learner("float32", share=True)
    logprobs, metrics, grads = _step(learner, idle, "importance_sampling")
    plain = learner.compute_logprobs(idle)
    assert metrics["loss:sum"] == 0.0
    assert all(x == pytest.approx(y, abs=1e-5) for r, s in zip(logprobs, plain) for x, y in zip(r, s))
    assert grads and all(float(g.abs().max()) == 0.0 for g in grads.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_positions_take_each_rows_own_targets_and_sampling_parameters(dtype):
    """A worker pass holds several experiments' rows: per-row temperature and truncation."""
    base, tok = load_model("tiny", seed=0, dtype=dtype)
    datums = _groups("importance_sampling")
    padded = pad_datums(datums, tok.pad_token_id, torch.device("cpu"))
    B = len(datums)
    plan = plan_prefix_sharing(padded.inputs_BT, padded.mask_BT, padded.fields["weights"],
                               breaks=frozenset({8}))  # rows 8.. are another experiment's
    assert plan is not None and len(plan.prefix_len_P) == 3
    temp_B11 = torch.tensor([1.0] * 8 + [0.7] * (B - 8))[:, None, None]
    top_k_B1 = torch.tensor([0] * 8 + [20] * (B - 8))[:, None]
    top_p_B1 = torch.tensor([1.0] * 8 + [0.9] * (B - 8))[:, None]
    min_p_B1 = torch.zeros(B, 1)
    truncation = (top_k_B1, top_p_B1, min_p_B1)
    with torch.no_grad():
        lp_BT, _ = shared_prefix_forward(base, plan, padded.inputs_BT, padded.targets_BT, padded.fields["weights"],
                                         temp_B11, truncation=truncation, every_position=True)
        logits = base(input_ids=padded.inputs_BT, attention_mask=padded.mask_BT).logits
        ref_BT = target_logprobs(logits, padded.targets_BT, temp_B11, *truncation)
    mask = padded.mask_BT.bool()
    assert torch.allclose(lp_BT[mask], ref_BT[mask], atol=TOL[dtype] * 4), (lp_BT - ref_BT)[mask].abs().max()
    assert bool(lp_BT[~mask].eq(0).all())


def test_a_step_without_advantages_moves_adam_as_a_zero_gradient_does():
    """After a step with advantages, Adam's moments move the weights on a step without any: the
    gated call (no backward at all) must leave the same weights as the plain one (a backward of 0)."""
    adam = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}
    weights = []
    for gated in ("importance_sampling", None):
        learner = _learner("float32", share=True)
        datums = _groups(gated, zero_groups=1)
        for batch in (datums[:12], datums[12:]):
            learner.tinker_forward_backward(batch, tinker_loss("importance_sampling"))
            learner.optim_step(adam)
        weights.append({n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" in n})
    moved = 0
    for n, w in weights[0].items():
        assert torch.allclose(w, weights[1][n], atol=1e-6), n
        moved += 1
    assert moved > 0
