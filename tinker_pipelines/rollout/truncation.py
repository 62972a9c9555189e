"""Top-k, top-p (nucleus) and min-p truncation, shared by the sampler and the learner.

The sampler draws from the truncated, renormalized distribution and reports that distribution's
logprob of each token; the learner recomputes the same quantity with these same functions, so
behaviour and recomputed logprobs agree (tested to 1e-4, ~1e-6 in fp32).

Definitions, on the temperature-scaled distribution p = softmax(logits / temperature), applied
in this order (Hugging Face's order of warpers):

1. top_k (0: off): keep every token whose logprob is >= the k-th largest one (ties at the k-th
   are all kept, so a row may keep more than k tokens).
2. top_p (1.0: off), on the distribution renormalized over what top_k kept: sort the
   probabilities in decreasing order, find the smallest prefix whose cumulative mass reaches
   top_p; its last probability is the cut; keep every token with probability >= the cut (ties
   at the cut are all kept).
3. min_p (0.0: off): keep every token whose logprob is >= max logprob + log(min_p), i.e.
   p >= min_p * max p (a ratio, so renormalization does not change it).

Each kept set is a threshold on values, never on positions in a sort, so it does not depend on
how a sort orders ties: the sampler and the learner get the same set from the same values.
They do not see bit-identical logits (a decode step with a KV cache and a full forward differ by
~1e-6), so a token within float error of a cut could be in one set and not the other. The
sampler therefore reports how many tokens it kept for each draw (`Sample.support`, carried into
`Datum.support_sizes`), and the learner renormalizes over that many of its own most likely
tokens (`top_n_logprobs`); where no size was recorded it recomputes the cut from the
parameters and always keeps the target token, whose logprob stays finite (`target_logprobs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

def is_active(top_k: int | torch.Tensor = 0, top_p: float | torch.Tensor = 1.0,
              min_p: float | torch.Tensor = 0.0) -> bool:
    """Whether any of the three truncations is on (for any row)."""
    return _on(top_k, lambda k: k > 0) or _on(top_p, lambda p: p < 1) or _on(min_p, lambda m: m > 0)


def _on(value, test) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(test(value).any())
    return bool(test(value))


def check_params(top_k: int, top_p: float, min_p: float, prefix: str = "") -> None:
    """Raise ValueError naming the parameter (after `prefix`, e.g. 'training.') when one is out
    of range: the one statement of these ranges, for configs, learners and sample requests.

    >>> check_params(0, 1.5, 0.0, prefix="training.")
    Traceback (most recent call last):
    ...
    ValueError: training.top_p must be in (0, 1] (1: off), got 1.5
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{prefix}top_k must be >= 0 (an integer; 0: off), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p <= 1):
        raise ValueError(f"{prefix}top_p must be in (0, 1] (1: off), got {top_p!r}")
    if not (isinstance(min_p, (int, float)) and not isinstance(min_p, bool) and 0 <= min_p < 1):
        raise ValueError(f"{prefix}min_p must be in [0, 1) (0: off), got {min_p!r}")


def _rows(value, shape: torch.Size, device, dtype) -> torch.Tensor:
    """`value` (a number, or one per row broadcastable to `shape`) as a tensor of `shape`."""
    return torch.as_tensor(value, device=device, dtype=dtype).expand(shape)


