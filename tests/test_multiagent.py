"""Two agents: zero-sum games, the batched two-policy runner, one adapter per agent on one base."""

import random

import pytest
import torch

from tinker_pipelines.loops.datums import trajectory_to_datum
from tinker_pipelines.envs import EnvError
from tinker_pipelines.envs.two_agent import SCRIPTED_PLAYERS, GameStep, RaceEnv, RaceGame, TwoAgentGame
from tinker_pipelines.models import stop_token_ids
from tinker_pipelines.loops.multiagent import AgentPolicy, MultiAgentConfig, MultiAgentTrainer, run_games
from tinker_pipelines.rollout.episodes import RolloutConfig
from tinker_pipelines.rollout.sampler import Sample


def test_race_rewards_are_zero_sum():
    rng = random.Random(0)
    for seed in range(300):
        game = RaceGame()
        game.reset(seed)
        totals = {"a": 0.0, "b": 0.0}
        illegal = 0
        while True:
            action = rng.choice(["1", "2", "3", "4", "x", " 2 "]) if rng.random() < 0.2 else \
                SCRIPTED_PLAYERS[rng.choice(list(SCRIPTED_PLAYERS))](game, rng)
            step = game.step(action)
            illegal += "illegal" in step.info
            for seat, r in step.rewards.items():
                totals[seat] += r
            if step.done:
                break
        assert abs(totals["a"] + totals["b"]) < 1e-9
        assert abs(abs(totals["a"]) - 1) <= 0.1 * illegal + 1e-9  # +-1 for the result, 0.1 per illegal reply


class _Scripted:
    """A sampler that plays legal race moves (so games last several turns)."""

    def __init__(self, tok, move="1"):
        self.tok, self.move = tok, move
        self.stop_token_ids, self.max_context = stop_token_ids(tok), 1024

    def sample(self, prompts, max_new_tokens, temperature=1.0, generator=None):
        toks = tuple(self.tok.encode(self.move, add_special_tokens=False) + [self.tok.eos_token_id])
        return [Sample(toks, tuple(-0.1 for _ in toks), "stop") for _ in prompts]


def test_run_games_token_exact_and_zero_sum(tiny):
    _, tok = tiny
    policies = {"a": AgentPolicy(_Scripted(tok, "1")), "b": AgentPolicy(_Scripted(tok, "2"))}
    seeds = [0, 1, 2, 3]
    games = run_games(policies, tok, [RaceGame() for _ in seeds], seeds, RolloutConfig(max_new_tokens=4, max_turns=10))
    for seed, g in zip(seeds, games):
        assert g["a"].total_reward + g["b"].total_reward == 0 and abs(g["a"].total_reward) == 1
        assert g["a"].info["winner"] in ("a", "b")
        for seat in "ab":
            traj = g[seat]
            assert len(traj.turns) >= 2
            for t0, t1 in zip(traj.turns, traj.turns[1:]):  # each context extends the last, token for token
                n = len(t0.prompt_tokens) + len(t0.sampled_tokens)
                assert t1.prompt_tokens[:n] == t0.prompt_tokens + t0.sampled_tokens
                assert "Opponent adds" in tok.decode(t1.prompt_tokens[n:])  # the other agent's move ...
            d = trajectory_to_datum(traj, 1.0)
            assert sum(d.weights) == traj.num_sampled_tokens  # ... carries no loss


class _Sequence:
    """A sampler that plays the given replies in turn (one per call, the same for every prompt)."""

    def __init__(self, tok, moves):
        self.tok, self.moves = tok, list(moves)
        self.stop_token_ids, self.max_context = stop_token_ids(tok), 1024

    def sample(self, prompts, max_new_tokens, temperature=1.0, generator=None):
        toks = tuple(self.tok.encode(self.moves.pop(0), add_special_tokens=False) + [self.tok.eos_token_id])
        return [Sample(toks, tuple(-0.1 for _ in toks), "stop") for _ in prompts]


