"""Every family of the fast path against Hugging Face, and against a Llama of the same shape.

    python -m benchmarks.architectures [--hidden 512 --layers 8 --heads 8 --kv-heads 2
                                        --intermediate 1536 --vocab 16384] [--families llama3,qwen2,...]

Each family is a random-weight model built from transformers' own config class (no download),
of the same dimensions as a default-RoPE Llama (`llama`) built the same way; each carries what
sets it apart: `llama3` Llama 3.1's RoPE scaling, `qwen2` q/k/v biases (Qwen2.5's rope theta),
`qwen3` q/k RMSNorm and tied embeddings, `mistral` a 4096-token sliding window (Mistral 7B
v0.1's; it does not bind at these lengths, so the windowed path runs at the Llama's cost),
`qwen3_5` the hybrid: three Gated DeltaNet layers to each gated full-attention one (`_qwen3_5`;
its adapters also cover the DeltaNet layers' linears). Per family, on this CPU:

- `greedy_equal`: the sampler's greedy tokens equal HF `generate`'s (6 prompts of 3-20 tokens,
  16 new tokens), fp32; `greedy_equal_bf16` the same in bf16 (reported);
- `logprobs_max_diff`: the sampler's logprobs of those tokens against the HF forward over prompt
  and completion, fp32 (goal <= 1e-5); `logprobs_max_diff_bf16` (reported);
- `mixed_equal_solo`: rows of 4 LoRA adapters (ranks 4-16, every linear and the output layer) in
  one batch give each adapter's tokens and logprobs exactly as it samples alone;
- `fast_path`: the lean decoder, mixed-adapter batches and prompt sharing in training all take it
  (`decode_fast`, `mixed_fast`, `train_prefix_shared` say which);
- `speed_vs_llama`: decode tokens/s at batch 16 (32-token prompts, 64 new tokens, no stop), fp32,
  over the Llama's (goal >= 0.9); best of `--reps` calls each, the families interleaved. By
  default with one torch thread, timed by the thread's CPU time (`_clock`: on a shared machine
  the wall clock measures the neighbours); `--threads 2` times the wall clock;
- `tinker_step_vs_llama`: the seconds of a Tinker `forward_backward` (`Learner.
  tinker_forward_backward`, importance sampling, LoRA rank 8 on every linear and the output
  layer) over 4 groups of 4 samples that share a 64-token prompt, over the Llama's (goal <= 1.15).

Last line: JSON {family: {those keys, tokens_per_s, step_s (by the ratios' clock), tokens_per_s_wall,
step_s_wall}, "llama": {the same four}, "dims": {...}, "threads": n, "clock": "cpu" or "wall"}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

PAD = 3
"""The tiny tokenizer's pad id (its vocabulary fits every test config)."""
FAMILIES = ("llama3", "qwen2", "qwen3", "mistral", "qwen3_5")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""Llama 3.1's RoPE parameters."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
DELTA_NET_TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
"""Qwen3.5's Gated DeltaNet layers' linears, adapted beside the attention ones."""


def targets_for(config) -> list[str]:
    """Every linear of a model of `config` and its output layer."""
    hybrid = "linear_attention" in (getattr(config, "layer_types", None) or ())
    return TARGETS + DELTA_NET_TARGETS if hybrid else list(TARGETS)


@dataclasses.dataclass(frozen=True)
class Dims:
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1536
    vocab: int = 16384
    head_dim: int | None = None
    """None: hidden / heads."""


