"""Agentic RL: tool use, and two agents trained together.

    python -m benchmarks.agentic            # both parts, CPU
    python -m benchmarks.agentic --part race
    python -m benchmarks.agentic --part tools --preset sft_short   # SFT stops short, RL finishes

1. **Tools** (`multiply_tools`): multi-digit multiplication, "What is 347 * 829?", on
   SmolLM2-135M-Instruct with one LoRA adapter. The adapter is warm-started (SFT) on
   demonstrations of both conditions -- a calculator call in the `<tool_call>` tag format then
   the result copied as the answer, and, without tools, the product written directly as a bare
   number -- so that both conditions answer in the graded format. Then GRPO on both conditions
   (the same number of groups each). Reported: greedy exact-answer rate on held-out problems with
   tools and without tools (the same model, the same problems), after SFT and after RL. (The
   ~1M-parameter tiny model learns the tag format but not to copy operands and results.)
   That SFT alone reaches 1.00 with tools; `--preset sft_short` stops SFT after 3 steps (tool
   demonstrations only) and leaves the rest to GRPO (`TOOLS_PRESETS`, `ToolsConfig`).
2. **Two agents** (`race`, race to exactly 9 adding 1..3, each reply naming the new total:
   `RaceGame(target=9, max_start=5, exact=True, reply="total")`; `--race-target 10`,
   `--race-rules reach` and `--race-reply move` give the earlier games): one tiny base model
   warm-started on random legal moves (the format, not the
   strategy; some after an illegal reply), then two LoRA adapters on that one base trained
   together: each iteration, self-play games between the two agents (zero-sum rewards; an
   illegal move costs 0.1 and is retried) plus, for each agent, games against a pool of scripted
   players (`RACE["rl"]["scripted_opponents"]`, `--race-pool`; '' for self-play only); both
   adapters take one step per iteration. Reported: each agent's win rate against the scripted
   `greedy` player (wins when it can, otherwise random), before, during and after, over held-out
   games sampled at temperature 1 (the policy RL trains; after a format-only warm start the greedy
   argmax of a near-uniform move distribution is an arbitrary fixed policy); P(winning move |
   total 6..8) and P(move to 5 | total 2..4) (target 9; `win_totals`, `steer_totals`), against
   what a uniform choice among the legal moves scores; and P(a legal reply).

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tinker_pipelines.algorithms import LossConfig, get_algorithm
from tinker_pipelines.checkpoint import seed_everything
from tinker_pipelines.loops.datums import rl_datums, sft_datum
from tinker_pipelines.envs.tool_env import MultiplyEnv
from tinker_pipelines.envs.two_agent import SCRIPTED_PLAYERS, RaceEnv, RaceGame
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.models import encode_chat, load_model, stop_token_ids
from tinker_pipelines.loops.multiagent import MultiAgentConfig, MultiAgentTrainer
from tinker_pipelines.rollout.episodes import run_episodes, run_groups
from tinker_pipelines.rollout.settings import SamplingSettings
from tinker_pipelines.rollout.sampler import Sampler
from tinker_pipelines.envs import EnvSpec
from tinker_pipelines.loops.experiment import derived_seed

@dataclass(frozen=True)
class ToolsConfig(SamplingSettings):
    """One setting of the tools part (SmolLM2-135M-Instruct, one LoRA adapter, `multiply_tools`,
    SFT then GRPO); `TOOLS_PRESETS` names the settings, `--preset` picks one. RL samples with the
    inherited `SamplingSettings`; evaluation uses them greedily."""

    max_new_tokens: int = 40
    """Tokens per turn, in RL and evaluation."""
    max_turns: int = 3
    """Policy turns per episode (a tool call is one)."""

    model: str = "smollm2-135m-instruct"
    """Base model. The ~1M-parameter tiny model learns the tag format but never learned to copy
    operands into the call or the result into the answer within minutes of CPU SFT (0.00 with
    tools); a pretrained model copies digits natively."""
    env: dict = field(default_factory=lambda: {"min_digits": 2, "max_digits": 3, "prompt_style": "short"})
    """`MultiplyEnv` keyword arguments, for SFT demonstrations, RL and evaluation alike."""
    lora: dict = field(default_factory=lambda: {"lora_rank": 16, "lora_alpha": 32.0, "micro_batch_size": 8})
    """LoRA learner settings."""
    sft_steps: int = 16
    """SFT optimizer steps (LoRA) before RL."""
    sft_batch_size: int = 8
    """Demonstrations per SFT step."""
    sft_learning_rate: float = 1e-3
    """SFT learning rate."""
    tool_examples: int = 600
    """Tool demonstration pairs: the calculator call, then (unless `call_only`) the result copied
    as the answer; two pairs per episode."""
    call_only: bool = False
    """Keep only the call turn of each tool demonstration: SFT shows the call format, never what
    to answer once the result is back."""
    direct_examples: int = 300
    """Direct-answer demonstrations (no tools, the bare product), so that the no-tool condition
    answers in the graded format rather than failing on format alone."""
    conditions: tuple[str, ...] = ("tool", "no_tool")
    """Conditions RL trains on (the same number of groups each) and evaluation reports: 'tool'
    (with the calculator), 'no_tool' (answer directly)."""
    rl_iterations: int = 4
    """GRPO iterations (one optimizer step each)."""
    groups_per_batch: int = 4
    """GRPO groups per iteration, per condition."""
    group_size: int = 6
    """Episodes per group (same problem)."""
    rl_learning_rate: float = 2e-4
    """GRPO learning rate (the SFT optimizer, its rate changed)."""
    eval_tasks: int = 60
    """Held-out (`split="test"`) problems, the same ones after SFT and after RL."""

    def __post_init__(self) -> None:
        self.check_sampling("tools.")


TOOLS_PRESETS = {
    # 16 SFT steps on full demonstrations: 1.00 with the calculator after SFT alone, nothing left
    # for RL; the tool vs no-tool comparison.
    "default": ToolsConfig(),
    # SFT stopped short (3 steps on tool demonstrations only: the call, then the result copied),
    # so that RL has to raise held-out success with the calculator: seed 0 0.725 -> 1.00 after 6
    # GRPO steps at lr 1e-3 (docs/environments.md). `call_only=True` with 4 SFT steps was tried
    # too: 0.00 held-out and 0.00 in RL sampling (no group with a success: no GRPO signal).
    "sft_short": ToolsConfig(sft_steps=3, conditions=("tool",), rl_iterations=6, rl_learning_rate=1e-3,
                             eval_tasks=40),
}
RACE = {
    # Replies name the new total ('9' from 6) and the total must land on the target exactly: with
    # the number added as the reply and reaching 10 or beyond winning, the tiny model never learned
    # to read the total (every P(move | total) the same at every total, in every setting tried), and
    # adding 3 was the best a blind policy could do (docs/environments.md, "Race"). Target 9, not
    # 10: every legal reply is then one digit, one token. With "10" the winning reply began with
    # the token "1", and RL's credit for it leaked into "1" at low totals (illegal there): one seed's
    # first mover drifted to replying "1" and lost every game from iteration 7.
    "game": {"target": 9, "max_start": 5, "exact": True, "reply": "total"},
    # The warm start has to learn to read the total to make legal replies at all. At 3e-3 seed 0
    # never did on one machine (loss ~0.9 for 400 steps, others ~0.5); at 1e-3 seeds 0-2 reach ~0.5.
    "sft": {"steps": 300, "batch_size": 32, "learning_rate": 1e-3, "examples": 3000, "illegal_fraction": 0.1,
            "read_fraction": 0.0, "player": "random", "random_fraction": 0.0},
    # A move's tokens and no more (`RaceGame.reply_tokens`: 1 for '3', 3 for '7+3'): digits are
    # single tokens, the chat template closes the turn. With room for more, one large GRPO step
    # once pushed an agent off the end-of-turn token ('333', '223': KL 4.7 to the base in one
    # step) and it lost nearly every game.
    "rl": {"iterations": 40, "groups_per_batch": 8, "group_size": 8, "learning_rate": 3e-3,
           "max_turns": 10, "kl_coef": 0.0,
           # Opponent mixing: besides the 8 self-play seeds, each agent plays 16 seeds x 8 games
           # against the scripted `greedy` player (on other seeds than the evaluation's). In
           # self-play alone agent A's reward barely depends on its policy while B is near-random
           # (see docs/environments.md). KL 0: the only setting in which A reached its ceiling.
           "scripted_opponents": ("greedy",), "scripted_groups": 16},
    "eval_every": 10,
    "eval_tasks": 300,
    "eval_temperature": 1.0,
    "opponent": "greedy",
}


def sft(model, tok, examples, steps, batch_size, learning_rate, seed, label, learner=None):
    """Supervised warm start: full-parameter on `model`, or through `learner` (e.g. LoRA) if given."""
    datums = [sft_datum(tok, m, c) for m, c in examples]
    # Frozen afterwards only when this function made the learner (the race base model, which
    # gets LoRA adapters next); a given learner's adapter stays trainable for RL.
    own = learner is None
    learner = learner or Learner(model, LearnerConfig(mode="full", learning_rate=learning_rate), tok.pad_token_id)
    loss_fn, rng = get_algorithm("sft").loss, random.Random(derived_seed(seed, label))
    start, loss = time.perf_counter(), float("nan")
    for step in range(steps):
        loss = learner.forward_backward(rng.sample(datums, batch_size), loss_fn)["loss"]
        learner.optim_step()
        if (step + 1) % max(1, min(100, steps // 4)) == 0:
            print(f"  [{label}] SFT step {step + 1}/{steps}  loss {loss:.3f}  "
                  f"[{time.perf_counter() - start:.0f} s]", flush=True)
    if own:
        model.requires_grad_(False)
    return loss


CONDITION_TOOLS = {"tool": ("calculator",), "no_tool": ()}
"""The tools each condition's environment offers."""


