"""Rows of one decode batch, each with its own LoRA adapter over a shared frozen base.

`RowAdapters` holds, for a base-only `LeanDecoder`, which adapter each row uses and adds every
row's low-rank delta after the base matmul that ran once over all rows. A row computes its own
adapter's delta only, as Punica's BGMV and S-LoRA's gathered LoRA do with their own GPU kernels;
in torch (CPU and GPU) the rows are grouped by adapter instead (S-LoRA's and Punica's SGMV
layout): a linear group's adapters are split into buckets of similar rank, each bucket's factors
stacked once per set of adapters present (A [n, R, in]; B per module [n, O_p, R_p], or one
block-diagonal [n, O, R] where one product over its zeros is cheaper than a product per module),
zero-padded to the bucket's largest rank, and each bucket's rows gathered into [n, m, in] (m: its
largest adapter's row count) so that its delta is one batched product for A and one per module
for B. `_partition` splits the rank-sorted adapters where a bucket's fixed cost (calls) is less
than what padding would cost (flops, and the bytes of its factors, which a decode's few rows per
adapter make the larger part): adapters of far apart ranks go apart. The row layouts (gather and
inverse index tensors, on the adapters' device) are built once per batch composition and reused
while it holds, or when it comes back (the shared prefix's rows, then the prompts'); a prune
(`keep`) builds the new composition's from the kept rows, which the sampler has already read; the
stacked factors are built again only when the set of adapters present changes.

Batch invariance (CPU): a row's delta must be the same floats whoever shares its batch. The
reference form computes each adapter's rows alone, `linears.INVARIANT_ROWS` at a time, at its own
rank (`_own_products(reference=True)`); a batched form is used for a shape only once its first
call gave the reference's floats, on the call's arguments and on random ones (as `linears`
checks its forms), else the reference runs. Measured on an AVX-512 EPYC (2 threads, SmolLM2's
shapes): the batched products matched the reference from 4 rows per adapter (`ROW_ALIGN`) and
with ranks of 12 or more zero-padded to any larger one up to 256, but a rank under 12 padded
did not (`MIN_RANK`). The delta is added to the base output as its own sum (`y + d`), so a
row's output is its batch-invariant base plus its batch-invariant delta.

Adapters in another dtype than the base (fp32 LoRA on a bf16 base, PEFT's default) compute as
`tinker_pipelines.models.dtypes` states: `x` cast to the adapters' dtype, the low-rank products
there, the sum with the base output rounded once to the base's dtype (`add_lora`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from tinker_pipelines.models.dtypes import adapter_input, add_lora
from tinker_pipelines.rollout.linears import INVARIANT_ROWS

Factors = tuple[torch.Tensor, torch.Tensor]
"""One module's adapter update: A [r, in], B [out, r] (the scaling folded into B)."""
GroupFactors = tuple[tuple[int, "Factors | None"], ...]
"""A fused linear group's update: per module, its output features and its factors (None: no LoRA
there). The group's output is the modules' outputs side by side."""

MIN_RANK = 12
"""On a batch-invariant decoder (CPU) a module's rank under this is zero-padded to it, alone or
beside others: MKL summed a product over an inner dimension of 1-11 in another order than over
the same one padded, so a rank-8 adapter padded beside a rank-64 one got other floats than
alone; from 12 up, zero columns added at the end (to 256) left every row's floats unchanged at
SmolLM2's shapes (AVX-512, 2 threads), so buckets pad ranks freely."""
ROW_ALIGN = 4
"""Rows per adapter in a batched product are padded to a multiple of this (CPU): 1-3 rows (and
5-7 or 9-11 in a batch of one adapter) summed in another order than the reference; every
multiple of 4 matched, up to the 130 rows tried."""
DISPATCH_FLOPS = {"cpu": 1.2e6}
"""What one more bucket's calls cost, in flops of its products (`_partition`): ~35 us of call
overhead at the ~35 GFLOP/s that small batched products reach on a CPU core. Elsewhere (a GPU) a
launch costs more than any padding of a decode batch: one bucket."""
DISPATCH_FLOPS_OTHER = 1e12
READ_FLOPS = {"cpu": 6.0}
"""What reading one byte of stacked factors costs, in flops: at a decode's few rows per adapter
the products stream their factors from memory (~6 GB/s on a loaded core against ~35 GFLOP/s),
so a bucket's zero padding costs its bytes more than its flops."""
READ_FLOPS_OTHER = 0.0


