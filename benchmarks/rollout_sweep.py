"""Parts of `benchmarks.rollout` on SmolLM2: a batch-size sweep against HF `generate`, and greedy
agreement with it.

- Sweep: for each batch size, prompts that ask for prose (rows mostly decode all
  `max_new_tokens`, so the figure is decode speed, not prefill), temperature 1.0 over the full
  vocabulary, ours and HF interleaved after one warm-up each; tokens counted up to each row's
  first stop token. Peak fraction = 2 x parameters x tokens/s over the fp32 matmul peak measured
  in the same process. Plotted to a PNG (tokens/s and peak fraction against batch size).
- Ceiling: for each batch size, the decode step's weight matmuls alone, each the faster of torch's
  `x @ W^T` and `(W @ x^T)^T`, with the projections our decoder fuses fused (q/k/v, gate/up), and
  timed in one pass over all the weights per form (each weight read from memory, as in decode):
  torch's own kernels at that row count, without attention, sampling or Python. Its peak fraction bounds what any decoder built on those kernels reaches.
- Greedy: the same prompts at temperature 0 through our sampler and `generate(do_sample=False)`
  with its raw logits: every row's tokens must be equal, and our reported logprobs (log_softmax
  at temperature 1 of the chosen token) are compared with HF's; where a row differs, HF's logit
  margin at the first differing step says whether it was a near-tie.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tinker_pipelines.models import encode_chat, stop_token_ids
from tinker_pipelines.rollout.sampler import Sampler

TOPICS = ["a lighthouse", "the sea", "a mountain village", "a clockmaker", "winter", "a library", "rain", "a train"]


def prose_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts asking for a short story (uneven lengths)."""
    return [encode_chat(tokenizer, [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."
                                                                + " Make it vivid." * (i % 3)}]) for i in range(n)]


def left_padded(tokenizer, prompts: list[list[int]], device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids, attention mask, prompt length) of the prompts left-padded into one batch for `generate`."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    return ids.to(device), mask.to(device), L


def _until_stop(row: list[int], stops: set[int]) -> list[int]:
    for j, t in enumerate(row):
        if t in stops:
            return row[:j + 1]
    return row


def sweep(model, tokenizer, batches: list[int], max_new_tokens: int, peak_gflops: float) -> list[dict]:
    """Ours vs HF `generate` tokens/s at each batch size (one timed call each, after a warm-up),
    on the model's device and dtype."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    stops = stop_token_ids(tokenizer)
    sampler = Sampler(model, tokenizer.pad_token_id, stops)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    with torch.inference_mode():
        for B in batches:
            prompts = prose_prompts(tokenizer, B)
            ids, mask, L = left_padded(tokenizer, prompts, model.device)
            kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=stops,
                          pad_token_id=tokenizer.pad_token_id)
            sampler.sample(prompts, 2, 1.0, torch.Generator().manual_seed(0))  # warm-up
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, **kwargs)
            sync()
            start = time.perf_counter()
            ours = sum(len(s.tokens) for s in sampler.sample(prompts, max_new_tokens, 1.0,
                                                             torch.Generator().manual_seed(1)))
            ours_s = time.perf_counter() - start
            torch.manual_seed(1)
            sync()
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, **kwargs)
            sync()
            hf_s = time.perf_counter() - start
            hf = sum(len(_until_stop(r, set(stops))) for r in out[:, L:].tolist())
            o, h = ours / ours_s, hf / hf_s
            rows.append({"batch": B, "ours_tok_s": round(o, 1), "hf_tok_s": round(h, 1), "ratio": round(o / h, 3),
                         "peak_fraction": round(2 * params * o / 1e9 / peak_gflops, 4),
                         "hf_peak_fraction": round(2 * params * h / 1e9 / peak_gflops, 4),
                         "tokens": [ours, hf]})
            print(f"  sweep batch {B}: ours {o:.0f} tok/s, HF {h:.0f} tok/s", flush=True)
    return rows


def step_weights(model) -> list[torch.Tensor]:
    """The weights one decode step multiplies, fused as our decoder fuses them (Llama-shaped
    models; otherwise every `Linear`'s weight), the output layer last."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    try:
        out = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            out += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight]
        return out + [model.get_output_embeddings().weight]
    except (AttributeError, TypeError):
        return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


