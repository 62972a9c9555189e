"""The `adapter_loads` check on real checkpoints of a tiny experiment (LoRA and full)."""

from __future__ import annotations

import torch
from dagster_env import NO_SFT

from assets.checks import adapter_loads
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.train import Experiment


def _experiment(mode: str) -> Experiment:
    cfg = config_from_dict({**NO_SFT, "training": {**NO_SFT["training"], "mode": mode}})
    exp = Experiment(cfg)
    exp.start_rl()
    return exp


def test_lora_checkpoint_passes_then_fails_when_it_differs_or_is_corrupt(tmp_path):
    exp = _experiment("lora")
    exp.save(tmp_path / "a")
    ok = adapter_loads(exp, tmp_path / "a")
    assert ok.passed and ok.metadata["tensors_loaded"].value > 0
    assert ok.metadata["tensors_differing_from_resident"].value == 0
    with torch.no_grad():  # the resident policy moves on: the written files no longer match it
        next(p for n, p in exp.policy.named_parameters() if "lora_B" in n).add_(1.0)
    moved = adapter_loads(exp, tmp_path / "a")
    assert not moved.passed and moved.metadata["tensors_differing_from_resident"].value == 1
    exp.save(tmp_path / "b")
    f = tmp_path / "b" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    corrupt = adapter_loads(exp, tmp_path / "b")
    assert not corrupt.passed and "content hash" in corrupt.metadata["error"].value


def test_full_checkpoint_passes(tmp_path):
    exp = _experiment("full")
    exp.save(tmp_path / "c")
    result = adapter_loads(exp, tmp_path / "c")
    assert result.passed, result.metadata
    assert result.metadata["finite_logits"].value