@torch.no_grad()
def keep_mask(logprobs_NV: torch.Tensor, top_k: int | torch.Tensor = 0, top_p: float | torch.Tensor = 1.0,
              min_p: float | torch.Tensor = 0.0) -> torch.Tensor:
    """Boolean mask [..., V] of the tokens each row keeps; `logprobs_NV` is log_softmax(logits / T)
    over the last dimension, the parameters one number or one per row (broadcastable to its
    leading dimensions; 0 / 1.0 / 0.0 switch a row's truncation off)."""
    lp = logprobs_NV.detach().float()
    V, lead, dev = lp.shape[-1], lp.shape[:-1], lp.device
    keep = None

    def both(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
        return b if a is None else a & b

    if _on(top_k, lambda k: k > 0):
        k = _rows(top_k, lead, dev, torch.long)
        k = torch.where((k <= 0) | (k > V), V, k)
        top = lp.topk(int(k.max()), dim=-1).values  # sorted, largest first
        keep = lp >= top.gather(-1, (k - 1)[..., None])
    if _on(top_p, lambda p: p < 1):
        p = _rows(top_p, lead, dev, torch.float32)
        probs = torch.softmax(lp.masked_fill(~keep, -math.inf) if keep is not None else lp, dim=-1)
        # the largest probabilities, sorted, until they hold top_p in every row (a nucleus is
        # usually small: a full sort of the vocabulary costs ~25 ms per step at 8k on a CPU core)
        n = min(V, 64)
        while True:
            top = probs.topk(n, dim=-1).values
            cum = top.cumsum(dim=-1)
            if n == V or bool(((cum[..., -1] >= p) | (p >= 1)).all()):
                break
            n = min(V, n * 8)
        needed = (cum < p[..., None]).sum(dim=-1).clamp_(max=n - 1)
        cut = top.gather(-1, needed[..., None])
        keep = both(keep, (probs >= cut) | (p >= 1)[..., None])
    if _on(min_p, lambda m: m > 0):
        m = _rows(min_p, lead, dev, torch.float32)
        floor = lp.max(dim=-1, keepdim=True).values + torch.log(m)[..., None]  # log 0 = -inf: all kept
        keep = both(keep, lp >= floor)
    return keep if keep is not None else torch.ones(lp.shape, dtype=torch.bool, device=dev)


CHUNK_ELEMENTS = 1 << 24
"""Logits per chunk of `target_logprobs` (rows x vocabulary): 64 MiB per fp32 chunk tensor, so
at a 152k vocabulary a chunk is ~110 positions and its few fp32 temporaries stay a few hundred
MiB whatever the micro-batch."""


def target_logprobs(logits_BKV: torch.Tensor, targets_BK: torch.Tensor, temperature: float | torch.Tensor,
                    top_k: int | torch.Tensor = 0, top_p: float | torch.Tensor = 1.0,
                    min_p: float | torch.Tensor = 0.0, support_BK: torch.Tensor | None = None, *,
                    chunk_rows: int | None = None) -> torch.Tensor:
    """The learner's logprob of each target [B, K] (fp32) under the sampling distribution: softmax
    of logits / temperature, truncated and renormalized as the sampler does. Per-row parameters
    are [B, 1] (temperature [B, 1, 1]). With every truncation off this is exactly the plain
    `log_softmax(logits / temperature).gather(targets)`.

    `support_BK` is the size of the set the sampler kept when it drew each target (`Sample.support`;
    0: not recorded). Where it is given the learner keeps the same number of tokens, its own top
    `n`, instead of recomputing the cut from the parameters: a token within float error of a cut
    then cannot land on the other side of it (see `top_n_logprobs`). Elsewhere the target is
    always kept: a token the sampler drew has mass, even where float error puts it just outside
    the learner's cut.

    Memory: the B*K positions are taken `chunk_rows` at a time (default: `CHUNK_ELEMENTS` logits
    per chunk); only a chunk is upcast to fp32, and backward recomputes each chunk's softmax
    instead of keeping it, writing the gradient into one tensor of the logits' shape and dtype.
    So beyond the logits and their gradient, forward and backward hold a few chunk-sized fp32
    tensors, never a [B, K, V] one. The numbers are those of `target_logprobs_unchunked` (each
    row computes the same operations; gradients agree to float rounding). `temperature` is not
    differentiated."""
    B, K, V = logits_BKV.shape
    if isinstance(temperature, torch.Tensor) and temperature.requires_grad:
        raise ValueError("temperature must not require grad (target_logprobs does not differentiate it)")
    rows = chunk_rows if chunk_rows is not None else max(1, CHUNK_ELEMENTS // max(V, 1))
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")

    def per_row(x, dtype=None):  # a per-row tensor as one value per flattened position
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        return x.to(logits_BKV.device, dtype).reshape(x.shape[0], -1).expand(B, K).reshape(B * K)

    sized = support_BK.gt(0) if support_BK is not None else None
    plan = _Plan(temperature=per_row(temperature, torch.float32),
                 truncation=tuple(per_row(x) for x in (top_k, top_p, min_p)),
                 active=is_active(top_k, top_p, min_p),
                 support_N=support_BK.reshape(B * K) if sized is not None and bool(sized.any()) else None,
                 all_sized=sized is not None and bool(sized.all()), rows=rows)
    return _ChunkedTargetLogprobs.apply(logits_BKV.reshape(B * K, V), targets_BK.reshape(B * K), plan).view(B, K)


@dataclass(frozen=True)
class _Plan:
    """`target_logprobs`'s parameters per flattened position, and what it decided once for the
    whole batch (so every chunk takes the branches the unchunked computation takes)."""

    temperature: float | torch.Tensor
    truncation: tuple
    active: bool
    support_N: torch.Tensor | None
    all_sized: bool
    rows: int

    def chunk(self, s: slice) -> tuple:
        """(temperature, truncation, support) of the rows `s`."""
        def cut(x):
            return x[s] if isinstance(x, torch.Tensor) and x.dim() > 0 else x
        temp = self.temperature
        temp = temp[s, None] if isinstance(temp, torch.Tensor) and temp.dim() > 0 else temp
        return temp, tuple(cut(x) for x in self.truncation), cut(self.support_N)

    @property
    def plain(self) -> bool:
        return not self.active and self.support_N is None


def _chunk_logprobs(logits_CV: torch.Tensor, targets_C: torch.Tensor, plan: _Plan, s: slice) -> torch.Tensor:
    """`target_logprobs_unchunked` on rows `s`, with the branches the plan took for the batch."""
    temperature, truncation, support_C = plan.chunk(s)
    logprobs_CV = torch.log_softmax(logits_CV.float() / temperature, dim=-1)
    target_C = logprobs_CV.gather(-1, targets_C[:, None]).squeeze(-1)
    if plan.all_sized:
        return top_n_logprobs(logprobs_CV, target_C, support_C)
    if not plan.active:
        by_params_C = target_C
    else:
        keep = keep_mask(logprobs_CV, *truncation)
        keep.scatter_(-1, targets_C[:, None], True)
        by_params_C = target_C - torch.logsumexp(logprobs_CV.masked_fill(~keep, -math.inf), dim=-1)
    if support_C is None:
        return by_params_C
    sized_C = support_C.gt(0)
    if not bool(sized_C.any()):  # where() would pick by_params everywhere
        return by_params_C
    return torch.where(sized_C, top_n_logprobs(logprobs_CV, target_C, support_C), by_params_C)


class _ChunkedTargetLogprobs(torch.autograd.Function):
    """Chunked forward; backward recomputes each chunk (a plain chunk loop under autograd would
    keep every chunk's fp32 softmax, i.e. [B, K, V] in fp32 again, and torch.utils.checkpoint per
    chunk sums per-chunk gradients through full-size slice backwards)."""

    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, targets_N: torch.Tensor, plan: _Plan) -> torch.Tensor:
        N = logits_NV.shape[0]
        lp_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
        for i in range(0, N, plan.rows):
            s = slice(i, min(N, i + plan.rows))
            lp_N[s] = _chunk_logprobs(logits_NV[s], targets_N[s], plan, s)
        ctx.save_for_backward(logits_NV, targets_N)
        ctx.plan = plan
        return lp_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_N: torch.Tensor):
        logits_NV, targets_N = ctx.saved_tensors
        plan: _Plan = ctx.plan
        if not ctx.needs_input_grad[0]:
            return None, None, None
        N = logits_NV.shape[0]
        grad_NV = torch.empty_like(logits_NV)
        for i in range(0, N, plan.rows):
            s = slice(i, min(N, i + plan.rows))
            if plan.plain:  # d/dz log_softmax(z)[t] = onehot(t) - softmax(z), then / temperature
                temperature = plan.chunk(s)[0]
                g_C1 = grad_N[s, None].float()
                grad_CV = torch.log_softmax(logits_NV[s].float() / temperature, dim=-1).exp_().mul_(-g_C1)
                grad_CV.scatter_add_(1, targets_N[s, None], g_C1)
                grad_NV[s] = grad_CV.div_(temperature)
            else:  # truncated sets: the same operations as forward, differentiated per chunk
                with torch.enable_grad():
                    x_CV = logits_NV[s].detach().requires_grad_(True)
                    lp_C = _chunk_logprobs(x_CV, targets_N[s], plan, s)
                    (grad_NV[s],) = torch.autograd.grad(lp_C, x_CV, grad_N[s])
        return grad_NV, None, None


