"""Environments: the Gym-like contract, the spec that builds them, and the built-ins."""

from tinker_pipelines.envs.base import BUILTIN_ENVS, Env, EnvError, EnvSpec, checked_reset, checked_step
from tinker_pipelines.envs.check import EnvCheckError, check_env

__all__ = ["BUILTIN_ENVS", "Env", "EnvCheckError", "EnvError", "EnvSpec", "check_env", "checked_reset",
           "checked_step"]
