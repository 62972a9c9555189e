"""Target logprobs computed over chunks of positions: the numbers of the unchunked fp32 computation,
without a [B, K, V] fp32 tensor, and one training micro-batch at a 150k vocabulary within a stated
memory bound."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tinker_pipelines.rollout.truncation import CHUNK_ELEMENTS, target_logprobs, target_logprobs_unchunked

B, K, V = 3, 7, 211


def _with_grad(fn, logits_BKV: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits_BKV.detach().clone().requires_grad_(True)
    lp_BK = fn(x, *args, **kwargs)
    w_BK = torch.randn(lp_BK.shape, generator=torch.Generator().manual_seed(1))
    (lp_BK * w_BK).sum().backward()
    return lp_BK.detach(), x.grad


def _cases() -> dict[str, dict]:
    g = torch.Generator().manual_seed(2)
    per_row = dict(top_k=torch.tensor([[0], [4], [9]]), top_p=torch.tensor([[0.8], [1.0], [0.6]]),
                   min_p=torch.tensor([[0.0], [0.05], [0.0]]))
    return {
        "plain": dict(temperature=0.7),
        "plain_row_temperature": dict(temperature=torch.tensor([0.5, 1.0, 1.3]).view(B, 1, 1)),
        "top_k": dict(temperature=0.8, top_k=5),
        "top_p": dict(temperature=0.8, top_p=0.7),
        "min_p": dict(temperature=0.8, min_p=0.1),
        "all_three": dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
        "per_row": dict(temperature=torch.tensor([0.6, 0.9, 1.2]).view(B, 1, 1), **per_row),
        "support_some": dict(temperature=0.8, top_k=5, support_BK=torch.randint(0, 6, (B, K), generator=g)),
        "support_all": dict(temperature=0.8, support_BK=torch.randint(1, 6, (B, K), generator=g)),
        "support_all_zero": dict(temperature=0.8, top_p=0.8, support_BK=torch.zeros(B, K, dtype=torch.long)),
    }


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("chunk_rows", [1, 4, None])
def test_chunked_logprobs_and_gradients_equal_the_unchunked_ones(case, chunk_rows):
    kw = _cases()[case]
    temperature = kw.pop("temperature")
    g = torch.Generator().manual_seed(0)
    logits_BKV = torch.randn(B, K, V, generator=g) * 3
    targets_BK = torch.randint(0, V, (B, K), generator=g)
    want, grad_want = _with_grad(target_logprobs_unchunked, logits_BKV, targets_BK, temperature, **kw)
    got, grad_got = _with_grad(target_logprobs, logits_BKV, targets_BK, temperature, chunk_rows=chunk_rows, **kw)
    assert got.dtype == torch.float32 and got.shape == (B, K)
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    assert torch.allclose(grad_got, grad_want, rtol=0, atol=1e-6), (grad_got - grad_want).abs().max()
    assert grad_got.abs().sum() > 0


@pytest.mark.parametrize("case", ["plain", "per_row", "support_some"])
def test_bf16_logits_give_the_fp32_computation_of_the_same_logits(case):
    """bf16 logits are upcast chunk by chunk: the logprobs are exactly those computed in fp32 from
    the same (bf16-rounded) logits, the gradient that gradient rounded to bf16."""
    kw = _cases()[case]
    temperature = kw.pop("temperature")
    g = torch.Generator().manual_seed(0)
    logits_bf16 = (torch.randn(B, K, V, generator=g) * 3).bfloat16()
    targets_BK = torch.randint(0, V, (B, K), generator=g)
    want, grad_want = _with_grad(target_logprobs_unchunked, logits_bf16.float(), targets_BK, temperature, **kw)
    got, grad_got = _with_grad(target_logprobs, logits_bf16, targets_BK, temperature, chunk_rows=4, **kw)
    assert got.dtype == torch.float32 and grad_got.dtype == torch.bfloat16
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    # the gradient is computed in fp32 and rounded once to bf16 (a relative error of at most 2^-8)
    assert torch.allclose(grad_got.float(), grad_want, rtol=2 ** -8, atol=1e-12)


class _Allocations(TorchDispatchMode):
    """Records the dtype and size of every tensor an operation returns."""

    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[torch.dtype, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:  # not a view
                self.outputs.append((t.dtype, t.numel(), str(func)))
        return out


@pytest.mark.parametrize("case", ["plain", "per_row", "support_some"])
def test_no_fp32_tensor_of_the_logits_size_is_made_forward_or_backward(case):
    """From bf16 logits, forward and backward allocate one tensor of the logits' size (the
    gradient, bf16) and nothing in fp32 larger than a chunk; the unchunked computation, checked
    the same way, allocates several fp32 ones (so the check can fail)."""
    kw = _cases()[case]
    temperature = kw.pop("temperature")
    g = torch.Generator().manual_seed(0)
    logits_bf16 = (torch.randn(B, K, V, generator=g) * 3).bfloat16().requires_grad_(True)
    targets_BK = torch.randint(0, V, (B, K), generator=g)
    chunk = 4
    for fn, extra in ((target_logprobs, {"chunk_rows": chunk}), (target_logprobs_unchunked, {})):
        logits_bf16.grad = None
        with _Allocations() as seen:
            fn(logits_bf16, targets_BK, temperature, **kw, **extra).sum().backward()
        fp32_big = [o for o in seen.outputs if o[0] == torch.float32 and o[1] > chunk * V]
        full = [o for o in seen.outputs if o[1] >= B * K * V]
        if fn is target_logprobs:
            assert fp32_big == [], fp32_big
            assert [o[0] for o in full] == [torch.bfloat16], full
        else:
            assert len(fp32_big) >= 2


def test_default_chunk_is_bounded_by_chunk_elements():
    """At a 150k vocabulary the default chunk is ~110 positions: the same numbers as one chunk."""
    V_big = 150_000
    g = torch.Generator().manual_seed(0)
    logits_BKV = torch.randn(1, 2 * (CHUNK_ELEMENTS // V_big) + 5, V_big, generator=g)
    targets_BK = torch.randint(0, V_big, logits_BKV.shape[:2], generator=g)
    got = target_logprobs(logits_BKV, targets_BK, 0.9, top_p=0.9)
    assert torch.equal(got, target_logprobs_unchunked(logits_BKV, targets_BK, 0.9, top_p=0.9))


def test_temperature_that_requires_grad_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        target_logprobs(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long),
                        torch.ones(1, 1, 1, requires_grad=True))


def test_one_training_micro_batch_at_150k_vocab_stays_within_its_memory_bound():
    """One `Learner.forward_backward` micro-batch (8 x 65 logit rows at V = 150,000: 312 MB of fp32
    logits) may add at most the logits, their gradient and three chunk-sized fp32 tensors
    (2 x 312 + 3 x 67 = 825 MB) above what was resident before it. The unchunked fp32 path needs
    ~3 logits' worth (~940 MB measured) and fails this bound; at bf16 logits it would need ~5.
    Measured in a child process by peak resident memory (`benchmarks.ready_logprobs.peak_mb`)."""
    from benchmarks.ready_logprobs import cpu_peaks_in_child

    peaks = cpu_peaks_in_child(old=True)
    bound_mb = 2 * peaks["logits_mb"] + 3 * CHUNK_ELEMENTS * 4 / 1e6
    assert peaks["peak_logprob_mb_150k_vocab"] < bound_mb, peaks
    assert peaks["peak_logprob_mb_150k_vocab_old"] > bound_mb, peaks  # the bound tells the two paths apart
