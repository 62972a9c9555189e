"""Typed run config for the jobs, generated from the library's config dataclasses, and the
helpers that build and read run configs (the launcher and the sensors both use them).

Every field keeps the library's default and its docstring as the Dagster description, so the
Launchpad documents each field and the two never drift. Dagster rejects unknown or mistyped
fields at launch; `to_library_config` then runs the library's own validation (ranges, names),
which raises `ConfigError` naming the field — both before any model loads.

This module imports no other module of `assets/` (and nothing imports the composition root), so
`launch`, `sensors` and the asset modules can all import it without a cycle.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import inspect
import textwrap
import typing
from typing import Any, Dict, List

import dagster as dg
from pydantic import Field, create_model

from tinker_pipelines import config as lib
from tinker_pipelines.schedule_rules import eval_due as _eval_due

_DEFAULTS = lib.Config()
"""The library's defaults: what a run config dict means where it leaves a field out."""


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (`x: int = 1` followed by a string literal), a dataclass base's too
    (`TrainingConfig`'s sampling fields are declared on `SamplingSettings`)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        docs.update({a.target.id: b.value.value.strip() for a, b in zip(body, body[1:])
                     if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)})
    return docs


def _config_class(cls: type, suffix: str = "Run") -> type[dg.Config]:
    docs, hints, fields = _field_docs(cls), typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            sub = _config_class(hint)
            fields[f.name] = (sub, Field(default_factory=sub, description=(hint.__doc__ or "").strip()))
            continue
        if typing.get_origin(hint) is dict:
            hint = Dict[str, Any]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if typing.get_origin(hint) is tuple:  # Dagster's config types have lists, not tuples (YAML has lists)
            hint, default = List[typing.get_args(hint)[0]], list(default)
        fields[f.name] = (hint, Field(default=default, description=docs.get(f.name, f.name)))
    return create_model(cls.__name__ + suffix, __base__=dg.Config, __doc__=cls.__doc__, **fields)


_ExperimentConfig = _config_class(lib.Config)


class RLConfig(_ExperimentConfig):  # type: ignore[misc, valid-type]
    """One experiment (the partition key names it and the iteration); the same for every iteration."""

    kl_bound: float = Field(default=1.0, description=(
        "Blocking asset check: fail an iteration whose |KL| to the reference exceeds this; its adapter "
        "version is tagged tinker.checks=failed, never promoted and never trained on from."))
    champion_margin: float = Field(default=0.05, description="Asset check: warn when evaluation trails the champion by more than this.")
    auto_continue: bool = Field(default=True, description="Let the continue_training sensor launch the next iteration.")
    rollout_retries: int = Field(default=2, description=(
        "Retries of rollout_batch after a transient error of a remote env, reward server or worker "
        "(ConnectionError, TimeoutError, EOFError, URLError); other errors fail at once."))
    rollout_retry_delay_s: float = Field(default=2.0, description="Wait before the first retry of rollout_batch; doubles each retry.")

    def to_library_config(self) -> lib.Config:
        """The validated library `Config`; raises `ConfigError` naming the bad field."""
        data = self.model_dump()
        for extra in RUN_ONLY:
            data.pop(extra)
        return lib.config_from_dict(data)

    def settings(self) -> dict[str, Any]:
        """What is stored with the experiment: the library config plus the check bounds (retries
        are per run: they change nothing that is computed)."""
        if not (math.isfinite(self.kl_bound) and self.kl_bound > 0):
            raise lib.ConfigError(f"kl_bound must be positive and finite, got {self.kl_bound}")
        if not (math.isfinite(self.champion_margin) and self.champion_margin >= 0):
            raise lib.ConfigError(f"champion_margin must be >= 0 and finite, got {self.champion_margin}")
        if self.rollout_retries < 0 or not self.rollout_retry_delay_s >= 0:
            raise lib.ConfigError("rollout_retries and rollout_retry_delay_s must not be negative")
        return {"config": lib.config_to_dict(self.to_library_config()), "kl_bound": self.kl_bound,
                "champion_margin": self.champion_margin}


RUN_ONLY = ("kl_bound", "champion_margin", "auto_continue", "rollout_retries", "rollout_retry_delay_s")
"""Fields of `RLConfig` that are not the library's `Config`."""


class EvaluateConfig(dg.Config):
    """Evaluate one registered adapter version on held-out tasks."""

    model_name: str = Field(description="Registered model, e.g. tinker-quickstart.")
    version: str = Field(default="", description="Version number or alias ('champion'); '' = the latest version.")
    num_tasks: int = Field(default=0, description="Held-out tasks; 0 = the experiment's eval.num_tasks.")
    promote: bool = Field(default=True, description="Move the alias `champion` here when it beats the current champion.")


def setting(config: dict[str, Any], section: str, name: str) -> Any:
    """`config[section][name]` of a library-style config dict, else the library's default.

    >>> setting({"training": {"iterations": 3}}, "training", "iterations"), setting({}, "eval", "every")
    (3, 5)
    """
    value = (config.get(section) or {}).get(name)
    return getattr(getattr(_DEFAULTS, section), name) if value is None else value


def total_iterations(config: dict[str, Any]) -> int:
    """`training.iterations` of a config dict (the library default when absent)."""
    return int(setting(config, "training", "iterations"))


def rl_run_config(config: dict[str, Any], auto_continue: bool = False) -> dict[str, Any]:
    """Run config of the `rl` job from a library-style config dict (plus check bounds)."""
    return {"ops": {"rollout_batch": {"config": {**config, "auto_continue": auto_continue}}}}


def rl_config_of(run_config: dict[str, Any]) -> dict[str, Any]:
    """The library-style config dict inside an `rl` run config (inverse of `rl_run_config`)."""
    return (((run_config or {}).get("ops") or {}).get("rollout_batch") or {}).get("config") or {}


def auto_continue(config: dict[str, Any]) -> bool:
    """`auto_continue` of an `rl` config dict (RLConfig's default when absent)."""
    value = config.get("auto_continue")
    return bool(RLConfig.model_fields["auto_continue"].default if value is None else value)


def eval_due(config: dict[str, Any], iteration: int) -> bool:
    """Whether iteration k of a config dict evaluates: the library's rule
    (`tinker_pipelines.schedule_rules.eval_due`) on `eval.every` and `training.iterations`."""
    return _eval_due(iteration, int(setting(config, "eval", "every")), total_iterations(config))


RL_STEPS = ("rollout_batch", "scored_trajectories", "adapter_checkpoint")
"""The assets of every `rl` run; `eval_report` is added when evaluation is due."""


def iteration_assets(config: dict[str, Any], iteration: int) -> list[dg.AssetKey]:
    """The assets a run of iteration k needs: `eval_report` only when due (one step less per run)."""
    names = list(RL_STEPS) + (["eval_report"] if eval_due(config, iteration) else [])
    return [dg.AssetKey(n) for n in names]