def family_config(name: str, dims: Dims, **overrides):
    """A config of family `name` ('llama' is the default-RoPE Llama) from transformers' class."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3_5TextConfig, Qwen3Config

    common = dict(vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
                  num_hidden_layers=dims.layers, num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
                  head_dim=dims.head_dim or dims.hidden // dims.heads, max_position_embeddings=16384,
                  pad_token_id=PAD, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    family = {
        "llama": (LlamaConfig, {}),
        "llama3": (LlamaConfig, {"rope_parameters": dict(LLAMA3_ROPE)}),
        "qwen2": (Qwen2Config, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
        "qwen3": (Qwen3Config, {"tie_word_embeddings": True}),
        "mistral": (MistralConfig, {"sliding_window": 4096}),
        "qwen3_5": (Qwen3_5TextConfig, _qwen3_5(dims)),
    }
    if name not in family:
        raise ValueError(f"family {name!r} is not one of {', '.join(family)}")
    cls, own = family[name]
    return cls(**{**common, **own, **overrides})


def _qwen3_5(dims: Dims) -> dict:
    """Qwen3.5's differences at `dims`: three Gated DeltaNet layers to each full-attention one
    (its default `layer_types`) with as many key heads as the Llama's kv heads and a value head per
    query head (so in_proj q|k|v is the Llama's q|k|v), a quarter-head rotary split over
    (text, height, width) as its checkpoints set it, tied embeddings."""
    head_dim = dims.head_dim or dims.hidden // dims.heads
    half = int(head_dim * 0.25) // 2
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [half - 2 * (half // 4), half // 4, half // 4], "mrope_interleaved": True}
    return {"tie_word_embeddings": True, "rope_parameters": rope, "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim, "linear_num_key_heads": dims.kv_heads,
            "linear_num_value_heads": dims.heads}


def build_model(config, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random-weight causal LM of `config`, seeded, in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()


def prompts(vocab: int, lengths=(3, 11, 7, 20, 1, 14), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, rows: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF `generate`'s greedy continuations of left-padded `rows`."""
    L = max(len(p) for p in rows)
    ids = torch.full((len(rows), L), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD)
    return out[:, L:].tolist()


@torch.no_grad()
def forward_logprobs(model, prompt: list[int], tokens) -> torch.Tensor:
    """The HF forward's fp32 logprobs of `tokens` after `prompt`."""
    logits = model(input_ids=torch.tensor([list(prompt) + list(tokens)])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(list(tokens))[:, None]).squeeze(1)


def against_hf(model, max_new_tokens: int = 16) -> tuple[bool, float]:
    """(greedy tokens equal HF `generate`'s, largest |logprob - HF forward's|) on `prompts`."""
    from tinker_pipelines.rollout.sampler import Sampler

    rows = prompts(model.config.vocab_size)
    ours = Sampler(model, PAD, []).sample(rows, max_new_tokens, temperature=0.0)
    equal = [list(s.tokens) for s in ours] == hf_greedy(model, rows, max_new_tokens)
    worst = max((forward_logprobs(model, p, s.tokens) - torch.tensor(s.logprobs)).abs().max().item()
                for p, s in zip(rows, ours))
    return equal, worst


def add_adapters(model, ranks=(4, 8, 8, 16), seed: int = 3):
    """`model` inside PEFT with one adapter per rank (`a0`, `a1`, ...) on every linear and the
    output layer, each with a random, distinct B (a fresh B is zero: no delta to test)."""
    from peft import LoraConfig, get_peft_model

    peft = None
    for i, r in enumerate(ranks):
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets_for(model.config), lora_dropout=0.0)
        if peft is None:
            peft = get_peft_model(model, cfg, adapter_name=f"a{i}")
        else:
            peft.add_adapter(f"a{i}", cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05)
    return peft.eval()


def mixed_and_solo(peft, n_adapters: int, max_new_tokens: int = 12):
    """Each adapter's samples from one mixed batch of `n_adapters` requests, and alone."""
    from tinker_pipelines.rollout.sampler import Sampler, SampleRequest

    rows = prompts(peft.get_base_model().config.vocab_size, lengths=(5, 9, 17, 4))
    sampler = Sampler(peft, PAD, [])

    def request(k: int) -> SampleRequest:
        return SampleRequest(rows[k % 2:], max_new_tokens, 1.0, torch.Generator().manual_seed(10 + k), f"a{k}")

    mixed = sampler.sample_requests([request(k) for k in range(n_adapters)])
    alone = [sampler.sample_requests([request(k)])[0] for k in range(n_adapters)]
    return sampler, mixed, alone


def _clock() -> tuple[float, float]:
    """(wall, CPU) seconds now. With one torch thread every matmul runs on the calling thread,
    so its CPU time is the work alone: on a machine shared with other jobs the wall clock
    measures them too (2 cores at load 8-13 gave ratios from 0.9 to 3.1 between identical models)."""
    return time.perf_counter(), time.thread_time()


