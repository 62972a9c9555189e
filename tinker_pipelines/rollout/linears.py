"""The decoder's linear layers and attention on CPU: fast forms, and batch-invariant forms.

Fast (`rows_linear`, `blocked_linear`): the same floats as `F.linear`, computed the way MKL
runs fastest at decode row counts (docs/architecture.md, "Decode speed on CPU").

Batch-invariant (`invariant_linear`, `attention`): each row's result does not depend on which
other rows share the batch, or how many. `F.linear` is not: MKL sums a row's dot products in
another order at another row count (on SmolLM2's layers a row's output changes with every batch
size tried), and neither is the CPU attention kernel once the keys outnumber ~30. A resident
worker decodes several experiments' rows in one batch whose size depends on who else is
running; with these forms an experiment samples exactly the tokens and logprobs it samples alone.

Which product MKL runs depends on the CPU (AVX2 or AVX-512 kernels) and the thread count, so no
fast form is trusted blindly: the first call of each shape computes the reference form (`F.linear`;
for the invariant forms, the product over fixed chunks of `INVARIANT_ROWS` rows, one call per
chunk) and tries the fast forms beside it, fastest first; from then on that shape uses the first
fast form that gave the very same floats, or the reference form if none did. On an AVX2 machine
the one-call forms passed at every shape the decoder uses. On an AVX-512 one with 2 threads,
`W @ x^T` at 12-48 rows sums in another order than `F.linear`, a LoRA factor's `A @ x^T` changes
a row's floats from 48 rows up, and `W @ x^T` does at 576 x 1536 from 64 rows; there the
invariant form runs those products per chunk in one batched call (`_per_chunk`), which gave the
reference floats at every shape measured. Off CPU these are the plain forms (no claim is made
there).
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


_VERIFIED: dict[tuple, int] = {}
"""Per call shape (and thread count): which fast form gave the reference form's floats on its
first call (its index among the candidates), or -1 for none."""


def _key(kind: str, x_MH: torch.Tensor, weight_NH: torch.Tensor, *extra) -> tuple:
    return (kind, tuple(x_MH.shape), x_MH.stride(), tuple(weight_NH.shape), weight_NH.stride(), x_MH.dtype,
            torch.get_num_threads(), *extra)


def _verified(key: tuple, fast, reference, args: tuple) -> torch.Tensor:
    """`fast(*args)` where that form has given `reference(*args)`'s floats for this `key`, else
    `reference(*args)`. `fast` is one form or a list of them, fastest first. The first call of a
    key tries them in order, each on this call's arguments and on random ones of the same shapes
    and strides (`_probe`): whether MKL sums in another order depends on shapes, not values, but
    the values at hand can hide it (a fresh LoRA adapter's B is zero, so any form of its delta
    adds exact zeros), and the key remembers the first form that matched on both, or -1."""
    fasts = fast if isinstance(fast, (list, tuple)) else [fast]
    k = _VERIFIED.get(key)
    if k is not None and k >= 0:
        return fasts[k](*args)
    want = reference(*args)
    if k is None:
        probe = _probe(args)
        probe_want = reference(*probe)
        _VERIFIED[key] = next((i for i, f in enumerate(fasts)
                               if torch.equal(f(*args), want) and torch.equal(f(*probe), probe_want)), -1)
    return want


def _random_like(t):
    """A tensor of `t`'s shape, strides, dtype and device, filled from N(0, 0.05^2); None stays None."""
    if t is None:
        return None
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(torch.randn(t.shape, dtype=t.dtype, device=t.device) * 0.05)


