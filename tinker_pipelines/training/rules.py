"""The rules a learner's settings obey, stated once.

`LearnerConfig` checks them when it is built (a learner is never made from bad settings) and
`Config.validate` checks the same fields of an experiment's config before any model loads, with
the same messages, each naming the config field (`training.learning_rate`, ...). Sampling
truncation (top-k, top-p, min-p) has its own home, `rollout.truncation.check_params`, which
both the sampler and these rules call.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from tinker_pipelines.rollout.truncation import check_params


def check_learner_settings(*, mode: str, learning_rate: float, lora_rank: int, lora_alpha: float,
                           micro_batch_size: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
                           min_p: float = 0.0, value_learning_rate: float = 0.0, micro_batch_tokens: int = 0) -> None:
    """Raise `ValueError` naming the first field out of range.

    >>> check_learner_settings(mode="lora", learning_rate=0.0, lora_rank=8, lora_alpha=16.0,
    ...                        micro_batch_size=64, temperature=1.0)
    Traceback (most recent call last):
    ...
    ValueError: training.learning_rate must be positive, got 0.0
    """

    def require(ok: bool, field: str, what: str, value: object) -> None:
        if not ok:
            raise ValueError(f"{field} {what}, got {value!r}")

    require(mode in ("lora", "full"), "training.mode", "must be 'lora' or 'full'", mode)
    require(learning_rate > 0 and math.isfinite(learning_rate), "training.learning_rate", "must be positive",
            learning_rate)
    require(lora_rank >= 1, "training.lora_rank", "must be >= 1", lora_rank)
    require(lora_alpha > 0 and math.isfinite(lora_alpha), "training.lora_alpha", "must be positive", lora_alpha)
    require(micro_batch_size >= 1, "training.micro_batch_size", "must be >= 1", micro_batch_size)
    require(micro_batch_tokens >= 0, "training.micro_batch_tokens", "must be >= 0 (0: no bound)", micro_batch_tokens)
    # logprobs are divided by it: 0 (greedy) has no logprobs to train on
    require(temperature > 0 and math.isfinite(temperature), "training.temperature", "must be positive",
            temperature)
    require(value_learning_rate >= 0 and math.isfinite(value_learning_rate), "algorithm.value_learning_rate",
            "must be >= 0", value_learning_rate)
    check_params(top_k, top_p, min_p, prefix="training.")


ADAM_PARAMS_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                        "grad_clip_norm": 0.0}
"""Tinker's `AdamParams` fields and the SDK's defaults (tinker==0.38.0 `types/adam_params.py`)."""


def adam_settings(adam: Mapping[str, float]) -> dict[str, float]:
    """Tinker's `AdamParams` (missing fields take the SDK's defaults) as an AdamW parameter
    group's settings (`lr`, `betas`, `eps`, `weight_decay`) plus `grad_clip_norm` (0: no
    clipping); `ValueError` naming `adam_params.<field>` for an unknown field or a value out of range.

    >>> adam_settings({"learning_rate": 1e-3})
    {'lr': 0.001, 'betas': (0.9, 0.95), 'eps': 1e-12, 'weight_decay': 0.0, 'grad_clip_norm': 0.0}
    >>> adam_settings({"beta1": 1.0})
    Traceback (most recent call last):
    ...
    ValueError: adam_params.beta1 must be in [0, 1), got 1.0
    """
    unknown = sorted(set(adam) - set(ADAM_PARAMS_DEFAULTS))
    if unknown:
        raise ValueError(f"adam_params.{unknown[0]} is not an AdamParams field; fields: {', '.join(ADAM_PARAMS_DEFAULTS)}")
    v = {**ADAM_PARAMS_DEFAULTS, **adam}
    for k, x in v.items():
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"adam_params.{k} must be a finite number, got {x!r}")
    rules = {"learning_rate": (v["learning_rate"] >= 0, "must be >= 0"),
             "beta1": (0 <= v["beta1"] < 1, "must be in [0, 1)"), "beta2": (0 <= v["beta2"] < 1, "must be in [0, 1)"),
             "eps": (v["eps"] > 0, "must be positive"), "weight_decay": (v["weight_decay"] >= 0, "must be >= 0"),
             "grad_clip_norm": (v["grad_clip_norm"] >= 0, "must be >= 0 (0: no clipping)")}
    for k, (ok, what) in rules.items():
        if not ok:
            raise ValueError(f"adam_params.{k} {what}, got {v[k]!r}")
    return {"lr": float(v["learning_rate"]), "betas": (float(v["beta1"]), float(v["beta2"])), "eps": float(v["eps"]),
            "weight_decay": float(v["weight_decay"]), "grad_clip_norm": float(v["grad_clip_norm"])}


TINKER_LORA_TARGETS = {"train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                       "train_mlp": ("gate_proj", "up_proj", "down_proj"),
                       "train_unembed": ("lm_head",)}
"""The modules each switch of Tinker's `LoraConfig` adds LoRA to (Llama-style names)."""
TINKER_LORA_ALPHA = 32.0
"""The LoRA alpha of adapters made from a Tinker `LoraConfig`, which has no alpha field."""
TINKER_PASS_TOKENS = 1024
"""Padded tokens per forward pass of a Tinker adapter's `forward_backward` (`micro_batch_tokens`):
a client sends a whole step's datums in one call. SmolLM2 on a 2-core CPU, 64 datums of 38-50
tokens (a math_rl step): one pass held 8.0 GB at its peak and took 22 s; passes of 1024 tokens
3.4 GB and 16.5 s (512: 2.3 GB, 15.2 s; 2048: 5.4 GB, 15.4 s). The loss is a sum over tokens,
so the passes do not change the gradient beyond float rounding."""


def tinker_lora_settings(lora_config: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
    """Tinker's `LoraConfig` {rank, seed, train_mlp, train_attn, train_unembed} (the SDK's
    defaults for missing switches: all True) as `LearnerConfig` fields (mode 'lora', rank, alpha,
    targets, and `TINKER_PASS_TOKENS` as its pass size) and the adapter's init seed (None: the
    client gave none). `ValueError` naming `lora_config.<field>`.

    >>> tinker_lora_settings({"rank": 4, "seed": 7, "train_mlp": False})
    ({'mode': 'lora', 'lora_rank': 4, 'lora_alpha': 32.0, 'lora_targets': ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'lm_head'), 'micro_batch_tokens': 1024}, 7)
    """
    known = ("rank", "seed", *TINKER_LORA_TARGETS)
    unknown = sorted(set(lora_config) - set(known))
    if unknown:
        raise ValueError(f"lora_config.{unknown[0]} is not a LoraConfig field; fields: {', '.join(known)}")
    rank, seed = lora_config.get("rank"), lora_config.get("seed")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_config.rank must be an integer >= 1, got {rank!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"lora_config.seed must be an integer or null, got {seed!r}")
    switches = {k: lora_config.get(k, True) for k in TINKER_LORA_TARGETS}
    for k, v in switches.items():
        if not isinstance(v, bool):
            raise ValueError(f"lora_config.{k} must be true or false, got {v!r}")
    if not any(switches.values()):
        raise ValueError("lora_config: train_attn, train_mlp and train_unembed are all false; an adapter needs "
                         "at least one of them")
    targets = tuple(t for k in ("train_attn", "train_mlp", "train_unembed") if switches[k]
                    for t in TINKER_LORA_TARGETS[k])
    return {"mode": "lora", "lora_rank": rank, "lora_alpha": TINKER_LORA_ALPHA, "lora_targets": targets,
            "micro_batch_tokens": TINKER_PASS_TOKENS}, seed
