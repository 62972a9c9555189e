"""The experiment config: one YAML file, validated before any model loads.

Every error names the field, e.g. `training.learning_rate must be positive, got -1`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tinker_pipelines.algorithms.registry import get_algorithm
from tinker_pipelines.envs.base import EnvSpec
from tinker_pipelines.models import check_model_name
from tinker_pipelines.rollout.settings import SamplingSettings
from tinker_pipelines.training.rules import check_learner_settings


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """Which base model to train."""

    name: str = "tiny"
    """'tiny', 'smollm2-135m-instruct' or a local Hugging Face model directory."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments for the builder (for 'tiny': hidden_size, num_layers, arch)."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    dtype: str = "auto"
    """'auto' (bf16 where the device computes it natively: a GPU of compute capability 8.0+, a
    CPU with AMX or AVX512-BF16; fp32 elsewhere), 'float32' or 'bfloat16' ('float16' is refused:
    training has no loss scaling)."""
    seed: int | None = None
    """Seed of the in-process 'tiny' model's weights (None: the experiment's seed); experiments
    that share a resident worker's base set the same value."""


@dataclass(frozen=True)
class EnvConfig:
    """Which environment to act in."""

    path: str = "arithmetic"
    """Built-in name or 'package.module:ClassName' of an `Env` subclass."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments for training episodes."""
    eval_kwargs: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_EVAL_KWARGS))
    """Overrides of `kwargs` for evaluation episodes (held-out tasks); the default `split: test`
    applies only to environments whose constructor takes a `split` (others hold out by seed)."""

    def spec(self, evaluation: bool = False) -> EnvSpec:
        if not evaluation:
            return EnvSpec(self.path, dict(self.kwargs))
        extra = dict(self.eval_kwargs)
        if extra == DEFAULT_EVAL_KWARGS and not _accepts(EnvSpec(self.path).resolve(), "split"):
            extra = {}  # an env without splits holds out its evaluation tasks by seed alone
        return EnvSpec(self.path, {**self.kwargs, **extra})

    def check(self) -> None:
        """Resolve the class and bind the training and the evaluation kwargs to its constructor,
        so that a mismatch fails before any model loads, naming the field."""
        for name, spec in (("env.kwargs", self.spec()), ("env.eval_kwargs", self.spec(evaluation=True))):
            try:
                spec.check_kwargs(name)
            except ValueError as e:
                raise ConfigError(str(e)) from None


DEFAULT_EVAL_KWARGS: dict[str, Any] = {"split": "test"}
"""`env.eval_kwargs` by default."""


def _accepts(fn: Any, name: str) -> bool:
    """Whether calling `fn` accepts a keyword argument `name`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except ValueError:
        return True
    return any(p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.kind == p.VAR_KEYWORD
               for p in params)


@dataclass(frozen=True)
class AlgorithmConfig:
    """The RL objective."""

    name: str = "grpo"
    """A registered algorithm: grpo, ppo, importance_sampling, rloo, ..."""
    clip_eps: float = 0.2
    """Ratio clip for ppo/grpo."""
    kl_coef: float = 0.0
    """KL penalty weight to the reference policy (0: no reference is computed)."""
    kl_estimator: str = "k3"
    """'k1' or 'k3'."""
    normalization: str | None = None
    """Loss averaging: 'sequence' (GRPO), 'token' (DAPO) or 'constant' (Dr. GRPO); unset: the
    algorithm's own ('constant' for dr_grpo, else 'sequence')."""
    gamma: float = 1.0
    """PPO: discount per policy token in GAE, in [0, 1]."""
    gae_lambda: float = 0.95
    """PPO: GAE lambda in [0, 1] (0: one-step TD, 1: Monte Carlo returns)."""
    vf_coef: float = 0.1
    """PPO: weight of the value loss next to the policy loss (>= 0)."""
    value_clip: float = 0.2
    """PPO: new values further than this from the scored ones get no gradient (0 disables)."""
    whiten_advantages: bool = True
    """PPO: scale GAE advantages to mean 0, std 1 over the batch's policy tokens."""
    value_learning_rate: float = 0.0
    """PPO: Adam learning rate of the value head (0: training.learning_rate)."""
    ppo_epochs: int | None = None
    """Passes over each rollout, behaviour logprobs and old values fixed (unset: 4 for ppo, 1 otherwise)."""
    minibatches: int = 1
    """Shuffled minibatches per pass, one optimizer step each (at most the number of datums)."""
    target_kl: float | None = None
    """Stop an iteration's passes once a minibatch's approximate KL to the behaviour policy exceeds this (unset: off)."""


@dataclass(frozen=True)
class DeepSpeedConfig:
    """Full-parameter training through DeepSpeed ZeRO, data parallel over `torchrun` ranks."""

    stage: int = 0
    """0: off (the plain learner); 2: ZeRO-2 (gradients and Adam states partitioned); 3: ZeRO-3 (parameters too)."""
    offload_optimizer: bool = False
    """Keep the Adam states and their update in CPU memory (ZeRO-Offload)."""
    zero_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra keys of DeepSpeed's `zero_optimization` section, e.g. {reduce_bucket_size: 5.0e+7}."""


