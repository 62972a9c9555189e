"""One GRPO iteration with our stack and with TRL's `GRPOTrainer`, side by side on CPU.

The same work on both sides:
- model: the tiny Llama (optionally wider), SFT-warm-started here on the arithmetic env so that
  groups have mixed rewards (an untrained model scores 0 everywhere and neither side would learn),
  or `--model smollm2-135m-instruct` (sums up to 9 + 9, no warm start: replies that contain the
  sum already earn the partial credit, so groups are mixed from the start);
  the warm-started weights and the tokenizer are saved to a temporary directory and TRL loads
  them from there, as a user would pass a model path;
- task: the `arithmetic` env; iteration k uses the same task seeds on both sides (those
  `Experiment.rollout(k)` draws), TRL's reward function is the env's own `score_reply`;
- batch: `--groups` tasks x `--group-size` completions of at most `--max-new-tokens`, sampled
  at temperature 1, top-k/top-p off;
- update: LoRA (r 8, alpha 16, every attention and MLP projection; `--mode full` for all
  parameters), AdamW at the same learning rate, gradient-norm clip 1, one optimizer step per
  iteration, no KL (TRL's default beta 0; ours kl_coef 0), token-mean loss normalisation (TRL's
  default `dapo`; ours `grpo` with `normalization: token`, which equals it: tests/test_trl_crosscheck.py);
- precision fp32 on both sides and activation checkpointing off on both. TRL's other settings
  are its defaults; its bf16 default is turned off because bf16 matmuls on these CPUs are ~30x
  slower than fp32, which would slow TRL, not us.

Timed, per iteration, after one untimed warm-up iteration on each side (first-call costs:
optimizer state, caches) and with model loading and trainer construction excluded:
- ours: `Experiment.rollout(k)` + `Experiment.train_step(groups)`: sampling, env rewards,
  advantages, datums, forward/backward, optimizer step;
- TRL: one `Trainer` optimizer step, from its `on_step_begin` to its `on_step_end` callback:
  generation, rewards, advantages, forward/backward, grad clip, optimizer and scheduler step.
The sides alternate (TRL step k, then our iteration k, from TRL's step-end callback) so that
both see the same machine load; the median of `--repeats` timed iterations per side is reported,
with its split into sampling + rewards (TRL: up to the call of its reward function) and training.
Both sides run in one process with the same torch thread count (set OMP_NUM_THREADS to pin it).
Tokens: completion tokens generated, and completion tokens the loss was computed on. Our
trainer skips groups whose rewards are all equal (no gradient); TRL trains on them with zero
advantage, so the table shows both sides' trained tokens and informative groups.

    python -m benchmarks.vs_trl [--model tiny|smollm2-135m-instruct] [--groups 8] [--group-size 8]
                                [--max-new-tokens 16] [--repeats 5]

Last line: {"ratio": ours_s / trl_s, "ours_s": ..., "trl_s": ..., "ours_tokens": ..., "trl_tokens": ...}
(tokens: completion tokens generated in the timed iterations).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def bench_config(a: argparse.Namespace) -> dict:
    tiny = a.model == "tiny"
    model = {"name": a.model, "kwargs": {"hidden_size": a.hidden_size}} if tiny else {"name": a.model}
    return {"seed": 0, "model": {**model, "device": "cpu", "dtype": "float32"},
            "env": {"path": "arithmetic", "kwargs": {"max_operand": 3 if tiny else 9, "partial_credit": 0.5}},
            "algorithm": {"name": "grpo", "normalization": "token", "kl_coef": 0.0},
            "training": {"mode": a.mode, "iterations": a.repeats + 1, "learning_rate": a.lr,
                         "groups_per_batch": a.groups, "group_size": a.group_size,
                         "max_new_tokens": a.max_new_tokens, "temperature": 1.0, "lora_rank": 8, "lora_alpha": 16.0,
                         "grad_clip": 1.0, "micro_batch_size": a.groups * a.group_size},
            "sft": {"steps": a.sft_steps if a.sft_steps is not None else (150 if tiny else 0), "batch_size": 16, "examples": 500, "learning_rate": 3e-3,
                    "kwargs": {"verbose_fraction": 0.5}},
            "eval": {"every": 1000, "num_tasks": 1}}


def iteration_tasks(cfg, iteration: int) -> list[tuple[list[dict], str]]:
    """(prompt messages, answer) of each task `Experiment.rollout(iteration)` draws."""
    from tinker_pipelines.envs.arithmetic import sample_problem
    from tinker_pipelines.loops.experiment import EVAL_SEED_OFFSET, derived_seed

    rng = random.Random(derived_seed(cfg.seed, "tasks", iteration))
    seeds = [rng.randrange(EVAL_SEED_OFFSET) for _ in range(cfg.training.groups_per_batch)]
    env, kwargs = cfg.env.spec().build(), cfg.env.kwargs
    out = []
    for s in seeds:
        a, b = sample_problem(s, kwargs.get("max_operand", 9), "train")
        out.append((env.reset(seed=s), str(a + b)))
    return out


def ours_iteration(exp, k: int) -> dict:
    """Iteration `k` of our stack, timed: rollout (sampling, env rewards) + train step."""
    start = time.perf_counter()
    ro = exp.rollout(k)
    metrics = exp.train_step(ro.groups)
    return {"s": time.perf_counter() - start, "sample_s": ro.metrics["time/rollout_s"],
            "train_s": metrics["time/train_s"], "generated": ro.metrics["sampled_tokens"],
            "trained": metrics.get("trained_tokens", 0.0), "informative": metrics["informative_groups"],
            "reward": ro.metrics["reward_mean"]}


def run_side_by_side(exp, model_dir: Path, cfg, iterations: int, out_dir: Path) -> tuple[list[dict], list[dict]]:
    """TRL's training run with our iteration k run right after TRL's step k (outside TRL's timed
    window), so both sides see the same machine load at about the same time."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tinker_pipelines.envs.arithmetic import score_reply
    from tinker_pipelines.training.learner import LearnerConfig

    t, partial = cfg.training, cfg.env.kwargs.get("partial_credit", 0.0)
    trl_rows: list[dict] = []
    ours_rows: list[dict] = []

    def arithmetic_reward(completions, answer, completion_ids, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [score_reply(x, a, partial).reward for x, a in zip(texts, answer, strict=True)]
        groups = [rewards[i:i + t.group_size] for i in range(0, len(rewards), t.group_size)]
        # Every completion token is in TRL's loss (dapo; truncated completions are not masked).
        generated = float(sum(len(ids) for ids in completion_ids))
        trl_rows[-1].update(generated=generated, trained=generated, reward=sum(rewards) / len(rewards),
                            sample_s=time.perf_counter() - trl_rows[-1]["start"],
                            informative=float(sum(len(set(g)) > 1 for g in groups)))
        return rewards

    class SideBySide(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            trl_rows.append({"start": time.perf_counter()})

        def on_step_end(self, args, state, control, **kw):
            row = trl_rows[-1]
            row["s"] = time.perf_counter() - row.pop("start")
            row["train_s"] = row["s"] - row["sample_s"]
            ours_rows.append(ours_iteration(exp, len(ours_rows)))

    tasks = [task for k in range(iterations) for task in iteration_tasks(cfg, k)]
    data = Dataset.from_dict({"prompt": [m for m, _ in tasks], "answer": [a for _, a in tasks]})
    peft_config = None
    if t.mode == "lora":
        peft_config = LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=list(LearnerConfig().lora_targets))
    args = GRPOConfig(output_dir=str(out_dir), max_steps=iterations, learning_rate=t.learning_rate,
                      per_device_train_batch_size=t.groups_per_batch * t.group_size, num_generations=t.group_size,
                      max_completion_length=t.max_new_tokens, temperature=t.temperature, max_grad_norm=t.grad_clip,
                      shuffle_dataset=False,  # step k sees iteration k's tasks, as ours does
                      bf16=False, activation_checkpointing=False, use_cpu=True, report_to=[], save_strategy="no",
                      disable_tqdm=True, seed=cfg.seed)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=arithmetic_reward, args=args, train_dataset=data,
                          peft_config=peft_config, callbacks=[SideBySide()])
    trainer.train()
    return ours_rows, trl_rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=8, help="tasks per iteration")
    p.add_argument("--group-size", type=int, default=8, help="completions per task")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--mode", choices=("lora", "full"), default="lora")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--model", default="tiny", help="tiny, smollm2-135m-instruct or a model directory")
    p.add_argument("--hidden-size", type=int, default=128, help="tiny model width (128: ~1M parameters)")
    p.add_argument("--sft-steps", type=int, default=None,
                   help="untimed warm start so groups have mixed rewards (default: 150 on tiny, 0 otherwise: "
                        "a pretrained model's replies already earn partial credit)")
    p.add_argument("--repeats", type=int, default=5, help="timed iterations per side (after one warm-up)")
    a = p.parse_args(argv)

    import torch

    from tinker_pipelines.config import config_from_dict
    from tinker_pipelines.loops.experiment import Experiment

    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        cfg = config_from_dict({**bench_config(a), "output_dir": str(Path(tmp) / "ours")})
        exp = Experiment(cfg)
        exp.sft()
        model_dir = Path(tmp) / "model"
        exp.base_model.save_pretrained(model_dir)
        exp.tokenizer.save_pretrained(model_dir)
        exp.start_rl()
        print(f"threads {torch.get_num_threads()}, {a.groups}x{a.group_size} completions of <= {a.max_new_tokens} "
              f"tokens, {a.mode}, model {a.model}" + (f" (hidden {a.hidden_size})" if a.model == "tiny" else ""),
              flush=True)
        ours_rows, trl_rows = run_side_by_side(exp, model_dir, cfg, a.repeats + 1, Path(tmp) / "trl")
        ours_rows, trl_rows = ours_rows[1:], trl_rows[1:]  # the first iteration of each side is the warm-up

    table = [("ours", ours_rows), ("TRL", trl_rows)]
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    print(f"{'':<6}{'iteration s':>12}{'sample+reward s':>16}{'train s':>9}{'generated':>11}{'trained':>9}"
          f"{'informative':>13}{'reward':>8}   (medians over {a.repeats} warm iterations; token sums)")
    for name, rows in table:
        print(f"{name:<6}{med(rows, 's'):>12.3f}{med(rows, 'sample_s'):>16.3f}{med(rows, 'train_s'):>9.3f}"
              f"{sum(r['generated'] for r in rows):>11.0f}{sum(r['trained'] for r in rows):>9.0f}"
              f"{statistics.fmean(r['informative'] for r in rows):>9.1f}/{a.groups:<3}"
              f"{statistics.fmean(r['reward'] for r in rows):>8.3f}")
        print(f"{'':<6}iterations: " + " ".join(f"{r['s']:.2f}" for r in rows))
    ours_s, trl_s = (statistics.median(r["s"] for r in rows) for _, rows in table)
    result = {"ratio": round(ours_s / trl_s, 4), "ours_s": round(ours_s, 4), "trl_s": round(trl_s, 4),
              "ours_tokens": int(sum(r["generated"] for r in ours_rows)),
              "trl_tokens": int(sum(r["generated"] for r in trl_rows)),
              "ours_trained_tokens": int(sum(r["trained"] for r in ours_rows)),
              "trl_trained_tokens": int(sum(r["trained"] for r in trl_rows)), "mode": a.mode, "model": a.model,
              "repeats": a.repeats}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
