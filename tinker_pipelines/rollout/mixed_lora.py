"""Rows of one decode batch, each with its own LoRA adapter over a shared frozen base.

`RowAdapters` holds, for a base-only `LeanLlamaDecoder`, which adapter each row uses and adds
every row's low-rank delta after the base matmul that ran once over all rows. The batch's
adapters sit side by side (A [R, in], B [out, R], built once per set of adapters) with a row
mask [B, R] keeping each row's own block, so the delta is one pair of matmuls however many
adapters share the batch (one pair per adapter was dispatch-bound on small models); the other
adapters' blocks add exact zeros. A batch of one adapter needs no mask. A batch-invariant
decoder (CPU) hands the factors and a transposed mask to `linears.invariant_linear`, which adds
the delta inside its base product: a row's delta is then the same floats whoever shares the
batch (tested against each adapter alone).

Adapters in another dtype than the base (fp32 LoRA on a bf16 base, PEFT's default) add their
delta as `tinker_pipelines.models.dtypes` states (`add_delta_upcast`): `x` cast to the adapters' dtype,
the low-rank products there, the sum with the base output rounded once to the base's dtype. On
a batch-invariant decoder (CPU) each adapter's products are `invariant_linear`s of their own
factors, so a row's delta is still the floats it gets when its adapter is alone in the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinker_pipelines.models.dtypes import adapter_input, add_lora
from tinker_pipelines.rollout.linears import invariant_linear

Factors = tuple[torch.Tensor, torch.Tensor]
"""A fused linear group's adapter update: A [R, in], B [out, R] (scaling folded into B)."""


def lora_factors(modules: list[torch.nn.Module], name: str) -> tuple[torch.Tensor, torch.Tensor] | None | bool:
    """Adapter `name`'s update of the fused linear `modules` as two matrices (A [R, in], B [out, R],
    the scaling folded into B; B is block-diagonal over the modules), so that the fused output
    gains `x @ A.T @ B.T`. None when no module has the adapter; False when it is not a vanilla
    LoRA (DoRA or another variant, a LoRA bias, dropout), which only its own forward can run."""
    As, Bs, outs = [], [], []
    for m in modules:
        out_features = m.out_features if hasattr(m, "out_features") else m.weight.shape[0]
        outs.append(out_features)
        if name not in getattr(m, "lora_A", {}):
            Bs.append(None)
            continue
        if name in getattr(m, "lora_variant", {}) or getattr(m, "lora_bias", {}).get(name, False):
            return False
        dropout = m.lora_dropout[name]
        if not (isinstance(dropout, torch.nn.Identity) or getattr(dropout, "p", 1) == 0):
            return False
        As.append(m.lora_A[name].weight)
        Bs.append(m.lora_B[name].weight * m.scaling[name])
    if not As:
        return None
    A = torch.cat(As)
    B = A.new_zeros((sum(outs), A.shape[0]))
    row = col = 0
    for b, n_out in zip(Bs, outs):
        if b is not None:
            B[row:row + n_out, col:col + b.shape[1]] = b
            col += b.shape[1]
        row += n_out
    return A, B