def lora_factors(modules: list[torch.nn.Module], name: str) -> GroupFactors | None | bool:
    """Adapter `name`'s update of the fused linear `modules`: per module, its output features and
    (A [r, in], B [out, r]) with the scaling folded into B, so that the module's output gains
    `x @ A.T @ B.T`. None when no module has the adapter; False when it is not a vanilla LoRA
    (DoRA or another variant, a LoRA bias, dropout), which only its own forward can run."""
    out: list[tuple[int, Factors | None]] = []
    for m in modules:
        out_features = m.out_features if hasattr(m, "out_features") else m.weight.shape[0]
        if name not in getattr(m, "lora_A", {}):
            out.append((out_features, None))
            continue
        if name in getattr(m, "lora_variant", {}) or getattr(m, "lora_bias", {}).get(name, False):
            return False
        dropout = m.lora_dropout[name]
        if not (isinstance(dropout, torch.nn.Identity) or getattr(dropout, "p", 1) == 0):
            return False
        out.append((out_features, (m.lora_A[name].weight, m.lora_B[name].weight * m.scaling[name])))
    return tuple(out) if any(f is not None for _, f in out) else None


def _group(f) -> GroupFactors | None:
    """`f` as `GroupFactors`: a bare (A, B) pair is one module's."""
    if f is None or not isinstance(f[0], torch.Tensor):
        return f
    return ((f[1].shape[0], f),)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass
class _Bucket:
    """Adapters of one linear group whose deltas run as one batched product for A and one per
    module for B (a module's B alone: not block-diagonal over the group's modules)."""

    ks: tuple[int, ...]
    """The adapters (indices into `RowAdapters.lora`), in stacking order."""
    outs: tuple[int, ...]
    """The group's modules' output features."""
    ranks: tuple[tuple[int, ...], ...]
    """Each adapter's own rank per module (0: no LoRA there)."""
    A_nRI: torch.Tensor
    """Their A factors stacked: module p's in rows [r0_p, r0_p + R_p), R_p the largest rank
    there, zero rows past each adapter's own."""
    parts: tuple[tuple[int, int, int, torch.Tensor], ...]
    """Per module with LoRA in the bucket: (p, r0, R, B [n, O_p, R])."""
    B_nOR: torch.Tensor | None = None
    """The group's B factors as one block-diagonal stack [n, O, R] (the parts' are views into it),
    where one product over the group's zeros costs less than one per module (`_partition`)."""
    key: tuple = ()
    """What `_invariant_delta`'s check depends on besides the rows."""
    _own: dict[int, tuple] = field(default_factory=dict)

    def own(self, j: int) -> tuple[torch.Tensor, list[tuple[int, int, int, torch.Tensor | None]]]:
        """Adapter j's factors at its own ranks, contiguous: (A [r, in], per module of `parts`
        (p, column of its low-rank block, rank, B [O_p, rank]; None at rank 0))."""
        got = self._own.get(j)
        if got is None:
            As, parts, col = [], [], 0
            for p, r0, _, B_nOR in self.parts:
                r = self.ranks[j][p]
                As.append(self.A_nRI[j, r0:r0 + r])
                parts.append((p, col, r, B_nOR[j, :, :r].contiguous() if r else None))
                col += r
            got = (torch.cat(As).contiguous(), parts)
            self._own[j] = got
        return got


def _stack(fs: list[tuple[int, int, GroupFactors]], block: bool, min_rank: int) -> _Bucket:
    """The bucket of adapters `fs` ((total rank, k, factors), one fused group), each module's rank
    padded to at least `min_rank`; with `block`, its B factors as one block-diagonal stack."""
    outs = tuple(O for O, _ in fs[0][2])
    ranks = tuple(tuple(max(f[0].shape[0], min_rank) if f is not None else 0 for _, f in g) for _, _, g in fs)
    R = [max(r[p] for r in ranks) for p in range(len(outs))]
    A0 = next(f[0] for _, _, g in fs for _, f in g if f is not None)
    A_nRI = A0.new_zeros((len(fs), sum(R), A0.shape[1]))
    B_all = A0.new_zeros((len(fs), sum(outs), sum(R))) if block else None
    parts, r0, o0 = [], 0, 0
    for p in range(len(outs)):
        if R[p]:
            B_nOR = B_all[:, o0:o0 + outs[p], r0:r0 + R[p]] if block else A0.new_zeros((len(fs), outs[p], R[p]))
            for j, (_, _, g) in enumerate(fs):
                f = g[p][1]
                if f is not None:
                    A_nRI[j, r0:r0 + f[0].shape[0]] = f[0]
                    B_nOR[j, :, :f[0].shape[0]] = f[1]
            parts.append((p, r0, R[p], B_nOR))
        r0, o0 = r0 + R[p], o0 + outs[p]
    key = (A_nRI.shape, tuple(t[:3] for t in parts), ranks, A_nRI.dtype, block)
    return _Bucket(tuple(k for _, k, _ in fs), outs, ranks, A_nRI, tuple(parts), B_all, key)


