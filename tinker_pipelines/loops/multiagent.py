"""Two agents trained together: two LoRA adapters on one resident base model.

`run_games` is the episode runner for two-seat games (`envs.two_agent.TwoAgentGame`). It uses the
same pieces as `rollout.episodes.run_episodes` (the batched `Sampler`, `env_reply_tokens`,
token-exact `Turn`s): each round, the games waiting on seat 'a' are sampled in one batch with
agent a's adapter active, then those waiting on seat 'b' with agent b's. Every seat keeps its own
conversation and token context; the opponent's moves reach it as environment messages (weight 0
in training). Each game gives one `Trajectory` per seat, and the runner checks that a zero-sum
game's seat rewards sum to zero.

`MultiAgentTrainer` holds one `Learner` per seat over a shared `PeftModel` and runs self-play
iterations: rollout, then a GRPO (or any registered algorithm) step per agent on its own
trajectories, grouped by game seed. Training one agent never touches the other's adapter.
With `scripted_opponents`, each agent also plays groups against scripted players every iteration
(an opponent pool: its reward then depends on its own play even while the other agent is weak or
moving), and those groups join its self-play groups in the same step.
Pure library: no dagster.
"""

from __future__ import annotations

import dataclasses

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tinker_pipelines.algorithms.losses import LossConfig
from tinker_pipelines.algorithms.registry import get_algorithm
from tinker_pipelines.loops.datums import rl_datums
from tinker_pipelines.envs.base import Env, EnvError
from tinker_pipelines.envs.two_agent import SCRIPTED_PLAYERS, GameStep, TwoAgentGame, VersusScripted
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.models import encode_chat, stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, env_reply_tokens, run_episodes
from tinker_pipelines.rollout.settings import SamplingSettings
from tinker_pipelines.rollout.sampler import Sampler, completion_text
from tinker_pipelines.types import Message, Trajectory, TrajectoryGroup, Turn


@dataclass
class AgentPolicy:
    """What plays a seat: a sampler and how to make its weights the active ones."""

    sampler: Sampler
    activate: Callable[[], None] = lambda: None
    """Called before sampling (e.g. `Learner.activate`, selecting the agent's adapter)."""


@dataclass
class _Seat:
    messages: list[Message]
    context: list[int] | None = None
    pending: list[Message] = field(default_factory=list)
    last_action: str = ""
    last_sampled: tuple[int, ...] = ()
    turns: list[Turn] = field(default_factory=list)
    final_reward: float = 0.0


@dataclass
class _Game:
    game: TwoAgentGame
    task_id: str
    seats: dict[str, _Seat]
    stop_reason: str | None = None
    info: dict = field(default_factory=dict)


def _checked_game_step(game: TwoAgentGame, action: str) -> GameStep:
    name = type(game).__name__
    try:
        result = game.step(action)
    except Exception as e:
        raise EnvError(f"game {name} raised in step(): {type(e).__name__}: {e}") from e
    for seat, r in result.rewards.items():
        if not isinstance(r, (int, float)) or not math.isfinite(r):
            raise EnvError(f"game {name} returned a non-finite reward {r!r} for seat {seat!r}")
    return result


