"""`_HFDecoder`: the sampler's decode steps for any causal LM, through the model's own forward and
a `DynamicCache` (models `LeanLlamaDecoder` does not support, or `Sampler(lean=False)`)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class _HFDecoder:
    """Decode steps through the model's own forward and a `DynamicCache` (any causal LM)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def prefill(self, input_BL: torch.Tensor, mask_BL: torch.Tensor, positions_BL: torch.Tensor,
                max_new_tokens: int) -> torch.Tensor:
        self.cache = DynamicCache()
        out = self.model(input_ids=input_BL, attention_mask=mask_BL, position_ids=positions_BL,
                         cache=self.cache, use_cache=True, logits_to_keep=1)
        self.mask_BS = torch.cat([mask_BL, mask_BL.new_ones(mask_BL.shape[0], max_new_tokens)], dim=1)
        self.next_pos_B = positions_BL[:, -1] + 1
        self.L = input_BL.shape[1]
        return out.logits[:, -1]

    def select(self, keep_idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep_idx)
        self.mask_BS = self.mask_BS.index_select(0, keep_idx)
        self.next_pos_B = self.next_pos_B.index_select(0, keep_idx)

    def step(self, tok_B: torch.Tensor, t: int) -> torch.Tensor:
        out = self.model(input_ids=tok_B[:, None], attention_mask=self.mask_BS[:, : self.L + t + 1],
                         position_ids=(self.next_pos_B + t)[:, None], cache=self.cache, use_cache=True)
        return out.logits[:, -1]