def exact(traj) -> float:
    """Exact-answer reward of an episode; 0 for one cut off at `max_turns` while still calling
    tools (its last step has no answer to grade)."""
    return traj.info.get("exact", 0.0)


def tool_eval(sampler, tok, cfg: ToolsConfig, condition: str):
    """Greedy exact-answer rate and tool-calling rate on `cfg.eval_tasks` held-out problems (the
    same ones for every call). An episode cut off at `max_turns` ends on a tool turn: it called."""
    kw = {**cfg.env, "split": "test", "tools": CONDITION_TOOLS[condition]}
    seeds = [10_000_000 + i for i in range(cfg.eval_tasks)]
    trajs = run_episodes(sampler, tok, [MultiplyEnv(**kw) for _ in seeds], seeds,
                         dataclasses.replace(cfg.sampling(), temperature=0.0))
    return (statistics.fmean(exact(t) for t in trajs),
            statistics.fmean(float(t.info.get("tool_calls", 0) > 0 or "tool_results" in t.info) for t in trajs))


def tool_sft_examples(cfg: ToolsConfig, seed: int) -> list:
    """SFT demonstrations: tool episodes (only their call turns if `cfg.call_only`) plus, when
    the no-tool condition is trained, direct answers."""
    tool = MultiplyEnv.sft_examples(cfg.tool_examples, seed=seed, **cfg.env)
    if cfg.call_only:  # pairs alternate: the call, then the answer after the result
        tool = tool[0::2]
    direct = (MultiplyEnv.sft_examples(cfg.direct_examples, seed=seed + 1, tools=(), **cfg.env)
              if "no_tool" in cfg.conditions else [])
    return tool + direct