def run_games(policies: dict[str, AgentPolicy], tokenizer: PreTrainedTokenizerBase, games: list[TwoAgentGame],
              seeds: list[int], cfg: RolloutConfig,
              generator: torch.Generator | None = None) -> list[dict[str, Trajectory]]:
    """Play one game per seed, all batched; returns each game's trajectory per seat.

    `cfg.max_turns` bounds each seat's actions; a game cut short (max_turns or context
    overflow) gives both seats 0.
    """
    states = []
    for game, seed in zip(games, seeds, strict=True):
        if set(policies) != set(game.seats):
            raise ValueError(f"policies are for seats {sorted(policies)}, the game has {list(game.seats)}")
        try:
            opening = game.reset(seed)
        except Exception as e:
            raise EnvError(f"game {type(game).__name__} raised in reset(): {type(e).__name__}: {e}") from e
        seats = {s: _Seat(list(opening.get(s, []))) for s in game.seats}
        states.append(_Game(game, game.task_id or str(seed), seats))
    while live := [g for g in states if g.stop_reason is None]:
        for seat_name, policy in policies.items():
            movers = []
            for g in live:
                if g.stop_reason is not None or g.game.to_move != seat_name:
                    continue
                s = g.seats[seat_name]
                if len(s.turns) >= cfg.max_turns:
                    g.stop_reason = "max_turns"
                    continue
                if s.context is None:  # first action of this seat: render what it has seen so far
                    s.messages += s.pending
                    s.context = encode_chat(tokenizer, s.messages)
                else:
                    reply = env_reply_tokens(tokenizer, s.messages, s.last_action, list(s.last_sampled), s.pending)
                    s.messages += [{"role": "assistant", "content": s.last_action}, *s.pending]
                    s.context = s.context + list(s.last_sampled) + reply
                s.pending = []
                limit = policy.sampler.max_context
                if limit is not None and len(s.context) + cfg.max_new_tokens > limit:
                    g.stop_reason = "context_overflow"
                    continue
                movers.append(g)
            if not movers:
                continue
            policy.activate()
            samples = policy.sampler.sample([g.seats[seat_name].context for g in movers], cfg.max_new_tokens,
                                            cfg.temperature, generator, **cfg.sampling_kwargs())
            for g, smp in zip(movers, samples):
                s = g.seats[seat_name]
                action = completion_text(tokenizer, smp, policy.sampler.stop_token_ids)
                result = _checked_game_step(g.game, action)
                s.turns.append(Turn(tuple(s.context), smp.tokens, smp.logprobs,
                                    float(result.rewards.get(seat_name, 0.0)), action, smp.support))
                s.last_action, s.last_sampled = action, smp.tokens
                for other, r in result.rewards.items():
                    if other != seat_name:
                        g.seats[other].final_reward += float(r)
                for other, obs in result.observations.items():
                    g.seats[other].pending += list(obs)
                g.info = dict(result.info)
                if result.done:
                    g.stop_reason = "done"
        live = [g for g in states if g.stop_reason is None]
    out = []
    for g in states:
        if g.stop_reason != "done":  # cut short: nobody wins
            for s in g.seats.values():
                s.turns = [dataclasses.replace(t, reward=0.0) for t in s.turns]
                s.final_reward = 0.0
        trajs = {name: Trajectory(tuple(s.turns), s.final_reward, g.task_id, g.stop_reason or "done",
                                  {**g.info, "seat": name}) for name, s in g.seats.items()}
        if g.game.zero_sum:
            total = sum(t.total_reward for t in trajs.values())
            if abs(total) > 1e-6:
                raise EnvError(f"game {type(g.game).__name__} is zero-sum but its rewards sum to {total} "
                               f"(task {g.task_id})")
        out.append(trajs)
    return out


@dataclass(frozen=True)
class MultiAgentConfig(SamplingSettings):
    """Self-play training of one LoRA adapter per seat; games are sampled with the inherited
    `SamplingSettings` (a move's tokens, moves per seat, temperature, truncation, stop strings)."""

    max_new_tokens: int = 4
    """Tokens per move."""
    max_turns: int = 8
    """Actions per seat before a game is cut off (both get 0)."""
    seed: int = 0
    algorithm: str = "grpo"
    learning_rate: float = 5e-3
    lora_rank: int = 8
    lora_alpha: float = 16.0
    groups_per_batch: int = 8
    """Game seeds per iteration."""
    group_size: int = 8
    """Games per seed: each seat's G trajectories of one seed form a group."""
    micro_batch_size: int = 64
    kl_coef: float = 0.0
    """Weight of a KL penalty to the shared base (each adapter disabled); keeps the format."""
    scripted_opponents: tuple[str, ...] = ()
    """Scripted players (names in the trainer's `scripted_players`) each agent also plays every
    iteration, besides self-play: an opponent pool whose play does not move with the other agent."""
    scripted_groups: int = 0
    """Seeds per seat per iteration against the pool (cycled over `scripted_opponents`), each
    `group_size` games; their groups join the seat's self-play groups in one optimizer step."""

    def __post_init__(self) -> None:
        self.check_sampling("multiagent.")
        if self.scripted_groups < 0:
            raise ValueError(f"multiagent.scripted_groups must be >= 0, got {self.scripted_groups}")
        if self.scripted_groups and not self.scripted_opponents:
            raise ValueError("multiagent.scripted_opponents is empty but scripted_groups > 0")