def test_illegal_move_is_retried_with_a_penalty_in_self_play(tiny):
    _, tok = tiny
    # a: illegal, then legal moves; b: always legal. The retry is a turn of a's own context.
    policies = {"a": AgentPolicy(_Sequence(tok, ["9", "1", "1", "1", "1", "1"])),
                "b": AgentPolicy(_Scripted(tok, "1"))}
    (g,) = run_games(policies, tok, [RaceGame()], [0], RolloutConfig(max_new_tokens=4, max_turns=10))
    a, b = g["a"], g["b"]
    assert a.turns[0].reward == -0.1 and a.turns[0].action_text == "9"
    n = len(a.turns[0].prompt_tokens) + len(a.turns[0].sampled_tokens)
    assert a.turns[1].prompt_tokens[:n] == a.turns[0].prompt_tokens + a.turns[0].sampled_tokens
    assert "Illegal move" in tok.decode(a.turns[1].prompt_tokens[n:])
    assert abs(a.total_reward + b.total_reward) < 1e-9 and abs(abs(a.total_reward) - 1) == pytest.approx(0.1)
    assert not g["a"].info.get("forfeit")


def test_sft_examples_teach_recovery_after_an_illegal_move():
    examples = RaceEnv.sft_examples(400, seed=0, illegal_fraction=0.3)
    assert all(reply in ("1", "2", "3") for _, reply in examples)
    recover = [m for m, _ in examples if any("Illegal move" in x["content"] for x in m)]
    assert 0.1 * len(examples) < len(recover) < 0.5 * len(examples)
    assert not any("Illegal move" in x["content"] for m, _ in RaceEnv.sft_examples(100, seed=0) for x in m)


class _LongerWins(TwoAgentGame):
    """Each seat says one thing; the longer reply wins (zero-sum), so random replies differ in reward."""

    def reset(self, seed=None):
        self._seed, self.said, self.turn = seed, {}, "a"
        return {s: [{"role": "user", "content": "Say something long."}] for s in self.seats}

    @property
    def to_move(self):
        return self.turn

    def step(self, action):
        self.said[self.turn] = len(action)
        if self.turn == "a":
            self.turn = "b"
            return GameStep({"b": [{"role": "user", "content": "Your turn."}]}, {}, False)
        r = float(self.said["a"] > self.said["b"]) - float(self.said["a"] < self.said["b"])
        return GameStep({}, {"a": r, "b": -r}, True, {"winner": "a" if r > 0 else "b" if r < 0 else None})


class _NotZeroSum(_LongerWins):
    def step(self, action):
        out = super().step(action)
        return GameStep(out.observations, {"a": 1.0, "b": 1.0}, out.done) if out.done else out


def test_non_zero_sum_rewards_are_caught(tiny):
    _, tok = tiny
    policies = {"a": AgentPolicy(_Scripted(tok)), "b": AgentPolicy(_Scripted(tok))}
    with pytest.raises(EnvError, match="zero-sum"):
        run_games(policies, tok, [_NotZeroSum()], [0], RolloutConfig(max_new_tokens=4))


def test_training_agent_a_leaves_agent_b_untouched(tiny):
    model, tok = tiny
    cfg = MultiAgentConfig(groups_per_batch=3, group_size=4, max_new_tokens=6, learning_rate=5e-2)
    trainer = MultiAgentTrainer(model, tok, _LongerWins, cfg)
    a, b = trainer.learners["a"], trainer.learners["b"]
    assert a.model is b.model is trainer.model and a.adapter_name != b.adapter_name
    b_before = [p.detach().clone() for p in b.params]
    a_before = [p.detach().clone() for p in a.params]
    for it in range(2):  # LoRA B starts at zero: both factors move from the second step
        metrics = trainer.run_iteration(it, seats=("a",))
        assert metrics["a/informative_groups"] > 0 and "b/loss" not in metrics
    assert all(torch.equal(x, y) for x, y in zip(b_before, b.params))
    assert all(not torch.equal(x, y) for x, y in zip(a_before, a.params))
    # each agent samples with its own adapter: logprobs of its samples match its learner
    games = trainer.rollout(5)
    for seat in "ab":
        from tinker_pipelines.loops.datums import rl_datums
        from tinker_pipelines.loops.multiagent import seat_groups

        datums = rl_datums(seat_groups(games, seat, cfg.group_size), "group_normalized", skip_uniform=False)
        recomputed = trainer.learners[seat].compute_logprobs(datums)
        worst = max(abs(bl - r) for d, lp in zip(datums, recomputed)
                    for w, bl, r in zip(d.weights, d.behaviour_logprobs, lp) if w)
        assert worst < 1e-4, seat
    metrics = trainer.run_iteration(6)
    assert "a/loss" in metrics and "b/loss" in metrics
    assert 0.0 <= trainer.evaluate("a", lambda: RaceEnv(seat="a"), [0, 1, 2]) <= 1.0