def run_tools(cfg: ToolsConfig, seed: int) -> dict:
    """SFT (LoRA) on demonstrations, then GRPO on each condition in `cfg.conditions`; held-out
    success in each condition, the same model and problems, before and after RL."""
    print(f"== tools: multi-digit multiplication, conditions {', '.join(cfg.conditions)} ({cfg.model}) ==", flush=True)
    t0 = time.perf_counter()
    seed_everything(seed)
    model, tok = load_model(cfg.model, seed=seed)
    learner = Learner(model, LearnerConfig(mode="lora", learning_rate=cfg.sft_learning_rate, **cfg.lora,
                                           temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                           min_p=cfg.min_p), tok.pad_token_id)
    sft(learner.model, tok, tool_sft_examples(cfg, seed), cfg.sft_steps, cfg.sft_batch_size, cfg.sft_learning_rate,
        seed, "tools", learner)
    for group in learner.optimizer.param_groups:
        group["lr"] = cfg.rl_learning_rate
    sampler = Sampler(learner.model, tok.pad_token_id, stop_token_ids(tok), tokenizer=tok)

    def evaluate(label: str) -> dict:
        out = {c: tool_eval(sampler, tok, cfg, c) for c in cfg.conditions}
        print(f"  after {label}: " + ", ".join(f"{c} {ok:.2f} (calls a tool {calls:.2f})"
                                             for c, (ok, calls) in out.items())
              + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
        return out

    before = evaluate("SFT")
    algo = get_algorithm("grpo")
    specs = {c: EnvSpec("multiply_tools", {**cfg.env, "tools": CONDITION_TOOLS[c]}) for c in cfg.conditions}
    rollout = cfg.sampling()
    for it in range(cfg.rl_iterations):
        rng = random.Random(derived_seed(seed, "tool-tasks", it))
        groups, success = [], {}
        for name, spec in specs.items():  # every condition gets the same RL budget
            gen = torch.Generator().manual_seed(derived_seed(seed, "tool-sample", name, it))
            g = run_groups(sampler, tok, spec, [rng.randrange(10_000_000) for _ in range(cfg.groups_per_batch)],
                           cfg.group_size, rollout, gen)
            success[name] = statistics.fmean(exact(t) for grp in g for t in grp.trajectories)
            groups += g
        datums = rl_datums(groups, algo.advantages)
        if datums:
            learner.forward_backward(datums, algo.loss, LossConfig())
            learner.optim_step()
        print(f"  RL iteration {it:>2}  train success " + ", ".join(f"{c} {v:.2f}" for c, v in success.items())
              + f"  informative groups {len(datums) // cfg.group_size}  [{time.perf_counter() - t0:.0f} s]",
              flush=True)
    after = evaluate("RL")
    return {"before": before, "after": after, "seconds": time.perf_counter() - t0}


def race_context(seat: str, total: int) -> list[dict]:
    """A conversation in which `seat` is to move at `total`, as it meets that total in a game: the
    opening message (A's first move, at a start total; B's, after one move of A's), or for A
    beyond the start totals its opening, its own move and B's reply (2 each)."""
    game = RaceGame(**RACE["game"])
    game.reset(0)
    system = {"role": "system", "content": game.rules()}
    if seat == "b":
        return [system, {"role": "user", "content": f"Opponent adds 1. Total is {total}. Your move."}]
    if total <= game.max_start:
        return [system, {"role": "user", "content": f"Total is {total}. Your move."}]
    game.total = total - 4
    return [system, {"role": "user", "content": f"Total is {game.total}. Your move."},
            {"role": "assistant", "content": game.format_move(2)},
            {"role": "user", "content": f"Opponent adds 2. Total is {total}. Your move."}]


def reply_probs(trainer: MultiAgentTrainer, seat: str, total: int) -> dict[int, float]:
    """The probability of each legal move's reply at `total`, read from the seat's agent on the
    prompt it sees there: the product over the reply's tokens, and the end of the turn after a
    reply shorter than the turn's token budget ("8" then end, not "81")."""
    tok = trainer.tokenizer
    ids = encode_chat(tok, race_context(seat, total))
    game = RaceGame(**RACE["game"])
    game.reset(0)
    game.total = total
    trainer.learners[seat].activate()
    out = {}
    for move in range(1, game.largest_move() + 1):
        reply = tok.encode(game.format_move(move), add_special_tokens=False)
        if len(reply) < game.reply_tokens():
            reply.append(tok.eos_token_id)
        with torch.no_grad():
            logits_RV = trainer.model(torch.tensor([ids + reply[:-1]])).logits[0, len(ids) - 1:]
        logprobs_R = torch.log_softmax(logits_RV.float(), -1).gather(1, torch.tensor(reply)[:, None])
        out[move] = logprobs_R.sum().exp().item()
    return out


def move_prob(trainer: MultiAgentTrainer, seat: str, totals: range, best: Callable[[int], int]) -> float:
    """Mean probability, over `totals`, that the seat's agent plays move `best(total)`. With
    replies that are the move itself, any policy that ignores the total scores exactly 1/3 on
    three totals (its three move probabilities, one per total): above 1/3 the agent reads the
    position. With replies that name the new total (`--race-reply total`) a policy must read the
    total to play legally at all (`legal_prob`), and a uniform choice among the legal replies
    scores 1/3."""
    return statistics.fmean(reply_probs(trainer, seat, t)[best(t)] for t in totals)


def win_totals() -> range:
    """The totals from which one move reaches the target (7..9 racing to 10, 6..8 to 9)."""
    game = RaceGame(**RACE["game"])
    return range(game.target - game.max_add, game.target)


def steer_totals() -> range:
    """The totals from which one move leaves the opponent `max_add + 1` short of the target, a
    lost position against perfect play (3..5 racing to 10, moving to 6; 2..4 racing to 9)."""
    game = RaceGame(**RACE["game"])
    safe = game.target - (game.max_add + 1)
    return range(safe - game.max_add, safe)


def take_win_prob(trainer: MultiAgentTrainer, seat: str) -> float:
    """P(move = target - total | total in `win_totals`). Under the reach rules (the target *or
    beyond* wins) a policy that always adds 3 wins from every one of those totals and scores 1/3
    here; under `--race-rules exact` (land on the target exactly) that move is the only one that
    wins."""
    target = RaceGame(**RACE["game"]).target
    return move_prob(trainer, seat, win_totals(), lambda t: target - t)


def uniform_take_win() -> float:
    """`take_win_prob` of a policy that reads the total and picks uniformly among the legal
    moves: 1/3 under the reach rules, more under `exact` (fewer legal moves near the target)."""
    game = RaceGame(**RACE["game"])
    game.reset(0)
    chances = []
    for total in win_totals():
        game.total = total
        chances.append(1 / game.largest_move())
    return statistics.fmean(chances)


def steer_prob(trainer: MultiAgentTrainer, seat: str) -> float:
    """P(move to target - max_add - 1 | total in `steer_totals`): the only winning move there, a
    different move at each total (3, 2, 1)."""
    safe = steer_totals().stop
    return move_prob(trainer, seat, steer_totals(), lambda t: safe - t)


def legal_prob(trainer: MultiAgentTrainer, seat: str) -> float:
    """P(a legal reply), the mean over the totals below the target of the legal replies'
    probabilities."""
    game = RaceGame(**RACE["game"])
    return statistics.fmean(sum(reply_probs(trainer, seat, t).values()) for t in range(game.target))


def run_race(seed: int) -> dict:
    print(f"== two agents: race to {RaceGame(**RACE['game']).target}, self-play, two LoRA adapters on one base ==",
          flush=True)
    t0 = time.perf_counter()
    seed_everything(seed)
    model, tok = load_model("tiny", seed=seed)
    s, r = RACE["sft"], RACE["rl"]
    sft(model, tok, RaceEnv.sft_examples(s["examples"], seed=seed, illegal_fraction=s["illegal_fraction"],
                                         read_fraction=s["read_fraction"], player=s["player"],
                                         random_fraction=s["random_fraction"], **RACE["game"]),
        s["steps"], s["batch_size"],
        s["learning_rate"], seed, "race")
    cfg = MultiAgentConfig(seed=seed, learning_rate=r["learning_rate"], groups_per_batch=r["groups_per_batch"],
                           group_size=r["group_size"], max_new_tokens=RaceGame(**RACE["game"]).reply_tokens(),
                           max_turns=r["max_turns"],
                           kl_coef=r["kl_coef"], scripted_opponents=tuple(r["scripted_opponents"]),
                           scripted_groups=r["scripted_groups"])
    trainer = MultiAgentTrainer(model, tok, functools.partial(RaceGame, **RACE["game"]), cfg)
    eval_seeds = [10_000_000 + i for i in range(RACE["eval_tasks"])]

    take_win: list[dict[str, float]] = []
    steer: list[dict[str, float]] = []
    legal: list[dict[str, float]] = []

    def win_rates() -> dict[str, float]:
        take_win.append({seat: take_win_prob(trainer, seat) for seat in trainer.seats})
        steer.append({seat: steer_prob(trainer, seat) for seat in trainer.seats})
        legal.append({seat: legal_prob(trainer, seat) for seat in trainer.seats})
        return {seat: trainer.evaluate(seat, lambda: RaceEnv(seat=seat, opponent=RACE["opponent"], **RACE["game"]),
                                       eval_seeds, temperature=RACE["eval_temperature"], seed=seed)
                for seat in trainer.seats}

    curve = [(0, win_rates())]
    print(f"  before: A {curve[0][1]['a']:.2f}  B {curve[0][1]['b']:.2f}  [{time.perf_counter() - t0:.0f} s]",
          flush=True)
    for it in range(r["iterations"]):
        m = trainer.run_iteration(it)
        if (it + 1) % RACE["eval_every"] == 0 or it + 1 == r["iterations"]:
            curve.append((it + 1, win_rates()))
            mixed = "".join(f"  vs pool {seat.upper()} {m[seat + '/win_rate_scripted']:.2f}" for seat in trainer.seats
                            if seat + "/win_rate_scripted" in m)
            print(f"  iteration {it + 1:>3}  self-play win A {m['a/win_rate_selfplay']:.2f}{mixed}  "
                  f"vs {RACE['opponent']}: A {curve[-1][1]['a']:.2f}  B {curve[-1][1]['b']:.2f}  "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    return {"curve": curve, "take_win": take_win, "steer": steer, "legal": legal,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "tools", "race"], default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=sorted(TOOLS_PRESETS), default="default",
                        help="setting of the tools part (see TOOLS_PRESETS)")
    parser.add_argument("--race-lr", type=float, default=RACE["rl"]["learning_rate"])
    parser.add_argument("--race-kl", type=float, default=RACE["rl"]["kl_coef"])
    parser.add_argument("--race-pool", default=",".join(RACE["rl"]["scripted_opponents"]),
                        help="scripted opponents mixed into race training ('' for self-play only)")
    parser.add_argument("--race-pool-groups", type=int, default=RACE["rl"]["scripted_groups"])
    parser.add_argument("--race-iterations", type=int, default=RACE["rl"]["iterations"])
    parser.add_argument("--race-sft-steps", type=int, default=RACE["sft"]["steps"])
    parser.add_argument("--race-sft-read", type=float, default=RACE["sft"]["read_fraction"],
                        help='share of warm-start examples that ask "What is the total?" (reading the position)')
    parser.add_argument("--race-sft-player", default=RACE["sft"]["player"], choices=sorted(SCRIPTED_PLAYERS),
                        help="scripted player whose moves the warm start imitates (random: the format only)")
    parser.add_argument("--race-sft-random", type=float, default=RACE["sft"]["random_fraction"],
                        help="share of the scripted player's warm-start moves replaced by random legal moves")
    parser.add_argument("--race-sft-examples", type=int, default=RACE["sft"]["examples"])
    parser.add_argument("--race-reply", choices=["move", "total"], default=RACE["game"]["reply"],
                        help="a move is the number added ('3') or the new total ('9' from 6)")
    parser.add_argument("--race-target", type=int, default=RACE["game"]["target"],
                        help="the total to race to (starts up to target - 4, as 0..6 racing to 10)")
    parser.add_argument("--race-rules", choices=["exact", "reach"],
                        default="exact" if RACE["game"]["exact"] else "reach",
                        help="exact: land on the target exactly (one winning move from the 3 totals below it); "
                             "reach: the target or more wins")
    args = parser.parse_args()
    RACE["sft"].update(steps=args.race_sft_steps, read_fraction=args.race_sft_read, player=args.race_sft_player,
                       random_fraction=args.race_sft_random, examples=args.race_sft_examples)
    RACE["game"].update(target=args.race_target, max_start=args.race_target - 4, exact=args.race_rules == "exact")
    RACE["game"]["reply"] = args.race_reply
    pool = tuple(p for p in args.race_pool.split(",") if p)
    RACE["rl"].update(learning_rate=args.race_lr, kl_coef=args.race_kl, scripted_opponents=pool,
                      scripted_groups=args.race_pool_groups if pool else 0, iterations=args.race_iterations)
    torch.set_num_threads(1)
    result: dict = {}
    tools_cfg = TOOLS_PRESETS[args.preset]
    tools = run_tools(tools_cfg, args.seed) if args.part in ("all", "tools") else None
    race = run_race(args.seed) if args.part in ("all", "race") else None
    print()
    if tools:
        b, a = tools["before"], tools["after"]
        rows = {"tool": "  success with calculator", "no_tool": "  success without tools"}
        print(f"{'multiplication (held-out, greedy)':<36}{'after SFT':>10}{'after RL':>10}")
        for c in tools_cfg.conditions:
            print(f"{rows[c]:<36}{b[c][0]:>10.2f}{a[c][0]:>10.2f}")
        if "tool" in tools_cfg.conditions:
            print(f"{'  episodes that call a tool':<36}{b['tool'][1]:>10.2f}{a['tool'][1]:>10.2f}")
        print(f"  (preset {args.preset}: {tools_cfg.sft_steps} SFT steps, {tools_cfg.rl_iterations} GRPO iterations, "
              f"{tools_cfg.eval_tasks} held-out problems, seed {args.seed}; {tools['seconds'] / 60:.1f} min)")
        result.update(tools_preset=args.preset, tools_seed=args.seed, tools_sft_steps=tools_cfg.sft_steps,
                      tools_rl_iterations=tools_cfg.rl_iterations, tools_eval_tasks=tools_cfg.eval_tasks,
                      tools_minutes=round(tools["seconds"] / 60, 1))
        if "tool" in tools_cfg.conditions:
            result.update(tools_sft=b["tool"][0], tools_rl=a["tool"][0],
                          tools_gain=round(a["tool"][0] - b["tool"][0], 4), tool_success=a["tool"][0])
        if "no_tool" in tools_cfg.conditions:
            result.update(no_tool_success=a["no_tool"][0])
    if race:
        curve = race["curve"]
        print(f"{'win rate vs ' + RACE['opponent'] + ' player':<36}" + "".join(f"{'it ' + str(i):>8}" for i, _ in curve))
        for seat, name in (("a", "agent A (moves first)"), ("b", "agent B (moves second)")):
            print(f"{'  ' + name:<36}" + "".join(f"{w[seat]:>8.2f}" for _, w in curve))
        blind = "uniform over the legal replies" if RACE["game"]["reply"] == "total" else "blind to the total"
        wins, steers = win_totals(), steer_totals()
        print(f"P(winning move | total {wins.start}..{wins.stop - 1}); {uniform_take_win():.2f} = {blind}")
        for seat in race["take_win"][0]:
            print(f"{'  agent ' + seat.upper():<36}" + "".join(f"{w[seat]:>8.2f}" for w in race["take_win"]))
        print(f"P(move to {steers.stop} | total {steers.start}..{steers.stop - 1}), the winning move there; "
              f"1/3 = {blind}")
        for seat in race["steer"][0]:
            print(f"{'  agent ' + seat.upper():<36}" + "".join(f"{w[seat]:>8.2f}" for w in race["steer"]))
        print(f"P(a legal reply | total 0..{wins.stop - 1})")
        for seat in race["legal"][0]:
            print(f"{'  agent ' + seat.upper():<36}" + "".join(f"{w[seat]:>8.2f}" for w in race["legal"]))
        print(f"  ({race['seconds'] / 60:.1f} min)")
        result.update(agent_a_before=curve[0][1]["a"], agent_a_after=curve[-1][1]["a"],
                      agent_b_before=curve[0][1]["b"], agent_b_after=curve[-1][1]["b"],
                      agent_a_min_during=min(w["a"] for _, w in curve[1:]),
                      agent_b_min_during=min(w["b"] for _, w in curve[1:]),
                      agent_a_take_win_before=race["take_win"][0]["a"], agent_a_take_win_after=race["take_win"][-1]["a"],
                      agent_b_take_win_before=race["take_win"][0]["b"], agent_b_take_win_after=race["take_win"][-1]["b"],
                      agent_a_steer_before=race["steer"][0]["a"], agent_a_steer_after=race["steer"][-1]["a"],
                      agent_b_steer_before=race["steer"][0]["b"], agent_b_steer_after=race["steer"][-1]["b"],
                      agent_a_legal_after=race["legal"][-1]["a"], agent_b_legal_after=race["legal"][-1]["b"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