@dataclass
class _Layout:
    """Where each bucket of a linear group finds its rows, for one batch composition. Bucket b's
    j-th adapter's rows fill slots [offset_b + j m_b, offset_b + (j + 1) m_b) (padding slots read
    row 0 and are never read back); the deltas of all slots land in one buffer, and each batch row
    takes its slot's delta from it, or the buffer's last row, zeros, when its adapter has none."""

    rows: list[int]
    """The batch row of each slot, bucket after bucket; -1 for padding."""
    shapes: list[tuple[int, int, int, tuple[int, int] | None]]
    """Per bucket: (offset, n, m, span), `span` the batch rows [start, stop) when its slots are
    exactly those rows in order (its `x` is then a view)."""
    batch: int
    device: torch.device
    identity: bool = False
    """Every batch row is its own slot, in order: the buffer is the batch's delta as it is."""
    _index: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _scratch: dict[tuple, tuple] = field(default_factory=dict)

    def scratch(self, plan: tuple, T: int, like: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple]]:
        """For a linear group's `plan` (`_plan`) at `T` rows of `x` per batch row: its output
        buffers (each slot's delta, then a zero row unless `identity`), and per bucket (its rows
        of `x`: a slice or a gather index, the [n, m, in] shape, its views of the buffers per
        module, its view of the one buffer of block-diagonal B factors or None). Made once and
        kept with the layout: the modules a bucket has no LoRA in stay zeros."""
        buckets, _, mods, cols, zeros = plan
        key = (mods, cols, tuple(zeros), T, like.dtype)  # cols: two groups of one total width differ
        got = self._scratch.get(key)
        if got is None:
            gather, _ = self.index(T)
            bufs = [like.new_zeros((len(self.rows) * T + (not self.identity), O)) for _, _, O in mods]
            slots = []
            for (offset, n, m, span), zero in zip(self.shapes, zeros):
                lo, hi = offset * T, (offset + n * m) * T
                if mods[0][0] < 0:  # block-diagonal B: one buffer of all the group's columns
                    whole = bufs[0][lo:hi].view(n, m * T, -1)
                    views = {p: whole[:, :, o0:o0 + O] for p, o0, O in cols}
                else:
                    whole, views = None, {p: buf[lo:hi].view(n, m * T, -1) for (p, _, _), buf in zip(mods, bufs)}
                rows = slice(span[0] * T, span[1] * T) if span is not None else gather[lo:hi]
                slots.append((rows, (n, m * T, -1), views, whole))
            got = self._scratch[key] = (bufs, slots)
        return got

    def index(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gather, inverse) over the rows of `x` [batch * T, in]: the `x` row of each slot's
        position, and each `x` row's position in the buffer (its last row: zeros)."""
        got = self._index.get(T)
        if got is None:
            S = len(self.rows)
            gather = [max(r, 0) * T + t for r in self.rows for t in range(T)]
            inverse = [S * T] * (self.batch * T)
            for s, r in enumerate(self.rows):
                if r >= 0:
                    inverse[r * T:(r + 1) * T] = range(s * T, (s + 1) * T)
            got = (torch.tensor(gather, device=self.device), torch.tensor(inverse, device=self.device))
            self._index[T] = got
        return got


