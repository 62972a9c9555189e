"""check_env on every built-in env, what it catches, tool episodes, the documented example env."""

import math
import random
import re
from pathlib import Path

import pytest
import torch

from tinker_pipelines.loops.datums import trajectory_to_datum
from tinker_pipelines.envs import BUILTIN_ENVS, Env, EnvCheckError, EnvSpec, check_env
from tinker_pipelines.envs.tool_env import MultiplyEnv
from tinker_pipelines.envs.tools import format_tool_call
from tinker_pipelines.envs.two_agent import SCRIPTED_PLAYERS, RaceEnv, RaceGame
from tinker_pipelines.models import render_chat, stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, run_episodes
from tinker_pipelines.rollout.sampler import Sample, Sampler
from tinker_pipelines.types import StepResult

GOOD_ACTIONS = {
    "arithmetic": ["7"],
    "guess_number": [str(i) for i in range(1, 17)],
    "multiply_tools": [format_tool_call("calculator", {"expression": "12*34"}), "408"],
    "race": ["1", "2", "3"],
    "repeat": ["1234"],
}


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_check_env_on_every_builtin(name, tiny):
    _, tok = tiny
    assert name in GOOD_ACTIONS, f"add good actions for the new built-in {name!r}"
    found = check_env(EnvSpec(name).build(), actions=GOOD_ACTIONS[name], tokenizer=tok)
    assert all("reward" in w and "after the end" in w for w in found), found  # only arithmetic's harmless repeat


class _Good(Env):
    def reset(self, seed=None):
        self._seed = seed
        self.rng, self.done = random.Random(seed), False
        return [{"role": "user", "content": f"Say {self.rng.randint(0, 9)}"}]

    def step(self, action):
        if self.done:
            raise RuntimeError("over")
        self.done = True
        return StepResult([], 1.0, True, {})


class _Nondeterministic(_Good):
    def reset(self, seed=None):
        super().reset(seed)
        return [{"role": "user", "content": f"Say {random.random()}"}]


class _NanReward(_Good):
    def step(self, action):
        return StepResult([], math.nan, True, {})


class _BoolReward(_Good):
    def step(self, action):
        return StepResult([], True, True, {})


class _Crashes(_Good):
    def step(self, action):
        return StepResult([], float(int(action)), True, {})  # "The answer is 7." -> ValueError


class _GoesOn(_Good):
    def step(self, action):
        return StepResult([] if self.done else [{"role": "user", "content": "again"}], 0.0, self.done, {}) \
            if not setattr(self, "done", not self.done) else None


class _BadMessage(_Good):
    def reset(self, seed=None):
        super().reset(seed)
        return [{"role": "user", "text": "hi"}]


class _Silent(_Good):
    def step(self, action):
        return StepResult([], 0.0, False, {})


class _RandomStep(_Good):
    def step(self, action):
        super().step(action)
        return StepResult([], random.random(), True, {})


@pytest.mark.parametrize("env,match", [
    (_Nondeterministic(), "different observations"),
    (_NanReward(), "finite"),
    (_BoolReward(), "finite floats"),
    (_Crashes(), "raised ValueError"),
    (_GoesOn(), "after the episode ended"),
    (_BadMessage(), "malformed message"),
    (_Silent(), "no message to answer"),
    (_RandomStep(), "replaying the same replies"),
])
def test_check_env_catches_broken_envs(env, match):
    with pytest.raises(EnvCheckError, match=match):
        check_env(env, actions=["1"])
    check_env(_Good())


def test_tiny_template_renders_tool_messages(tiny):
    _, tok = tiny
    text = render_chat(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c"},
                             {"role": "tool", "content": "287663"}])
    assert text.endswith("<|im_start|>tool\n287663<|im_end|>\n<|im_start|>assistant\n")


