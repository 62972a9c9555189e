"""Environment config: the README's example env trains and evaluates; kwargs that do not fit the
constructor fail before any model loads, naming the field."""

from __future__ import annotations

import sys
import textwrap

import pytest

from tinker_pipelines.config import ConfigError, config_from_dict

ECHO = textwrap.dedent('''
    from tinker_pipelines.envs import Env
    from tinker_pipelines.types import StepResult

    class Echo(Env):
        def reset(self, seed=None):
            self._seed, self.word = seed, ["apple", "pear", "plum"][(seed or 0) % 3]
            return [{"role": "user", "content": f"Say {self.word}."}]

        def step(self, action):
            return StepResult([], float(action.strip() == self.word), True, {})

    class Sized(Env):
        def __init__(self, n: int = 3, split: str = "train"):
            self.n, self.split = n, split

        def reset(self, seed=None):
            self._seed = seed
            return [{"role": "user", "content": f"{self.split} {self.n}"}]

        def step(self, action):
            return StepResult([], 0.0, True, {})
''')


@pytest.fixture()
def envs_module(tmp_path, monkeypatch):
    (tmp_path / "readme_envs.py").write_text(ECHO)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "readme_envs"
    sys.modules.pop("readme_envs", None)


def _cfg(tmp_path, env: dict) -> dict:
    return {"seed": 0, "output_dir": str(tmp_path / "out"), "model": {"name": "tiny", "dtype": "float32"}, "env": env,
            "training": {"iterations": 1, "groups_per_batch": 2, "group_size": 2, "max_new_tokens": 4},
            "eval": {"every": 1, "num_tasks": 2}}


def test_the_readme_echo_env_trains_and_evaluates(tmp_path, envs_module):
    from tinker_pipelines.loops.train import train

    cfg = config_from_dict(_cfg(tmp_path, {"path": f"{envs_module}:Echo"}))
    assert cfg.env.spec(evaluation=True).kwargs == {}  # no split to pass: held out by seed
    history = train(cfg)
    assert "eval/reward_mean" in history[-1]


def test_the_default_split_reaches_envs_that_take_one(envs_module):
    cfg = config_from_dict({"env": {"path": f"{envs_module}:Sized", "kwargs": {"n": 5}}})
    assert cfg.env.spec(evaluation=True).build().split == "test"
    assert cfg.env.spec().build().split == "train"


@pytest.mark.parametrize("env, field", [
    ({"path": "{m}:Echo", "eval_kwargs": {"split": "dev"}}, "env.eval_kwargs"),
    ({"path": "{m}:Echo", "kwargs": {"size": 3}}, "env.kwargs"),
    ({"path": "{m}:Sized", "kwargs": {"m": 1}}, "env.kwargs"),
])
def test_kwargs_that_do_not_fit_fail_before_the_model_loads(envs_module, env, field):
    env = {**env, "path": env["path"].format(m=envs_module)}
    with pytest.raises(ConfigError, match=f"^{field} .* do not fit the constructor of"):
        config_from_dict({"env": env})