def _layout(memberships: tuple[tuple[int, ...], ...], rows: list[int], device: torch.device, align: int) -> _Layout:
    """The slots of buckets of adapters `memberships` for batch rows of adapters `rows`."""
    flat, shapes = [], []
    for ks in memberships:
        per = [[i for i, a in enumerate(rows) if a == k] for k in ks]
        m = _round_up(max(1, max(len(p) for p in per)), align)
        mine = [i for p in per for i in p + [-1] * (m - len(p))]
        span = (mine[0], mine[0] + len(mine)) if mine == list(range(mine[0], mine[0] + len(mine))) else None
        shapes.append((len(flat), len(ks), m, span))
        flat += mine
    return _Layout(flat, shapes, len(rows), device, identity=flat == list(range(len(rows))))


def _products(X_nmI: torch.Tensor, b: _Bucket, outs: dict[int, torch.Tensor], whole: torch.Tensor | None) -> None:
    """Every slot's delta into `outs[p]` [n, m, O_p] for each module p of `b.parts` (or, with a
    block-diagonal B, into `whole` [n, m, O]): one batched product for A, one per module for B."""
    low_nmR = torch.bmm(X_nmI, b.A_nRI.transpose(1, 2))
    if b.B_nOR is not None:
        torch.bmm(low_nmR, b.B_nOR.transpose(1, 2), out=whole)
        return
    for p, r0, R, B_nOR in b.parts:
        torch.bmm(low_nmR[:, :, r0:r0 + R], B_nOR.transpose(1, 2), out=outs[p])


def _own_products(X_nmI: torch.Tensor, b: _Bucket, outs: dict[int, torch.Tensor], whole: torch.Tensor | None = None,
                  chunked: bool = False, reference: bool = False) -> None:
    """The same, adapter by adapter at its own ranks: a batched product of one matrix per
    adapter, or (`chunked`) of one per chunk of `INVARIANT_ROWS` rows, or (`reference`) a plain
    product per chunk, whose shapes no batch changes."""
    n, m, _ = X_nmI.shape
    for j in range(n):
        A_rI, parts = b.own(j)
        for p, _, _, B_Or in parts:
            if B_Or is None:
                outs[p][j].zero_()
        parts = [t for t in parts if t[3] is not None]
        if not (chunked or reference):
            low_1mr = torch.bmm(X_nmI[j:j + 1], A_rI.t()[None])
            for p, c0, r, B_Or in parts:
                outs[p][j] = torch.bmm(low_1mr[:, :, c0:c0 + r], B_Or.t()[None])[0]
            continue
        X_cCI = _chunks(X_nmI[j])
        c = X_cCI.shape[0]
        if chunked:
            low_cCr = torch.bmm(X_cCI, A_rI.t().expand(c, -1, -1))
            for p, c0, r, B_Or in parts:
                d_cCO = torch.bmm(low_cCr[:, :, c0:c0 + r].contiguous(), B_Or.t().expand(c, -1, -1))
                outs[p][j] = d_cCO.reshape(-1, B_Or.shape[0])[:m]
            continue
        for i, X_CI in enumerate(X_cCI):
            low_Cr = torch.mm(X_CI, A_rI.t())
            s = i * INVARIANT_ROWS
            for p, c0, r, B_Or in parts:
                outs[p][j, s:s + INVARIANT_ROWS] = torch.mm(low_Cr[:, c0:c0 + r].contiguous(), B_Or.t())[:m - s]


def _chunks(X_mI: torch.Tensor) -> torch.Tensor:
    """`X`'s rows as chunks of `INVARIANT_ROWS` (zero rows pad the last): [c, INVARIANT_ROWS, in]."""
    pad = -X_mI.shape[0] % INVARIANT_ROWS
    if pad:
        X_mI = torch.cat([X_mI, X_mI.new_zeros((pad, X_mI.shape[1]))])
    return X_mI.reshape(-1, INVARIANT_ROWS, X_mI.shape[1])


_FORMS = (_products, _own_products, lambda X, b, outs, whole: _own_products(X, b, outs, chunked=True))
"""The batch-invariant delta's forms, fastest first; the reference is `_own_products(reference=True)`:
each adapter's rows alone, `INVARIANT_ROWS` at a time, at its own ranks."""
_CHECKED: dict[tuple, int] = {}
"""Per call shape (and thread count): the first of `_FORMS` that gave the reference's floats on
that shape's first call, or -1 for none."""


