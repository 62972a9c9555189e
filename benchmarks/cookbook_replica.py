"""tinker-cookbook's `math_rl` arithmetic recipe (0.5.8) replayed in this process, on our own
learner and sampler: the same problems, prompt tokens, reward, advantages and datums as the
recipe sends to a Tinker service, with no HTTP in between.

It is the in-process side of `benchmarks.tinker_api --part api` (the same RL steps through the
SDK and here), and it is how the recipe's settings for a 2-core CPU were chosen
(`python -m benchmarks.cookbook_replica --steps 20 ...`, docs/tinker.md).

What is copied from the recipe, and where it is in the cookbook:
- problems: `ArithmeticDataset.get_batch(i)` seeds a `RandomState` with the batch index and
  draws `x, y = randint(0, 101)` per group (`recipes/math_rl/arithmetic_env.py`);
- prompts: rendered by the cookbook's own `role_colon` renderer in `.venv-cookbook`, with the
  few-shot `What is 4 + 5?` -> `9` prefix (`render_prompts`);
- reward: `ProblemEnv.step`: `correct + 0.1 * (format - 1)`, correct = the last integer of the
  reply (cut at the stop sequence) equals x + y, format = the stop sequence was reached;
- advantages: reward minus the group's mean (`rl/data_processing.compute_advantages`);
- loss: `importance_sampling` on the sampled tokens, Adam with Tinker's defaults (beta2 0.95,
  no gradient clipping), LoRA alpha 32.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STOP = "\n\nUser:"
"""The `role_colon` renderer's stop sequence (`get_stop_sequences()`)."""
FORMAT_COEF = 0.1
"""`ArithmeticEnv`'s `format_coef`."""
_INTEGER = re.compile(r"-?\d+")

_RENDER = """
import json, sys
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
from tinker_cookbook.tokenizer_utils import get_tokenizer
r = renderers.get_renderer("role_colon", tokenizer=get_tokenizer(sys.argv[1]))
out = []
for x, y in json.loads(sys.stdin.read()):
    env = ArithmeticEnv(x, y, renderer=r, convo_prefix=ArithmeticEnv.standard_fewshot_prefix())
    convo = env.convo_prefix + [{"role": "user", "content": env.get_question()}]
    out.append(r.build_generation_prompt(convo).to_ints())
print(json.dumps({"prompts": out, "stop": r.get_stop_sequences()}))
"""


def recipe_problems(batch_index: int, groups_per_batch: int) -> list[tuple[int, int]]:
    """The (x, y) of each group of the recipe's batch `batch_index`, as `ArithmeticDataset` draws them."""
    rng = np.random.RandomState(None)
    rng.seed(batch_index)
    return [(int(rng.randint(0, 101)), int(rng.randint(0, 101))) for _ in range(groups_per_batch)]


def render_prompts(model_dir: str | Path, problems: list[tuple[int, int]], cookbook_python: str | Path,
                   timeout_s: float = 300.0) -> list[list[int]]:
    """The recipe's prompt tokens for `problems`, rendered by the cookbook itself in its own
    environment (its tokenizer loader and `role_colon` renderer on `model_dir`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    p = subprocess.run([str(cookbook_python), "-c", _RENDER, str(model_dir)], input=json.dumps(problems),
                       capture_output=True, text=True, env=env, timeout=timeout_s)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"rendering the recipe's prompts in {cookbook_python} failed: {last}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if out["stop"] != [STOP]:
        raise RuntimeError(f"role_colon's stop sequences are {out['stop']}, this replica assumes {[STOP]}")
    return out["prompts"]


def is_correct(reply: str, x: int, y: int) -> bool:
    """`ArithmeticEnv.check_answer` on the reply's content (the text before the stop sequence)."""
    found = _INTEGER.findall(reply.split(STOP, 1)[0].replace(",", ""))
    return bool(found) and int(found[-1]) == x + y


def reward(reply: str, reached_stop: bool, x: int, y: int) -> float:
    """`ProblemEnv.step`'s total reward."""
    return FORMAT_COEF * (float(reached_stop) - 1.0) + float(is_correct(reply, x, y))


@dataclass(frozen=True)
class Settings:
    """The recipe's knobs (its chz names) that the replica honours."""

    groups_per_batch: int = 8
    group_size: int = 8
    max_tokens: int = 4
    learning_rate: float = 5e-4
    lora_rank: int = 8
    temperature: float = 1.0
    stop_at_eos: bool = True
    """End a reply at the tokenizer's EOS (Tinker's sampler does); False: only at the stop sequence."""


