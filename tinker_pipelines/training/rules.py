"""The rules a learner's settings obey, stated once.

`LearnerConfig` checks them when it is built (a learner is never made from bad settings) and
`Config.validate` checks the same fields of an experiment's config before any model loads, with
the same messages, each naming the config field (`training.learning_rate`, ...). Sampling
truncation (top-k, top-p, min-p) has its own home, `rollout.truncation.check_params`, which
both the sampler and these rules call.
"""

from __future__ import annotations

import math

from tinker_pipelines.rollout.truncation import check_params


def check_learner_settings(*, mode: str, learning_rate: float, lora_rank: int, lora_alpha: float,
                           micro_batch_size: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
                           min_p: float = 0.0, value_learning_rate: float = 0.0) -> None:
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
    # logprobs are divided by it: 0 (greedy) has no logprobs to train on
    require(temperature > 0 and math.isfinite(temperature), "training.temperature", "must be positive",
            temperature)
    require(value_learning_rate >= 0 and math.isfinite(value_learning_rate), "algorithm.value_learning_rate",
            "must be >= 0", value_learning_rate)
    check_params(top_k, top_p, min_p, prefix="training.")
