"""A forward_backward in passes bounded by tokens (`LearnerConfig.micro_batch_tokens`, which Tinker
adapters set to `rules.TINKER_PASS_TOKENS`): the passes it runs, the same loss and gradient as one
pass, and the field's checks."""

import random

import pytest
import torch

from tinker_pipelines.algorithms.tinker_losses import datum_from_tinker, tinker_loss
from tinker_pipelines.models import load_model
from tinker_pipelines.training.gradient import micro_batches
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.training.rules import TINKER_PASS_TOKENS, tinker_lora_settings
from tinker_pipelines.types import Datum


def _rl_datums(n: int, seed: int = 0) -> list[Datum]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(5, 14)
        toks = [rng.randrange(3, 200) for _ in range(length + 1)]
        out.append(datum_from_tinker(toks[:-1], {"target_tokens": toks[1:], "logprobs": [-2.0] * length,
                                                 "advantages": [rng.choice([-1.0, 0.5, 1.0])] * length}))
    return out


def _step(dtype: str, pass_tokens: int, datums: list[Datum]):
    base, tok = load_model("tiny", seed=0, dtype=dtype)
    fields, _ = tinker_lora_settings({"rank": 4})
    learner = Learner(base, LearnerConfig(**{**fields, "micro_batch_tokens": pass_tokens}), tok.pad_token_id,
                      init_seed=11)
    with torch.no_grad():  # B non-zero, so that every LoRA factor gets a gradient
        g = torch.Generator().manual_seed(5)
        for n, p in learner.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)
    logprobs, metrics = learner.tinker_forward_backward(datums, tinker_loss("importance_sampling"))
    grads = {n: p.grad.float().clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    return learner, logprobs, metrics, grads


def test_passes_are_bounded_by_padded_tokens_in_order():
    datums = _rl_datums(40)
    chunks = micro_batches(datums, 64, 48)
    assert [d for c in chunks for d in c] == datums  # every datum once, in order
    assert all(len(c) * max(len(d.input_tokens) for d in c) <= 48 for c in chunks)
    assert len(chunks) > 8
    # no token bound: the row bound alone; one datum over the bound is a pass of its own
    assert [len(c) for c in micro_batches(datums, 16)] == [16, 16, 8]
    long = Datum((1,) * 30, (1,) * 30, (1.0,) * 30)
    assert [len(c) for c in micro_batches([long, datums[0]], 64, 10)] == [1, 1]


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_token_bounded_passes_give_the_one_pass_loss_and_gradient(dtype, tol):
    datums = _rl_datums(24)
    one, lp_one, m_one, g_one = _step(dtype, 0, datums)
    many, lp_many, m_many, g_many = _step(dtype, 40, datums)
    assert len(one.micro_batches(datums)) == 1 and len(many.micro_batches(datums)) >= 6
    assert m_many["loss:sum"] == pytest.approx(m_one["loss:sum"], rel=tol, abs=tol)
    assert all(a == pytest.approx(b, abs=tol) for r, s in zip(lp_many, lp_one) for a, b in zip(r, s))
    assert g_one.keys() == g_many.keys() and len(g_one) > 0
    for n, g in g_one.items():
        assert torch.allclose(g_many[n], g, rtol=tol, atol=tol * max(1.0, float(g.abs().max()))), n


def test_tinker_adapters_take_the_pass_size_and_a_bad_one_is_named():
    fields, _ = tinker_lora_settings({"rank": 8})
    assert fields["micro_batch_tokens"] == TINKER_PASS_TOKENS > 0
    with pytest.raises(ValueError, match=r"training\.micro_batch_tokens must be >= 0 \(0: no bound\), got -1"):
        LearnerConfig(mode="lora", micro_batch_tokens=-1)


def test_deepspeed_refuses_a_token_bound_before_any_work():
    from tinker_pipelines.training.deepspeed_learner import DeepSpeedLearner

    base, tok = load_model("tiny", seed=0)
    with pytest.raises(ValueError, match=r"training\.micro_batch_tokens is not supported under DeepSpeed"):
        DeepSpeedLearner(base, LearnerConfig(mode="full", micro_batch_tokens=512), tok.pad_token_id)
    assert not torch.distributed.is_initialized()
