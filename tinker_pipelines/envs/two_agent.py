"""Games for two LLM agents, and a single-agent view of one seat against a scripted opponent.

A `TwoAgentGame` keeps the shared state; each seat has its own conversation. The seat to move
replies with text; the game answers with messages for each seat (usually the opponent learns
what was played) and, when the game ends, rewards for both seats that sum to zero.
`tinker_pipelines.loops.multiagent.run_games` drives two policies through such games; `VersusScripted`
turns one seat into an ordinary `Env`, so the usual episode runner, `check_env` and the training
loop can play it against a scripted opponent (and measure win rates).

`RaceGame` is the counting game "race to N": the players take turns adding 1..k to a running
total; whoever brings it to N or beyond wins (+1), the other loses (-1). A reply that is not a
number in 1..k is an illegal move: the mover pays a small penalty (to the other seat, so the game
stays zero-sum), is told so and moves again; only its `max_illegal + 1`-th illegal move of the
game forfeits. (When the first illegal reply forfeited at once, an agent that drifted off the
legal moves lost every game, its rewards became uniformly -1 and its GRPO groups carried no
gradient back: an absorbing collapse. With retries and a per-move penalty, fewer illegal moves
always means more reward, so the signal back to legal play never vanishes.) Perfect play leaves the opponent a distance to N that is a multiple of
k + 1, so there is a strategy to learn, and a random start makes both seats sometimes the favourite.
"""

from __future__ import annotations

import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from tinker_pipelines.envs.base import Env
from tinker_pipelines.types import Observation, StepResult


@dataclass(frozen=True)
class GameStep:
    """What `TwoAgentGame.step` returns."""

    observations: dict[str, Observation]
    """New messages for each seat (a seat missing from the dict gets none)."""
    rewards: dict[str, float]
    """Reward of each seat for this step; over a whole game they sum to zero for a zero-sum game."""
    done: bool
    """True when the game has ended."""
    info: dict[str, Any] = field(default_factory=dict)
    """Diagnostics (winner, forfeit, ...); never trained on."""


class TwoAgentGame(ABC):
    """A turn-based game between two seats; one instance per game, like `Env`."""

    seats: tuple[str, str] = ("a", "b")
    """Seat names; policies are assigned to seats."""
    zero_sum: bool = True
    """Whether the seats' total rewards must sum to zero (checked by the game runner)."""

    @abstractmethod
    def reset(self, seed: int | None = None) -> dict[str, Observation]:
        """Start a game; the opening messages of each seat (the same seed gives the same game)."""

    @property
    @abstractmethod
    def to_move(self) -> str:
        """The seat whose reply `step` expects next."""

    @abstractmethod
    def step(self, action: str) -> GameStep:
        """Apply the reply of the seat to move."""

    @property
    def task_id(self) -> str:
        return str(getattr(self, "_seed", ""))


