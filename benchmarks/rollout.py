"""Rollout throughput: our sampler vs plain Hugging Face `generate`, and batched multi-turn
episodes vs a per-episode loop.

    python -m benchmarks.rollout [--skip-smollm2] [--batch 16] [--new-tokens 64] [--repeats 3]

1. Single turn, per model (`tiny`, `smollm2-135m-instruct`): the same batch of chat prompts
   (uneven lengths), temperature 1.0, full-vocabulary sampling (HF: do_sample=True, top_k=0,
   top_p=1.0), the same max_new_tokens and stop tokens. Generated tokens are counted honestly:
   each row's tokens up to and including its first stop token (HF keeps padding finished rows;
   those pads are not counted). The two run interleaved, `--repeats` times each, after one
   warm-up call each; throughput is total tokens / total seconds.
2. Multi-turn on `tiny` (the figure) and, for reference, half as many episodes once on SmolLM2
   (`guess_number`, episodes of uneven length: 2..6 guesses allowed, replies end at
   a stop token or max_new_tokens): `run_episodes` (all episodes batched across turns) vs the
   loop a user would write: one episode at a time, `model.generate` per turn on the re-rendered
   chat. Same model, sampling settings and token counting.
3. Decode FLOP/s ~= 2 x parameters x tokens/s (one multiply-add per weight per token; ignores
   attention over the KV cache and the embedding lookup, counts a tied lm_head once), as a
   fraction of the best torch fp32 matmul rate measured in this process.
4. On SmolLM2 (`benchmarks.rollout_sweep`): a sweep over batch sizes (`--sweep`, default
   1,4,16,64,128; prose prompts, so rows decode their whole `--sweep-tokens`) against HF
   `generate`, printed and plotted to `--plot`; and greedy agreement with `generate`
   (identical tokens, largest logprob difference).

The last line is one JSON object: ratio_tiny, ratio_smollm2, ratio_multiturn, peak_fraction,
ratio_smollm2_b64, peak_fraction_b64, sweep, matmul_ceiling (batch -> peak fraction of the decode step's
weight matmuls alone: `rollout_sweep.matmul_ceiling`), greedy_identical, greedy_max_logprob_diff.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks import rollout_sweep
from tinker_pipelines.envs.guess_number import GuessNumberEnv
from tinker_pipelines.models import encode_chat, load_model, stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, run_episodes
from tinker_pipelines.rollout.sampler import Sampler


def matmul_peak_gflops(n: int = 1536, repeats: int = 5) -> float:
    """Best fp32 GFLOP/s of an n x n @ n x n torch matmul over `repeats` runs."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts of uneven length (1 to 4 sentences of question)."""
    prompts = []
    for i in range(n):
        extra = " Think about it." * (i % 4)
        messages = [{"role": "system", "content": "Answer with a single number and nothing else."},
                    {"role": "user", "content": f"What is {i % 10} + {(3 * i) % 10}?{extra}"}]
        prompts.append(encode_chat(tokenizer, messages))
    return prompts


def _hf_kwargs(model, tokenizer, stops: list[int], max_new_tokens: int) -> dict:
    return dict(max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)


def _count_until_stop(rows: list[list[int]], stops: set[int]) -> int:
    total = 0
    for row in rows:
        n = len(row)
        for j, t in enumerate(row):
            if t in stops:
                n = j + 1
                break
        total += n
    return total


def hf_generate_batch(model, tokenizer, prompts: list[list[int]], stops: list[int], max_new_tokens: int,
                      seed: int) -> int:
    """Plain `generate` on the left-padded batch; returns the generated tokens counted honestly."""
    ids, mask, L = rollout_sweep.left_padded(tokenizer, prompts)
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, **_hf_kwargs(model, tokenizer, stops, max_new_tokens))
    return _count_until_stop(out[:, L:].tolist(), set(stops))


