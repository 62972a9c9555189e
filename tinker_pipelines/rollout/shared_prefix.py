"""The prompts' common start (a system prompt, a task's instructions), prefilled once.

When every prompt of a batch begins with the same tokens, the sampler runs them through the
model once per adapter and copies their keys and values (a hybrid model's linear-attention layers:
their conv and recurrent states at the prefix's end) into each row's cache; the logprobs then
differ from a full prefill's by float rounding (~1e-5 on SmolLM2; greedy tokens still equal
`generate`'s).
"""

from __future__ import annotations

import os

import torch

from tinker_pipelines.rollout.lean_decoder import LeanDecoder, PromptStore


SHARED_PREFIX_MIN = 16
"""Shortest common prompt prefix (tokens) that `Sampler` prefills once for all rows."""


def shared_prefix_len(prompts: list[tuple[int, ...]]) -> int:
    """Tokens at the start of every prompt, when there are at least `SHARED_PREFIX_MIN` of them
    and every prompt goes on past them; else 0.

    >>> shared_prefix_len([tuple(range(20)) + (7,), tuple(range(20)) + (8, 9)])
    20
    >>> shared_prefix_len([tuple(range(20)), tuple(range(20)) + (8,)])  # one prompt is all prefix
    19
    >>> shared_prefix_len([tuple(range(10)) + (1,), tuple(range(10)) + (2,)])  # too short to pay
    0
    """
    if len(prompts) < 2:
        return 0
    n = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)
    return n if n >= SHARED_PREFIX_MIN else 0


def prefill_shared_prefix(decoder: LeanDecoder, prompts: list[tuple[int, ...]], row_adapter: list[int],
                          fingerprint: tuple | None) -> tuple[PromptStore | None, list]:
    """Keys and values of the prompts' common prefix (a system prompt, a task's instructions),
    prefilled once per adapter, and each prompt's hit in them; (None, [None, ...]) when
    sharing saves fewer than `SHARED_PREFIX_MIN` tokens of every prompt sharing it."""
    n = shared_prefix_len(prompts)
    adapters = sorted(set(row_adapter))
    if n == 0 or len(adapters) >= len(prompts):
        return None, [None] * len(prompts)
    prefix = prompts[0][:n]
    device = decoder.embed.weight.device
    input_PL = torch.tensor([prefix] * len(adapters), device=device)
    mask_PL = torch.ones_like(input_PL)
    positions_PL = torch.arange(n, device=device).expand(len(adapters), n)
    if decoder.adapters is None:
        decoder.prefill(input_PL, mask_PL, positions_PL, 0)
    else:  # each adapter's own keys and values of the prefix
        decoder.adapters.set_rows(adapters)
        decoder.prefill_reusing(input_PL, mask_PL, positions_PL, 0, None, [None] * len(adapters))
        decoder.adapters.set_rows(row_adapter)
    store = PromptStore(decoder.keys, decoder.values, n, [n] * len(adapters), {}, fingerprint, decoder.states())
    return store, [(adapters.index(a), n) for a in row_adapter]