class RaceGame(TwoAgentGame):
    """Race to `target`, adding 1..`max_add` per move; seat 'a' moves first from a seeded start.

    The start total is drawn from 0..`max_start` so that, with `balanced`, the first mover faces a
    lost position (against perfect play) in half of the games: both seats can win and must learn.
    """

    def __init__(self, target: int = 10, max_add: int = 3, max_start: int = 6, balanced: bool = True,
                 max_illegal: int = 2, illegal_penalty: float = 0.1, exact: bool = False, reply: str = "move"):
        """`max_illegal`: illegal replies a seat may make per game and move again (the next one
        forfeits; 0: the first forfeits); `illegal_penalty`: reward moved from the mover to the
        other seat for each illegal reply that does not forfeit. `exact`: the total must land on
        `target` exactly (a move past it is illegal), so that from `target - max_add` on exactly
        one move wins; otherwise reaching `target` or beyond wins, and adding `max_add` wins from
        every one of those totals whatever the total is. `reply`: what a move looks like: 'move',
        the number added ("3"); 'total', the total the move makes ("10" from 7), as players of
        counting games call it out.
        With 'total' no policy blind to the total can even play legally, and the winning replies
        are the same words from every total that allows them ("10" from 7, 8 or 9; "6" from 3..5
        is the only winning move there): a warm start on random legal moves already has to read
        the total, and RL then has a strategy it can express (see docs/environments.md, "Race")."""
        if max_add < 1 or target < 2:
            raise ValueError(f"env.kwargs: need max_add >= 1 and target >= 2, got {max_add}, {target}")
        if not 0 <= max_start < target - max_add:
            raise ValueError(f"env.kwargs.max_start must be in [0, target - max_add), got {max_start}")
        if max_illegal < 0:
            raise ValueError(f"env.kwargs.max_illegal must be >= 0, got {max_illegal}")
        if not 0 <= illegal_penalty < 1:
            raise ValueError(f"env.kwargs.illegal_penalty must be in [0, 1), got {illegal_penalty}")
        if not isinstance(exact, bool):
            raise ValueError(f"env.kwargs.exact must be true or false, got {exact!r}")
        if reply not in ("move", "total"):
            raise ValueError(f"env.kwargs.reply must be 'move' or 'total', got {reply!r}")
        self.target, self.max_add, self.max_start, self.balanced = target, max_add, max_start, balanced
        self.max_illegal, self.illegal_penalty, self.exact, self.reply = max_illegal, illegal_penalty, exact, reply
        self.total: int | None = None
        self.done = True
        self._to_move = "a"

    def rules(self) -> str:
        how = "Reply with one number." if self.reply == "move" else "Reply with the new total."
        if self.exact:
            return (f"Race to {self.target}. Players take turns adding 1 to {self.max_add} to the total, "
                    f"never past {self.target}. Whoever makes the total exactly {self.target} wins. {how}")
        return (f"Race to {self.target}. Players take turns adding 1 to {self.max_add} to the total. "
                f"Whoever makes the total {self.target} or more wins. {how}")

    def format_move(self, move: int) -> str:
        """The reply that plays `move` now (what the scripted players and the warm start say)."""
        return str(move) if self.reply == "move" else str(self.total + move)

    def reply_tokens(self) -> int:
        """The most tokens a legal reply takes when digits are single tokens (a rollout's
        `max_new_tokens`: room for more lets a drifting policy write past the move)."""
        if self.reply == "move":
            return len(str(self.max_add))
        return len(str(self.target if self.exact else self.target - 1 + self.max_add))

    def largest_move(self) -> int:
        """The largest legal move now (`max_add`, or less near the target under `exact`)."""
        return min(self.max_add, self.target - self.total) if self.exact else self.max_add

    def reset(self, seed: int | None = None) -> dict[str, Observation]:
        self._seed = seed if seed is not None else random.randrange(2**31)
        rng = random.Random(self._seed)
        starts = list(range(self.max_start + 1))
        if self.balanced:
            lost = [t for t in starts if (self.target - t) % (self.max_add + 1) == 0]
            won = [t for t in starts if t not in lost]
            starts = lost if lost and won and rng.random() < 0.5 else won or lost
        self.total = rng.choice(starts)
        self.done, self._to_move, self.moves = False, "a", []
        self.illegal = {"a": 0, "b": 0}
        system = {"role": "system", "content": self.rules()}
        return {"a": [system, {"role": "user", "content": f"Total is {self.total}. Your move."}], "b": [system]}

    @property
    def to_move(self) -> str:
        return self._to_move

    def parse_move(self, action: str) -> int | None:
        """The number played, or None when the reply is not a legal move."""
        m = re.fullmatch(r"\s*(\d{1,3})\s*\.?\s*", action)
        if m is None:
            return None
        move = int(m.group(1)) - (self.total if self.reply == "total" else 0)
        return move if 1 <= move <= self.largest_move() else None

    def step(self, action: str) -> GameStep:
        if self.total is None:
            raise RuntimeError("RaceGame.step() called before reset()")
        if self.done:
            raise RuntimeError("RaceGame.step() called after the game ended; call reset()")
        mover = self._to_move
        other = "b" if mover == "a" else "a"
        move = self.parse_move(action)
        if move is None:
            self.illegal[mover] += 1
            if self.illegal[mover] > self.max_illegal:  # forfeit
                self.done = True
                return GameStep({}, {mover: -1.0, other: 1.0}, True, {"winner": other, "forfeit": True})
            what = (f"one number from 1 to {self.largest_move()}" if self.reply == "move" else
                    f"the new total, from {self.total + 1} to {self.total + self.largest_move()}")
            text = f"Illegal move. Reply with {what}. Total is {self.total}. Your move."
            p = self.illegal_penalty
            return GameStep({mover: [{"role": "user", "content": text}]}, {mover: -p, other: p}, False,
                            {"illegal": mover})
        self.total += move
        self.moves.append(move)
        if self.total >= self.target:
            self.done = True
            return GameStep({}, {mover: 1.0, other: -1.0}, True, {"winner": mover, "forfeit": False})
        self._to_move = other
        text = f"Opponent adds {move}. Total is {self.total}. Your move."
        return GameStep({other: [{"role": "user", "content": text}]}, {mover: 0.0, other: 0.0}, False, {})

    # -- scripted players ------------------------------------------------------------------
    def optimal_move(self) -> int:
        """Leave the opponent a multiple of max_add + 1 to go; 1 when no move does."""
        return (self.target - self.total) % (self.max_add + 1) or 1