def single_turn(name: str, model, tokenizer, batch: int, max_new_tokens: int, repeats: int) -> dict:
    stops = stop_token_ids(tokenizer)
    prompts = chat_prompts(tokenizer, batch)
    sampler = Sampler(model, tokenizer.pad_token_id, stops)
    ours_tok = ours_s = hf_tok = hf_s = 0.0
    with torch.inference_mode():
        sampler.sample(prompts, 4, 1.0, torch.Generator().manual_seed(0))  # warm-up
        hf_generate_batch(model, tokenizer, prompts, stops, 4, 0)
        for r in range(repeats):  # interleaved
            start = time.perf_counter()
            samples = sampler.sample(prompts, max_new_tokens, 1.0, torch.Generator().manual_seed(r))
            ours_s += time.perf_counter() - start
            ours_tok += sum(len(s.tokens) for s in samples)
            start = time.perf_counter()
            hf_tok += hf_generate_batch(model, tokenizer, prompts, stops, max_new_tokens, r)
            hf_s += time.perf_counter() - start
    ours, hf = ours_tok / ours_s, hf_tok / hf_s
    return {"model": name, "ours_tok_s": ours, "hf_tok_s": hf, "ratio": ours / hf,
            "ours_tokens": int(ours_tok), "hf_tokens": int(hf_tok),
            "params": sum(p.numel() for p in model.parameters())}


def _envs(n: int) -> tuple[list[GuessNumberEnv], list[int]]:
    return [GuessNumberEnv(1, 16, max_guesses=2 + i % 5) for i in range(n)], list(range(n))


def per_episode_loop(model, tokenizer, n: int, max_new_tokens: int, seed: int) -> tuple[int, int]:
    """What a user would write: one episode at a time, `generate` per turn. (tokens, turns)"""
    stops = stop_token_ids(tokenizer)
    kwargs = _hf_kwargs(model, tokenizer, stops, max_new_tokens)
    torch.manual_seed(seed)
    tokens = turns = 0
    envs, seeds = _envs(n)
    for env, s in zip(envs, seeds):
        messages = list(env.reset(s))
        while True:
            ids = torch.tensor([encode_chat(tokenizer, messages)])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)[0, ids.shape[1]:]
            reply = out.tolist()
            n_tok = _count_until_stop([reply], set(stops))
            tokens, turns = tokens + n_tok, turns + 1
            action = tokenizer.decode(reply[:n_tok], skip_special_tokens=True)
            result = env.step(action)
            if result.done:
                break
            messages += [{"role": "assistant", "content": action}, *result.observation]
    return tokens, turns