def matmul_ceiling(model, batches: list[int], peak_gflops: float, repeats: int = 3) -> dict[int, float]:
    """Batch size -> fraction of the peak that the decode step's weight matmuls alone reach
    (`step_weights`; per weight the faster of the two product forms, fastest of `repeats`). Each
    form runs in a pass over all the weights, so a weight is not timed right after it was read."""
    weights = [w.detach() for w in step_weights(model)]
    out = {}
    with torch.inference_mode():
        for B in batches:
            x = torch.randn(B, max(w.shape[1] for w in weights), dtype=weights[0].dtype, device=weights[0].device)
            forms = [lambda w, x=x: x[:, :w.shape[1]] @ w.t(), lambda w, x=x: (w @ x[:, :w.shape[1]].t()).t()]
            best_s = [[float("inf")] * len(forms) for _ in weights]
            for _ in range(repeats + 1):  # the first round warms up
                for f, form in enumerate(forms):  # a pass per form: each weight comes from memory, as in decode
                    for i, w in enumerate(weights):
                        start = time.perf_counter()
                        form(w)
                        best_s[i][f] = min(best_s[i][f], time.perf_counter() - start)
            flops = 2 * B * sum(w.numel() for w in weights)
            out[B] = round(flops / sum(min(b) for b in best_s) / 1e9 / peak_gflops, 4)
    return out


def greedy_agreement(model, tokenizer, batch: int, max_new_tokens: int) -> dict:
    """Our greedy decode vs `generate(do_sample=False)` on the model's device and dtype.

    `identical`: every row's tokens equal. `max_logprob_diff`: our reported logprobs against
    HF's over each row's common prefix (the tokens before the rows first differ). For each row
    that differs, `divergence_margins` holds HF's logit of its own token minus its logit of ours
    at the first differing step: a margin within the dtype's rounding is a near-tie that both
    decoders may break either way (random-weight models have many), a large one a real bug."""
    stops = stop_token_ids(tokenizer)
    prompts = prose_prompts(tokenizer, batch)
    ids, mask, L = left_padded(tokenizer, prompts, model.device)
    with torch.inference_mode():
        ours = Sampler(model, tokenizer.pad_token_id, stops).sample(prompts, max_new_tokens, 0.0)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stops, pad_token_id=tokenizer.pad_token_id, output_logits=True,
                             return_dict_in_generate=True)
    logits_TBV = torch.stack(out.logits).float().cpu()  # raw logits of every generated position
    diff, compared, margins = 0.0, 0, []
    for b, s in enumerate(ours):
        hf_tokens = _until_stop(out.sequences[b, L:].tolist(), set(stops))
        mine = list(s.tokens)
        n = next((j for j, (x, y) in enumerate(zip(mine, hf_tokens)) if x != y), min(len(mine), len(hf_tokens)))
        if mine != hf_tokens and n < min(len(mine), len(hf_tokens)):
            margins.append(float(logits_TBV[n, b, hf_tokens[n]] - logits_TBV[n, b, mine[n]]))
        elif mine != hf_tokens:  # one stopped where the other went on
            margins.append(float("inf"))
        hf_lp = torch.log_softmax(logits_TBV[:n, b], dim=-1).gather(1, torch.tensor(hf_tokens[:n])[:, None]).squeeze(1)
        diff = max(diff, float((torch.tensor(s.logprobs[:n]) - hf_lp).abs().max()) if n else 0.0)
        compared += n
    return {"identical": not margins, "max_logprob_diff": diff, "tokens": compared, "rows": len(ours),
            "rows_differing": len(margins), "divergence_margins": [round(m, 5) for m in margins]}


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """Tokens/s and peak fraction against batch size; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    batches = [r["batch"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(batches, [r["ours_tok_s"] for r in rows], "o-", label="ours")
    a.plot(batches, [r["hf_tok_s"] for r in rows], "s--", label="HF generate")
    a.set(xscale="log", xlabel="batch size", ylabel="tokens/s", title="decode throughput")
    b.plot(batches, [r["peak_fraction"] for r in rows], "o-", label="ours")
    b.plot(batches, [r["hf_peak_fraction"] for r in rows], "s--", label="HF generate")
    b.set(xscale="log", xlabel="batch size", ylabel="fraction of fp32 matmul peak", title="peak fraction")
    for ax in (a, b):
        ax.minorticks_off()
        ax.set_xticks(batches, [str(x) for x in batches])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