def random_player(game: RaceGame, rng: random.Random) -> str:
    """A uniformly random legal move."""
    return game.format_move(rng.randint(1, game.largest_move()))


def greedy_player(game: RaceGame, rng: random.Random) -> str:
    """Wins when the target is within reach, otherwise plays at random."""
    need = game.target - game.total
    return game.format_move(need) if need <= game.max_add else random_player(game, rng)


def optimal_player(game: RaceGame, rng: random.Random) -> str:
    """Perfect play."""
    return game.format_move(game.optimal_move())


SCRIPTED_PLAYERS: dict[str, Callable[[Any, random.Random], str]] = {
    "random": random_player, "greedy": greedy_player, "optimal": optimal_player,
}
"""Scripted opponents for `RaceGame`, by name."""


class VersusScripted(Env):
    """One seat of a two-agent game as an `Env`: the opponent's replies come from a script.

    The agent sees exactly the messages it would see against another agent, so a policy trained
    in self-play is evaluated here unchanged. Reward: the seat's reward when the game ends.
    """

    def __init__(self, game: TwoAgentGame, seat: str, opponent: Callable[[Any, random.Random], str]):
        if seat not in game.seats:
            raise ValueError(f"env.kwargs.seat must be one of {game.seats}, got {seat!r}")
        self.game, self.seat, self.opponent = game, seat, opponent
        self._started = False
        self._done = True

    def _play_opponent(self, pending: list) -> GameStep | None:
        """Let the opponent move until it is our turn or the game ends; returns the final step."""
        while self.game.to_move != self.seat:
            result = self.game.step(self.opponent(self.game, self._rng))
            pending += result.observations.get(self.seat, [])
            self._reward += result.rewards.get(self.seat, 0.0)
            if result.done:
                return result
        return None

    def reset(self, seed: int | None = None) -> Observation:
        self._seed = seed if seed is not None else random.randrange(2**31)
        self._rng = random.Random(f"opponent-{self._seed}")
        opening = self.game.reset(self._seed)
        messages = list(opening[self.seat])
        self._reward, self._started, self._done = 0.0, True, False
        if self._play_opponent(messages) is not None:
            raise RuntimeError(f"{type(self.game).__name__} ended before seat {self.seat!r} moved")
        return messages

    def _end(self, result: GameStep) -> StepResult:
        self._done = True
        win = float(result.info.get("winner") == self.seat)
        return StepResult([], self._reward, True, {**result.info, "win": win, "exact": win})

    def step(self, action: str) -> StepResult:
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        if self._done:
            raise RuntimeError(f"{type(self).__name__}.step() called after the episode ended; call reset()")
        self._reward = 0.0
        result = self.game.step(action)
        self._reward += result.rewards.get(self.seat, 0.0)
        if result.done:
            return self._end(result)
        pending = list(result.observations.get(self.seat, []))
        final = self._play_opponent(pending)
        if final is not None:
            return self._end(final)
        return StepResult(pending, self._reward, False, {})


