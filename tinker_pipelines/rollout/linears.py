"""The decoder's linear layers and attention on CPU: fast forms, and batch-invariant forms.

Fast (`rows_linear`, `blocked_linear`): the same floats as `F.linear`, computed the way MKL
runs fastest at decode row counts (docs/architecture.md, "Decode speed on CPU").

Batch-invariant (`invariant_linear`, `attention`): each row's result does not depend on which
other rows share the batch, or how many. `F.linear` is not: MKL sums a row's dot products in
another order at another row count (on SmolLM2's layers a row's output changes with every batch
size tried), and neither is the CPU attention kernel once the keys outnumber ~30. A resident
worker decodes several experiments' rows in one batch whose size depends on who else is
running; with these forms an experiment samples exactly the tokens and logprobs it samples alone.
On CPU `W @ x^T` with at least `INVARIANT_ROWS` rows was invariant for every shape and row count
measured (12 to 4,096 rows, SmolLM2's, the tiny model's and LoRA factors' shapes), so fewer rows
are padded up to it. Off CPU these are the plain forms (no claim is made there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HEAD_BLOCK = 1024
"""Output-layer columns per matmul on CPU (`blocked_linear`)."""


STREAM_ROWS = (12, 128)
"""Row counts at which `rows_linear` streams the weight on CPU (both ends included)."""
STREAM_MIN_WEIGHT = 1 << 18
"""Smallest weight (entries) worth streaming: smaller ones stay in cache either way."""


def _streams(x_MH: torch.Tensor, weight_NH: torch.Tensor) -> bool:
    return (x_MH.device.type == "cpu" and STREAM_ROWS[0] <= x_MH.shape[0] <= STREAM_ROWS[1]
            and weight_NH.numel() >= STREAM_MIN_WEIGHT)


def _streamed(x_MH: torch.Tensor, weight_NH: torch.Tensor, bias_N: torch.Tensor | None) -> torch.Tensor:
    """`(weight @ x^T)^T` as a contiguous `[M, N]` (contiguous: attention kernels given the
    transposed view round differently)."""
    if bias_N is None:
        y_NM = torch.mm(weight_NH, x_MH.t())
    else:
        y_NM = torch.addmm(bias_N[:, None], weight_NH, x_MH.t())
    return y_NM.t().contiguous()


def rows_linear(x: torch.Tensor, weight_NH: torch.Tensor, bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the few rows of a decode step (`x` is `[..., H]`).

    For `x @ W^T` MKL packs the whole weight on every call; for `W @ x^T` it packs the few rows
    and streams the weight as stored. On CPU, for `STREAM_ROWS` rows against a weight of at
    least `STREAM_MIN_WEIGHT` entries, this computes the latter: on SmolLM2's layers (2 threads)
    1.3-1.6x faster at 12-128 rows, and the same floats (tested bitwise). At 2-11 rows it would
    be ~2x faster, but there MKL picks a kernel that sums in another order: as accurate, yet
    SmolLM2's logprobs then move ~1.2e-5 from HF's, past the 1e-5 the decoder keeps. At 1 row
    (a matrix-vector product) and from ~256 rows (training) it gains nothing. Outside
    `STREAM_ROWS`, and off CPU, it is `F.linear`."""
    x_MH = x.reshape(-1, x.shape[-1])
    if not _streams(x_MH, weight_NH):
        return F.linear(x, weight_NH, bias_N)
    return _streamed(x_MH, weight_NH, bias_N).view(*x.shape[:-1], weight_NH.shape[0])


def blocked_linear(x_BH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None = None,
                   block: int = HEAD_BLOCK, invariant: bool = False) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a wide output layer, bitwise the same. On CPU it runs in
    blocks of `block` output columns: for a few rows against a 49k-token vocabulary, MKL's one
    call packs the whole 113 MB weight and runs ~1.5x slower than blocks that stay in cache
    (measured on SmolLM2's head at 16 and 64 rows); each block streams its weight rows as
    `rows_linear` does where that applies. Each output is the same dot product over the hidden
    size either way. With `invariant`, each block is an `invariant_linear`. Elsewhere (a GPU)
    it is one `F.linear`."""
    V = weight_VH.shape[0]
    if invariant and x_BH.device.type == "cpu":
        if V <= 2 * block:
            return invariant_linear(x_BH, weight_VH, bias_V)
        return torch.cat([invariant_linear(x_BH, weight_VH[s:s + block], None if bias_V is None else bias_V[s:s + block])
                          for s in range(0, V, block)], dim=-1)
    if x_BH.device.type != "cpu" or x_BH.dim() != 2 or V <= 2 * block:
        return rows_linear(x_BH, weight_VH, bias_V)
    out_BV = x_BH.new_empty((x_BH.shape[0], V))
    stream = _streams(x_BH, weight_VH[:block])
    for start in range(0, V, block):
        w = weight_VH[start:start + block]
        b = None if bias_V is None else bias_V[start:start + block]
        if stream:
            out_BV[:, start:start + block] = _streamed(x_BH, w, b)
        elif b is None:
            torch.mm(x_BH, w.t(), out=out_BV[:, start:start + block])
        else:
            torch.addmm(b, x_BH, w.t(), out=out_BV[:, start:start + block])
    return out_BV


INVARIANT_ROWS = 12
"""Fewest rows `invariant_linear` multiplies at once (fewer are padded with zero rows)."""


def invariant_linear(x: torch.Tensor, weight_NH: torch.Tensor, bias_N: torch.Tensor | None = None,
                     lora: "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None" = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose every row is the same floats whatever the batch: on CPU
    `(W @ x^T)^T` over at least `INVARIANT_ROWS` rows (the product MKL computes in one order for
    any row count from there; tested). From 12 to 128 rows it is also `F.linear`'s floats.

    `lora` = (A [R, H], B [N, R], mask [R, rows of x's first dimension] or None) adds each row's
    low-rank delta `B @ (mask * (A @ x^T))` to the product before it is transposed back: the
    side-by-side factors of several adapters, the mask keeping each row's own columns. Masked
    columns add exact zeros, and the sums run in one order at every row count and number of
    adapters (tested), so a row's delta does not depend on the batch either. (The decoder is
    batch-invariant on CPU only; elsewhere the same products run, without a claim.)"""
    if x.device.type != "cpu" and lora is None:
        return F.linear(x, weight_NH, bias_N)
    x_MH = x.reshape(-1, x.shape[-1])
    M = x_MH.shape[0]
    if M < INVARIANT_ROWS:
        x_MH = torch.cat([x_MH, x_MH.new_zeros((INVARIANT_ROWS - M, x_MH.shape[1]))])
    xt_HM = x_MH.t()
    y_NM = torch.mm(weight_NH, xt_HM) if bias_N is None else torch.addmm(bias_N[:, None], weight_NH, xt_HM)
    if lora is not None:
        A_RH, B_NR, mask_RB = lora
        low_RM = torch.mm(A_RH, xt_HM)
        if mask_RB is not None:  # x's positions per batch row share the row's mask
            low_RM[:, :M].view(low_RM.shape[0], mask_RB.shape[1], -1).mul_(mask_RB[:, :, None])
        y_NM.addmm_(B_NR, low_RM)
    return y_NM.t()[:M].contiguous().view(*x.shape[:-1], weight_NH.shape[0])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              invariant: bool) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)` (`mask` boolean,
    True = attend); with `invariant`, written out as matmul, softmax, matmul, whose per-row
    results do not depend on the batch (the CPU flash kernel's do, past ~30 keys)."""
    if not invariant:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)