def _elapsed(t0: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - t0[0], cpu - t0[1]


def _decode_seconds(model, batch: int = 16, prompt_len: int = 32, new: int = 64) -> tuple[float, float]:
    from tinker_pipelines.rollout.sampler import Sampler

    rows = prompts(model.config.vocab_size, lengths=(prompt_len,) * batch, seed=5)
    sampler = Sampler(model, PAD, [])
    t0 = _clock()
    sampler.sample(rows, new, 1.0, torch.Generator().manual_seed(0))
    return _elapsed(t0)


def tinker_datums(vocab: int, groups: int = 4, per_group: int = 4, prompt_len: int = 64, seed: int = 0):
    """A recipe's RL step as the learner takes it: groups of samples of one prompt, advantage 0 on
    the prompt, the sampler's logprobs on the replies."""
    from tinker_pipelines.algorithms.tinker_losses import datum_from_tinker, tinker_loss

    g = torch.Generator().manual_seed(seed)
    loss = tinker_loss("importance_sampling")
    out = []
    for k in range(groups):
        prompt = torch.randint(5, vocab, (prompt_len,), generator=g).tolist()
        for j in range(per_group):
            reply = torch.randint(5, vocab, (16 + 4 * j,), generator=g).tolist()
            tokens = prompt + reply
            n = len(tokens) - 1
            adv = [0.0] * (prompt_len - 1) + [float(j % 3) - 0.8] * len(reply)
            lp = [0.0] * (prompt_len - 1) + (-torch.rand(len(reply), generator=g) * 2).tolist()
            out.append(datum_from_tinker(tokens[:-1], {"target_tokens": tokens[1:], "logprobs": lp[:n],
                                                       "advantages": adv[:n]}, loss=loss))
    return out, loss


def tinker_learner(model, share_prefix: bool = True, rank: int = 8, seed: int = 0):
    from tinker_pipelines.training.learner import Learner, LearnerConfig

    cfg = LearnerConfig(mode="lora", lora_rank=rank, lora_alpha=32.0, lora_targets=tuple(targets_for(model.config)),
                        share_prefix=share_prefix, learning_rate=1e-3)
    return Learner(model, cfg, PAD, adapter_name="bench", init_seed=seed)


def _step_seconds(learner, datums, loss) -> tuple[float, float]:
    t0 = _clock()
    learner.tinker_forward_backward(datums, loss)
    elapsed = _elapsed(t0)
    learner.optimizer.zero_grad(set_to_none=True)
    return elapsed


def _correctness(name: str, dims: Dims) -> dict:
    from tinker_pipelines.rollout.lean_decoder import LeanDecoder
    from tinker_pipelines.training.prefix_sharing import supports_prefix_sharing

    config = family_config(name, dims)
    out = {}
    for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
        model = build_model(config, dtype=dtype)
        out[f"greedy_equal{suffix}"], out[f"logprobs_max_diff{suffix}"] = against_hf(model)
    model = build_model(config)
    peft = add_adapters(model)
    sampler, mixed, alone = mixed_and_solo(peft, 4)
    out["mixed_equal_solo"] = all([(s.tokens, s.logprobs) for s in m] == [(s.tokens, s.logprobs) for s in a]
                                  for m, a in zip(mixed, alone))
    out["decode_fast"] = LeanDecoder.why_not(model) is None
    out["mixed_fast"] = sampler.supports_mixed_adapters()
    out["train_prefix_shared"] = supports_prefix_sharing(peft)
    out["fast_path"] = out["decode_fast"] and out["mixed_fast"] and out["train_prefix_shared"]
    return out


def _speeds(names: list[str], dims: Dims, reps: int, clock: int) -> dict[str, dict]:
    """Decode tokens/s and Tinker step seconds per family, best of `reps`, interleaved (each rep
    in another order), by wall clock and by CPU time (`_clock`); `clock` picks which the ratios use."""
    models = {n: build_model(family_config(n, dims)) for n in names}
    learners = {n: tinker_learner(build_model(family_config(n, dims))) for n in names}
    datums, loss = tinker_datums(dims.vocab)
    for n in names:  # warm-up: first-call checks of the linear forms, allocator
        _decode_seconds(models[n], new=4)
        _step_seconds(learners[n], datums, loss)
    decode = {n: [float("inf")] * 2 for n in names}
    step = {n: [float("inf")] * 2 for n in names}
    for r in range(reps):
        for n in (names if r % 2 == 0 else names[::-1]):
            decode[n] = [min(a, b) for a, b in zip(decode[n], _decode_seconds(models[n]))]
            step[n] = [min(a, b) for a, b in zip(step[n], _step_seconds(learners[n], datums, loss))]
    return {n: {"tokens_per_s": round(16 * 64 / decode[n][clock], 1), "step_s": round(step[n][clock], 4),
                "tokens_per_s_wall": round(16 * 64 / decode[n][0], 1), "step_s_wall": round(step[n][0], 4)}
            for n in names}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Dims):
        if f.name != "head_dim":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--parts", default="correctness,speed", help="correctness, speed or both (comma-separated)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; with 1 (the default) the ratios use CPU time, else the wall clock")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> dict:
    dims = Dims(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Dims) if f.name != "head_dim"})
    names = [n for n in args.families.split(",") if n]
    result: dict = {"dims": dataclasses.asdict(dims), "threads": args.threads,
                    "clock": "cpu" if args.threads == 1 else "wall"}
    parts = set(args.parts.split(","))
    for n in names:
        result[n] = _correctness(n, dims) if "correctness" in parts else {}
        print(n, json.dumps(result[n]), flush=True)
    if "speed" not in parts:
        print(json.dumps(result))
        return result
    speeds = _speeds(["llama", *names], dims, args.reps, clock=1 if args.threads == 1 else 0)
    result["llama"] = speeds["llama"]
    for n in names:
        result[n].update(speeds[n])
        result[n]["speed_vs_llama"] = round(speeds[n]["tokens_per_s"] / speeds["llama"]["tokens_per_s"], 3)
        result[n]["tinker_step_vs_llama"] = round(speeds[n]["step_s"] / speeds["llama"]["step_s"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