class RaceEnv(VersusScripted):
    """`RaceGame`, one seat against a scripted player ('random', 'greedy' or 'optimal')."""

    def __init__(self, seat: str = "a", opponent: str = "greedy", target: int = 10, max_add: int = 3,
                 max_start: int = 6, balanced: bool = True, max_illegal: int = 2, illegal_penalty: float = 0.1,
                 exact: bool = False, reply: str = "move"):
        if opponent not in SCRIPTED_PLAYERS:
            raise ValueError(f"env.kwargs.opponent must be one of {', '.join(SCRIPTED_PLAYERS)}, got {opponent!r}")
        super().__init__(RaceGame(target, max_add, max_start, balanced, max_illegal, illegal_penalty, exact, reply),
                         seat,
                         SCRIPTED_PLAYERS[opponent])

    @staticmethod
    def sft_examples(n: int, seed: int = 0, illegal_fraction: float = 0.0, read_fraction: float = 0.0,
                     player: str = "random", random_fraction: float = 0.0,
                     **game_kwargs: Any) -> list[tuple[list, str]]:
        """Legal moves of the scripted `player` (default: random, the format and not the strategy)
        from both seats' points of view; `player="greedy"` demonstrates "win when you can" and
        nothing else (its other moves are random), so the policy reads the total from the start
        and the rest of the strategy is left to RL. With `random_fraction`, that share of the
        demonstrator's moves is a random legal move instead: a weaker teacher whose imitation still
        depends on the total (the tiny model learns to read the total from dense targets such as
        the optimal player's, not from the greedy player's 3 totals in 10) and leaves RL room.
        With `illegal_fraction`, that share of moves comes after an illegal reply and the game's
        answer to it (the illegal reply is context only, never a target): how to recover.
        With `read_fraction`, that share of the examples asks "What is the total?" after a game
        message and answers the total: the model learns to read the position (random moves alone
        never depend on it, and a policy that ignores the total cannot learn the game), still
        nothing of the strategy."""
        if not 0 <= read_fraction < 1:
            raise ValueError(f"sft.read_fraction must be in [0, 1), got {read_fraction}")
        if player not in SCRIPTED_PLAYERS:
            raise ValueError(f"sft.player must be one of {', '.join(SCRIPTED_PLAYERS)}, got {player!r}")
        if not 0 <= random_fraction <= 1:
            raise ValueError(f"sft.random_fraction must be in [0, 1], got {random_fraction}")
        demonstrator = SCRIPTED_PLAYERS[player]
        kwargs = {k: v for k, v in game_kwargs.items()
                  if k in ("target", "max_add", "max_start", "balanced", "max_illegal", "illegal_penalty", "exact",
                           "reply")}
        rng = random.Random(seed)
        out: list[tuple[list, str]] = []
        rules = {"role": "system", "content": RaceGame(**kwargs).rules()}
        target, max_add = kwargs.get("target", 10), kwargs.get("max_add", 3)
        for _ in range(round(n * read_fraction)):
            total = rng.randrange(target)
            said = rng.choice([f"Total is {total}.", f"Opponent adds {rng.randint(1, max_add)}. Total is {total}."])
            out.append(([rules, {"role": "user", "content": f"{said} What is the total?"}], str(total)))
        while len(out) < n:
            game = RaceGame(**kwargs)
            views = {s: list(m) for s, m in game.reset(rng.randrange(2**31)).items()}
            while not game.done and len(out) < n:
                seat = game.to_move
                if rng.random() < illegal_fraction and game.illegal[seat] < game.max_illegal:
                    wrong = rng.choice([game.format_move(0), game.format_move(game.max_add + 1),
                                        str(rng.randint(10, 99)), "x"])
                    if game.reply == "total" and rng.random() < 0.5:  # a misread total
                        wrong = str(rng.randrange(game.target + game.max_add))
                    if game.parse_move(wrong) is not None:  # by chance a legal reply after all
                        wrong = "x"
                    views[seat].append({"role": "assistant", "content": wrong})
                    for s, obs in game.step(wrong).observations.items():
                        views[s] += obs
                move = (random_player if rng.random() < random_fraction else demonstrator)(game, rng)
                out.append((list(views[seat]), move))
                views[seat].append({"role": "assistant", "content": move})
                for s, obs in game.step(move).observations.items():
                    views[s] += obs
        if read_fraction:
            rng.shuffle(out)
        return out