class RowAdapters:
    """Which adapter each row of a batch decodes with, and their factors per layer and group."""

    def __init__(self, lora: list[list[list[Factors | None]]], row_adapter: list[int], invariant: bool = False):
        self.lora = lora
        """`lora[k][layer][group]`: adapter k's factors of one fused linear group, or None."""
        self.invariant = invariant
        """Masks kept as [R, B] for `linears.invariant_linear` (`factors`) instead of [B, R] (`add_delta`)."""
        self._factors_for: tuple[int, ...] | None = None
        self.dtype = next((f[0].dtype for per_layer in lora for per in per_layer for f in per if f), None)
        """The adapters' dtype (None: no adapter changes any layer)."""
        self.set_rows(row_adapter)

    @classmethod
    def build(cls, groups: list[list[list[torch.nn.Module]]], names: list[str | None],
              row_adapter: list[int], invariant: bool = False) -> "RowAdapters | None":
        """Rows decode with adapter `names[row_adapter[i]]` (None: the bare base) over the
        decoder's fused linear `groups` (per layer, its groups of modules: a decoder layer's 4,
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

    def set_rows(self, row_adapter: list[int]) -> None:
        self.row_adapter = list(row_adapter)
        present = tuple(sorted(set(self.row_adapter)))
        if self._factors_for != present:  # rows finishing (`keep`) keep the set: only the masks change
            self._factors_for = present
            self._factors = [[self._side_by_side(present, li, g) for g in range(len(per))]
                             for li, per in enumerate(self.lora[0])]
        rows_B = torch.tensor(self.row_adapter)
        self._rows_B = rows_B
        self._masks = [[None if f is None or len(present) == 1 else self._mask(rows_B, f) for f in per]
                       for per in self._factors]

    def _mask(self, rows_B: torch.Tensor, factors) -> torch.Tensor:
        """1 where a row's adapter owns a column of the side-by-side factors: [B, R] ([R, B] if invariant)."""
        owns = factors[2][:, None] == rows_B[None, :] if self.invariant else rows_B[:, None] == factors[2][None, :]
        return owns.to(factors[0].device, factors[0].dtype)

    def keep(self, rows: list[int]) -> None:
        """Keep (or repeat) these rows, as the decoder's `select` does with its cache."""
        self.set_rows([self.row_adapter[i] for i in rows])

    def _side_by_side(self, present: tuple[int, ...], li: int, g: int):
        """(A [R, in], B [out, R], the adapter owning each of the R columns) of `present`, or None."""
        fs = [(k, self.lora[k][li][g]) for k in present if self.lora[k][li][g] is not None]
        if not fs:
            return None
        owner_R = torch.cat([torch.full((f[0].shape[0],), k) for k, f in fs])
        return (torch.cat([f[0] for _, f in fs]), torch.cat([f[1] for _, f in fs], dim=1), owner_R,
                tuple(f for _, f in fs), tuple(k for k, _ in fs))

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: int) -> None:
        """`y += ` each row's adapter delta of linear group `group` on `x` [B, ..., in] (not invariant)."""
        f = self._factors[layer][group]
        if f is None:
            return
        low = F.linear(x, f[0])
        mask_BR = self._masks[layer][group]
        if mask_BR is not None:
            low = low * mask_BR.view(x.shape[0], *([1] * (x.dim() - 2)), -1)
        y += F.linear(low, f[1])

    def factors(self, layer: int, group: int):
        """(A [R, in], B [out, R], mask [R, B] or None, each adapter's own (A, B)) of linear group
        `group`, the form `linears.invariant_linear` adds; None when no row's adapter changes it."""
        f = self._factors[layer][group]
        if f is None:
            return None
        return f[0], f[1], self._masks[layer][group], f[3]

    def add_delta_upcast(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: int) -> None:
        """`y` (the base output on `x` [B, ..., in], in the base's dtype) becomes the LoRA layer's
        output as PEFT computes it for adapters in another dtype (`tinker_pipelines.models.dtypes`): each
        row's delta from `x` cast to the adapters' dtype, added in that dtype, rounded once."""
        f = self._factors[layer][group]
        if f is None:
            return
        A_RI, B_OR, _, parts, ks = f
        x_f = adapter_input(x, A_RI)
        mask = self._masks[layer][group]
        ones = [1] * (x.dim() - 2)
        if not self.invariant:
            low = F.linear(x_f, A_RI)
            if mask is not None:
                low = low * mask.view(x.shape[0], *ones, -1)
            delta = F.linear(low, B_OR)
        else:  # adapter by adapter, each product batch-invariant; other rows add exact zeros
            delta = None
            rows_B = self._rows_B.to(x.device)
            for k, (A_rI, B_Or) in zip(ks, parts):
                low = invariant_linear(x_f, A_rI)
                if mask is not None:
                    low = low * (rows_B == k).to(low.dtype).view(x.shape[0], *ones, 1)
                d = invariant_linear(low, B_Or)
                delta = d if delta is None else delta.add_(d)
        y.copy_(add_lora(y, delta))
