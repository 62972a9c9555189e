"""Drawing one token per row from a batch of logits: `sample_tokens`, the sampler's per-step draw
(greedy, temperature and top-k / top-p / min-p truncation, by inverting the CDF with one uniform
per row)."""

from __future__ import annotations

import torch

from tinker_pipelines.rollout.truncation import is_active, keep_mask


def sample_tokens(logits_BV: torch.Tensor, temperature: float | torch.Tensor,
                  generator: torch.Generator | None = None,
                  uniforms_B: torch.Tensor | None = None, *, top_k: int | torch.Tensor = 0,
                  top_p: float | torch.Tensor = 1.0,
                  min_p: float | torch.Tensor = 0.0, with_support: bool = False,
                  host_temperatures: list[float] | None = None, top_logprobs: int = 0) -> tuple[torch.Tensor, ...]:
    """Draw one token per row; return (tokens_B, logprobs_B), and with `with_support` also
    support_B: how many tokens the truncated distribution of each row kept (0 where nothing was
    truncated, greedy rows included), which the learner needs to renormalize exactly as the draw
    did (`truncation.top_n_logprobs`). Temperature 0 is greedy.

    `temperature`, `top_k`, `top_p` and `min_p` are one value or one per row (`truncation`:
    0 / 1.0 / 0.0 switch a row's truncation off). A sampled row draws from softmax(logits / T)
    truncated and renormalized, and its logprob is that distribution's; a greedy row takes the
    argmax (truncation cannot change it) and reports its logprob at temperature 1, untruncated.
    Sampling inverts the CDF with one uniform per row (cumsum + searchsorted), ~10x cheaper on
    CPU than `torch.multinomial` at vocab 8k+; the uniforms are `uniforms_B`, else drawn from
    `generator` on its own device and moved to the logits' device (so a CPU generator gives the
    same draws whatever device the model is on). The search is right-sided: a uniform of exactly
    0 picks the first token with probability mass, never a zero-probability one; a uniform whose
    scaled value rounds up to the total mass picks the last token with mass (not the last token).

    `host_temperatures`: the values of a per-row `temperature` tensor, as Python floats of its
    dtype (`tensor.tolist()`), when the caller has them: which rows are greedy is then read from
    them instead of from the device (no host sync per call on a GPU; the same branches).

    `top_logprobs` = K > 0 appends (top_logprobs_BK, top_ids_BK): each row's K most likely tokens
    under the very distribution its token was drawn from and its logprob reported in, most likely
    first (greedy rows: temperature 1, untruncated; a token outside a truncated row's support has
    -inf). So the sampled token, when among them, has exactly its `logprobs_B` value.
    """
    out = _draw(logits_BV.float(), temperature, generator, uniforms_B,
                (top_k, top_p, min_p) if is_active(top_k, top_p, min_p) else None, host_temperatures, top_logprobs)
    return (out[:3] if with_support else out[:2]) + (out[3:] if top_logprobs else ())


def _draw(logits_BV: torch.Tensor, temperature: float | torch.Tensor, generator: torch.Generator | None,
          uniforms_B: torch.Tensor | None, truncation: tuple | None, host_temperatures: list[float] | None = None,
          n_top: int = 0) -> tuple[torch.Tensor, ...]:
    B, V = logits_BV.shape
    if isinstance(temperature, torch.Tensor):
        temp_B = temperature.to(logits_BV.device, torch.float32)
        greedy_B = temp_B.eq(0)
        if host_temperatures is not None:
            if len(host_temperatures) != B:
                raise ValueError(f"host_temperatures has {len(host_temperatures)} values for {B} rows")
            any_greedy, all_greedy = 0 in host_temperatures, all(x == 0 for x in host_temperatures)
            all_one = all(x == 1 for x in host_temperatures)
        else:
            any_greedy = bool(greedy_B.any())
            all_greedy = any_greedy and bool(greedy_B.all())
            all_one = not any_greedy and bool(temp_B.eq(1).all())
        if not any_greedy:
            temperature = 1.0 if all_one else temp_B[:, None]
        elif all_greedy:
            temperature = 0.0
        else:
            scaled = logits_BV / torch.where(greedy_B, 1.0, temp_B)[:, None]
            return _invert_cdf(torch.log_softmax(scaled, dim=-1), generator, uniforms_B, greedy_B, truncation, n_top)
    if isinstance(temperature, (int, float)) and temperature == 0:
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
        tokens_B = logprobs_BV.argmax(dim=-1)
        top = logprobs_BV.topk(min(n_top, V), dim=-1) if n_top else ()
        return (tokens_B, logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1), torch.zeros_like(tokens_B), *top)
    scaled = logits_BV if isinstance(temperature, (int, float)) and temperature == 1 else logits_BV / temperature
    return _invert_cdf(torch.log_softmax(scaled, dim=-1), generator, uniforms_B, None, truncation, n_top)


def _invert_cdf(logprobs_BV: torch.Tensor, generator: torch.Generator | None, uniforms_B: torch.Tensor | None,
                greedy_B: torch.Tensor | None, truncation: tuple | None = None, n_top: int = 0
                ) -> tuple[torch.Tensor, ...]:
    B, V = logprobs_BV.shape
    if uniforms_B is None:
        device = generator.device if generator is not None else "cpu"
        uniforms_B = torch.rand(B, generator=generator, device=device)
    probs_BV = logprobs_BV.exp()
    support_B = torch.zeros(B, dtype=torch.long, device=logprobs_BV.device)
    if truncation is not None:  # the kept tokens' mass, renormalized through the CDF's total
        keep_BV = keep_mask(logprobs_BV, *truncation)
        if greedy_B is not None:
            keep_BV |= greedy_B[:, None]
        probs_BV = probs_BV * keep_BV
        support_B = keep_BV.sum(dim=-1)
        support_B = support_B.masked_fill(support_B.eq(V), 0)  # a row that kept everything was not truncated
    cdf_BV = probs_BV.cumsum(dim=-1)
    total_B1 = cdf_BV[:, -1:].contiguous()
    u_B1 = uniforms_B.to(logprobs_BV.device)[:, None] * total_B1
    tokens_B = torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(1)
    # u * total may round up to total (u the largest float below 1): the last token with mass,
    # the first one whose cumulative sum reaches the total (trailing tokens may have none)
    tokens_B = torch.minimum(tokens_B, torch.searchsorted(cdf_BV, total_B1).squeeze(1))
    if greedy_B is not None:
        tokens_B = torch.where(greedy_B, logprobs_BV.argmax(dim=-1), tokens_B)
    lp_B = logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
    if truncation is not None:  # log of the renormalized distribution (greedy rows: untruncated)
        renorm_B = lp_B - total_B1.squeeze(1).log()
        lp_B = renorm_B if greedy_B is None else torch.where(greedy_B, lp_B, renorm_B)
    if not n_top:
        return tokens_B, lp_B, support_B
    top_BK, ids_BK = logprobs_BV.topk(min(n_top, V), dim=-1)
    if truncation is not None:  # the same renormalization; dropped tokens have no mass
        shift_B1 = total_B1.log() if greedy_B is None else torch.where(greedy_B[:, None], 0.0, total_B1.log())
        top_BK = torch.where(keep_BV.gather(1, ids_BK), top_BK - shift_B1, float("-inf"))
    return tokens_B, lp_B, support_B, top_BK, ids_BK