def seat_groups(games: list[dict[str, Trajectory]], seat: str, group_size: int) -> list[TrajectoryGroup]:
    """The seat's trajectories grouped by consecutive `group_size` games (one seed each); episodes
    in which the seat never acted are left out."""
    groups = []
    for i in range(0, len(games), group_size):
        trajs = tuple(g[seat] for g in games[i:i + group_size] if g[seat].turns)
        if len(trajs) >= 2:
            groups.append(TrajectoryGroup(trajs))
    return groups


class MultiAgentTrainer:
    """Two (or more) agents, one LoRA adapter each, on one resident base model."""

    def __init__(self, base_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 make_game: Callable[[], TwoAgentGame], cfg: MultiAgentConfig = MultiAgentConfig(),
                 scripted_players: dict[str, Callable] | None = None):
        """`scripted_players`: the pool `cfg.scripted_opponents` names from (default: the race
        players of `envs.two_agent.SCRIPTED_PLAYERS`)."""
        self.cfg, self.tokenizer, self.make_game = cfg, tokenizer, make_game
        self.scripted_players = SCRIPTED_PLAYERS if scripted_players is None else scripted_players
        for name in cfg.scripted_opponents:
            if name not in self.scripted_players:
                raise ValueError(f"multiagent.scripted_opponents: unknown player {name!r} "
                                 f"(known: {', '.join(self.scripted_players)})")
        self.algorithm = get_algorithm(cfg.algorithm)
        self.loss_cfg = LossConfig(kl_coef=cfg.kl_coef)
        lcfg = LearnerConfig(mode="lora", learning_rate=cfg.learning_rate, lora_rank=cfg.lora_rank,
                             lora_alpha=cfg.lora_alpha, temperature=cfg.temperature if cfg.temperature > 0 else 1.0,
                             top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p, micro_batch_size=cfg.micro_batch_size,
                             needs_reference=cfg.kl_coef > 0)
        self.seats = make_game().seats
        self.learners: dict[str, Learner] = {}
        model = base_model
        for seat in self.seats:
            learner = Learner(model, lcfg, tokenizer.pad_token_id, adapter_name=f"agent_{seat}")
            model = learner.model
            self.learners[seat] = learner
        self.model = model
        self.sampler = Sampler(model, tokenizer.pad_token_id, stop_token_ids(tokenizer), tokenizer=tokenizer)
        self.rollout_cfg = cfg.sampling()
        self.iteration = 0

    def policies(self) -> dict[str, AgentPolicy]:
        return {seat: AgentPolicy(self.sampler, learner.activate) for seat, learner in self.learners.items()}

    def rollout(self, iteration: int) -> list[dict[str, Trajectory]]:
        """`groups_per_batch` seeds x `group_size` games of self-play, sampled at `temperature`."""
        from tinker_pipelines.loops.experiment import derived_seed

        rng = random.Random(derived_seed(self.cfg.seed, "games", iteration))
        seeds = [rng.randrange(2**31) for _ in range(self.cfg.groups_per_batch)]
        seeds = [s for s in seeds for _ in range(self.cfg.group_size)]
        gen = torch.Generator().manual_seed(derived_seed(self.cfg.seed, "game-sample", iteration))
        return run_games(self.policies(), self.tokenizer, [self.make_game() for _ in seeds], seeds,
                         self.rollout_cfg, gen)

    def rollout_scripted(self, iteration: int, seat: str) -> list[TrajectoryGroup]:
        """`scripted_groups` seeds x `group_size` games of `seat`'s agent against the scripted pool
        (seed k plays `scripted_opponents[k % len]`); one group per seed: the same start and
        opponent script, so the group baseline compares the agent's own moves."""
        from tinker_pipelines.loops.experiment import derived_seed

        cfg = self.cfg
        if not cfg.scripted_groups:
            return []
        rng = random.Random(derived_seed(cfg.seed, "scripted-games", seat, iteration))
        seeds = [rng.randrange(2**31) for _ in range(cfg.scripted_groups)]
        names = [cfg.scripted_opponents[k % len(cfg.scripted_opponents)] for k in range(len(seeds))]
        envs = [VersusScripted(self.make_game(), seat, self.scripted_players[n]) for n in names
                for _ in range(cfg.group_size)]
        seeds = [s for s in seeds for _ in range(cfg.group_size)]
        gen = torch.Generator().manual_seed(derived_seed(cfg.seed, "scripted-sample", seat, iteration))
        self.learners[seat].activate()
        trajs = run_episodes(self.sampler, self.tokenizer, envs, seeds, self.rollout_cfg, gen)
        return [TrajectoryGroup(tuple(trajs[i:i + cfg.group_size])) for i in range(0, len(trajs), cfg.group_size)]

    def train_step(self, games: list[dict[str, Trajectory]], seats: tuple[str, ...] | None = None,
                   extra_groups: dict[str, list[TrajectoryGroup]] | None = None) -> dict[str, float]:
        """One optimizer step per seat in `seats` (default: all) on its own trajectories (self-play
        groups plus that seat's `extra_groups`, e.g. games against the scripted pool)."""
        metrics: dict[str, float] = {}
        for seat in seats or self.seats:
            groups = seat_groups(games, seat, self.cfg.group_size) + list((extra_groups or {}).get(seat, []))
            datums = rl_datums(groups, self.algorithm.advantages) if groups else []
            metrics[f"{seat}/informative_groups"] = float(sum(len(set(g.rewards)) > 1 for g in groups))
            if not datums:
                continue
            learner = self.learners[seat]
            m = learner.forward_backward(datums, self.algorithm.loss, self.loss_cfg)
            m.update(learner.optim_step())
            metrics.update({f"{seat}/{k}": v for k, v in m.items()})
        return metrics

    def run_iteration(self, iteration: int, seats: tuple[str, ...] | None = None) -> dict[str, float]:
        games = self.rollout(iteration)
        metrics = {"iteration": float(iteration)}
        for seat in self.seats:
            rewards = [g[seat].total_reward for g in games]
            metrics[f"{seat}/reward_mean"] = statistics.fmean(rewards)
            metrics[f"{seat}/win_rate_selfplay"] = statistics.fmean(float(r > 0) for r in rewards)
        metrics["cut_short"] = statistics.fmean(float(g[self.seats[0]].stop_reason != "done") for g in games)
        extra = {seat: self.rollout_scripted(iteration, seat) for seat in seats or self.seats}
        for seat, groups in extra.items():
            if groups:
                metrics[f"{seat}/win_rate_scripted"] = statistics.fmean(
                    float(t.info.get("win", 0.0)) for g in groups for t in g.trajectories)
        metrics.update(self.train_step(games, seats, extra))
        self.iteration = iteration + 1
        return metrics

    def evaluate(self, seat: str, make_env: Callable[[], Env], seeds: list[int], key: str = "win",
                 temperature: float = 0.0, seed: int = 0) -> float:
        """Mean `info[key]` of `seat`'s agent's episodes in single-agent envs (e.g. against a
        scripted opponent: `envs.two_agent.RaceEnv(seat=..., opponent='greedy')`); greedy by
        default, else sampled at `temperature` with a generator seeded from `seed`."""
        self.learners[seat].activate()
        cfg = dataclasses.replace(self.rollout_cfg, temperature=temperature)
        gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
        trajs = run_episodes(self.sampler, self.tokenizer, [make_env() for _ in seeds], seeds, cfg, gen)
        return statistics.fmean(float(t.info.get(key, 0.0)) for t in trajs)