@dataclass(frozen=True)
class TrainingConfig(SamplingSettings):
    """The RL loop; its rollouts' sampling settings (max_new_tokens, temperature, max_turns,
    top_k, top_p, min_p, stop) are `rollout.settings.SamplingSettings`'s fields."""

    mode: str = "lora"
    """'lora' or 'full'."""
    iterations: int = 10
    """RL iterations (rollout, score, one optimizer step)."""
    learning_rate: float = 1e-4
    """Adam learning rate."""
    lora_rank: int = 8
    """LoRA rank."""
    lora_alpha: float = 16.0
    """LoRA alpha."""
    groups_per_batch: int = 8
    """Distinct tasks per iteration."""
    group_size: int = 8
    """Episodes per task (G), for the group baseline."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    micro_batch_size: int = 64
    """Sequences per forward pass."""
    share_prefix: bool = True
    """Run a group's shared prompt once in the training forward (same numbers, less compute)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (same
    gradient, a fraction of the activation memory, ~1.3x the training compute)."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """ZeRO stage 2 or 3 for full-parameter training under torchrun (stage 0: off)."""
    devices: int = 1
    """Devices a full-parameter step leases under the GPU-aware executor, one `torchrun` rank on each
    (> 1 needs training.deepspeed.stage 2 or 3); each rank samples its share of the rollouts."""


@dataclass(frozen=True)
class SFTConfig:
    """Optional supervised warm start before RL (steps = 0 skips it)."""

    steps: int = 0
    """Optimizer steps of supervised training."""
    batch_size: int = 32
    """Examples per step."""
    learning_rate: float = 1e-3
    """Adam learning rate for SFT."""
    examples: int = 2000
    """Size of the generated training set."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments for the env's `sft_examples` (e.g. verbose_fraction for arithmetic)."""


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation."""

    every: int = 5
    """Evaluate every this many iterations (and after the last)."""
    num_tasks: int = 200
    """Held-out tasks, decoded greedily."""


@dataclass(frozen=True)
class DPOConfig:
    """DPO (algorithm.name: dpo): preference pairs from scored rollouts of the starting policy."""

    pairs: int = 64
    """Preference pairs to collect (tasks whose best and worst replies score differently)."""
    group_size: int = 8
    """Replies sampled per task to find a best and a worst one."""
    max_rounds: int = 8
    """Rounds of `pairs` fresh tasks to sample before settling for fewer pairs."""
    steps: int = 20
    """DPO optimizer steps."""
    batch_size: int = 16
    """Pairs per optimizer step."""
    beta: float = 0.1
    """DPO temperature: implicit reward = beta * (policy - reference) sequence logprob."""

    def validate(self) -> None:
        for name in ("pairs", "max_rounds", "steps", "batch_size"):
            _require(getattr(self, name) >= 1, f"dpo.{name}", "must be >= 1", getattr(self, name))
        _require(self.group_size >= 2, "dpo.group_size", "must be >= 2 (a best and a worst reply)", self.group_size)
        _require(self.beta > 0 and math.isfinite(self.beta), "dpo.beta", "must be positive", self.beta)


@dataclass(frozen=True)
class Config:
    """A whole experiment."""

    seed: int = 0
    """Seeds model init, task selection and sampling; same seed, same metrics."""
    output_dir: str = "runs/default"
    """Where checkpoints and metrics go."""
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)

    def validate(self) -> "Config":
        """Check everything that can be checked without loading a model."""
        t, a = self.training, self.algorithm
        try:  # the learner's own rules (`training.rules`), checked before any model loads
            check_learner_settings(mode=t.mode, learning_rate=t.learning_rate, lora_rank=t.lora_rank,
                                   lora_alpha=t.lora_alpha, micro_batch_size=t.micro_batch_size,
                                   temperature=t.temperature, top_k=t.top_k, top_p=t.top_p, min_p=t.min_p,
                                   value_learning_rate=a.value_learning_rate)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _require(self.output_dir.strip() != "", "output_dir", "must be a path (not empty)", self.output_dir)
        sft = self.sft
        _require(sft.learning_rate > 0 and math.isfinite(sft.learning_rate), "sft.learning_rate", "must be positive",
                 sft.learning_rate)
        for name in ("batch_size", "examples"):
            _require(getattr(sft, name) >= 1, f"sft.{name}", "must be >= 1", getattr(sft, name))
        for name in ("iterations", "groups_per_batch", "group_size"):
            _require(getattr(t, name) >= 1, f"training.{name}", "must be >= 1", getattr(t, name))
        try:
            t.check_sampling("training.")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        ds = t.deepspeed
        _require(ds.stage in (0, 2, 3), "training.deepspeed.stage", "must be 0, 2 or 3", ds.stage)
        _require(ds.stage == 0 or t.mode == "full", "training.mode",
                 f"must be 'full' with training.deepspeed.stage {ds.stage} (ZeRO trains every parameter)", t.mode)
        _require(ds.stage > 0 or not ds.offload_optimizer, "training.deepspeed.offload_optimizer",
                 "needs training.deepspeed.stage 2 or 3", ds.offload_optimizer)
        _require("stage" not in ds.zero_overrides, "training.deepspeed.zero_overrides",
                 "must not set stage (use training.deepspeed.stage)", ds.zero_overrides)
        _require(not isinstance(t.devices, bool) and t.devices >= 1, "training.devices", "must be >= 1", t.devices)
        _require(t.devices == 1 or ds.stage in (2, 3), "training.devices",
                 "> 1 needs training.deepspeed.stage 2 or 3 (one ZeRO rank per device)", t.devices)
        _require(self.sft.steps >= 0, "sft.steps", "must be >= 0", self.sft.steps)
        _require(self.eval.every >= 1, "eval.every", "must be >= 1", self.eval.every)
        _require(self.eval.num_tasks >= 1, "eval.num_tasks", "must be >= 1", self.eval.num_tasks)
        algo = get_algorithm(a.name)
        _require(t.group_size >= algo.min_group_size, "training.group_size",
                 f"must be >= {algo.min_group_size} for {a.name}", t.group_size)
        _require(a.kl_estimator in ("k1", "k3"), "algorithm.kl_estimator", "must be 'k1' or 'k3'", a.kl_estimator)
        _require(a.normalization in (None, "sequence", "token", "constant"), "algorithm.normalization",
                 "must be 'sequence', 'token' or 'constant'", a.normalization)
        _require(algo.normalization is None or a.normalization in (None, algo.normalization), "algorithm.normalization",
                 f"must be {algo.normalization!r} or unset for {a.name} (it is defined with it)", a.normalization)
        _require(a.ppo_epochs is None or a.ppo_epochs >= 1, "algorithm.ppo_epochs", "must be >= 1", a.ppo_epochs)
        _require(a.minibatches >= 1, "algorithm.minibatches", "must be >= 1", a.minibatches)
        _require(a.target_kl is None or (a.target_kl > 0 and math.isfinite(a.target_kl)), "algorithm.target_kl",
                 "must be > 0 (or unset)", a.target_kl)
        _require(a.clip_eps > 0 and math.isfinite(a.clip_eps), "algorithm.clip_eps", "must be > 0", a.clip_eps)
        _require(a.kl_coef >= 0, "algorithm.kl_coef", "must be >= 0", a.kl_coef)
        for name in ("gamma", "gae_lambda"):
            _require(0 <= getattr(a, name) <= 1, f"algorithm.{name}", "must be in [0, 1]", getattr(a, name))
        for name in ("vf_coef", "value_clip"):
            v = getattr(a, name)
            _require(v >= 0 and math.isfinite(v), f"algorithm.{name}", "must be >= 0", v)
        self.dpo.validate()
        check_model_name(self.model.name)
        # no loss scaling anywhere: fp16 gradients below ~6e-8 flush to 0 (bf16 has fp32's range)
        _require(self.model.dtype not in ("float16", "fp16"), "model.dtype",
                 "cannot be float16 for training (no loss scaling: small gradients underflow to 0); "
                 "use bfloat16 (same memory, float32's exponent range) or float32", self.model.dtype)
        from tinker_pipelines.models import check_model_kwargs, resolve_device, resolve_dtype

        try:
            check_model_kwargs(self.model.name, self.model.kwargs)
            resolve_dtype(self.model.dtype, resolve_device(self.model.device))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.env.check()
        return self


def _require(ok: bool, name: str, what: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{name} {what}, got {value!r}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known, key=str)
    if unknown:
        raise ConfigError(f"unknown field {prefix}{unknown[0]}; known: {', '.join(sorted(known))}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, {} if value is None else value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    args = typing.get_args(hint)
    if type(None) in args:  # `X | None`
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint) or hint
    if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if origin in (int, str, bool, float):
        if not isinstance(value, origin) or (origin is int and isinstance(value, bool)):
            raise ConfigError(f"{name} must be {origin.__name__}, got {value!r}")
    if origin is dict and not isinstance(value, dict):
        raise ConfigError(f"{name} must be a mapping, got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        value = origin(value)
    return value


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a `Config`; raises `ConfigError` naming the bad field."""
    return _build(Config, {} if data is None else data, "").validate()


def load_config(path: str | Path) -> Config:
    """Read a YAML config file."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    data = yaml.safe_load(text)
    if data is None:
        raise ConfigError(f"config file {path} is empty: write at least the fields that differ from the defaults")
    return config_from_dict(data)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain-data form of a config (for records, MLflow params and YAML): tuple fields as lists,
    as YAML and JSON write them and read them back, so that a record of an earlier run (and its
    MLflow params, `str` of the value) compares equal to the same config now."""
    return _tuples_as_lists(dataclasses.asdict(cfg))


def _tuples_as_lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _tuples_as_lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tuples_as_lists(v) for v in value]
    return value