class _ScriptedSampler:
    """Replies with fixed texts in turn (per row), like a policy that knows the task."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.calls = tok, replies, 0
        self.stop_token_ids, self.max_context = stop_token_ids(tok), 1024

    def sample(self, prompts, max_new_tokens, temperature=1.0, generator=None):
        out = []
        for p in prompts:
            text = self.replies(self.tok.decode(p))
            toks = tuple(self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id])
            out.append(Sample(toks, tuple(-0.5 for _ in toks), "stop"))
        return out


def _multiply_policy(context: str) -> str:
    if "<|im_start|>tool\n" in context:
        return context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    a, b = re.findall(r"What is (\d+) \* (\d+)\?", context)[-1]
    return format_tool_call("calculator", {"expression": f"{a}*{b}"})


def test_tool_episode_env_tokens_carry_no_loss(tiny):
    _, tok = tiny
    sampler = _ScriptedSampler(tok, _multiply_policy)
    seeds = [3, 4]
    trajs = run_episodes(sampler, tok, [MultiplyEnv(prompt_style="short") for _ in seeds], seeds,
                         RolloutConfig(max_new_tokens=96, max_turns=3))
    for traj in trajs:
        assert traj.stop_reason == "done" and traj.total_reward == 1.0 and len(traj.turns) == 2
        t0, t1 = traj.turns
        env_start = len(t0.prompt_tokens) + len(t0.sampled_tokens)
        assert t1.prompt_tokens[:env_start] == t0.prompt_tokens + t0.sampled_tokens  # token-exact
        env_text = tok.decode(t1.prompt_tokens[env_start:])
        assert env_text.startswith("\n<|im_start|>tool\n" + traj.info["answer"])
        d = trajectory_to_datum(traj, 1.0)
        assert sum(d.weights) == traj.num_sampled_tokens
        assert all(d.weights[i] == 0 for i in range(env_start - 1, len(t1.prompt_tokens) - 1))
        assert all(d.weights[i] == 1 for i in range(len(t1.prompt_tokens) - 1, len(d.weights)))


def test_tool_env_with_the_tiny_model_never_crashes(tiny):
    model, tok = tiny
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    seeds = list(range(8))
    trajs = run_episodes(sampler, tok, [MultiplyEnv() for _ in seeds], seeds,
                         RolloutConfig(max_new_tokens=8, max_turns=3), torch.Generator().manual_seed(0))
    assert all(t.total_reward == 0.0 and t.info["exact"] == 0.0 for t in trajs)


def test_race_env_against_scripted_players():
    wins = {}
    for me in ("random", "optimal"):
        total = 0
        for seed in range(200):
            env = RaceEnv(seat="b", opponent="greedy")
            env.reset(seed)
            rng = random.Random(seed)
            while True:
                move = str(env.game.optimal_move()) if me == "optimal" else str(rng.randint(1, 3))
                r = env.step(move)
                if r.done:
                    total += r.info["win"]
                    assert r.reward == (1.0 if r.info["win"] else -1.0)
                    break
        wins[me] = total / 200
    assert wins["optimal"] > 0.8 and wins["random"] < 0.5
    env = RaceEnv(seat="b")
    opening = env.reset(0)
    assert [m["role"] for m in opening] == ["system", "user"] and "Opponent adds" in opening[1]["content"]
    for _ in range(2):  # illegal replies: a penalty, the reason, and another try
        retry = env.step("seven")
        assert not retry.done and retry.reward == -0.1 and "Illegal move" in retry.observation[0]["content"]
    forfeit = env.step("seven")  # the third forfeits
    assert forfeit.done and forfeit.reward == -1.0 and forfeit.info["forfeit"]
    strict = RaceEnv(seat="b", max_illegal=0)
    strict.reset(0)
    assert strict.step("seven").info["forfeit"]


def test_race_illegal_move_then_legal_play_goes_on():
    env = RaceEnv(seat="a", opponent="random")
    opening = env.reset(3)
    total = int(opening[-1]["content"].split("Total is ")[1].split(".")[0])
    retry = env.step("4")
    assert not retry.done and f"Total is {total}." in retry.observation[0]["content"]
    assert env.game.total == total and env.game.to_move == "a"
    nxt = env.step("1")
    assert nxt.done or (nxt.reward == 0.0 and "Opponent adds" in nxt.observation[-1]["content"])
    with pytest.raises(ValueError, match="max_illegal"):
        RaceEnv(max_illegal=-1)
    with pytest.raises(ValueError, match="illegal_penalty"):
        RaceEnv(illegal_penalty=1.5)


def test_race_exact_rules_make_one_move_win_and_moves_past_the_target_illegal():
    game = RaceGame(exact=True)
    assert "exactly 10" in game.rules() and "or more" not in game.rules()
    for total in (7, 8, 9):
        winners = []
        for move in (1, 2, 3):
            game.reset(0)
            game.total = total
            step = game.step(str(move))
            if step.done:
                winners.append(move)
            elif move > 10 - total:  # past the target: illegal, the mover pays and moves again
                assert step.info["illegal"] == "a" and step.rewards == {"a": -0.1, "b": 0.1}
                assert game.total == total and game.to_move == "a"
                assert f"from 1 to {10 - total}." in step.observations["a"][0]["content"]
        assert winners == [10 - total]  # exactly one winning move, the one that lands on 10
    reach = RaceGame()
    reach.reset(0)
    reach.total = 8
    assert reach.step("3").done  # under the default rules overshooting wins
    for seed in range(50):  # the scripted players and the warm start's moves stay legal
        env = RaceEnv(seat="b", opponent="random", exact=True)
        env.reset(seed)
        while not (r := env.step(str(env.game.optimal_move()))).done:
            assert r.reward == 0.0
        assert not r.info.get("forfeit")
    with pytest.raises(ValueError, match="env.kwargs.exact"):
        RaceEnv(exact="no")
    for context, move in RaceEnv.sft_examples(200, seed=1, exact=True):
        total = int(context[-1]["content"].split("Total is ")[1].split(".")[0])
        assert 1 <= int(move) <= min(3, 10 - total), (context[-1], move)


def test_race_read_examples_answer_the_total_and_teach_no_moves():
    examples = RaceEnv.sft_examples(300, seed=0, read_fraction=0.4)
    reads = [(m, reply) for m, reply in examples if m[-1]["content"].endswith("What is the total?")]
    assert len(reads) == 120 and len(examples) == 300
    for m, reply in reads:  # the answer is the total stated in the message, never a move choice
        assert reply == m[-1]["content"].split("Total is ")[1].split(".")[0]
        assert m[0]["role"] == "system" and "Race to 10" in m[0]["content"]
    assert len({reply for _, reply in reads}) == 10  # every total 0..9 appears
    moves = [reply for m, reply in examples if not m[-1]["content"].endswith("What is the total?")]
    assert set(moves) == {"1", "2", "3"}
    assert any("What" in m[-1]["content"] for m, _ in examples[:60])  # mixed in, not all at the end
    assert RaceEnv.sft_examples(50, seed=0) == RaceEnv.sft_examples(50, seed=0, read_fraction=0.0)
    with pytest.raises(ValueError, match="read_fraction"):
        RaceEnv.sft_examples(10, read_fraction=1.0)


def _doc_example():
    text = (Path(__file__).parents[1] / "docs" / "environments.md").read_text()
    code = text.split("<!-- example-env")[1].split("```python\n", 1)[1].split("```", 1)[0]
    return code


def test_documented_example_env(tiny):
    code = _doc_example()
    assert len(code.strip().splitlines()) <= 30
    namespace: dict = {}
    exec(compile(code, "docs/environments.md", "exec"), namespace)
    cls = namespace["SpellBackwards"]
    model, tok = tiny
    found = check_env(cls(), actions=["loot", "rewsna"], tokenizer=tok)
    assert [w for w in found if "pickled" not in w] == []  # defined by exec, so not importable
    env = cls()
    word = env.reset(seed=1)[-1]["content"]
    assert env.step("x").observation and env.step(word[::-1]).reward == 0.5
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    seeds = list(range(6))
    trajs = run_episodes(sampler, tok, [cls() for _ in seeds], seeds, RolloutConfig(max_new_tokens=6, max_turns=2),
                         torch.Generator().manual_seed(0))
    assert all(t.stop_reason == "done" and len(t.turns) == 2 for t in trajs)  # a random model misses twice


def test_race_sft_demonstrator_is_any_scripted_player():
    examples = RaceEnv.sft_examples(400, seed=0, player="greedy")
    at = {}
    for m, reply in examples:
        total = int(m[-1]["content"].split("Total is ")[1].split(".")[0])
        at.setdefault(total, set()).add(reply)
    for total in (7, 8, 9):  # greedy wins when it can: the one move to 10
        assert at[total] == {str(10 - total)}
    assert at[0] == {"1", "2", "3"}  # and plays at random otherwise
    assert RaceEnv.sft_examples(30, seed=0) == RaceEnv.sft_examples(30, seed=0, player="random")
    with pytest.raises(ValueError, match="sft.player must be one of .*got 'perfect'"):
        RaceEnv.sft_examples(10, player="perfect")


def _moves_at(examples, total):
    return [reply for m, reply in examples if m[-1]["content"].split("Total is ")[1].startswith(f"{total}.")]


def test_race_sft_random_fraction_weakens_the_demonstrator():
    optimal = _moves_at(RaceEnv.sft_examples(600, seed=0, player="optimal"), 5)
    assert set(optimal) == {"1"}  # 5 + 1 leaves the opponent 4 short of 10
    half = _moves_at(RaceEnv.sft_examples(600, seed=0, player="optimal", random_fraction=0.5), 5)
    assert set(half) == {"1", "2", "3"}
    share = half.count("1") / len(half)  # 0.5 + 0.5 / 3 in expectation
    assert 0.5 < share < 0.85, share
    with pytest.raises(ValueError, match="sft.random_fraction must be in \\[0, 1\\], got 1.5"):
        RaceEnv.sft_examples(10, random_fraction=1.5)


def test_race_total_replies_name_the_new_total_so_only_a_reading_policy_is_legal():
    game = RaceGame(reply="total")
    assert "new total" in game.rules() and game.reply_tokens() == 2  # up to "12" from 9
    game.reset(0)
    total = game.total
    assert game.format_move(2) == str(total + 2)
    for wrong in ("2" if total != 0 else "5", str(total), str(total + 4), "x"):  # a bare move, no move, too far
        step = game.step(wrong)
        assert step.info["illegal"] == "a" and game.total == total and game.to_move == "a", wrong
        assert f"the new total, from {total + 1} to {total + 3}." in step.observations["a"][0]["content"]
        game.illegal["a"] = 0
    step = game.step(f" {total + 2} ")
    assert game.total == total + 2 and game.to_move == "b" and step.rewards == {"a": 0.0, "b": 0.0}
    exact = RaceGame(exact=True, reply="total")
    exact.reset(0)
    exact.total = 8
    assert exact.step("11").info["illegal"] == "a" and exact.step("10").done  # past 10 is illegal there
    for seed in range(30):  # every scripted player replies in the game's format
        for name, player in SCRIPTED_PLAYERS.items():
            env = RaceEnv(seat="a", opponent=name, reply="total")
            env.reset(seed)
            rng = random.Random(seed)
            while not (r := env.step(player(env.game, rng))).done:
                assert r.reward == 0.0
            assert not r.info.get("forfeit")
    misreads = 0
    for context, reply in RaceEnv.sft_examples(300, seed=2, reply="total", illegal_fraction=0.3):
        shown = int(context[-1]["content"].split("Total is ")[1].split(".")[0])
        assert 1 <= int(reply) - shown <= 3, (context[-1], reply)
        if context[-1]["content"].startswith("Illegal move"):  # a wrong reply is context only
            misreads += context[-2]["content"].isdigit()
    assert misreads > 0  # the warm start shows recovering from a misread total too
    for exact in (False, True):  # a made-up wrong reply that happens to be legal never ends a game early
        assert len(RaceEnv.sft_examples(2000, seed=3, reply="total", illegal_fraction=0.5, exact=exact)) == 2000
    with pytest.raises(ValueError, match="env.kwargs.reply"):
        RaceEnv(reply="words")
    assert RaceGame().reply_tokens() == 1 and RaceGame().format_move(3) == "3"
    # landing exactly on 9, every total is one digit: a legal reply is one token, as with moves
    assert RaceGame(target=9, max_start=5, exact=True, reply="total").reply_tokens() == 1
    assert RaceGame(target=9, max_start=5, reply="total").reply_tokens() == 2  # up to "11" from 8
