"""An algorithm added from outside the package: a plain loss function and one registry call,
then `train(cfg)` selects it by name. Nothing in `tinker_pipelines/` knows about it."""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file

from tinker_pipelines.algorithms import Algorithm, LossBatch, LossConfig, masked_mean, register_algorithm
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.loops.train import train

CALLS: list[int] = []


def sign_reinforce_loss(logprobs_BT: torch.Tensor, batch: LossBatch,
                        cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE on the sign of the advantage only: raise the likelihood of better-than-average
    replies and lower it for worse ones, each by the same amount."""
    CALLS.append(logprobs_BT.shape[0])
    sign_BT = batch.advantages_BT.sign()
    loss = -masked_mean(sign_BT * logprobs_BT, batch.weights_BT, cfg.normalization)
    return loss, {"sign_reinforce/positive_fraction": masked_mean((sign_BT > 0).float(), batch.weights_BT).item()}


register_algorithm(Algorithm("sign_reinforce", sign_reinforce_loss, advantages="group_centered", min_group_size=2))


def test_registered_loss_trains_through_the_config(tmp_path):
    cfg = config_from_dict({
        "seed": 0,
        "output_dir": str(tmp_path / "run"),
        "model": {"name": "tiny", "dtype": "float32"},  # the numbers below were measured in fp32
        # A short SFT warm start makes the tiny model answer, right or wrong, so groups have mixed
        # rewards and every iteration takes an optimizer step.
        "env": {"path": "arithmetic", "kwargs": {"max_operand": 3}},
        "sft": {"steps": 30, "batch_size": 16, "examples": 64, "learning_rate": 3e-3},
        "algorithm": {"name": "sign_reinforce", "normalization": "token"},
        "training": {"mode": "lora", "iterations": 2, "learning_rate": 1e-2, "groups_per_batch": 4,
                     "group_size": 4, "max_new_tokens": 6},
        "eval": {"every": 2, "num_tasks": 4},
    })
    CALLS.clear()
    history = train(cfg)

    stepped = [m for m in history if m["informative_groups"] > 0]
    assert len(history) == 2 and stepped and len(CALLS) == len(stepped), "the learner must call the registered loss"
    for m in stepped:
        assert 0.0 < m["sign_reinforce/positive_fraction"] < 1.0  # our metric reaches the iteration's metrics
        assert all(math.isfinite(v) for v in m.values())
    # LoRA's B matrices start at zero: non-zero ones after training mean the parameters moved.
    adapter = load_file(str(tmp_path / "run" / "checkpoints" / "iter_00001" / "adapter_model.safetensors"))
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)
