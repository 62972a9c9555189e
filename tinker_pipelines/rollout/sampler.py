"""Batched decoding with a KV cache that returns the sampled tokens and their logprobs.

All rows decode together; a row that hits a stop token is dropped from the batch (and from the
cache) so finished episodes cost nothing. Sampling draws one uniform per row and inverts the
CDF, which is much cheaper on CPU than `torch.multinomial` over a large vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass(frozen=True)
class Sample:
    """One completion."""

    tokens: tuple[int, ...]
    """Sampled token ids, including the stop token when one was produced."""
    logprobs: tuple[float, ...]
    """Logprob of each sampled token under the sampling distribution (logits / temperature)."""
    stop_reason: str
    """'stop' (a stop token was sampled) or 'length' (max_new_tokens reached)."""


class ContextOverflowError(ValueError):
    """A prompt does not fit the model's context with room to generate."""


def sample_tokens(logits_BV: torch.Tensor, temperature: float,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens_B, logprobs_B). temperature 0 is greedy.

    Greedy logprobs are reported at temperature 1.
    """
    if temperature == 0:
        logprobs_BV = torch.log_softmax(logits_BV.float(), dim=-1)
        tokens_B = logprobs_BV.argmax(dim=-1)
    else:
        logprobs_BV = torch.log_softmax(logits_BV.float() / temperature, dim=-1)
        cdf_BV = logprobs_BV.exp().cumsum(dim=-1)
        u_B1 = torch.rand(logits_BV.shape[0], 1, generator=generator) * cdf_BV[:, -1:]
        tokens_B = torch.searchsorted(cdf_BV, u_B1).squeeze(1).clamp_(max=logits_BV.shape[1] - 1)
    return tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)


class Sampler:
    """Generates completions for a batch of token prompts with one model."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, stop_token_ids: list[int],
                 max_context: int | None = None):
        self.model = model
        self.pad_token_id = pad_token_id
        self.stop_token_ids = list(stop_token_ids)
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", None)

    @torch.inference_mode()
    def sample(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
               generator: torch.Generator | None = None) -> list[Sample]:
        """Complete every prompt; rows are independent of each other's lengths."""
        if not prompts:
            return []
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        longest = max(len(p) for p in prompts)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if self.max_context is not None and longest + max_new_tokens > self.max_context:
            raise ContextOverflowError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                f"model context of {self.max_context} tokens"
            )
        B = len(prompts)
        device = next(self.model.parameters()).device
        input_BL = torch.full((B, longest), self.pad_token_id, dtype=torch.long)
        mask_BL = torch.zeros((B, longest), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding keeps every row's last token aligned
            input_BL[i, longest - len(p):] = torch.tensor(p)
            mask_BL[i, longest - len(p):] = 1
        input_BL, mask_BL = input_BL.to(device), mask_BL.to(device)
        positions_BL = (mask_BL.cumsum(-1) - 1).clamp_(min=0)
        stop_S = torch.tensor(self.stop_token_ids, device=device)

        cache = DynamicCache()
        out = self.model(input_ids=input_BL, attention_mask=mask_BL, position_ids=positions_BL,
                         cache=cache, use_cache=True, logits_to_keep=1)
        logits_BV = out.logits[:, -1]
        rows = torch.arange(B, device=device)  # original index of each live row
        next_pos_B = positions_BL[:, -1] + 1
        tokens: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        stopped = [False] * B
        for step in range(max_new_tokens):
            tok_B, lp_B = sample_tokens(logits_BV, temperature, generator)
            for r, t, lp in zip(rows.tolist(), tok_B.tolist(), lp_B.tolist()):
                tokens[r].append(t)
                logprobs[r].append(lp)
            done_B = torch.isin(tok_B, stop_S)
            if done_B.any():
                for r in rows[done_B].tolist():
                    stopped[r] = True
                keep_B = ~done_B
                if not keep_B.any():
                    break
                rows, tok_B, next_pos_B, mask_BL = rows[keep_B], tok_B[keep_B], next_pos_B[keep_B], mask_BL[keep_B]
                keep_idx = keep_B.nonzero().squeeze(1)
                cache.batch_select_indices(keep_idx)
            if step == max_new_tokens - 1:
                break
            mask_BL = torch.cat([mask_BL, mask_BL.new_ones(mask_BL.shape[0], 1)], dim=1)
            out = self.model(input_ids=tok_B[:, None], attention_mask=mask_BL,
                             position_ids=next_pos_B[:, None], cache=cache, use_cache=True)
            logits_BV = out.logits[:, -1]
            next_pos_B = next_pos_B + 1
        return [
            Sample(tuple(t), tuple(lp), "stop" if s else "length")
            for t, lp, s in zip(tokens, logprobs, stopped)
        ]
