"""What a sampler call takes and returns: `SampleRequest` (one caller's share of a batch),
`Sample` (one completion) and `completion_text` (its text as an API returns it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Sample:
    """One completion."""

    tokens: tuple[int, ...]
    """Sampled token ids, including the stop token when one was produced."""
    logprobs: tuple[float, ...]
    """Logprob of each sampled token under the sampling distribution (logits / temperature)."""
    stop_reason: str
    """'stop' (a stop token was sampled, or the text reached a stop string) or 'length'
    (max_new_tokens reached)."""
    stop_string: str | None = None
    """The stop string that ended the completion (None: none did). `tokens` then run up to and
    including the token that completed it (that token may carry text past the stop string);
    `completion_text` gives the text before it."""
    support: tuple[int, ...] = ()
    """How many tokens the truncated distribution kept at each step (top-k / top-p / min-p), one
    per token; empty when nothing was truncated. The learner renormalizes over as many of its own
    most likely tokens (`Datum.support_sizes`), so its logprobs are those of this distribution."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    """With `SampleRequest.top_logprobs` = k: for each token, the k most likely tokens as (id,
    logprob), most likely first, under the distribution that token was drawn from (the one
    `logprobs` are of; -inf outside a truncated support); empty otherwise."""


@dataclass
class SampleRequest:
    """One caller's share of a batched `Sampler.sample_requests` call."""

    prompts: list[list[int]]
    """Token prompts to complete."""
    max_new_tokens: int
    """Tokens each completion may have."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    generator: torch.Generator | None = None
    """Source of this request's uniforms (one per prompt and step), advanced as if it were sampled alone."""
    adapter: str | None = None
    """The LoRA adapter its rows decode with; `BASE` for the bare base model; None: the model's
    active adapter, as it is set."""
    top_k: int = 0
    """Keep the k most likely tokens (ties at the k-th kept); 0: off. See `rollout.truncation`."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens with this much mass (ties at the cut kept); 1.0: off."""
    min_p: float = 0.0
    """Keep tokens with probability >= min_p x the most likely one's; 0.0: off."""
    stop: tuple[str, ...] = ()
    """Stop strings: a row ends at the token with which its decoded text (special tokens
    skipped) first contains one of them; needs the sampler's tokenizer."""
    top_logprobs: int = 0
    """Also return each step's this many most likely tokens and their logprobs (`Sample.top_logprobs`); 0: off."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end this request's rows, besides the sampler's own stop tokens (Tinker's
    `stop` given as token ids)."""


BASE = "__base__"
"""`SampleRequest.adapter` naming the base model without any adapter."""



def completion_text(tokenizer: PreTrainedTokenizerBase, sample: Sample, stop_token_ids: list[int] | tuple = ()) -> str:
    """A completion's text as an OpenAI-style API returns it: stop tokens and special tokens
    dropped, and cut before the stop string that ended it (the trajectory keeps every sampled
    token, the stop string included)."""
    stop_ids = set(stop_token_ids)
    text = tokenizer.decode([t for t in sample.tokens if t not in stop_ids], skip_special_tokens=True)
    if sample.stop_string is not None and (at := text.find(sample.stop_string)) >= 0:
        text = text[:at]
    return text
