"""Datums padded into [B, T] tensors for a training forward (`pad_datums`), and a loss's
inputs from those rows (`loss_batch`); shared by `Learner`, `DeepSpeedLearner`, DPO and the
worker's cross-experiment batches."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tinker_pipelines.algorithms.losses import LossBatch
from tinker_pipelines.types import Datum


@dataclass
class _Padded:
    inputs_BT: torch.Tensor
    targets_BT: torch.Tensor
    mask_BT: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    reference_BT: torch.Tensor | None = None
    """The datums' own reference logprobs (`Datum.reference_logprobs`), 0 in rows without them;
    None when no datum has them."""
    has_reference: tuple[bool, ...] = ()
    """Per row: whether its datum carries its reference logprobs."""

    def own_reference(self, start: int = 0, end: int | None = None) -> torch.Tensor | None:
        """Rows [start, end)'s own reference logprobs when every one of them carries them, else None."""
        rows = self.has_reference[start:end]
        return self.reference_BT[start:end] if rows and all(rows) else None


def pad_datums(datums: list[Datum], pad_token_id: int, device: torch.device | str = "cpu") -> _Padded:
    """Right-pad datums into [B, T] tensors on `device`; padding has weight 0. Built on the host
    and moved in one copy per tensor (per-datum copies to a GPU would cost a launch each)."""
    B, T = len(datums), max(len(d.input_tokens) for d in datums)
    inputs = torch.full((B, T), pad_token_id, dtype=torch.long)
    targets = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    fields = {k: torch.zeros((B, T)) for k in ("weights", "behaviour_logprobs", "advantages", "old_values", "returns",
                                               "support_sizes")}  # sizes < 2**24: exact in float32
    has_reference = tuple(bool(d.reference_logprobs) for d in datums)
    reference = torch.zeros((B, T)) if any(has_reference) else None
    for i, d in enumerate(datums):
        n = len(d.input_tokens)
        if has_reference[i]:
            reference[i, :n] = torch.tensor(d.reference_logprobs)
        inputs[i, :n] = torch.tensor(d.input_tokens)
        targets[i, :n] = torch.tensor(d.target_tokens)
        mask[i, :n] = 1
        for k in fields:
            if getattr(d, k, ()):
                fields[k][i, :n] = torch.tensor(getattr(d, k))
    if torch.device(device).type != "cpu":
        inputs, targets, mask = inputs.to(device), targets.to(device), mask.to(device)
        fields = {k: v.to(device) for k, v in fields.items()}
        reference = reference.to(device) if reference is not None else None
    return _Padded(inputs, targets, mask, fields, reference, has_reference)


def loss_batch(fields: dict[str, torch.Tensor], ref_BT: torch.Tensor | None,
               values_BT: torch.Tensor | None) -> LossBatch:
    """A loss's inputs from padded rows (`_Padded.fields`, or a row slice of them)."""
    critic = ({"values_BT": values_BT, "old_values_BT": fields["old_values"], "returns_BT": fields["returns"]}
              if values_BT is not None else {})
    return LossBatch(fields["weights"], fields["behaviour_logprobs"], fields["advantages"], ref_BT, **critic)