def test_scripted_pool_config_is_checked(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="scripted_groups"):
        MultiAgentConfig(scripted_groups=-1)
    with pytest.raises(ValueError, match="scripted_opponents"):
        MultiAgentConfig(scripted_groups=2)
    with pytest.raises(ValueError, match="unknown player 'grandmaster'"):
        MultiAgentTrainer(model, tok, RaceGame, MultiAgentConfig(scripted_opponents=("grandmaster",), scripted_groups=1))


def test_sampling_settings_are_checked_and_reach_sampler_and_learners(tiny):
    """`MultiAgentConfig`'s sampling fields are the shared `SamplingSettings`: checked there,
    named under `multiagent.`, and used by both the games' sampler and each seat's learner."""
    model, tok = tiny
    with pytest.raises(ValueError, match=r"multiagent\.max_new_tokens must be >= 1, got 0"):
        MultiAgentConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"multiagent\.top_p must be in \(0, 1\]"):
        MultiAgentConfig(top_p=0.0)
    cfg = MultiAgentConfig(groups_per_batch=1, group_size=2, max_new_tokens=3, max_turns=4, top_k=5, min_p=0.01,
                           stop=("9",))
    trainer = MultiAgentTrainer(model, tok, RaceGame, cfg)
    assert trainer.rollout_cfg == RolloutConfig(3, 1.0, 4, top_k=5, min_p=0.01, stop=("9",))
    assert all((lr.cfg.top_k, lr.cfg.min_p) == (5, 0.01) for lr in trainer.learners.values())
    games = trainer.rollout(0)
    turns = [t for g in games for traj in g.values() for t in traj.turns]
    assert turns and all(len(t.sampled_support) == len(t.sampled_tokens) for t in turns)  # top_k truncated every draw
    assert all("9" not in t.action_text for t in turns)  # the env sees the text before the stop string


def test_opponent_pool_groups_share_start_and_opponent_and_are_trained_on(tiny):
    model, tok = tiny
    cfg = MultiAgentConfig(groups_per_batch=2, group_size=4, max_new_tokens=1, max_turns=10, learning_rate=5e-2,
                           scripted_opponents=("greedy", "optimal"), scripted_groups=4)
    trainer = MultiAgentTrainer(model, tok, RaceGame, cfg)
    groups = trainer.rollout_scripted(0, "a")
    assert len(groups) == 4 and all(len(g.trajectories) == 4 for g in groups)
    for g in groups:  # one seed per group: the same start total in every game of the group
        assert len({t.task_id for t in g.trajectories}) == 1
        assert len({t.turns[0].prompt_tokens for t in g.trajectories}) == 1
        assert all("win" in t.info for t in g.trajectories)
    # the same iteration and seat replays the same games; another iteration does not
    again = trainer.rollout_scripted(0, "a")
    assert [t.task_id for g in again for t in g.trajectories] == [t.task_id for g in groups for t in g.trajectories]
    assert {t.task_id for g in trainer.rollout_scripted(1, "a") for t in g.trajectories} != \
        {t.task_id for g in groups for t in g.trajectories}
    # the pool's groups join the seat's self-play groups in its one step; the other seat gets none
    b_before = [p.detach().clone() for p in trainer.learners["b"].params]
    games = trainer.rollout(0)
    base = trainer.train_step(games, seats=("a",))
    mixed = trainer.train_step(games, seats=("a",), extra_groups={"a": groups})
    assert mixed["a/informative_groups"] == base["a/informative_groups"] + sum(len(set(g.rewards)) > 1 for g in groups)
    assert all(torch.equal(x, y) for x, y in zip(b_before, trainer.learners["b"].params))
    m = trainer.run_iteration(1, seats=("a",))
    assert 0.0 <= m["a/win_rate_scripted"] <= 1.0 and "b/win_rate_scripted" not in m
    assert set(trainer.scripted_players) == set(SCRIPTED_PLAYERS)  # the default pool: the race players