def _probe(args: tuple) -> tuple:
    """`args` (x, weight, bias[, lora][, ...]) with x, bias and the LoRA factors random (same
    shapes and strides; the weight and the LoRA mask kept). Stacked factors stay the
    concatenation of the per-adapter ones, as `RowAdapters` builds them."""
    x, weight, bias, *rest = args
    if rest and isinstance(rest[0], tuple):
        A, B, mask, parts = rest[0]
        if parts is None:
            lora = (_random_like(A), _random_like(B), mask, None)
        else:
            parts = tuple((_random_like(a), _random_like(b)) for a, b in parts)
            lora = (torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts], dim=1), mask, parts)
        rest = [lora, *rest[1:]]
    return (_random_like(x), weight, _random_like(bias), *rest)


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
    1.3-1.6x faster at 12-128 rows on an AVX2 machine, and the same floats there. At 2-11 rows it
    would be ~2x faster, but there MKL picks a kernel that sums in another order: as accurate, yet
    SmolLM2's logprobs then move ~1.2e-5 from HF's, past the 1e-5 the decoder keeps. At 1 row
    (a matrix-vector product) and from ~256 rows (training) it gains nothing. Each shape streams
    only once its first call gave `F.linear`'s floats (see the module's docstring); outside
    `STREAM_ROWS`, and off CPU, it is `F.linear`."""
    x_MH = x.reshape(-1, x.shape[-1])
    if not _streams(x_MH, weight_NH):
        return F.linear(x, weight_NH, bias_N)
    y_MN = _verified(_key("stream", x_MH, weight_NH, bias_N is not None), lambda *a: _streamed(*a), F.linear,
                     (x_MH, weight_NH, bias_N))
    return y_MN.view(*x.shape[:-1], weight_NH.shape[0])


def blocked_linear(x_BH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None = None,
                   block: int = HEAD_BLOCK, invariant: bool = False) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a wide output layer, bitwise the same. On CPU it runs in
    blocks of `block` output columns: for a few rows against a 49k-token vocabulary, MKL's one
    call packs the whole 113 MB weight and runs ~1.5x slower than blocks that stay in cache
    (measured on SmolLM2's head at 16 and 64 rows); each block streams its weight rows as
    `rows_linear` does where that applies. Each output is the same dot product over the hidden
    size either way on an AVX2 machine; each shape runs in blocks only once its first call gave
    one `F.linear`'s floats (see the module's docstring). With `invariant`, each block is an
    `invariant_linear`. Elsewhere (a GPU) it is one `F.linear`."""
    V = weight_VH.shape[0]
    if invariant and x_BH.device.type == "cpu":
        if V <= 2 * block:
            return invariant_linear(x_BH, weight_VH, bias_V)
        return torch.cat([invariant_linear(x_BH, weight_VH[s:s + block], None if bias_V is None else bias_V[s:s + block])
                          for s in range(0, V, block)], dim=-1)
    if x_BH.device.type != "cpu" or x_BH.dim() != 2 or V <= 2 * block:
        return rows_linear(x_BH, weight_VH, bias_V)
    return _verified(_key("blocked", x_BH, weight_VH, block, bias_V is not None),
                     lambda x, w, b: _blocks(x, w, b, block), F.linear, (x_BH, weight_VH, bias_V))


def _blocks(x_BH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None, block: int) -> torch.Tensor:
    V = weight_VH.shape[0]
    out_BV = x_BH.new_empty((x_BH.shape[0], V))
    stream = _streams(x_BH, weight_VH[:block])
    for start in range(0, V, block):
        w = weight_VH[start:start + block]
        b = None if bias_V is None else bias_V[start:start + block]
        if stream:
            out_BV[:, start:start + block] = rows_linear(x_BH, w, b)
        elif b is None:
            torch.mm(x_BH, w.t(), out=out_BV[:, start:start + block])
        else:
            torch.addmm(b, x_BH, w.t(), out=out_BV[:, start:start + block])
    return out_BV


INVARIANT_ROWS = 12
"""Rows per product of `invariant_linear`'s reference form (a last chunk is padded with zeros)."""
PREFILL_ROWS = 64
"""Past `STREAM_ROWS`, `invariant_linear` pads its rows to a multiple of this (zero rows)."""


def _chunks_t(x_MH: torch.Tensor) -> torch.Tensor:
    """`x`'s rows in chunks of `INVARIANT_ROWS` (zero rows pad the last one), each transposed:
    `[n, H, INVARIANT_ROWS]`."""
    x_MH, _ = _pad_rows(x_MH, None, -x_MH.shape[0] % INVARIANT_ROWS)
    return x_MH.reshape(-1, INVARIANT_ROWS, x_MH.shape[1]).transpose(1, 2)