def _random_like(b: _Bucket) -> _Bucket:
    """A bucket of `b`'s shapes and zero padding, its factors random (own factors not cached)."""
    A = torch.randn(b.A_nRI.shape, dtype=b.A_nRI.dtype, device=b.A_nRI.device) * 0.05
    keep = torch.zeros(A.shape[:2], dtype=torch.bool, device=A.device)
    parts = []
    for p, r0, R, B_nOR in b.parts:
        B = torch.randn(B_nOR.shape, dtype=B_nOR.dtype, device=B_nOR.device) * 0.05
        for j, rk in enumerate(b.ranks):
            keep[j, r0:r0 + rk[p]] = True
            B[j, :, rk[p]:] = 0
        parts.append((p, r0, R, B))
    B_all = None
    if b.B_nOR is not None:  # the parts as views into one block-diagonal stack again
        B_all = torch.zeros_like(b.B_nOR)
        o0 = [sum(b.outs[:p]) for p in range(len(b.outs))]
        for p, r0, R, B in parts:
            B_all[:, o0[p]:o0[p] + b.outs[p], r0:r0 + R] = B
        parts = [(p, r0, R, B_all[:, o0[p]:o0[p] + b.outs[p], r0:r0 + R]) for p, r0, R, _ in parts]
    return _Bucket(b.ks, b.outs, b.ranks, A * keep[:, :, None], tuple(parts), B_all, b.key)


def _check_key(shape: torch.Size, b: _Bucket) -> tuple:
    """What decides whether a form gives the reference's floats: the shapes, the threads."""
    return (tuple(shape), b.key, torch.get_num_threads())


def _invariant_delta(X_nmI: torch.Tensor, b: _Bucket, outs: dict[int, torch.Tensor], whole: torch.Tensor | None,
                     key: tuple | None = None) -> None:
    """`outs` = the reference's floats, by the fastest form that has given them at this shape
    (checked on its first call, on these arguments and on random ones: a fresh adapter's zero B
    would let any form pass). `key`: `_check_key`, when the caller has it."""
    key = key or _check_key(X_nmI.shape, b)
    k = _CHECKED.get(key)
    if k is not None and k >= 0:
        _FORMS[k](X_nmI, b, outs, whole)
        return
    _own_products(X_nmI, b, outs, reference=True)
    if k is None:
        probe = (torch.randn(X_nmI.shape, dtype=X_nmI.dtype, device=X_nmI.device), _random_like(b))
        mine = [t[0] for t in b.parts]  # the modules the forms write

        def buffers() -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
            if whole is None:
                return {p: torch.empty_like(outs[p]) for p in mine}, None
            w = torch.zeros_like(whole)
            return {p: w[:, :, sum(b.outs[:p]):sum(b.outs[:p + 1])] for p in range(len(b.outs))}, w

        probe_want, _ = buffers()
        _own_products(*probe, probe_want, reference=True)

        def same(form) -> bool:
            for args, want in (((X_nmI, b), outs), (probe, probe_want)):
                got, w = buffers()
                form(*args, got, w)
                if not all(torch.equal(got[p], want[p]) for p in mine):
                    return False
            return True

        _CHECKED[key] = next((i for i, form in enumerate(_FORMS) if same(form)), -1)


def _plan(buckets: list[_Bucket]) -> tuple | None:
    """What `add_delta` needs of a linear group's buckets: (buckets, their adapters (the layout's
    key), the output buffers (p, first output column, width): one per module with LoRA in any
    bucket, or with block-diagonal B factors one of all the group's columns (p = -1), every
    module's (p, first column, width), per bucket the modules of those it has none of)."""
    if not buckets:
        return None
    outs = buckets[0].outs
    cols = tuple((p, sum(outs[:p]), outs[p]) for p in range(len(outs)))
    mine = [{t[0] for t in b.parts} for b in buckets]
    ps = sorted(set().union(*mine))
    mods = ((-1, 0, sum(outs)),) if buckets[0].B_nOR is not None else tuple(cols[p] for p in ps)
    return (buckets, tuple(b.ks for b in buckets), mods, cols,
            [tuple(p for p in ps if p not in m) for m in mine])


