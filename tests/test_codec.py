"""Artifacts are data: rollouts, datums and preference pairs round-trip exactly through tagged
JSON, and a planted pickle (or any other foreign bytes) is refused without running anything."""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass

import pytest
import torch

from tinker_pipelines.types import CriticDatum
from tinker_pipelines.types import PreferencePair
from tinker_pipelines.tracking import LocalStore
from tinker_pipelines.tracking.codec import decode, encode, register
from tinker_pipelines.tracking.store import dumps, loads
from tinker_pipelines.types import Datum, Trajectory, TrajectoryGroup, Turn


def _trajectory(seed: int, reward: float = 1.0 / 3.0) -> Trajectory:
    turn = Turn((1, 2, 3), (4, 5), (-0.1234567890123, -1e-300), 0.5, "four five")
    return Trajectory((turn, turn), reward, f"task{seed}", "length",
                      {"exact": True, "n": 3, "nan": math.nan, "np": torch.tensor(2.5), "t": torch.ones(2),
                       "nested": {"k": (1, [2, 3]), 7: "int key"}, "obj": object.__new__(type("Foo", (), {}))})


def test_rollouts_datums_and_pairs_round_trip_exactly():
    groups = [TrajectoryGroup((_trajectory(0), _trajectory(1)))]
    datums = [Datum((1, 2), (2, 3), (0.0, 1.0), (-0.5, -0.25), (0.1, 0.1)),
              CriticDatum((1,), (2,), (1.0,), rewards=(1.0,), old_values=(0.3,), returns=(float("inf"),))]
    pairs = [PreferencePair("t", _trajectory(2), _trajectory(3, reward=-1.0))]
    value = {"groups": groups, "metrics": {"reward_mean": 0.1 + 0.2}, "datums": datums, "pairs": pairs}
    back = decode(encode(value))
    assert back["datums"] == datums and type(back["datums"][1]) is CriticDatum
    assert back["metrics"]["reward_mean"] == 0.1 + 0.2  # floats bit for bit
    t = back["groups"][0].trajectories[0]
    assert t.turns == _trajectory(0).turns and t.final_reward == 1.0 / 3.0
    assert t.info["np"] == 2.5 and t.info["t"] == [1.0, 1.0] and math.isnan(t.info["nan"])
    assert t.info["nested"] == {"k": (1, [2, 3]), 7: "int key"} and t.info["obj"].startswith("<")
    assert back["pairs"][0].chosen.turns == pairs[0].chosen.turns


class _Boom:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_a_planted_pickle_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = LocalStore(tmp_path / "artifacts")
    store.put_bytes("exp/00000/rollout.json", pickle.dumps({"groups": [_Boom()]}))
    with pytest.raises(ValueError, match="pickle"):
        loads(store.get_bytes("exp/00000/rollout.json"))
    assert not (tmp_path / "pwned").exists()
    for junk in (b"not json", b'{"format": "other", "value": 1}', b'{"format": "tinker-json/1", "value": '
                 b'{"__dataclass__": "Popen", "fields": {}}}'):
        with pytest.raises(ValueError):
            loads(junk)


def test_unknown_dataclasses_need_registering():
    @dataclass(frozen=True)
    class MyDatum(Datum):
        extra: tuple[float, ...] = ()

    d = MyDatum((1,), (2,), (1.0,), extra=(0.5,))
    with pytest.raises(TypeError, match="register"):
        dumps([d])
    register(MyDatum)
    assert loads(dumps([d])) == [d]