def _per_chunk(w_NH: torch.Tensor, xt_nHC: torch.Tensor, M: int, bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """`w @ x^T (+ bias)` as `[N, M]` for the first M rows of `x` given as `_chunks_t(x)`: one
    batched product whose every chunk has the reference form's shape, in one call instead of
    one per chunk."""
    n, C = xt_nHC.shape[0], xt_nHC.shape[2]
    if bias_N is None:
        y_nNC = torch.bmm(w_NH.expand(n, -1, -1), xt_nHC)
    else:
        y_nNC = torch.baddbmm(bias_N[None, :, None].expand(n, -1, C), w_NH.expand(n, -1, -1), xt_nHC)
    return y_nNC.transpose(0, 1).reshape(w_NH.shape[0], -1)[:, :M]


def _product(x_MH: torch.Tensor, weight_NH: torch.Tensor, bias_N: torch.Tensor | None, lora,
             per_adapter: bool = False, chunked_low: bool = False, chunked_base: bool = False,
             stacked_b: bool = False, batched_low: bool = False) -> torch.Tensor:
    """`(W @ x^T + B @ (mask * (A @ x^T)))` as `[N, M]`; with `per_adapter`, the delta one
    adapter at a time from its own factors (`lora[3]`), each product of the shape it has when
    that adapter is alone in the batch (the others add exact zeros to its rows). With
    `chunked_low` / `chunked_base`, `A @ x^T` / `W @ x^T` run per chunk of `INVARIANT_ROWS` rows
    in one batched call (`_per_chunk`): on an AVX-512 machine `A @ x^T` over all rows changes a
    row's floats from 48 rows up, and `W @ x^T` at some shapes. With `stacked_b` (and
    `per_adapter`), each adapter's `A @ x^T` is written into one `[R, M]` block (with
    `batched_low`, by one batched product whose every matrix has that adapter's shape) and a single
    product with the side-by-side `B` adds every adapter's delta: each row's other columns are
    exact zeros, and on SmolLM2's shapes (AVX-512, 2 threads) that product gave the floats of the
    adapter-by-adapter ones at every row count tried, where stacking `A` did not."""
    xt_HM, M = x_MH.t(), x_MH.shape[0]
    xt_nHC = _chunks_t(x_MH) if chunked_low or chunked_base else None  # once for every product
    if chunked_base:
        y_NM = _per_chunk(weight_NH, xt_nHC, M, bias_N)
    else:
        y_NM = torch.mm(weight_NH, xt_HM) if bias_N is None else torch.addmm(bias_N[:, None], weight_NH, xt_HM)
    if lora is not None:
        A_RH, B_NR, mask_RM, parts = lora
        if not per_adapter or parts is None:
            parts = ((A_RH, B_NR),)
        elif stacked_b and len(parts) > 1:
            low_RM = _adapters_low(A_RH, parts, xt_HM, xt_nHC if chunked_low else None, batched_low)
            if mask_RM is not None:
                low_RM.mul_(mask_RM)
            return y_NM.addmm_(B_NR, low_RM)
        start = 0
        for A_rH, B_Nr in parts:  # one call per adapter: batching adapters' (chunk) products together changed floats
            low_rM = _per_chunk(A_rH, xt_nHC, M) if chunked_low else torch.mm(A_rH, xt_HM)
            if mask_RM is not None:
                low_rM.mul_(mask_RM[start:start + A_rH.shape[0]])
            y_NM.addmm_(B_Nr, low_rM)
            start += A_rH.shape[0]
    return y_NM


def _adapters_low(A_RH: torch.Tensor, parts, xt_HM: torch.Tensor, xt_nHC: torch.Tensor | None,
                  batched: bool) -> torch.Tensor:
    """Every adapter's `A @ x^T`, stacked as `[R, M]`, each product of the shape it has when that
    adapter is alone: per chunk when `xt_nHC` is given, else in one batched call (`batched`,
    adapters of one rank) or one call per adapter."""
    n, r, M = len(parts), parts[0][0].shape[0], xt_HM.shape[1]
    if batched and xt_nHC is None and all(a.shape[0] == r for a, _ in parts):
        return torch.bmm(A_RH.reshape(n, r, -1), xt_HM.expand(n, -1, -1)).view(n * r, M)
    low_RM, start = xt_HM.new_empty((A_RH.shape[0], M)), 0
    for A_rH, _ in parts:
        rows = low_RM[start:start + A_rH.shape[0]]
        if xt_nHC is not None:
            rows.copy_(_per_chunk(A_rH, xt_nHC, M))
        else:
            torch.mm(A_rH, xt_HM, out=rows)
        start += A_rH.shape[0]
    return low_RM


def _pad_rows(x_MH: torch.Tensor, lora, pad: int):
    """`x` with `pad` zero rows appended, and the LoRA mask with as many zero columns."""
    if not pad:
        return x_MH, lora
    x_MH = torch.cat([x_MH, x_MH.new_zeros((pad, x_MH.shape[1]))])
    if lora is not None and lora[2] is not None:
        lora = (*lora[:2], torch.cat([lora[2], lora[2].new_zeros((lora[2].shape[0], pad))], dim=1), lora[3])
    return x_MH, lora


def _chunked(x_MH: torch.Tensor, weight_NH: torch.Tensor, bias_N: torch.Tensor | None, lora) -> torch.Tensor:
    """`_product` over chunks of exactly `INVARIANT_ROWS` rows, adapter by adapter: every call has
    one shape whatever the batch, so a row's floats depend only on the row and its adapter (MKL's
    result for a row did not depend on its place in the chunk at any shape measured, AVX2 and
    AVX-512, 1 and 2 threads; tested)."""
    M, C = x_MH.shape[0], INVARIANT_ROWS
    pad = -M % C
    x_MH, lora = _pad_rows(x_MH, lora, pad)
    parts = [_product(x_MH[s:s + C], weight_NH, bias_N,
                      None if lora is None else (*lora[:2], None if lora[2] is None else lora[2][:, s:s + C], lora[3]),
                      per_adapter=True)
             for s in range(0, M + pad, C)]
    return torch.cat(parts, dim=1)[:, :M]


def _invariant_forms() -> list:
    """The faster forms `invariant_linear` tries against its reference (each a function of
    (x, weight, bias, lora)), fastest first: one call over all rows (stacked factors); the base
    in one call and every adapter's `A @ x^T` in one batched call (`batched_low`, adapters of
    one rank), then one product with the side-by-side `B`; the same with a call per adapter's
    `A @ x^T` (`stacked_b`); one `A` and one `B` product per adapter; the same with each
    adapter's `A @ x^T` per chunk; everything per chunk, in batched calls (1.5-2.3x faster than
    a call per chunk on SmolLM2's layers at 48-128 rows, AVX-512, 2 threads). On that machine, at SmolLM2's `o_proj` and `down_proj` with
    4 adapters, the per-adapter `A @ x^T` forms matched up to 32 rows and took 0.43-0.66x the
    time of the per-chunk ones at 16 rows; a mixed 16-row decode took 0.92x the time with
    `stacked_b` than with a `B` product per adapter, and 0.83-0.84x that with `batched_low`
    (fastest of 6 interleaved calls each, twice); from 64 rows only the last form matched."""

    def per_adapter(**kw):
        return lambda *a: _product(*a, per_adapter=True, **kw)

    return [lambda *a: _product(*a), per_adapter(stacked_b=True, batched_low=True), per_adapter(stacked_b=True),
            per_adapter(),
            per_adapter(chunked_low=True, stacked_b=True), per_adapter(chunked_low=True),
            per_adapter(chunked_low=True, chunked_base=True)]


_INVARIANT_FORMS = _invariant_forms()


def invariant_linear(x: torch.Tensor, weight_NH: torch.Tensor, bias_N: torch.Tensor | None = None,
                     lora: "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None" = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose every row is the same floats whatever the batch: on CPU
    the product over fixed chunks of `INVARIANT_ROWS` rows, or, for a row count at which one call
    over all rows has given exactly those floats (checked on its first call, see the module's
    docstring), that one call: MKL runs it faster, and on an AVX2 machine it always matched.

    `lora` = (A [R, H], B [N, R], mask [R, rows of x's first dimension] or None, parts) adds each
    row's low-rank delta `B @ (mask * (A @ x^T))` to the product before it is transposed back: the
    side-by-side factors of several adapters, the mask keeping each row's own columns, and `parts`
    each adapter's own (A, B) in column order (None: one adapter). The reference form adds the
    adapters' deltas one by one from their own factors, so a row's delta is the floats it gets
    when its adapter is alone in the batch (the masked columns of the others add exact zeros);
    one product over the side-by-side factors is used where its first call gave the same floats.
    (The decoder is batch-invariant on CPU only; elsewhere the same products run, without a claim.)"""
    if x.device.type != "cpu" and lora is None:
        return F.linear(x, weight_NH, bias_N)
    x_MH = x.reshape(-1, x.shape[-1])
    M = x_MH.shape[0]
    if lora is not None:
        lora = (*lora, None) if len(lora) == 3 else tuple(lora)
        if lora[2] is not None:  # x's positions per batch row share the row's mask
            mask_RB = lora[2]
            lora = (*lora[:2], mask_RB[:, :, None].expand(-1, -1, M // mask_RB.shape[1]).reshape(-1, M), lora[3])
    if x.device.type != "cpu":
        y_NM = _product(x_MH, weight_NH, bias_N, lora)
    else:
        pad = -M % PREFILL_ROWS if M > STREAM_ROWS[1] else 0
        # prefill row counts rarely repeat: round them so that each shape's check pays off
        x_MH, lora = _pad_rows(x_MH, lora, pad)
        extra = (bias_N is not None, None if lora is None else
                 (tuple(lora[0].shape), lora[2] is not None, lora[3] and tuple(a.shape[0] for a, _ in lora[3])))
        y_NM = _verified(_key("invariant", x_MH, weight_NH, *extra), _INVARIANT_FORMS,
                         lambda *a: _chunked(*a), (x_MH, weight_NH, bias_N, lora))[:, :M]
    return y_NM.t().contiguous().view(*x.shape[:-1], weight_NH.shape[0])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              invariant: bool) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)` (`mask` boolean,
    True = attend); with `invariant`, written out as matmul, softmax, matmul, whose per-row
    results do not depend on the batch (the CPU flash kernel's do, past ~30 keys)."""
    if not invariant:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)