class RowAdapters:
    """Which adapter each row of a batch decodes with, and their factors per layer and group."""

    def __init__(self, lora: list[list[list[GroupFactors | Factors | None]]], row_adapter: list[int],
                 invariant: bool = False):
        self.lora = [[[_group(f) for f in per] for per in per_layer] for per_layer in lora]
        """`lora[k][layer][group]`: adapter k's factors of one fused linear group, or None."""
        self.invariant = invariant
        """Batch-invariant products (`_invariant_delta`), ranks and rows aligned for them."""
        self.dtype = next((f[0].dtype for per_layer in self.lora for per in per_layer if per
                           for g in per if g for _, f in g if f is not None), None)
        """The adapters' dtype (None: no adapter changes any layer)."""
        self._present: tuple[int, ...] | None = None
        self._buckets: list[list[list[_Bucket]]] = []
        self._plans: list[list[tuple | None]] = []
        self._layouts: dict[tuple[int, ...], dict[tuple[tuple[int, ...], ...], _Layout]] = {}
        self._runs: dict[tuple, tuple] = {}
        self.set_rows(row_adapter)

    @classmethod
    def build(cls, groups: list[list[list[torch.nn.Module]]], names: list[str | None],
              row_adapter: list[int], invariant: bool = False) -> "RowAdapters | None":
        """Rows decode with adapter `names[row_adapter[i]]` (None: the bare base) over the
        decoder's fused linear `groups` (per layer, its groups of modules: a decoder layer's,
        then the output layer as one more "layer" of one group); None when an adapter is not a
        vanilla LoRA (`lora_factors`)."""
        lora = []
        for name in names:
            per_layer = [[lora_factors(g, name) for g in layer] if name is not None else [None] * len(layer)
                         for layer in groups]
            if any(f is False for layer in per_layer for f in layer):
                return None
            lora.append(per_layer)
        return cls(lora, row_adapter, invariant)

    def ranks(self, layer: int, group: int) -> dict[int, int]:
        """Each adapter's own rank in linear group `group` of `layer`, summed over its modules
        (adapters without LoRA there left out)."""
        return {k: sum(f[0].shape[0] for _, f in per[layer][group] if f is not None)
                for k, per in enumerate(self.lora) if per[layer][group] is not None}

    def set_rows(self, row_adapter: list[int]) -> None:
        """Rows decode with adapters `row_adapter` from now on. The stacked factors are built again
        only when the set of adapters present changes; a batch composition seen before (a prune
        back to it, the shared prefix's rows then the prompts') reuses its row layouts."""
        self.row_adapter = list(row_adapter)
        counts = Counter(self.row_adapter)
        present = tuple(sorted(counts))
        if present != self._present:
            self._present = present
            self._layouts = {}
            self._buckets = [[self._partition(li, g, counts) for g in range(len(per))]
                             for li, per in enumerate(self.lora[0])]
            self._plans = [[_plan(bs) for bs in per] for per in self._buckets]
        composition = tuple(self.row_adapter)
        layout = self._layouts.get(composition)
        if layout is None:
            members = {tuple(b.ks for b in bs) for per in self._buckets for bs in per if bs}
            device = next((b.A_nRI.device for per in self._buckets for bs in per for b in bs), torch.device("cpu"))
            align = ROW_ALIGN if self.invariant else 1
            layout = {ms: _layout(ms, self.row_adapter, device, align) for ms in members}
            if len(self._layouts) >= 8:  # a sample call sees a few compositions; keep the latest
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[composition] = layout
        if layout is not getattr(self, "_layout", None):
            self._runs = {}
        self._layout = layout

    def keep(self, rows: list[int]) -> None:
        """Keep (or repeat) these rows, as the decoder's `select` does with its cache."""
        self.set_rows([self.row_adapter[i] for i in rows])

    def _partition(self, li: int, g: int, counts: Counter) -> list[_Bucket]:
        """The present adapters with LoRA in group `g` of layer `li`, in buckets of similar rank:
        the split of the rank-sorted adapters whose products' flops plus `DISPATCH_FLOPS` per
        bucket are least (for the rows each has now), each bucket's factors stacked."""
        min_rank = MIN_RANK if self.invariant else 1
        fs = []
        for k in self._present:
            group = self.lora[k][li][g]
            if group is not None:
                ranks = [max(f[0].shape[0], min_rank) if f is not None else 0 for _, f in group]
                fs.append((sum(ranks), k, group, ranks))
        if not fs:
            return []
        fs.sort(key=lambda t: (t[0], t[1]))
        outs = [O for O, _ in fs[0][2]]
        A0 = next(f[0] for _, f in fs[0][2] if f is not None)
        width, row_align = A0.shape[1], ROW_ALIGN if self.invariant else 1
        dispatch = DISPATCH_FLOPS.get(A0.device.type, DISPATCH_FLOPS_OTHER)
        read = READ_FLOPS.get(A0.device.type, READ_FLOPS_OTHER) * A0.element_size()

        def cost(i: int, j: int) -> float:  # adapters i..j-1 as one bucket
            m = _round_up(max(counts[k] for _, k, _, _ in fs[i:j]), row_align)
            R = [max(t[3][p] for t in fs[i:j]) for p in range(len(outs))]
            return dispatch + (j - i) * (2.0 * m + read) * (sum(R) * width + sum(r * O for r, O in zip(R, outs)))

        best, cut = [0.0], [0]
        for j in range(1, len(fs) + 1):
            i = min(range(j), key=lambda i: best[i] + cost(i, j))
            best.append(best[i] + cost(i, j))
            cut.append(i)
        bounds, j = [], len(fs)
        while j > 0:
            bounds.append((cut[j], j))
            j = cut[j]
        buckets = [fs[i:j] for i, j in reversed(bounds)]
        # one block-diagonal B product per bucket instead of one per module, where its zeros'
        # bytes and flops cost less than the calls it saves
        block = False
        if len(outs) > 1:
            extra = saved = 0.0
            for part in buckets:
                m = _round_up(max(counts[k] for _, k, _, _ in part), row_align)
                R = [max(t[3][p] for t in part) for p in range(len(outs))]
                extra += len(part) * (2.0 * m + read) * (sum(R) * sum(outs) - sum(r * O for r, O in zip(R, outs)))
                saved += (sum(1 for r in R if r) - 1) * dispatch
            block = extra < saved
        return [_stack([t[:3] for t in part], block, min_rank) for part in buckets]

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: int) -> None:
        """`y` (the base output on `x` [B, ..., in]) gains each row's own adapter delta of linear
        group `group`, in place: in the adapters' dtype, summed with `y` and rounded once to `y`'s
        dtype where the two differ (`tinker_pipelines.models.dtypes`)."""
        plan = self._plans[layer][group]
        if plan is None:
            return
        x_MI = x.reshape(-1, x.shape[-1])
        T = x_MI.shape[0] // len(self.row_adapter)
        x_MI = adapter_input(x_MI, plan[0][0].A_nRI)
        run = self._runs.get((layer, group, T, x_MI.dtype))
        if run is None:
            run = self._runs[(layer, group, T, x_MI.dtype)] = self._run(plan, T, x_MI)
        adds, steps = run
        for rows, shape, b, views, whole, key in steps:
            X_nmI = (x_MI[rows] if isinstance(rows, slice) else x_MI.index_select(0, rows)).view(shape)
            if key is None:
                _products(X_nmI, b, views, whole)
            else:
                _invariant_delta(X_nmI, b, views, whole, key)
        y_MO = y.view(-1, y.shape[-1])
        for o0, O, buf, inverse in adds:
            delta = buf if inverse is None else buf.index_select(0, inverse)
            y_part = y_MO if O == y_MO.shape[1] else y_MO[:, o0:o0 + O]
            if y.dtype == x_MI.dtype:
                y_part += delta
            else:
                y_part.copy_(add_lora(y_part, delta))

    def _run(self, plan: tuple, T: int, x_MI: torch.Tensor) -> tuple[list[tuple], list[tuple]]:
        """What `add_delta` does for a linear group at this batch composition and `T` rows of
        `x` per batch row, resolved once: per output buffer (first column, width, buffer, inverse
        index or None), per bucket (its rows of `x`, their [n, m, in] shape, the bucket, its
        output views, its block-diagonal view or None, its check key or None off the
        batch-invariant path)."""
        buckets, members, mods = plan[:3]
        layout = self._layout[members]
        bufs, slots = layout.scratch(plan, T, x_MI)
        inverse = None if layout.identity else layout.index(T)[1]
        adds = [(o0, O, buf, inverse) for (_, o0, O), buf in zip(mods, bufs)]
        invariant = self.invariant and x_MI.device.type == "cpu"
        steps = [(rows, shape, b, views, whole, _check_key((shape[0], shape[1], x_MI.shape[1]), b) if invariant else None)
                 for b, (rows, shape, views, whole) in zip(buckets, slots)]
        return adds, steps
