"""Bad input fails early with an error that names the field or the environment."""

import math

import pytest
import torch

from tinker_pipelines.config import ConfigError, config_from_dict, load_config
from tinker_pipelines.envs import Env, EnvError, EnvSpec
from tinker_pipelines.models import stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, run_groups
from tinker_pipelines.rollout.sampler import ContextOverflowError, Sampler
from tinker_pipelines.types import StepResult


@pytest.mark.parametrize("patch,message", [
    ({"algorithm": {"name": "reinforce9"}}, "algorithm.name 'reinforce9'"),
    ({"model": {"name": "gpt-17"}}, "model.name 'gpt-17'"),
    ({"env": {"path": "no_such.module:Env"}}, "env.path 'no_such.module:Env'"),
    ({"env": {"path": "tinker_pipelines.types:Datum"}}, "not a subclass"),
    ({"env": {"path": "arithmetic-without-colon"}}, "env.path"),
    ({"algorithm": {"clip_eps": -0.2}}, "algorithm.clip_eps must be > 0, got -0.2"),
    ({"training": {"learning_rate": 0}}, "training.learning_rate must be positive"),
    ({"training": {"learning_rate": -1e-3}}, "training.learning_rate must be positive"),
    ({"training": {"group_size": 1}}, "training.group_size must be >= 2 for grpo"),
    ({"training": {"mode": "qlora"}}, "training.mode"),
    ({"training": {"learning_rte": 1e-3}}, "unknown field training.learning_rte"),
    ({"training": {"iterations": "ten"}}, "training.iterations must be int"),
    ({"algorithm": {"kl_estimator": "k7"}}, "algorithm.kl_estimator"),
])
def test_bad_config_names_the_field(patch, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(patch)


def test_bad_config_fails_before_any_model_loads(monkeypatch):
    import tinker_pipelines.models as models

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", boom)
    from tinker_pipelines.train import Experiment

    cfg = config_from_dict({})
    bad = cfg.__class__(**{**cfg.__dict__, "training": cfg.training.__class__(learning_rate=-1.0)})
    with pytest.raises(ConfigError, match="training.learning_rate"):
        Experiment(bad)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


class CrashingEnv(Env):
    def reset(self, seed=None):
        self._seed = seed
        return [{"role": "user", "content": "hi"}]

    def step(self, action):
        raise KeyError("the env has a bug")


class NaNRewardEnv(CrashingEnv):
    def step(self, action):
        return StepResult([], math.nan, True)


@pytest.mark.parametrize("env_cls,message", [
    (CrashingEnv, "CrashingEnv raised in step\\(\\): KeyError"),
    (NaNRewardEnv, "NaNRewardEnv returned a non-finite reward nan"),
])
def test_env_failures_are_reported_naming_the_env(tiny, env_cls, message):
    model, tok = tiny
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    spec = EnvSpec(f"{__name__}:{env_cls.__name__}")
    with pytest.raises(EnvError, match=message):
        run_groups(sampler, tok, spec, [0], 2, RolloutConfig(max_new_tokens=2), torch.Generator().manual_seed(0))


def test_prompt_longer_than_context(tiny):
    model, tok = tiny
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok), max_context=32)
    with pytest.raises(ContextOverflowError, match="exceeds the model context of 32"):
        sampler.sample([[5] * 30], max_new_tokens=8)
    spec = EnvSpec("arithmetic")
    with pytest.raises(ValueError, match="ArithmeticEnv .*exceeds the model context of 32"):
        run_groups(sampler, tok, spec, [0], 2, RolloutConfig(max_new_tokens=8))