def target_logprobs_unchunked(logits_BKV: torch.Tensor, targets_BK: torch.Tensor, temperature: float | torch.Tensor,
                              top_k: int | torch.Tensor = 0, top_p: float | torch.Tensor = 1.0,
                              min_p: float | torch.Tensor = 0.0, support_BK: torch.Tensor | None = None
                              ) -> torch.Tensor:
    """`target_logprobs` computed over the whole [B, K, V] at once in fp32 (several fp32 copies of
    the logits, all kept for backward: ~40 GB at V = 152k, K = 1k, B = 64). Kept as the reference
    the chunked computation is tested and measured against."""
    logprobs_BKV = torch.log_softmax(logits_BKV.float() / temperature, dim=-1)
    target_BK = logprobs_BKV.gather(-1, targets_BK[..., None]).squeeze(-1)
    sized_BK = support_BK.gt(0) if support_BK is not None else None
    if sized_BK is not None and bool(sized_BK.all()):
        return top_n_logprobs(logprobs_BKV, target_BK, support_BK)
    if not is_active(top_k, top_p, min_p):
        by_params_BK = target_BK
    else:
        keep = keep_mask(logprobs_BKV, top_k, top_p, min_p)
        keep.scatter_(-1, targets_BK[..., None], True)
        by_params_BK = target_BK - torch.logsumexp(logprobs_BKV.masked_fill(~keep, -math.inf), dim=-1)
    if sized_BK is None or not bool(sized_BK.any()):
        return by_params_BK
    return torch.where(sized_BK, top_n_logprobs(logprobs_BKV, target_BK, support_BK), by_params_BK)


