"""Scores of a prompt's own tokens, from one forward over the prompt: each position's logprob,
its k most likely tokens, and the logprobs of token ids a caller names at chosen positions
(Tinker's `prompt_logprobs`, `topk_prompt_logprobs`, `prompt_logprobs_last_n` and
`target_prompt_logprobs`). A sample call scores each of its prompts once, however many samples
it draws of it.

Position i is scored by the model's next-token distribution after tokens [0, i), at temperature 1
without truncation; position 0 has no prefix and is never scored. Only the positions a prompt's
`PromptScoring` asks for go through the output layer (`logits_to_keep`), so scoring the last n
tokens of a long prompt costs its forward plus n rows of logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinker_pipelines.rollout.decode_rows import left_padded
from tinker_pipelines.rollout.truncation import CHUNK_ELEMENTS

FORWARD_LOGITS = 1 << 26
"""Most logits (rows x kept positions x vocabulary) one scoring forward produces: prompts are
scored in groups under it (a single prompt beyond it goes alone). 256 MiB in fp32."""


@dataclass(frozen=True)
class PromptScoring:
    """What one prompt's forward scores; the defaults score nothing."""

    logprobs: bool = False
    """Each scored position's own token's logprob."""
    topk: int = 0
    """The k most likely tokens at each scored position, most likely first; 0: none."""
    last_n: int = 0
    """`logprobs` and `topk` cover the last n positions; 0: every position after the first."""
    target_positions: tuple[int, ...] = ()
    """Positions (1..len(prompt) - 1) of the cells whose token ids `target_ids` names."""
    target_ids: tuple[int, ...] = ()
    """The token id each cell scores at its position (`PromptScores.targets`, in this order)."""

    def first(self, n_tokens: int) -> int:
        """The first position `logprobs` and `topk` cover."""
        return n_tokens - self.last_n if self.last_n else 1

    def lowest(self, n_tokens: int) -> int | None:
        """The first position whose distribution the forward must produce; None: none."""
        wanted = [self.first(n_tokens)] if self.logprobs or self.topk else []
        wanted += [min(self.target_positions)] if self.target_positions else []
        lowest = min(wanted, default=None)
        return lowest if lowest is not None and lowest < n_tokens else None


@dataclass(frozen=True)
class PromptScores:
    """One prompt's scores (`PromptScoring` says which); positions before `first` were not scored."""

    first: int
    """The position `logprobs[0]` and `topk[0]` are of."""
    logprobs: tuple[float, ...] = ()
    """Positions first..len(prompt) - 1: the prompt's token there, given the tokens before it."""
    topk: tuple[tuple[tuple[int, float], ...], ...] = ()
    """Positions first..len(prompt) - 1: (token id, logprob) of the k most likely, most likely first."""
    targets: tuple[float, ...] = ()
    """The logprob of each `PromptScoring` target cell, in its order."""


def check_scoring(s: PromptScoring, n_tokens: int, vocab: int) -> None:
    """ValueError naming the field of `s` that does not fit a prompt of `n_tokens` tokens."""
    for name in ("topk", "last_n"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"prompt_scoring.{name} must be an integer >= 0, got {v!r}")
    if s.last_n > n_tokens - 1:
        raise ValueError(f"prompt_scoring.last_n {s.last_n} exceeds the prompt's {n_tokens - 1} scorable positions")
    if len(s.target_positions) != len(s.target_ids):
        raise ValueError(f"prompt_scoring has {len(s.target_positions)} target_positions but {len(s.target_ids)} "
                         f"target_ids")
    bad = next((p for p in s.target_positions if not 1 <= p < n_tokens), None)
    if bad is not None:
        raise ValueError(f"prompt_scoring.target_positions has {bad}, outside the prompt's positions 1..{n_tokens - 1}")
    bad = next((t for t in s.target_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt_scoring.target_ids has {bad}, outside the vocabulary [0, {vocab})")


@torch.no_grad()
def score_prompts(model: torch.nn.Module, prompts: list[list[int]], scoring: list[PromptScoring],
                  pad_token_id: int) -> list[PromptScores]:
    """Each prompt's scores under `model` as it is (its active adapter), prompts grouped into
    left-padded forwards of at most `FORWARD_LOGITS` logits."""
    out = [PromptScores(first=s.first(len(p))) for p, s in zip(prompts, scoring, strict=True)]
    need = sorted(((b, len(p) - lo) for b, (p, s) in enumerate(zip(prompts, scoring))
                   if (lo := s.lowest(len(p))) is not None), key=lambda x: -x[1])
    if not need:
        return out
    device = next(model.parameters()).device
    per_group = max(1, FORWARD_LOGITS // model.get_input_embeddings().num_embeddings)
    group: list[tuple[int, int]] = []
    for row in need + [(-1, 0)]:  # a sentinel flushes the last group
        if group and (row[0] < 0 or (len(group) + 1) * group[0][1] > per_group):
            keep = group[0][1]  # rows are sorted by kept positions, longest first
            input_UT, mask_UT, positions_UT = left_padded([prompts[b][:-1] for b, _ in group], pad_token_id, device)
            logits_UKV = model(input_ids=input_UT, attention_mask=mask_UT, position_ids=positions_UT,
                               logits_to_keep=keep).logits
            for j, (b, k) in enumerate(group):
                out[b] = _scores(logits_UKV[j, keep - k:], prompts[b], scoring[b])
            group = []
        group.append(row)
    return out


def _scores(logits_KV: torch.Tensor, prompt: list[int], s: PromptScoring) -> PromptScores:
    """One prompt's scores from the logits predicting its last K tokens."""
    K, V = logits_KV.shape
    lo, first = len(prompt) - K, s.first(len(prompt))
    device = logits_KV.device
    tokens_K = torch.tensor(prompt[lo:], device=device)
    cell_pos_C = torch.tensor(s.target_positions, dtype=torch.long, device=device) - lo
    cell_ids_C = torch.tensor(s.target_ids, dtype=torch.long, device=device)
    cells_C = torch.zeros(len(s.target_ids), dtype=torch.float32, device=device)
    lp_parts, top_vals, top_ids = [], [], []
    step = max(1, CHUNK_ELEMENTS // V)  # positions per fp32 log-softmax: its temporaries stay bounded
    for a in range(0, K, step):
        lp_CV = torch.log_softmax(logits_KV[a:a + step].float(), dim=-1)
        if s.logprobs:
            lp_parts.append(lp_CV.gather(1, tokens_K[a:a + step, None]).squeeze(1))
        if s.topk:
            vals, ids = lp_CV.topk(min(s.topk, V), dim=-1)  # sorted: most likely first
            top_vals.append(vals)
            top_ids.append(ids)
        if len(cells_C):
            here = (cell_pos_C >= a) & (cell_pos_C < a + step)
            cells_C[here] = lp_CV[cell_pos_C[here] - a, cell_ids_C[here]]
    skip = first - lo  # positions scored only for target cells before `first`
    logprobs = tuple(torch.cat(lp_parts)[skip:].tolist()) if s.logprobs else ()
    topk = ()
    if s.topk:
        ids, vals = torch.cat(top_ids)[skip:].tolist(), torch.cat(top_vals)[skip:].tolist()
        topk = tuple(tuple(zip(i, v)) for i, v in zip(ids, vals))
    return PromptScores(first, logprobs, topk, tuple(cells_C.tolist()))
