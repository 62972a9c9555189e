"""The race part's position probes (`benchmarks.agentic.reply_probs` and the figures built on it)."""

import functools

import pytest
import torch

from benchmarks import agentic
from tinker_pipelines.envs.two_agent import RaceGame
from tinker_pipelines.models import encode_chat, load_model
from tinker_pipelines.loops.multiagent import MultiAgentConfig, MultiAgentTrainer


@pytest.fixture
def race_game(monkeypatch):
    def use(**game):
        monkeypatch.setitem(agentic.RACE, "game", {"exact": False, "reply": "move", **game})
        model, tok = load_model("tiny", seed=0)
        return MultiAgentTrainer(model, tok, functools.partial(RaceGame, **agentic.RACE["game"]),
                                 MultiAgentConfig(seed=0))
    return use


def _next_token_probs(trainer, ids):
    trainer.learners["b"].activate()
    with torch.no_grad():
        return torch.softmax(trainer.model(torch.tensor([ids])).logits[0, -1].float(), -1)


def test_reply_probs_read_the_reply_tokens_and_the_end_of_a_short_reply(race_game):
    trainer = race_game(reply="total", exact=True)
    tok = trainer.tokenizer
    game = RaceGame(exact=True, reply="total")
    prompt = encode_chat(tok, [{"role": "system", "content": game.rules()},
                               {"role": "user", "content": "Opponent adds 1. Total is 5. Your move."}])
    probs = agentic.reply_probs(trainer, "b", 5)
    assert sorted(probs) == [1, 2, 3]
    six = tok.encode("6", add_special_tokens=False)
    # "6" must be followed by the end of the turn: a 2-token budget would let "61" through
    expected = _next_token_probs(trainer, prompt)[six[0]] * _next_token_probs(trainer, prompt + six)[tok.eos_token_id]
    assert probs[1] == pytest.approx(float(expected), rel=1e-4)
    assert sorted(agentic.reply_probs(trainer, "b", 8)) == [1, 2]  # past 10 is illegal under exact rules
    ten = tok.encode("10", add_special_tokens=False)
    at7 = encode_chat(tok, [{"role": "system", "content": game.rules()},
                            {"role": "user", "content": "Opponent adds 1. Total is 7. Your move."}])
    expected = _next_token_probs(trainer, at7)[ten[0]] * _next_token_probs(trainer, at7 + ten[:1])[ten[1]]
    assert agentic.reply_probs(trainer, "b", 7)[3] == pytest.approx(float(expected), rel=1e-4)
    # A never opens beyond the start totals: there it is asked after a move of its own and B's
    opening, mine, reply = agentic.race_context("a", 8)[1:]
    assert opening["content"] == "Total is 4. Your move." and mine["content"] == "6"
    assert reply["content"] == "Opponent adds 2. Total is 8. Your move."
    assert len(agentic.race_context("a", 5)) == 2
    assert 0 < agentic.legal_prob(trainer, "b") < 1


def test_move_replies_are_one_token_each(race_game):
    trainer = race_game()
    tok = trainer.tokenizer
    game = RaceGame()
    prompt = encode_chat(tok, [{"role": "system", "content": game.rules()},
                               {"role": "user", "content": "Opponent adds 1. Total is 8. Your move."}])
    p = _next_token_probs(trainer, prompt)
    probs = agentic.reply_probs(trainer, "b", 8)
    for move in (1, 2, 3):
        assert probs[move] == pytest.approx(float(p[tok.encode(str(move), add_special_tokens=False)[0]]), rel=1e-4)
    assert agentic.take_win_prob(trainer, "b") == pytest.approx(
        sum(agentic.reply_probs(trainer, "b", t)[10 - t] for t in (7, 8, 9)) / 3)
