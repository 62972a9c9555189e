"""Does the policy learn? Held-out exact-answer rate before vs after RL.

    python -m benchmarks.learning                                   # tiny on `arithmetic`: SFT, then GRPO
    python -m benchmarks.learning --model smollm2-135m-instruct     # GRPO-LoRA on `repeat`, no SFT
    python -m benchmarks.learning --algorithm ppo                   # any registered RL algorithm
    python -m benchmarks.learning --algorithm dpo                   # tiny: SFT, then DPO on pairs from SFT rollouts
    python -m benchmarks.learning --algorithm rloo --sft-dir /tmp/sft_tiny   # SFT once, reuse it

`before` is the held-out rate of the starting checkpoint (the SFT checkpoint for tiny, the
base model for SmolLM2), `after` the rate after RL; both greedy, on tasks RL never trains on.
The last line is one JSON object. For clipped losses (ppo, grpo, dr_grpo) it carries each
iteration's `clip_fraction` of its last epoch (`clip_fraction_last_epoch`; PPO runs 4 epochs over
each rollout, so from the second on the behaviour policy is a step old and the clip acts), and
the update's `optim_steps` per iteration.

With `--sft-dir`, the tiny recipe's SFT checkpoint is written there the first time and loaded
from there afterwards (SFT is deterministic for a seed, so every algorithm starts from the same
weights); `minutes` then counts RL and evaluation only and the JSON says `"sft_reused": true`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from tinker_pipelines.algorithms.registry import get_algorithm
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.loops.train import train

TINY = {
    "model": {"name": "tiny"},
    "env": {"path": "arithmetic", "kwargs": {"max_operand": 9}},
    # Demonstrations that are right in content but mostly chatty ("The answer is 7."): the SFT
    # checkpoint knows the sums and RL must teach the bare-number format the reward asks for.
    "sft": {"steps": 500, "batch_size": 32, "learning_rate": 3e-3, "examples": 2000,
            "kwargs": {"verbose_fraction": 0.75}},
    "training": {"mode": "full", "iterations": 40, "learning_rate": 1e-4, "groups_per_batch": 16,
                 "group_size": 8, "max_new_tokens": 8},
    "eval": {"every": 10, "num_tasks": 200},
}

DPO = {"pairs": 128, "group_size": 8, "steps": 40, "batch_size": 16, "beta": 0.1}
"""`--algorithm dpo`: best vs worst of 8 sampled replies on 128 tasks from the starting policy
(the same SFT checkpoint as GRPO's), 40 steps of 16 pairs; `--iterations` sets the steps."""

SMOLLM2 = {
    "model": {"name": "smollm2-135m-instruct"},
    # SmolLM2 knows the number ("Sure! The number is 4821.") but rarely replies with it bare:
    # exact 0.04, contains 1.00 at the start. (On `arithmetic` it almost never samples a bare
    # sum, and 40 iterations of this recipe left its exact rate at 0.)
    # Exact answers are rare at first (the model says "The answer is 16."), so a reply that merely
    # contains the sum earns partial credit, more the shorter it is; `before`/`after` count exact
    # answers only.
    "env": {"path": "repeat", "kwargs": {"digits": 4, "partial_credit": 0.5}},
    "training": {"mode": "lora", "iterations": 40, "learning_rate": 3e-4, "lora_rank": 16, "lora_alpha": 32,
                 "groups_per_batch": 8, "group_size": 8, "max_new_tokens": 12, "temperature": 0.8,
                 "micro_batch_size": 16},
    "eval": {"every": 10, "num_tasks": 100},
}


ALGORITHM_OVERRIDES: dict[str, dict[str, dict]] = {}
"""Per-algorithm changes to a recipe's sections ('algorithm', 'training'), applied on top of it;
each documented where it is set. Algorithms not listed run the recipe as it is."""


def recipe(model: str, algorithm: str, iterations: int | None, seed: int, sft_dir: str | None = None) -> dict:
    """The config (as a dict, without output_dir) the benchmark runs for `model` and `algorithm`."""
    base = TINY if model == "tiny" else SMOLLM2
    over = ALGORITHM_OVERRIDES.get(algorithm, {})
    training = {**base["training"], **over.get("training", {}), **({"iterations": iterations} if iterations else {})}
    data = {**base, "training": training, "seed": seed, "algorithm": {"name": algorithm, **over.get("algorithm", {})}}
    if get_algorithm(algorithm).pairwise:
        data["dpo"] = {**DPO, **({"steps": iterations} if iterations else {})}
    if sft_dir and "sft" in base and (Path(sft_dir) / "config.json").exists():
        data.update(model={"name": str(sft_dir)}, sft={"steps": 0})
    return data


def run(model: str, algorithm: str, iterations: int | None, seed: int, sft_dir: str | None = None) -> dict:
    data = recipe(model, algorithm, iterations, seed, sft_dir)
    pairwise, sft_reused = "dpo" in data, data["model"]["name"] != model
    with tempfile.TemporaryDirectory() as out:
        cfg = config_from_dict({**data, "output_dir": out})
        start = time.perf_counter()
        evals: list[tuple[int, float, float]] = []
        updates: list[dict] = []

        def on_iteration(m: dict) -> None:
            if "clip_fraction" in m and m["iteration"] >= 0:
                updates.append({"iteration": int(m["iteration"]), "clip_fraction": m["clip_fraction"],
                                "approx_kl": m.get("approx_kl"), "optim_steps": m.get("optim_steps")})
            if "eval/exact_rate" in m:
                evals.append((int(m["iteration"]), m["eval/exact_rate"], m.get("eval/contains_rate", float("nan"))))
                print(f"  iteration {int(m['iteration']):>3}  held-out exact {m['eval/exact_rate']:.3f}  "
                      f"contains {m.get('eval/contains_rate', float('nan')):.3f}  "
                      f"[{(time.perf_counter() - start) / 60:.1f} min]", flush=True)

        train(cfg, on_iteration=on_iteration)
        minutes = (time.perf_counter() - start) / 60
        if sft_dir and cfg.sft.steps and (Path(out) / "sft").exists():
            shutil.copytree(Path(out) / "sft", sft_dir, dirs_exist_ok=True)
    before, after = evals[0][1], evals[-1][1]
    print()
    print(f"{'model':<24}{'algorithm':<12}{'before':>8}{'after':>8}{'gain':>8}{'minutes':>9}")
    print(f"{model:<24}{algorithm:<12}{before:>8.3f}{after:>8.3f}{after - before:>+8.3f}{minutes:>9.1f}")
    clip = [u["clip_fraction"] for u in updates]
    if clip:
        print(f"clip_fraction of the last epoch: mean {sum(clip) / len(clip):.3f} over {len(clip)} iterations, "
              f"last {clip[-1]:.3f} ({updates[-1]['optim_steps']:.0f} optimizer steps per iteration)")
    return {"task": cfg.env.path, "model": model, "algorithm": algorithm, "before": before, "after": after,
            "gain": after - before, "minutes": round(minutes, 2),
            "iterations": cfg.dpo.steps if pairwise else cfg.training.iterations, "sft_reused": sft_reused,
            "curve": [{"iteration": i, "exact": e, "contains": c} for i, e, c in evals],
            **({"clip_fraction_last_epoch": updates} if updates else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2-135m-instruct"])
    parser.add_argument("--algorithm", default="grpo")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-dir", default=None, help="write the tiny SFT checkpoint here, or load it if present")
    args = parser.parse_args()
    result = run(args.model, args.algorithm, args.iterations, args.seed, args.sft_dir)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