def multi_turn(name: str, model, tokenizer, n: int, max_new_tokens: int, repeats: int) -> dict:
    stops = stop_token_ids(tokenizer)
    sampler = Sampler(model, tokenizer.pad_token_id, stops)
    cfg = RolloutConfig(max_new_tokens=max_new_tokens, temperature=1.0, max_turns=10)
    ours_tok = ours_s = loop_tok = loop_s = 0.0
    ours_turns = loop_turns = 0
    with torch.inference_mode():
        for r in range(repeats):
            envs, seeds = _envs(n)
            start = time.perf_counter()
            trajs = run_episodes(sampler, tokenizer, envs, seeds, cfg, torch.Generator().manual_seed(r))
            ours_s += time.perf_counter() - start
            ours_tok += sum(len(t.sampled_tokens) for traj in trajs for t in traj.turns)
            ours_turns += sum(len(traj.turns) for traj in trajs)
            start = time.perf_counter()
            tok, turns = per_episode_loop(model, tokenizer, n, max_new_tokens, r)
            loop_s += time.perf_counter() - start
            loop_tok, loop_turns = loop_tok + tok, loop_turns + turns
    ours, loop = ours_tok / ours_s, loop_tok / loop_s
    return {"model": name, "episodes": n * repeats, "ours_tok_s": ours, "loop_tok_s": loop, "ratio": ours / loop,
            "ours_turns": ours_turns, "loop_turns": loop_turns, "ours_s": ours_s, "loop_s": loop_s}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-smollm2", action="store_true", help="only the tiny model (quick)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=16, help="multi-turn episodes per repeat")
    parser.add_argument("--turn-tokens", type=int, default=16, help="max_new_tokens per multi-turn turn")
    parser.add_argument("--skip-multiturn-smollm2", action="store_true",
                        help="multi-turn on tiny only (the SmolLM2 reference row takes ~1-2 minutes)")
    parser.add_argument("--sweep", default="1,4,16,64,128", help="SmolLM2 batch sizes to sweep ('': none)")
    parser.add_argument("--sweep-tokens", type=int, default=32, help="max_new_tokens of each sweep call")
    parser.add_argument("--plot", default="runs/benchmarks/rollout_sweep.png", help="where the sweep's PNG goes")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, or 1 when other jobs keep the cores busy)")
    args = parser.parse_args(argv)
    note = ""
    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        load = os.getloadavg()[0]
        if torch.get_num_threads() > 1 and load >= 1.0:
            # OpenMP threads that wait for a busy core stall every op: 2 threads then run both
            # samplers ~10-20x slower and the comparison measures the other jobs.
            torch.set_num_threads(1)
            note = f" (load average {load:.1f} from other jobs: 1 thread; --threads overrides)"
    started = time.perf_counter()
    peak = matmul_peak_gflops()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads{note}; "
          f"fp32 matmul peak {peak:.1f} GFLOP/s", flush=True)

    rows, decode = [], {}
    names = ["tiny"] + ([] if args.skip_smollm2 else ["smollm2-135m-instruct"])
    multis, swept, greedy, ceiling = [], [], None, {}
    batches = [int(x) for x in args.sweep.split(",") if x.strip()]
    for name in names:
        model, tok = load_model(name)
        if name != "tiny":
            greedy = rollout_sweep.greedy_agreement(model, tok, 8, args.sweep_tokens)
            print(f"  greedy vs HF generate: identical {greedy['identical']}, largest logprob difference "
                  f"{greedy['max_logprob_diff']:.2e} over {greedy['tokens']} tokens", flush=True)
            swept = rollout_sweep.sweep(model, tok, batches, args.sweep_tokens, peak) if batches else []
            ceiling = rollout_sweep.matmul_ceiling(model, sorted(set(batches) | {args.batch}), peak)
            for r in swept:
                r["matmul_ceiling_fraction"] = ceiling[r["batch"]]
        row = single_turn(name, model, tok, args.batch, args.new_tokens, args.repeats)
        rows.append(row)
        print(f"  {name}: ours {row['ours_tok_s']:.0f} tok/s, HF {row['hf_tok_s']:.0f} tok/s", flush=True)
        decode[name] = 2 * row["params"] * row["ours_tok_s"] / 1e9
        if name == "tiny" or not args.skip_multiturn_smollm2:
            # the figure is on tiny; SmolLM2 (one repeat: its per-episode loop is slow) for reference
            n, reps = (args.episodes, args.repeats) if name == "tiny" else (max(4, args.episodes // 2), 1)
            m = multi_turn(name, model, tok, n, args.turn_tokens, reps)
            multis.append(m)
            print(f"  multi-turn {name}: ours {m['ours_tok_s']:.0f} tok/s, loop {m['loop_tok_s']:.0f}"
                  " tok/s", flush=True)
        del model

    print()
    print(f"single turn, batch {args.batch}, temperature 1.0, max_new_tokens {args.new_tokens}, "
          f"{args.repeats} interleaved repeats")
    print(f"{'model':<24}{'ours tok/s':>12}{'HF tok/s':>12}{'ratio':>8}{'tokens ours/HF':>18}"
          f"{'GFLOP/s':>10}{'of peak':>9}")
    for row in rows:
        gf = decode[row["model"]]
        print(f"{row['model']:<24}{row['ours_tok_s']:>12.0f}{row['hf_tok_s']:>12.0f}{row['ratio']:>8.2f}"
              f"{str(row['ours_tokens']) + '/' + str(row['hf_tokens']):>18}{gf:>10.1f}{gf / peak:>9.1%}")
    print(f"\nmulti-turn guess_number, episodes of 2-6 guesses, max_new_tokens {args.turn_tokens}/turn, "
          "batched run_episodes vs per-episode generate loop")
    print(f"{'model':<24}{'episodes':>9}{'ours tok/s':>12}{'loop tok/s':>12}{'ratio':>8}{'turns ours/loop':>17}"
          f"{'seconds ours/loop':>19}")
    for m in multis:
        turns = f"{m['ours_turns']}/{m['loop_turns']}"
        secs = f"{m['ours_s']:.1f}/{m['loop_s']:.1f}"
        print(f"{m['model']:<24}{m['episodes']:>9}{m['ours_tok_s']:>12.0f}{m['loop_tok_s']:>12.0f}{m['ratio']:>8.2f}"
              f"{turns:>17}{secs:>19}")
    if swept:
        print(f"\nSmolLM2 sweep: temperature 1.0, prose prompts, max_new_tokens {args.sweep_tokens}, one timed call each")
        print(f"{'batch':>6}{'ours tok/s':>12}{'HF tok/s':>12}{'ratio':>8}{'ours of peak':>14}{'HF of peak':>12}"
              f"{'torch matmuls alone':>21}")
        for r in swept:
            print(f"{r['batch']:>6}{r['ours_tok_s']:>12.0f}{r['hf_tok_s']:>12.0f}{r['ratio']:>8.2f}"
                  f"{r['peak_fraction']:>14.1%}{r['hf_peak_fraction']:>12.1%}{r['matmul_ceiling_fraction']:>21.1%}")
        print("(torch matmuls alone: a decode step's weight products alone, fused as our decoder fuses them, "
              "each in torch's faster form: the peak fraction any decoder on torch's kernels stays under)")
        png = rollout_sweep.plot(swept, Path(args.plot), f"SmolLM2-135M-Instruct, fp32, {torch.get_num_threads()} "
                                 f"thread(s), peak {peak:.0f} GFLOP/s")
        print(f"plot: {png}" if png else "plot: matplotlib is not installed")
    multi = multis[0]
    peak_model = names[-1]
    print(f"\ndecode FLOP/s ~= 2 x params x tokens/s (matmuls only); peak fraction from {peak_model}; "
          f"total {time.perf_counter() - started:.0f} s")
    by_name = {r["model"]: r for r in rows}
    result = {
        "ratio_tiny": round(by_name["tiny"]["ratio"], 3),
        "ratio_smollm2": round(by_name["smollm2-135m-instruct"]["ratio"], 3) if "smollm2-135m-instruct" in by_name else None,
        "ratio_multiturn": round(multi["ratio"], 3),
        "peak_fraction": round(decode[peak_model] / peak, 4),
        "peak_gflops": round(peak, 1),
        "multiturn_model": multi["model"],
        "ratio_multiturn_smollm2": round(multis[1]["ratio"], 3) if len(multis) > 1 else None,
        "ratio_smollm2_b64": next((r["ratio"] for r in swept if r["batch"] == 64), None),
        "peak_fraction_b64": next((r["peak_fraction"] for r in swept if r["batch"] == 64), None),
        "sweep": [{k: r[k] for k in ("batch", "ours_tok_s", "hf_tok_s", "ratio", "peak_fraction",
                                     "matmul_ceiling_fraction")} for r in swept],
        "matmul_ceiling": {str(b): f for b, f in ceiling.items()},
        "greedy_identical": greedy["identical"] if greedy else None,
        "greedy_max_logprob_diff": greedy["max_logprob_diff"] if greedy else None,
        "batch": args.batch,
        "threads": torch.get_num_threads(),
        "load_average": round(os.getloadavg()[0], 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