class Replica:
    """The recipe's training loop on an in-process `Learner` and `Sampler` over `model_dir`."""

    def __init__(self, model_dir: str | Path, settings: Settings, cookbook_python: str | Path, seed: int = 0):
        import torch

        from tinker_pipelines.models import load_model
        from tinker_pipelines.rollout.sampler import Sampler
        from tinker_pipelines.training.learner import Learner, LearnerConfig

        self.s, self.model_dir, self.cookbook_python, self.seed = settings, str(model_dir), cookbook_python, seed
        base, self.tokenizer = load_model(self.model_dir)
        from tinker_pipelines.training.rules import tinker_lora_settings

        # the adapter a Tinker client gets for `rank` with the SDK's defaults (lm_head included)
        lora, _ = tinker_lora_settings({"rank": settings.lora_rank})
        cfg = LearnerConfig(**lora, learning_rate=settings.learning_rate, betas=(0.9, 0.95), grad_clip=0.0,
                            temperature=settings.temperature,
                            # one pass over the step's datums, as a Tinker forward_backward call is
                            micro_batch_size=settings.groups_per_batch * settings.group_size)
        self.learner = Learner(base, cfg, self.tokenizer.pad_token_id, init_seed=seed)
        # Tinker's sampler ends a reply at the model's EOS as well as at the request's stop
        # sequences: role_colon's parse_response expects both ("terminated_with_eos").
        eos = [self.tokenizer.eos_token_id] if settings.stop_at_eos else []
        self.sampler = Sampler(self.learner.model, self.tokenizer.pad_token_id, eos, tokenizer=self.tokenizer)
        self.generator = torch.Generator().manual_seed(seed)
        self.prompts: dict[int, list[list[int]]] = {}

    def prerender(self, batch_indices: range) -> None:
        """Render the prompts of these batches in one call of the cookbook's environment (a
        process start costs seconds)."""
        problems = [recipe_problems(i, self.s.groups_per_batch) for i in batch_indices]
        flat = render_prompts(self.model_dir, [p for ps in problems for p in ps], self.cookbook_python)
        for j, i in enumerate(batch_indices):
            self.prompts[i] = flat[j * self.s.groups_per_batch:(j + 1) * self.s.groups_per_batch]

    def step(self, batch_index: int) -> dict[str, float]:
        """One iteration of `do_sync_training`: sample the batch's groups, score, one optimizer step."""
        from tinker_pipelines.algorithms.losses import LossConfig, importance_sampling_loss

        s = self.s
        t0 = time.perf_counter()
        problems = recipe_problems(batch_index, s.groups_per_batch)
        if batch_index not in self.prompts:
            self.prerender(range(batch_index, batch_index + 1))
        prompts = self.prompts[batch_index]
        rows = [p for p in prompts for _ in range(s.group_size)]
        samples = self.sampler.sample(rows, s.max_tokens, s.temperature, self.generator, stop=(STOP,))
        t_sample = time.perf_counter() - t0
        datums, correct = [], []
        for g, (x, y) in enumerate(problems):
            group = samples[g * s.group_size:(g + 1) * s.group_size]
            texts = [self.tokenizer.decode(list(smp.tokens)) for smp in group]
            rewards_G = np.array([reward(t, smp.stop_string is not None, x, y) for t, smp in zip(texts, group)])
            correct += [is_correct(t, x, y) for t in texts]
            adv_G = rewards_G - rewards_G.mean()
            datums += [rl_datum(prompts[g], smp.tokens, smp.logprobs, float(a)) for smp, a in zip(group, adv_G)]
        metrics = self.learner.forward_backward(datums, importance_sampling_loss, LossConfig(normalization="token"))
        self.learner.optim_step()
        self.last_replies = [(x, y, self.tokenizer.decode(list(smp.tokens)))
                             for (x, y), smp in zip([p for p in problems for _ in range(s.group_size)], samples)]
        return {"step": batch_index, "correct": float(np.mean(correct)), "sample_s": t_sample,
                "total_s": time.perf_counter() - t0, **{k: float(v) for k, v in metrics.items()}}


def rl_datum(prompt: list[int], tokens: tuple[int, ...], logprobs: tuple[float, ...], advantage: float):
    """The recipe's datum for one sampled reply: targets are the next tokens, only the reply's
    positions weighted, each carrying its sampling logprob and the trajectory's advantage."""
    from tinker_pipelines.types import Datum

    seq = list(prompt) + list(tokens)
    n_prompt_targets = len(prompt) - 1
    n = len(tokens)
    return Datum(tuple(seq[:-1]), tuple(seq[1:]), (0.0,) * n_prompt_targets + (1.0,) * n,
                 behaviour_logprobs=(0.0,) * n_prompt_targets + tuple(logprobs),
                 advantages=(0.0,) * n_prompt_targets + (advantage,) * n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="a `tinker-pipelines model-dir` directory")
    parser.add_argument("--cookbook-python", default=".venv-cookbook/bin/python")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=0, help="print this many replies of each step")
    for f, v in vars(Settings()).items():
        if isinstance(v, bool):
            parser.add_argument(f"--{f.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=v)
        else:
            parser.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    s = Settings(**{f: getattr(args, f) for f in vars(Settings())})
    replica = Replica(args.model_dir, s, args.cookbook_python, args.seed)
    replica.prerender(range(args.steps))
    curve = []
    for i in range(args.steps):
        m = replica.step(i)
        curve.append(m["correct"])
        print(f"step {i:3d} correct {m['correct']:.3f}  sample {m['sample_s']:.1f}s  total {m['total_s']:.1f}s",
              flush=True)
        if args.show:
            print("   ", "; ".join(f"{x}+{y}:{t!r}" for x, y, t in replica.last_replies[:args.show]), flush=True)
    k = min(3, len(curve) // 2)
    gain = float(np.mean(curve[-k:]) - np.mean(curve[:k])) if k else 0.0
    print(json.dumps({"settings": vars(s), "steps": args.steps, "curve": curve, "gain": round(gain, 4)}))


if __name__ == "__main__":
    main()
