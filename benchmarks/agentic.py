"""Agentic RL on the tiny model: tool use, and two agents trained together.

    python -m benchmarks.agentic            # both parts, tiny model, CPU (~15 min on the loaded 2-core box)
    python -m benchmarks.agentic --part race

1. **Tools** (`multiply_tools`): multi-digit multiplication, "What is 347 * 829?". The tiny model
   is warm-started (full-parameter SFT) on demonstrations -- a calculator call in the
   `<tool_call>` tag format then the result copied as the answer, and, for the no-tool
   condition, the product written directly -- because a random-init model never writes a
   well-formed tag by chance, so RL alone cannot discover the format. Then GRPO-LoRA on the
   tool-enabled env. Reported: greedy exact-answer rate on held-out problems with tools and
   without tools (the same model, the same problems), before and after RL.
2. **Two agents** (`race`, race to 10 adding 1..3): one base model warm-started on random legal
   moves (the format, not the strategy), then two LoRA adapters on that one base trained together
   by self-play (zero-sum rewards). Reported: each agent's win rate against the scripted `greedy`
   player (wins when it can, otherwise random), before, during and after, over 300 held-out games
   sampled at temperature 1 (the policy RL trains; after a format-only warm start the greedy
   argmax of a near-uniform move distribution is an arbitrary fixed policy).

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from tinker_pipelines.algorithms import LossConfig, get_algorithm
from tinker_pipelines.checkpoint import seed_everything
from tinker_pipelines.datums import rl_datums, sft_datum
from tinker_pipelines.envs.tool_env import MultiplyEnv
from tinker_pipelines.envs.two_agent import RaceEnv, RaceGame
from tinker_pipelines.learner import Learner, LearnerConfig
from tinker_pipelines.models import load_model, stop_token_ids
from tinker_pipelines.multiagent import MultiAgentConfig, MultiAgentTrainer
from tinker_pipelines.rollout.episodes import RolloutConfig, run_episodes, run_groups
from tinker_pipelines.rollout.sampler import Sampler
from tinker_pipelines.envs import EnvSpec
from tinker_pipelines.train import derived_seed
from tinker_pipelines.types import TrajectoryGroup

TOOLS = {
    "env": {"min_digits": 2, "max_digits": 3, "prompt_style": "short"},
    "sft": {"steps": 300, "batch_size": 16, "learning_rate": 4e-3, "tool_examples": 3000, "direct_examples": 600},
    "rl": {"iterations": 6, "groups_per_batch": 4, "group_size": 6, "learning_rate": 5e-3, "max_new_tokens": 90,
           "max_turns": 3},
    "eval_tasks": 50,
}
RACE = {
    "sft": {"steps": 80, "batch_size": 32, "learning_rate": 3e-3, "examples": 3000},
    "rl": {"iterations": 40, "groups_per_batch": 8, "group_size": 8, "learning_rate": 5e-3, "max_new_tokens": 3,
           "max_turns": 8, "kl_coef": 0.1},
    "eval_every": 10,
    "eval_tasks": 300,
    "eval_temperature": 1.0,
    "opponent": "greedy",
}


def sft(model, tok, examples, steps, batch_size, learning_rate, seed, label):
    datums = [sft_datum(tok, m, c) for m, c in examples]
    learner = Learner(model, LearnerConfig(mode="full", learning_rate=learning_rate), tok.pad_token_id)
    loss_fn, rng = get_algorithm("sft").loss, random.Random(derived_seed(seed, label))
    start, loss = time.perf_counter(), float("nan")
    for step in range(steps):
        loss = learner.forward_backward(rng.sample(datums, batch_size), loss_fn)["loss"]
        learner.optim_step()
        if (step + 1) % 100 == 0:
            print(f"  [{label}] SFT step {step + 1}/{steps}  loss {loss:.3f}  "
                  f"[{time.perf_counter() - start:.0f} s]", flush=True)
    model.requires_grad_(False)
    return loss


def tool_eval(sampler, tok, tools, n, max_new_tokens):
    kw = {**TOOLS["env"], "split": "test", "tools": tools}
    seeds = [10_000_000 + i for i in range(n)]
    trajs = run_episodes(sampler, tok, [MultiplyEnv(**kw) for _ in seeds], seeds,
                         RolloutConfig(max_new_tokens, 0.0, TOOLS["rl"]["max_turns"]))
    return (statistics.fmean(t.info["exact"] for t in trajs),
            statistics.fmean(float(t.info.get("tool_calls", 0) > 0) for t in trajs))


def run_tools(seed: int) -> dict:
    print("== tools: multi-digit multiplication with and without a calculator ==", flush=True)
    t0 = time.perf_counter()
    seed_everything(seed)
    model, tok = load_model("tiny", seed=seed)
    s, r = TOOLS["sft"], TOOLS["rl"]
    examples = (MultiplyEnv.sft_examples(s["tool_examples"], seed=seed, **TOOLS["env"])
                + MultiplyEnv.sft_examples(s["direct_examples"], seed=seed + 1, tools=(), **TOOLS["env"]))
    sft(model, tok, examples, s["steps"], s["batch_size"], s["learning_rate"], seed, "tools")
    learner = Learner(model, LearnerConfig(mode="lora", learning_rate=r["learning_rate"]), tok.pad_token_id)
    sampler = Sampler(learner.model, tok.pad_token_id, stop_token_ids(tok))
    n = TOOLS["eval_tasks"]
    before = {"tool": tool_eval(sampler, tok, ("calculator",), n, r["max_new_tokens"]),
              "no_tool": tool_eval(sampler, tok, (), n, r["max_new_tokens"])}
    print(f"  after SFT: with tools {before['tool'][0]:.2f} (calls a tool {before['tool'][1]:.2f}), "
          f"without {before['no_tool'][0]:.2f}  [{time.perf_counter() - t0:.0f} s]", flush=True)
    algo, spec = get_algorithm("grpo"), EnvSpec("multiply_tools", {**TOOLS["env"]})
    cfg = RolloutConfig(r["max_new_tokens"], 1.0, r["max_turns"])
    for it in range(r["iterations"]):
        rng = random.Random(derived_seed(seed, "tool-tasks", it))
        groups = run_groups(sampler, tok, spec, [rng.randrange(10_000_000) for _ in range(r["groups_per_batch"])],
                            r["group_size"], cfg, torch.Generator().manual_seed(derived_seed(seed, "tool-sample", it)))
        datums = rl_datums(groups, algo.advantages)
        if datums:
            learner.forward_backward(datums, algo.loss, LossConfig())
            learner.optim_step()
        success = statistics.fmean(t.info["exact"] for g in groups for t in g.trajectories)
        print(f"  RL iteration {it:>2}  train success {success:.2f}  informative groups "
              f"{len(datums) // r['group_size']}  [{time.perf_counter() - t0:.0f} s]", flush=True)
    after = {"tool": tool_eval(sampler, tok, ("calculator",), n, r["max_new_tokens"]),
             "no_tool": tool_eval(sampler, tok, (), n, r["max_new_tokens"])}
    return {"before": before, "after": after, "seconds": time.perf_counter() - t0}


def run_race(seed: int) -> dict:
    print("== two agents: race to 10, self-play, two LoRA adapters on one base ==", flush=True)
    t0 = time.perf_counter()
    seed_everything(seed)
    model, tok = load_model("tiny", seed=seed)
    s, r = RACE["sft"], RACE["rl"]
    sft(model, tok, RaceEnv.sft_examples(s["examples"], seed=seed), s["steps"], s["batch_size"],
        s["learning_rate"], seed, "race")
    cfg = MultiAgentConfig(seed=seed, learning_rate=r["learning_rate"], groups_per_batch=r["groups_per_batch"],
                           group_size=r["group_size"], max_new_tokens=r["max_new_tokens"], max_turns=r["max_turns"],
                           kl_coef=r["kl_coef"])
    trainer = MultiAgentTrainer(model, tok, RaceGame, cfg)
    eval_seeds = [10_000_000 + i for i in range(RACE["eval_tasks"])]

    def win_rates() -> dict[str, float]:
        return {seat: trainer.evaluate(seat, lambda: RaceEnv(seat=seat, opponent=RACE["opponent"]), eval_seeds,
                                       temperature=RACE["eval_temperature"], seed=seed)
                for seat in trainer.seats}

    curve = [(0, win_rates())]
    print(f"  before: A {curve[0][1]['a']:.2f}  B {curve[0][1]['b']:.2f}  [{time.perf_counter() - t0:.0f} s]",
          flush=True)
    for it in range(r["iterations"]):
        m = trainer.run_iteration(it)
        if (it + 1) % RACE["eval_every"] == 0 or it + 1 == r["iterations"]:
            curve.append((it + 1, win_rates()))
            print(f"  iteration {it + 1:>3}  self-play win A {m['a/win_rate_selfplay']:.2f}  "
                  f"vs {RACE['opponent']}: A {curve[-1][1]['a']:.2f}  B {curve[-1][1]['b']:.2f}  "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    return {"curve": curve, "seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "tools", "race"], default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--race-lr", type=float, default=RACE["rl"]["learning_rate"])
    parser.add_argument("--race-kl", type=float, default=RACE["rl"]["kl_coef"])
    args = parser.parse_args()
    RACE["rl"].update(learning_rate=args.race_lr, kl_coef=args.race_kl)
    torch.set_num_threads(1)
    result: dict = {}
    tools = run_tools(args.seed) if args.part in ("all", "tools") else None
    race = run_race(args.seed) if args.part in ("all", "race") else None
    print()
    if tools:
        b, a = tools["before"], tools["after"]
        print(f"{'multiplication (held-out, greedy)':<36}{'after SFT':>10}{'after RL':>10}")
        print(f"{'  success with calculator':<36}{b['tool'][0]:>10.2f}{a['tool'][0]:>10.2f}")
        print(f"{'  success without tools':<36}{b['no_tool'][0]:>10.2f}{a['no_tool'][0]:>10.2f}")
        print(f"{'  episodes that call a tool':<36}{b['tool'][1]:>10.2f}{a['tool'][1]:>10.2f}")
        print(f"  ({tools['seconds'] / 60:.1f} min)")
        result.update(tool_success=a["tool"][0], no_tool_success=a["no_tool"][0])
    if race:
        curve = race["curve"]
        print(f"{'win rate vs ' + RACE['opponent'] + ' player':<36}" + "".join(f"{'it ' + str(i):>8}" for i, _ in curve))
        for seat, name in (("a", "agent A (moves first)"), ("b", "agent B (moves second)")):
            print(f"{'  ' + name:<36}" + "".join(f"{w[seat]:>8.2f}" for _, w in curve))
        print(f"  ({race['seconds'] / 60:.1f} min)")
        result.update(agent_a_before=curve[0][1]["a"], agent_a_after=curve[-1][1]["a"],
                      agent_b_before=curve[0][1]["b"], agent_b_after=curve[-1][1]["b"],
                      agent_a_min_during=min(w["a"] for _, w in curve[1:]),
                      agent_b_min_during=min(w["b"] for _, w in curve[1:]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