def top_n_logprobs(logprobs_BKV: torch.Tensor, target_BK: torch.Tensor, n_BK: torch.Tensor) -> torch.Tensor:
    """Each target's logprob renormalized over the `n` most likely tokens of its row (n >= 1).

    The sampler's kept set is always an upper set of values (every truncation is a threshold),
    so it is the sampler's top n. The learner's logits differ from the sampler's by float error,
    which can swap the n-th and the (n+1)-th token; when that puts the target itself outside the
    learner's top n, the sampler's set is the learner's top n - 1 plus the target, and that is
    what the target is renormalized over. Any other swap changes the normalizer by the
    difference of two nearly equal probabilities.

    >>> lp = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), dim=-1)
    >>> x = top_n_logprobs(lp, lp[:, 1], torch.tensor([2]))  # renormalized over the top two
    >>> bool(torch.isclose(x, lp[:, 1] - torch.logsumexp(lp[:, :2], dim=-1)).all())
    True
    >>> y = top_n_logprobs(lp, lp[:, 2], torch.tensor([2]))  # the target ranks third: {top 1, target}
    >>> bool(torch.isclose(y, lp[:, 2] - torch.logaddexp(lp[:, 0], lp[:, 2])).all())
    True
    """
    V = logprobs_BKV.shape[-1]
    n_BK = n_BK.to(device=logprobs_BKV.device, dtype=torch.long).clamp(1, V)
    top_BKN = logprobs_BKV.topk(int(n_BK.max()), dim=-1).values  # sorted, largest first; differentiable
    lse_BKN = torch.logcumsumexp(top_BKN, dim=-1)
    lse_n_BK = lse_BKN.gather(-1, (n_BK - 1)[..., None]).squeeze(-1)
    rank_BK = logprobs_BKV.detach().gt(target_BK.detach()[..., None]).sum(dim=-1)  # tokens strictly above
    lse_before_BK = lse_BKN.gather(-1, (n_BK - 2).clamp(min=0)[..., None]).squeeze(-1)
    swapped_BK = torch.where(n_BK > 1, torch.logaddexp(lse_before_BK, target_BK), target_BK)
    return target_BK - torch.where(rank_BK < n_BK, lse_n_BK, swapped_BK)
